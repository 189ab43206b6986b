"""The core rules the modern decoders (issue 38) brought, on the core alone (CPU tensors, milliseconds): rotary
positions compared after a cache, ``cache_position``'s values, a 2D mask wider than a static cache, and 5.x's
per-layer-type mask dicts."""

from __future__ import annotations

import pytest
import torch

from neofix import CacheLengthError, PositionError
from neofix._core import CacheView, Limits, Policy, Positions, StepInputs, align
from neofix._core._types import BY_COLUMNS, BY_GIVEN, BY_MASK, Offset

LIMITS = Limits(max_positions=None, vocab_size=96, hidden_size=32, heads=2, head_dim=8)
ROTARY = Policy(positions=Positions.ROTARY)
MASK = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]])  # three cached tokens and one new, rows left-padded


def _cache(past, batch=3):
    return CacheView(past, batch, (past, past), None, 2, 8, "object")


def _step(positions=None, mask=MASK, new=1, cache_position=None, batch=3):
    return StepInputs(torch.ones(batch, new, dtype=torch.long), None, mask, positions, None, cache_position)


# -- rotary positions after a cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, expected",
    [
        ([[3], [3], [3]], [[3], [3], [3]]),  # the column (transformers' own, counting the pads): kept
        ([[3], [1], [2]], [[3], [1], [2]]),  # the mask's: kept
        ([[2], [0], [1]], [[3], [1], [2]]),  # not advanced, per row (the mask's scheme): the mask's
        ([[2], [2], [2]], [[3], [3], [3]]),  # not advanced, shared by differently padded rows: the column
        ([[2]], [[3], [3], [3]]),  # one row for all: the column
        ([[3], [1], [1]], [[3], [1], [2]]),  # the mask's but for one row: that row repaired
    ],
)
@pytest.mark.parametrize("on_device", [False, True])
def test_rotary_positions_after_a_cache_keep_either_scheme_and_repair_the_rest(given, expected, on_device):
    """On the host (CPU memory) right positions are read with a list scan and passed on as given; wrong ones, and
    every decode step on a device, are compared and repaired on the device, nothing read (a report, read later)."""
    from ._sync import device_reads

    with device_reads(on_device):
        aligned = align(_step(torch.tensor(given)), _cache(3), LIMITS, ROTARY)
    assert torch.broadcast_to(aligned.position_ids, (3, 1)).tolist() == expected
    if on_device or given != expected:
        assert bool(aligned.report.wrong.any()) == (given != expected)
    else:
        assert aligned.report is None
    assert aligned.repairs == ()


@pytest.mark.parametrize(
    "given, expected",
    [
        ([[3], [3], [3]], [[3], [3], [3]]),  # the column: kept
        ([[3], [1], [2]], [[3], [3], [3]]),  # the mask's, which this cache does not hold: the column
        ([[2], [0], [1]], [[3], [3], [3]]),  # not advanced, per row: the column (not the mask's)
    ],
)
@pytest.mark.parametrize("on_device", [False, True])
def test_rotary_positions_after_a_cache_of_transformers_own_continue_its_columns(given, expected, on_device):
    """A cache whose prompt was given no positions holds transformers' own (each token's column): only those continue
    it, so the mask's positions, right after a cache built with them, are repaired to the columns on left-padded rows,
    and so are positions that do not advance."""
    from ._sync import device_reads

    with device_reads(on_device):
        aligned = align(_step(torch.tensor(given)), _cache(3)._replace(built=BY_COLUMNS), LIMITS, ROTARY)
    assert torch.broadcast_to(aligned.position_ids, (3, 1)).tolist() == expected
    if on_device or given != expected:
        assert aligned.report.truth == "columns"
        assert torch.broadcast_to(aligned.report.derived, (3, 1)).tolist() == [[3], [3], [3]]
    strict = Policy(strict=True, positions=Positions.ROTARY)
    if given != expected:
        with pytest.raises(PositionError, match=r"^position_ids\[(\d), 0\] is \d at the step after 3 cached tokens, "
                           r"but the cache holds transformers' own positions, which put that real token of row \1 at "
                           r"position 3: the prompt was given no position_ids"):
            align(_step(torch.tensor(given)), _cache(3)._replace(built=BY_COLUMNS), LIMITS, strict)


