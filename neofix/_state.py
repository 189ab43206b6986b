"""``neofix.DecodeState``: the bookkeeping of a hand-written decoding loop (GPT-Neo, or any family given
``model=``), in one object.

A decoding loop has to move four things together at every step: the tokens fed (only the uncached ones), the
attention mask (cached plus new tokens), the position ids (from the mask, so left padding is honoured) and the
KV cache.  :class:`DecodeState` keeps them in step, with or without neofix's patch, on every supported
transformers release::

    state = DecodeState(input_ids, attention_mask)        # the prompt; left padding allowed
    out = model(**state.model_inputs())                   # prefill
    for _ in range(n):
        state.advance(out.logits[:, -1].argmax(-1), out)  # append the new tokens, take the model's cache
        out = model(**state.model_inputs())
    state.sequences                                       # (batch, prompt + generated)

Every step costs the same as the loop written by hand: the mask grows by one column, positions are one cumsum,
and the cache is handed on, never copied (only :meth:`DecodeState.reorder` of a legacy tuple cache copies it, as
transformers' own beam search does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from . import _caches, _compat
from ._core import derive_positions
from ._errors import BatchMismatchError, CacheLengthError, InputShapeError, MaskLengthError, NeofixError, counted

__all__ = ["DecodeState"]

_keyword: str | None = None


def _cache_keyword() -> str:
    """The keyword the installed GPT-Neo takes its cache under (read from the signature, once)."""
    global _keyword
    if _keyword is None:
        import importlib

        from ._families import GPT_NEO

        module = importlib.import_module(GPT_NEO.module)
        _keyword = _caches.keyword(getattr(module, GPT_NEO.causal_lm).forward)
    return _keyword


def _cache_objects_accepted() -> bool:
    """From 4.45 GPT-Neo's forward takes ``Cache`` objects (4.45 - 4.53 still take tuples, logging a deprecation)."""
    return _compat.release() >= (4, 45)


def _cache_of(out: Any, where: str) -> Any:
    """The cache in ``out``: a model output carrying one, a ``Cache`` object or a legacy tuple cache."""
    if isinstance(out, Mapping):  # transformers' ModelOutput; read by key (5.x logs a deprecation for attributes)
        cache = _caches.of_output(out)
        if cache is not None:
            return cache
        raise NeofixError(
            f"{where}: the model output carries no cache (its fields: {', '.join(out.keys()) or 'none'}): call the "
            f"model with use_cache=True, as model(**state.model_inputs()) does"
        )
    if isinstance(out, (tuple, list)):
        if _caches.is_legacy(out) or (type(out) is list and _fused(out)):
            return out
        if out and all(type(layer) is torch.Tensor and layer.dim() == 5 and len(layer) == 2 for layer in out):
            raise TypeError(
                f"{where}: got a legacy cache whose layers each stack key and value in one tensor (PEFT's prefix "
                f"tuning); pass it as one (key, value) pair per layer: tuple(tuple(layer) for layer in cache)"
            )
        if out and isinstance(out[0], torch.Tensor):
            raise TypeError(
                f"{where}: got the model output as a plain tuple (return_dict=False); pass the output of a "
                f"return_dict=True call, or the cache itself"
            )
        raise TypeError(
            f"{where}: got a {type(out).__name__} that is not a cache (a legacy cache is one (key, value) pair of 4D "
            f"tensors per layer); pass the model output or its cache"
        )
    if callable(getattr(out, "get_seq_length", None)):  # a transformers Cache object
        return out
    raise TypeError(
        f"{where}: expected the model output or its cache (a transformers Cache object or a tuple of (key, value) "
        f"pairs), got {type(out).__name__}"
    )


def _fused(cache: Any) -> bool:
    """A cache of one tensor per layer, its keys and values fused: GPT-BigCode's up to transformers 4.53 (a list, as
    its forward returns it; a model output given as a plain tuple, ``return_dict=False``, is a tuple)."""
    return isinstance(cache, (tuple, list)) and bool(cache) and all(
        type(layer) is torch.Tensor and layer.dim() in (3, 4) for layer in cache  # (not PEFT's stacked (2, B, H, S, D))
    )


