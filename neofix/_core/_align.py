"""The alignment core: one decoding step's tensors and cache view in, aligned tensors or a :class:`NeofixError` out.

Pure and version-free: it knows nothing about transformers releases, model families, caches' classes or wrappers,
and it warns nothing itself (repairs come back as data; the caller reports them).  The step contract (``b`` batch,
``q`` new tokens, ``p`` cached tokens, ``m`` mask columns, ``P`` the position table's size):

* ``m == p + q``: unchanged.  ``m < p + q``: the mask was not extended; repair appends ones (strict: error).
  ``m > p + q``: sliced to ``p + q`` where every reading of it gives the same mask (all ones), else an error.
  A repair is never a guess: where two readings of a mask give different masks, it is refused; where they agree,
  there is nothing to refuse.
* position_ids missing: ``cumsum(mask) - 1`` over the whole mask, last ``q`` columns, pads clamped to 0.
  Length ``p + q``: the last ``q`` are taken (strict: error).  Any other length: re-derived (strict: error).
* ``p + q > P``: error before any compute.  Batch mismatches, cache layers of different lengths, empty steps,
  wrong embedding widths: errors.

:func:`align` runs five named steps in order: :func:`read_inputs` (the new tokens), :func:`check_cache`,
:func:`align_mask`, :func:`align_side_inputs` (token types, cache positions) and :func:`align_positions`; then the
value rules of :mod:`._values`.  Each rule is written once, here or there; a step that keeps every rule (the usual
decode step) passes each of them without a torch operation, so there is no separate fast path to keep equal.
"""

from __future__ import annotations

from typing import Any

import torch

from .._errors import (
    NeofixError,
    BatchMismatchError,
    CacheLengthError,
    InputShapeError,
    MaskLengthError,
    PositionError,
    SequenceTooLongError,
    TokenIdError,
    counted,
)
from ._types import (
    CACHE_POSITION_DROPPED,
    MASK_EXTENDED,
    MASK_SLICED,
    POSITIONS_REDERIVED,
    POSITIONS_SLICED,
    TOKEN_TYPES_SLICED,
    Aligned,
    CacheView,
    Limits,
    Policy,
    Positions,
    Repair,
    StepInputs,
    is_integer,
)
from ._reads import Facts
from ._values import (
    FIX_POSITIONS,
    ValueStep,
    built_by,
    check_positions_fit,
    check_values,
    positions_kept,
    read_values,
    rows_to_mark,
    cache_position_kept,
    on_host,
    settle,
    settle_cache_position,
    sequence_too_long,
    value_plan,
)

FIX_MASK = "append a column of ones per new token (torch.cat([mask, mask.new_ones(batch, new_tokens)], -1))"

