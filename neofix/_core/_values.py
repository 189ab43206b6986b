"""Values: what the tensors hold (token ids, mask values, positions), as opposed to their shapes.

Reading a value off an accelerator is a host-device synchronisation.  So a step reads values at most once, and only
where that is cheap: on prefill and multi-token steps every check the step needs is gathered into one tensor and read
in one go (token ids, mask values, whether the mask has left or right padding, whether given positions agree with the
mask).  A single-token decode step reads nothing (unless ``check_values`` or strict mode asks): given positions are
compared with the mask's on the device and repaired there (``torch.where``), and the comparison is handed back as a
:class:`~neofix._core.Report` for the caller to read when that costs nothing.
"""

from __future__ import annotations

import array
import operator
from typing import Any, NamedTuple

import torch

from .._errors import MaskValueError, PositionError, TokenIdError
from ._types import (
    POSITION_VALUES,
    POSITIONS_COUNT_PADDING,
    POSITIONS_DERIVED,
    Limits,
    Policy,
    Repair,
    Report,
)

FIX_POSITIONS = "pass only the new tokens' positions, or none at all and neofix derives them from the mask"
_FIX_VALUES = (
    "positions must advance by one per real token: derive them from the attention mask "
    "((mask.cumsum(-1) - 1).clamp(min=0)), or pass none and neofix derives them"
)


#: The kinds of positions (:class:`Policy`) whose given values are compared with the mask's
COMPARED_KINDS = ("absolute", "mask")


