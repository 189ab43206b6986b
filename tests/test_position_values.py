"""Positions of the right shape but the wrong value, right padding at the start of decoding, and compiled loops.

The two hand-written-loop bugs that pass every shape check: ``arange`` positions over a left-padded prompt (then the
sequence length at each step), and a loop that forgets to increment.  In repair mode both must give the reference
tokens (full recompute, positions from the mask) with a ``NeofixWarning`` naming the row, the step and the value; in
strict mode a ``PositionError`` at the first wrong step.  Deliberate positions where nothing is decoded (packed
documents restarting at 0, no padding) are left exactly as given.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import neofix
from neofix.testing import reference_greedy, reference_positions, tiny_gpt_neo, tiny_model

from ._sync import read_values_on
from ._versions import cache_keyword, has, output_cache
from .loops import decode, left_padded_batch

STEPS = 6


def reference(model, ids, mask, steps=STEPS):
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1]:]


def said(caught):
    return [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]


def vanilla_decode(model, *args, **kwargs):
    """The same loop on unpatched transformers, in float32 where 4.36 - 4.44 cannot run float64 GPT-Neo."""
    if has("float64 mask bug"):
        model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    with neofix.unpatched(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return decode(model, *args, **kwargs), model


def test_arange_over_a_left_padded_batch_is_repaired(model):
    """positions=arange(L) on the prompt, then [[cur_len]] on each step: the classic batched-generation bug."""
    ids, mask = left_padded_batch([6, 3, 5])
    expected = reference(model, ids, mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = decode(model, ids, mask, STEPS, positions="arange")
    assert torch.equal(got, expected)
    messages = said(caught)
    assert len(messages) == 2, messages  # one per kind: the prompt, then the decode steps; once each
    assert "position_ids count the left padding of rows 1, 2: the first real token of row 1 is at position 3" in messages[0]
    assert "position_ids[1, 0] is 6 at the step after 6 cached tokens" in messages[1]
    assert "puts that real token of row 1 at position 3" in messages[1]
    plain, vanilla_model = vanilla_decode(model, ids, mask, STEPS, positions="arange")
    assert not torch.equal(plain, reference(vanilla_model, ids, mask))  # vanilla: wrong tokens for the padded rows


def test_a_loop_that_does_not_increment_is_repaired(model):
    ids, mask = left_padded_batch([6, 3, 5])
    expected = reference(model, ids, mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = decode(model, ids, mask, STEPS, positions="frozen")
    assert torch.equal(got, expected)
    messages = said(caught)
    assert len(messages) == 1 and "position_ids[0, 0] is 5 at the step after 6 cached tokens" in messages[0], messages
    plain, vanilla_model = vanilla_decode(model, ids, mask, STEPS, positions="frozen")
    assert not torch.equal(plain, reference(vanilla_model, ids, mask))


@pytest.mark.parametrize("positions, at", [("arange", 0), ("frozen", 1)])
def test_strict_mode_raises_at_the_first_wrong_step(model, strict, positions, at):
    ids, mask = left_padded_batch([6, 3, 5])
    forwards = []
    handle = model.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(neofix.PositionError, match="positions must advance by one per real token"):
            decode(model, ids, mask, STEPS, positions=positions)
    finally:
        handle.remove()
    assert len(forwards) == at + 1


def test_positions_without_padding_are_left_as_given(model):
    """No cache, every token real, positions restarting per packed document: deliberate, and exactly vanilla's."""
    ids = torch.randint(1, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8]])
    model32 = tiny_gpt_neo(seed=0, dtype=torch.float32)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), position_ids=positions, use_cache=False)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        patched = model32(**kwargs).logits
        with neofix.unpatched():
            plain = model32(**kwargs).logits
    assert torch.equal(patched, plain)


