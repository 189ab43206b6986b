"""Tests written for the mutants of the core (``neofix/_core``) that the rest of the suite let survive.

Each test pins one rule of the core that no other test checked (benchmarks/MUTATION.md lists the mutants, and which
test kills which).  They call the core directly, on CPU tensors, so they run in milliseconds.
"""

from __future__ import annotations

import pytest
import torch

from neofix import MaskLengthError, PositionError
from neofix._core import CacheView, Limits, Policy, Positions, StepInputs, align, explain_index_error
from neofix._core._reads import Question, read_on_device, read_on_host, reader_for
from neofix._core._types import BY_COLUMNS, BY_MASK

from ._sync import HostReads

LIMITS = Limits(max_positions=64, vocab_size=96, hidden_size=32, heads=4, head_dim=8)


def _cache(past: int, batch: int = 1) -> CacheView:
    return CacheView(past, batch, (past, past), None, None, None, "object")


def _step(new: int, mask=None, positions=None, batch: int = 1) -> StepInputs:
    return StepInputs(torch.ones(batch, new, dtype=torch.long), None, mask, positions)


# -- inside torch.compile: the positions an eager step ends with, from the device alone ------------------------------


@pytest.mark.parametrize(
    "past, new, mask, positions, expected",
    [
        (3, 1, [[0, 1, 1, 1]], [[9]], [[2]]),  # a decode step at a wrong position: the mask's
        (3, 2, [[0, 1, 1, 1, 1]], [[7, 8]], [[2, 3]]),  # a chunk at wrong positions
        (1, 1, [[1, 1]], [[5]], [[1]]),  # after one cached token
        (3, 2, None, [[0, 0]], [[3, 4]]),  # no mask: every token real, positions continue after the cache
        (3, 2, None, [[3, 4]], [[3, 4]]),  # right ones kept
        (2, 1, [[0, 1, 1]], None, [[1]]),  # none given: derived from the mask
        (2, 2, [[1, 0, 1, 1]], None, [[1, 2]]),
    ],
)
def test_compiling_ends_with_the_eager_positions(past, new, mask, positions, expected):
    """``Policy(compiling=True)`` (inside ``torch.compile``: nothing read, nothing reported) gives a cached step the
    positions the eager step ends with: wrong given ones repaired from the mask (or the cache), missing ones derived."""
    mask = None if mask is None else torch.tensor(mask)
    positions = None if positions is None else torch.tensor(positions)
    step = _step(new, mask, positions)
    eager = align(step, _cache(past), LIMITS, Policy())
    with HostReads() as reads:
        compiled = align(step, _cache(past), LIMITS, Policy(compiling=True))
    assert compiled.repairs == () and reads.by_neofix == []
    assert compiled.position_ids.tolist() == expected
    if eager.position_ids is not None:
        assert torch.equal(compiled.position_ids, eager.position_ids)


# -- the reader chosen ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("elsewhere", ["input_ids", "mask", "positions"])
def test_the_host_reader_is_chosen_only_where_every_tensor_it_reads_is_in_cpu_memory(elsewhere):
    """One tensor of the step on another device (``meta`` stands in for an accelerator, which CI does not have) and
    the step is read on the device: the host reader's ``tolist()`` would synchronise, and a check of that kind is
    what the device reader makes of it."""
    tensors = {"input_ids": torch.ones(1, 2, dtype=torch.long), "mask": torch.ones(1, 2, dtype=torch.long),
               "positions": torch.tensor([[0, 1]])}

    def question():
        return Question(tensors["input_ids"], None, tensors["positions"], True, True, tensors["mask"], 2, 0)

    assert reader_for(question()) is read_on_host
    tensors[elsewhere] = tensors[elsewhere].to("meta")
    assert reader_for(question()) is read_on_device


# -- the readers on questions the property rarely draws --------------------------------------------------------------


@pytest.mark.parametrize(
    "question",
    [
        # no mask, after a cache: a given position that does not continue the cache is wrong
        Question(torch.ones(1, 2, dtype=torch.long), None, torch.tensor([[0, 1]]), True, True, None, 2, 3),
        Question(torch.ones(2, 1, dtype=torch.long), None, torch.tensor([[4]]), True, True, None, 1, 4),
        Question(torch.ones(1, 2, dtype=torch.long), None, torch.tensor([[3, 4]]), True, True, None, 2, 3),
        # inputs_embeds (no input_ids), no mask, nothing given: nothing to read at all
        Question(None, None, None, False, False, None, 2, 0),
        Question(None, None, None, False, False, torch.tensor([[0, 1, 1]]), 3, 0),
        # inputs_embeds, a mask of two rows, one row of positions for both: row 1's is wrong
        Question(None, None, torch.tensor([[2, 3]]), True, True, torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]), 2, 2),
    ],
)
def test_the_readers_read_alike_without_a_mask_or_ids(question):
    host, device = read_on_host(question), read_on_device(question)
    assert host._replace(positions=None) == device._replace(ids=None, types=None, positions=None)
    assert device.ids is None if question.input_ids is None else device.ids == (1, 1)


