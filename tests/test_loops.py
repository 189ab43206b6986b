"""Hand-written decoding loops, patched, against the full-recompute reference, token for token.

Each test also shows what vanilla transformers does with the same loop, so it proves neofix is what makes it pass.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import neofix
from neofix.testing import reference_greedy

from ._versions import requires
from .loops import decode, left_padded_batch

STEPS = 8


def reference(model, ids, mask, steps=STEPS):
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1]:]


def vanilla_outcome(model, *args, **kwargs):
    """What unpatched transformers does: the tokens it produces, or the exception it raises."""
    with neofix.unpatched():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return decode(model, *args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any failure is the vanilla behaviour we document
            return exc


def assert_vanilla_broken(outcome, expected):
    if isinstance(outcome, Exception):
        assert not isinstance(outcome, neofix.NeofixError)
        return
    assert not torch.equal(outcome, expected), "vanilla transformers already gets this loop right"


@pytest.mark.parametrize("positions", ["none", "correct"])
def test_synced_loop_matches_reference(model, positions):
    ids, mask = left_padded_batch([6, 3, 5])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = decode(model, ids, mask, STEPS, positions=positions)
    assert torch.equal(got, reference(model, ids, mask))
    said = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    if positions == "none":  # the prompt's positions differ from transformers' own: said once, nothing else
        assert len(said) == 1 and "row 1 of this forward is left-padded and no position_ids were given" in said[0]
    else:
        assert said == []  # nothing to repair, nothing said


def test_stale_mask_is_extended(model):
    ids, mask = left_padded_batch([6, 3, 5])
    expected = reference(model, ids, mask)
    with pytest.warns(neofix.NeofixWarning, match=r"attention_mask has 6 columns, .* expected 7"):
        got = decode(model, ids, mask, STEPS, mask_mode="stale", positions="correct")
    assert torch.equal(got, expected)
    assert_vanilla_broken(vanilla_outcome(model, ids, mask, STEPS, mask_mode="stale", positions="correct"), expected)


def test_stale_mask_unpadded_batch_of_one(model):
    """The report that started it all: batch 1, no padding, the prompt mask kept for every step."""
    ids, mask = left_padded_batch([5])
    expected = reference(model, ids, mask)
    with pytest.warns(neofix.NeofixWarning):
        assert torch.equal(decode(model, ids, mask, STEPS, mask_mode="stale"), expected)
    assert_vanilla_broken(vanilla_outcome(model, ids, mask, STEPS, mask_mode="stale"), expected)


def test_left_padded_loop_without_positions(model):
    ids, mask = left_padded_batch([6, 2, 4])
    expected = reference(model, ids, mask)
    assert torch.equal(decode(model, ids, mask, STEPS, positions="none"), expected)
    outcome = vanilla_outcome(model, ids, mask, STEPS, positions="none")
    assert_vanilla_broken(outcome, expected)
    # the unpadded row is right in vanilla too: only padded rows go wrong
    if not isinstance(outcome, Exception):
        assert torch.equal(outcome[0], expected[0])


def test_stale_prompt_positions_are_rederived(model):
    ids, mask = left_padded_batch([6, 3])
    expected = reference(model, ids, mask)
    with pytest.warns(neofix.NeofixWarning, match="position_ids has 6 columns"):
        got = decode(model, ids, mask, STEPS, positions="stale")
    assert torch.equal(got, expected)
    assert_vanilla_broken(vanilla_outcome(model, ids, mask, STEPS, positions="stale"), expected)


def test_full_length_positions_take_the_last_columns(model):
    ids, mask = left_padded_batch([6, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        got = decode(model, ids, mask, STEPS, positions="full")
    assert torch.equal(got, reference(model, ids, mask))


def test_no_mask_unpadded(model):
    ids, mask = left_padded_batch([5, 5])
    assert torch.equal(decode(model, ids, mask, STEPS, pass_mask=False), reference(model, ids, mask))


@pytest.mark.parametrize("chunks", [(3,), (2, 5), (1,)])
@pytest.mark.parametrize("mask_mode", ["synced"])
def test_chunked_prefill_left_padded(model, chunks, mask_mode):
    ids, mask = left_padded_batch([7, 3, 5], width=7)
    expected = reference(model, ids, mask)
    assert torch.equal(decode(model, ids, mask, STEPS, chunks=chunks, mask_mode=mask_mode), expected)


def test_chunked_prefill_with_full_positions(model):
    ids, mask = left_padded_batch([7, 3, 5], width=7)
    got = decode(model, ids, mask, STEPS, chunks=(4,), positions="full")
    assert torch.equal(got, reference(model, ids, mask))


@pytest.mark.parametrize("cache_format", ["legacy", pytest.param("object", marks=requires("Cache objects"))])
def test_cache_formats(model, cache_format):
    ids, mask = left_padded_batch([6, 3])
    expected = reference(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers 4.45 - 4.53 warn about tuples themselves
        got = decode(model, ids, mask, STEPS, cache_format=cache_format, mask_mode="stale")
    assert torch.equal(got, expected)


def test_inputs_embeds_prefill_then_ids(model):
    ids, mask = left_padded_batch([6, 3])
    from ._versions import cache_keyword, output_cache

    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        out = model(inputs_embeds=embeds, attention_mask=mask, use_cache=True)
        tokens = [out.logits[:, -1:].argmax(-1)]
        cache = output_cache(out)
        for _ in range(STEPS - 1):
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], -1)
            out = model(input_ids=tokens[-1], attention_mask=mask, use_cache=True, **{cache_keyword(): cache})
            cache = output_cache(out)
            tokens.append(out.logits[:, -1:].argmax(-1))
    ids, mask = left_padded_batch([6, 3])
    assert torch.equal(torch.cat(tokens, -1), reference(model, ids, mask))


@pytest.mark.parametrize("mask_mode", ["synced", "stale"])
def test_a_model_of_one_layer_decodes_as_the_reference(mask_mode):
    """A one-layer GPT-Neo (its cache holds a single layer): the loop's tokens are the full recompute's, with the mask
    kept in step and with the prompt's mask kept (extended by neofix, the cache read whole to tell its length)."""
    from neofix.testing import tiny_gpt_neo

    model = tiny_gpt_neo(seed=0, dtype=torch.float64, num_layers=1)
    ids, mask = left_padded_batch([6, 3, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = decode(model, ids, mask, STEPS, mask_mode=mask_mode, positions="correct")
    assert torch.equal(got, reference(model, ids, mask))