def test_left_padded_custom_positions_are_left_as_given(model):
    """A left-padded row whose positions neither follow the mask nor count the padding has no second reading to
    repair towards (a custom scheme): left as given, without a word."""
    ids, mask = left_padded_batch([6, 3])
    positions = reference_positions(mask) + 2  # every real token two further on: not arange, not the mask's
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
    model32 = tiny_gpt_neo(seed=0, dtype=torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        patched = model32(**kwargs).logits
        with neofix.unpatched():
            plain = model32(**kwargs).logits
    assert torch.equal(patched, plain)


# -- right padding at the start of decoding -------------------------------------------------------------------------


def right_padded_loop(model, steps=3, chunk=1, positions=False, pads=2):
    """A prompt batch right-padded (as GPT-2 / GPT-Neo tokenizers pad by default), decoded by hand (``chunk``
    tokens per forward: more than one is a chunk after the cache, which takes the chunk path; ``positions``: the
    prompt comes with its positions, which takes the general path; ``pads``: row 1's pads, 1 or 2)."""
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 0] if pads == 1 else [21, 22, 23, 0, 0]])
    mask = (ids != 0).long()
    given = {"position_ids": reference_positions(mask)} if positions else {}
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **given)
        for _ in range(steps):
            mask = torch.cat([mask, mask.new_ones(2, chunk)], -1)
            out = model(
                input_ids=out.logits[:, -1:].argmax(-1).repeat(1, chunk), attention_mask=mask, use_cache=True,
                **{cache_keyword(): output_cache(out)},
            )
    return out


@pytest.mark.parametrize("chunk, positions, pads", [(1, False, 2), (2, False, 2), (1, True, 2), (1, False, 1), (1, True, 1)])
def test_right_padding_is_said_when_decoding_starts(model, chunk, positions, pads):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        right_padded_loop(model, chunk=chunk, positions=positions, pads=pads)
    messages = said(caught)
    assert len(messages) == 1, messages
    assert "decoding continues from a cache whose prompt had right padding in row 1" in messages[0]
    assert "tokenizer.padding_side = 'left'" in messages[0]


@pytest.mark.parametrize("chunk", [1, 2])
def test_right_padding_strict_raises_at_the_first_decode_step(model, strict, chunk):
    forwards = []
    handle = model.transformer.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        with pytest.raises(neofix.MaskValueError, match="right padding in row 1"):
            right_padded_loop(model, chunk=chunk)
    finally:
        handle.remove()
    assert len(forwards) == 2  # the prefill ran (a right-padded forward is fine on its own); decoding from it is not


def test_right_padding_without_decoding_is_not_said(model, strict):
    """Classification and training on right-padded batches never decode from the cache: nothing is said, even in
    strict mode (tests/test_never_break.py compares their outputs with vanilla's)."""
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        for _ in range(2):
            model(input_ids=ids, attention_mask=mask)  # use_cache defaults to True: a cache is returned, not used


# -- compiled loops -------------------------------------------------------------------------------------------------


@pytest.fixture
def compiled():
    torch._dynamo.reset()
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2)
    yield model, torch.compile(model, backend="eager")
    torch._dynamo.reset()


@pytest.mark.parametrize("mask_mode, positions", [("synced", "none"), ("stale", "none"), ("synced", "frozen")])
def test_a_compiled_loop_is_as_correct_as_an_eager_one(compiled, mask_mode, positions):
    """Under torch.compile neofix traces its shape logic into the graph: mask extension, positions from the mask,
    and the device-side repair of wrong position values.  Nothing is read or reported inside compiled code."""
    model, fast = compiled
    ids, mask = left_padded_batch([6, 3, 5])
    expected = reference(model, ids, mask)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = decode(fast, ids, mask, STEPS, mask_mode=mask_mode, positions=positions)
    assert torch.equal(got, expected)
    assert said(caught) == []  # inside compiled code repairs are made, not reported
    if mask_mode == "synced" and positions == "none":
        torch._dynamo.reset()
        with neofix.unpatched(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = decode(torch.compile(model, backend="eager"), ids, mask, STEPS)
        assert not torch.equal(plain, expected)  # vanilla compiled: the padded rows go wrong


# -- what the messages say (mutation testing found these words and kinds unchecked) ---------------------------------

FIX = (
    "positions must advance by one per real token: derive them from the attention mask "
    "((mask.cumsum(-1) - 1).clamp(min=0)), or pass none and neofix derives them. Reported once."
)


@pytest.mark.parametrize(
    "lengths, rows, pronoun", [([5, 3], "row 1", "its"), ([5, 3, 2], "rows 1, 2", "their")]
)
def test_counted_padding_is_named_per_row(model, lengths, rows, pronoun):
    """arange over a left-padded prefill: the warning names the rows and the first one's positions, and the trace
    records the repair's kind."""
    ids, mask = left_padded_batch(lengths)
    positions = torch.arange(ids.shape[1]).expand(len(lengths), -1)
    with warnings.catch_warnings(record=True) as caught, neofix.trace(model) as steps, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=ids, attention_mask=mask, position_ids=positions)
    assert said(caught) == [
        f"neofix: position_ids count the left padding of {rows}: the first real token of row 1 is at position 2, "
        f"but the attention mask puts it at 0 (arange over a left-padded batch: the classic batched-generation bug); "
        f"derived {pronoun} positions from the mask. To fix your code: {FIX}"
    ]
    assert [step.repairs for step in steps] == [("positions_count_padding",)]


