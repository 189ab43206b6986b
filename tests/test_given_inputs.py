"""Positions and token types the caller gives: the shape rules of ``align`` (one row for every row, the dtypes refused,
positions of the cached plus new tokens, positions of a stale length, token types of the new or of every token); and
the other inputs' rules: token ids' dtypes, embeddings of no columns, masks of an ambiguous width, 4D masks, a masked
new token, a step past the position table.

Each outcome is compared with what the same call computes given the new tokens' values in the usual shape (or with
the full recompute), and with vanilla transformers where vanilla runs the call.  Float32 throughout: transformers 4.36
- 4.44 cannot run float64 GPT-Neo unpatched.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import neofix
from neofix import _compat
from neofix.testing import reference_logits, tiny_gpt_neo

from ._sync import HostReads, read_values_on
from ._versions import cache_keyword, output_cache
from .loops import left_padded_batch


@pytest.fixture(scope="module")
def model32():
    return tiny_gpt_neo(seed=0, dtype=torch.float32)


def ids_of(batch, width, seed=0):
    return torch.randint(1, 90, (batch, width), generator=torch.Generator().manual_seed(seed))


def forward(model, **kwargs):
    with torch.no_grad():
        return model(**kwargs)


def cached(model, ids, mask):
    """A fresh cache of the prompt (a forward grows the cache it is given: each call needs its own)."""
    return output_cache(forward(model, input_ids=ids, attention_mask=mask, use_cache=True))


def said(caught):
    return [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]


def run(model, **kwargs):
    """(logits, warnings said, the step's trace record)."""
    with neofix.trace(model) as steps, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = forward(model, **kwargs).logits
    assert len(steps) == 1
    return logits, said(caught), steps[0]


# -- one row of positions for every row ------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3])
def test_one_row_of_positions_given_as_1d_is_every_rows_positions(model32, batch):
    """1D position_ids of a prefill of 4 tokens (transformers broadcasts them over the batch): as the same positions
    given per row, and as vanilla computes them; the batch is neither 2 nor the number of columns."""
    ids = ids_of(batch, 4)
    mask = torch.ones_like(ids)
    flat, words, _ = run(model32, input_ids=ids, attention_mask=mask, position_ids=torch.arange(4))
    rows, _, _ = run(model32, input_ids=ids, attention_mask=mask, position_ids=torch.arange(4).expand(batch, 4))
    with neofix.unpatched():
        vanilla = forward(model32, input_ids=ids, attention_mask=mask, position_ids=torch.arange(4)).logits
    assert torch.equal(flat, rows)
    assert torch.equal(flat, vanilla)
    assert words == []


def test_one_row_of_positions_given_as_1d_on_a_decode_step(model32):
    ids = ids_of(3, 5)
    mask = torch.ones(3, 6, dtype=torch.long)
    step = {"input_ids": ids_of(3, 1, seed=1), "attention_mask": mask}
    keyword = cache_keyword(model32)
    flat, words, record = run(model32, **step, position_ids=torch.tensor([5]), **{keyword: cached(model32, ids, mask[:, :5])})
    rows, _, _ = run(model32, **step, position_ids=torch.tensor([[5]] * 3), **{keyword: cached(model32, ids, mask[:, :5])})
    assert torch.equal(flat, rows)
    expected = reference_logits(model32, torch.cat((ids, step["input_ids"]), 1), mask)[:, -1]
    assert torch.equal(flat[:, -1].argmax(-1), expected.argmax(-1))
    # float32 logits of about 200: a cached step and the full recompute round differently on some CPUs
    torch.testing.assert_close(flat[:, -1], expected, rtol=1e-4, atol=1e-3)
    assert (words, record.repairs) == ([], ())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.float16])
def test_positions_that_are_not_integers_are_refused(model32, dtype):
    ids = ids_of(2, 4)
    positions = torch.arange(4).expand(2, 4).to(dtype)
    with pytest.raises(neofix.PositionError) as raised:
        forward(model32, input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions)
    message = str(raised.value)
    assert f"position_ids has dtype {dtype}" in message
    assert "positions are integers" in message and "pass torch.long positions" in message