@pytest.mark.parametrize(
    "question",
    [
        Question(torch.ones(1, 2, dtype=torch.long), None, torch.tensor([[0, 1]]), True, True, None, 2, 3),
        Question(None, None, torch.tensor([[2, 3]]), True, True, torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]]), 2, 2),
    ],
)
def test_a_wrong_position_is_read_as_wrong_by_both_readers(question):
    """Without a mask (positions continue the cache), and with one row of positions shared by every mask row of a
    step given ``inputs_embeds`` (each mask row is compared)."""
    assert read_on_host(question).wrong and read_on_device(question).wrong


@pytest.mark.parametrize(
    "given, wrong",
    [
        ([[2, 3, 3, 4]], False),  # the mask's: each real token's count of real tokens before it
        ([[2, 3, 9, 4]], False),  # the new pad's position is not judged
        ([[3, 4, 5, 6]], True),  # the columns: they count the pads
        ([[2, 3, 3, 5]], True),  # the last one off
    ],
)
def test_positions_after_a_cache_with_a_gap_are_judged_as_the_mask_counts(given, wrong):
    """A row that is not pads then real tokens (a hole among the cached and among the new tokens) is judged by its
    count of real tokens, on the host as on the device: the mask's positions pass, others are wrong."""
    mask = torch.tensor([[1, 0, 1, 1, 1, 0, 1]])  # 3 cached (one a pad), 4 new (one a pad)
    question = Question(torch.ones(1, 4, dtype=torch.long), None, torch.tensor(given), True, True, mask, 4, 3)
    assert read_on_host(question).wrong is wrong
    assert read_on_device(question).wrong is wrong


def test_the_device_reader_reads_no_position_range_unless_asked():
    """A family without a position table (``range_of_positions`` False) gets no range read: the rules would compare
    it with a table size of ``None``."""
    positions = torch.tensor([[0, 1]])
    question = Question(torch.ones(1, 2, dtype=torch.long), None, positions, True, False, torch.ones(1, 2), 2, 0)
    assert read_on_device(question).positions is None
    asked = question._replace(range_of_positions=True)
    assert read_on_device(asked).positions == (0, 1)


def test_a_rotary_family_without_a_position_table_checks_values_on_the_device():
    from neofix._core import Positions

    from ._sync import device_reads

    limits = LIMITS._replace(max_positions=None)
    step = _step(2, torch.ones(1, 2, dtype=torch.long), torch.tensor([[0, 1]]))
    with device_reads(True), HostReads() as reads:
        aligned = align(step, _cache(0), limits, Policy(check_values=True, positions=Positions.ROTARY))
    assert aligned.position_ids.tolist() == [[0, 1]]
    assert [name for name, _ in reads.by_neofix] == ["tolist"]  # the device reader's one read


# -- positions repaired after a cache without a mask -----------------------------------------------------------------


@pytest.mark.parametrize("on_device", [False, True])
def test_stale_values_of_a_chunk_without_a_mask_continue_the_cache(on_device):
    """No mask, 3 cached tokens, a chunk of 2 given at positions 0 and 1: repaired to 3 and 4, shape (1, 2)."""
    from ._sync import device_reads

    with device_reads(on_device):
        aligned = align(_step(2, None, torch.tensor([[0, 1]])), _cache(3), LIMITS, Policy())
    assert aligned.position_ids.shape == (1, 2) and aligned.position_ids.tolist() == [[3, 4]]
    assert aligned.repair_kinds == ("position_values_repaired",)


# -- the model's own 3D mask ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dims", [3, 4])
def test_a_model_mask_of_the_steps_shape_is_used_as_given(dims):
    """A 3D (batch, queries, keys) or 4D (batch, heads, queries, keys) mask with one query row per new token and one
    key column per cached and new token is taken as it is; its query rows are the second-to-last dimension."""
    shape = (1, 2, 5) if dims == 3 else (1, 1, 2, 5)
    mask = torch.zeros(shape)
    aligned = align(_step(2, mask), _cache(3), LIMITS, Policy())
    assert aligned.attention_mask is mask and aligned.repairs == ()


def test_a_model_mask_over_sliding_window_slots_is_used_as_given_whatever_its_width():
    """A static cache of sliding-window layers (no capacity given: the family's ``read_window_cache``): its 4D mask
    spans the window's slots or the prompt's keys, the layer's business; only its query rows are checked."""
    sliding = CacheView(0, None, None, None, None, None, "static")
    mask = torch.zeros(1, 1, 3, 8)
    assert align(_step(3, mask), sliding, LIMITS, Policy()).attention_mask is mask
    with pytest.raises(MaskLengthError, match=r"needs 2 rows of queries .* and the columns its sliding-window cache"):
        align(_step(2, mask), sliding, LIMITS, Policy())