def test_positions_counting_the_pads_of_a_gap_are_rederived_as_after_a_cache():
    """arange over a batch whose first row has a gap in its mask (pads between real tokens) and whose second is
    left-padded with a gap: without a cache both rows are re-derived from the mask (warned once, naming the first row
    and its first token after the gap), so the logits are those of the mask's positions, which a chunk after a cache
    of the same tokens, given the same positions, also gets; a right-padded row given its columns is left alone.
    (float32: vanilla 4.36 - 4.44 cannot run a float64 GPT-Neo.)"""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    ids = torch.arange(1, 19).view(3, 6)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 1, 0, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    columns = torch.arange(6).expand(3, -1)
    mask_positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        given = model(input_ids=ids, attention_mask=mask, position_ids=columns).logits
    assert said(caught) == [
        f"neofix: position_ids count the padding of rows 0, 1: the real token of row 0 at column 4, after a gap in its "
        f"mask, is at position 4, but the attention mask puts it at 2 (arange over a padded batch); derived their "
        f"positions from the mask. To fix your code: {FIX}"
    ]
    with torch.no_grad(), neofix.unpatched():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=torch.where(mask == 1, mask_positions,
                                                                                      columns)).logits
        counted = model(input_ids=ids, attention_mask=mask, position_ids=columns).logits
    real = mask == 1
    assert torch.equal(given[real], expected[real])
    assert not torch.allclose(counted[:2][real[:2]], expected[:2][real[:2]])  # the columns give other logits there
    with warnings.catch_warnings(), torch.no_grad():  # a chunk of the last three tokens after a cache of the first three
        warnings.simplefilter("ignore")
        cache = output_cache(model(input_ids=ids[:, :3], attention_mask=mask[:, :3], position_ids=columns[:, :3]))
        chunk = model(input_ids=ids[:, 3:], attention_mask=mask, position_ids=columns[:, 3:],
                      **{cache_keyword(): cache}).logits
    torch.testing.assert_close(chunk[real[:, 3:]], given[:, 3:][real[:, 3:]], rtol=1e-4, atol=1e-4)