@pytest.mark.parametrize(
    "given, expected",
    [
        ([[3], [3]], [[3], [3]]),  # the columns: kept (transformers' own, as the prompt had)
        ([[2], [3]], [[2], [3]]),  # the mask's, shifted by each row's leading pads: kept
        ([[2], [2]], [[2], [3]]),  # the mask's unshifted on the left-padded row: that row repaired
        ([[1], [1]], [[2], [3]]),  # not advanced: the shifted mask's, row 0's not its column (which counts the pad)
    ],
)
@pytest.mark.parametrize("on_device", [False, True])
def test_after_a_cache_of_transformers_own_a_row_without_leading_pads_continues_by_the_mask(given, expected, on_device):
    """A cache whose prompt was given no positions, a row whose pad comes after its first real token (right padding,
    or a pad fed after the prompt): its real tokens sit at the mask's positions (no leading pads to shift them), so
    the mask's continue it as well as the columns, and a repair takes the mask's there, the column on a left-padded
    row."""
    from ._sync import device_reads

    mask = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1]])
    step = _step(torch.tensor(given), mask, batch=2)
    with device_reads(on_device):
        aligned = align(step, _cache(3, 2)._replace(built=BY_COLUMNS), LIMITS, ROTARY)
    assert torch.broadcast_to(aligned.position_ids, (2, 1)).tolist() == expected


@pytest.mark.parametrize("given", [[[1]], [[2]]], ids=["the shift alone", "the mask's"])
def test_on_the_host_a_left_padded_row_after_a_cache_of_transformers_own_is_judged_by_its_count_and_its_pads(given):
    """The host's list scan of one left-padded row after a cache of transformers' own positions: its new token is
    the row's third real token after one pad, so only 3 (its column, and the mask's 2 shifted by the pad) continues
    the cache; a position that is the pad alone, or the mask's unshifted, is repaired to it."""
    step = _step(torch.tensor(given), torch.tensor([[0, 1, 1, 1]]), batch=1)
    aligned = align(step, _cache(3, 1)._replace(built=BY_COLUMNS), LIMITS, ROTARY)
    assert aligned.position_ids.tolist() == [[3]]


#: What a cache built with the mask's positions, or with them plus 5, puts the new token at, and the words that say so.
_CONTINUED = {
    BY_MASK: ([[3], [1], [2]], "the attention mask puts that real token of row \\1 at position \\d"),
    Offset(5, True): (
        [[8], [6], [7]],
        "the cache holds the positions its prompt was given, each real token's count of real tokens before it plus "
        "the same number, which put that real token of row \\1 at position \\d",
    ),
}


@pytest.mark.parametrize(
    "built, given",
    [
        (BY_MASK, [[3], [1], [2]]),  # the mask's: kept
        (BY_MASK, [[3], [3], [3]]),  # the columns, which this cache does not hold: the mask's
        (BY_MASK, [[3]]),  # one row for all (an arange after the cache): the mask's
        (BY_MASK, [[2], [0], [1]]),  # not advanced: the mask's
        (Offset(5, True), [[8], [6], [7]]),  # the mask's plus 5: kept
        (Offset(5, True), [[7], [5], [6]]),  # not advanced: the mask's plus 5
        (Offset(5, True), [[3], [1], [2]]),  # the mask's, the offset dropped: the mask's plus 5
        (Offset(5, True), [[3], [3], [3]]),  # the columns: the mask's plus 5
        (Offset(5, True), [[8]]),  # one row for all: the mask's plus 5
    ],
)
@pytest.mark.parametrize("on_device", [False, True])
def test_rotary_positions_after_a_cache_of_the_masks_continue_the_masks(built, given, on_device):
    """A cache whose prompt was given the mask's positions (on left-padded rows, where the schemes differ), or the
    mask's plus 5 on every real token, holds those: only they continue it, so the columns, or positions that do not
    advance or drop the offset, are repaired to them, in words that say which (strict: the error)."""
    from ._sync import device_reads

    expected, words = _CONTINUED[built]
    cache = _cache(3)._replace(built=built)
    with device_reads(on_device):
        aligned = align(_step(torch.tensor(given)), cache, LIMITS, ROTARY)
    assert torch.broadcast_to(aligned.position_ids, (3, 1)).tolist() == expected
    if on_device:
        assert aligned.report.truth == ("mask" if built == BY_MASK else "offset")
        assert aligned.report.derived.tolist() == expected
    strict = Policy(strict=True, positions=Positions.ROTARY)
    if torch.broadcast_to(torch.tensor(given), (3, 1)).tolist() != expected:
        with pytest.raises(PositionError, match=r"^position_ids\[(\d), 0\] is \d at the step after 3 cached tokens, "
                           r"but " + words):
            align(_step(torch.tensor(given)), cache, LIMITS, strict)
    else:
        assert align(_step(torch.tensor(given)), cache, LIMITS, strict).repairs == ()


