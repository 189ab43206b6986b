"""Reading a step's values: one interface, two implementations, chosen once per step by :func:`reader_for`.

A value read (token ids, mask values, given positions) is a host-device synchronisation on an accelerator, and a
torch reduction costs tens of microseconds on the CPU right after a forward.  So a step that reads does it once,
through one of two readers that answer the same :class:`Question` with the same :class:`Facts`:

* :func:`read_on_host` (tensors in CPU memory): one ``tolist()`` per tensor, searched at C speed (list counts,
  ``bytes`` searches).  Token ids, token types and the range of given positions are not read there: on the CPU an
  index outside a table raises ``IndexError`` in the lookup before anything runs, and the model forward names the
  value (:func:`~neofix._core._values.explain_index_error`).
* :func:`read_on_device` (an accelerator): every check as a tensor, concatenated and read with one ``tolist()``.

The rules that judge the facts live in :mod:`._values`; nothing here decides anything.  Single-token decode steps
read nothing (see :func:`~neofix._core._values.settle`).
"""

from __future__ import annotations

from itertools import accumulate, compress, repeat
from operator import sub
from typing import Any, Callable, NamedTuple

import torch


class Question(NamedTuple):
    """What a step asks of its values.  ``positions``: the given positions (``None``: none given); ``compare``: compare
    them with the mask's; ``range_of_positions``: read their smallest and largest value (a family with a position
    table); ``mask``: the aligned 2D mask or ``None``; ``past``: cached tokens (``None``: not known; 0 without a
    cache); ``slots``: the new tokens' slots where ``past`` is not known (see :func:`new_columns`); ``scheme``: without
    a cache, tell whether the given positions are the mask's, and whether they are the columns (a rotary prompt: the
    positions its cache is built with, :func:`~._values.built_by`), or, with ``compare`` (a family with a position
    table), their offset from the mask's alone."""

    input_ids: Any
    token_types: Any
    positions: Any
    compare: bool
    range_of_positions: bool
    mask: Any
    new: int
    past: int | None
    slots: Any = None
    scheme: bool = False


class Facts(NamedTuple):
    """What a step's values are, read once.  ``None`` ranges were not read (see :func:`read_on_host`).

    ``left``: some row has a pad followed by a real token (left padding, or a gap); ``right_padded``: the rows with a
    real token followed by a pad that end in a pad;
    ``wrong``: after a cache, some real new token's given position differs from the mask's (no mask: from the
    positions after the cache), or, without a cache where ``scheme`` asks, some real token's; ``counts_pads``: without
    a cache, the rows whose given positions count their padding (a pad before a real token, and every real token at
    its column, ``arange`` over the padded width, or at the mask's position plus the leading pads: see
    :func:`_counts_pads`);
    ``columns``: without a cache where ``scheme`` asks, every real token's given position is its column (``False``
    where not asked); ``offset``: there, where they are wrong (with ``compare``: wrong or not), the one number every
    real token's given position is off from the mask's by (the same in every row), else ``None``.
    """

    ids: tuple[int, int] | None
    types: tuple[int, int] | None
    positions: tuple[int, int] | None
    binary: bool
    left: bool
    right_padded: tuple[int, ...]
    wrong: bool
    counts_pads: tuple[int, ...]
    columns: bool = False
    offset: int | None = None


Reader = Callable[[Question], Facts]

# Question's and Facts' own constructors are Python functions (a NamedTuple's ``__new__``): the readers of every step
# that reads build the tuple directly, which is what that function does, at a fraction of its cost.
_new = tuple.__new__


def reader_for(question: Question) -> Reader:
    """The reader of a step: on the host where every tensor it reads is in CPU memory, else on the device."""
    input_ids, _, positions, _, _, mask, _, _, _, _ = question
    if (
        (input_ids is None or input_ids.is_cpu)
        and (mask is None or mask.is_cpu)
        and (positions is None or positions.is_cpu)
    ):
        return read_on_host
    return read_on_device


# -- on the host ---------------------------------------------------------------------------------------------------


