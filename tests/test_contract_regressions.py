"""Regressions of issue 36 that the hand-inlined copies of the step contract let in (each failed before the contract
was written once), judged against vanilla transformers and the full-recompute reference, never a hard-coded result:

1. a 4D attention mask with the rows' correct ``position_ids``: the positions are the caller's, unchanged, and no
   2D-mask reading is made up for it; without ``position_ids`` a 4D mask stays exactly as vanilla; a 4D mask of the
   wrong key length is a ``MaskLengthError`` whose sentence reads right;
3. one reading, refused: a mask whose every reading gives the same mask (all ones, too short or too long) is
   extended or sliced as vanilla does, never refused; a mask with zeros that two readings place differently is
   still a clear ``MaskLengthError``;
6. a model grown after its first forward (blocks appended) is judged as it is: its cache's new layers are checked
   as a freshly built model of that structure checks them.

Item 2 (a chunk after a cache with pads among its new tokens) lives in tests/test_chunk_consistency.py.
"""

from __future__ import annotations

import copy
import os
import re
import warnings

import pytest
import torch
import transformers

import neofix
from neofix.testing import (
    FAMILY_CONFIGS,
    reference_greedy,
    reference_logits,
    reference_positions,
    tiny_gpt_neo,
    tiny_model,
)

from .test_families import run as outcome  # call() with every warning recorded: (result or error, warnings)
from .test_families import said
from ._versions import TF, TF_RELEASE, cache_keyword, output_cache
from .loops import decode, left_padded_batch


def selected(*names):
    """``names`` limited by ``NEOFIX_TEST_FAMILIES`` (comma-separated, or "all"), as tests/test_families.py reads it:
    GPT-Neo always runs; the other families where this release tests them."""
    chosen = os.environ.get("NEOFIX_TEST_FAMILIES", "all").strip()
    if not chosen or chosen == "all":
        return list(names)
    wanted = {name.strip() for name in chosen.split(",")} | {"gpt_neo"}
    return [name for name in names if name in wanted]


def available(family):
    if not hasattr(transformers, FAMILY_CONFIGS[family][0]):
        pytest.skip(f"transformers {TF} has no {FAMILY_CONFIGS[family][0]}")


# -- 1. 4D attention masks -------------------------------------------------------------------------------------------

#: transformers 4.45 - 5.x add a 4D mask to the attention scores as given (float-additive, one row per new token, one
#: column per cached plus new token); 4.26 - 4.35 flatten any mask to (batch, -1), and 4.36 - 4.44 read a 4D mask as
#: 0/1 and invert it (their own convention), so vanilla GPT-Neo cannot take the additive mask these tests pass.
additive_4d_masks = pytest.mark.skipif(
    TF_RELEASE < (4, 45),
    reason=f"GPT-Neo takes a float-additive 4D attention mask as given from transformers 4.45 (before, 4.26 - 4.35 "
    f"flatten it to 2D and 4.36 - 4.44 read it as 0/1); installed: transformers {TF}",
)