def align(
    step: StepInputs, cache: CacheView, limits: Limits, policy: Policy = Policy(), facts: Facts | None = None
) -> Aligned | None:
    """Align one step, or raise :class:`~neofix.NeofixError`.

    ``cache`` says what the cache holds (:class:`CacheView`; its ``length`` is ``None`` when that cannot be told
    without a device synchronisation: length checks are skipped then).  ``facts``: the step's values, where
    :func:`keeps_every_rule` read them already.  Returns ``None`` when there is nothing to align (neither input_ids
    nor inputs_embeds: transformers raises its own error).
    """
    shape = read_inputs(step, limits)
    if shape is None:
        return None
    batch, new = shape
    cache = length_from_slots(cache, step.cache_position, new, policy.compiling, policy.strict)
    total, past_the_table = check_cache(cache, batch, new, limits)
    strict = policy.strict
    repairs: list[Repair] = []
    passed, mask_2d = align_mask(step.attention_mask, batch, new, cache, total, repairs, policy)
    if policy.trusted_positions and any(kind in (MASK_EXTENDED, MASK_SLICED) for kind, _ in repairs):
        step = step._replace(position_ids=None)  # generate built them from the mask it gave, not from this one: as
        # where none are given, this one's rules make them (the mask's repair, said, is the one cause)
    mask = passed
    if mask_2d and total is not None and mask.shape[-1] > total:  # a static cache's slots (_read_by_slot): its
        mask = mask[:, :total]  # first columns are the tokens so far (the slots past them are empty)
    token_types, cache_position = align_side_inputs(step, new, total, strict, repairs)
    cache_position = settle_cache_position(cache_position, cache.length, new, policy, repairs)
    first = step.input_ids if step.input_ids is not None else step.inputs_embeds
    model_mask = mask is not None and not mask_2d
    positions, given = align_positions(
        step.position_ids, mask_2d, model_mask, batch, new, cache.length, total, strict, repairs, first,
        policy.positions,
    )
    if passed is not mask and positions is None and policy.positions is Positions.MASK:  # read by slot, and the
        passed = mask  # model derives positions from every column it is given (OPT: cumsum, less the cache): the
        repairs.append(Repair(MASK_SLICED, ""))  # tokens so far
    values = ValueStep(
        step.input_ids, token_types, positions, given, mask if mask_2d else None, model_mask, new, cache.length,
        cache_position, cache.built,
    )
    settled = settle(values, limits, policy, repairs, facts)
    if past_the_table is not None:  # more tokens than the table, where it bounds positions alone: they decide
        check_positions_fit(settled.positions, past_the_table, policy.compiling)
    return Aligned(
        passed,
        settled.positions,
        token_types,
        cache_position,
        batch,
        new,
        tuple(repairs),
        settled.report,
        settled.right_padded,
        settled.built,
    )


def keeps_every_rule(
    step: StepInputs, cache: CacheView, limits: Limits, kind: Positions, trusted: bool, read_always: bool, strict: bool
) -> tuple[bool, Facts | None]:
    """Whether :func:`align` would return ``step`` as it is, with nothing repaired, reported or marked: the usual
    decode step (one token after a cache, its mask extended, positions none or generate's own), and the usual forward
    without left padding (training, scoring, a prompt, a chunk).

    Decided by the rule functions :func:`align` applies, on shapes (:func:`ids_problem`, :func:`cache_problem`,
    :func:`mask_rows_problem`, :func:`mask_kept`, :func:`positions_problem`, :func:`~._values.value_plan`,
    :func:`~._values.cache_position_kept`) and, for a
    step that reads its values, on the values read once (:func:`~._values.read_values`, judged by
    :func:`~._values.check_values`, which raises as align would, :func:`~._values.positions_kept` and
    :func:`~._values.rows_to_mark`).  So it can only spare align's work, never decide otherwise: where any rule
    would act or refuse on shapes, it answers ``False`` and align decides, with the values' facts where they were
    read (``align(..., facts=)``: a step's values are read once).  ``kind``, ``trusted``, ``read_always``
    (``check_values``) and ``strict``: see :class:`Policy`.
    """
    input_ids, embeds, mask, positions, token_types, cache_position = step
    if input_ids is None or embeds is not None or token_types is not None:
        return False, None
    shape = input_ids.shape  # (each tensor's shape read once: a tensor's attributes cost more than a rule's test)
    if ids_problem(shape, input_ids.dtype) is not None:
        return False, None
    batch, new = shape
    past = cache.length
    if not new or past is None or not batch or cache_problem(cache, batch, new, limits) is not None:
        return False, None
    if mask is not None:
        if isinstance(mask, dict):
            return False, None
        shape = mask.shape
        if len(shape) != 2 or mask_rows_problem(shape[0], batch) is not None or not mask_kept(shape[1], past + new):
            return False, None
    if cache_position is not None and (
        cache_position.shape[-1] != new or not cache_position_kept(cache_position, past, new)
    ):
        return False, None
    given = positions is not None and kind.taken
    if given:
        shape = positions.shape
        if positions_problem(shape, positions.dtype, batch) is not None or shape[-1] != new:
            return False, None
    compare, derive, read, rotary, scheme = value_plan(
        given, mask is not None, False, new, past, kind, trusted, read_always, strict, cache.built
    )
    if rotary:
        return False, None
    if not read:
        return not (compare or derive), None
    facts = read_values(input_ids, None, positions, given, compare, mask, new, past, limits, None, scheme)
    check_values(facts, input_ids, None, positions, mask, limits)
    kept = positions_kept(facts, compare, derive, cache.built) and not rows_to_mark(facts, past)
    kept = kept and built_by(facts, scheme, kind, given, past, mask is not None) is None
    return kept, facts


