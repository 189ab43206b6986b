"""OLMo2 (transformers 4.48 and later; it arrived in 4.47): the modern decoders' scenarios
(:mod:`tests._modern_family`) on a tiny random OLMo2 (``neofix.testing.FAMILY_CONFIGS["olmo2"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("olmo2", "4.47")


@pytest.fixture(scope="module")
def family():
    return "olmo2"
