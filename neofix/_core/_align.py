"""The alignment core: one decoding step's tensors and cache view in, aligned tensors or a :class:`NeofixError` out.

Pure and version-free: it knows nothing about transformers releases, model families, caches' classes or wrappers,
and it warns nothing itself (repairs come back as data; the caller reports them).  The step contract (``b`` batch,
``q`` new tokens, ``p`` cached tokens, ``m`` mask columns, ``P`` the position table's size):

* ``m == p + q``: unchanged.  ``m < p + q``: the mask was not extended; repair appends ones (strict: error).
  ``m > p + q``: ambiguous, always an error.
* position_ids missing: ``cumsum(mask) - 1`` over the whole mask, last ``q`` columns, pads clamped to 0.
  Length ``p + q``: the last ``q`` are taken (strict: error).  Any other length: re-derived (strict: error).
* ``p + q > P``: error before any compute.  Batch mismatches, cache layers of different lengths, empty steps,
  wrong embedding widths: errors.

:func:`align` runs five named steps in order: :func:`read_inputs` (the new tokens), :func:`check_cache`,
:func:`align_mask`, :func:`align_side_inputs` (token types, cache positions) and :func:`align_positions`; then the
value checks of :mod:`._values`.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .._errors import (
    BatchMismatchError,
    CacheLengthError,
    InputShapeError,
    MaskLengthError,
    PositionError,
    SequenceTooLongError,
)
from ._types import (
    CACHE_POSITION_DROPPED,
    MASK_EXTENDED,
    POSITIONS_DERIVED,
    POSITIONS_REDERIVED,
    POSITIONS_SLICED,
    TOKEN_TYPES_SLICED,
    Aligned,
    CacheView,
    Limits,
    Repair,
    StepInputs,
)
from ._values import FIX_POSITIONS, derive_positions
from ._values import check_values as _check_values

FIX_MASK = "append a column of ones per new token (torch.cat([mask, mask.new_ones(batch, new_tokens)], -1))"

_new_tuple = tuple.__new__


def tokens(count: int) -> str:
    return "1 new token" if count == 1 else f"{count} new tokens"


def rows(count: int) -> str:
    return f"{count} row{'s' if count != 1 else ''}"


def step_unchanged(
    batch: int,
    new: int,
    mask_shape: tuple[int, ...] | None,
    positions_shape: tuple[int, ...] | None,
    token_types_given: bool,
    cache_position_length: int | None,
    cache: CacheView,
    max_positions: int | None,
) -> bool:
    """Whether :func:`align` (with ``check_values`` off) returns the step as given: nothing repaired, nothing raised,
    no value read.  Shapes and ints only, so that a model forward can skip :func:`align` for the hottest call there
    is, a single-token decode step that already keeps the contract.

    True for one new token per row after a cache every layer of which holds the same ``p > 0`` tokens of the same
    rows, with ``p + 1`` within the position table, no token types, a ``cache_position`` of one entry or none, and
    either a 2D mask of ``p + 1`` columns with one position per row, or no mask (with one position per row or none:
    transformers 5.x passes no mask for an unpadded batch).
    """
    past = cache.length
    if new != 1 or not past or cache.batch != batch or token_types_given:
        return False
    if max_positions is not None and past >= max_positions:
        return False
    if cache_position_length not in (None, 1):
        return False
    lengths = cache.layer_lengths
    if lengths is None or lengths.count(past) != len(lengths):
        return False
    if mask_shape is None:
        return positions_shape is None or positions_shape == (batch, 1)
    return mask_shape == (batch, past + 1) and positions_shape == (batch, 1)


def align(
    step: StepInputs,
    cache: CacheView,
    limits: Limits,
    *,
    strict: bool,
    check_values: bool,
) -> Aligned | None:
    """Align one step, or raise :class:`~neofix.NeofixError`.

    ``cache`` says what the cache holds (:class:`CacheView`; its ``length`` is ``None`` when that cannot be told
    without a device synchronisation: length checks are skipped then).  Returns ``None`` when there is nothing to
    align (neither input_ids nor inputs_embeds: transformers raises its own error).
    """
    shape = read_inputs(step, limits)
    if shape is None:
        return None
    batch, new = shape
    total = check_cache(cache, batch, new, limits)
    repairs: list[Repair] = []
    mask, mask_2d = align_mask(step.attention_mask, batch, new, cache.length, total, strict, repairs)
    token_types, cache_position = align_side_inputs(step, new, total, strict, repairs)
    positions, given = align_positions(
        step.position_ids, mask if mask_2d else None, batch, new, cache.length, total, cache_position, strict, repairs,
        step.input_ids if step.input_ids is not None else step.inputs_embeds,
    )
    positions, values_checked = _check_values(
        step.input_ids, token_types, positions, given, mask if mask_2d else None, new, cache.length, limits, strict,
        check_values, repairs,
    )
    # tuple.__new__ builds the same Aligned as Aligned(...) without the Python-level __new__ NamedTuple generates
    aligned = (mask, positions, token_types, cache_position, batch, new, tuple(repairs), values_checked)
    return _new_tuple(Aligned, aligned)  # type: ignore[no-any-return]


# -- 1. the new tokens -----------------------------------------------------------------------------------------------


def read_inputs(step: StepInputs, limits: Limits) -> tuple[int, int] | None:
    """``(batch, new tokens)`` of the step, from ``input_ids`` or ``inputs_embeds``; ``None`` when neither is given."""
    input_ids, embeds = step.input_ids, step.inputs_embeds
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise InputShapeError(
                f"input_ids has shape {tuple(input_ids.shape)}, but the model expects (batch, new_tokens): "
                f"add the batch dimension (input_ids[None]) or flatten extra ones"
            )
        batch, new = input_ids.shape
        name = "input_ids"
    elif embeds is not None:
        if embeds.dim() != 3 or embeds.shape[-1] != limits.hidden_size:
            raise InputShapeError(
                f"inputs_embeds has shape {tuple(embeds.shape)}, but this model expects "
                f"(batch, new_tokens, {limits.hidden_size}) (config.hidden_size = {limits.hidden_size}): embed the "
                f"tokens with this model's model.get_input_embeddings()"
            )
        batch, new = embeds.shape[0], embeds.shape[1]
        name = "inputs_embeds"
    else:
        return None
    if new == 0:
        raise InputShapeError(
            f"this step feeds no new tokens ({name} has 0 columns, batch {batch}): every forward needs at least one "
            f"token; stop the loop instead"
        )
    return batch, new


# -- 2. the cache ----------------------------------------------------------------------------------------------------


def check_cache(cache: CacheView, batch: int, new: int, limits: Limits) -> int | None:
    """Check the cache against the step; return ``p + q`` (``None`` when the cache's length cannot be told)."""
    if cache.batch is not None and cache.batch != batch:
        raise BatchMismatchError(
            f"the cache holds {cache.batch} rows, but this step feeds {batch}: the cache, attention_mask and "
            f"inputs must hold the same rows (reorder or select the cache with the inputs, e.g. after beam search)"
        )
    past = cache.length
    lengths = cache.layer_lengths
    if lengths is not None and past is not None:
        # one pass in C for the usual case (every layer holds past, or cannot tell); the loop names the layer
        if lengths.count(past) + lengths.count(None) != len(lengths):
            for layer, held in enumerate(lengths):
                if held is not None and held != past:
                    raise_cache_length_error(layer, held, past)
    if past is None:
        return None
    total = past + new
    if limits.max_positions is not None and total > limits.max_positions:
        fit = max(limits.max_positions - past, 0)
        raise SequenceTooLongError(
            f"this step would reach sequence length {total} (the cache holds {past} tokens and the step "
            f"feeds {new}), but config.max_position_embeddings is {limits.max_positions}: {fit} more new "
            f"token{'s' if fit != 1 else ''} fit; shorten the prompt or generate fewer tokens"
        )
    return total


def raise_cache_length_error(layer: Any, held: int, expected: int) -> None:
    """Raise :class:`CacheLengthError`: cache ``layer`` holds ``held`` tokens where layer 0 holds ``expected``."""
    raise CacheLengthError(
        f"cache layer {layer} holds {held} tokens, but layer 0 holds {expected}: every layer of the cache must hold "
        f"the same tokens (was it built for another model, or cropped or edited per layer?). Crop every layer to "
        f"the same length, or rebuild the cache by running the whole sequence again"
    )


# -- 3. the attention mask -------------------------------------------------------------------------------------------


def align_mask(
    mask: Any, batch: int, new: int, past: int | None, total: int | None, strict: bool, repairs: list[Repair]
) -> tuple[Any, bool]:
    """The mask to use (a 2D mask extended where it was not), and whether it is a 2D padding mask."""
    if mask is None:
        return None, False
    dims = mask.dim()
    if dims == 2:
        if mask.shape[0] != batch:
            raise BatchMismatchError(
                f"attention_mask has {rows(mask.shape[0])}, but this step feeds {batch}: pass one mask row per input "
                f"row"
            )
        columns = mask.shape[1]
        if total is None or columns == total:
            return mask, True
        expected = (
            f"attention_mask has {columns} columns, but the cache holds {past} tokens and this step feeds {new}: "
            f"expected {total}"
        )
        if columns > total:
            raise MaskLengthError(
                f"{expected}. A longer mask is ambiguous (which columns belong to the cache?): pass the mask of "
                f"exactly the cached plus the new tokens"
            )
        if strict:
            raise MaskLengthError(f"{expected}. The mask was not extended for the new tokens: {FIX_MASK}")
        repairs.append(
            Repair(
                MASK_EXTENDED,
                f"neofix: {expected}; extended it with ones on the right (the classic 'mask not extended' decoding "
                f"bug). To fix your loop: {FIX_MASK}. Reported once.",
            )
        )
        return torch.cat([mask, mask.new_ones((batch, total - columns))], dim=-1), True
    if dims in (3, 4):
        if mask.shape[0] not in (1, batch):
            raise BatchMismatchError(
                f"the {dims}D attention_mask has {rows(mask.shape[0])}, but this step feeds {batch}: pass one mask "
                f"row per input row (or one for all)"
            )
        if mask.shape[-2] != new or (total is not None and mask.shape[-1] != total):
            keys = "" if total is None else f", {total}"
            raise MaskLengthError(
                f"the {dims}D attention_mask has shape {tuple(mask.shape)}, but this step needs (..., {new}{keys}): "
                f"one row per new token and one column per cached plus new token (the cache holds {past}); or pass "
                f"the 2D (batch, cached + new tokens) padding mask and let the model build the rest"
            )
        return mask, False
    raise InputShapeError(f"attention_mask has shape {tuple(mask.shape)}; pass a 2D (batch, cached + new tokens) mask")


# -- 4. token types and cache positions (the same length rules as positions) -----------------------------------------


def align_side_inputs(
    step: StepInputs, new: int, total: int | None, strict: bool, repairs: list[Repair]
) -> tuple[Any, Any]:
    token_types, cache_position = step.token_type_ids, step.cache_position
    if token_types is not None and token_types.shape[-1] != new:
        if not strict and total is not None and token_types.shape[-1] == total:
            token_types = token_types[..., -new:]
            repairs.append(Repair(TOKEN_TYPES_SLICED, ""))
        else:
            raise InputShapeError(
                f"token_type_ids has {token_types.shape[-1]} columns, but this step feeds {tokens(new)}: pass the new "
                f"tokens' types only"
            )
    if cache_position is not None and cache_position.shape[-1] != new:
        described = f"cache_position has {cache_position.shape[-1]} entries, but this step feeds {tokens(new)}"
        if strict:
            raise PositionError(f"{described}: pass cache_position for the new tokens only, or leave it out")
        cache_position = None  # the model recomputes it from the cache length
        repairs.append(Repair(CACHE_POSITION_DROPPED, f"neofix: {described}; left it out. Reported once."))
    return token_types, cache_position


# -- 5. positions ----------------------------------------------------------------------------------------------------


def align_positions(
    positions: Any,
    mask: Any,
    batch: int,
    new: int,
    past: int | None,
    total: int | None,
    cache_position: Any,
    strict: bool,
    repairs: list[Repair],
    first: Any,
) -> tuple[Any, bool]:
    """The positions to use, and whether they are the caller's (``False``: derived here, or left to the model)."""
    if positions is not None:
        dims = positions.dim()
        if dims not in (1, 2):
            raise PositionError(f"position_ids has shape {tuple(positions.shape)}; expected (batch, new_tokens)")
        given_rows = positions.shape[0] if dims == 2 else 1
        if given_rows not in (1, batch):
            raise BatchMismatchError(
                f"position_ids has {rows(given_rows)}, but this step feeds {batch}: pass one row per input row (or "
                f"one row for all)"
            )
        length = positions.shape[-1]
        if length == new:
            return positions, True
        described = f"position_ids has {length} columns, but this step feeds {tokens(new)} (the cache holds {past})"
        if strict:
            raise PositionError(f"{described}: {FIX_POSITIONS}")
        if total is not None and length == total:
            repairs.append(Repair(POSITIONS_SLICED, ""))
            return positions[..., -new:], True
        repairs.append(
            Repair(
                POSITIONS_REDERIVED,
                f"neofix: {described}; derived them from the attention mask instead (stale prompt positions?). To "
                f"fix your loop: {FIX_POSITIONS}. Reported once.",
            )
        )
        if mask is None:
            if past is None:
                return None, False
            # no 2D mask: every token is real, so positions simply continue after the cache
            return torch.arange(past, total, device=first.device).unsqueeze(0), False  # type: ignore[arg-type]
    if mask is None:
        return None, False
    derived = derive_positions(mask, new)
    if past is not None:
        derived = _trailing_pads_as_transformers(derived, mask, past, cache_position)
    repairs.append(Repair(POSITIONS_DERIVED, ""))
    return derived, False


def _trailing_pads_as_transformers(
    positions: torch.Tensor, mask: torch.Tensor, past_length: int, cache_position: torch.Tensor | None
) -> torch.Tensor:
    """Derived positions, except that pads after a row's last real token keep the positions transformers gives them.

    A pad's position changes nothing for the real tokens (it is masked out), but it does change the pad's own
    logits and hidden states, which some heads read (QA takes a softmax over every column, pads included).  An
    unpadded or right-padded row then computes exactly what it computes unpatched, bit for bit.  transformers'
    own positions when none are given: ``cache_position`` where the release passes it, else ``arange(p, p + q)``.
    Elementwise only: no device synchronisation.
    """
    new = positions.shape[-1]
    if cache_position is not None and cache_position.dim() == 1:
        own = cache_position.unsqueeze(0)
    else:
        own = torch.arange(past_length, past_length + new, device=positions.device).unsqueeze(0)
    real = mask[:, -new:] != 0
    trailing = real.flip(-1).cumsum(-1).flip(-1) == 0  # no real token at or after this column
    return torch.where(trailing, own.to(positions.dtype), positions)
