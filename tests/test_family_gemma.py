"""Gemma (transformers 4.38 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny random
Gemma (``neofix.testing.FAMILY_CONFIGS["gemma"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("gemma", "4.38")


@pytest.fixture(scope="module")
def family():
    return "gemma"