def derive_positions(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Positions of the last ``new_tokens`` columns of a 2D mask: ``cumsum(mask) - 1``, pads clamped to 0."""
    positions = attention_mask.long().cumsum(-1)[:, -new_tokens:] - 1
    return positions.clamp_(min=0)


class _Step(NamedTuple):
    """What the value step works on (see :func:`settle`)."""

    input_ids: Any
    token_types: Any
    positions: Any
    given: bool
    mask: Any
    new: int
    past: int | None
    cache_position: Any
    limits: Limits
    policy: Policy


class Settled(NamedTuple):
    positions: Any
    values_read: bool
    report: Report | None
    right_padded: tuple[int, ...]
    repairs: tuple[Repair, ...] = ()  # made by read_prefill (the other steps append to the caller's list)


_UNCHANGED = Settled(None, True, None, ())

# A NamedTuple's own constructor is a Python function: read_prefill, which runs on every forward without a cache,
# builds its tuples directly (what that function does), at a fraction of its cost right after a forward.
_new = tuple.__new__

#: A chunk's positions derived from the mask: said at prefill (a chunk continues the rows as they are), so silent.
_DERIVED_IN_CHUNK = Repair(POSITIONS_DERIVED, "")
_DERIVED_IN_CHUNK_ONLY = (_DERIVED_IN_CHUNK,)
#: What a chunk is settled to that passes as it is: positions transformers makes right (and any a family makes), or
#: the caller's, where every check passes.
_CHUNK_UNCHANGED = Settled(None, True, None, ())


def settle(
    input_ids: Any,
    token_types: Any,
    positions: Any,
    given: bool,
    mask: Any,
    new: int,
    past: int | None,
    cache_position: Any,
    limits: Limits,
    policy: Policy,
    repairs: list[Repair],
) -> Settled:
    """The step's positions, after every value check the step gets.

    ``positions`` are the caller's (``given``), or ``None`` (derive them from the 2D ``mask`` where one is given),
    or positions already made from shapes (``given`` False: a step without a mask).  ``mask`` is the aligned 2D mask
    or ``None``.
    """
    decode = new == 1 and past != 0
    # generate's own positions are compared on its prefill only (they may be the caller's), not on its decode steps
    kind = policy.positions
    compare = given and kind in COMPARED_KINDS and (not policy.trusted_positions or past == 0)
    if not given and kind != "absolute":  # positions the model makes itself (from the mask, or counting from 0)
        if policy.compiling or (decode and not policy.check_values):
            return Settled(positions, False, None, ())
        if prefill_fits(past, positions, token_types, input_ids, mask):
            return read_prefill(input_ids, mask, limits, policy.uncached_positions, past, derive=False)  # type: ignore[arg-type]
        step = _Step(input_ids, token_types, positions, given, mask, new, past, cache_position, limits, policy)
        return _read_once(step, False, repairs, derive=False)
    if policy.compiling:
        return Settled(_without_reading(positions, given, compare, mask, new, past, cache_position), False, None, ())
    if decode and not policy.check_values and not (compare and policy.strict):
        if given:
            if compare:
                return _repaired_on_device(positions, mask, past)
            return Settled(positions, False, None, ())
        if mask is None:
            return Settled(positions, False, None, ())
        repairs.append(Repair(POSITIONS_DERIVED, ""))
        return Settled(_decode_positions(mask, past, cache_position), False, None, ())
    if prefill_fits(past, positions, token_types, input_ids, mask):
        settled = read_prefill(input_ids, mask, limits, policy.uncached_positions, past)  # type: ignore[arg-type]
        repairs += settled.repairs
        return settled
    step = _Step(input_ids, token_types, positions, given, mask, new, past, cache_position, limits, policy)
    return _read_once(step, compare, repairs)


def _row_padding(rows: list[list[int]], real: list[int], width: int) -> tuple[bool, bool, tuple[int, ...]] | None:
    """Where a 0/1 mask read as lists has padding: ``(left, after, right_padded)``, or ``None`` if a value is neither
    0 nor 1.  ``left``: a pad followed by a real token somewhere; ``after``: a real token followed by a pad
    somewhere; ``right_padded``: the rows with a real token followed by a pad that end in a pad.  ``real`` holds each
    row's count of ones.  What the torch path computes with ``diff`` and ``aminmax``, in list searches at C speed
    (a torch operation costs tens of microseconds on the CPU right after a forward); a row of pads then real tokens,
    the usual left padding, takes two of them."""
    left = after = False
    right: list[int] = []
    for index, (row, ones) in enumerate(zip(rows, real)):
        pads = width - ones
        if row.count(0) != pads:
            return None
        if not pads or not ones:
            continue
        first = row.index(1)
        if first == pads:  # pads, then as many real tokens as the row holds: the usual left padding
            left = True
            continue
        # the first real token comes before the last pad: a real token is followed by a pad
        after = True
        if first or row.index(0) != ones:  # not real tokens then pads: a pad is followed by a real token too
            left = True
        if not row[-1]:
            right.append(index)
    return left, after, tuple(right)


_count_ones = operator.methodcaller("count", 1)

#: ``(counts, table)``: 0, 1, 2, ... as a list, and as the bytes of int64 values after as many zeros (from
#: ``8 * (n - pads)`` on, a row of ``pads`` pads then real tokens' positions), as long as the widest mask read so far
#: (see :func:`_counting`).
_COUNTING: tuple[list[int], memoryview] = ([], memoryview(b""))


def _counting(width: int) -> tuple[list[int], memoryview]:
    """:data:`_COUNTING`, at least ``width`` long.  Grown by rebinding, never in place: a thread reading the old one
    reads the right values.  It holds about 60 bytes per column of the widest mask seen."""
    global _COUNTING
    counting = _COUNTING
    if len(counting[0]) < width:
        size = max(width, 2 * len(counting[0]), 64)
        table = memoryview(bytes(8 * size) + array.array("q", range(size)).tobytes())
        counting = _COUNTING = (list(range(size)), table)
    return counting


#: Read CPU tensors' reductions one by one (tests turn it off to run the path accelerators take, on the CPU).
READ_SCALARS_ON_CPU = True


def prefill_fits(past: int | None, positions: Any, token_types: Any, input_ids: Any, mask: Any) -> bool:
    """Whether :func:`read_prefill` handles the step: a prefill, or a multi-token step after a cache (a chunk), with
    no positions or token types, long ``input_ids`` and a long 2D mask over the cached plus new tokens, or none on a
    prefill (shapes and dtypes only)."""
    if positions is not None or token_types is not None or input_ids is None:
        return False
    return shapes_fit(past, input_ids, input_ids.shape, mask, None if mask is None else mask.shape)


def shapes_fit(past: int | None, input_ids: Any, shape: Any, mask: Any, mask_shape: Any) -> bool:
    """:func:`prefill_fits` once positions and token types are known to be absent, from shapes already read
    (``shape``: ``input_ids.shape``; ``mask_shape``: ``mask.shape``, or ``None`` without a mask).  A forward's fast
    path reads each shape once: reading one builds a ``torch.Size``, and costs microseconds right after a forward."""
    if input_ids.dtype != torch.long:
        return False
    if past == 0:
        return mask is None or (mask.dtype == torch.long and mask_shape == shape)
    return (
        past is not None
        and shape[-1] > 1
        and mask is not None
        and mask.dtype == torch.long
        and mask_shape[-1] == past + shape[-1]
    )


if hasattr(torch.Tensor, "is_cpu"):
    # ``tensor.device`` builds a device object: several times slower right after a forward; attrgetter is C
    _on_cpu = operator.attrgetter("is_cpu")

else:  # pragma: no cover - torch releases before Tensor.is_cpu

    def _on_cpu(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"


def read_prefill(
    input_ids: torch.Tensor,
    mask: Any,
    limits: Limits,
    uncached_positions: str = "mask",
    past: int = 0,
    derive: bool = True,
) -> Settled:
    """The values of the most common forward: a prefill without a cache (training, scoring, a loop's first forward)
    given long ``input_ids`` and a long 2D mask as wide as them (or none), and no positions; or a chunk of a prefill
    after ``past`` cached tokens, with the mask over the cached and new tokens.

    The checks of :func:`_read_once` in as few operations as they take.  On the CPU, where a read waits for
    nothing, but a torch reduction costs tens of microseconds right after a forward (its code has gone cold, measured
    in place: ``aminmax`` and two ``item()`` about 40, ``tolist()`` of a 2 x 32 mask about 5): the mask is read once
    as lists and searched at C speed (:func:`_row_padding`), and token ids are left to the embedding, whose
    ``IndexError`` the model forward explains.  NumPy, a byte comparison of the tensor's memory (ctypes), and
    ``torch.tensor`` of lists were tried and cost more there.  Elsewhere torch operations and one read.  (A chunk
    on the CPU with the usual mask is read by :func:`neofix._wrappers.plain_forward`, which builds a left-padded
    chunk's positions from the lists.)  Returns positions ``None`` where transformers' own are the mask's already (no left padding).  The
    repair it may add (``positions_derived``, warned once on a prefill) is in the returned ``repairs``.
    """
    if READ_SCALARS_ON_CPU and _on_cpu(input_ids) and (mask is None or _on_cpu(mask)):
        # Token ids are not read here: on the CPU an id outside the vocabulary raises IndexError in the embedding
        # lookup before anything else runs, and the model forward names it (explain_index_error), as on decode steps.
        if mask is None:
            return _UNCHANGED
        rows = mask.tolist()  # the one read
        width = len(rows[0]) if rows else 0
        # The usual masks in one pass: each row all real tokens, or pads then real tokens (left padding)
        left = after = False
        right_padded: tuple[int, ...] = ()
        for row in rows:
            ones = row.count(1)
            if ones == width:
                continue
            if not ones or row.count(0) + ones != width or row.index(1) != width - ones:
                # a row of pads only, a pad after a real token, or a value neither 0 nor 1: searched row by row
                real = list(map(_count_ones, rows))
                padding = _row_padding(rows, real, width)
                if padding is None:
                    _raise_mask_value_error(mask)
                left, after, right_padded = padding  # type: ignore[misc]
                break
            left = True
        else:
            if not left:  # every token real: nothing else to learn
                return _UNCHANGED
    else:
        batch = input_ids.shape[0]
        if not batch:  # no rows: nothing to read (a reduction over nothing raises), nothing to derive
            return _UNCHANGED
        if mask is None:
            values = torch.stack(torch.aminmax(input_ids)).tolist()  # the one read
            if not (0 <= values[0] and values[1] < limits.vocab_size):
                raise_token_id_error(input_ids, limits.vocab_size)
            return _UNCHANGED
        if mask.shape == input_ids.shape:  # ids and mask: min, max
            low, high = torch.aminmax(torch.stack((input_ids, mask)).view(2, -1), dim=-1)
        else:  # a chunk: the mask covers the cache too
            low, high = (torch.stack(pair) for pair in zip(torch.aminmax(input_ids), torch.aminmax(mask)))
        parts = [low, high]
        if mask.shape[-1] > 1:
            parts += [*torch.aminmax(torch.diff(mask, dim=-1), dim=-1), mask[:, -1]]
        values = torch.cat(parts).tolist()  # the one read
        low_id, low_mask, high_id, high_mask = values[:4]
        if not (0 <= low_id and high_id < limits.vocab_size):
            raise_token_id_error(input_ids, limits.vocab_size)
        if not (0 <= low_mask and high_mask <= 1):
            _raise_mask_value_error(mask)
        if mask.shape[-1] < 2:
            return _UNCHANGED
        lows, highs, last = values[4 : 4 + batch], values[4 + batch : 4 + 2 * batch], values[4 + 2 * batch :]
        left, after = max(highs, default=0) > 0, min(lows, default=0) < 0  # a pad followed by a real token; a real token by a pad
        right_padded = tuple(row for row in range(batch) if lows[row] < 0 and not last[row])
    if past:
        right_padded = ()  # said at prefill: a chunk continues the rows as they are
    if not left or (uncached_positions == "transformers" and not past) or not derive:
        # every real token sits at its column: transformers' own positions (arange) are the mask's already
        return Settled(None, True, None, right_padded)
    derived = _DERIVED_IN_CHUNK if past else _new(Repair, (POSITIONS_DERIVED, lambda: _from_mask_message(mask)))
    if after:  # keep transformers' positions for pads after a row's last real token
        return Settled(_mask_positions(mask, input_ids.shape[-1], past, None), True, None, right_padded, (derived,))
    # Every row is pads then real tokens: a real token's position is the count of real tokens before it, and a pad's
    # (before the first real token) 0: ``(cumsum - 1).clamp(min=0)``, which is the cumsum one column earlier.  A
    # prefill has no column before its first: ``cumsum - mask`` (a fresh tensor, changed in place).  A chunk: the
    # cumsum's columns from the last cached one, a view.
    counted = mask.cumsum(-1)
    # (a slice: Python's basic indexing costs half of ``narrow`` right after a forward; the mask is past + new wide)
    positions = counted[:, past - 1 : -1] if past else counted.sub_(mask)
    return _new(Settled, (positions, True, None, right_padded, (derived,)))


def read_given(input_ids: torch.Tensor, positions: torch.Tensor, mask: Any) -> Settled | None:
    """The value checks of :func:`_read_once` for the caller's positions on a prefill on the CPU, where they all
    pass: positions that fit (long, 2D, one row or one per input row, a column per new token: the caller checks), and
    a 2D long mask as wide as the ids (or none).  Returns the positions
    unchanged, or ``None`` wherever ``_read_once`` could say or change anything (the general path then does, in its
    words): on an accelerator (where reading is a synchronisation), a mask with a row that is neither all real tokens
    nor pads then real tokens (right padding, a gap, a row of pads, a value neither 0 nor 1), a row whose positions
    count its left padding (``arange``).  A chunk after a cache: :func:`neofix._wrappers.plain_forward`.

    A torch operation costs tens of microseconds right after a forward on the CPU: the mask and the positions are
    read with one ``tolist()`` each, and searched at C speed (list comparisons), as :func:`read_prefill` reads the
    mask.  Token ids are left to the embedding, as there, and so is the range of the positions: only for a family
    that looks them up in its table of ``max_positions`` (absolute positions; the caller checks), where on the CPU
    one outside it raises ``IndexError`` before anything else runs, which the model forward names
    (:func:`explain_index_error`).  (A ``min`` and a ``max`` over the lists cost more than both reads.)  So a prefill
    whose every row is real tokens, which takes any positions, reads none.
    """
    if not (READ_SCALARS_ON_CPU and _on_cpu(input_ids) and _on_cpu(positions) and (mask is None or _on_cpu(mask))):
        return None
    if mask is None:  # every token real, at its column: any position in the table
        return _new(Settled, (positions, True, None, (), ()))
    pads_of = _left_pads(mask.tolist())  # the one read of the mask
    if pads_of is None:
        return None
    if any(pads_of):
        given = positions.tolist()  # the one read of the positions
        shared = given[0] if len(given) == 1 else None  # one row of positions for every row
        counts = _counting(len(given[0]))[0]
        for index, pads in enumerate(pads_of):
            own = given[index] if shared is None else shared
            if pads and own[pads:] == counts[pads : len(own)]:  # they count the padding: _read_once repairs them
                return None
    return _new(Settled, (positions, True, None, (), ()))


def _left_pads(rows: list[list[int]]) -> list[int] | None:
    """Each row's pads, where every row of a mask read as lists is real tokens, or pads then real tokens (at least
    one); else ``None`` (right padding, a gap, a row of pads, a value neither 0 nor 1)."""
    width = len(rows[0]) if rows else 0
    pads_of = []
    for row in rows:
        pads = width - row.count(1)
        if pads and (pads == width or row.count(0) != pads or row.index(1) != pads):
            return None
        pads_of.append(pads)
    return pads_of


# -- steps that read nothing -------------------------------------------------------------------------------------


def _decode_positions(mask: torch.Tensor, past: int | None, cache_position: Any) -> torch.Tensor:
    """The position of a single new token from the mask: real tokens so far minus one.  A masked new token (a
    finished row) keeps the position transformers gives it."""
    counted = mask.sum(-1, keepdim=True, dtype=torch.long) - 1
    if cache_position is not None and cache_position.dim() == 1:
        own = cache_position.unsqueeze(0).to(counted.dtype)
    elif past is not None:
        own = torch.full_like(counted, past)
    else:
        return counted.clamp_(min=0)
    return torch.where(mask[:, -1:] != 0, counted, own)


def _mask_positions(mask: torch.Tensor, new: int, past: int | None, cache_position: Any) -> torch.Tensor:
    """Positions of the last ``new`` columns from the mask, pads after a row's last real token kept as transformers
    gives them.

    A pad's position changes nothing for the real tokens (it is masked out), but it does change the pad's own
    logits and hidden states, which some heads read (QA takes a softmax over every column, pads included).  An
    unpadded or right-padded row then computes exactly what it computes unpatched, bit for bit.  transformers' own
    positions when none are given: ``cache_position`` where the release passes it, else ``arange(p, p + q)``.
    """
    if new == 1 and past != 0:
        return _decode_positions(mask, past, cache_position)
    derived = derive_positions(mask, new)
    if past is None:
        return derived
    if cache_position is not None and cache_position.dim() == 1:
        own = cache_position.unsqueeze(0)
    else:
        own = torch.arange(past, past + new, device=derived.device).unsqueeze(0)
    real = mask[:, -new:] != 0
    trailing = real.flip(-1).cumsum(-1).flip(-1) == 0  # no real token at or after this column
    return torch.where(trailing, own.to(derived.dtype), derived)


def _step_truth(mask: Any, new: int, past: int | None, like: torch.Tensor) -> tuple[Any, Any] | None:
    """``(derived, real)`` for comparing given positions at a cached step: the mask's positions of the new tokens and
    which of them are real; without a mask every token is real and positions continue after the cache."""
    if mask is not None:
        if new == 1:
            return mask.sum(-1, keepdim=True, dtype=torch.long) - 1, mask[:, -1:] != 0
        return mask.long().cumsum(-1)[:, -new:] - 1, mask[:, -new:] != 0
    if past is None:
        return None
    derived = torch.arange(past, past + new, device=like.device).unsqueeze(0)
    return derived, torch.ones_like(derived, dtype=torch.bool)


def _repaired_on_device(positions: torch.Tensor, mask: Any, past: int | None) -> Settled:
    truth = _step_truth(mask, 1, past, positions)
    if truth is None:
        return Settled(positions, False, None, ())
    derived, real = truth
    wrong = real & (positions != derived)
    repaired = torch.where(wrong, derived, positions)
    return Settled(repaired, False, Report(wrong, positions, derived, past, mask is not None), ())


def _without_reading(
    positions: Any, given: bool, compare: bool, mask: Any, new: int, past: int | None, cache_position: Any
) -> Any:
    """Inside ``torch.compile``: the same positions an eager step ends with, computed from shapes and on the device
    only (nothing read, nothing reported)."""
    if given:
        if not compare or past == 0:
            return positions
        truth = _step_truth(mask, new, past, positions)
        if truth is None:
            return positions
        derived, real = truth
        return torch.where(real & (positions != derived), derived, positions)
    if mask is None:
        return positions
    return _mask_positions(mask, new, past, cache_position)


# -- steps that read once ----------------------------------------------------------------------------------------


class _Reads:
    """Values gathered for the one read of a step, as 1-d tensors concatenated (integer dtypes promote to long) and
    read with one ``tolist()``; :meth:`read` returns them by name."""

    __slots__ = ("names", "parts")

    def __init__(self) -> None:
        self.names: list[tuple[str, int]] = []
        self.parts: list[torch.Tensor] = []

    def min_max(self, name: str, tensor: torch.Tensor) -> None:
        """``name_min`` and ``name_max``: the smallest and largest value of ``tensor``."""
        low, high = torch.aminmax(tensor.reshape(1, -1), dim=-1)
        self.parts += (low, high)
        self.names += ((name + "_min", 0), (name + "_max", 0))

    def rows_min_max(self, name: str, tensor: torch.Tensor) -> None:
        """``name_min`` and ``name_max``: per row of a 2D ``tensor``, lists of its smallest and largest values."""
        low, high = torch.aminmax(tensor, dim=-1)
        self.parts += (low, high)
        self.names += ((name + "_min", low.shape[0]), (name + "_max", high.shape[0]))

    def flag(self, name: str, tensor: torch.Tensor) -> None:
        self.parts.append(tensor.reshape(1))
        self.names.append((name, 0))

    def vector(self, name: str, tensor: torch.Tensor) -> None:
        self.parts.append(tensor)
        self.names.append((name, tensor.shape[0]))

    def read(self) -> dict[str, Any]:
        parts = self.parts
        if not parts:
            return {}
        values = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()  # the one read
        found: dict[str, Any] = {}
        start = 0
        for name, size in self.names:  # size 0: a single value
            if size:
                found[name] = values[start : start + size]
                start += size
            else:
                found[name] = values[start]
                start += 1
        return found


def _read_once(step: _Step, compare: bool, repairs: list[Repair], derive: bool = True) -> Settled:
    """Every value check of a step that may read (a prefill, a multi-token step, or one asked to read), in one read."""
    input_ids, token_types, positions, given, mask, new, past, cache_position, limits, policy = step
    if any(tensor is not None and not tensor.numel() for tensor in (input_ids, token_types, positions, mask)):
        # a batch of no rows (a step of no new tokens was refused before): no value to check, none to derive, and a
        # reduction over nothing raises; transformers runs (or refuses) it as it is
        return Settled(positions, False, None, ())
    reads = _Reads()
    if input_ids is not None:
        reads.min_max("ids", input_ids)
        if token_types is not None:
            reads.min_max("types", token_types)
    if given and limits.max_positions is not None:
        reads.min_max("positions", positions)
    prefill = past == 0
    cumsum = real = derived = wrong = None
    if mask is not None:
        if mask.dtype == torch.bool:
            steps = mask.to(torch.int8)
        elif mask.dtype.is_floating_point:
            reads.flag("mask_not_binary", ((mask != 0) & (mask != 1)).any())
            steps = mask.long()
        else:
            reads.min_max("mask", mask)
            steps = mask
        if mask.shape[-1] > 1:  # per row: +1 where a pad is followed by a real token (left padding), -1 the other way
            reads.rows_min_max("steps", torch.diff(steps, dim=-1))
            if prefill:  # with a real-to-pad step, a row ending in padding is right-padded
                reads.vector("last", mask[:, -1])
    if compare and not prefill:
        truth = _step_truth(mask, new, past, positions)
        if truth is not None:
            derived, real = truth
            wrong = real & (positions != derived)
            reads.flag("wrong", wrong.any())
    elif compare and mask is not None:  # prefill: rows whose positions count their left padding (arange)
        cumsum = mask.long().cumsum(-1)
        real = mask != 0
        leading = (cumsum == 0).sum(-1, keepdim=True)
        counts_pads = ((positions == cumsum - 1 + leading) | ~real).all(-1) & (leading[:, 0] > 0) & real.any(-1)
        reads.vector("counts_pads", counts_pads)
    found = reads.read()

    if input_ids is not None and not (0 <= found["ids_min"] and found["ids_max"] < limits.vocab_size):
        raise_token_id_error(input_ids, limits.vocab_size)
    if "types_min" in found and not (0 <= found["types_min"] and found["types_max"] < limits.vocab_size):
        raise_token_id_error(token_types, limits.vocab_size, name="token_type_ids")
    if "positions_min" in found and not (0 <= found["positions_min"] and found["positions_max"] < limits.max_positions):  # type: ignore[operator]
        raise_position_range_error(positions, limits.max_positions)  # type: ignore[arg-type]
    binary = "mask_min" not in found or (0 <= found["mask_min"] and found["mask_max"] <= 1)
    if found.get("mask_not_binary") or not binary:
        _raise_mask_value_error(mask)
    left_padded = max(found.get("steps_max", (0,))) > 0
    right_padded = ()
    if "last" in found:
        steps_and_last = zip(found["steps_min"], found["last"])
        right_padded = tuple(row for row, (low, last) in enumerate(steps_and_last) if low < 0 and not last)

    if given:
        if found.get("wrong"):
            positions = _repair_cached(positions, derived, wrong, past, mask is not None, policy.strict, repairs)  # type: ignore[arg-type]
        elif any(found.get("counts_pads", ())):
            positions = _repair_counted_padding(
                positions, mask, cumsum, real, found["counts_pads"], policy.strict, repairs  # type: ignore[arg-type]
            )
        return Settled(positions, True, None, right_padded)
    if positions is not None or mask is None or not derive:  # made from shapes (no mask), or the model's to make
        return Settled(positions, True, None, right_padded)
    if not left_padded:
        # every real token sits at its column: transformers' own positions (arange) are the mask's already
        return Settled(None, True, None, right_padded)
    if prefill:
        if policy.uncached_positions == "transformers":
            return Settled(None, True, None, right_padded)
        repairs.append(Repair(POSITIONS_DERIVED, lambda: _from_mask_message(mask)))
    else:
        repairs.append(Repair(POSITIONS_DERIVED, ""))
    if min(found.get("steps_min", (0,))) < 0:  # a pad after a real token somewhere: keep transformers' positions there
        return Settled(_mask_positions(mask, new, past, cache_position), True, None, right_padded)
    derived = mask.long().cumsum(-1)[:, -new:] - 1
    return Settled(derived.clamp_(min=0), True, None, right_padded)


def _from_mask_message(mask: torch.Tensor) -> str:
    row = int((mask[:, 1:].long() > mask[:, :-1].long()).any(-1).nonzero()[0, 0])  # once per process: a read is fine
    return (
        f"neofix: row {row} of this forward is left-padded and no position_ids were given: neofix gave its real tokens "
        f"positions from the attention mask (0, 1, 2, ... from the first real token) instead of transformers' own, "
        f"which count the padding, so that a padded row computes what it computes alone (and decodes as it would "
        f"alone). Logits and losses of left-padded rows therefore differ from an unpatched run. To choose positions "
        f"yourself pass position_ids; neofix.configure(uncached_positions='transformers') keeps transformers' own "
        f"for every forward without a cache. Reported once."
    )


def _repair_cached(
    positions: torch.Tensor,
    derived: torch.Tensor,
    wrong: torch.Tensor,
    past: int | None,
    from_mask: bool,
    strict: bool,
    repairs: list[Repair],
) -> torch.Tensor:
    described = describe_wrong(wrong, positions, derived, past, from_mask)
    if strict:
        raise PositionError(f"{described}: {_FIX_VALUES}")
    repairs.append(Repair(POSITION_VALUES, repaired_message(described, from_mask)))
    return torch.where(wrong, derived, positions)


def describe_wrong(
    wrong: torch.Tensor, given: torch.Tensor, derived: torch.Tensor, past: int | None, from_mask: bool = True
) -> str:
    """Words for the first wrong position of a cached step (reads a few values: an error or a one-time warning)."""
    row, column = (int(i) for i in wrong.nonzero()[0])
    value = int(torch.broadcast_to(given, wrong.shape)[row, column])
    expected = int(torch.broadcast_to(derived, wrong.shape)[row, column])
    return describe_position(row, column, value, expected, past, from_mask)


def describe_position(row: int, column: int, value: int, expected: int, past: int | None, from_mask: bool) -> str:
    after = "" if past is None else f" at the step after {past} cached tokens"
    truth = (
        f"the attention mask puts that real token of row {row} at position {expected}"
        if from_mask
        else f"with no attention mask every token is real, so that token is at position {expected}"
    )
    return f"position_ids[{row}, {column}] is {value}{after}, but {truth}"


def repaired_message(described: str, from_mask: bool = True) -> str:
    used = "the mask's positions" if from_mask else "positions continuing after the cache"
    return (
        f"neofix: {described} (arange over a left-padded batch, or a loop that does not increment its positions?); "
        f"used {used}. To fix your loop: {_FIX_VALUES}. Reported once."
    )


def _repair_counted_padding(
    positions: torch.Tensor,
    mask: torch.Tensor,
    cumsum: torch.Tensor,
    real: torch.Tensor,
    flags: list[int],
    strict: bool,
    repairs: list[Repair],
) -> torch.Tensor:
    rows = [row for row, flag in enumerate(flags) if flag]
    row = rows[0]
    first = int(real[row].long().argmax())
    given = int(torch.broadcast_to(positions, mask.shape)[row, first])
    named = f"row {row}" if len(rows) == 1 else f"rows {', '.join(map(str, rows))}"
    described = (
        f"position_ids count the left padding of {named}: the first real token of row {row} is at position {given}, "
        f"but the attention mask puts it at 0 (arange over a left-padded batch: the classic batched-generation bug)"
    )
    if strict:
        raise PositionError(f"{described}; {_FIX_VALUES}")
    repairs.append(
        Repair(
            POSITIONS_COUNT_PADDING,
            f"neofix: {described}; derived {'its' if len(rows) == 1 else 'their'} positions from the mask. To fix "
            f"your code: {_FIX_VALUES}. Reported once.",
        )
    )
    bad_rows = torch.tensor(flags, dtype=torch.bool, device=mask.device).unsqueeze(-1)
    return torch.where(bad_rows & real, (cumsum - 1).clamp(min=0), positions)


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