def additive_mask(mask2d, new, dtype=torch.float64):
    """The 4D mask transformers builds from a 2D padding mask for ``new`` tokens after ``mask2d.shape[1] - new``
    cached ones: (batch, 1, new, cached + new), 0 where a token is attended (causal, real), finfo.min where not."""
    batch, keys = mask2d.shape
    causal = torch.ones(new, keys, dtype=torch.bool).tril(diagonal=keys - new)
    allowed = causal[None, None] & mask2d.bool()[:, None, None, :]
    return torch.zeros(batch, 1, new, keys, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


class Positions:
    """The position ids that reach GPT-Neo's position embedding (``wpe``), per forward."""

    def __init__(self, model):
        self.seen = []
        self.handle = model.transformer.wpe.register_forward_hook(
            lambda _module, args, _out: self.seen.append(args[0].clone())
        )

    def __enter__(self):
        return self.seen

    def __exit__(self, *exc):
        self.handle.remove()


@torch.no_grad()
def loop_4d(model, ids, mask, steps, *, positions):
    """Greedy decoding by hand, every step passing the additive 4D mask of the cached plus new tokens (and, with
    ``positions``, the new tokens' mask-derived positions): (tokens, the positions given per step)."""
    keyword = cache_keyword(model)
    cache, new, full, generated, given = None, ids, mask, [], []
    for _ in range(steps):
        kwargs = {"input_ids": new, "attention_mask": additive_mask(full, new.shape[1], model.dtype), "use_cache": True}
        if positions:
            kwargs["position_ids"] = reference_positions(full)[:, -new.shape[1]:]
            given.append(kwargs["position_ids"])
        if cache is not None:
            kwargs[keyword] = cache
        out = model(**kwargs)
        cache = output_cache(out)
        new = out.logits[:, -1:].argmax(-1)
        generated.append(new)
        full = torch.cat([full, full.new_ones((full.shape[0], 1))], dim=-1)
    return torch.cat(generated, dim=-1), given


@additive_4d_masks
def test_a_4d_mask_with_correct_positions_decodes_the_reference_tokens(model):
    """Issue 36, item 1: a hand loop over a left-padded batch passing transformers' own additive 4D causal mask and the
    rows' correct ``position_ids``.  Vanilla produces the reference tokens; with neofix the positions reach the model
    unchanged at every step (a 4D mask gives no 2D padding mask to compare them with: nothing may be derived from one
    that was not given), no warning claims "with no attention mask every token is real", and the tokens are vanilla's
    and the full recompute's."""
    ids, mask = left_padded_batch([6, 3, 5])
    steps = 5
    with Positions(model) as reached:
        (tokens, given), words = outcome(lambda: loop_4d(model, ids, mask, steps, positions=True))
    assert not any("no attention mask" in word for word in words), words
    assert len(reached) == steps
    for step, (want, got) in enumerate(zip(given, reached)):
        assert torch.equal(got.expand_as(want), want), (
            f"step {step}: the caller gave position_ids {want.tolist()}, the model got {got.tolist()}"
        )
    with neofix.unpatched():
        plain, _ = loop_4d(model, ids, mask, steps, positions=True)
    reference = reference_greedy(model, ids, mask, steps)[:, ids.shape[1]:]
    assert torch.equal(plain, reference), "vanilla itself does not decode the reference tokens: the premise failed"
    assert torch.equal(tokens, reference), f"neofix: {tokens.tolist()}, vanilla and the reference: {reference.tolist()}"


@additive_4d_masks
def test_a_4d_mask_without_positions_stays_exactly_as_vanilla(model):
    """Issue 36, item 1: a 4D mask without ``position_ids`` on left-padded rows (a prefill, then a cached step) is left
    to transformers' own positions: the logits are vanilla's, bit for bit (no positions are derived from a 2D mask
    that was not given)."""
    ids, mask = left_padded_batch([6, 3, 5])

    def run():
        out = model(input_ids=ids, attention_mask=additive_mask(mask, ids.shape[1]), use_cache=True)
        full = torch.cat([mask, mask.new_ones((3, 1))], dim=-1)
        step = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=additive_mask(full, 1),
                     **{cache_keyword(model): output_cache(out)})
        return out.logits, step.logits

    (patched, words) = outcome(run)
    with neofix.unpatched():
        plain, _ = outcome(run)
    assert isinstance(plain, tuple), plain
    assert isinstance(patched, tuple), patched
    for name, got, want in zip(("prefill", "cached step"), patched, plain):
        assert torch.equal(got, want), f"{name}: neofix changed vanilla's logits (max diff {(got - want).abs().max()})"