# -- positions of the cached plus new tokens, and of a stale length --------------------------------------------------


def test_positions_of_the_cached_and_new_tokens_are_sliced_silently(model32):
    """A decode step given the positions of all 6 tokens: the new token's are used, nothing is said, and the trace
    names the adjustment; positions that disagree with the mask there are still compared (and repaired)."""
    ids, mask = left_padded_batch([5, 3], vocab=90)
    full = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), 1)
    step = {"input_ids": ids_of(2, 1, seed=2), "attention_mask": full}
    keyword = cache_keyword(model32)
    right = (full.cumsum(-1) - 1).clamp(min=0)
    sliced, words, record = run(model32, **step, position_ids=right, **{keyword: cached(model32, ids, mask)})
    alone, _, _ = run(model32, **step, position_ids=right[:, -1:], **{keyword: cached(model32, ids, mask)})
    assert torch.equal(sliced, alone)
    assert words == []
    assert record.repairs == ("positions_sliced",)
    # arange over the padded row's columns (the loop forgot the padding): compared after the slice, and repaired
    counted = torch.arange(6).expand(2, 6)
    repaired, words, record = run(model32, **step, position_ids=counted, **{keyword: cached(model32, ids, mask)})
    assert torch.equal(repaired, alone)
    assert record.repairs == ("positions_sliced",)  # a decode step's value repair is reported from the device
    assert len(words) == 1 and "position_ids[1, 0] is 5" in words[0]


@pytest.mark.parametrize("with_mask", [True, False])
def test_positions_of_a_stale_length_are_derived_again_and_said(model32, with_mask):
    """Positions of the prompt's 5 columns given again at a decode step (a loop that forgot to update them): with a
    left-padded mask they are derived from it, without one they continue after the cache; said once, by name."""
    if with_mask:
        ids, mask = left_padded_batch([5, 3], vocab=90)
        full = torch.cat((mask, torch.ones(2, 1, dtype=torch.long)), 1)
    else:
        ids, mask, full = ids_of(2, 5), None, None
    stale = torch.arange(5).expand(2, 5)
    step = {"input_ids": ids_of(2, 1, seed=3), "attention_mask": full}
    keyword = cache_keyword(model32)
    logits, words, record = run(model32, **step, position_ids=stale, **{keyword: cached(model32, ids, mask)})
    truth = torch.tensor([[5], [3]]) if with_mask else torch.tensor([[5], [5]])
    expected, _, _ = run(model32, **step, position_ids=truth, **{keyword: cached(model32, ids, mask)})
    assert torch.equal(logits, expected)
    assert record.repairs == (("positions_rederived", "positions_derived") if with_mask else ("positions_rederived",))
    assert len(words) == 1
    instead = (
        "derived them from the attention mask instead"
        if with_mask
        else "gave them the positions after the cache instead, 5 to 5 (with no attention mask every token is real)"
    )
    assert words == [
        f"neofix: position_ids has 5 columns, but this step feeds 1 new token (the cache holds 5); {instead} (stale "
        f"prompt positions?). To fix your loop: pass only the new tokens' positions, or none at all and neofix derives "
        f"them from the mask. Reported once."
    ]


# -- token types -----------------------------------------------------------------------------------------------------