# -- words ---------------------------------------------------------------------------------------------------------


def test_a_mask_of_one_column_is_named_in_the_singular():
    aligned = align(_step(1, torch.ones(1, 1, dtype=torch.long)), _cache(1), LIMITS, Policy())
    repair = aligned.repairs[0]
    assert repair.kind == "mask_extended"
    expected = "attention_mask has 1 column, but the cache holds 1 token and this step feeds 1: expected 2"
    assert expected in repair.message


def test_one_row_one_token_and_one_new_token_are_named_in_the_singular():
    """"the cache holds 1 rows", "holds 1 tokens": every count in a message takes its noun's number."""
    from neofix import BatchMismatchError, CacheLengthError, MaskLengthError

    with pytest.raises(BatchMismatchError, match=r"^the cache holds 1 row, but this step feeds 2: "):
        align(_step(1, batch=2), _cache(3), LIMITS, Policy())
    uneven = CacheView(3, 1, (3, 1), None, None, None, "object")
    with pytest.raises(CacheLengthError, match=r"^cache layer 1 holds 1 token, but layer 0 holds 3: "):
        align(_step(1), uneven, LIMITS, Policy())
    with pytest.raises(MaskLengthError, match=r"this step's 1 new token"):
        align(_step(1, torch.tensor([[0]])), _cache(3), LIMITS, Policy())


# -- an IndexError that no value explains -----------------------------------------------------------------------------


def test_an_index_error_without_positions_is_left_to_the_caller():
    """Every id in range and no positions given: nothing to name, the caller re-raises the ``IndexError``."""
    cause = IndexError("index out of range in self")
    assert explain_index_error(cause, LIMITS, torch.tensor([[1, 2]]), None, None) is None
    assert explain_index_error(cause, LIMITS, torch.tensor([[1, 2]]), torch.tensor([[0, 3]]), None) is None


def test_a_longer_all_ones_mask_is_sliced_as_a_named_silent_repair():
    """A mask of more columns than cached plus new tokens, all ones (every reading agrees): sliced to its first
    ``p + q`` columns, recorded as ``mask_sliced`` (what traces list), with no warning."""
    mask = torch.ones(1, 5, dtype=torch.long)
    aligned = align(_step(1, mask), _cache(2), LIMITS, Policy())
    assert aligned.attention_mask.shape == (1, 3)
    assert aligned.repairs[0].kind == "mask_sliced" and not aligned.repairs[0].message


# -- token types and cache positions ---------------------------------------------------------------------------------


def test_token_types_of_another_length_are_refused_by_their_count_in_1d_and_2d():
    import neofix

    for token_types in (torch.zeros(3, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)):
        step = _step(2)._replace(token_type_ids=token_types)
        with pytest.raises(neofix.InputShapeError, match=r"token_type_ids has 3 columns, but this step feeds 2 new"):
            align(step, _cache(4), LIMITS, Policy())


@pytest.mark.parametrize("strict", [False, True])
def test_cache_position_of_the_new_tokens_is_kept_and_another_is_left_out(strict):
    import neofix

    right = torch.arange(3, 5)
    aligned = align(_step(2)._replace(cache_position=right), _cache(3), LIMITS, Policy(strict=strict))
    assert aligned.cache_position is right and "cache_position_dropped" not in aligned.repair_kinds
    stale = _step(2)._replace(cache_position=torch.arange(0, 5))
    if strict:
        with pytest.raises(neofix.PositionError, match="cache_position has 5 entries, but this step feeds 2 new"):
            align(stale, _cache(3), LIMITS, Policy(strict=True))
        return
    aligned = align(stale, _cache(3), LIMITS, Policy())
    assert aligned.cache_position is None
    (dropped,) = [repair for repair in aligned.repairs if repair.kind == "cache_position_dropped"]
    assert dropped.message == (
        "neofix: cache_position has 5 entries, but this step feeds 2 new tokens; left it out. Reported once."
    )


# -- more rules no other test pinned -------------------------------------------------------------------------------


def test_trusted_positions_are_still_compared_at_a_prefill():
    """``trusted_positions`` (built by generate) skips the comparison on cached steps only: a prefill's positions
    that count the left padding are repaired even so."""
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    counted = torch.tensor([[0, 1, 2], [0, 1, 2]])
    aligned = align(_step(3, mask, counted, batch=2), _cache(0, 2), LIMITS, Policy(trusted_positions=True))
    assert aligned.repair_kinds == ("positions_count_padding",)
    assert aligned.position_ids.tolist() == [[0, 1, 2], [0, 0, 1]]


@pytest.mark.parametrize(
    "name, values, error",
    [("token_type_ids", [[-1, 5]], "TokenIdError"), ("position_ids", [[-1, 0]], "PositionError")],
)
def test_the_device_reader_checks_the_smallest_value_too(name, values, error):
    """On an accelerator every value is checked from its (min, max): a negative smallest value is refused even when
    the largest is in range."""
    import neofix

    from ._sync import device_reads

    step = _step(2, torch.ones(1, 2, dtype=torch.long))._replace(**{name: torch.tensor(values)})
    with device_reads(True), pytest.raises(getattr(neofix, error), match=rf"{name}\[0, 0\] is -1"):
        align(step, _cache(0), LIMITS, Policy(check_values=True))