def test_counted_padding_of_a_left_padded_row_and_a_gap_row_is_not_called_left_padding(model):
    """arange over a batch whose first counted row is left-padded and whose second has a gap: the warning names both
    rows and the first one's token, and calls what they count padding, not left padding (which the gap row has
    none of)."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 0, 0, 1, 1]])
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=torch.arange(1, 13).view(2, 6), attention_mask=mask, position_ids=torch.arange(6).expand(2, -1))
    assert said(caught) == [
        f"neofix: position_ids count the padding of rows 0, 1: the first real token of row 0 is at position 2, but the "
        f"attention mask puts it at 0 (arange over a padded batch); derived their positions from the mask. To fix "
        f"your code: {FIX}"
    ]


def test_positions_counting_the_pads_of_a_gap_are_a_position_error_in_strict_mode(model, strict):
    mask = torch.tensor([[1, 1, 0, 0, 1, 1]])
    with pytest.raises(neofix.PositionError, match="count the padding of row 0: the real token of row 0 at column 4"):
        model(input_ids=torch.arange(1, 7).view(1, 6), attention_mask=mask, position_ids=torch.arange(6).view(1, 6))


@pytest.mark.parametrize("with_mask", [True, False])
def test_wrong_decode_position_is_described_by_where_the_truth_comes_from(model, with_mask):
    """A decode step whose positions were not incremented: the warning names the value, the cache length and the
    position the mask (or, without a mask, the cache length) gives, and what neofix used instead."""
    ids, mask = left_padded_batch([5, 3]) if with_mask else (torch.arange(1, 11).view(2, 5), None)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    step = {cache_keyword(): output_cache(out)}
    if with_mask:
        step["attention_mask"] = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], -1)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=torch.tensor([[5], [6]]), position_ids=torch.tensor([[2], [2]]), use_cache=True, **step)
    truth, used = (
        ("the attention mask puts that real token of row 0 at position 5", "the mask's positions")
        if with_mask
        else ("with no attention mask every token is real, so that token is at position 5",
              "positions continuing after the cache")
    )
    assert said(caught) == [
        f"neofix: position_ids[0, 0] is 2 at the step after 5 cached tokens, but {truth} (arange over a left-padded "
        f"batch, or a loop that does not increment its positions?); used {used}. To fix your loop: {FIX}"
    ]


def test_token_id_errors_say_what_to_check(model):
    """Out-of-vocabulary ids: the message names the tensor, the place, the value, the range and what to check; on a
    decode step (checked only when the embedding fails) the IndexError is kept as the cause."""
    ids, mask = left_padded_batch([5, 3])
    vocab = model.config.vocab_size
    with pytest.raises(neofix.TokenIdError) as prefill:
        model(input_ids=ids, attention_mask=mask, token_type_ids=torch.full_like(ids, vocab + 4))
    assert str(prefill.value) == (
        f"token_type_ids[0, 0] is {vocab + 4}, outside the vocabulary: config.vocab_size is {vocab}, so token ids "
        f"must lie in [0, {vocab - 1}]. This model embeds token types with the token embedding, so they must be "
        f"token ids too"
    )
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    with pytest.raises(neofix.TokenIdError) as step:
        model(
            input_ids=torch.tensor([[5], [vocab]]), attention_mask=torch.cat([mask, torch.ones(2, 1).long()], -1),
            use_cache=True, **{cache_keyword(): output_cache(out)},
        )
    assert str(step.value) == (
        f"input_ids[1, 0] is {vocab}, outside the vocabulary: config.vocab_size is {vocab}, so token ids must lie in "
        f"[0, {vocab - 1}]. Check that the tokenizer belongs to this model (len(tokenizer) <= vocab_size) and that "
        f"pad_token_id is a valid id"
    )
    assert isinstance(step.value.__cause__, IndexError)


def test_mask_values_are_checked_when_positions_are_given(model):
    """A forward given positions reads its values on the general path: a mask value other than 0 and 1 is refused
    there too, naming the place."""
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 24, 25]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 2, 1, 1]])
    with pytest.raises(neofix.MaskValueError, match=r"attention_mask\[1, 2\] is 2"):
        model(input_ids=ids, attention_mask=mask, position_ids=torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]))


def test_a_decode_step_positions_from_the_mask_keep_transformers_own_for_a_finished_row():
    """``_decode_positions``: a real new token gets real tokens so far minus one; a masked new token (a finished
    row) keeps the position transformers gives it: the slot of a 1D ``cache_position`` (transformers' own, e.g. a
    static cache's), else the cached length; without either, the mask's count (pads at 0)."""
    from neofix._core._values import mask_positions

    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]])  # finished, left-padded, no real token
    assert mask_positions(mask, 1, 3, None).tolist() == [[3], [2], [3]]
    assert mask_positions(mask, 1, 3, torch.tensor([7])).tolist() == [[7], [2], [7]]
    # only a 1D cache_position names the step's slot; another shape is not transformers' and is not read
    assert mask_positions(mask, 1, 3, torch.tensor([[7], [7], [7]])).tolist() == [[3], [2], [3]]
    assert mask_positions(mask, 1, None, None).tolist() == [[2], [2], [0]]
    assert mask_positions(mask, 1, None, torch.tensor([7])).tolist() == [[7], [2], [7]]


# -- which path reads the values: the forward's fast path, the general path (align), the path accelerators take ------


def on_path(path, monkeypatch):
    read_values_on(monkeypatch, path != "accelerator")


PATHS = ["cpu", "accelerator", "bool mask"]  # the host's reads, the device's, and a mask of another dtype


@pytest.mark.parametrize("path", PATHS)
def test_a_batch_of_left_and_right_padded_rows_keeps_each_as_it_computes_alone(path, monkeypatch):
    """A prefill batching a left-padded row with a right-padded one: the left-padded row's real tokens get the
    mask's positions (said once, naming row 0), and the right-padded row keeps transformers' positions, its pads'
    too, so that its every logit is vanilla's bit for bit; the same on the forward's fast path, on the general path,
    on the path accelerators take, and for a bool mask (read by the general path's torch operations)."""
    model = tiny_gpt_neo(dtype=torch.float32)
    ids = torch.tensor([[0, 0, 11, 12, 13, 14], [21, 22, 23, 0, 0, 0]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    on_path(path, monkeypatch)
    if path == "bool mask":
        mask = mask.bool()
    with torch.no_grad():
        with neofix.unpatched():
            vanilla = model(input_ids=ids, attention_mask=mask).logits
            alone = model(input_ids=ids[:1, 2:]).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits[1], vanilla[1])  # the right-padded row, pads included
    torch.testing.assert_close(logits[0, 2:], alone[0])  # the left-padded row's real tokens, as the row alone
    assert not torch.allclose(vanilla[0, 2:], alone[0])  # (which vanilla's positions, counting the pads, are not)
    warned = said(caught)
    assert len(warned) == 1 and warned[0].startswith("neofix: row 0 of this forward is left-padded")


@pytest.mark.parametrize(
    "row, described",
    [
        ([1, 1, 0, 1, 1, 1], "has a pad between its real tokens (a gap in its mask)"),
        ([1, 0, 1, 1, 0, 0], "has a pad between its real tokens (a gap in its mask)"),
        ([0, 1, 0, 1, 1, 1], "has a pad between its real tokens (a gap in its mask)"),
        ([0, 0, 0, 1, 1, 1], "is left-padded"),
    ],
)
def test_a_gap_in_the_mask_is_said_as_a_gap(row, described):
    """A row whose pads sit between real tokens gets the mask's positions as a left-padded row does (with global
    attention, GPT-2's, its real tokens then compute what they compute alone: GPT-Neo's local window counts columns,
    the gap's too); the warning said "is left-padded" of it, which it is not."""
    model = tiny_model("gpt2", dtype=torch.float64)
    mask = torch.tensor([[1] * 6, row])
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    real = [index for index, flag in enumerate(row) if flag]
    with torch.no_grad():
        alone = model(input_ids=ids[1:, real]).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(logits[1, real], alone[0])
    assert len(said(caught)) == 1 and said(caught)[0].startswith(f"neofix: row 1 of this forward {described} and no")


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32])
def test_an_unpadded_or_right_padded_prefill_is_vanilla_for_any_mask_dtype(dtype):
    """Masks of ints, bools or 0./1. floats without left padding: the logits are vanilla's bit for bit, and nothing
    is said (the general path reads bool and float masks with torch operations)."""
    model = tiny_gpt_neo(dtype=torch.float32)
    ids = torch.tensor([[11, 12, 13, 14, 15], [21, 22, 23, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).to(dtype)
    with torch.no_grad():
        with neofix.unpatched():
            vanilla = model(input_ids=ids, attention_mask=mask).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            logits = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(logits, vanilla)
    assert said(caught) == []


def test_a_float_mask_of_other_values_is_refused():
    """A float mask holding a value other than 0 and 1 (an additive mask, or weights) is refused by name, as an
    integer one is."""
    model = tiny_gpt_neo(dtype=torch.float32)
    mask = torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]])
    with torch.no_grad(), pytest.raises(neofix.MaskValueError):
        model(input_ids=torch.tensor([[1, 2, 3], [4, 5, 6]]), attention_mask=mask)