def test_token_types_of_the_new_tokens_are_used_as_given(model32):
    """GPT-Neo adds the token-type embedding (its token embedding) of ``token_type_ids``: a prefill and a decode step
    given them compute what vanilla computes, and types of every token at the step are sliced to the new token's."""
    ids = ids_of(2, 5)
    types = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])
    mask = torch.ones(2, 6, dtype=torch.long)
    prefill, words, _ = run(model32, input_ids=ids, attention_mask=mask[:, :5], token_type_ids=types)
    with neofix.unpatched():
        vanilla = forward(model32, input_ids=ids, attention_mask=mask[:, :5], token_type_ids=types).logits
    assert torch.equal(prefill, vanilla) and words == []
    keyword = cache_keyword(model32)
    step = {"input_ids": ids_of(2, 1, seed=4), "attention_mask": mask}
    new, words, record = run(model32, **step, token_type_ids=torch.tensor([[1], [0]]),
                             **{keyword: cached(model32, ids, mask[:, :5])})
    with neofix.unpatched():
        vanilla = forward(model32, **step, token_type_ids=torch.tensor([[1], [0]]),
                          **{keyword: cached(model32, ids, mask[:, :5])}).logits
    assert torch.equal(new, vanilla) and words == []
    assert record.repairs == ("positions_derived",)  # none given: the mask's (silent on a decode step)
    every = torch.cat((types, torch.tensor([[1], [0]])), 1)
    sliced, words, record = run(model32, **step, token_type_ids=every, **{keyword: cached(model32, ids, mask[:, :5])})
    assert torch.equal(sliced, new) and words == [] and record.repairs == ("token_type_ids_sliced", "positions_derived")


# -- the bounds of valid values --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_the_smallest_and_largest_valid_values_are_accepted_where_values_are_read(model32, path, monkeypatch):
    """Token id 0 and vocab_size - 1, token type 0 and vocab_size - 1, position 0 and max_position_embeddings - 1:
    valid, on the prefill and the decode step of a run that reads every value (``check_values=True``), on the CPU's
    reads and on the path accelerators take; the logits are vanilla's, and the step reads as often as one of values
    inside the bounds (a value at a bound taken for one outside would be searched for, one more read, and found
    valid)."""
    from neofix._core import _values

    read_values_on(monkeypatch, path == "cpu")
    neofix.configure(check_values=True)
    vocab, table = model32.config.vocab_size, model32.config.max_position_embeddings
    ids = torch.tensor([[0, 5, vocab - 1], [vocab - 1, 0, 7]])
    mask = torch.ones(2, 4, dtype=torch.long)
    prefills = [
        {},
        {"token_type_ids": torch.tensor([[0, vocab - 1, 3], [1, 0, vocab - 1]])},
        {"position_ids": torch.tensor([[0, 1, table - 1], [table - 1, 0, 1]])},  # packed documents: left as given
    ]
    inside = {"input_ids": ids.clamp(1, vocab - 2), "token_type_ids": 1, "position_ids": 1}
    for extra in prefills:
        with HostReads() as reads:
            patched, words, _ = run(model32, input_ids=ids, attention_mask=mask[:, :3], **extra)
        with neofix.unpatched():
            vanilla = forward(model32, input_ids=ids, attention_mask=mask[:, :3], **extra).logits
        assert torch.equal(patched, vanilla), extra
        assert words == [], (extra, words)
        within = {name: value.clamp(inside[name], bound - 2) for name, value in extra.items()
                  for bound in [table if name == "position_ids" else vocab]}
        with HostReads() as usual:
            run(model32, input_ids=inside["input_ids"], attention_mask=mask[:, :3], **within)
        assert len(reads.by_neofix) == len(usual.by_neofix), (extra, reads.by_neofix, usual.by_neofix)
    with HostReads() as reads:  # no mask: the token ids alone are read
        patched, words, _ = run(model32, input_ids=ids)
    with neofix.unpatched():
        vanilla = forward(model32, input_ids=ids).logits
    with HostReads() as usual:
        run(model32, input_ids=inside["input_ids"])
    assert torch.equal(patched, vanilla) and words == []
    assert len(reads.by_neofix) == len(usual.by_neofix), (reads.by_neofix, usual.by_neofix)
    keyword = cache_keyword(model32)
    step = {"attention_mask": mask, "position_ids": torch.tensor([[3], [3]])}
    at_bounds = {"input_ids": torch.tensor([[0], [vocab - 1]]), "token_type_ids": torch.tensor([[vocab - 1], [0]])}
    with HostReads() as reads:
        patched, words, _ = run(model32, **step, **at_bounds, **{keyword: cached(model32, ids, mask[:, :3])})
    with neofix.unpatched():
        vanilla = forward(model32, **step, **at_bounds, **{keyword: cached(model32, ids, mask[:, :3])}).logits
    assert torch.equal(patched, vanilla)
    assert words == []
    within = {name: value.clamp(1, vocab - 2) for name, value in at_bounds.items()}
    with HostReads() as usual:
        run(model32, **step, **within, **{keyword: cached(model32, ids, mask[:, :3])})
    assert len(reads.by_neofix) == len(usual.by_neofix), (reads.by_neofix, usual.by_neofix)


