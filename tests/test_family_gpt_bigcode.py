"""GPT-BigCode (StarCoder, SantaCoder; transformers 4.28 and later, patched from 4.30): what its own cache layouts and
attention add to the family scenarios of ``tests/test_families.py``, which run its multi-query tiny model.

Up to 4.53 its cache is one tensor per layer fusing keys and values (``(batch, tokens, 2 * head_dim)`` with multi-query
attention, ``(batch, heads, tokens, 2 * head_dim)`` without), read by ``neofix._families.gpt_bigcode.read_fused``;
from 4.54 a ``Cache`` object of the usual layout (one key-value head with multi-query attention).  Every scenario is
compared token for token with the full-recompute reference, and with vanilla where vanilla is right."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch
import transformers

import neofix
from neofix._families import FAMILIES
from neofix.testing import reference_greedy, tiny_model

from ._versions import TF_RELEASE, cache_keyword, legacy, output_cache
from .loops import decode, left_padded_batch, left_padded_chunk_after_a_cache, patched_and_vanilla
from .test_families import NAMES, run

STEPS = 5

if "gpt_bigcode" not in NAMES:
    pytest.skip("NEOFIX_TEST_FAMILIES leaves GPT-BigCode out", allow_module_level=True)
if not hasattr(transformers, "GPTBigCodeConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no GPT-BigCode", allow_module_level=True)
if not FAMILIES["gpt_bigcode"].patched_here():
    pytest.skip(FAMILIES["gpt_bigcode"].targets[0].why, allow_module_level=True)


def adapter_module():
    importlib.import_module(FAMILIES["gpt_bigcode"].module)  # the import hook patches it
    return sys.modules[FAMILIES["gpt_bigcode"].adapter]


def model_of(multi_query, dtype=torch.float64, **overrides):
    return tiny_model("gpt_bigcode", seed=0, dtype=dtype, multi_query=multi_query, **overrides)


def reference(model, ids, mask, steps=STEPS):
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1]:]


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_the_cache_is_read_in_its_layout(multi_query):
    """The cache a prefill returns, read by the adapter: its tokens, rows and key layout (one key-value head of width 8
    with multi-query attention, 4 of width 8 without), on every release: the fused tensors up to 4.53, the cache
    object (4.57: an ``EncoderDecoderCache``) or the tuples of pairs (4.54 - 4.56) after."""
    module = adapter_module()
    model = model_of(multi_query)
    ids, mask = left_padded_batch([6, 3])
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))
    if module.FUSED_CACHE:
        assert type(cache) is list and cache[0].shape == ((2, 6, 16) if multi_query else (2, 4, 6, 16))
    view = module.read_cache(cache, 2)
    assert (view.length, view.batch, view.layer_lengths) == (6, 2, (6, 6))
    assert (view.heads, view.head_dim) == (1 if multi_query else 4, 8)
    limits = module.ADAPTER.limits(model.config)
    assert (limits.heads, limits.head_dim, limits.max_positions) == (view.heads, view.head_dim, 64)


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
@pytest.mark.parametrize("cache_format", ["native", "legacy"])
def test_a_left_padded_loop_gives_the_reference(multi_query, cache_format):
    """A left-padded hand loop without positions, its mask extended at every step or the prompt's (stale), the cache as
    returned or as legacy tuples: the reference's tokens, with and without multi-query attention.  Vanilla's are the
    reference's only where its forward derives positions from the mask (up to 4.53) and the mask is extended."""
    model = model_of(multi_query)
    ids, mask = left_padded_batch([6, 3, 5])
    expected = reference(model, ids, mask)
    for mask_mode in ("synced", "stale"):
        (tokens, _), (plain, _) = patched_and_vanilla(
            lambda: run(lambda: decode(model, ids, mask, STEPS, mask_mode=mask_mode, cache_format=cache_format))
        )
        assert isinstance(tokens, torch.Tensor), (mask_mode, tokens)
        assert torch.equal(tokens, expected), mask_mode
        right = isinstance(plain, torch.Tensor) and torch.equal(plain, expected)
        assert right == (mask_mode == "synced" and TF_RELEASE < (4, 54)), (mask_mode, plain)


def test_a_left_padded_prompt_computes_vanillas_logits_where_the_model_derives_positions():
    """Up to 4.53 the forward derives missing positions from the mask itself (pads at 1): a left-padded prompt without
    positions computes vanilla's logits bit for bit, pads included, and nothing is said (``Positions.MASK``: left to
    the model).  From 4.54 vanilla's positions count the pads, and neofix derives the mask's (said once): the real
    tokens' logits are then those of each row alone."""
    model = model_of(True)
    ids, mask = left_padded_batch([6, 3])
    call = lambda: model(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    (logits, messages), (plain, _) = patched_and_vanilla(lambda: run(call))
    if TF_RELEASE < (4, 54):
        assert torch.equal(logits, plain)
        assert messages == []
        return
    assert not torch.equal(logits[1, 3:], plain[1, 3:])
    with torch.no_grad():
        alone = model(input_ids=ids[1:, 3:]).logits[0]
    torch.testing.assert_close(logits[1, 3:], alone)
    assert any("row 1 of this forward is left-padded and no position_ids were given" in m for m in messages), messages


def test_a_cache_of_the_other_attention_is_refused():
    """The cache of the same model without multi-query attention (4 key-value heads), given to one with it (1): refused
    before the model runs, naming both layouts; vanilla fails inside attention (or, up to 4.53, where its fused
    tensors happen to broadcast, computes garbage)."""
    model, other = model_of(True, torch.float32), model_of(False, torch.float32)
    ids = torch.ones(2, 4, dtype=torch.long)
    with torch.no_grad():
        cache = output_cache(other(input_ids=ids, use_cache=True))
    error, _ = run(lambda: model(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 5, dtype=torch.long),
                                 use_cache=True, **{cache_keyword(model): cache}))
    assert isinstance(error, neofix.InputShapeError), error
    assert str(error).startswith("the cache holds keys of 4 heads of width 8, but this model has 1 heads of width 8")


