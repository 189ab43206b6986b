"""The alignment core: one decoding step's shapes in, aligned tensors or a :class:`NeofixError` out.

Pure and version-free: it knows nothing about transformers, caches or wrappers.  The caller (the model-forward
wrapper, or :class:`neofix.DecodeState`) reads the step, passes the number of cached tokens, and puts the aligned
tensors back.  The step contract it implements (``b`` batch, ``q`` new tokens, ``p`` cached tokens, ``m`` mask
columns, ``P`` max_position_embeddings):

* ``m == p + q``: unchanged.  ``m < p + q``: the mask was not extended; repair appends ones (strict: error).
  ``m > p + q``: ambiguous, always an error.
* position_ids missing: ``cumsum(mask) - 1`` over the whole mask, last ``q`` columns, pads clamped to 0.
  Length ``p + q``: the last ``q`` are taken (strict: error).  Any other length: re-derived (strict: error).
* ``p + q > P``: error before any compute.  Batch mismatches, cache layers of different lengths, empty steps,
  wrong embedding widths: errors.
* Value checks (token ids and the range of given positions; with ``check_values`` also the positions of real
  tokens against the mask) need one host-device synchronisation, so they run on prefill and multi-token steps,
  and on single-token steps only with ``check_values=True``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from ._errors import (
    BatchMismatchError,
    CacheLengthError,
    InputShapeError,
    MaskLengthError,
    PositionError,
    SequenceTooLongError,
    TokenIdError,
    warn_once,
)

# Repair names, as reported in traces and warnings.
MASK_EXTENDED = "mask_extended"
POSITIONS_DERIVED = "positions_derived"  # none were given: normal, not warned
POSITIONS_SLICED = "positions_sliced"  # full-length positions: the last q taken, not warned
POSITIONS_REDERIVED = "positions_rederived"
POSITION_VALUES = "position_values_repaired"
TOKEN_TYPES_SLICED = "token_type_ids_sliced"
CACHE_POSITION_DROPPED = "cache_position_dropped"

_FIX_MASK = "append a column of ones per new token (torch.cat([mask, mask.new_ones(batch, new_tokens)], -1))"
def _new_tokens(count: int) -> str:
    return "1 new token" if count == 1 else f"{count} new tokens"


_FIX_POSITIONS = "pass only the new tokens' positions, or none at all and neofix derives them from the mask"


class Limits(NamedTuple):
    """What the model allows: ``config.max_position_embeddings``, ``config.vocab_size``, ``config.hidden_size``."""

    max_positions: int
    vocab_size: int
    hidden_size: int


_new_tuple = tuple.__new__


class Aligned(NamedTuple):
    attention_mask: Any
    position_ids: Any
    token_type_ids: Any
    cache_position: Any
    batch: int
    new_tokens: int
    repairs: tuple[str, ...]
    values_checked: bool


def derive_positions(attention_mask: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Positions of the last ``new_tokens`` columns of a 2D mask: ``cumsum(mask) - 1``, pads clamped to 0."""
    positions = attention_mask.long().cumsum(-1)[:, -new_tokens:] - 1
    return positions.clamp_(min=0)


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


def step_unchanged(
    batch: int,
    new: int,
    mask_shape: tuple[int, ...] | None,
    positions_shape: tuple[int, ...] | None,
    token_types_given: bool,
    cache_position_length: int | None,
    past_length: int | None,
    cache_batch: int | None,
    layer_lengths: Sequence[int | None] | None,
    max_positions: int,
) -> bool:
    """Whether :func:`align` (with ``check_values`` off) returns the step as given: nothing repaired, nothing raised,
    no value read.  Shapes and ints only, so that a model forward can skip :func:`align` for the hottest call there
    is, a single-token decode step that already keeps the contract.

    True for one new token per row after a cache every layer of which holds the same ``p > 0`` tokens of the same
    rows, with ``p + 1`` within the position table, no token types, a ``cache_position`` of one entry or none, and
    either a 2D mask of ``p + 1`` columns with one position per row, or no mask (with one position per row or none:
    transformers 5.x passes no mask for an unpadded batch).
    """
    if new != 1 or not past_length or cache_batch != batch or past_length >= max_positions or token_types_given:
        return False
    if cache_position_length not in (None, 1):
        return False
    if layer_lengths is None or layer_lengths.count(past_length) != len(layer_lengths):
        return False
    if mask_shape is None:
        return positions_shape is None or positions_shape == (batch, 1)
    return mask_shape == (batch, past_length + 1) and positions_shape == (batch, 1)


