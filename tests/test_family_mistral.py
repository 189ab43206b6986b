"""Mistral (transformers 4.34 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny random
Mistral: Llama's shape with a sliding window of 4 (``sliding_window``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("mistral", "4.34")


@pytest.fixture(scope="module")
def family():
    return "mistral"