def read_on_host(question: Question) -> Facts:
    input_ids, _, positions, compare, _, mask, new, past, _, scheme = question
    if mask is None:
        rows = leading = None
        binary, left, right = True, False, ()
    else:
        rows = mask.tolist()
        binary, left, right, leading = _scan(rows)
    wrong, counts_pads, columns, offset = False, (), False, None
    # (without a cache only a row with a pad before a real token can count its pads)
    if (compare and binary and (past != 0 or left)) or (scheme and binary):
        given = positions.tolist()
        given = [given] if not given or type(given[0]) is not list else given
        if len(given) == 1:
            given *= len(rows) if rows is not None else len(input_ids if input_ids is not None else given)
        if scheme and not compare:  # a rotary prompt: the mask's, the columns, or an offset from the mask's
            every = _numbers(0, new)
            if rows is None:  # every token real: the mask's positions are the columns
                wrong = any(own != every for own in given)
            else:
                wrong = any(map(_wrong, rows, leading, given, repeat(new)))  # type: ignore[arg-type]
            columns = not wrong if not left else all(map(_at_columns, rows, given, repeat(every)))  # type: ignore[arg-type]
            if wrong and not columns:
                offset = _offset(rows, leading, given)
        elif past == 0:
            if rows is not None:
                counted = map(_counts_pads, rows, leading, given)  # type: ignore[arg-type]
                counts_pads = tuple(compress(range(len(rows)), counted))
            if scheme:  # a prompt of a family with a position table: an offset from the mask's
                offset = _offset(rows, leading, given)
        elif rows is None:  # every token real: the new tokens continue after the cache
            wrong = past is not None and any(own != _numbers(past, past + new) for own in given)
        else:
            wrong = any(map(_wrong, rows, leading, given, repeat(new)))  # type: ignore[arg-type]
    return _new(Facts, (None, None, None, binary, left, right, wrong, counts_pads, columns, offset))


def _scan(rows: list[list[Any]]) -> tuple[bool, bool, tuple[int, ...], list[int | None]]:
    """``(binary, left, right_padded, leading)`` of a mask's rows (see :class:`Facts`); ``leading``: per row,
    its pads where every one comes before its first real token (0: none), else ``None``.

    Each row's real tokens are counted once (``count(1)``, in C: most of a mask's entries are the int 1 itself, which
    the count finds by identity); a row that is not pads then real tokens is counted again, for its zeros."""
    width = len(rows[0]) if rows else 0
    ones = list(map(list.count, rows, repeat(1)))
    if ones.count(width) == len(ones):  # every token real: the usual mask
        return True, False, (), [0] * len(ones)
    left = False
    right: list[int] = []
    leading: list[int | None] = []
    for index, (row, real) in enumerate(zip(rows, ones)):
        pads = width - real
        if real and row.index(1) == pads and not any(row[:pads]):  # pads (zeros), then real tokens
            left = left or pads != 0
            leading.append(pads)
            continue
        leading.append(None)
        if real + row.count(0) != width:
            return False, False, (), leading
        if not real:  # a row of pads
            continue
        steps = bytes(row) if isinstance(row[0], int) else bytes(map(int, row))
        left = left or b"\x00\x01" in steps
        if not row[-1]:  # a real token, then pads to the end
            right.append(index)
    return True, left, tuple(right), leading


def _wrong(row: list[int], pads: int | None, own: list[int], new: int) -> bool:
    """Whether a real new token of a row sits at another position than its mask says: its count of real tokens minus
    one.  ``pads``: the row's, where they all come before its real tokens (see :func:`_scan`), else ``None``.
    (Compared as lists of the real tokens' positions: in C.)"""
    width = len(row)
    if pads is not None:  # pads, then real tokens: column c is at c - pads
        skip = max(pads - (width - new), 0)  # the new tokens that are pads (their positions are not judged)
        return own[skip:] != _numbers(width - new + skip - pads, width - pads)
    real = row[-new:]
    mask_positions = list(map(sub, accumulate(row), repeat(1)))[-new:]
    return list(compress(own, real)) != list(compress(mask_positions, real))


