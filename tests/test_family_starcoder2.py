"""Starcoder2 (transformers 4.40 and later; it arrived in 4.39): the modern decoders' scenarios
(:mod:`tests._modern_family`) on a tiny random Starcoder2 (``neofix.testing.FAMILY_CONFIGS["starcoder2"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("starcoder2", "4.39")


@pytest.fixture(scope="module")
def family():
    return "starcoder2"