@pytest.mark.parametrize("new", [1, 2], ids=["decode step", "chunk"])
@pytest.mark.parametrize("on_device", [False, True])
def test_no_positions_after_a_cache_of_the_masks_are_the_masks(new, on_device):
    """After a cache whose prompt was given the mask's positions, a step given none gets the mask's (transformers'
    own, the columns, would not continue it on a left-padded row), derived on the device and not said; after a cache
    of transformers' own, or one not known, none are left to transformers, as before."""
    from ._sync import device_reads

    mask = torch.cat([MASK[:, :3], torch.ones(3, new, dtype=torch.long)], -1)
    with device_reads(on_device):
        aligned = align(_step(None, mask, new), _cache(3)._replace(built=BY_MASK), LIMITS, ROTARY)
        assert aligned.position_ids.tolist() == [[3, 4][:new], [1, 2][:new], [2, 3][:new]]
        assert aligned.repairs == () or [repair.message for repair in aligned.repairs] == [""]  # (not said)
        for built in (None, BY_COLUMNS):
            unknown = align(_step(None, mask, new), _cache(3)._replace(built=built), LIMITS, ROTARY)
            assert unknown is None or unknown.position_ids is None


@pytest.mark.parametrize("on_device", [False, True])
def test_after_an_offset_its_prompt_did_not_tell_either_scheme_plus_it_continues_the_cache(on_device):
    """An offset read where the prompt had no pad before a real token (``told`` False: the mask's and the columns
    agreed there) is continued by either scheme plus it, as a cache whose prompt told nothing is by either scheme:
    on a row right-padded since, the columns plus 5 are kept, and so are the mask's plus 5; positions that do not
    advance are repaired (where the prompt told the mask's, the columns plus 5 are repaired to them).  Without a mask
    (every token real), the columns plus 5."""
    from ._sync import device_reads

    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])  # (row 0: a pad fed after the prompt)
    cache = _cache(3, 2)._replace(built=Offset(5, False))
    with device_reads(on_device):
        for given, expected in (([[8], [8]], [[8], [8]]), ([[7], [8]], [[7], [8]]), ([[6], [7]], [[7], [8]])):
            aligned = align(_step(torch.tensor(given), mask, batch=2), cache, LIMITS, ROTARY)
            assert torch.broadcast_to(aligned.position_ids, (2, 1)).tolist() == expected, given
            repaired = aligned.repairs if aligned.report is None else aligned.report.wrong.any()
            assert bool(repaired) == (given != expected), given  # (kept ones: nothing repaired, nothing said)
        both_padded = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 1]])  # (every row's mask position one below its column)
        for built, expected in ((Offset(5, False), [[8], [8]]), (Offset(5, True), [[7], [7]])):
            step = _step(torch.tensor([[8], [8]]), both_padded, batch=2)
            aligned = align(step, cache._replace(built=built), LIMITS, ROTARY)
            assert torch.broadcast_to(aligned.position_ids, (2, 1)).tolist() == expected, built
        unmasked = align(_step(torch.tensor([[8], [8]]), None, batch=2), cache, LIMITS, ROTARY)
        assert unmasked.position_ids.tolist() == [[8], [8]] and unmasked.repairs == ()
        frozen = align(_step(torch.tensor([[7], [7]]), None, batch=2), cache, LIMITS, ROTARY)
        assert torch.broadcast_to(frozen.position_ids, (2, 1)).tolist() == [[8], [8]]