@pytest.mark.parametrize("new, mask, cache_position, expected", [
    (3, [[1, 1, 1, 1, 1, 0, 1, 1]], [5, 6, 7], [[5, 5, 6]]),  # a chunk whose first token is a pad
    (1, [[1, 1, 1, 0]], [3], [[3]]),  # a decode step feeding a pad
])
def test_a_pad_keeps_the_cache_position_transformers_gives_it(new, mask, cache_position, expected):
    """A static cache (its length not known without a read): real tokens get the mask's positions, a pad the
    ``cache_position`` transformers passes."""
    step = _step(new, torch.tensor(mask))._replace(cache_position=torch.tensor(cache_position))
    view = CacheView(None, 1, None, 16, None, None, "static")
    aligned = align(step, view, LIMITS, Policy())
    assert aligned.position_ids.tolist() == expected


def test_stale_positions_with_a_4d_mask_are_refused():
    import neofix

    step = _step(2, torch.zeros(1, 1, 2, 5), torch.tensor([[0, 1, 2]]))
    with pytest.raises(neofix.PositionError, match="with a 3D or 4D attention mask neofix cannot tell"):
        align(step, _cache(3), LIMITS, Policy())


def test_the_families_kind_of_positions_decides_what_stale_ones_get():
    """Stale positions (neither the new tokens' nor cached plus new): rotary ones refused, a family without positions
    left alone, a family that derives them from its mask left to the model (no mask given), an absolute one with a
    static cache's mask derived from the mask."""
    import neofix
    from neofix._core import Positions

    stale = torch.tensor([[0, 1, 2]])
    with pytest.raises(neofix.PositionError, match="with rotary positions"):
        align(_step(2, None, stale), _cache(3), LIMITS, Policy(positions=Positions.ROTARY))
    aligned = align(_step(2, None, stale), _cache(3), LIMITS, Policy(positions=Positions.NONE))
    assert aligned.position_ids is stale and aligned.repairs == ()
    aligned = align(_step(2, None, stale), _cache(3), LIMITS, Policy(positions=Positions.MASK))
    assert aligned.position_ids is None and aligned.repair_kinds == ("positions_rederived",)
    static = CacheView(None, 1, None, 16, None, None, "static")
    aligned = align(_step(2, torch.tensor([[0, 1, 1, 1]]), stale), static, LIMITS, Policy())
    assert aligned.position_ids.tolist() == [[1, 2]] and aligned.repair_kinds[0] == "positions_rederived"


@pytest.mark.parametrize("heads, head_dim", [(4, 4), (2, 8)])
def test_a_cache_of_another_head_width_or_count_is_refused(heads, head_dim):
    import neofix

    view = CacheView(3, 1, (3, 3), None, heads, head_dim, "object")
    with pytest.raises(neofix.InputShapeError, match=f"keys of {heads} heads of width {head_dim}, but this model"):
        align(_step(1, torch.ones(1, 4, dtype=torch.long)), view, LIMITS, Policy())


@pytest.mark.parametrize(
    "unused, heads, head_dim, cause",
    [
        (16, 4, 16, "built from the config's head_dim of 16, which this model's attention does not use"),
        (16, 2, 16, "built by another model"),  # other heads too: not the config's cache
        (16, 4, 4, "built by another model"),  # as many heads, of another width than the config's
        (None, 4, 16, "built by another model"),  # a config head_dim the attention reads (or none)
    ],
)
def test_a_cache_as_wide_as_a_config_head_dim_the_attention_ignores_is_named_as_built_from_it(
    unused, heads, head_dim, cause
):
    """``Limits.unused_head_dim``: a cache of the model's heads as wide as that config value was built from the config
    (the static cache transformers makes), and the error says what to set; any other cache of other heads is another
    model's.  (The rule on numbers: tests/test_family_llama.py runs it on the releases where Llama's attention ignores
    the config's head_dim.)"""
    import neofix

    view = CacheView(3, 1, (3, 3), None, heads, head_dim, "object")
    with pytest.raises(neofix.InputShapeError) as raised:
        align(_step(1, torch.ones(1, 4, dtype=torch.long)), view, LIMITS._replace(unused_head_dim=unused), Policy())
    message = str(raised.value)
    assert f"keys of {heads} heads of width {head_dim}, but this model has 4 heads of width 8: the cache was" in message
    assert cause in message
    if unused is not None and cause.startswith("built from"):
        assert message.endswith("Leave head_dim out of the config or set it to 8")
    else:
        assert "Pass the cache this model returned" in message