# -- 1. the new tokens -----------------------------------------------------------------------------------------------


def read_inputs(step: StepInputs, limits: Limits) -> tuple[int, int] | None:
    """``(batch, new tokens)`` of the step, from ``input_ids`` or ``inputs_embeds``; ``None`` when neither is given."""
    input_ids, embeds = step.input_ids, step.inputs_embeds
    if input_ids is not None:
        shape = input_ids.shape
        problem = ids_problem(shape, input_ids.dtype)
        if problem is not None:
            raise problem
        batch, new = shape
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


def ids_problem(shape: Any, dtype: Any) -> NeofixError | None:
    """The error for ``input_ids`` (of ``shape`` and ``dtype``) that are not a 2D tensor of integers, else ``None``."""
    if len(shape) != 2:
        return InputShapeError(
            f"input_ids has shape {tuple(shape)}, but the model expects (batch, new_tokens): "
            f"add the batch dimension (input_ids[None]) or flatten extra ones"
        )
    if not is_integer(dtype):
        return TokenIdError(
            f"input_ids has dtype {dtype}, but token ids are integers (indices into the vocabulary): "
            f"pass the tokenizer's input_ids (torch.long)"
        )
    return None


# -- 2. the cache ----------------------------------------------------------------------------------------------------


def length_from_slots(cache: CacheView, slots: Any, new: int, compiling: bool, strict: bool = False) -> CacheView:
    """A static cache's length (a tensor: not known from shapes) where the new tokens' slots (``cache_position``,
    given or transformers' own) tell it: their last + 1 - ``new``, read in an eager call on the host (CPU memory,
    nothing to wait for), or anywhere in ``strict`` mode (which may synchronise: it raises where a repair would be
    made).  The step is then checked as one after a cache of that many tokens.  Elsewhere it stays unknown, and
    positions are taken at the slots on the device (:func:`~._reads.new_columns`)."""
    if cache.length is not None or cache.layout != "static" or slots is None or compiling or slots.dim() != 1:
        return cache
    if slots.shape[0] != new or not (strict or on_host(slots, None)):
        return cache
    past = int(slots[-1]) + 1 - new
    return cache._replace(length=past) if past >= 0 else cache


def check_cache(
    cache: CacheView, batch: int, new: int, limits: Limits
) -> tuple[int | None, SequenceTooLongError | None]:
    """Check the cache against the step; return ``p + q`` (``None`` when the cache's length cannot be told), and
    the error of a step of more tokens than the position table where the table bounds only the positions looked up
    (``limits.wider_than_table``): a left-padded batch wider than the table runs where its positions fit, which
    :func:`~._values.check_positions_fit` reads (else ``None``)."""
    problem = cache_problem(cache, batch, new, limits)
    deferred = problem if limits.wider_than_table and type(problem) is SequenceTooLongError else None
    if problem is not None and deferred is None:
        raise problem
    return (None if cache.length is None else cache.length + new), deferred