@pytest.mark.parametrize("new", [1, 2], ids=["decode step", "chunk"])
@pytest.mark.parametrize("on_device", [False, True])
def test_no_positions_after_a_cache_of_an_offset_continue_it(new, on_device):
    """After a cache whose prompt was given the mask's positions plus 5, a step given none gets those (the mask's plus
    5), derived on the device and not said; so does one without left padding (transformers' own would drop it)."""
    from ._sync import device_reads

    for mask, expected in ((MASK, [[8, 9], [6, 7], [7, 8]]), (torch.ones(3, 4, dtype=torch.long), [[8, 9]] * 3)):
        mask = torch.cat([mask[:, :3], torch.ones(3, new, dtype=torch.long)], -1)
        with device_reads(on_device):
            aligned = align(_step(None, mask, new), _cache(3)._replace(built=Offset(5, True)), LIMITS, ROTARY)
        assert aligned.position_ids.tolist() == [row[:new] for row in expected]
        assert [repair.message for repair in aligned.repairs] == [""]  # (not said)


@pytest.mark.parametrize(
    "mask, given, built",
    [
        ([[1, 1, 1], [0, 1, 1]], [[0, 1, 2], [0, 0, 1]], BY_MASK),  # the mask's, a left-padded row: told
        ([[1, 1, 1], [0, 1, 1]], [[0, 1, 2], [1, 0, 1]], BY_MASK),  # a pad's position is not judged
        ([[1, 1, 1], [0, 1, 1]], [[0, 1, 2]], BY_COLUMNS),  # one row for all, an arange: the columns
        ([[1, 1, 1], [0, 1, 1]], [[0, 1, 2], [5, 1, 2]], BY_COLUMNS),  # the columns (the pad's not judged)
        ([[1, 1, 1], [0, 1, 1]], [[5, 6, 7], [0, 5, 6]], Offset(5, True)),  # the mask's plus 5 in every row: told
        ([[1, 1, 1], [0, 1, 1]], [[5, 6, 7], [0, 6, 7]], BY_GIVEN),  # offsets that differ by row: the caller's own
        ([[1, 1, 1], [0, 1, 1]], [[5, 6, 8], [0, 5, 6]], BY_GIVEN),  # no one offset in a row: the caller's own
        ([[1, 1, 1], [1, 1, 1]], [[1, 2, 3]], Offset(1, False)),  # every token real, from 1: the offset 1, untold
        ([[1, 1, 1], [1, 1, 0]], [[3, 4, 5], [3, 4, 0]], Offset(3, False)),  # right padding: the schemes agree, untold
        ([[1, 1, 1], [1, 1, 0]], [[0, 1, 2], [0, 1, 1]], None),  # no pad before a real token: the schemes agree
        ([[1, 0, 1], [1, 1, 1]], [[0, 1, 1], [0, 1, 2]], BY_MASK),  # a gap: the mask's differ from the columns there
        ([[1, 0, 1], [1, 1, 1]], [[0, 1, 2], [0, 1, 2]], BY_COLUMNS),  # the gap's real token at its column
        (None, [[0, 1, 2]], None),  # no mask, every token real: both schemes are the columns
        (None, [[1, 2, 3], [0, 1, 2]], BY_GIVEN),  # no mask, a row's positions from 1: the caller's own
        (None, [[2, 3, 4]], Offset(2, False)),  # no mask, every row's from 2: the offset 2
    ],
)
@pytest.mark.parametrize("on_device", [False, True])
def test_a_rotary_prompts_given_positions_tell_which_its_cache_is_built_with(mask, given, built, on_device):
    """A rotary prompt's given positions are read with its values: every real token at the mask's position, where a
    row has a pad before a real token (there the two schemes differ), builds the cache with the mask's; every one at
    its column, where the schemes differ, with the columns; every one at the mask's plus the same number, with that
    offset; none of these, with the caller's own (``Aligned.built``, which the wrapper remembers).  The step itself
    is passed on unchanged."""
    from ._sync import device_reads

    mask, given = (None if mask is None else torch.tensor(mask)), torch.tensor(given)
    step = StepInputs(torch.ones(2, 3, dtype=torch.long), None, mask, given, None, None)
    with device_reads(on_device):
        aligned = align(step, _cache(0, 2), LIMITS, ROTARY)
    assert aligned.built == built
    assert aligned.position_ids is given and aligned.repairs == ()