def test_only_a_prefill_reports_its_right_padded_rows():
    """A row ending in a pad after a real token is right padding at a prefill (decoding from it is then said); a
    chunk after a cache ending so marks nothing."""
    mask = torch.tensor([[1, 1, 1, 0]])
    assert align(_step(4, mask), _cache(0), LIMITS, Policy()).right_padded == (0,)
    assert align(_step(2, mask), _cache(2), LIMITS, Policy()).right_padded == ()


def test_only_positions_looked_up_in_a_table_are_compared_with_the_mask():
    """``Positions.compared``: absolute (GPT-Neo) and mask-derived (OPT) positions are compared and repaired; rotary
    ones (transformers' own count the padding, as right as the mask's) and a family without positions are not."""
    from neofix._core import Positions

    assert [kind for kind in Positions if kind.compared] == [Positions.ABSOLUTE, Positions.MASK]
    mask = torch.tensor([[1, 1, 1], [0, 1, 1]])
    counted = torch.tensor([[0, 1, 2], [0, 1, 2]])
    repaired = ("positions_count_padding",)
    for kind, kinds in [(Positions.ABSOLUTE, repaired), (Positions.MASK, repaired), (Positions.ROTARY, ()),
                        (Positions.NONE, ())]:
        aligned = align(_step(3, mask, counted, batch=2), _cache(0, 2), LIMITS, Policy(positions=kind))
        assert aligned.repair_kinds == kinds, kind
    # after a cache, rotary positions are compared with both schemes a cache is built with (issue 38): the column
    # (2, transformers' own, counting the pad) and the mask's (1) are kept; one that is neither is the mask's
    for kind, given, expected in [
        (Positions.MASK, [[0]], [[1]]),
        (Positions.MASK, [[2]], [[1]]),
        (Positions.ROTARY, [[0]], [[1]]),
        (Positions.ROTARY, [[2]], [[2]]),
        (Positions.ROTARY, [[1]], [[1]]),
        (Positions.NONE, [[0]], [[0]]),  # left alone (the model refuses positions)
    ]:
        step = _step(1, torch.tensor([[0, 1, 1]]), torch.tensor(given))
        aligned = align(step, _cache(2), LIMITS, Policy(positions=kind))
        got = aligned.position_ids.tolist() if aligned.position_ids is not None else None
        assert got == expected, (kind, given)


# -- a static cache read by its slots (benchmarks/MUTATION.md, "Static caches read by their slots") --------------------

SO_FAR = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]])  # five tokens so far, left-padded rows


def _static(length=None, capacity=8) -> CacheView:
    return CacheView(length, 3, None, capacity, 4, 8, "static")


@pytest.mark.parametrize("compiling", [False, True], ids=["eager", "compiling"])
@pytest.mark.parametrize("positions", ["none", "right", "wrong"])
@pytest.mark.parametrize("new", [1, 2])
@pytest.mark.parametrize("empty", [0, 1], ids=["empty slots zeros", "empty slots ones"])
def test_a_static_step_read_by_slot_on_the_device_gets_the_positions_of_the_tokens_so_far(empty, new, positions,
                                                                                        compiling):
    """A static cache whose length is not known (its slots on an accelerator, or inside torch.compile), a mask as wide
    as its 8 slots whose empty slots are zeros or ones (the causal mask hides those): every position, derived,
    compared or repaired, is the one the same step gets over a dynamic cache of the tokens so far with their mask
    (the mask's count at each new token's slot, not at its last columns, which count the empty slots' ones)."""
    from ._sync import device_reads

    past = SO_FAR.shape[1] - new
    wide = torch.cat([SO_FAR, torch.full((3, 3), empty)], dim=-1)
    right = (SO_FAR.cumsum(-1) - 1)[:, past:]
    given = {"none": None, "right": right, "wrong": right + torch.tensor([[0], [5], [0]])}[positions]
    step = StepInputs(torch.ones(3, new, dtype=torch.long), None, wide, given, None, torch.arange(past, past + new))
    dynamic = CacheView(past, 3, (past, past), None, 4, 8, "object")
    policy = Policy(compiling=compiling)
    with device_reads():
        got = align(step, _static(), LIMITS, policy)
        expected = align(step._replace(attention_mask=SO_FAR), dynamic, LIMITS, policy)
    assert got.attention_mask is wide  # passed on as given: transformers reads it by slot
    assert torch.equal(got.position_ids, expected.position_ids)
    assert torch.equal(got.position_ids, right)
    assert got.repair_kinds == expected.repair_kinds


