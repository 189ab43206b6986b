"""flash-attention-2 ignores GPT-Neo's local window: neofix refuses the steps that would come out wrong.

Flash attention itself needs a GPU; neofix's check runs before it, so it is tested here on the attention module
directly (on the CPU the original forward fails later, for want of flash-attn, which these tests tell apart).
"""

from __future__ import annotations

import pytest
import torch

import neofix
from neofix import _caches
from neofix._families import gpt_neo
from neofix.testing import tiny_gpt_neo_config

from ._versions import has, requires


def attention(kind="local", **overrides):
    from transformers.models.gpt_neo import modeling_gpt_neo

    config = tiny_gpt_neo_config(**overrides)
    try:
        return modeling_gpt_neo.GPTNeoFlashAttention2(config, kind, 1)
    except TypeError:  # transformers 4.36 - 4.44 take no layer_id
        return modeling_gpt_neo.GPTNeoFlashAttention2(config, kind)


def layer_cache(held, layers=2):
    pairs = tuple((torch.zeros(1, 4, held, 8), torch.zeros(1, 4, held, 8)) for _ in range(layers))
    if has("Cache objects") and not gpt_neo.ATTENTION_GETS_LAYER_PAIRS:
        return _caches.from_legacy(pairs, tiny_gpt_neo_config())
    return pairs[1]


def run(module, held, new=1):
    hidden = torch.zeros(1, new, 32)
    return module(hidden, layer_past=layer_cache(held) if held else None)


pytestmark = requires("flash-attention-2 class")


def test_a_step_past_the_window_is_refused():
    with pytest.raises(neofix.AttentionWindowError, match=r"attends over 6 tokens \(the cache holds 5\).*last 4"):
        run(attention(), held=5)


def test_a_prefill_past_the_window_is_refused():
    with pytest.raises(neofix.AttentionWindowError, match="attn_implementation='eager'"):
        run(attention("global"), held=0, new=5)  # a global layer of a model that has local ones: refused at once


@pytest.mark.parametrize("held, new", [(0, 4), (3, 1)])
def test_steps_within_the_window_reach_flash_attention(held, new):
    with pytest.raises(Exception) as raised:  # no flash-attn on this machine: whatever it raises, not neofix
        run(attention(), held=held, new=new)
    assert not isinstance(raised.value, neofix.NeofixError)


def test_models_without_local_layers_are_left_alone():
    module = attention("global", attention_types=[[["global"], 4]])
    with pytest.raises(Exception) as raised:
        run(module, held=5)
    assert not isinstance(raised.value, neofix.NeofixError)


def test_unpatched_flash_attention_has_no_check(vanilla):
    with pytest.raises(Exception) as raised:
        run(attention(), held=5)
    assert not isinstance(raised.value, neofix.NeofixError)