def test_a_4d_mask_of_the_wrong_key_length_is_a_readable_mask_length_error(model):
    """Issue 36, item 1: a 4D mask with one key column too many on a decode step (cache of 5, one new token) is a
    ``MaskLengthError`` whose sentence names the shape given and what the step needs, "1 row" and "6 columns" (today
    it reads "... and 6: one column per cached plus new token (the cache holds 5) columns")."""
    ids = torch.randint(1, 90, (2, 6), generator=torch.Generator().manual_seed(3))
    cache = output_cache(model(input_ids=ids[:, :5], use_cache=True))
    wrong = torch.zeros(2, 1, 1, 7, dtype=model.dtype)
    with pytest.raises(neofix.MaskLengthError) as raised, torch.no_grad():
        model(input_ids=ids[:, 5:], attention_mask=wrong, **{cache_keyword(model): cache})
    message = str(raised.value)
    assert "(2, 1, 1, 7)" in message, message
    assert re.search(r"\b1 row\b", message), message
    assert re.search(r"\b6 (?:key )?columns\b", message), f"the number of columns the step needs is not said: {message}"
    assert ") columns" not in message, f"the sentence does not read: {message}"


# -- 3. one reading, refused -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", selected("gpt_neo", "gpt_neox"))
def test_a_one_token_prompt_whose_mask_is_never_extended(family):
    """Issue 36, item 3a: a BOS-only prompt decoded by hand with its one-column mask of ones passed at every step
    (``m == p == q == 1`` at the second step, then ``m == q == 1 < p``): every reading of an all-ones mask is the same
    mask, so it is extended, never refused; the tokens are the full recompute's (vanilla 4.45 computes this right)."""
    available(family)
    model = tiny_model(family, seed=0, dtype=torch.float64)
    ids, mask = torch.tensor([[model.config.bos_token_id]]), torch.ones(1, 1, dtype=torch.long)
    tokens, _ = outcome(lambda: decode(model, ids, mask, 4, mask_mode="stale"))
    assert isinstance(tokens, torch.Tensor), f"{type(tokens).__name__}: {tokens}"
    assert torch.equal(tokens, reference_greedy(model, ids, mask, 4)[:, 1:])


def test_an_all_ones_mask_as_wide_as_a_chunk_after_a_cache_is_extended(model):
    """Issue 36, item 3a: after a cache of 4 tokens, a chunk of 3 with a mask of 3 columns of ones (the chunk's own
    mask, or the first cached tokens' mask not extended: both readings give all ones) computes what the well-formed
    call (mask of 7 ones) computes, in repair mode."""
    ids = torch.randint(1, 90, (2, 7), generator=torch.Generator().manual_seed(5))
    keyword = cache_keyword(model)

    def chunk(width):
        cache = output_cache(model(input_ids=ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long),
                                   use_cache=True))
        return model(input_ids=ids[:, 4:], attention_mask=torch.ones(2, width, dtype=torch.long),
                     **{keyword: cache}).logits

    got, _ = outcome(lambda: chunk(3))
    want, _ = outcome(lambda: chunk(7))
    assert isinstance(got, torch.Tensor), f"{type(got).__name__}: {got}"
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
    torch.testing.assert_close(got, reference_logits(model, ids)[:, 4:], rtol=1e-6, atol=1e-6)


def longer_all_ones(model, case):
    """(the call with an all-ones mask longer than cache + input, the same call with the exact mask of ones)."""
    ids = torch.randint(1, 90, (2, 6), generator=torch.Generator().manual_seed(7))
    keyword = cache_keyword(model)
    if case == "prefill":  # no cache, 4 tokens, 7 columns of ones
        return (lambda: model(input_ids=ids[:, :4], attention_mask=torch.ones(2, 7, dtype=torch.long)).logits,
                lambda: model(input_ids=ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long)).logits)

    def step(width):  # a cache of 5, one new token, 9 columns of ones
        cache = output_cache(model(input_ids=ids[:, :5], use_cache=True))
        return model(input_ids=ids[:, 5:], attention_mask=torch.ones(2, width, dtype=torch.long),
                     **{keyword: cache}).logits

    return lambda: step(9), lambda: step(6)