@pytest.mark.parametrize("past, new, mask", [
    (2, 2, [[1, 1, 1, 0]]),  # a chunk whose last token is a pad
    (3, 1, [[1, 1, 1, 0]]),  # a decode step feeding a pad
    (2, 3, [[1, 0, 1, 1, 0]]),
    (1, 2, [[0, 1, 0], [1, 1, 1]]),
])
def test_compiling_gives_a_new_pad_the_position_the_eager_step_gives_it(past, new, mask):
    """Inside torch.compile, positions of a cached step without ``cache_position`` are derived on the device: a pad
    among the new tokens keeps transformers' own position (its column) as in the eager step, which leaves it to
    transformers where no real token needs another (``None``: ``arange(past, past + new)``)."""
    mask = torch.tensor(mask)
    step = _step(new, mask, batch=mask.shape[0])
    eager = align(step, _cache(past, mask.shape[0]), LIMITS, Policy())
    compiled = align(step, _cache(past, mask.shape[0]), LIMITS, Policy(compiling=True))
    own = torch.arange(past, past + new).expand(mask.shape[0], new)
    assert torch.equal(compiled.position_ids, own if eager.position_ids is None else eager.position_ids)


def test_the_slots_on_an_accelerator_are_not_read_to_tell_a_static_caches_length():
    """The new tokens' slots tell a static cache's length only where reading them waits for nothing (CPU memory):
    slots on an accelerator (``meta`` stands in for one: any read of it fails) leave the length unknown."""
    from neofix._core._align import length_from_slots

    assert length_from_slots(_static(), torch.tensor([5, 6]), 2, False).length == 5
    assert length_from_slots(_static(), torch.tensor([5, 6], device="meta"), 2, False).length is None


@pytest.mark.parametrize("elsewhere", ["positions", "mask"])
def test_values_are_read_on_the_host_only_where_the_positions_and_the_mask_both_are_in_cpu_memory(elsewhere):
    """``on_host`` (the list scans of rotary positions, of ``cache_position``, of a static cache's slots): one of the
    two tensors on an accelerator (``meta``) and the values are not read on the host, as the reader of the step
    would not read them there."""
    from neofix._core._values import on_host

    tensors = {"positions": torch.tensor([[3]]), "mask": torch.ones(1, 4, dtype=torch.long)}
    assert on_host(tensors["positions"], tensors["mask"]) and on_host(tensors["positions"], None)
    tensors[elsewhere] = tensors[elsewhere].to("meta")
    assert not on_host(tensors["positions"], tensors["mask"])
    assert reader_for(Question(None, None, tensors["positions"], True, False, tensors["mask"], 1, 3)) is read_on_device


def test_compiling_reads_no_slot_of_a_static_cache():
    """Inside torch.compile the slots (``cache_position`` on the CPU) are not read to tell a static cache's length:
    nothing is read on the host, and the positions are those an eager step gets where the slots are on an
    accelerator (taken at the slots on the device)."""
    from ._sync import HostReads, device_reads

    wide = torch.cat([SO_FAR, torch.ones(3, 3, dtype=torch.long)], dim=-1)
    step = StepInputs(torch.ones(3, 1, dtype=torch.long), None, wide, None, None, torch.tensor([4]))
    with HostReads() as reads:
        compiled = align(step, _static(), LIMITS, Policy(compiling=True))
    assert reads.by_neofix == []
    with device_reads():
        eager = align(step, _static(), LIMITS, Policy())
    assert torch.equal(compiled.position_ids, eager.position_ids)


@pytest.mark.parametrize("mask", [[[1, 1, 1, 0], [1, 1, 1, 1]], [[1, 1, 1], [1, 1, 1]]],
                         ids=["right-padded", "one column short"])
def test_slots_from_the_first_tell_a_static_cache_is_empty(mask):
    """A static cache whose length is a tensor (one reset for the next prompt: ``cache.reset()`` on 5.x keeps its
    layers initialised) and whose new tokens go to slots 0 to 3 holds no tokens: the prompt is aligned as over a
    fresh static cache, known to be empty (its right-padded rows marked, a mask one column short extended)."""
    mask = torch.tensor(mask)
    step = StepInputs(torch.ones(2, 4, dtype=torch.long), None, mask, None, None, torch.arange(4))
    reset = align(step, CacheView(None, 2, None, 8, 4, 8, "static"), LIMITS, Policy())
    fresh = align(step, CacheView(0, None, None, 8, None, None, "static"), LIMITS, Policy())
    assert reset.right_padded == fresh.right_padded and reset.repairs == fresh.repairs
    assert torch.equal(reset.attention_mask, fresh.attention_mask)
    assert reset.repairs or reset.right_padded  # (something to align: the cases differ from a cache of unknown length)


@pytest.mark.parametrize("width", [4, 8], ids=["the tokens so far", "the slots (read by slot)"])
def test_a_mask_of_other_rows_is_refused_over_a_static_cache_whatever_its_width(width):
    """A static cache whose length its slots tell, a 2D mask of 2 rows for a batch of 3: refused by name, whether it
    is as wide as the tokens so far or as the cache's slots (read by slot: it skipped the rows' check and reached
    transformers, which failed with an ``IndexError``)."""
    import neofix

    step = StepInputs(torch.ones(3, 1, dtype=torch.long), None, torch.ones(2, width, dtype=torch.long), None, None,
                      torch.tensor([3]))
    with pytest.raises(neofix.BatchMismatchError, match="attention_mask has 2 rows, but this step feeds 3"):
        align(step, _static(), LIMITS, Policy())