@pytest.mark.parametrize("on_device", [False, True])
def test_after_a_cache_of_the_callers_own_positions_given_ones_are_left_as_given(on_device):
    """A cache built with positions of neither scheme (from 1, say: only differences matter, so vanilla decodes the
    reference's tokens) is continued by the caller's own: positions that are neither the columns nor the mask's are
    left as given, on the device as on the host, and nothing is said."""
    from ._sync import device_reads

    with device_reads(on_device):
        aligned = align(_step(torch.tensor([[4], [2], [3]])), _cache(3)._replace(built=BY_GIVEN), LIMITS, ROTARY)
    assert aligned.position_ids.tolist() == [[4], [2], [3]]
    assert aligned.repairs == () and aligned.report is None


def test_a_rotary_chunk_after_a_cache_is_read_and_repaired_at_once():
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    aligned = align(_step(torch.tensor([[1, 1], [0, 0]]), mask, new=2, batch=2), _cache(3, 2), LIMITS, ROTARY)
    assert aligned.position_ids.tolist() == [[3, 4], [2, 3]]
    assert aligned.repair_kinds == ("position_values_repaired",)


def test_rotary_positions_that_do_not_advance_are_a_position_error_in_strict_mode():
    with pytest.raises(PositionError, match=r"^position_ids\[0, 0\] is 2 at the step after 3 cached tokens"):
        align(_step(torch.tensor([[2], [0], [1]])), _cache(3), LIMITS, Policy(strict=True, positions=Positions.ROTARY))


def test_rotary_positions_are_left_alone_without_a_cache_and_where_generate_made_them():
    aligned = align(_step(torch.tensor([[0, 0, 0, 0]] * 3), new=4), _cache(0), LIMITS, ROTARY)
    assert aligned.position_ids.tolist() == [[0, 0, 0, 0]] * 3  # no cache: any scheme (packed documents)
    trusted = Policy(positions=Positions.ROTARY, trusted_positions=True)
    aligned = align(_step(torch.tensor([[2], [0], [1]])), _cache(3), LIMITS, trusted)
    assert aligned.position_ids.tolist() == [[2], [0], [1]] and aligned.report is None


# -- cache_position ------------------------------------------------------------------------------------------------


def test_a_right_cache_position_is_passed_on_as_given():
    given = torch.tensor([3])
    assert align(_step(cache_position=given), _cache(3), LIMITS, ROTARY).cache_position is given


def test_a_cache_position_that_does_not_advance_is_replaced_and_said():
    aligned = align(_step(cache_position=torch.tensor([2])), _cache(3), LIMITS, ROTARY)
    assert aligned.cache_position.tolist() == [3]
    assert aligned.repair_kinds == ("cache_position_repaired",)
    with pytest.raises(PositionError, match=r"^cache_position is \[2\] at a step after 3 cached tokens"):
        align(_step(cache_position=torch.tensor([2])), _cache(3), LIMITS, Policy(strict=True))


def test_cache_position_is_left_alone_where_the_caches_length_cannot_be_told():
    static = CacheView(None, 3, None, 16, 2, 8, "static")
    given = torch.tensor([9])
    assert align(_step(cache_position=given), static, LIMITS, ROTARY).cache_position is given


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


# -- a 2D mask as wide as a static cache's slots --------------------------------------------------------------------

SLOT_WIDE = torch.tensor([[1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 0, 0, 0]])


@pytest.mark.parametrize("on_host", [True, False], ids=["slots read on the host", "slots on the device"])
def test_a_mask_as_wide_as_a_static_caches_slots_gives_positions_at_the_new_tokens_slots(on_host, monkeypatch):
    """After three tokens in an 8-slot static cache, the fourth at slot 3: a real token's position is the mask's at
    its slot (not at the mask's last column, an empty slot's), whether the slots tell the cache's length (read on
    the host) or are only used on the device."""
    if not on_host:
        from neofix._core import _values

        monkeypatch.setattr(_values._reads, "reader_for", lambda question: _values._reads.read_on_device)
    static = CacheView(None, 3, None, 8, 2, 8, "static")
    aligned = align(_step(mask=SLOT_WIDE, cache_position=torch.tensor([3])), static, LIMITS, Policy())
    assert aligned.position_ids.tolist() == [[3], [1], [2]]
    assert aligned.attention_mask is SLOT_WIDE  # passed on as given (BLOOM builds its ALiBi over every slot)