@pytest.mark.parametrize("past", [5, 0], ids=["decode step", "prompt"])
def test_a_cache_position_of_another_length_is_left_out_and_said(model32, past):
    """``cache_position`` of the cached plus new tokens at a decode step (transformers' own is the new tokens' slots),
    or of one token more than a prompt feeds: left out, so that the model computes it from the cache, and said;
    strict mode refuses it."""
    import inspect

    if "cache_position" not in inspect.signature(type(model32.transformer).forward).parameters:
        pytest.skip("GPT-Neo takes no cache_position on this release")
    ids = ids_of(2, 5)
    mask = torch.ones(2, 6, dtype=torch.long)
    keyword = cache_keyword(model32)
    new = 1 if past else 5
    step = {"input_ids": ids_of(2, new, seed=5), "attention_mask": mask[:, : past + new]}

    def cache():
        return {keyword: cached(model32, ids, mask[:, :past])} if past else {}

    given, words, record = run(model32, **step, cache_position=torch.arange(6), **cache())
    alone, _, _ = run(model32, **step, **cache())
    assert torch.equal(given, alone)
    fed = "1 new token" if past else "5 new tokens"
    assert words == [f"neofix: cache_position has 6 entries, but this step feeds {fed}; left it out. Reported once."]
    assert "cache_position_dropped" in record.repairs
    neofix.configure(mode="strict")
    with pytest.raises(neofix.PositionError, match=rf"cache_position has 6 entries, but this step feeds {fed}: "
                                                   r"pass cache_position for the new tokens only, or leave it out"):
        forward(model32, **step, cache_position=torch.arange(6), **cache())


@pytest.mark.parametrize("with_mask", [True, False])
def test_wrong_positions_read_at_a_cached_step_are_repaired_and_said(model32, with_mask):
    """With ``check_values=True`` a decode step's given positions are read and compared on the host: row 1's,
    one short of the truth, are repaired (with a mask, to the mask's; without one, to the positions after the
    cache), said by name, and named in the trace."""
    neofix.configure(check_values=True)
    ids = ids_of(2, 5)
    mask = torch.ones(2, 6, dtype=torch.long) if with_mask else None
    keyword = cache_keyword(model32)
    step = {"input_ids": ids_of(2, 1, seed=6), "attention_mask": mask}
    prompt_mask = None if mask is None else mask[:, :5]
    logits, words, record = run(model32, **step, position_ids=torch.tensor([[5], [4]]),
                                **{keyword: cached(model32, ids, prompt_mask)})
    right, _, _ = run(model32, **step, position_ids=torch.tensor([[5], [5]]), **{keyword: cached(model32, ids, prompt_mask)})
    assert torch.equal(logits, right)
    assert record.repairs == ("position_values_repaired",)
    truth = (
        "the attention mask puts that real token of row 1 at position 5"
        if with_mask
        else "with no attention mask every token is real, so that token is at position 5"
    )
    used = "used the mask's positions" if with_mask else "used positions continuing after the cache"
    assert words == [
        f"neofix: position_ids[1, 0] is 4 at the step after 5 cached tokens, but {truth} (arange over a left-padded "
        f"batch, or a loop that does not increment its positions?); {used}. To fix your loop: positions must advance "
        f"by one per real token: derive them from the attention mask ((mask.cumsum(-1) - 1).clamp(min=0)), or pass "
        f"none and neofix derives them. Reported once."
    ]