def align(
    *,
    input_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_length: int | None,
    cache_batch: int | None,
    limits: Limits,
    strict: bool,
    check_values: bool,
    token_type_ids: torch.Tensor | None = None,
    cache_position: torch.Tensor | None = None,
    layer_lengths: Sequence[int | None] | None = None,
) -> Aligned | None:
    """Align one step, or raise :class:`~neofix.NeofixError`.

    ``past_length`` is the number of tokens the cache holds (0 without a cache, ``None`` when it cannot be told
    without a device synchronisation: length checks are skipped then).  ``layer_lengths`` are the tokens each cache
    layer holds (``None`` for a layer that cannot be told): they must all equal ``past_length``, checked here, before
    any layer appends to the cache.  Returns ``None`` when there is nothing to align (neither input_ids nor
    inputs_embeds: transformers raises its own error).
    """
    # -- the new tokens -------------------------------------------------------------------------------------------
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise InputShapeError(
                f"input_ids has shape {tuple(input_ids.shape)}, but GPT-Neo expects (batch, new_tokens): "
                f"add the batch dimension (input_ids[None]) or flatten extra ones"
            )
        batch, new = input_ids.shape
    elif inputs_embeds is not None:
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != limits.hidden_size:
            raise InputShapeError(
                f"inputs_embeds has shape {tuple(inputs_embeds.shape)}, but this model expects "
                f"(batch, new_tokens, {limits.hidden_size}) (config.hidden_size = {limits.hidden_size}): embed the "
                f"tokens with this model's model.get_input_embeddings()"
            )
        batch, new = inputs_embeds.shape[0], inputs_embeds.shape[1]
    else:
        return None
    if new == 0:
        raise InputShapeError(
            f"this step feeds no new tokens ({'input_ids' if input_ids is not None else 'inputs_embeds'} has "
            f"0 columns, batch {batch}): every forward needs at least one token; stop the loop instead"
        )
    if cache_batch is not None and cache_batch != batch:
        raise BatchMismatchError(
            f"the cache holds {cache_batch} rows, but this step feeds {batch}: the cache, attention_mask and "
            f"inputs must hold the same rows (reorder or select the cache with the inputs, e.g. after beam search)"
        )
    if layer_lengths is not None and past_length is not None:
        # one pass in C for the usual case (every layer holds past_length, or cannot tell); the loop names the layer
        if layer_lengths.count(past_length) + layer_lengths.count(None) != len(layer_lengths):
            for layer, held in enumerate(layer_lengths):
                if held is not None and held != past_length:
                    raise_cache_length_error(layer, held, past_length)

    repairs: list[str] = []
    total = None if past_length is None else past_length + new
    if total is not None and total > limits.max_positions:
        fit = max(limits.max_positions - past_length, 0)
        raise SequenceTooLongError(
            f"this step would reach sequence length {total} (the cache holds {past_length} tokens and the step "
            f"feeds {new}), but config.max_position_embeddings is {limits.max_positions}: {fit} more new "
            f"token{'s' if fit != 1 else ''} fit; shorten the prompt or generate fewer tokens"
        )

    # -- the attention mask ---------------------------------------------------------------------------------------
    mask = attention_mask
    mask_2d = False
    if mask is not None:
        mask_dim = mask.dim()
        if mask_dim == 2:
            mask_2d = True
            if mask.shape[0] != batch:
                raise BatchMismatchError(
                    f"attention_mask has {_rows(mask.shape[0])}, but this step feeds {batch}: "
                    f"pass one mask row per input row"
                )
            columns = mask.shape[1]
            if total is not None and columns != total:
                expected = (
                    f"attention_mask has {columns} columns, but the cache holds {past_length} tokens and this "
                    f"step feeds {new}: expected {total}"
                )
                if columns > total:
                    raise MaskLengthError(
                        f"{expected}. A longer mask is ambiguous (which columns belong to the cache?): pass the mask "
                        f"of exactly the cached plus the new tokens"
                    )
                if strict:
                    raise MaskLengthError(f"{expected}. The mask was not extended for the new tokens: {_FIX_MASK}")
                mask = torch.cat([mask, mask.new_ones((batch, total - columns))], dim=-1)
                repairs.append(MASK_EXTENDED)
                warn_once(
                    MASK_EXTENDED,
                    f"neofix: {expected}; extended it with ones on the right (the classic 'mask not extended' "
                    f"decoding bug). To fix your loop: {_FIX_MASK}. Reported once.",
                )
        elif mask_dim in (3, 4):
            if mask.shape[0] not in (1, batch):
                raise BatchMismatchError(
                    f"the {mask_dim}D attention_mask has {_rows(mask.shape[0])}, but this step feeds {batch}: pass "
                    f"one mask row per input row (or one for all)"
                )
            if mask.shape[-2] != new or (total is not None and mask.shape[-1] != total):
                keys = "" if total is None else f", {total}"
                raise MaskLengthError(
                    f"the {mask_dim}D attention_mask has shape {tuple(mask.shape)}, but this step needs "
                    f"(..., {new}{keys}): one row per new token and one column per cached plus new token "
                    f"(the cache holds {past_length}); or pass the 2D (batch, cached + new tokens) padding mask and "
                    f"let the model build the rest"
                )
        else:
            raise InputShapeError(
                f"attention_mask has shape {tuple(mask.shape)}; pass a 2D (batch, cached + new tokens) mask"
            )

    # -- token types and cache positions (same length rules as positions) --------------------------------------
    if token_type_ids is not None and token_type_ids.shape[-1] != new:
        if not strict and total is not None and token_type_ids.shape[-1] == total:
            token_type_ids = token_type_ids[..., -new:]
            repairs.append(TOKEN_TYPES_SLICED)
        else:
            raise InputShapeError(
                f"token_type_ids has {token_type_ids.shape[-1]} columns, but this step feeds {_new_tokens(new)}: "
                f"pass the new tokens' types only"
            )
    if cache_position is not None and cache_position.shape[-1] != new:
        described = f"cache_position has {cache_position.shape[-1]} entries, but this step feeds {_new_tokens(new)}"
        if strict:
            raise PositionError(f"{described}: pass cache_position for the new tokens only, or leave it out")
        cache_position = None  # the model recomputes it from the cache length
        repairs.append(CACHE_POSITION_DROPPED)
        warn_once(CACHE_POSITION_DROPPED, f"neofix: {described}; left it out. Reported once.")

    # -- positions ------------------------------------------------------------------------------------------------
    positions = position_ids
    given_positions = positions is not None
    if positions is not None:
        positions_dim = positions.dim()
        if positions_dim not in (1, 2):
            raise PositionError(f"position_ids has shape {tuple(positions.shape)}; expected (batch, new_tokens)")
        rows = positions.shape[0] if positions_dim == 2 else 1
        if rows not in (1, batch):
            raise BatchMismatchError(
                f"position_ids has {_rows(rows)}, but this step feeds {batch}: pass one row per input row (or one "
                f"row for all)"
            )
        length = positions.shape[-1]
        if length != new:
            described = (
                f"position_ids has {length} columns, but this step feeds {_new_tokens(new)} "
                f"(the cache holds {past_length})"
            )
            if strict:
                raise PositionError(f"{described}: {_FIX_POSITIONS}")
            if total is not None and length == total:
                positions = positions[..., -new:]
                repairs.append(POSITIONS_SLICED)
            else:
                positions = None
                given_positions = False
                repairs.append(POSITIONS_REDERIVED)
                warn_once(
                    POSITIONS_REDERIVED,
                    f"neofix: {described}; derived them from the attention mask instead (stale prompt positions?). "
                    f"To fix your loop: {_FIX_POSITIONS}. Reported once.",
                )
    if positions is None:
        if mask_2d:
            positions = derive_positions(mask, new)
            if past_length is not None:
                positions = _trailing_pads_as_transformers(positions, mask, past_length, cache_position)
            repairs.append(POSITIONS_DERIVED)
        elif POSITIONS_REDERIVED in repairs and past_length is not None:
            # no 2D mask: every token is real, so positions simply continue after the cache
            device = input_ids.device if input_ids is not None else inputs_embeds.device  # type: ignore[union-attr]
            positions = torch.arange(past_length, total, device=device).unsqueeze(0)  # type: ignore[arg-type]

    # -- values: one synchronisation, only where it is cheap or asked for ------------------------------------
    prefill = new > 1 or not past_length
    check_ids = input_ids is not None and (prefill or check_values)
    check_range = given_positions and (prefill or check_values)  # given positions index the position table
    check_positions = check_values and given_positions and mask_2d
    values_checked = check_ids or check_range
    if values_checked:
        repaired = _check_values(
            input_ids if check_ids else None,
            token_type_ids if check_ids else None,
            positions if check_range else None,
            mask if check_positions else None,
            new,
            limits,
            strict,
        )
        if repaired is not None:
            positions = repaired
            repairs.append(POSITION_VALUES)

    # tuple.__new__ builds the same Aligned as Aligned(...) without the Python-level __new__ NamedTuple generates
    aligned = (mask, positions, token_type_ids, cache_position, batch, new, tuple(repairs), values_checked)
    return _new_tuple(Aligned, aligned)  # type: ignore[no-any-return]


