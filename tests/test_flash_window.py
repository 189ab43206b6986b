"""flash-attention-2 ignores GPT-Neo's local window: neofix refuses the steps that would come out wrong.

Flash attention itself needs a GPU; neofix's check runs before it, so it is tested here on the attention module
directly, with transformers' flash-attention forward replaced by a stub that records its calls (``flash``): a step
neofix lets through must reach that forward with exactly what the caller passed, a refused one must not reach it.
"""

from __future__ import annotations

import pytest
import torch

import neofix
from neofix.testing import tiny_gpt_neo_config

from ._versions import has, requires

pytestmark = requires("flash-attention-2 class")

LAYER = 1  # the attention modules below are layer 1 of the model: a local layer in the tiny config
RAN = "the flash-attention-2 forward ran"


@pytest.fixture
def flash():
    """transformers' ``GPTNeoFlashAttention2.forward`` replaced by a stub, with neofix patched over the stub.

    Yields the list of calls the stub received, as ``(module, args, kwargs)``.
    """
    from transformers.models.gpt_neo import modeling_gpt_neo

    owner = modeling_gpt_neo.GPTNeoFlashAttention2
    calls = []

    def stub(self, *args, **kwargs):
        calls.append((self, args, kwargs))
        return RAN

    with neofix.unpatched():  # leaving it patches transformers' own forward again
        original = vars(owner)["forward"]
        owner.forward = stub
        try:
            with neofix.patched():  # over the stub; leaving it removes that patch, the stub in place again
                assert owner.forward is not stub, "neofix no longer wraps GPTNeoFlashAttention2.forward"
                yield calls
        finally:
            owner.forward = original


def attention(kind="local", **overrides):
    from transformers.models.gpt_neo import modeling_gpt_neo

    config = tiny_gpt_neo_config(**overrides)
    try:
        return modeling_gpt_neo.GPTNeoFlashAttention2(config, kind, LAYER)
    except TypeError:  # transformers 4.36 - 4.44 take no layer_id
        return modeling_gpt_neo.GPTNeoFlashAttention2(config, kind)


def layer_cache(lengths):
    """What an attention layer receives as ``layer_past`` for a cache whose layers hold ``lengths`` tokens: its own
    ``(key, value)`` pair up to 4.44, the whole Cache object (read per layer) from 4.45."""
    pairs = [(torch.zeros(1, 4, n, 8), torch.zeros(1, 4, n, 8)) for n in lengths]
    if not has("attention layers get the whole cache"):
        return pairs[LAYER]
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache()
    for index, (key, value) in enumerate(pairs):
        cache.update(key, value, index)
    assert [cache.get_seq_length(i) for i in range(len(lengths))] == list(lengths)
    return cache


def run(module, held, new=1):
    """One step of ``new`` tokens on a cache whose layers all hold ``held`` tokens (or a list of lengths)."""
    hidden = torch.zeros(1, new, 32)
    lengths = held if isinstance(held, list) else [held] * 4
    past = layer_cache(lengths) if any(lengths) else None
    return module(hidden, layer_past=past), hidden, past


def assert_reached(calls, module, hidden, past):
    """The stubbed forward ran once, given the module, the hidden states and the cache exactly as passed."""
    assert len(calls) == 1, f"the flash-attention forward ran {len(calls)} times"
    self, args, kwargs = calls[0]
    assert self is module
    assert args == (hidden,) and args[0] is hidden
    assert set(kwargs) == {"layer_past"} and kwargs["layer_past"] is past


def test_a_step_past_the_window_is_refused(flash):
    with pytest.raises(neofix.AttentionWindowError, match=r"attends over 6 tokens \(the cache holds 5\).*last 4"):
        run(attention(), held=5)
    assert flash == []


def test_a_prefill_past_the_window_is_refused(flash):
    with pytest.raises(neofix.AttentionWindowError, match="attn_implementation='eager'"):
        run(attention("global"), held=0, new=5)  # a global layer of a model that has local ones: refused at once
    assert flash == []


@pytest.mark.parametrize("held, new", [(0, 4), (3, 1)])
def test_steps_within_the_window_reach_flash_attention(flash, held, new):
    module = attention()
    result, hidden, past = run(module, held=held, new=new)
    assert result == RAN
    assert_reached(flash, module, hidden, past)


def test_the_window_check_reads_this_layers_cache(flash):
    """A cache whose layers hold different lengths is read at the attention's own layer, not at layer 0."""
    module = attention()
    result, hidden, past = run(module, held=[5, 3, 5, 5])  # this layer: 3 + 1 tokens, within the window of 4
    assert result == RAN
    assert_reached(flash, module, hidden, past)
    with pytest.raises(neofix.AttentionWindowError, match=r"attends over 6 tokens \(the cache holds 5\)"):
        run(module, held=[2, 5, 2, 2])  # this layer: 5 + 1 tokens
    assert len(flash) == 1


def test_models_without_local_layers_are_left_alone(flash):
    module = attention("global", attention_types=[[["global"], 4]])
    result, hidden, past = run(module, held=5)
    assert result == RAN
    assert_reached(flash, module, hidden, past)


def test_unpatched_flash_attention_has_no_check(flash, vanilla):
    module = attention()
    result, hidden, past = run(module, held=5)
    assert result == RAN
    assert_reached(flash, module, hidden, past)
