"""Falcon (transformers 4.33 and later, patched from 4.36): the modern decoders' scenarios (:mod:`tests._modern_family`)
on its tiny random model of the usual kind (rotary positions, multi-query attention, no position table), and what the
ALiBi kind (``alibi=True``: Falcon-RW) adds, where positions are ignored by the model and so left alone, as BLOOM's.

Every correctness check compares with the full-recompute reference token for token (float64, sharpened)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("falcon", "4.33")


@pytest.fixture(scope="module")
def family():
    return "falcon"
