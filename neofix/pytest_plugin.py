"""pytest plugin (entry point ``pytest11: neofix``): fixtures for guarding your own GPT-Neo decoding in CI.

Loaded automatically when neofix is installed; disable with ``pytest -p no:neofix``.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest


@pytest.fixture
def gpt_neo_tiny() -> Callable[..., Any]:
    """Factory ``gpt_neo_tiny(seed=0, dtype=torch.float32, **config_overrides)``: an eval-mode tiny random
    ``GPTNeoForCausalLM`` with global and local layers, built from a config (no download)."""
    from .testing import tiny_gpt_neo

    return tiny_gpt_neo
