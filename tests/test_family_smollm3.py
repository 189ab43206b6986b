"""SmolLM3 (transformers 4.53 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny
random SmolLM3 (``neofix.testing.FAMILY_CONFIGS["smollm3"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("smollm3", "4.53")


@pytest.fixture(scope="module")
def family():
    return "smollm3"
