"""The core rules the modern decoders (issue 38) brought, on the core alone (CPU tensors, milliseconds): rotary
positions compared after a cache, ``cache_position``'s values, a 2D mask wider than a static cache, and 5.x's
per-layer-type mask dicts."""

from __future__ import annotations

import pytest
import torch

from neofix import CacheLengthError
from neofix._core import CacheView, Limits, Policy, Positions, StepInputs, align

LIMITS = Limits(max_positions=None, vocab_size=96, hidden_size=32, heads=2, head_dim=8)
ROTARY = Policy(positions=Positions.ROTARY)
MASK = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])  # three cached tokens and one new, rows left-padded


def _cache(past, batch=3):
    return CacheView(past, batch, (past, past), None, 2, 8, "object")


def _step(positions=None, mask=MASK, new=1, cache_position=None, batch=3):
    return StepInputs(torch.ones(batch, new, dtype=torch.long), None, mask, positions, None, cache_position)


# -- masks against a static cache; 5.x's mask dicts ------------------------------------------------------------------


def test_a_2d_mask_wider_than_a_static_cache_is_refused():
    static = CacheView(None, 3, None, 4, 2, 8, "static")
    mask = torch.ones(3, 5, dtype=torch.long)
    with pytest.raises(CacheLengthError, match="^attention_mask has 5 columns, but the cache is a static cache of 4"):
        align(_step(mask=mask), static, LIMITS, ROTARY)
    assert align(_step(mask=mask[:, :4]), static, LIMITS, ROTARY).attention_mask.shape == (3, 4)


def test_a_dict_of_prepared_masks_is_used_as_given():
    masks = {"full_attention": torch.zeros(3, 1, 1, 4), "sliding_attention": torch.zeros(3, 1, 1, 4)}
    aligned = align(_step(torch.tensor([[2], [0], [1]]), mask=masks), _cache(3), LIMITS, ROTARY)
    assert aligned.attention_mask is masks
    assert aligned.position_ids.tolist() == [[2], [0], [1]]  # no 2D mask: positions are not compared with one
