"""The value rules: what a step's values (token ids, mask values, given positions) must be, and the positions a step
ends with.

Reading a value off an accelerator is a host-device synchronisation.  So a step reads its values at most once,
through the reader :mod:`._reads` chooses for it, and only where that is cheap: on prefills and multi-token steps.  A
single-token decode step reads nothing (unless ``check_values`` or strict mode asks): given positions are compared
with the mask's on the device and repaired there (``torch.where``), and the comparison is handed back as a
:class:`~neofix._core.Report` for the caller to read when that costs nothing.

Positions, wherever they are made, come from one rule (:func:`mask_positions`): a real token's position is the
number of real tokens before it; a pad keeps the position transformers gives it.  So a chunk after a cache gives its
tokens, pads included, the positions the same tokens get in one forward without a cache.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .._errors import MaskValueError, PositionError, SequenceTooLongError, TokenIdError, counted
from . import _reads
from ._reads import Facts, Question, new_columns, step_truth
from ._types import (
    BY_COLUMNS,
    BY_COUNT,
    BY_GIVEN,
    BY_MASK,
    BY_OFFSET,
    CACHE_POSITION_VALUES,
    POSITION_VALUES,
    POSITIONS_COUNT_PADDING,
    POSITIONS_DERIVED,
    Limits,
    Offset,
    Policy,
    Positions,
    Repair,
    Report,
)

_new = tuple.__new__

FIX_POSITIONS = "pass only the new tokens' positions, or none at all and neofix derives them from the mask"
_FIX_VALUES = (
    "positions must advance by one per real token: derive them from the attention mask "
    "((mask.cumsum(-1) - 1).clamp(min=0)), or pass none and neofix derives them"
)


class ValueStep(NamedTuple):
    """What the value rules work on, after the shape rules (:mod:`._align`).  ``positions``: the caller's
    (``given``), ``None``, or positions made from shapes (``given`` False: stale ones replaced without a mask);
    ``mask``: the aligned 2D mask or ``None``; ``model_mask``: a 3D or 4D mask was given (positions are then never
    compared with or derived from a mask); ``past``: cached tokens (``None``: not known); ``built``: the positions the
    cache was built with, where known (:attr:`~._types.CacheView.built`)."""

    input_ids: Any
    token_types: Any
    positions: Any
    given: bool
    mask: Any
    model_mask: bool
    new: int
    past: int | None
    cache_position: Any
    built: str | Offset | None = None


class Settled(NamedTuple):
    positions: Any
    report: Report | None
    right_padded: tuple[int, ...]
    built: str | Offset | None = None


def settle(
    step: ValueStep, limits: Limits, policy: Policy, repairs: list[Repair], facts: Facts | None = None
) -> Settled:
    """The step's positions, after every value rule the step gets (raises for values no repair can make right).
    ``facts``: the step's values where they were read already (by :func:`~._align.keeps_every_rule`)."""
    compare, derive, read, rotary, scheme = value_plan(
        step.given, step.mask is not None, step.model_mask, step.new, step.past, policy.positions,
        policy.trusted_positions, policy.check_values, policy.strict, step.built,
    )
    report = None
    if rotary:
        positions, report = _settle_rotary(step, policy, not read, repairs)
        step = step._replace(positions=positions)
    if policy.compiling:  # nothing read, nothing reported: the same positions, from shapes and on the device
        return Settled(_positions_on_device(step, compare, derive), None, ())
    if not read:
        settled = _settle_without_reading(step, compare, derive, repairs)
        return settled if report is None else settled._replace(report=report)
    if _empty(step.input_ids) or _empty(step.positions) or _empty(step.mask):
        return Settled(step.positions, None, ())  # no rows: nothing to read (transformers runs or refuses it)
    if facts is None:
        facts = read_values(
            step.input_ids, step.token_types, step.positions, step.given, compare, step.mask, step.new, step.past,
            limits, step.cache_position, scheme,
        )
        check_values(facts, step.input_ids, step.token_types, step.positions, step.mask, limits)
    positions = _positions_from(facts, step, compare, derive, policy, repairs)
    built = built_by(facts, scheme, policy.positions, step.given, step.past, step.mask is not None)
    return Settled(positions, None, rows_to_mark(facts, step.past), built)