def test_a_mask_of_other_rows_as_wide_as_the_tokens_so_far_is_refused_over_a_static_cache_too():
    """A static cache whose length its slots tell, a mask of exactly the tokens so far but of 2 rows for a batch of 3:
    refused by name, as over a dynamic cache of those tokens."""
    import neofix

    step = StepInputs(torch.ones(3, 1, dtype=torch.long), None, torch.ones(2, 4, dtype=torch.long), None, None,
                      torch.tensor([3]))
    for view in (_static(), CacheView(3, 3, (3, 3), None, 4, 8, "object")):
        with pytest.raises(neofix.BatchMismatchError, match="attention_mask has 2 rows, but this step feeds 3"):
            align(step, view, LIMITS, Policy())


def test_a_static_cache_of_sliding_window_layers_reads_a_wider_mask_by_slot():
    """A static cache of sliding-window layers (Mistral, Gemma2, Gemma3 on 5.x: no capacity told, each layer has its
    own slots), its length told by the slots: a mask wider than the tokens so far is read by slot and passed on as
    given, its positions those of the tokens so far."""
    wide = torch.cat([SO_FAR[:, :4], torch.zeros(3, 4, dtype=torch.long)], dim=-1)
    step = StepInputs(torch.ones(3, 1, dtype=torch.long), None, wide, None, None, torch.tensor([3]))
    aligned = align(step, _static(capacity=None), LIMITS, Policy())
    expected = align(step._replace(attention_mask=SO_FAR[:, :4]), CacheView(3, 3, (3, 3), None, 4, 8, "object"),
                     LIMITS, Policy())
    assert aligned.attention_mask is wide
    assert torch.equal(aligned.position_ids, expected.position_ids)


def test_align_checks_the_ids_on_the_device_where_no_facts_are_given():
    """Where the step's values were not read before (no facts), ``align`` reads them itself: on an accelerator the
    ids' range is read with the rest, and an id past the vocabulary is refused as the first pass refuses it."""
    import neofix
    from neofix._core import Positions, keeps_every_rule

    from ._sync import device_reads

    step = _step(3, torch.ones(1, 3, dtype=torch.long))._replace(input_ids=torch.tensor([[5, 96, 7]]))
    with device_reads(), pytest.raises(neofix.TokenIdError) as first:
        keeps_every_rule(step, _cache(0), LIMITS, Positions.ABSOLUTE, False, False, False)
    with device_reads(), pytest.raises(neofix.TokenIdError) as aligned:
        align(step, _cache(0), LIMITS, Policy())
    assert str(aligned.value) == str(first.value)


# -- today's changes: OPT's slot mask, the rotary cache's positions (benchmarks/MUTATION.md, 2026-12-06) --------------

ROTARY = Policy(positions=Positions.ROTARY)


def _rotary(given, mask, past, built=None, on_device=False, policy=ROTARY):
    """The positions a rotary step after ``past`` cached tokens is given, read on the host or on the device."""
    from ._sync import device_reads

    new = len(given[0])
    mask = None if mask is None else torch.tensor(mask)
    batch = 1 if mask is None else mask.shape[0]
    cache = CacheView(past, batch, (past, past), None, 4, 8, "object", built)
    with device_reads(on_device):
        return align(_step(new, mask, torch.tensor(given), batch), cache, LIMITS, policy)


@pytest.mark.parametrize(
    "given, mask, past, expected",
    [
        ([[0]], None, 3, [[3]]),  # no mask: every token real, so the column (the count) is the one right position
        ([[0, 0]], None, 3, [[3, 4]]),  # the same for a chunk: each token its own column
        ([[2]], [[0, 1, 1, 1], [0, 0, 1, 1]], 3, [[3], [3]]),  # one row for all, neither scheme's in row 1: columns
        ([[0]], [[0, 0, 1, 1]], 3, [[1]]),  # neither scheme's: the mask's (its first columns are pads)
        ([[3]], [[0, 1, 1, 1]], 3, [[3]]),  # the column of a padded row: one scheme, kept
        ([[2], [2]], [[0, 1, 1, 1], [1, 1, 0, 0]], 3, [[2], [2]]),  # the mask's where it is real (row 1's is a pad)
    ],
)
def test_rotary_positions_after_a_cache_are_judged_alike_on_the_host_and_on_the_device(given, mask, past, expected):
    """Rotary positions after a cache are right where every real token is at its column or every one at the mask's
    position: the host's list scan and the device's tensor rule must agree on which are right and on the repair."""
    host = _rotary(given, mask, past)
    device = _rotary(given, mask, past, on_device=True)
    rows = 1 if mask is None else len(mask)
    for aligned in (host, device):
        assert torch.broadcast_to(aligned.position_ids, (rows, len(given[0]))).tolist() == expected


