"""Where a step's outcome goes: its repairs are warned (once per kind), decode steps' position reports are read when
that costs nothing, and step listeners (``neofix.trace``, ``NEOFIX_TRACE``) receive a :class:`StepInfo` for every
forward the patch handles.

Importing this module imports neither torch nor transformers (``import neofix`` does not import it).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, NamedTuple

from . import _errors
from ._errors import warn_once


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
        message = repair.message
        if message and repair.kind not in _errors._warned:
            message = message() if callable(message) else message
            if message:
                warn_once(repair.kind, message)


# -- position reports of decode steps ----------------------------------------------------------------------------------
#
# A decode step compares given positions with the mask's and repairs them on the device (``torch.where``); whether it
# did is only known on the device.  On the CPU it is read at once (there is no device to wait for).  On an accelerator
# the comparison is copied to pinned host memory without blocking, an event is recorded behind the copy, and the next
# forward reads it once the event says the copy has landed: never waiting, never synchronising.  Once the repair has
# been reported (warnings are once per kind), no report is made at all.

#: Reports copied off an accelerator, oldest first: (event, host tensor of shape (3, batch), cached tokens, whether
#: positions came from a mask).
pending: list[tuple[Any, Any, int | None, bool]] = []
_pending_lock = threading.Lock()

def in_host_memory(tensor: Any) -> bool:
    """Whether reading ``tensor`` waits for nothing (CPU memory): its report is read at once."""
    return tensor.device.type == "cpu"  # type: ignore[no-any-return]


def deliver(report: Any) -> None:
    """Report a decode step's position repair (a :class:`~neofix._core.Report`) without blocking."""
    from ._core._types import POSITION_VALUES

    if POSITION_VALUES in _errors._warned:
        return
    import torch

    wrong = report.wrong
    if in_host_memory(wrong):
        if wrong.any():  # CPU memory: reading it waits for nothing
            _warn_positions(wrong, report.given, report.derived, report.past, report.truth)
        return
    packed = torch.stack(
        [
            wrong.reshape(-1).long(),
            torch.broadcast_to(report.given, wrong.shape).reshape(-1).long(),
            torch.broadcast_to(report.derived, wrong.shape).reshape(-1).long(),
        ]
    )
    event = _event(packed.device)
    if event is None:  # no way to know when a copy has landed: report nothing rather than wait
        return
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=packed.device.type == "cuda")
    host.copy_(packed, non_blocking=True)
    event.record()
    host._neofix_host_copy = True  # what tests' synchronisation counters may read
    with _pending_lock:
        pending.append((event, host, report.past, report.truth))


def poll() -> None:
    """Read the reports whose copies have landed (never waiting for the others)."""
    while pending:
        with _pending_lock:
            if not pending or not pending[0][0].query():
                return
            _, host, past, truth = pending.pop(0)
        wrong, given, derived = host.tolist()  # host memory, already written: no synchronisation
        if any(wrong):
            from ._core._types import POSITION_VALUES
            from ._core._values import describe_position, repaired_message

            row = wrong.index(1)
            described = describe_position(row, 0, given[row], derived[row], past, truth)
            warn_once(POSITION_VALUES, repaired_message(described, truth))


def _warn_positions(wrong: Any, given: Any, derived: Any, past: int | None, truth: str) -> None:
    from ._core._types import POSITION_VALUES
    from ._core._values import describe_wrong, repaired_message

    warn_once(POSITION_VALUES, repaired_message(describe_wrong(wrong, given, derived, past, truth), truth))


def _event(device: Any) -> Any:
    import torch

    if device.type == "cuda":
        return torch.cuda.Event()
    event_class = getattr(torch, "Event", None)  # torch >= 2.4: events of any accelerator
    if event_class is None:
        return None
    try:
        return event_class(device=device)
    except Exception:  # noqa: BLE001 - an accelerator without events: no report
        return None


def clear_pending() -> None:
    """Forget reports not read yet (tests)."""
    with _pending_lock:
        pending.clear()