def _check_values(
    input_ids: torch.Tensor | None,
    token_type_ids: torch.Tensor | None,
    positions: torch.Tensor | None,
    mask: torch.Tensor | None,
    new: int,
    limits: Limits,
    strict: bool,
) -> torch.Tensor | None:
    """Check token ids, the range of given positions and (with ``mask``) their values with one synchronisation.

    Returns repaired positions, or None when nothing was repaired.
    """
    named = (("input_ids", input_ids), ("token_type_ids", token_type_ids))
    id_tensors = [(name, ids) for name, ids in named if ids is not None]
    flags = [_outside(t, limits.vocab_size) for _, t in id_tensors]
    if positions is not None:
        flags.append(_outside(positions, limits.max_positions))
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
        raise_position_range_error(positions, limits.max_positions)
    if derived is None or not found[-1]:
        return None
    row, column = wrong.nonzero()[0].tolist()  # type: ignore[union-attr]
    given = int(torch.broadcast_to(positions, derived.shape)[row, column])  # type: ignore[arg-type]
    described = (
        f"position_ids[{row}, {column}] is {given}, but the attention mask puts that real token at position "
        f"{int(derived[row, column])}"
    )
    if strict:
        raise PositionError(f"{described}: positions must advance by one per real token; {_FIX_POSITIONS}")
    warn_once(
        POSITION_VALUES,
        f"neofix: {described}; used the positions derived from the mask. To fix your loop: {_FIX_POSITIONS}. "
        f"Reported once.",
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


def _rows(count: int) -> str:
    return f"{count} row{'s' if count != 1 else ''}"


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
        else "GPT-Neo embeds token types with the token embedding, so they must be token ids too"
    )
    raise TokenIdError(
        f"{name}{where} is {value}, outside the vocabulary: config.vocab_size is {vocab_size}, so token ids must "
        f"lie in [0, {vocab_size - 1}]. {fix}"
    ) from cause


def raise_position_range_error(
    positions: torch.Tensor, max_positions: int, cause: BaseException | None = None
) -> None:
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


def raise_cache_length_error(layer: Any, held: int, expected: int) -> None:
    """Raise :class:`CacheLengthError`: cache ``layer`` holds ``held`` tokens where layer 0 holds ``expected``."""
    raise CacheLengthError(
        f"cache layer {layer} holds {held} tokens, but layer 0 holds {expected}: every layer of the cache must hold "
        f"the same tokens (was it built for another model, or cropped or edited per layer?). Crop every layer to "
        f"the same length, or rebuild the cache by running the whole sequence again"
    )


def explain_index_error(
    cause: IndexError,
    limits: Limits,
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
    if position_ids is not None:
        raise_position_range_error(position_ids, limits.max_positions, cause)
