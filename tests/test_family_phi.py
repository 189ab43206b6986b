"""Phi (Phi-1, Phi-1.5, Phi-2; transformers 4.36 and later): the modern decoders' scenarios
(:mod:`tests._modern_family`) on a tiny random Phi (``neofix.testing.FAMILY_CONFIGS["phi"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("phi", "4.36")


@pytest.fixture(scope="module")
def family():
    return "phi"