@pytest.mark.parametrize("path", PATHS)
def test_uncached_positions_transformers_keeps_transformers_own_positions_without_a_cache(path, monkeypatch):
    """``configure(uncached_positions="transformers")``: a left-padded forward without a cache is vanilla's bit for
    bit, and nothing is said; a chunk after a cache still gets the mask's positions (the setting is for forwards
    without a cache)."""
    on_path(path, monkeypatch)
    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    ids, mask = left_padded_batch([6, 3])
    if path == "bool mask":
        mask = mask.bool()
    neofix.configure(uncached_positions="transformers")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = model(input_ids=ids, attention_mask=mask).logits
        with neofix.unpatched():
            vanilla = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(patched, vanilla)
    assert said(caught) == []
    chunks = []
    for setting in ("transformers", "mask", None):  # None: the mask's positions given, to compare with
        neofix.configure(uncached_positions="mask")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", neofix.NeofixWarning)
            cache = output_cache(model(input_ids=ids[:, :4], attention_mask=mask[:, :4].long(), use_cache=True))
            neofix.configure(uncached_positions=setting or "mask")
            given = {} if setting else {"position_ids": reference_positions(mask.long())[:, 4:]}
            chunks.append(model(input_ids=ids[:, 4:], attention_mask=mask, **given, **{cache_keyword(): cache}).logits)
    assert torch.equal(chunks[0], chunks[1])
    torch.testing.assert_close(chunks[0], chunks[2])  # the mask's positions, given