# The ints 0, 1, 2, ... made once: a row's expected positions are a slice of it (a list of n new ints costs more to
# build than to compare).  Grown, never shrunk, when a longer row comes.
_NUMBERS: list[int] = list(range(1024))


def _numbers(start: int, stop: int) -> list[int]:
    """``list(range(start, stop))`` for ``0 <= start <= stop``."""
    global _NUMBERS
    if stop > len(_NUMBERS):
        _NUMBERS = list(range(max(stop, 2 * len(_NUMBERS))))
    return _NUMBERS[start:stop]


def _at_columns(row: list[int], own: list[int], every: list[int]) -> bool:
    """Whether a row's real tokens are at their columns (``every``: the row's column numbers)."""
    return list(compress(own, row)) == list(compress(every, row))


def _offset(rows: list[list[int]] | None, leading: list[int | None] | None, given: list[list[int]]) -> int | None:
    """Without a cache: the one number by which every row's real tokens' given positions are off from the mask's
    (``rows``: the mask's, ``leading``: their pads before the first real token, where every pad is (see :func:`_scan`);
    ``None``: every token real), or ``None`` where they differ (or no token is real).

    The mask puts a row's real tokens at 0, 1, 2, ... (each one's count of real tokens before it), so they are off by
    one number where their given positions run on from the first one: compared as lists, in C."""
    found: int | None = None
    for index, own in enumerate(given):
        pads = leading[index] if leading is not None else 0
        real = own[pads:] if pads is not None else list(compress(own, rows[index]))  # type: ignore[index]
        if not real:
            continue
        if found is None:
            found = int(real[0])  # (an int: a float mask's counts are floats)
        if real != list(range(found, found + len(real))):
            return None
    return found


def _counts_pads(row: list[int], pads: int | None, own: list[int]) -> bool:
    """Whether a row with a pad before a real token (left padding, or a gap) has positions that count its pads: every
    real token at its column (``arange`` over the padded width), or, on a left-padded row, every one at the mask's
    position plus the leading pads (the two agree up to a row's first gap: a prefix cut before it is read alike).
    ``pads``: as :func:`_wrong`'s."""
    if pads == 0:  # real tokens from the first column, none after a pad: their columns are the mask's positions
        return False
    if pads is not None and own[pads] != pads:  # (a left-padded row: its first real token tells at once)
        return False
    every = _numbers(0, len(row))
    columns = list(compress(every, row))  # the real tokens' columns
    # (a pad comes before a real token where the last real token's column is past the count of real tokens before it)
    if not columns or columns[-1] == len(columns) - 1:
        return False
    if _at_columns(row, own, every):
        return True
    leading = columns[0]
    return leading > 0 and list(compress(own, row)) == _numbers(leading, leading + len(columns))


# -- on the device -------------------------------------------------------------------------------------------------


