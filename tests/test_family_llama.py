"""Llama (transformers 4.28 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny random
Llama: rotary positions, grouped-query attention, no position table."""

from __future__ import annotations

import pytest
import torch

import neofix
from neofix.testing import tiny_model

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available
from ._versions import TF_RELEASE

skip_unless_available("llama", "4.28")


@pytest.fixture(scope="module")
def family():
    return "llama"


@pytest.mark.skipif(
    not (4, 38) <= TF_RELEASE < (4, 45),
    reason="Llama's attention reads a config head_dim from 4.45; generate's static cache arrived in 4.38",
)
def test_a_static_cache_of_a_config_head_dim_the_attention_ignores_is_named(family):
    """Up to 4.44 Llama's attention uses hidden_size / heads (8 here) and ignores a config ``head_dim`` (16), which
    the static cache ``generate`` builds reads: vanilla fails writing the cache (the widths differ); neofix refuses
    before any layer runs, and names the config's ``head_dim`` as the cause, not another model's cache."""
    model = tiny_model("llama", head_dim=16)
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    call = dict(input_ids=ids, attention_mask=(ids != 0).long(), max_new_tokens=2, do_sample=False,
                cache_implementation="static", pad_token_id=0)
    with neofix.unpatched(), pytest.raises(RuntimeError, match="shape mismatch|index_copy_"):
        model.generate(**call)
    with pytest.raises(neofix.InputShapeError) as raised:
        model.generate(**call)
    assert str(raised.value) == (
        "the cache holds keys of 2 heads of width 16, but this model has 2 heads of width 8: the cache was built from "
        "the config's head_dim of 16, which this model's attention does not use on this transformers release (it "
        "uses hidden_size // num_attention_heads). Leave head_dim out of the config or set it to 8"
    )