@pytest.mark.parametrize("path", PATHS)
def test_a_left_padded_prompt_of_two_tokens_gets_the_masks_positions(path, monkeypatch):
    """The narrowest left padding, one pad then one real token: the real token computes what it computes alone."""
    on_path(path, monkeypatch)
    model = tiny_gpt_neo(seed=0, dtype=torch.float64)  # (float32 rounds the masked column's share differently)
    ids = torch.tensor([[31, 32], [0, 33]])
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mask = (ids != 0) if path == "bool mask" else (ids != 0).long()
        logits = model(input_ids=ids, attention_mask=mask).logits
        alone = model(input_ids=ids[1:, 1:]).logits
    torch.testing.assert_close(logits[1, 1], alone[0, 0])
    if not has("float64 mask bug"):  # (vanilla 4.36 - 4.44 cannot run float64 GPT-Neo)
        with torch.no_grad(), neofix.unpatched():
            vanilla = model(input_ids=ids, attention_mask=(ids != 0).long()).logits
        assert not torch.allclose(vanilla[1, 1], alone[0, 0])  # vanilla's position 1 for it computes otherwise
    assert len(said(caught)) == 1 and said(caught)[0].startswith("neofix: row 1 of this forward is left-padded")


@pytest.mark.parametrize("path", ["cpu", "accelerator"])
def test_counted_padding_is_repaired_in_its_row_only(path, monkeypatch):
    """A batch of two left-padded rows given positions: row 0's count its padding (arange), row 1's are a custom
    scheme (the mask's plus 2).  Row 0's are repaired, so it computes what it computes alone; row 1's are left as
    given, vanilla's bit for bit."""
    on_path(path, monkeypatch)
    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    ids, mask = left_padded_batch([4, 5], width=6)
    positions = torch.stack((torch.arange(6), reference_positions(mask)[1] + 2))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        alone = model(input_ids=ids[:1, 2:]).logits
        with neofix.unpatched():
            vanilla = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(logits[0, 2:], alone[0])
    assert torch.equal(logits[1], vanilla[1])
    messages = said(caught)
    assert len(messages) == 1 and "row 0" in messages[0] and "row 1" not in messages[0], messages