@pytest.mark.parametrize("mode", ["repair", "strict"])
@pytest.mark.parametrize("case", ["prefill", "decode step"])
@pytest.mark.parametrize("family", selected("gpt_neo", "gpt_neox"))
def test_an_all_ones_mask_longer_than_cache_and_input_is_sliced_as_vanilla(family, case, mode):
    """Issue 36, item 3b: an all-ones mask longer than cache plus input (every reading gives the same mask: DESIGN.md
    says "sliced to p + q as vanilla does", in both modes) computes what the exact mask computes, and, where vanilla
    runs it (4.45 on), exactly vanilla's logits; GPT-NeoX's own transformers test passes such a mask.  (Up to 4.40
    vanilla raises a shape RuntimeError here: neofix slicing it is no change to anything vanilla completes.)"""
    available(family)
    model = tiny_model(family, seed=0, dtype=torch.float32)
    longer, exact = longer_all_ones(model, case)
    neofix.configure(mode=mode)
    got, _ = outcome(longer)
    want, _ = outcome(exact)
    with neofix.unpatched():
        plain, _ = outcome(longer)
    assert isinstance(want, torch.Tensor), want
    assert isinstance(got, torch.Tensor), f"{type(got).__name__}: {got}"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    if isinstance(plain, torch.Tensor):
        torch.testing.assert_close(got, plain, rtol=0, atol=0)
    else:
        assert TF_RELEASE < (4, 45), f"vanilla {TF} should run it: {type(plain).__name__}: {plain}"


AMBIGUOUS = {
    # no cache, 4 tokens, 7 columns with left padding: its first 4 columns (vanilla's slice) or its last 4?
    "longer left-padded mask, prefill": (0, 4, [[0, 0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], 7, 4),
    # a cache of 5, one new token, 9 columns with zeros: which 6 columns are the step's?
    "longer mask with zeros, decode step": (5, 1, [[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9], 9, 6),
    # a cache of 4, a chunk of 3, a mask of 3 columns with a zero: the chunk's own mask, or the first cached tokens'?
    "m == q after a cache, with zeros": (4, 3, [[0, 1, 1], [1, 1, 1]], 3, 7),
    # a cache of 1, one new token, a mask of 1 column, one row 0 (a pad BOS)
    "m == p == q == 1, a zero": (1, 1, [[0], [1]], 1, 2),
}


@pytest.mark.parametrize("mode", ["repair", "strict"])
@pytest.mark.parametrize("case", list(AMBIGUOUS))
def test_a_mask_with_zeros_that_two_readings_place_differently_is_still_refused(model, case, mode):
    """Issue 36, item 3c (passes before and after): where the readings of a mask differ (zeros that a longer mask's
    first or last columns, or a chunk's own or a stale mask, place on other tokens), neofix raises a
    ``MaskLengthError`` naming the columns given and the columns expected, before any compute."""
    past, new, rows, columns, expected = AMBIGUOUS[case]
    ids = torch.randint(1, 90, (2, past + new), generator=torch.Generator().manual_seed(9))
    kwargs = {"input_ids": ids[:, past:], "attention_mask": torch.tensor(rows)}
    if past:
        kwargs[cache_keyword(model)] = output_cache(model(input_ids=ids[:, :past], use_cache=True))
    neofix.configure(mode=mode)
    with pytest.raises(neofix.MaskLengthError) as raised, torch.no_grad():
        model(**kwargs)
    message = str(raised.value)
    assert f"attention_mask has {columns} column" in message, message
    assert f"expected {expected}" in message, message


# -- 6. a model grown after its first forward --------------------------------------------------------------------------

PROMPT = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])