def test_a_pad_after_a_cache_of_columns_keeps_its_given_position_on_the_device_too():
    """After a cache of transformers' own positions only real tokens are judged against the columns; a pad among the
    new tokens keeps the position it was given, on the device as on the host (nothing to repair, nothing reported)."""
    mask = [[1, 1, 1, 1, 1], [0, 0, 0, 0, 1], [0, 0, 1, 1, 1]]
    given = [[3, 4], [1, 4], [3, 4]]  # row 1's first new token is a pad, at a position of its own
    host = _rotary(given, mask, 3, built=BY_COLUMNS)
    device = _rotary(given, mask, 3, built=BY_COLUMNS, on_device=True)
    assert host.position_ids.tolist() == device.position_ids.tolist() == given
    assert host.repairs == device.repairs == ()


def test_rotary_positions_without_a_mask_are_described_by_the_count():
    """Without a mask every token is real: a wrong position is refused (strict) in the words of the count of tokens,
    as an absolute family's is, not in the mask's."""
    strict = Policy(strict=True, positions=Positions.ROTARY)
    with pytest.raises(PositionError) as rotary:
        _rotary([[0]], None, 3, policy=strict)
    with pytest.raises(PositionError) as absolute:
        _rotary([[0]], None, 3, policy=Policy(strict=True))
    assert "with no attention mask every token is real" in str(rotary.value)
    assert str(rotary.value) == str(absolute.value)


@pytest.mark.parametrize("built", [None, BY_COLUMNS, BY_MASK])
def test_a_decode_steps_report_says_what_the_strict_error_says(built):
    """On the device a decode step's wrong rotary position is repaired unread and reported later: the report, once
    read, describes the position in the words the strict mode's error uses (the cached tokens it follows included)."""
    from neofix._core._values import describe_wrong

    mask = [[1, 1, 1, 1], [0, 0, 1, 1], [0, 1, 1, 1]]
    given = [[2], [0], [1]]  # not advanced
    report = _rotary(given, mask, 3, built, on_device=True).report
    described = describe_wrong(report.wrong, report.given, report.derived, report.past, report.truth)
    with pytest.raises(PositionError) as strict:
        _rotary(given, mask, 3, built, policy=Policy(strict=True, positions=Positions.ROTARY))
    assert str(strict.value).startswith(described + ": ")


def test_a_repair_to_the_columns_says_it_used_the_columns():
    """The one-time warning of a repair after a cache of transformers' own positions says which positions it used."""
    mask = [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]
    aligned = _rotary([[2, 3], [0, 1], [1, 2]], mask, 3, built=BY_COLUMNS)  # a chunk, not advanced: read at once
    (repair,) = aligned.repairs
    assert "; used the cache's. To fix your loop: the prompt was given no position_ids" in repair.message


def _opt_static(mask, length):
    cache = CacheView(length, 3, None, 8, 4, 8, "static")
    step = StepInputs(torch.ones(3, 1, dtype=torch.long), None, mask, None)
    return align(step, cache, LIMITS, Policy(positions=Positions.MASK))


def test_opt_is_given_a_masks_tokens_so_far_over_a_static_cache_as_a_silent_named_repair():
    """OPT derives its positions from every column of its mask: a mask as wide as a static cache's slots is given as
    the tokens so far, recorded as ``mask_sliced`` (what traces list) with no warning; a mask of exactly the tokens
    so far is passed on with nothing recorded."""
    wide = torch.cat([SO_FAR, torch.zeros(3, 3, dtype=torch.long)], -1)
    aligned = _opt_static(wide, 4)
    assert torch.equal(aligned.attention_mask, SO_FAR)
    assert [(r.kind, bool(r.message)) for r in aligned.repairs] == [("mask_sliced", False)]
    exact = _opt_static(SO_FAR, 4)
    assert torch.equal(exact.attention_mask, SO_FAR) and exact.repairs == ()


@pytest.mark.parametrize("missing", [None, ()], ids=["None", "empty"])
def test_a_legacy_cache_with_a_missing_layer_is_read_as_holding_nothing_there(missing):
    """A tuple cache whose later layers are missing (``None``, as GPT-Neo's forward once filled an unused one, or an
    empty tuple): those layers are read as holding 0 tokens, and the step is refused naming that layer, not an
    ``AttributeError`` from reading it, nor a length it does not hold."""
    import neofix
    from neofix import _caches

    pair = (torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8))
    view = _caches.read((pair, missing, pair), 3)
    assert (view.length, view.batch, view.layer_lengths, view.heads, view.head_dim) == (3, 1, (3, 0, 3), 4, 8)
    with pytest.raises(neofix.CacheLengthError, match=r"cache layer 1 holds 0 tokens, but layer 0 holds 3"):
        align(_step(1, torch.ones(1, 4, dtype=torch.long)), view, LIMITS, Policy())
    assert _caches.read([pair, missing, pair], 3) == view  # a list of layers reads as the tuple does
    assert _caches.read((), 3).length == 0  # an empty tuple: no cache