def _preferred(cache: Any) -> Any:
    """The cache in the format the installed GPT-Neo takes without complaint (no copy where none is needed); a fused
    one (:func:`_fused`) as it is, the only format its model takes."""
    if _fused(cache):
        return cache
    if isinstance(cache, (tuple, list)):
        if _cache_objects_accepted():  # 4.45 - 4.53 log a deprecation for tuples, 4.54+ reject them
            return _caches.from_legacy(tuple(tuple(layer) for layer in cache), None)
        return cache
    if not _cache_objects_accepted():  # 4.36 - 4.44: transformers has Cache objects, GPT-Neo takes tuples
        to_legacy = getattr(cache, "to_legacy_cache", None)
        if to_legacy is None:
            raise TypeError(
                f"transformers {_compat.transformers_version()}'s GPT-Neo takes legacy tuple caches only, and a "
                f"{type(cache).__name__} cannot be converted to one"
            )
        return to_legacy()
    return cache


def _already_reordered(cache: Any, held: Any) -> bool:
    """Whether ``cache`` is the held Cache object, or tuples holding that object's current tensors (taken from it with
    ``to_legacy_cache()`` or by hand after ``reorder()`` reordered it in place)."""
    if cache is held:
        return True
    if held is None or isinstance(held, (tuple, list)) or not isinstance(cache, (tuple, list)) or not cache:
        return False
    layers = getattr(held, "layers", None)
    if layers:  # transformers >= 4.56
        key = getattr(layers[0], "keys", None)
    else:
        key_cache = getattr(held, "key_cache", None)
        key = key_cache[0] if key_cache else None
    return key is not None and _caches.first_key(cache) is key


def _reorder_cache(cache: Any, index: torch.Tensor) -> Any:
    if cache is None:
        return None
    if _fused(cache):
        return [layer.index_select(0, index.to(layer.device)) for layer in cache]
    if isinstance(cache, (tuple, list)):
        return tuple(tuple(t.index_select(0, index.to(t.device)) for t in layer) for layer in cache)
    cache.reorder_cache(index)  # in place, one index_select per layer
    return cache


