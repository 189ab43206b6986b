"""GPT-OSS (transformers 4.55 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny
random GPT-OSS (``neofix.testing.FAMILY_CONFIGS["gpt_oss"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("gpt_oss", "4.55")


@pytest.fixture(scope="module")
def family():
    return "gpt_oss"
