"""transformers' continuous batching (``model.generate_batch``): requests packed side by side into one paged cache,
each step a single row of several requests' tokens, through neofix's model forward.  It must give vanilla's tokens
and the full-recompute reference's, and add no warning.

GPT-Neo has no paged attention (its attention takes no attention interface: vanilla fails every request), so Llama
runs it.  Measured on this machine's CPU: it runs in vanilla on 5.25; on 4.57 (its generation loop fails) and 5.10
(its memory estimate needs psutil) vanilla fails too, so the test runs from 5.25.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GenerationConfig

try:  # 5.x: the paged cache's size (by default the free memory's share, seconds of allocation on a CPU)
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
except ImportError:
    ContinuousBatchingConfig = None

import neofix
from neofix.testing import reference_greedy, tiny_model

from ._versions import TF_RELEASE
from .loops import patched_and_vanilla

PROMPTS = [[5, 17, 33], [9, 4, 61, 22, 8, 13, 70, 41, 2, 19, 55], [44], [3, 88, 12, 7, 30, 61, 25]]
NEW = 8

pytestmark = pytest.mark.skipif(
    TF_RELEASE < (5, 25), reason="continuous batching runs in vanilla transformers on a CPU from 5.25 (see above)"
)


#: room for every request at once: 16 blocks of 32 tokens, 64 tokens per step
SMALL = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=64) if ContinuousBatchingConfig else None


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=0, dtype=torch.float32)


def batched(model, attention):
    """Each request's new tokens (in the order given), or the errors the requests ended with; and neofix's
    warnings."""
    model.set_attn_implementation(attention)
    config = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        results = model.generate_batch(PROMPTS, generation_config=config, continuous_batching_config=SMALL)
    ordered = sorted(results.values(), key=lambda result: PROMPTS.index(list(result.prompt_ids)))
    errors = [result.error for result in ordered if result.error is not None]
    told = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    return errors or [list(result.generated_tokens) for result in ordered], told


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_continuous_batching_gives_vanilla_and_reference_tokens(llama, attention):
    (patched, patched_told), (plain, _) = patched_and_vanilla(lambda: batched(llama, attention))
    assert patched_told == []
    assert patched == plain
    for prompt, tokens in zip(PROMPTS, patched):
        expected = reference_greedy(llama, torch.tensor([prompt]), max_new_tokens=NEW)[0, len(prompt):]
        assert tokens == expected.tolist(), prompt
