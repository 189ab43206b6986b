"""Gemma2 (transformers 4.42 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny random
Gemma2 (``neofix.testing.FAMILY_CONFIGS["gemma2"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("gemma2", "4.42")


@pytest.fixture(scope="module")
def family():
    return "gemma2"