def cache_problem(cache: CacheView, batch: int, new: int, limits: Limits) -> NeofixError | None:
    """The error for a cache that does not fit the step or the model, else ``None``: other rows, another model's
    heads, layers of different lengths, or more tokens than the position table holds (where the table bounds only
    positions, a left-padded step may still fit: see :func:`check_cache`)."""
    # Unpacked at once: a named field costs a lookup each.
    past, rows, lengths, _, heads, head_dim, _, _ = cache
    max_positions, _, _, model_heads, model_head_dim, _, unused_head_dim = limits
    if rows is not None and rows != batch:
        return BatchMismatchError(
            f"the cache holds {counted(rows, 'row')}, but this step feeds {batch}: the cache, attention_mask and "
            f"inputs must hold the same rows (reorder or select the cache with the inputs, e.g. after beam search)"
        )
    if heads is not None and model_heads is not None and (heads != model_heads or head_dim != model_head_dim):
        found = (
            f"the cache holds keys of {heads} heads of width {head_dim}, but this model has {model_heads} heads of "
            f"width {model_head_dim}"
        )
        if heads == model_heads and head_dim == unused_head_dim:  # e.g. the static cache generate builds from it
            return InputShapeError(
                f"{found}: the cache was built from the config's head_dim of {head_dim}, which this model's attention "
                f"does not use on this transformers release (it uses hidden_size // num_attention_heads). Leave "
                f"head_dim out of the config or set it to {model_head_dim}"
            )
        return InputShapeError(
            f"{found}: the cache was built by another model. Pass the cache this model returned, or none (the prompt "
            f"is then encoded again)"
        )
    if lengths is not None and past is not None and lengths.count(past) != len(lengths):
        # (one pass in C for the usual case, every layer holding past; the loop skips layers that cannot tell)
        for layer, held in enumerate(lengths):
            if held is not None and held != past:
                return cache_length_error(layer, held, past)
    if past is None or max_positions is None or past + new <= max_positions:
        return None
    return sequence_too_long(past, new, max_positions)


def raise_cache_length_error(layer: Any, held: int, expected: int) -> None:
    """Raise :class:`CacheLengthError`: cache ``layer`` holds ``held`` tokens where layer 0 holds ``expected``."""
    raise cache_length_error(layer, held, expected)


def cache_length_error(layer: Any, held: int, expected: int) -> CacheLengthError:
    return CacheLengthError(
        f"cache layer {layer} holds {counted(held, 'token')}, but layer 0 holds {expected}: every layer of the cache must hold "
        f"the same tokens (was it built for another model, or cropped or edited per layer?). Crop every layer to "
        f"the same length, or rebuild the cache by running the whole sequence again"
    )


# -- 3. the attention mask -------------------------------------------------------------------------------------------


def align_mask(
    mask: Any,
    batch: int,
    new: int,
    cache: CacheView,
    total: int | None,
    repairs: list[Repair],
    policy: Policy,
) -> tuple[Any, bool]:
    """The mask to use (a 2D mask extended where it was not), and whether it is a 2D padding mask (``policy``: strict
    mode, and whether a static cache's may be widened to its slots, see :func:`_extended_to_the_slots`).

    A 3D or 4D mask is the model's own attention mask (transformers builds one for static caches): one row per new
    token, and one column per cached plus new token, or per slot of a static cache.
    """
    if mask is None or isinstance(mask, dict):  # a dict: 5.x generate's prepared masks, one per layer type (used as
        return mask, False  # given, as a 4D mask: the model's own, with layers of different widths)
    dims = mask.dim()
    if dims == 2:
        problem = mask_rows_problem(mask.shape[0], batch)
        if problem is not None:
            raise problem
        if cache.capacity is not None and mask.shape[1] > cache.capacity:
            _raise_past_capacity(mask.shape[1], cache.capacity)
        if total is not None and total < mask.shape[1] and _read_by_slot(mask.shape[1], cache):
            return mask, True  # read by slot, as transformers reads it, and passed on as given (see align)
        if total is None and _extended_to_the_slots(mask.shape[1], new, cache, policy):
            return torch.cat([mask, mask.new_ones((batch, cache.capacity - mask.shape[1]))], dim=-1), True
        return _align_padding_mask(mask, batch, new, cache.length, total, policy.strict, repairs), True
    if dims in (3, 4):
        _check_model_mask(mask, dims, batch, new, cache, total)
        return mask, False
    raise InputShapeError(f"attention_mask has shape {tuple(mask.shape)}; pass a 2D (batch, cached + new tokens) mask")