def _tensor(value: Any, name: str, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _integer(value: torch.Tensor, name: str, where: str, what: str = "token ids") -> None:
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{where}: {name} must hold integer {what}, got dtype {value.dtype}")


class DecodeState:
    """Keeps the tokens, attention mask, positions and KV cache of a hand-written decoding loop in step.

    ``DecodeState(input_ids, attention_mask=None, *, model=None)`` starts from a prompt of shape (batch, length); left
    padding (mask 0 on the left) is allowed, and without a mask every token is real.  ``model``, the model the loop
    calls, tells which arguments it takes (positions or not, the cache keyword); without it the state prepares
    GPT-Neo's, which GPT-2, GPT-J, CodeGen and GPT-NeoX take too.

    * :meth:`model_inputs` returns the keyword arguments of the next forward: the tokens the cache does not hold
      yet, the mask over cached plus new tokens, their positions (``cumsum(mask) - 1``, pads at 0; not for a model
      that takes none, such as BLOOM), the cache under the keyword the model takes (GPT-Neo: ``cache`` from transformers
      5.24, ``past_key_values`` before) and ``use_cache=True``.
    * :meth:`advance` appends one token per row and takes the cache the forward returned.
    * :meth:`reorder` selects rows (beam search).  :meth:`check` validates a cache against the state.

    Correct with or without neofix's patch: the state itself derives everything the patch would repair.
    """

    __slots__ = (
        "_sequences", "_mask", "_cache", "_cached", "_awaiting", "_pending", "_pending_batch", "_keyword", "_positions"
    )

    def __init__(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, model: Any = None
    ) -> None:
        where = "DecodeState"
        ids = _tensor(input_ids, "input_ids", where)
        _integer(ids, "input_ids", where)
        if ids.dim() != 2:
            hint = " (add the batch dimension: input_ids[None])" if ids.dim() == 1 else ""
            raise InputShapeError(f"{where}: input_ids has shape {tuple(ids.shape)}; expected (batch, length){hint}")
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise InputShapeError(
                f"{where}: input_ids has shape {tuple(ids.shape)}; the prompt needs at least one row and one token"
            )
        mask = torch.ones_like(ids, dtype=torch.long) if attention_mask is None else _prompt_mask(attention_mask, ids)
        self._sequences = ids
        self._mask = mask
        self._cache: Any = None
        self._cached = 0  # tokens the cache holds
        self._awaiting = False  # model_inputs() was handed out and advance() has not been called since
        self._pending: torch.Tensor | None = None  # reorder to apply to the cache the current forward returns
        self._pending_batch = 0
        # the keyword the model takes its cache under, and whether it takes positions (ALiBi models do not)
        self._keyword: str | None = None
        self._positions = True
        if model is not None:
            import inspect

            forward = getattr(type(model), "forward", None)
            if forward is None:
                raise TypeError(f"{where}: model must be a transformers model, got {type(model).__name__}")
            parameters = inspect.signature(forward).parameters
            self._keyword = _caches.keyword(forward)
            self._positions = "position_ids" in parameters

    # -- reading ----------------------------------------------------------------------------------------------------

    @property
    def sequences(self) -> torch.Tensor:
        """Every token so far, shape (batch, prompt + generated), padding and finished rows' tokens included."""
        return self._sequences

    @property
    def attention_mask(self) -> torch.Tensor:
        """The mask over :attr:`sequences` (long, 1 real, 0 padding or a finished row's token)."""
        return self._mask

    @property
    def cache(self) -> Any:
        """The KV cache (``None`` before the first :meth:`advance`), in the format the installed GPT-Neo takes
        (GPT-BigCode's own up to transformers 4.53: a list of one tensor per layer, fusing its keys and values)."""
        return self._cache

    def __repr__(self) -> str:
        batch, length = self._sequences.shape
        return f"DecodeState(batch={batch}, tokens={length}, cached={self._cached})"

    def model_inputs(self) -> dict[str, Any]:
        """The keyword arguments of the next forward: ``model(**state.model_inputs())``.  Asked again before
        :meth:`advance`, it checks that no forward ran on the inputs it handed out last (a forward updates a cache
        object in place: :class:`~neofix.CacheLengthError`, before a step that would feed a token twice)."""
        if self._awaiting and self._cache is not None:  # asked again: did a forward update the cache since?
            self._validate(
                self._cache, self._cached, self._sequences.shape[0], "DecodeState.model_inputs",
                "a forward already ran on the inputs handed out last and updated the cache; pass its output to "
                "advance() before asking for the next inputs",
            )
        new = self._sequences.shape[1] - self._cached
        inputs: dict[str, Any] = {
            "input_ids": self._sequences[:, self._cached :],
            "attention_mask": self._mask,
            "use_cache": True,
        }
        if self._positions:
            inputs["position_ids"] = derive_positions(self._mask, new)
        if self._cache is not None:
            inputs[self._keyword or _cache_keyword()] = self._cache
        self._awaiting = True
        return inputs

    # -- stepping ---------------------------------------------------------------------------------------------------

    def advance(self, tokens: torch.Tensor, out: Any, finished: torch.Tensor | None = None) -> None:
        """Append one token per row and take the cache of the forward that just ran.

        tokens
            shape (batch,) or (batch, 1): the next token of every row.
        out
            the model output (with its cache) or the cache itself; it must hold every token of :attr:`sequences`.
        finished
            optional bool tensor of shape (batch,).  A finished row's token is appended masked out (mask 0): it does
            not move that row's position and no later token attends to it.  Other rows are unaffected.  A row is
            meant to stay finished: a masked column still counts towards GPT-Neo's local attention window.
        """
        where = "DecodeState.advance"
        batch, length = self._sequences.shape
        tokens = _tensor(tokens, "tokens", where)
        _integer(tokens, "tokens", where)
        if tokens.dim() == 2 and tokens.shape[1] == 1:
            tokens = tokens[:, 0]
        if tokens.dim() != 1:
            raise InputShapeError(
                f"{where}: tokens has shape {tuple(tokens.shape)}; expected ({batch},) or ({batch}, 1): one new token "
                f"per row"
            )
        if tokens.shape[0] != batch:
            raise BatchMismatchError(f"{where}: tokens has {counted(tokens.shape[0], 'row')}, but the state holds {batch}")
        column = self._mask.new_ones((batch, 1))
        if finished is not None:
            finished = _tensor(finished, "finished", where)
            if finished.dtype != torch.bool:
                raise TypeError(f"{where}: finished must be a bool tensor, got dtype {finished.dtype}")
            if finished.dim() != 1:
                raise InputShapeError(f"{where}: finished has shape {tuple(finished.shape)}; expected ({batch},)")
            if finished.shape[0] != batch:
                raise BatchMismatchError(f"{where}: finished has {counted(finished.shape[0], 'row')}, but the state holds {batch}")
            column = (~finished).to(device=self._mask.device, dtype=self._mask.dtype).unsqueeze(1)

        cache = _cache_of(out, where)
        # A reorder() since model_inputs() applies to the cache this forward returned, unless that cache is the
        # held Cache object itself (updated in place by the forward), which reorder() already reordered, or tuples
        # taken from it after reorder() (they hold its reordered tensors themselves).
        pending = self._pending if not _already_reordered(cache, self._cache) else None
        expected_batch = self._pending_batch if pending is not None else batch
        self._validate(cache, length, expected_batch, where, f"it must hold every token fed so far{_ASK}")
        if pending is not None:
            cache = _reorder_cache(cache, pending)
        self._pending = None
        self._cache = _preferred(cache)
        self._cached = length
        self._awaiting = False
        tokens = tokens.to(device=self._sequences.device, dtype=self._sequences.dtype).unsqueeze(1)
        self._sequences = torch.cat([self._sequences, tokens], dim=1)
        self._mask = torch.cat([self._mask, column], dim=1)

    def reorder(self, beam_idx: torch.Tensor) -> None:
        """Select rows: row ``i`` becomes the former row ``beam_idx[i]`` (sequences, mask and cache).

        Call it between a forward and :meth:`advance` (beam search: choose each new beam's source row and token,
        reorder, then advance with the new beams' tokens): the cache that forward returns is reordered when
        :meth:`advance` receives it.  Called after :meth:`advance`, it reorders the held cache.  ``beam_idx`` may
        repeat or drop rows.  A legacy tuple cache is copied (as transformers' beam search does); a Cache object is
        reordered in place.
        """
        where = "DecodeState.reorder"
        index = _tensor(beam_idx, "beam_idx", where)
        _integer(index, "beam_idx", where, "row indices")
        batch = self._sequences.shape[0]
        if index.dim() != 1 or index.shape[0] == 0:
            raise InputShapeError(
                f"{where}: beam_idx has shape {tuple(index.shape)}; expected a non-empty 1D tensor of row indices"
            )
        index = index.to(self._sequences.device).long()
        outside = (index < 0) | (index >= batch)
        if bool(outside.any()):
            position = int(outside.nonzero()[0, 0])
            raise NeofixError(
                f"{where}: beam_idx[{position}] is {int(index[position])}, but the state holds {batch} rows "
                f"(valid indices: 0 to {batch - 1})"
            )
        self._sequences = self._sequences.index_select(0, index)
        self._mask = self._mask.index_select(0, index)
        if self._awaiting:
            if self._pending is None:
                self._pending, self._pending_batch = index, batch
            else:
                self._pending = self._pending.index_select(0, index)
        # The held cache too: a Cache object may be the very one the forward updated in place (advance() then knows
        # it is reordered already); a held tuple is stale once a forward ran, but model_inputs() may be asked again.
        self._cache = _reorder_cache(self._cache, index)

    # -- checking ---------------------------------------------------------------------------------------------------

    def check(self, cache: Any = None) -> None:
        """Raise :class:`~neofix.NeofixError` unless ``cache`` fits this state (default: the state's own cache).

        A cache fits when it holds the tokens :meth:`model_inputs` will not feed again (every token but the last
        appended) for as many rows as the state: :class:`~neofix.CacheLengthError` names the lengths,
        :class:`~neofix.BatchMismatchError` the rows.  ``cache`` may also be a model output carrying one.
        """
        where = "DecodeState.check"
        if cache is None:
            cache = self._cache
            if cache is None:
                if self._cached:
                    raise CacheLengthError(f"{where}: the state expects a cache of {counted(self._cached, 'token')} but has none")
                return
        else:
            cache = _cache_of(cache, where)
        hint = "it must hold every token but the ones model_inputs() feeds next"
        if self._awaiting:
            hint += " (a forward already ran on this state? then pass its output to advance() first)"
        self._validate(cache, self._cached, self._sequences.shape[0], where, hint + _ASK)

    def _validate(self, cache: Any, length: int, batch: int, where: str, hint: str) -> None:
        if _fused(cache):  # (batch, [heads,] tokens, 2 * head_dim)
            held, rows = cache[0].shape[-2], cache[0].shape[0]
        else:
            view = _caches.read(cache, 1)
            held, rows = view.length, view.batch
        if rows is not None and rows != batch:
            raise BatchMismatchError(
                f"{where}: the cache holds {counted(rows, 'row')}, but the state holds {batch}: reorder or select the cache "
                f"with the state (DecodeState.reorder)"
            )
        if held is not None and held != length:
            raise CacheLengthError(
                f"{where}: the cache holds {counted(held, 'token')}, but the state expected {length}: {hint}"
            )


#: the question every cache-length error of a caller-given cache ends with
_ASK = ". Was the output of another step, model or state passed?"


def _prompt_mask(attention_mask: Any, ids: torch.Tensor) -> torch.Tensor:
    """The prompt's mask, checked against its ids (shape, rows, device, values 0 and 1), as long."""
    where = "DecodeState"
    mask = _tensor(attention_mask, "attention_mask", where)
    if mask.dim() != 2:
        raise InputShapeError(
            f"{where}: attention_mask has shape {tuple(mask.shape)}; expected a 2D (batch, length) mask "
            f"like input_ids {tuple(ids.shape)}"
        )
    if mask.shape[0] != ids.shape[0]:
        raise BatchMismatchError(
            f"{where}: attention_mask has {counted(mask.shape[0], 'row')}, but input_ids has {ids.shape[0]}"
        )
    if mask.shape[1] != ids.shape[1]:
        raise MaskLengthError(
            f"{where}: attention_mask has {mask.shape[1]} columns, but input_ids has {ids.shape[1]}: pass "
            f"the mask of the prompt, one column per token"
        )
    if mask.device != ids.device:
        raise NeofixError(
            f"{where}: attention_mask is on {mask.device}, but input_ids is on {ids.device}; move both to "
            f"the model's device"
        )
    if bool(((mask != 0) & (mask != 1)).any()):  # once, at the start: a cheap synchronisation
        bad = ((mask != 0) & (mask != 1)).nonzero()[0].tolist()
        raise NeofixError(
            f"{where}: attention_mask[{bad[0]}, {bad[1]}] is {mask[bad[0], bad[1]].item()}; a mask holds 1 "
            f"for real tokens and 0 for padding only"
        )
    return mask.long()