def test_an_empty_static_caches_first_step_reads_a_mask_as_wide_as_its_slots_by_slot():
    """The first step (the cache known to be empty): the prompt's tokens are the first slots; the mask is not
    ambiguous (it was a MaskLengthError), and its first columns give the real tokens' positions."""
    empty = CacheView(0, None, None, 8, None, None, "static")
    aligned = align(_step(mask=SLOT_WIDE, new=4), empty, LIMITS, Policy())
    assert aligned.attention_mask is SLOT_WIDE
    assert aligned.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 0, 1], [0, 0, 1, 2]]  # (a pad keeps its column)


@pytest.mark.parametrize("columns", [1, 2, 3, 7, 8])
@pytest.mark.parametrize("pads_masks", [True, False], ids=["eager or sdpa", "flash attention"])
@pytest.mark.parametrize("kind", [Positions.ABSOLUTE, Positions.ROTARY, Positions.MASK])
def test_a_decode_steps_mask_over_a_static_cache_of_unknown_length_is_extended_to_every_slot(columns, pads_masks, kind):
    """Where a static cache's length is not read (an accelerator, torch.compile), a decode step's 2D mask narrower
    than the slots is extended with ones to every slot, on the device: a prompt's mask not extended since then covers
    every token, and a mask of the tokens so far means what it meant (the causal mask hides the empty slots).  Left as
    given: a mask of one column (the new token's own, or the first cached token's: its value would tell, a read), one
    as wide as the slots, every mask of a family that derives positions from each column (OPT), and every mask of an
    attention that keeps as many keys as the mask has columns (flash attention)."""
    from ._sync import simulated_accelerator

    unknown = CacheView(None, 2, None, 8, 2, 8, "static")
    mask = torch.tensor([[1] * columns, [0] + [1] * (columns - 1)])
    slots = torch.tensor([5])  # (on the device: not read)
    with simulated_accelerator():
        policy = Policy(positions=kind, pads_masks=pads_masks)
        aligned = align(_step(mask=mask, cache_position=slots, batch=2), unknown, LIMITS, policy)
    if columns in (1, 8) or kind is Positions.MASK or not pads_masks:
        assert aligned.attention_mask is mask
        return
    assert aligned.attention_mask.tolist() == [row + [1] * (8 - columns) for row in mask.tolist()]
    assert not any(repair.message for repair in aligned.repairs)  # (whether it was short is not known: nothing said)
    if kind is Positions.ABSOLUTE:  # taken at the slot, from the extended mask: its real tokens before it
        assert aligned.position_ids.tolist() == [[5], [4]]


def test_a_static_caches_length_is_told_by_its_slots_only_where_they_are_read_for_free():
    """The new tokens' slots tell a static cache's length (last slot + 1 - new tokens) when read on the host, eagerly;
    not under torch.compile, not from slots of another count than the step's tokens, nor from slots before 0, and
    never for a cache whose length is known or that is not static."""
    from neofix._core._align import length_from_slots

    static = CacheView(None, 3, None, 8, 2, 8, "static")
    assert length_from_slots(static, torch.tensor([5, 6]), 2, False).length == 5
    assert length_from_slots(static, torch.tensor([5, 6]), 2, True) is static
    assert length_from_slots(static, torch.tensor([6]), 2, False) is static
    assert length_from_slots(static, torch.tensor([[5, 6]]), 2, False) is static
    assert length_from_slots(static, None, 2, False) is static
    assert length_from_slots(static, torch.tensor([-1, 0]), 2, False) is static  # (a length of -1: not one)
    growing = CacheView(None, 3, None, None, 2, 8, "unknown")
    assert length_from_slots(growing, torch.tensor([5, 6]), 2, False) is growing
    known = static._replace(length=4)
    assert length_from_slots(known, torch.tensor([5, 6]), 2, False) is known