def _read_by_slot(columns: int, cache: CacheView) -> bool:
    """Whether a 2D mask wider than the tokens so far is a static cache's mask of its slots (ones for the tokens so
    far, zeros or ones for empty slots: a loop's mask allocated up front, or one as wide as the cache), which
    transformers reads by slot, its columns the slots from the first: over a static cache of no more slots than it
    has columns (any width where the slots are each layer's: sliding-window layers, no capacity told)."""
    return cache.layout == "static" and (cache.capacity is None or columns <= cache.capacity)


def _extended_to_the_slots(columns: int, new: int, cache: CacheView, policy: Policy) -> bool:
    """Whether a decode step's 2D mask over a static cache whose length is not known (on an accelerator, or inside
    ``torch.compile``) is extended with ones to the cache's slots, unread: a mask of the tokens so far, the prompt's
    not extended since (the classic bug), or one allocated up front.  Every such reading gives the same mask: its
    columns are slots, the tokens' slots past it are ones (the cached and the new tokens are real), and the empty
    slots' columns are hidden by the causal mask whatever they hold.  (Strict mode reads the length in an eager call,
    :func:`length_from_slots`: this is for ``torch.compile`` there, which repairs what it cannot read.)  A mask as
    wide as the new token alone is left as given (its value is that token's, or the first cached token's: a read
    would tell), and so is every mask of a family that derives positions from each column it is given
    (``Positions.MASK``, OPT: it would derive one for every slot), and of an attention that keeps as many keys as the
    mask has columns (flash attention: ``Policy.pads_masks``)."""
    capacity = cache.capacity  # (a static cache's slots: None for any other, and over sliding-window layers)
    if capacity is None or not policy.pads_masks or policy.positions is Positions.MASK:
        return False
    return new == 1 and new < columns < capacity