def test_a_forward_given_neither_ids_nor_embeddings_fails_as_vanilla(model32):
    """Nothing to align: transformers' own error, unchanged."""
    outcomes = []
    for context in (neofix.patched, neofix.unpatched):
        with context(), pytest.raises(ValueError) as raised:
            forward(model32, attention_mask=torch.ones(2, 3, dtype=torch.long))
        outcomes.append((type(raised.value), str(raised.value)))
    assert outcomes[0] == outcomes[1]
    assert not issubclass(outcomes[0][0], neofix.NeofixError)


@pytest.mark.parametrize("dtype", [torch.float32, torch.long])
def test_a_one_token_prompt_of_embeddings_with_a_one_column_mask_runs_as_vanilla(model32, dtype):
    """``inputs_embeds`` of one token and a mask of one column: the step's only value to read is whether a float
    mask is 0/1 (no ids, no padding steps in one column), read alone; the logits are vanilla's.  A value other than
    0 and 1 in that one column is refused by name (so the read took place)."""
    embeds = model32.transformer.wte(ids_of(2, 1)).detach()
    mask = torch.ones(2, 1, dtype=dtype)
    patched, words, record = run(model32, inputs_embeds=embeds, attention_mask=mask)
    with neofix.unpatched():
        plain = forward(model32, inputs_embeds=embeds, attention_mask=mask).logits
    assert torch.equal(patched, plain)
    assert (words, record.repairs) == ([], ())
    if dtype.is_floating_point:
        with pytest.raises(neofix.MaskValueError, match="attention_mask"):
            forward(model32, inputs_embeds=embeds, attention_mask=torch.tensor([[1.0], [0.5]]))


def test_the_words_for_a_wrong_position_name_the_cache_only_where_its_length_is_known():
    """A cache whose length cannot be told without reading the device (a static cache) gets no "after N cached
    tokens" in the words for a wrong position; a known length is named."""
    from neofix._core._values import describe_position

    assert describe_position(1, 0, 3, 5, None, "mask") == (
        "position_ids[1, 0] is 3, but the attention mask puts that real token of row 1 at position 5"
    )
    assert describe_position(0, 2, 9, 6, 4, "count") == (
        "position_ids[0, 2] is 9 at the step after 4 cached tokens, but with no attention mask every token is real, "
        "so that token is at position 6"
    )


# -- the other inputs' rules ---------------------------------------------------------------------------------------


def test_token_types_of_every_token_are_refused_in_strict_mode(model32):
    """Repair mode slices token types of the cached plus new tokens (above); strict mode refuses them, by name."""
    ids = ids_of(2, 7)
    mask = torch.ones(2, 7, dtype=torch.long)
    neofix.configure(mode="strict")
    with pytest.raises(neofix.InputShapeError) as raised:
        forward(model32, input_ids=ids[:, 4:], attention_mask=mask, token_type_ids=torch.zeros_like(ids),
                **{cache_keyword(model32): cached(model32, ids[:, :4], mask[:, :4])})
    assert str(raised.value) == (
        "token_type_ids has 7 columns, but this step feeds 3 new tokens: pass the new tokens' types only"
    )