def grown_model():
    """A 4-layer tiny GPT-Neo that ran a prefill and a chunk (neofix remembers its facts), then grew two blocks
    (config updated, weights made those of a freshly built 6-layer model)."""
    fresh = tiny_gpt_neo(seed=0, dtype=torch.float64, num_layers=6)
    model = tiny_gpt_neo(seed=0, dtype=torch.float64, num_layers=4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = output_cache(model(input_ids=PROMPT[:, :4], use_cache=True))
        cache = output_cache(model(input_ids=PROMPT[:, 4:6], attention_mask=torch.ones(1, 6, dtype=torch.long),
                                   **{cache_keyword(model): cache}))
        model(input_ids=PROMPT[:, 6:7], attention_mask=torch.ones(1, 7, dtype=torch.long),
              **{cache_keyword(model): cache})
    model.transformer.h.extend(copy.deepcopy(fresh.transformer.h[4:]))
    for name in ("num_layers", "attention_types", "attention_layers"):
        setattr(model.config, name, copy.deepcopy(getattr(fresh.config, name)))
    model.load_state_dict(fresh.state_dict())
    return model, fresh


def _crop_layer(cache, index):
    """``cache`` with layer ``index`` one token shorter (legacy tuples, key lists or layer objects)."""
    if isinstance(cache, tuple):
        return tuple((k[:, :, :-1], v[:, :, :-1]) if i == index else (k, v) for i, (k, v) in enumerate(cache))
    if hasattr(cache, "layers"):
        layer = cache.layers[index]
        layer.keys, layer.values = layer.keys[:, :, :-1], layer.values[:, :, :-1]
    else:
        cache.key_cache[index] = cache.key_cache[index][:, :, :-1]
        cache.value_cache[index] = cache.value_cache[index][:, :, :-1]
    return cache


def bad_cache(kind):
    """A cache of 5 tokens in the form this release returns: ``uneven``: 6 layers, the last one token shorter;
    ``too few``: the 4 layers of the model before it grew."""
    with torch.no_grad():
        if kind == "uneven":
            source = tiny_gpt_neo(seed=0, dtype=torch.float64, num_layers=6)
            return _crop_layer(output_cache(source(input_ids=PROMPT[:, :5], use_cache=True)), 5)
        source = tiny_gpt_neo(seed=0, dtype=torch.float64, num_layers=4)
        return output_cache(source(input_ids=PROMPT[:, :5], use_cache=True))


@pytest.mark.parametrize("new", [1, 3], ids=["decode step", "chunk of 3"])
@pytest.mark.parametrize("kind", ["uneven", "too few"])
def test_blocks_added_after_a_forward_are_judged_on_the_model_as_it_is(kind, new):
    """Issue 36, item 6: blocks appended to a model that already ran (neofix remembered 4 layers): a cached step whose
    cache's new layers disagree (layer 5 one token short, or only the old 4 layers) has exactly the outcome it has on
    a freshly built model of the same structure: a ``CacheLengthError`` naming the layer, not a bare torch error or a
    silent run (today the chunk's fast path checks only the old 4 layers)."""
    model, fresh = grown_model()
    call = dict(input_ids=PROMPT[:, 5:5 + new], attention_mask=torch.ones(1, 5 + new, dtype=torch.long))
    on_fresh, _ = outcome(lambda: fresh(**call, **{cache_keyword(fresh): bad_cache(kind)}))
    on_grown, _ = outcome(lambda: model(**call, **{cache_keyword(model): bad_cache(kind)}))
    layer = 5 if kind == "uneven" else 4
    assert isinstance(on_fresh, neofix.CacheLengthError), on_fresh
    assert f"cache layer {layer} holds" in str(on_fresh), on_fresh
    got = f"{type(on_grown).__name__}: {on_grown}" if isinstance(on_grown, Exception) else "it ran without an error"
    assert type(on_grown) is type(on_fresh) and str(on_grown) == str(on_fresh), f"the grown model: {got[:300]}"