def _align_padding_mask(
    mask: Any, batch: int, new: int, past: int | None, total: int | None, strict: bool, repairs: list[Repair]
) -> Any:
    """A 2D padding mask of one row per input row, extended with ones where it covers the cache but not the new
    tokens; one that is longer, or whose columns cannot be told apart, is refused."""
    columns = mask.shape[1]  # (its rows: checked by align_mask)
    if mask_kept(columns, total):
        return mask
    expected = (
        f"attention_mask has {counted(columns, 'column')}, but the cache holds {counted(past, 'token')} and this step "
        f"feeds {new}: expected {total}"
    )
    if columns > total:
        if not _readings_agree(mask, total):
            raise MaskLengthError(
                f"{expected}. A longer mask is ambiguous (which columns belong to the cache? its first {total} "
                f"columns and its last {total} give different masks): pass the mask of exactly the cached plus the "
                f"new tokens"
            )
        repairs.append(Repair(MASK_SLICED, ""))  # every reading gives the same mask: as transformers slices it
        return mask[:, :total]
    if past and (columns == new or columns > past) and not _readings_agree(mask, total):
        # as wide as the new tokens (the chunk's own mask?) or covering only some of them: the mask extended with
        # ones on the right and on the left are two readings, and with zeros in it they differ
        raise MaskLengthError(
            f"{expected}. It cannot be told which tokens it covers: "
            + (
                f"as wide as this step's {counted(new, 'new token')}, it may be their mask alone (a chunk's own mask), or the "
                f"mask of the first {columns} cached tokens not extended since"
                if columns == new
                else f"it covers the {past} cached tokens and only some of the {counted(new, 'new token')}"
            )
            + ". Pass the mask of exactly the cached plus the new tokens (torch.cat([mask_so_far, new_mask], -1))"
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
    return torch.cat([mask, mask.new_ones((batch, total - columns))], dim=-1)


def mask_rows_problem(given: int, batch: int) -> NeofixError | None:
    """The error for a 2D mask of ``given`` rows where the step feeds ``batch``, else ``None``."""
    if given == batch:
        return None
    return BatchMismatchError(
        f"attention_mask has {counted(given, 'row')}, but this step feeds {batch}: pass one mask row per input row"
    )


def mask_kept(columns: int, total: int | None) -> bool:
    """Whether a 2D mask of ``columns`` columns is used as given: it covers the cached plus the new tokens (or the
    cache's length cannot be told)."""
    return total is None or columns == total


def _readings_agree(mask: Any, total: int) -> bool:
    """Whether every reading of a mask of another width than ``total`` gives the same mask of ``total`` columns:
    its first and its last ``total`` columns (a longer mask), or it extended with ones on the right and on the left
    (a shorter one; equal only when it is all ones).  Reads the mask: only masks of a wrong width get here."""
    if mask.shape[1] > total:
        return bool(torch.equal(mask[:, :total], mask[:, -total:]))
    return bool((mask == 1).all())


def _raise_past_capacity(columns: int, capacity: int) -> None:
    """Refuse a 2D mask of more tokens than a static cache has slots: the step cannot fit in it."""
    raise CacheLengthError(
        f"attention_mask has {columns} columns, but the cache is a static cache of {capacity} slots: the cached and "
        f"the new tokens cannot fit (a model that builds its own static cache when none is passed, as Gemma2 and "
        f"Gemma3 do before transformers 4.53, makes it as long as the prompt). Pass a cache with room for every "
        f"token (max_cache_len) from the first step, or decode with generate()"
    )


def _check_model_mask(mask: Any, dims: int, batch: int, new: int, cache: CacheView, total: int | None) -> None:
    """Refuse a 3D or 4D mask of other rows or columns than the step's (it is used as given, never repaired)."""
    if mask.shape[0] not in (1, batch):
        raise BatchMismatchError(
            f"the {dims}D attention_mask has {counted(mask.shape[0], 'row')}, but this step feeds {batch}: pass one mask "
            f"row per input row (or one for all)"
        )
    keys = mask.shape[-1]
    if cache.capacity is not None:  # the keys span every slot (a mask of the tokens so far runs on no release)
        fits = keys == cache.capacity
        needs = f"{cache.capacity} columns, one per slot of the static cache"
    elif cache.layout == "static":  # sliding-window layers' slots: the width is the layer's (see read_window_cache)
        fits = True
        needs = "the columns its sliding-window cache layers take"
    else:
        fits = total is None or keys == total
        needs = f"{total} columns, one per cached and new token (the cache holds {cache.length})"
    if mask.shape[-2] != new or not fits:
        raise MaskLengthError(
            f"the {dims}D attention_mask has shape {tuple(mask.shape)}, but this step needs "
            f"{counted(new, 'row')} of queries (one per new token) and {needs}: pass a mask of that shape, "
            f"or pass the 2D (batch, cached + new tokens) padding mask and let the model build the rest"
        )


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
                f"token_type_ids has {token_types.shape[-1]} columns, but this step feeds {counted(new, 'new token')}: pass the new "
                f"tokens' types only"
            )
    if cache_position is not None and cache_position.shape[-1] != new:
        described = f"cache_position has {cache_position.shape[-1]} entries, but this step feeds {counted(new, 'new token')}"
        if strict:
            raise PositionError(f"{described}: pass cache_position for the new tokens only, or leave it out")
        cache_position = None  # the model recomputes it from the cache length
        repairs.append(Repair(CACHE_POSITION_DROPPED, f"neofix: {described}; left it out. Reported once."))
    return token_types, cache_position


# -- 5. positions ----------------------------------------------------------------------------------------------------


