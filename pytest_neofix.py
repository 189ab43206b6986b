"""pytest plugin of neofix (entry point ``pytest11: neofix``): guard your own decoding (any family neofix patches) in CI.

Loaded automatically when neofix is installed; disable with ``pytest -p no:neofix``.  It provides the
``gpt_neo_tiny`` and ``tiny_model`` fixtures; the assertions to use with it live in :mod:`neofix.testing`
(``assert_generation_consistent``, ``assert_steps_aligned``).

This module lives outside the ``neofix`` package on purpose: loading the plugin imports neither neofix nor torch
nor transformers, so a test session in which nothing asks for neofix runs every model exactly as it would without
neofix installed.  The fixtures import :mod:`neofix.testing` (and so patch the families) when a test first uses one.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest


@pytest.fixture
def gpt_neo_tiny() -> Callable[..., Any]:
    """Factory ``gpt_neo_tiny(seed=0, dtype=torch.float32, **config_overrides)``: an eval-mode tiny random
    ``GPTNeoForCausalLM`` with global and local layers, built from a config (no download).  The same seed and
    config give the same weights; the output layer is sharpened so that greedy decoding never sits on a near-tie.
    Using it imports neofix, so GPT-Neo is patched for the rest of the session, as in a program that imports it."""
    from neofix.testing import tiny_gpt_neo

    return tiny_gpt_neo


@pytest.fixture
def tiny_model() -> Callable[..., Any]:
    """Factory ``tiny_model(family="gpt_neo", seed=0, dtype=torch.float32, **config_overrides)``: an eval-mode tiny
    random causal LM of any family neofix patches (``neofix.FAMILIES``: "gpt_neo", "gpt2", "gptj", "codegen",
    "gpt_neox", "opt", "bloom", "gpt_bigcode", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
    "qwen3_moe", "gemma", "gemma2", "gemma3", "phi", "phi3", "granite", "smollm3", "gpt_oss", "starcoder2", "olmo2",
    "olmo", "cohere", "falcon"), built from a config (no download), its output layer sharpened. Using it imports
    neofix, as ``gpt_neo_tiny`` does."""
    from neofix.testing import tiny_model

    return tiny_model