def read_on_device(question: Question) -> Facts:
    input_ids, token_types, positions, compare, range_of_positions, mask, new, past, slots, scheme = question
    parts: list[torch.Tensor] = []

    def add(*tensors: torch.Tensor) -> slice:
        start = sum(part.shape[0] for part in parts)
        parts.extend(tensor.reshape(-1).long() for tensor in tensors)
        return slice(start, start + sum(tensor.numel() for tensor in tensors))

    ids = add(*torch.aminmax(input_ids)) if input_ids is not None else None
    types = add(*torch.aminmax(token_types)) if token_types is not None else None
    ranged = add(*torch.aminmax(positions)) if positions is not None and range_of_positions else None
    binary = steps = last = wrong = counts = columns = offsets = None
    if mask is not None:
        binary = add(((mask != 0) & (mask != 1)).any())
        if mask.shape[-1] > 1:  # per row: +1 where a pad is followed by a real token, -1 the other way
            steps = add(*torch.aminmax(torch.diff(mask.long(), dim=-1), dim=-1))
            last = add(mask[:, -1])
    if (compare and past != 0) or (scheme and not compare):
        truth = step_truth(mask, new, past, positions, slots)
        if truth is not None:
            derived, real = truth
            wrong = add((real & (positions != derived)).any())
            if scheme:
                columns = add((real & (positions != torch.arange(new, device=positions.device))).any())
                off = positions - derived  # (by how much each real token is off the mask's: one number, or many)
                offsets = add(torch.where(real, off, _FAR).min(), torch.where(real, off, -_FAR).max())
    elif compare:  # a prompt of a family with a position table: positions that count the pads, and with scheme, the
        if mask is not None:  # offset of every real token's from the mask's (read with the counts, once)
            counts = add(counts_padding(positions, mask))
        truth = step_truth(mask, new, past, positions, slots) if scheme else None
        if truth is not None:
            derived, real = truth
            off = positions - derived
            offsets = add(torch.where(real, off, _FAR).min(), torch.where(real, off, -_FAR).max())
    values = torch.cat(parts).tolist() if parts else []  # the one read

    def pair(where: slice | None) -> tuple[int, int] | None:
        return None if where is None else (values[where][0], values[where][1])

    rows = mask.shape[0] if mask is not None else 0
    lows, highs = (values[steps][:rows], values[steps][rows:]) if steps is not None else ([], [])
    ends = values[last] if last is not None else []
    wrongly, at_columns = wrong is not None and bool(values[wrong][0]), columns is not None and not values[columns][0]
    low, high = values[offsets] if offsets is not None else (None, None)
    return Facts(
        pair(ids),
        pair(types),
        pair(ranged),
        binary is None or not values[binary][0],
        max(highs, default=0) > 0,
        tuple(row for row, (low, end) in enumerate(zip(lows, ends)) if low < 0 and not end),
        wrongly,
        tuple(row for row, flag in enumerate(values[counts]) if flag) if counts is not None else (),
        at_columns,
        low if (compare or (wrongly and not at_columns)) and low == high else None,
    )


#: Beyond any offset of positions (torch.long's largest): where no token is real, the smallest offset and the largest
#: differ.
_FAR = 2**63 - 1


def step_truth(
    mask: Any, new: int, past: int | None, like: torch.Tensor, slots: Any = None
) -> tuple[Any, Any] | None:
    """``(derived, real)`` for comparing given positions after a cache: the mask's positions of the new tokens and
    which of them are real; without a mask every token is real and positions continue after the cache."""
    if mask is not None:
        return new_columns(mask.long().cumsum(-1), new, past, slots) - 1, new_columns(mask, new, past, slots) != 0
    if past is None:
        return None
    derived = torch.arange(past, past + new, device=like.device).unsqueeze(0)
    return derived, torch.ones_like(derived, dtype=torch.bool)


def new_columns(tensor: torch.Tensor, new: int, past: int | None, slots: Any) -> torch.Tensor:
    """The new tokens' columns of a 2D mask (or of a tensor over its columns): its last ``new``, or, over a static
    cache whose length is not known (``past`` ``None``), the new tokens' ``slots`` (its ``cache_position``, given or
    transformers' own): there a mask's columns are slots, and one may be as wide as all of them (ones for the tokens so
    far, zeros for the empty slots), as transformers reads it.  Taken on the device, unread; a mask narrower than the
    slots (not extended: a value read would tell) gives its last column for the slots past it."""
    if past is not None or slots is None or slots.dim() != 1:
        return tensor[:, -new:]
    return tensor.index_select(-1, slots.clamp(max=tensor.shape[-1] - 1))


def counts_padding(positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per row, without a cache: whether a pad comes before a real token (left padding, or a gap) and the real tokens'
    positions count the pads (see :func:`_counts_pads`)."""
    real = mask != 0
    counted = real.long().cumsum(-1)
    columns = torch.arange(mask.shape[-1], device=mask.device)
    last = torch.where(real, columns, -1).amax(-1)  # the last real token's column (-1: none, as a count of 0 gives)
    leading = (counted == 0).sum(-1, keepdim=True)
    at_columns = ((positions == columns) | ~real).all(-1)
    shifted = ((positions == counted - 1 + leading) | ~real).all(-1) & (leading[:, 0] > 0)
    return (at_columns | shifted) & (last != counted[:, -1] - 1)
