"""Step traces: what every forward of a patched model (any of the seven families) was given and what neofix made of it.

``with neofix.trace(model) as steps:`` records one :class:`Step` per forward of that model's base model (``GPTNeoModel``, ``GPT2Model``, ...);
``NEOFIX_TRACE=1`` logs the same line per step through ``logging.getLogger("neofix")`` at INFO.  Tracing is opt-in
and reads a few numbers off the device per step (one synchronisation), so it is meant for debugging and tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

import torch

from . import _caches
from ._compat import is_tracing, positional_names
from ._reports import StepInfo, add_listener, listeners_lock, remove_listener

__all__ = ["Step", "trace"]

_WRAPPER_MARK = "__neofix_wrapper__"  # set on every function neofix installs (neofix._wrappers.MARK)


@dataclasses.dataclass(frozen=True)
class Step:
    """One forward of a patched model's base model, as the model computed it.

    ``mask_length_given`` is the 2D mask's length as passed, ``mask_length`` after neofix's alignment (the same when
    neofix is not patched).  Positions are those the model used: the aligned ones, or, where none were given to an
    unpatched model, the ``arange`` it builds itself.  ``last_positions`` and ``real_tokens`` are per row: the position
    of the row's last new token and the number of real (mask 1) tokens the mask covers.  ``repairs`` names what neofix
    changed (see ``neofix._align``: ``mask_extended``, ``positions_derived``, ...).  ``None`` where not known.
    """

    index: int
    batch: int
    new_tokens: int
    cached_tokens: int | None
    mask_length_given: int | None
    mask_length: int | None
    position_min: int | None
    position_max: int | None
    last_positions: tuple[int, ...] | None
    real_tokens: tuple[int, ...] | None
    repairs: tuple[str, ...]
    patched: bool

    def __str__(self) -> str:
        cached = "?" if self.cached_tokens is None else self.cached_tokens
        if self.mask_length is None and self.mask_length_given is None:
            mask = "mask none"
        elif self.mask_length_given is not None and self.mask_length_given != self.mask_length:
            mask = f"mask {self.mask_length_given} -> {self.mask_length}"
        else:
            mask = f"mask {self.mask_length}"
        if self.position_min is None:
            positions = "positions ?"
        elif self.position_min == self.position_max:
            positions = f"positions {self.position_min}"
        else:
            positions = f"positions {self.position_min}..{self.position_max}"
        repaired = ", ".join(self.repairs) if self.repairs else "nothing"
        line = (
            f"step {self.index}: batch {self.batch}, {self.new_tokens} new + {cached} cached, {mask}, {positions}, "
            f"repaired: {repaired}"
        )
        return line if self.patched else line + " (neofix not patched)"


def _summarise(
    index: int,
    batch: int,
    new: int,
    cached: int | None,
    mask_given: int | None,
    mask: Any,
    positions: Any,
    repairs: tuple[str, ...],
    patched: bool,
    device: Any,
) -> Step:
    """Build a :class:`Step`, reading every number off the device at once."""
    if positions is None and cached is not None:  # what GPT-Neo's forward builds when given no positions
        positions = torch.arange(cached, cached + new, device=device).unsqueeze(0)
    parts: list[torch.Tensor] = []
    if positions is not None:
        # one row (1D, or 2D of one row) for the batch, or one per row
        rows = torch.broadcast_to(positions, (batch, positions.shape[-1])).long()
        parts = [rows[:, -1], rows.min().reshape(1), rows.max().reshape(1)]
    mask_2d = isinstance(mask, torch.Tensor) and mask.dim() == 2
    if mask_2d:
        parts.append(mask.long().sum(-1))
    values = torch.cat([p.to(parts[0].device) for p in parts]).tolist() if parts else []
    last = low = high = real = None
    if positions is not None:
        last, (low, high), values = tuple(values[:batch]), values[batch : batch + 2], values[batch + 2 :]
    if mask_2d:
        real = tuple(values)
    elif mask is None and cached is not None:  # no mask: every token is real
        real = (cached + new,) * batch
    return Step(
        index=index,
        batch=batch,
        new_tokens=new,
        cached_tokens=cached,
        mask_length_given=mask_given,
        mask_length=None if mask is None else int(mask.shape[-1]),
        position_min=low,
        position_max=high,
        last_positions=last,
        real_tokens=real,
        repairs=tuple(repairs),
        patched=patched,
    )


def _from_info(index: int, info: StepInfo) -> Step:
    mask = info.attention_mask
    positions = info.position_ids
    device = mask.device if isinstance(mask, torch.Tensor) else None
    if device is None and isinstance(positions, torch.Tensor):
        device = positions.device
    return _summarise(
        index,
        info.batch,
        info.new_tokens,
        info.cached_tokens,
        info.mask_length_given,
        mask,
        positions,
        info.repairs,
        True,
        device,
    )


def _from_call(index: int, module: Any, args: tuple, kwargs: dict) -> Step | None:
    """A step read off an unpatched ``GPTNeoModel`` call (nothing is aligned then)."""
    if args:
        kwargs = {**dict(zip(positional_names(type(module).forward), args)), **kwargs}
    ids, embeds = kwargs.get("input_ids"), kwargs.get("inputs_embeds")
    if ids is not None and ids.dim() == 2:
        batch, new, device = ids.shape[0], ids.shape[1], ids.device
    elif embeds is not None and embeds.dim() == 3:
        batch, new, device = embeds.shape[0], embeds.shape[1], embeds.device
    else:
        return None
    cached = _caches.length(_caches.of_call(kwargs)[1])
    mask = kwargs.get("attention_mask")
    given = int(mask.shape[-1]) if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
    return _summarise(
        index, batch, new, cached, given, mask, kwargs.get("position_ids"), (), False, device
    )


def _base_model(model: Any) -> Any:
    """The one base model of a family neofix patches inside ``model`` (or ``model`` itself): the module whose
    forward every step of the model passes through (``GPTNeoModel`` for a ``GPTNeoForCausalLM``)."""
    from ._families import FAMILIES

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"neofix.trace needs a model (a torch.nn.Module), got {type(model).__name__}")
    classes = tuple(
        getattr(sys.modules[family.module], family.base_model)
        for family in FAMILIES.values()
        if family.module in sys.modules and hasattr(sys.modules[family.module], family.base_model)
    )
    found = [module for module in model.modules() if classes and isinstance(module, classes)]
    names = ", ".join(family.base_model for family in FAMILIES.values())
    if not found:
        raise TypeError(
            f"neofix.trace: {type(model).__name__} contains no transformers model neofix patches ({names}); pass one "
            f"(a causal LM such as GPTNeoForCausalLM, its base model, or a module holding one)"
        )
    if len(found) > 1:
        raise ValueError(
            f"neofix.trace: {type(model).__name__} contains {len(found)} such models ({type(found[0]).__name__}, "
            f"...); pass the one to trace"
        )
    return found[0]


def _is_patched(module: Any) -> bool:
    """Whether neofix's wrapper sits on this model's forward (its listener then records the forward)."""
    return getattr(type(module).forward, _WRAPPER_MARK, False)


@contextlib.contextmanager
def trace(model: Any) -> Iterator[list[Step]]:
    """Record one :class:`Step` per forward of ``model`` inside the ``with`` block::

        with neofix.trace(model) as steps:
            model.generate(input_ids, attention_mask=mask, max_new_tokens=4)
        print(*steps, sep="\\n")   # step 0: batch 2, 6 new + 0 cached, mask 6, positions 0..5, repaired: nothing

    ``model`` may be any module holding one base model of a family neofix patches (``GPTNeoModel`` in a
    ``GPTNeoForCausalLM``, ``GPT2Model`` in a classification head, your own wrapper); forwards of other models are not recorded, forwards of this one are, from any thread.
    Traces nest.  With neofix patched, a step records what the patch aligned and repaired; unpatched, it records
    what the model was given.  Traced or compiled forwards (torch.jit, fx, torch.compile, export) are not recorded.
    """
    target = _base_model(model)
    steps: list[Step] = []
    lock = threading.Lock()

    def add(build: Callable[[int], Step | None]) -> None:
        with lock:
            step = build(len(steps))
            if step is not None:
                steps.append(step)

    def listener(info: StepInfo) -> None:
        if info.model is target:
            add(lambda index: _from_info(index, info))

    def pre_hook(module: Any, args: tuple, kwargs: dict) -> None:
        if _is_patched(module):  # the patch's listener records this forward, aligned
            return
        first = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if is_tracing(first):
            return
        add(lambda index: _from_call(index, module, args, kwargs))

    add_listener(listener)
    try:
        handle = target.register_forward_pre_hook(pre_hook, with_kwargs=True)
    except BaseException:
        remove_listener(listener)
        raise
    try:
        yield steps
    finally:
        handle.remove()
        remove_listener(listener)


# -- NEOFIX_TRACE=1 ---------------------------------------------------------------------------------------------------

_LOGGER = logging.getLogger("neofix")
_log_counters: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def _log_listener(info: StepInfo) -> None:
    # number the steps of each model's sequence: a step with an empty cache starts a new one
    with listeners_lock:
        index = 0 if not info.cached_tokens else _log_counters.get(info.model, 0)
        _log_counters[info.model] = index + 1
    line = f"neofix: {type(info.model).__name__} {_from_info(index, info)}"
    if _LOGGER.hasHandlers():
        _LOGGER.info(line)
    elif _LOGGER.isEnabledFor(logging.INFO):  # logging is not configured: do not let the line vanish
        print(line, file=sys.stderr)


def log_steps() -> None:
    """Log every aligned forward at INFO through ``logging.getLogger("neofix")`` (``NEOFIX_TRACE=1``).  Idempotent."""
    if _LOGGER.level == logging.NOTSET:
        _LOGGER.setLevel(logging.INFO)
    add_listener(_log_listener)
