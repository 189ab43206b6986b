"""Llama (transformers 4.28 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny random
Llama: rotary positions, grouped-query attention, no position table."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("llama", "4.28")


@pytest.fixture(scope="module")
def family():
    return "llama"