def test_pairs_on_a_fused_release_are_refused_naming_the_layouts():
    """Up to 4.53: a cache of ``(key, value)`` pairs (the layout of 4.54 and later), which the forward fails on
    (``'tuple' object has no attribute 'size'``), is refused naming both layouts; a ``Cache`` object likewise."""
    if not adapter_module().FUSED_CACHE:
        pytest.skip(f"transformers {transformers.__version__}: GPT-BigCode's cache is a Cache object of pairs")
    model = model_of(True, torch.float32)
    ids = torch.ones(2, 4, dtype=torch.long)
    with torch.no_grad():
        fused = output_cache(model(input_ids=ids, use_cache=True))
    pairs = tuple(tuple(layer.split(8, dim=-1)) for layer in fused)
    step = dict(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 5, dtype=torch.long), use_cache=True)
    error, _ = run(lambda: model(**step, past_key_values=pairs))
    assert isinstance(error, neofix.InputShapeError), error
    assert str(error).startswith("the cache holds a tuple per layer: the (key, value) pairs of transformers 4.54")
    with neofix.unpatched():
        plain, _ = run(lambda: model(**step, past_key_values=pairs))
    assert isinstance(plain, AttributeError), plain


@pytest.mark.parametrize("multi_query", [True, False], ids=["mqa", "mha"])
def test_a_left_padded_chunk_after_a_cache_gives_the_whole_forwards_logits(multi_query):
    """Three tokens after a cache of six, rows left-padded by four and five: every real token's logits are those of one
    forward over the whole sequence (sdpa, the default from 4.36).  On 4.36 - 4.38 transformers unmasks the rows of
    such a chunk as if it started the sequence: vanilla fails (``IndexError``, a row padded past the chunk) or
    computes wrong logits; neofix replaces that unmasking (``make_unmask_converter``)."""
    model = model_of(multi_query, torch.float32)
    whole, patched, plain = left_padded_chunk_after_a_cache(model)
    assert isinstance(patched, torch.Tensor), patched
    torch.testing.assert_close(patched, whole, rtol=1e-4, atol=1e-4)
    buggy = (4, 36) <= TF_RELEASE < (4, 39)
    assert isinstance(plain, IndexError) == buggy, plain


@pytest.mark.parametrize("handed", ["output", "cache"])
def test_decode_state_reorders_a_fused_cache(handed):
    """``DecodeState(..., model=model)`` over GPT-BigCode's own cache (fused up to 4.53: a list of tensors), handed
    the output or the cache itself: a loop that reverses the rows after its second step, then continues, decodes each
    row's reference tokens (reordered)."""
    model = model_of(True)
    ids, mask = left_padded_batch([6, 3, 5])
    state = neofix.DecodeState(ids, mask, model=model)
    with torch.no_grad():
        for step in range(STEPS):
            out = model(**state.model_inputs())
            state.advance(out.logits[:, -1].argmax(-1), out if handed == "output" else output_cache(out))
            if step == 1:
                state.reorder(torch.tensor([2, 1, 0]))
    if adapter_module().FUSED_CACHE:
        assert type(state.cache) is list and isinstance(state.cache[0], torch.Tensor)
    expected = reference(model, ids, mask)
    assert torch.equal(state.sequences[:, ids.shape[1]:], expected.flip(0))


def test_legacy_pairs_are_wrapped_where_the_release_rejects_them():
    """From 5.0 the forward fails on tuples of pairs (``'tuple' object has no attribute 'get_seq_length'``): repair mode
    wraps them in a ``DynamicCache``, said once, and the tokens are the reference's; 4.54 - 4.57 convert them."""
    if adapter_module().FUSED_CACHE:
        pytest.skip(f"transformers {transformers.__version__}: GPT-BigCode's cache is its own fused tensors")
    model = model_of(True)
    ids, mask = left_padded_batch([6, 3])
    tokens, messages = run(lambda: decode(model, ids, mask, STEPS, cache_format="legacy"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(model, ids, mask))
    wrapped = any("a legacy tuple cache was passed" in message for message in messages)
    assert wrapped == (TF_RELEASE >= (5, 0)), messages
    assert legacy(output_cache(model(input_ids=ids, use_cache=True)))[0][0].shape == (2, 1, 6, 8)
