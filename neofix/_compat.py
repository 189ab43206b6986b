"""Which transformers is installed, and whether a trace or compilation is running.

The alignment core (:mod:`neofix._core`) never looks at versions: release-specific facts live here (the supported
range, the installed release), in :mod:`neofix._caches` (cache formats) and in each family's adapter
(:mod:`neofix._families`).  It imports torch and transformers, so
``import neofix`` must not import it: the patch imports it once transformers is being loaded anyway.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

#: transformers releases neofix is tested against; setup.cfg's install_requires says the same (a test checks).
SUPPORTED_TRANSFORMERS = ">=4.26,<6"


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


_RELEASE: tuple[int, int] | None = None


def release() -> tuple[int, int]:
    """``(major, minor)`` of the installed transformers."""
    global _RELEASE
    if _RELEASE is None:
        from packaging.version import Version

        _RELEASE = Version(transformers_version()).release[:2]  # type: ignore[assignment]
    return _RELEASE  # type: ignore[return-value]


def in_range(since: str | None, until: str | None) -> bool:
    """Whether the installed transformers is at least ``since`` and below ``until`` (either may be None)."""
    from packaging.version import Version

    installed = Version(transformers_version())
    if installed.is_prerelease or installed.is_devrelease:  # 5.30.0.dev0 counts as 5.30
        installed = Version(installed.base_version)
    return (since is None or installed >= Version(since)) and (until is None or installed < Version(until))


def is_supported(version: str) -> bool:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    # prereleases of a supported release (5.30.0.dev0) count as inside the range
    return SpecifierSet(SUPPORTED_TRANSFORMERS, prereleases=True).contains(Version(version))


# --- tracing and compilation ------------------------------------------------------------------------------------

try:  # torch >= 2.3
    _is_compiling = torch.compiler.is_compiling
except AttributeError:  # pragma: no cover - older torch
    _is_compiling = torch._dynamo.is_compiling  # type: ignore[attr-defined]

try:  # the same flag as is_fx_tracing(), without the log line newer torch emits there ("will return true for both")
    from torch.fx._symbolic_trace import is_fx_symbolic_tracing as _is_fx_tracing
except ImportError:  # pragma: no cover - older torch
    try:
        from torch.fx._symbolic_trace import is_fx_tracing as _is_fx_tracing
    except ImportError:

        def _is_fx_tracing() -> bool:
            return False


_jit_is_tracing = torch._C._is_tracing
_Proxy = torch.fx.Proxy

# The module whose ``_is_fx_tracing_flag`` both functions above read.  is_tracing() reads the flag itself: it runs
# several times per decode step, and a module attribute read costs less than two nested calls.
try:
    from torch.fx import _symbolic_trace as _fx_state

    _fx_state._is_fx_tracing_flag  # noqa: B018 - present in every torch neofix supports
except (ImportError, AttributeError):  # pragma: no cover - older torch

    class _fx_state:  # type: ignore[no-redef]
        _is_fx_tracing_flag = False


def is_tracing(tensor: Any = None) -> bool:
    """True while torch.jit.trace, torch.fx (and transformers' HFTracer), torch.compile or torch.export runs.

    The patch stays out of the way then: a value check would become data-dependent control flow and break the
    trace, and a repair would be baked into the traced graph.

    ``_is_compiling()`` comes first: dynamo folds it to a constant, so it never reaches ``torch._C._is_tracing()``,
    a builtin it cannot trace (a graph break, or an error under ``fullgraph=True``).  Nothing here logs: a plain
    forward must not log what vanilla transformers does not.
    """
    return (
        _is_compiling()
        or _jit_is_tracing()
        or _fx_state._is_fx_tracing_flag  # what _is_fx_tracing() returns once _is_compiling() is False
        or isinstance(tensor, _Proxy)
    )


try:  # what torch.fx does to the root's code when the traced forward takes **kwargs (see rebound_by_fx)
    from torch.fx._symbolic_trace import _patch_function as _fx_patch_function
except ImportError:  # pragma: no cover - a torch without it cannot rebind a root's code either
    _fx_patch_function = None


def rebound_by_fx(args: Any) -> bool:
    """Whether torch.fx is tracing a wrapper as its root with the wrapper's code rebound: ``args`` is what the
    wrapper's ``*args`` holds, a tuple on every ordinary call.

    torch.fx traces a module's ``type(root).forward``.  It reads the parameters off the function ``__wrapped__``
    leads to (the original, a ``functools.wraps`` wrapper is transparent to it) and, when that original takes
    ``**kwargs`` or keyword-only parameters (``BloomModel.forward(..., **deprecated_arguments)``; GPT-2, OPT on
    4.57), compiles the *wrapper's* code again with one positional parameter per original parameter and no
    ``*args`` / ``**kwargs``.  The wrapper's ``args`` then holds ``input_ids`` (a proxy), ``kwargs`` the next
    parameter, its other locals the rest: its body runs on nonsense before any tracer check
    (``TypeError: __bool__ should return bool, returned Tensor``).  A wrapper that takes ``*args`` checks this
    first and, when true, returns :func:`trace_original_as_root` at once.
    """
    return args.__class__ is not tuple


def trace_original_as_root(original: Any) -> Any:
    """Step aside while torch.fx traces the calling wrapper as its root (see :func:`rebound_by_fx`): call the
    original exactly as torch.fx calls it when it traces the unpatched class, so the graph is vanilla's.

    Reads the values torch.fx bound, by position, to the calling wrapper's first parameters (its frame), and
    passes them, by position, to the original's code rebound the same way (``**kwargs`` arrives as one
    positional value, as in vanilla's trace).
    """
    frame = sys._getframe(1)
    try:
        code = frame.f_code
        values = frame.f_locals
        bound = [values[name] for name in code.co_varnames[: code.co_argcount]]
    finally:
        del frame
    if _fx_patch_function is None:  # pragma: no cover
        return original(*bound)
    return _fx_patch_function(original, len(bound))(*bound)


def positional_names(function: Any) -> tuple[str, ...]:
    """Names of the parameters a method takes positionally, without ``self``."""
    names = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    return tuple(names[1:]) if names and names[0] == "self" else tuple(names)


try:  # torch >= 2.4: torch.export (and the ONNX exporter built on it) sets this, torch.compile does not
    _is_exporting = torch.compiler.is_exporting
except AttributeError:  # pragma: no cover - older torch: no way to tell an export from a compilation

    def _is_exporting() -> bool:
        return True


#: What :func:`tracer` answers: no tracer runs, the patch steps aside (torch.jit, torch.fx, torch.export), or
#: ``torch.compile`` traces the call.
EAGER, STEPPING_ASIDE, COMPILING = 0, 1, 2


def tracer(tensor: Any = None) -> int:
    """Which tracer runs the call, in one check for the model forward's entry (it runs on every decode step):
    :data:`STEPPING_ASIDE` while torch.jit.trace, torch.fx (and transformers' HFTracer) or torch.export runs (the
    patch leaves the call exactly as it is, so the traced or exported graph is vanilla's), :data:`COMPILING` inside
    ``torch.compile`` (dynamo), :data:`EAGER` (0) when none does."""
    if _is_compiling():
        return STEPPING_ASIDE if _is_exporting() else COMPILING
    if _jit_is_tracing() or _fx_state._is_fx_tracing_flag or isinstance(tensor, _Proxy):
        return STEPPING_ASIDE
    return EAGER


def is_compiling() -> bool:
    """True inside ``torch.compile`` (dynamo), not in an export.

    There the patch runs its shape logic (mask extension, positions from the mask, slicing), which dynamo traces
    into the graph, so that a compiled loop is as correct as an eager one; nothing is read off the device and
    nothing is reported.
    """
    return tracer() == COMPILING


def is_stepping_aside(tensor: Any = None) -> bool:
    """True while torch.jit.trace, torch.fx (and transformers' HFTracer) or torch.export runs: the patch leaves the
    call exactly as it is, so the traced or exported graph is vanilla's."""
    return tracer(tensor) == STEPPING_ASIDE