@pytest.mark.parametrize("as_embeddings", [False, True], ids=["input_ids", "inputs_embeds"])
def test_a_chunk_without_a_mask_given_stale_positions_continues_after_the_cache(model32, as_embeddings):
    """Three new tokens after a 4-token cache, no mask, and positions of 5 columns (a stale prompt's): every token is
    real, so the new ones get positions 4 to 6, said once; the logits are the full recompute's.  The same given the
    tokens' embeddings."""
    ids = ids_of(2, 7)
    new = {"inputs_embeds": model32.transformer.wte(ids[:, 4:]).detach()} if as_embeddings else {"input_ids": ids[:, 4:]}
    cache = output_cache(forward(model32, input_ids=ids[:, :4], use_cache=True))
    logits, words, record = run(model32, **new, position_ids=torch.arange(5)[None], **{cache_keyword(model32): cache})
    expected = reference_logits(model32, ids)[:, 4:]
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-3)
    assert (record.position_min, record.position_max) == (4, 6)
    assert words == [
        "neofix: position_ids has 5 columns, but this step feeds 3 new tokens (the cache holds 4); gave them the "
        "positions after the cache instead, 4 to 6 (with no attention mask every token is real) (stale prompt positions?). "
        "To fix your loop: pass only the new tokens' positions, or none at all and neofix derives them from the mask. "
        "Reported once."
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.bool])
def test_token_ids_that_are_not_integers_are_refused(model32, dtype):
    with pytest.raises(neofix.TokenIdError) as raised:
        forward(model32, input_ids=ids_of(2, 3).to(dtype))
    assert str(raised.value) == (
        f"input_ids has dtype {dtype}, but token ids are integers (indices into the vocabulary): pass the tokenizer's "
        f"input_ids (torch.long)"
    )


def test_embeddings_of_no_tokens_are_refused_by_name(model32):
    with pytest.raises(neofix.InputShapeError) as raised:
        forward(model32, inputs_embeds=torch.zeros(2, 0, model32.config.hidden_size))
    assert str(raised.value) == (
        "this step feeds no new tokens (inputs_embeds has 0 columns, batch 2): every forward needs at least one token; "
        "stop the loop instead"
    )


@pytest.mark.parametrize("fit", [1, 0])
def test_a_step_past_the_position_table_says_how_many_tokens_still_fit(model32, fit):
    """A cache of 63 or 64 tokens in a table of 64, and a step of 2 (a chunk, on the general path: its mask is not
    long): the words count what still fits, 1 token or none."""
    past = 64 - fit
    cache = output_cache(forward(model32, input_ids=ids_of(1, past), use_cache=True))
    with pytest.raises(neofix.SequenceTooLongError) as raised:
        forward(model32, input_ids=ids_of(1, 2), attention_mask=torch.ones(1, past + 2, dtype=torch.bool),
                **{cache_keyword(model32): cache})
    fits = "1 more new token fits" if fit else "0 more new tokens fit"
    assert str(raised.value) == (
        f"this step would reach sequence length {past + 2} (the cache holds {past} tokens and the step feeds 2), but "
        f"config.max_position_embeddings is 64: {fits}; shorten the prompt or generate fewer tokens"
    )


@pytest.mark.parametrize("columns", [3, 5])
def test_a_mask_of_an_ambiguous_width_is_refused_with_the_fix(model32, columns):
    """After 4 cached tokens, a 3-token step's mask of 3 columns (its own? or the first 3 cached tokens'?) or of 5
    (the cache's and some of the new tokens'), with a pad: extended on its right or on its left it gives different
    masks, so nothing is guessed.  (All ones, both readings agree: tests/test_contract_regressions.py.)"""
    ids = ids_of(2, 7)
    cache = cached(model32, ids[:, :4], torch.ones(2, 4, dtype=torch.long))
    mask = torch.ones(2, columns, dtype=torch.long)
    mask[1, 0] = 0
    with pytest.raises(neofix.MaskLengthError) as raised:
        forward(model32, input_ids=ids[:, 4:], attention_mask=mask, **{cache_keyword(model32): cache})
    covers = (
        "as wide as this step's 3 new tokens, it may be their mask alone (a chunk's own mask), or the mask of the first "
        "3 cached tokens not extended since"
        if columns == 3
        else "it covers the 4 cached tokens and only some of the 3 new tokens"
    )
    assert str(raised.value) == (
        f"attention_mask has {columns} columns, but the cache holds 4 tokens and this step feeds 3: expected 7. It "
        f"cannot be told which tokens it covers: {covers}. Pass the mask of exactly the cached plus the new tokens "
        f"(torch.cat([mask_so_far, new_mask], -1))"
    )


