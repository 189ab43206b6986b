"""Phi3 (transformers 4.41 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny random
Phi3 (``neofix.testing.FAMILY_CONFIGS["phi3"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("phi3", "4.41")


@pytest.fixture(scope="module")
def family():
    return "phi3"