def value_plan(
    given: bool,
    mask_2d: bool,
    model_mask: bool,
    new: int,
    past: int | None,
    kind: Positions,
    trusted: bool,
    check_values: bool,
    strict: bool,
    built: str | Offset | None = None,
) -> tuple[bool, bool, bool, bool, bool]:
    """``(compare, derive, read, rotary, scheme)``: whether given positions are compared with the 2D mask's (``kind``
    looks them up in a table, and generate did not build them from the mask after a cache), whether missing ones are
    derived from it (``kind`` derives none itself, or the cache was ``built`` with the mask's, or offset from them: see
    :func:`offset_of`), whether the step reads its values (every step but a single-token decode step, unless ``check_values`` asks, or strict mode must judge
    given positions at once), whether given rotary positions after a cache are judged by :func:`rotary_truth` (not
    after a cache ``built`` with positions of no scheme: the caller's own; nor generate's own, the mask's, unless the
    cache was ``built`` with other ones: the columns, or an offset), and whether a rotary
    prompt's given positions are read for the scheme its cache is built with (:func:`built_by`)."""
    compare = given and kind.compared and not model_mask and (not trusted or past == 0)
    derive = not given and mask_2d and (kind.derived or built == BY_MASK or type(built) is Offset)
    decode = new == 1 and past != 0
    rotary = scheme = False
    if given and not model_mask:
        if kind.rotary:
            rotary = bool(past) and built != BY_GIVEN and (not trusted or not (built is None or built == BY_MASK))
            scheme = past == 0
        elif kind.compared and (past == 0 or type(built) is Offset):
            if past == 0:  # a prompt: the offset of its positions from the mask's (they build its cache)
                scheme = True
            else:  # after a cache built with the mask's plus an offset, those continue it: judged as rotary ones
                rotary, compare = True, False
    return compare, derive, not decode or check_values or (compare and strict), rotary, scheme


def read_values(
    input_ids: Any,
    token_types: Any,
    positions: Any,
    given: bool,
    compare: bool,
    mask: Any,
    new: int,
    past: int | None,
    limits: Limits,
    slots: Any = None,
    scheme: bool = False,
) -> Facts:
    """Read a step's values once, by the reader :func:`~._reads.reader_for` picks (given positions' range only where
    the family has a position table; ``slots`` and ``scheme``: see :class:`~._reads.Question`)."""
    question = _new(  # (Question's own constructor is a Python function: built directly, as it does)
        Question,
        (input_ids, token_types, positions if given else None, compare, given and limits.max_positions is not None, mask,
         new, past, slots, scheme),
    )
    return _reads.reader_for(question)(question)


def positions_kept(facts: Facts, compare: bool, derive: bool, built: str | Offset | None = None) -> bool:
    """Whether the facts leave the step's positions as they are: given ones that agree with the mask, or none to
    derive from a mask without left padding (every real token then sits at its column: transformers' own are right,
    unless the cache was ``built`` with the mask's offset)."""
    if compare and (facts.wrong or facts.counts_pads):
        return False
    return not (derive and (facts.left or type(built) is Offset))


def rows_to_mark(facts: Facts, past: int | None) -> tuple[int, ...]:
    """The rows a forward without a cache ends in padding (its cache is marked: decoding from it is warned)."""
    return facts.right_padded if past == 0 else ()


def built_by(
    facts: Facts, scheme: bool, kind: Positions, given: bool, past: int | None, mask_2d: bool
) -> str | Offset | None:
    """The positions a rotary prompt's cache is built with, where its values tell (``scheme``: the prompt's given
    positions were read): ``BY_MASK`` where every real token is at the mask's position and a row has a pad before a
    real token (there the mask's and the columns differ); ``BY_COLUMNS`` where every one is at its column and the mask's
    differ; an :class:`~._types.Offset` where every one is at the mask's plus the same number (told from the columns
    plus it where a row has a pad before a real token); ``BY_GIVEN`` where they are none of these (the caller's own
    scheme); else ``None`` (the two schemes agree on every real token: either continues the cache).  A rotary prompt
    given none (``given`` false, without a cache, with a 2D mask) builds it with transformers' own, ``BY_COLUMNS``,
    where a row has a pad before a real token (else ``None``: the two agree).  ``kind``: the family's positions."""
    if kind.rotary and not given and past == 0 and mask_2d:
        return BY_COLUMNS if facts.left else None
    if not scheme:
        return None
    if kind.compared:  # a family with a position table: its prompt's positions are the mask's (repaired there where
        # they count the pads) or offset from them
        return Offset(facts.offset, facts.left) if facts.offset and not facts.counts_pads else None
    if not facts.wrong:
        return BY_MASK if facts.left else None
    if facts.columns:
        return BY_COLUMNS
    return BY_GIVEN if facts.offset is None else Offset(facts.offset, facts.left)