@pytest.mark.parametrize("rows", [1, 3], ids=["one row for all", "a row each"])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_a_4d_mask_of_the_cached_and_new_tokens_runs_as_vanilla(rows, dtype):
    """The model's own 4D mask (one row per new token, a column per cached and new token) on a decode step of 3 rows,
    given for every row or once for all: neofix checks its shape and passes it on, so the outcome is vanilla's: the
    logits (and, a mask that hides nothing, the full recompute's) from 4.45, where every such mask runs; before,
    vanilla's own logits or error (4.26 and 4.40 read masks of their own conventions, 4.40 wants one row each)."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, attention_types=[[["global"], 4]])  # no window to mask
    ids = ids_of(3, 6)
    mask = torch.ones(rows, 1, 1, 6, dtype=torch.bool) if dtype == torch.bool else torch.zeros(rows, 1, 1, 6)
    outcomes = []
    for context in (neofix.patched, neofix.unpatched):
        with context():
            cache = output_cache(forward(model, input_ids=ids[:, :5], use_cache=True))
            try:
                outcomes.append(forward(model, input_ids=ids[:, 5:], attention_mask=mask,
                                        **{cache_keyword(model): cache}).logits)
            except (RuntimeError, ValueError) as exc:
                outcomes.append((type(exc), str(exc)))
    patched, plain = outcomes
    if isinstance(plain, torch.Tensor):
        assert torch.equal(patched, plain)
    else:
        assert patched == plain
    if _compat.release() >= (4, 45):  # (before, a float 4D mask is read as 0/1: zeros hide every token)
        assert isinstance(plain, torch.Tensor), plain
        torch.testing.assert_close(patched, reference_logits(model, ids)[:, -1:], rtol=1e-4, atol=1e-3)


def test_a_masked_new_token_keeps_the_position_transformers_gives_it(model32):
    """A decode step whose new token is masked in row 0 (a hand-written loop's finished row), no positions given:
    the masked token keeps transformers' position (the cache length), so row 0 computes exactly what it computes
    unpatched; row 1, left-padded, gets the mask's position."""
    ids, mask = left_padded_batch([5, 3])
    step = torch.cat((mask, torch.tensor([[0], [1]])), 1)
    new = ids_of(2, 1, seed=1)
    outcomes = []
    for context in (neofix.patched, neofix.unpatched):
        with context(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cache = output_cache(forward(model32, input_ids=ids, attention_mask=mask, use_cache=True))
            outcomes.append(forward(model32, input_ids=new, attention_mask=step, **{cache_keyword(model32): cache}))
    patched, plain = (outcome.logits for outcome in outcomes)
    assert torch.equal(patched[0], plain[0])
    expected = reference_logits(model32, torch.cat((ids, new), 1)[1:], step[1:])[:, -1]
    torch.testing.assert_close(patched[1:, -1], expected, rtol=1e-4, atol=1e-3)


def test_one_row_of_token_types_given_as_1d_is_every_rows(model32):
    """1D token_type_ids (transformers broadcasts them over the batch): a prefill computes vanilla's logits; at a
    cached step, types of every token so far are sliced to the new tokens', as 2D ones are."""
    ids = ids_of(2, 5)
    types = torch.tensor([0, 1, 0, 1, 1])
    patched, words, _ = run(model32, input_ids=ids, token_type_ids=types)
    with neofix.unpatched():
        plain = forward(model32, input_ids=ids, token_type_ids=types).logits
    assert torch.equal(patched, plain) and words == []
    mask = torch.ones(2, 5, dtype=torch.long)
    keyword = cache_keyword(model32)
    sliced, words, record = run(model32, input_ids=ids[:, 3:], attention_mask=mask, token_type_ids=types,
                                **{keyword: cached(model32, ids[:, :3], mask[:, :3])})
    new_only, _, _ = run(model32, input_ids=ids[:, 3:], attention_mask=mask, token_type_ids=types[3:],
                         **{keyword: cached(model32, ids[:, :3], mask[:, :3])})
    assert torch.equal(sliced, new_only)
    assert (words, record.repairs) == ([], ("token_type_ids_sliced",))
