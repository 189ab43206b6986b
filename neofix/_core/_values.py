"""Value checks: what the tensors hold (token ids, positions), as opposed to their shapes.

Reading a value off an accelerator is a host-device synchronisation, so every check a step needs is gathered into
one tensor and read once, and only where that is cheap or asked for: on prefill and multi-token steps, and on
single-token decode steps with ``check_values=True``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import PositionError, TokenIdError
from ._types import POSITION_VALUES, Limits, Repair

FIX_POSITIONS = "pass only the new tokens' positions, or none at all and neofix derives them from the mask"


def derive_positions(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Positions of the last ``new_tokens`` columns of a 2D mask: ``cumsum(mask) - 1``, pads clamped to 0."""
    positions = attention_mask.long().cumsum(-1)[:, -new_tokens:] - 1
    return positions.clamp_(min=0)


def check_values(
    input_ids: Any,
    token_types: Any,
    positions: Any,
    given: bool,
    mask: Any,
    new: int,
    past: int | None,
    limits: Limits,
    strict: bool,
    check_values: bool,
    repairs: list[Repair],
) -> tuple[Any, bool]:
    """Check the step's values where that is cheap or asked for; return (positions, whether values were read)."""
    prefill = new > 1 or not past
    check_ids = input_ids is not None and (prefill or check_values)
    # given positions index the position table
    check_range = given and limits.max_positions is not None and (prefill or check_values)
    check_positions = check_values and given and mask is not None
    if not (check_ids or check_range):
        return positions, False
    repaired = _read_and_check(
        input_ids if check_ids else None,
        token_types if check_ids else None,
        positions if check_range else None,
        mask if check_positions else None,
        new,
        limits,
        strict,
        repairs,
    )
    return (positions if repaired is None else repaired), True


def _read_and_check(
    input_ids: torch.Tensor | None,
    token_types: torch.Tensor | None,
    positions: torch.Tensor | None,
    mask: torch.Tensor | None,
    new: int,
    limits: Limits,
    strict: bool,
    repairs: list[Repair],
) -> torch.Tensor | None:
    """Check token ids, the range of given positions and (with ``mask``) their values with one synchronisation.

    Returns repaired positions, or None when nothing was repaired.
    """
    named = (("input_ids", input_ids), ("token_type_ids", token_types))
    id_tensors = [(name, ids) for name, ids in named if ids is not None]
    flags = [_outside(t, limits.vocab_size) for _, t in id_tensors]
    if positions is not None:
        flags.append(_outside(positions, limits.max_positions))  # type: ignore[arg-type]
    derived = wrong = None
    if positions is not None and mask is not None:
        derived = derive_positions(mask, new)
        wrong = (positions != derived) & (mask[:, -new:] != 0)
        flags.append(wrong.any())
    if not flags:
        return None
    found = torch.stack(flags).tolist()  # the one synchronisation
    for (name, ids), bad in zip(id_tensors, found):
        if bad:
            raise_token_id_error(ids, limits.vocab_size, name=name)
    if positions is not None and found[len(id_tensors)]:
        raise_position_range_error(positions, limits.max_positions)  # type: ignore[arg-type]
    if derived is None or not found[-1]:
        return None
    row, column = wrong.nonzero()[0].tolist()  # type: ignore[union-attr]
    given = int(torch.broadcast_to(positions, derived.shape)[row, column])  # type: ignore[arg-type]
    described = (
        f"position_ids[{row}, {column}] is {given}, but the attention mask puts that real token at position "
        f"{int(derived[row, column])}"
    )
    if strict:
        raise PositionError(f"{described}: positions must advance by one per real token; {FIX_POSITIONS}")
    repairs.append(
        Repair(
            POSITION_VALUES,
            f"neofix: {described}; used the positions derived from the mask. To fix your loop: {FIX_POSITIONS}. "
            f"Reported once.",
        )
    )
    return derived


def _outside(values: torch.Tensor, size: int) -> torch.Tensor:
    return ((values < 0) | (values >= size)).any()


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
        else "this model embeds token types with the token embedding, so they must be token ids too"
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