@pytest.mark.parametrize("positions", ["none", "correct", "frozen"])
def test_a_float_mask_decodes_as_an_integer_mask(model, positions):
    """A mask of 0. and 1. (some pipelines build one): the same tokens as with an integer mask, positions derived,
    given or repaired."""
    ids, mask = left_padded_batch([6, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        floats = decode(model, ids, mask.to(model.dtype), STEPS, positions=positions)
        ints = decode(model, ids, mask, STEPS, positions=positions)
    assert torch.equal(floats, ints)
    assert torch.equal(ints, reference(model, ids, mask))


@pytest.mark.parametrize("dtype", [torch.long, torch.bool, torch.float32])
def test_a_one_token_prompt_is_vanilla_for_any_mask_dtype(dtype):
    """A prompt of one token (a mask of one column: no padding to read) computes what vanilla computes, silently."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    ids = torch.tensor([[31], [32]])
    mask = torch.ones(2, 1, dtype=dtype)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with neofix.trace(model) as steps:
            patched = model(input_ids=ids, attention_mask=mask).logits
        with neofix.unpatched():
            vanilla = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(patched, vanilla)
    assert said(caught) == [] and steps[0].repairs == ()


def test_a_bool_mask_prefill_and_chunk_name_the_derived_positions(model):
    """Read by the general path's torch reads: a left-padded bool-mask prefill derives its positions (said once, and
    named in the trace), and a chunk after it derives them silently (said at prefill), both named in the trace."""
    ids, mask = left_padded_batch([6, 3])
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught, neofix.trace(model) as steps:
        warnings.simplefilter("always")
        out = model(input_ids=ids[:, :4], attention_mask=mask[:, :4].bool(), use_cache=True)
        model(input_ids=ids[:, 4:], attention_mask=mask.bool(), **{cache_keyword(): output_cache(out)})
    assert [step.repairs for step in steps] == [("positions_derived",), ("positions_derived",)]
    messages = said(caught)
    assert len(messages) == 1 and messages[0].startswith("neofix: row 1 of this forward is left-padded"), messages


@pytest.mark.parametrize("path", PATHS)
def test_a_chunks_derived_positions_are_silent_even_where_its_prefill_said_nothing(path, monkeypatch):
    """A left-padded prompt fed as a prefill given the mask's positions (nothing to say), then a chunk given none:
    the chunk's positions are derived from the mask without a word (a chunk continues the rows as they are; the
    repair is said at a prefill only), and its logits are the full recompute's."""
    on_path(path, monkeypatch)
    model = tiny_gpt_neo(seed=0, dtype=torch.float64)
    ids, mask = left_padded_batch([8, 5])
    if path == "bool mask":
        mask = mask.bool()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prompt = model(input_ids=ids[:, :5], attention_mask=mask[:, :5], position_ids=reference_positions(mask[:, :5]),
                       use_cache=True)
        chunk = model(input_ids=ids[:, 5:], attention_mask=mask, **{cache_keyword(): output_cache(prompt)}).logits
        whole = model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask)).logits[:, 5:]
    assert said(caught) == []
    assert torch.equal(chunk.argmax(-1), whole.argmax(-1))
    torch.testing.assert_close(chunk, whole, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("pad_position", [0, 1])  # reference_positions' pads; transformers' generate fills pads with 1
def test_a_chunks_given_positions_at_its_pads_are_not_compared(path, pad_position, monkeypatch):
    """A chunk whose new columns hold a row's left padding, given the mask's positions with the pads at 0 or at 1
    (what generate fills them with): only real tokens' positions are compared with the mask's, so nothing is
    repaired or said, and the logits are vanilla's given the same positions, bit for bit, pads included; the same on
    every read path.  The positions ``align`` computes inside ``torch.compile`` (from shapes, on the device) are the
    given ones too."""
    from neofix._core import Policy, StepInputs, align
    from neofix._families import gpt_neo

    on_path(path, monkeypatch)
    model = tiny_gpt_neo(dtype=torch.float32)
    ids, mask = left_padded_batch([8, 3])  # row 1: five pads, three of them in the chunk after 2 cached columns
    if path == "bool mask":
        mask = mask.bool()
    positions = reference_positions(mask).masked_fill(mask == 0, pad_position)
    prefill = {"input_ids": ids[:, :2], "attention_mask": mask[:, :2], "position_ids": positions[:, :2]}
    chunk = {"input_ids": ids[:, 2:], "attention_mask": mask, "position_ids": positions[:, 2:]}
    with torch.no_grad():
        with neofix.unpatched():
            cache = output_cache(model(**prefill, use_cache=True))
            vanilla = model(**chunk, **{cache_keyword(): cache}).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cache = output_cache(model(**prefill, use_cache=True))
            view = gpt_neo.ADAPTER.read_cache(cache, model.config.num_layers)  # (the chunk's forward grows it)
            logits = model(**chunk, **{cache_keyword(): cache}).logits
    assert torch.equal(logits, vanilla)
    assert said(caught) == []
    step = StepInputs(chunk["input_ids"], None, chunk["attention_mask"], chunk["position_ids"], None, None)
    aligned = align(step, view, gpt_neo.ADAPTER.limits(model.config), Policy(compiling=True))
    assert torch.equal(aligned.position_ids, chunk["position_ids"])
