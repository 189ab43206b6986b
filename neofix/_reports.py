"""Where a step's outcome goes: its repairs are warned (once per kind), and step listeners (``neofix.trace``,
``NEOFIX_TRACE``) receive a :class:`StepInfo` for every forward the patch handles.

Importing this module imports neither torch nor transformers (``import neofix`` does not import it).
"""

from __future__ import annotations

import threading

from ._errors import warn_once

from typing import Any, Callable, NamedTuple


class StepInfo(NamedTuple):
    """What one model forward was given and what neofix made of it (for traces)."""

    model: Any
    batch: int
    new_tokens: int
    cached_tokens: int | None
    mask_length_given: int | None
    attention_mask: Any
    position_ids: Any
    repairs: tuple[str, ...]


#: Callables receiving a :class:`StepInfo` for every forward the patch handles (``neofix.trace`` registers here).
#: Read without the lock on every step (a list read is atomic); changed only under ``listeners_lock``.
listeners: list[Callable[[StepInfo], None]] = []
listeners_lock = threading.Lock()


def add_listener(listener: Callable[[StepInfo], None]) -> None:
    with listeners_lock:
        if not any(registered is listener for registered in listeners):
            listeners.append(listener)


def remove_listener(listener: Callable[[StepInfo], None]) -> None:
    with listeners_lock:
        for position, registered in enumerate(listeners):
            if registered is listener:
                del listeners[position]
                break


def emit(info: StepInfo) -> None:
    for listener in tuple(listeners):
        listener(info)


def warn_repairs(repairs: Any) -> None:
    """Warn each repair that has a message, once per kind (see :func:`neofix._errors.warn_once`)."""
    for repair in repairs:
        if repair.message:
            warn_once(repair.kind, repair.message)
