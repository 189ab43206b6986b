"""The one host-read counter of the test suite (and of ``benchmarks/bench_decode.py``).

A host read is a call that brings a tensor's value to Python, or that must know a value to size its result; on an
accelerator each is a host-device synchronisation.  :class:`HostReads` sees every such call through a
``TorchFunctionMode`` and attributes it to the innermost Python frame outside torch: a read asked for by a frame in
neofix's files is neofix's.

CI has no accelerator, so every tensor is on the CPU, where a read waits for nothing.  To prove that a path would not
synchronise on an accelerator, run it with ``simulated_accelerator()``: neofix then treats CPU tensors as device
tensors (its decode-step position reports take the non-blocking path), and the only host memory it may read is the
copies that path makes, which are marked and not counted.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode

import neofix
from neofix import _reports

#: calls that read a value on the host (or need one to size their result): each synchronises on an accelerator
HOST_READS = frozenset(
    {
        "item",
        "tolist",
        "numpy",
        "__array__",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__complex__",
        "nonzero",
        "argwhere",
        "masked_select",
        "unique",
        "unique_consecutive",
        "cpu",
    }
)

NEOFIX_DIR = os.path.dirname(os.path.abspath(neofix.__file__)) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def asked_by() -> str:
    """``file:line`` of the innermost Python frame outside torch and this module: who asked for the read."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(TORCH_DIR) and filename != __file__:
            return f"{filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class HostReads(TorchFunctionMode):
    """Records ``(call, file:line)`` for every host read while active; ``by_neofix`` are those neofix asked for.

    Reads of the host copies neofix's non-blocking reports make (marked ``_neofix_host_copy``) are not counted: that
    memory is the host's, written before it is read.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, str]] = []
        self.paused = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if not self.paused and name in HOST_READS:
            subject = args[0] if args else None
            if not getattr(subject, "_neofix_host_copy", False):
                self.reads.append((name, asked_by()))
        return func(*args, **(kwargs or {}))

    @property
    def by_neofix(self) -> list[tuple[str, str]]:
        return [(name, where) for name, where in self.reads if where.startswith(NEOFIX_DIR)]


class DecodeReads(HostReads):
    """Counts host reads made after the model's first (prefill) forward: the decode steps."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.forwards = 0
        self.paused = True

    def __enter__(self) -> DecodeReads:
        def count(module: Any, inputs: Any, output: Any) -> None:
            self.forwards += 1
            self.paused = False

        self._hook = self.model.transformer.register_forward_hook(count)
        return super().__enter__()  # type: ignore[no-any-return]

    def __exit__(self, *exc: object) -> None:
        self._hook.remove()
        super().__exit__(*exc)


class _LandsAtNextPoll:
    """The event of a simulated accelerator: its copy has landed from the first poll after the step on."""

    def __init__(self) -> None:
        self.polled = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        landed, self.polled = self.polled, True
        return landed


@contextlib.contextmanager
def simulated_accelerator() -> Iterator[None]:
    """Make neofix treat CPU tensors as accelerator tensors: values read by the device reader, and position reports
    copied without blocking (a copy that lands at the next poll)."""
    saved = _reports.in_host_memory, _reports._event
    _reports.in_host_memory = lambda tensor: False
    _reports._event = lambda device: _LandsAtNextPoll()
    try:
        with device_reads():
            yield
    finally:
        _reports.in_host_memory, _reports._event = saved
        _reports.clear_pending()


@contextlib.contextmanager
def device_reads(on_device: bool = True) -> Iterator[None]:
    """Make every step read its values as on an accelerator (the device reader: torch reductions and one read),
    whatever the tensors' device; ``on_device=False``: with the host reader (the CPU's list scans)."""
    from neofix._core import _reads

    reader = _reads.read_on_device if on_device else _reads.read_on_host
    saved = _reads.reader_for
    _reads.reader_for = lambda question: reader
    try:
        yield
    finally:
        _reads.reader_for = saved


def read_values_on(monkeypatch: Any, host: bool) -> None:
    """For the rest of a test: read values with the host reader (``host``) or the device reader."""
    from neofix._core import _reads

    reader = _reads.read_on_host if host else _reads.read_on_device
    monkeypatch.setattr(_reads, "reader_for", lambda question: reader)