def align_positions(
    positions: Any,
    mask_2d: bool,
    model_mask: bool,
    batch: int,
    new: int,
    past: int | None,
    total: int | None,
    strict: bool,
    repairs: list[Repair],
    first: Any,
    kind: Positions = Positions.ABSOLUTE,
) -> tuple[Any, bool]:
    """The positions after the shape rules, and whether they are the caller's (``kind``: see :class:`Positions`).

    ``(given positions of q columns, True)``, or ``(None, False)`` to derive them from the 2D mask in the value step
    (or leave them to the model where there is none), or ``(positions made from shapes, False)``: stale positions
    with no mask at all, where every token is real and positions continue after the cache.  With a 3D or 4D mask
    (``model_mask``) no position is derived: stale ones are refused.
    """
    if positions is None or not kind.taken:  # none given, or a family that takes none (the model refuses)
        return positions, False
    shape = positions.shape
    problem = positions_problem(shape, positions.dtype, batch)
    if problem is not None:
        raise problem
    length = shape[-1]
    if length == new:
        return positions, True
    described = f"position_ids has {length} columns, but this step feeds {counted(new, 'new token')} (the cache holds {past})"
    if strict:
        raise PositionError(f"{described}: {FIX_POSITIONS}")
    if total is not None and length == total:
        repairs.append(Repair(POSITIONS_SLICED, ""))
        return positions[..., -new:], True
    if kind is Positions.ROTARY:
        raise PositionError(
            f"{described}: with rotary positions the new tokens must continue the positions the cache was built with "
            f"(transformers' own, counting left padding, or the mask's), which stale positions do not tell: "
            f"{FIX_POSITIONS}"
        )
    if model_mask:
        raise PositionError(
            f"{described}: with a 3D or 4D attention mask neofix cannot tell the rows' positions (it never derives "
            f"them from a mask it was not given): pass the new tokens' positions only"
        )
    return _rederived(described, mask_2d, past, total, repairs, first, kind), False


def _rederived(
    described: str, mask_2d: bool, past: int | None, total: int | None, repairs: list[Repair], first: Any,
    kind: Positions,
) -> Any:
    """Stale positions replaced (repair mode, a 2D mask or none): ``None`` to derive them from the mask in the value
    step (or to leave them to a family that derives its own), else the positions after the cache, every token real."""
    from_mask = mask_2d or past is None
    instead = (
        "derived them from the attention mask instead"
        if from_mask
        else f"gave them the positions after the cache instead, {past} to {total - 1} (with no attention mask every "
        f"token is real)"  # type: ignore[operator]
    )
    repairs.append(
        Repair(
            POSITIONS_REDERIVED,
            f"neofix: {described}; {instead} (stale prompt positions?). To fix your loop: {FIX_POSITIONS}. Reported "
            f"once.",
        )
    )
    if from_mask or kind is Positions.MASK:  # (a family that derives positions from its mask: left to it)
        return None
    return torch.arange(past, total, device=first.device).unsqueeze(0)  # type: ignore[arg-type]


def positions_problem(shape: Any, dtype: Any, batch: int) -> NeofixError | None:
    """The error for positions (of ``shape`` and ``dtype``) that are not a 1D or 2D tensor of integers with one row,
    or one per input row."""
    dims = len(shape)
    if dims not in (1, 2):
        return PositionError(f"position_ids has shape {tuple(shape)}; expected (batch, new_tokens)")
    if not is_integer(dtype):
        return PositionError(
            f"position_ids has dtype {dtype}, but positions are integers (each token's index in its sequence): "
            f"pass torch.long positions, e.g. (mask.long().cumsum(-1) - 1).clamp(min=0)"
        )
    given_rows = shape[0] if dims == 2 else 1
    if given_rows not in (1, batch):
        return BatchMismatchError(
            f"position_ids has {counted(given_rows, 'row')}, but this step feeds {batch}: pass one row per input row (or one row "
            f"for all)"
        )
    return None
