"""Cohere (transformers 4.40 and later): the modern decoders' scenarios
(:mod:`tests._modern_family`) on a tiny random Cohere (``neofix.testing.FAMILY_CONFIGS["cohere"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("cohere", "4.40")


@pytest.fixture(scope="module")
def family():
    return "cohere"