def offset_of(built: str | Offset | None) -> int:
    """The number a cache's positions are off from a scheme's: ``built``'s where that is an :class:`Offset`, else 0."""
    return built.by if type(built) is Offset else 0


def _columns_continue(built: str | Offset | None) -> bool:
    """Whether the columns (plus the cache's offset) continue a cache ``built`` so: not where its prompt told the
    mask's apart from them (``BY_MASK``, or an offset of the mask's it told)."""
    return built is None or built == BY_COLUMNS or (type(built) is Offset and not built.told)


def _empty(tensor: Any) -> bool:
    return tensor is not None and not tensor.numel()


def rotary_truth(
    positions: torch.Tensor, mask: Any, new: int, past: int, built: str | Offset | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(target, wrong)`` for rotary positions given after a cache of ``past`` tokens (computed on the device).

    Only differences matter, so a cache built with transformers' own positions (a token's column, counting left
    padding) and one built with the mask's (real tokens before it) are both right, and a step continues either: the
    given positions are right when every real token's is its column's, or every one's is the mask's.  Else (a loop
    that does not advance its positions, or passes the same one at every step) the real tokens whose position is not
    ``target``'s are ``wrong``, ``target`` being the scheme the rows agree on: one position shared by rows whose mask
    positions differ counts columns (a shared ``arange``); else the mask's (per row, as generate builds them).
    Without a mask every token is real and both schemes are the column.  Where the cache is known to hold
    transformers' own positions (``built`` ``BY_COLUMNS``: its prompt was given none, so its real tokens sit at their
    columns, left padding counted), the mask's scheme is shifted by each row's leading pads, as its prompt was:
    ``target`` is that, which is the column on a left-padded row and the mask's on a row without leading pads (right
    padding, or a pad fed after the prompt), and the mask's own positions are wrong on a left-padded row.  Where it is
    known to hold the mask's (``BY_MASK``: its prompt was given them), ``target`` is the mask's, and the columns are
    wrong on a row with a pad before a real token; where it holds a scheme's plus ``d`` (``built`` an
    :class:`~._types.Offset`: its prompt was given them), both are shifted by ``d``, and where the prompt told the
    mask's (``told``) only the mask's plus ``d`` are right, as after ``BY_MASK``.
    """
    offset = offset_of(built)
    column = torch.arange(past + offset, past + offset + new, device=positions.device).unsqueeze(0)
    if positions.dim() == 1:  # one row for every row
        positions = positions.unsqueeze(0)
    if mask is None:
        return column, positions != column
    counted = mask.long().cumsum(-1)
    derived = counted[:, -new:] - 1 + offset
    if built == BY_COLUMNS:
        derived = derived + (counted == 0).sum(-1, keepdim=True)  # (the row's leading pads)
    real = mask[:, -new:] != 0
    either = (~real | (positions == derived)).all()  # one scheme, every row: the mask's (shifted, after columns)
    if _columns_continue(built):
        either = either | (~real | (positions == column)).all()  # or the columns
    if built is not None and (type(built) is not Offset or built.told):
        target = derived
    else:
        shared = (positions == positions[:1]).all() & (derived != derived[:1]).any()
        target = torch.where(shared, column, derived)
    return target, real & (positions != target) & ~either


def _settle_rotary(step: ValueStep, policy: Policy, decode: bool, repairs: list[Repair]) -> tuple[Any, Report | None]:
    """Rotary positions given after a cache: repaired where they are neither scheme's (:func:`rotary_truth`); on a
    decode step on the device without a read (a :class:`Report` for the caller), else read at once (strict:
    :class:`PositionError`)."""
    positions, mask, past, built = step.positions, step.mask, step.past, step.built
    if not policy.compiling and on_host(positions, mask) and _either_scheme(positions, mask, step.new, past, built):
        return positions, None  # read on the host (a list scan: nothing to wait for), and right: nothing to do
    target, wrong = rotary_truth(positions, mask, step.new, past, built)  # type: ignore[arg-type]
    truth = _truth(mask, built)
    if policy.compiling or (decode and not policy.check_values and not policy.strict):
        repaired = torch.where(wrong, target, positions)
        return repaired, None if policy.compiling else Report(wrong, positions, target, past, truth)
    if not bool(wrong.any()):
        return positions, None
    return _repair_cached(positions, target, wrong, past, truth, policy.strict, repairs), None


def on_host(positions: Any, mask: Any) -> bool:
    """Whether the step's values are read on the host (CPU memory: a read waits for nothing), as :mod:`._reads`
    chooses its reader."""
    return _reads.reader_for(Question(None, None, positions, False, False, mask, 0, None, None)) is _reads.read_on_host


def _either_scheme(positions: torch.Tensor, mask: Any, new: int, past: int, built: str | Offset | None) -> bool:
    """:func:`rotary_truth`'s "right" on the host: every real token's given position is its column's (not after a
    cache ``built`` with the mask's, or offset from them), or every one's is the mask's (shifted by its row's leading
    pads after one built with the columns, by the offset after one built with that): list scans of the positions and
    the mask."""
    given = positions.tolist()
    if positions.dim() == 1:
        given = [given]
    offset = offset_of(built)
    column = list(range(past + offset, past + offset + new))
    if mask is None:
        return all(row == column for row in given)
    rows = mask.tolist()
    if len(given) == 1:
        given = given * len(rows)
    as_columns, as_mask = _columns_continue(built), True
    for row, values in zip(rows, given):
        before = sum(row[:-new]) + offset  # (the cached tokens' real ones, and the cache's offset)
        if built == BY_COLUMNS and 1 in row:
            before += row.index(1)  # (the row's leading pads: its prompt's real tokens sit at their columns)
        for value, flag, at in zip(values, row[-new:], column):
            before += flag
            if flag:
                as_columns = as_columns and value == at
                as_mask = as_mask and value == before - 1
        if not (as_columns or as_mask):
            return False
    return True


def cache_position_kept(cache_position: Any, past: int | None, new: int) -> bool:
    """Whether :func:`settle_cache_position` leaves ``cache_position`` as it is without reading a device: none given,
    nothing to judge it by (no cache, or one whose length cannot be told), or on the host ``arange(past, past + new)``.
    (Eager calls only: it reads the host's values.)"""
    if cache_position is None or not past or cache_position.dim() != 1:
        return True
    return on_host(cache_position, None) and cache_position.tolist() == list(range(past, past + new))


def settle_cache_position(cache_position: Any, past: int | None, new: int, policy: Policy, repairs: list[Repair]) -> Any:
    """``cache_position`` after a cache of ``past`` tokens must be ``arange(past, past + new)``: the releases that take
    it (4.36 - 4.57) build the causal mask and, without positions, the positions from it.  One that is not (a loop
    that does not advance it) is replaced: on an accelerator's decode step on the device and unread (the values are
    known from shapes; a right one is replaced by the same values), else read at once and said once (strict:
    :class:`PositionError`).  Untouched where the cache's length cannot be told (static caches)."""
    if cache_position is None or not past or cache_position.dim() != 1:
        return cache_position
    if policy.compiling or not (on_host(cache_position, None) or policy.strict or policy.check_values):
        return torch.arange(past, past + new, device=cache_position.device)
    given = cache_position.tolist()
    if given == list(range(past, past + new)):
        return cache_position
    described = (
        f"cache_position is {given if new <= 4 else given[:4] + ['...']} at a step after {past} cached tokens, but "
        f"this step's tokens are at {past} to {past + new - 1} of the cache"
    )
    fix = "pass cache_position = torch.arange(cached, cached + new_tokens), or leave it out (the model counts it)"
    if policy.strict:
        raise PositionError(f"{described}: {fix}")
    # (not "your loop": generate's own is wrong after candidate decoding on transformers 4.39 - 4.40)
    said = f"neofix: {described}; used those. Where your code passes it: {fix}. Reported once."
    repairs.append(Repair(CACHE_POSITION_VALUES, said))
    return torch.arange(past, past + new, device=cache_position.device)


def check_positions_fit(positions: Any, past_the_table: SequenceTooLongError, compiling: bool) -> None:
    """A step of more tokens than the position table, where only the positions looked up are bounded by it
    (:func:`~._align.check_cache`): raise ``past_the_table`` (its columns' error) unless every position the step
    looks up fits, or the error naming the position that does not.  ``None`` (transformers' own: the columns) and a
    compiled step (nothing is read there) are refused on their columns.  Reads the positions once: only steps wider
    than the table get here."""
    if positions is None or compiling:
        raise past_the_table
    highest, size = int(positions.max()), past_the_table.max_positions
    if highest >= size:
        past = past_the_table.past
        raise sequence_too_long(past, past_the_table.total - past, size, highest)


def sequence_too_long(
    past: int, new: int, max_positions: int, highest: int | None = None, why: str = ""
) -> SequenceTooLongError:
    """The error for a step past the position table: its tokens (``highest`` ``None``) or, where only positions are
    bounded, the ``highest`` position it would look up; ``why``: a family's reason, said last."""
    columns = highest is None  # (the sequence's columns are bounded, not only its positions)
    if columns:
        reach = f"reach sequence length {past + new}"
        highest = past + new - 1
    else:
        reach = f"look up position {highest} (each row's positions count its real tokens)"
    fit = max(max_positions - (highest + 1 - new), 0)
    error = SequenceTooLongError(
        f"this step would {reach} (the cache holds {counted(past, 'token')} and the step feeds {new}), but "
        f"config.max_position_embeddings is {max_positions}: {fit} more new token{' fits' if fit == 1 else 's fit'}; "
        f"shorten the prompt or generate fewer tokens{why}"
    )
    error.past, error.total, error.max_positions, error.columns = past, highest + 1, max_positions, columns
    return error


def check_values(facts: Facts, input_ids: Any, token_types: Any, positions: Any, mask: Any, limits: Limits) -> None:
    """Raise for token ids, token types or positions outside their tables, or a mask of values other than 0 and 1."""
    if facts.ids is not None and not (0 <= facts.ids[0] and facts.ids[1] < limits.vocab_size):
        raise_token_id_error(input_ids, limits.vocab_size)
    if facts.types is not None and not (0 <= facts.types[0] and facts.types[1] < limits.vocab_size):
        raise_token_id_error(token_types, limits.vocab_size, name="token_type_ids")
    if facts.positions is not None and not (0 <= facts.positions[0] and facts.positions[1] < limits.max_positions):  # type: ignore[operator]
        raise_position_range_error(positions, limits.max_positions)  # type: ignore[arg-type]
    if not facts.binary:
        _raise_mask_value_error(mask)


def _positions_from(
    facts: Facts, step: ValueStep, compare: bool, derive: bool, policy: Policy, repairs: list[Repair]
) -> Any:
    """The positions the facts call for: given ones repaired where they disagree with the mask, missing ones derived
    from a mask with left padding, else the step's own (``None``: transformers' own, which are the mask's)."""
    mask = step.mask
    if positions_kept(facts, compare, derive, step.built):
        return step.positions
    if compare and facts.wrong:
        derived, real = step_truth(mask, step.new, step.past, step.positions, step.cache_position)  # type: ignore[misc]
        wrong = real & (step.positions != derived)
        return _repair_cached(step.positions, derived, wrong, step.past, _truth(mask), policy.strict, repairs)
    if compare and facts.counts_pads:
        return _repair_counted_padding(step.positions, mask, facts.counts_pads, policy.strict, repairs)
    # (derive, with left padding: without it every real token sits at its column, and transformers' own are right)
    if step.past == 0:
        if policy.uncached_positions == "transformers":
            return None
        repairs.append(Repair(POSITIONS_DERIVED, lambda: _from_mask_message(mask)))
    else:
        repairs.append(Repair(POSITIONS_DERIVED, ""))  # said at prefill: a chunk continues the rows as they are
    return _derived(step)


def _settle_without_reading(step: ValueStep, compare: bool, derive: bool, repairs: list[Repair]) -> Settled:
    """A decode step: given positions compared and repaired on the device (reported later), missing ones derived."""
    if compare:
        return _repaired_on_device(step.positions, step.mask, step.past, step.cache_position)
    if derive:
        repairs.append(Repair(POSITIONS_DERIVED, ""))
        return Settled(_derived(step), None, ())
    return Settled(step.positions, None, ())


def _repaired_on_device(positions: torch.Tensor, mask: Any, past: int | None, slots: Any) -> Settled:
    truth = step_truth(mask, 1, past, positions, slots)
    if truth is None:
        return Settled(positions, None, ())
    derived, real = truth
    wrong = real & (positions != derived)
    repaired = torch.where(wrong, derived, positions)
    return Settled(repaired, Report(wrong, positions, derived, past, _truth(mask)), ())


def _positions_on_device(step: ValueStep, compare: bool, derive: bool) -> Any:
    """Inside ``torch.compile``: the positions an eager step ends with, computed on the device only."""
    if compare and step.past != 0:
        truth = step_truth(step.mask, step.new, step.past, step.positions, step.cache_position)
        if truth is not None:
            derived, real = truth
            return torch.where(real & (step.positions != derived), derived, step.positions)
    if derive:
        return _derived(step)
    return step.positions


# -- positions from the mask -----------------------------------------------------------------------------------------


def _derived(step: ValueStep) -> torch.Tensor:
    """Missing positions of a step: the mask's (:func:`mask_positions`), plus the offset its cache was built with."""
    positions = mask_positions(step.mask, step.new, step.past, step.cache_position)
    return positions + step.built.by if type(step.built) is Offset else positions


def derive_positions(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Positions of the last ``new_tokens`` columns of a 2D mask: ``cumsum(mask) - 1``, pads clamped to 0."""
    positions = attention_mask.long().cumsum(-1)[:, -new_tokens:] - 1
    return positions.clamp_(min=0)


def mask_positions(mask: torch.Tensor, new: int, past: int | None, cache_position: Any) -> torch.Tensor:
    """Positions of the last ``new`` columns of a 2D mask: a real token's is the number of real tokens before it; a
    pad keeps the position transformers gives it (``cache_position`` where the release passes it, else its column,
    ``arange(p, p + q)``).

    Only real tokens' positions are changed, and each from the columns up to it alone: so a chunk after a cache gives
    every token, pads included, the position the same token gets in one forward without a cache (a pad's position
    changes no real token's output, for pads are masked out as keys, but it does change the pad's own, which some
    heads read: QA takes a softmax over every column), and an unpadded or right-padded row computes exactly what it
    computes unpatched, bit for bit.
    """
    whole = mask.shape[-1] == new  # (a forward without a cache: no columns to drop)
    counted = (mask if mask.dtype is torch.long else mask.long()).cumsum(-1)
    slots = cache_position if cache_position is not None and cache_position.dim() == 1 else None
    derived = counted.sub_(1) if whole else new_columns(counted, new, past, slots) - 1
    if slots is not None:
        own = slots.to(derived.dtype)
    elif past is not None:
        own = torch.arange(past, past + new, device=derived.device)
    else:  # a cache whose length and slots cannot be told: transformers' own neither; pads before a real token at 0
        return derived.clamp_(min=0)
    return torch.where((mask if whole else new_columns(mask, new, past, slots)) != 0, derived, own)  # (own: one row)


def _from_mask_message(mask: torch.Tensor) -> str:
    row = int((mask[:, 1:].long() > mask[:, :-1].long()).any(-1).nonzero()[0, 0])  # once per process: a read is fine
    values = [bool(value) for value in mask[row].tolist()]  # (the row has a real token: its pads come before one)
    first, last = values.index(True), len(values) - 1 - values[::-1].index(True)
    gap = False in values[first:last]  # a pad between two real tokens
    padded = "has a pad between its real tokens (a gap in its mask)" if gap else "is left-padded"
    return (
        f"neofix: row {row} of this forward {padded} and no position_ids were given: neofix gave its real tokens "
        f"positions from the attention mask (each one's: the number of real tokens before it) instead of "
        f"transformers' own, which count the pads, so that its real tokens sit at the positions they have alone (a "
        f"left-padded row computes and decodes as it would alone). Logits and losses of such rows therefore differ "
        f"from an unpatched run. "
        f"To choose positions yourself pass position_ids; neofix.configure(uncached_positions='transformers') keeps "
        f"transformers' own for every forward without a cache. Reported once."
    )


def _repair_cached(
    positions: torch.Tensor,
    derived: torch.Tensor,
    wrong: torch.Tensor,
    past: int | None,
    truth: str,
    strict: bool,
    repairs: list[Repair],
) -> torch.Tensor:
    described = describe_wrong(wrong, positions, derived, past, truth)
    if strict:
        raise PositionError(f"{described}: {_WORDS[truth][3]}")
    repairs.append(Repair(POSITION_VALUES, repaired_message(described, truth)))
    return torch.where(wrong, derived, positions)


def describe_wrong(
    wrong: torch.Tensor, given: torch.Tensor, derived: torch.Tensor, past: int | None, truth: str = BY_MASK
) -> str:
    """Words for the first wrong position of a cached step (reads a few values: an error or a one-time warning)."""
    row, column = (int(i) for i in wrong.nonzero()[0])
    value = int(torch.broadcast_to(given, wrong.shape)[row, column])
    expected = int(torch.broadcast_to(derived, wrong.shape)[row, column])
    return describe_position(row, column, value, expected, past, truth)


def _truth(mask: Any, built: str | Offset | None = None) -> str:
    if type(built) is Offset:
        return BY_OFFSET
    return BY_COUNT if mask is None else BY_COLUMNS if built == BY_COLUMNS else BY_MASK


_CAUSE = "arange over a left-padded batch, or a loop that does not increment its positions?"
_AFTER_OWN = (
    "the prompt was given no position_ids, so transformers gave its real tokens their columns (left padding counted), "
    "and the cache holds those: pass none at any step, or the mask's from the prompt on"
)
_WORDS = {  # truth -> (the words for where the token is, what was used, the likely cause, the fix)
    BY_MASK: ("the attention mask puts that real token of row {row} at position {expected}", "the mask's positions",
              _CAUSE, _FIX_VALUES),
    BY_COLUMNS: ("the cache holds transformers' own positions, which put that real token of row {row} at position "
                 "{expected}", "the cache's", "the mask's positions after a prompt given none, or a loop that does "
                 "not increment its positions?", _AFTER_OWN),
    BY_COUNT: ("with no attention mask every token is real, so that token is at position {expected}",
               "positions continuing after the cache", _CAUSE, _FIX_VALUES),
    BY_OFFSET: ("the cache holds the positions its prompt was given, each real token's count of real tokens before it "
                "plus the same number, which put that real token of row {row} at position {expected}",
                "those, continued",
                "a loop that does not increment its positions, or drops the offset?",
                "after a prompt given the mask's positions plus a number, pass the same number added at every step, "
                "or pass none and neofix continues them"),
}


def describe_position(row: int, column: int, value: int, expected: int, past: int | None, truth: str) -> str:
    after = "" if past is None else f" at the step after {past} cached tokens"
    return f"position_ids[{row}, {column}] is {value}{after}, but {_WORDS[truth][0].format(row=row, expected=expected)}"


def repaired_message(described: str, truth: str = BY_MASK) -> str:
    _, used, cause, fix = _WORDS[truth]
    return f"neofix: {described} ({cause}); used {used}. To fix your loop: {fix}. Reported once."


def _repair_counted_padding(
    positions: torch.Tensor, mask: torch.Tensor, rows: tuple[int, ...], strict: bool, repairs: list[Repair]
) -> torch.Tensor:
    real = mask != 0
    firsts = [_first_past_a_pad(real[row].tolist()) for row in rows]
    row, (column, count) = rows[0], firsts[0]
    given = int(torch.broadcast_to(positions, mask.shape)[row, column])
    named = f"row {row}" if len(rows) == 1 else f"rows {', '.join(map(str, rows))}"
    if not any(before for _, before in firsts):  # each named row goes wrong at its first real token: left padding
        padding, batch = "left padding", "a left-padded batch: the classic batched-generation bug"
    else:
        padding, batch = "padding", "a padded batch"
    if not count:  # the first named row is left-padded
        token = f"the first real token of row {row} is at position {given}, but the attention mask puts it at 0"
    else:  # a gap: pads between real tokens
        token = (
            f"the real token of row {row} at column {column}, after a gap in its mask, is at position {given}, but "
            f"the attention mask puts it at {count}"
        )
    described = f"position_ids count the {padding} of {named}: {token} (arange over {batch})"
    if strict:
        raise PositionError(f"{described}; {_FIX_VALUES}")
    repairs.append(
        Repair(
            POSITIONS_COUNT_PADDING,
            f"neofix: {described}; derived {'its' if len(rows) == 1 else 'their'} positions from the mask. To fix "
            f"your code: {_FIX_VALUES}. Reported once.",
        )
    )
    bad_rows = torch.zeros(mask.shape[0], 1, dtype=torch.bool, device=mask.device)
    bad_rows[list(rows)] = True
    return torch.where(bad_rows & real, derive_positions(mask, mask.shape[-1]), positions)


def _first_past_a_pad(real: list[bool]) -> tuple[int, int]:
    """``(column, real tokens before it)`` of a row's first real token that comes after a pad (the row's last column
    where none does)."""
    count = 0
    for column, is_real in enumerate(real):
        if is_real and column != count:
            break
        count += is_real
    return column, count


def _raise_mask_value_error(mask: torch.Tensor) -> None:
    bad = ((mask != 0) & (mask != 1)).nonzero()
    row, column = (int(i) for i in bad[0])
    value = mask[row, column].item()
    raise MaskValueError(
        f"attention_mask[{row}, {column}] is {value}, but a 2D attention mask holds 1 for a real token and 0 for "
        f"padding, nothing else. An additive mask (0 and -inf or a large negative number) is the model's own "
        f"internal form: pass the tokenizer's attention_mask, or (additive_mask == 0).long()"
    )


# -- errors naming a value (they read: they only run when a step fails) --------------------------------------------


def _first_outside(values: torch.Tensor, size: int) -> tuple[str, int] | None:
    """``("[row, column]", value)`` of the first entry outside ``[0, size)``, or None (synchronises)."""
    bad = ((values < 0) | (values >= size)).nonzero()
    if not len(bad):
        return None
    index = tuple(bad[0].tolist())
    return "[" + ", ".join(str(i) for i in index) + "]", int(values[index])


def raise_token_id_error(
    ids: torch.Tensor, vocab_size: int, cause: BaseException | None = None, *, name: str = "input_ids"
) -> None:
    """Raise :class:`TokenIdError` for the first id of ``ids`` outside ``[0, vocab_size)`` (if there is one)."""
    first = _first_outside(ids, vocab_size)
    if first is None:
        return
    where, value = first
    fix = (
        "Check that the tokenizer belongs to this model (len(tokenizer) <= vocab_size) and that pad_token_id is a "
        "valid id"
        if name == "input_ids"
        else "This model embeds token types with the token embedding, so they must be token ids too"
    )
    raise TokenIdError(
        f"{name}{where} is {value}, outside the vocabulary: config.vocab_size is {vocab_size}, so token ids must "
        f"lie in [0, {vocab_size - 1}]. {fix}"
    ) from cause


def raise_position_range_error(positions: torch.Tensor, max_positions: int, cause: BaseException | None = None) -> None:
    """Raise :class:`PositionError` for the first position outside ``[0, max_positions)`` (if there is one)."""
    first = _first_outside(positions, max_positions)
    if first is None:
        return
    where, value = first
    raise PositionError(
        f"position_ids{where} is {value}, outside the position table: config.max_position_embeddings is "
        f"{max_positions}, so positions must lie in [0, {max_positions - 1}]. Derive them from the attention mask "
        f"((mask.cumsum(-1) - 1).clamp(min=0)), or pass none and neofix derives them"
    ) from cause


def explain_index_error(
    cause: IndexError,
    limits: Any,
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> None:
    """Turn an ``IndexError`` from an embedding lookup into the :class:`NeofixError` naming the bad value.

    Steps that skipped the value checks (single-token decode steps, by default) reach the embedding with whatever
    they were given; on the CPU an id or position outside its table surfaces as ``IndexError: index out of range in
    self``.  Returns (the caller re-raises ``cause``) when every value is in range.
    """
    if input_ids is not None:
        raise_token_id_error(input_ids, limits.vocab_size, cause)
    if token_type_ids is not None:
        raise_token_id_error(token_type_ids, limits.vocab_size, cause, name="token_type_ids")
    if position_ids is not None and limits.max_positions is not None:
        raise_position_range_error(position_ids, limits.max_positions, cause)
