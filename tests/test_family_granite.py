"""Granite (transformers 4.45 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny
random Granite (``neofix.testing.FAMILY_CONFIGS["granite"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("granite", "4.45")


@pytest.fixture(scope="module")
def family():
    return "granite"
