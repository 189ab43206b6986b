"""Patch lifecycle: ``patch()``, ``unpatch()``, ``is_patched()`` and the post-import hook.

Importing this module imports neither torch nor transformers: ``import neofix`` only registers a post-import hook
on GPT-Neo's modeling module (wrapt's, handed over when that module is first looked up, so that the import does not
pay for importing wrapt), which applies the patch when transformers loads GPT-Neo (at once if it already has).
Both verbs are idempotent and thread-safe; ``unpatch()`` restores transformers exactly (a wrapper installed on a
subclass over an inherited method is deleted, not replaced by a copy).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings

from ._errors import NeofixWarning, caller_stacklevel

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time (it is most of the import cost)
if TYPE_CHECKING:
    from typing import Any

GPT_NEO_MODULE = "transformers.models.gpt_neo.modeling_gpt_neo"

_MISSING = object()
_lock = threading.RLock()


class _Target:
    """One attribute neofix replaces.  (A plain class: ``typing.NamedTuple`` would double the import time.)"""

    __slots__ = ("attribute", "factory", "name", "needed", "owner", "required", "unneeded")

    def __init__(
        self,
        name: str,  # as shown by ``neofix doctor``
        owner: str,  # attribute of the modeling module, or "" for the module itself
        attribute: str,
        factory: str,  # the factory in neofix._wrappers: it receives the original, returns the replacement ("": none)
        required: bool,  # missing -> warning; optional targets exist only in some releases
        needed: str = "",  # a flag of neofix._compat: the target is skipped on releases where it is False
        unneeded: str = "",  # why it is not needed there (shown by ``neofix doctor``)
    ) -> None:
        self.name, self.owner, self.attribute, self.factory = name, owner, attribute, factory
        self.required, self.needed, self.unneeded = required, needed, unneeded

    def __repr__(self) -> str:
        return f"_Target({self.name!r})"


TARGETS = (
    _Target("GPTNeoModel.forward", "GPTNeoModel", "forward", "make_model_forward", True),
    _Target(
        "GPTNeoForCausalLM.prepare_inputs_for_generation",
        "GPTNeoForCausalLM",
        "prepare_inputs_for_generation",
        "make_prepare_inputs_for_generation",
        True,
    ),
    _Target("GPTNeoForCausalLM.generate", "GPTNeoForCausalLM", "generate", "make_generate", True),
    _Target(
        "GPTNeoSelfAttention.forward",
        "GPTNeoSelfAttention",
        "forward",
        "",  # no wrapper: listed so that `neofix doctor` says why
        False,
        "",
        "GPTNeoModel.forward reads every layer's cache length and refuses an uneven cache before any layer runs, so "
        "the eager attention layers need no check of their own",
    ),
    _Target(
        "GPTNeoFlashAttention2.forward",
        "GPTNeoFlashAttention2",
        "forward",
        "make_flash_attention_forward",
        False,
    ),
    _Target(
        "_prepare_4d_causal_attention_mask (float64)",
        "",
        "_prepare_4d_causal_attention_mask",
        "make_prepare_4d_mask_float64",
        False,
    ),
)


class _Applied:
    __slots__ = ("attribute", "installed", "original", "owner")

    def __init__(self, owner: Any, attribute: str, original: Any, installed: Any) -> None:
        self.owner = owner
        self.attribute = attribute
        self.original = original  # the owner's own attribute before patching, or _MISSING when it was inherited
        self.installed = installed  # the plain function neofix put there


_applied: list[_Applied] = []
_status: dict[str, tuple[str, str]] = {}
_unpatched_by_user = False
_log_steps = False  # NEOFIX_TRACE=1: log one line per step through logging.getLogger("neofix")


def is_patched() -> bool:
    """True while neofix's wrappers are installed on GPT-Neo."""
    return bool(_applied)


def patch() -> bool:
    """Install neofix on transformers' GPT-Neo (importing it if needed).

    Returns True when this call installed the patch, False when it was already installed or could not be (an
    unsupported transformers, or none: a :class:`~neofix.NeofixWarning` says which).  Idempotent.
    """
    global _unpatched_by_user
    with _lock:
        _unpatched_by_user = False
        if _applied:
            return False
        try:
            module = importlib.import_module(GPT_NEO_MODULE)
        except Exception as exc:  # transformers missing or broken: tell, never crash the caller
            _warn(f"neofix: could not import {GPT_NEO_MODULE} ({type(exc).__name__}: {exc}); nothing patched")
            return False
        if _applied:  # importing GPT-Neo just now fired the post-import hook, which patched it
            return True
        return _apply(module)


def unpatch() -> bool:
    """Remove neofix from GPT-Neo and restore transformers exactly.  Returns False if it was not patched.

    After ``unpatch()`` the post-import hook no longer patches on its own; ``patch()`` installs it again.
    """
    global _unpatched_by_user
    with _lock:
        _unpatched_by_user = True
        if not _applied:
            return False
        for applied in reversed(_applied):
            current = vars(applied.owner).get(applied.attribute, _MISSING)
            if current is not applied.installed:
                _warn(
                    f"neofix: {_describe(applied)} was wrapped again by someone else after neofix; left in place "
                    f"(remove the outer wrapper first)"
                )
                continue
            if applied.original is _MISSING:
                delattr(applied.owner, applied.attribute)
            else:
                setattr(applied.owner, applied.attribute, applied.original)
        _applied.clear()
        _status.clear()
        return True


def status() -> list[tuple[str, str, str]]:
    """``(target, state, reason)`` for every patch target; state is ``patched``, ``missing`` or ``skipped``."""
    with _lock:
        rows = []
        for target in TARGETS:
            state, reason = _status.get(target.name, ("unpatched", "neofix is not applied"))
            rows.append((target.name, state, reason))
        return rows


def _apply(module: Any) -> bool:
    from . import _compat, _wrappers

    version = _compat.transformers_version()
    if not _compat.is_supported(version):
        for target in TARGETS:
            _status[target.name] = ("skipped", f"transformers {version} is outside {_compat.SUPPORTED_TRANSFORMERS}")
        _warn(
            f"neofix: transformers {version} is outside the tested range {_compat.SUPPORTED_TRANSFORMERS}; "
            f"GPT-Neo left unpatched. Install a supported transformers, or set NEOFIX_DISABLE=1 to silence this"
        )
        return False
    try:
        for target in TARGETS:
            owner = getattr(module, target.owner, None) if target.owner else module
            if owner is None or not hasattr(owner, target.attribute):
                where = target.owner or module.__name__
                reason = f"{where}.{target.attribute} does not exist in transformers {version}"
                if target.required:
                    _status[target.name] = ("missing", reason)
                    _warn(f"neofix: {reason}; that part of GPT-Neo is left unpatched")
                else:
                    _status[target.name] = ("skipped", f"not needed: this release has no {where}.{target.attribute}")
                continue
            if not target.factory or (target.needed and not getattr(_compat, target.needed)):
                _status[target.name] = ("skipped", f"not needed on transformers {version}: {target.unneeded}")
                continue
            original = vars(owner).get(target.attribute, _MISSING)
            # the factory wraps what the class resolves (its own attribute or the inherited one) in a plain function
            installed = getattr(_wrappers, target.factory)(getattr(owner, target.attribute))
            setattr(owner, target.attribute, installed)
            _applied.append(_Applied(owner, target.attribute, original, installed))
            inherited = " (inherited; wrapper installed on the class)" if original is _MISSING else ""
            _status[target.name] = ("patched", f"transformers {version}{inherited}")
    except Exception:
        # never leave a half-applied patch behind
        _unpatch_all_quietly()
        raise
    if _log_steps:  # NEOFIX_TRACE=1: log every step (needs torch, which transformers has imported by now)
        from ._trace import log_steps

        log_steps()
    return True


def _unpatch_all_quietly() -> None:
    for applied in reversed(_applied):
        if vars(applied.owner).get(applied.attribute, _MISSING) is applied.installed:
            if applied.original is _MISSING:
                delattr(applied.owner, applied.attribute)
            else:
                setattr(applied.owner, applied.attribute, applied.original)
    _applied.clear()


def _describe(applied: _Applied) -> str:
    owner = getattr(applied.owner, "__name__", repr(applied.owner))
    return f"{owner}.{applied.attribute}"


def _warn(message: str) -> None:
    # the first caller outside neofix: the user's `import neofix` line (NEOFIX_TRACE), `patch()` call, or import
    # of transformers (the post-import hook)
    warnings.warn(message, NeofixWarning, stacklevel=caller_stacklevel())


def _on_import(module: Any) -> None:
    """Post-import hook: patch GPT-Neo as its module finishes loading.  Never raises into the user's import."""
    with _lock:
        if _applied or _unpatched_by_user:
            return
        try:
            _apply(module)
        except Exception as exc:
            _status.clear()
            _warn(f"neofix: patching GPT-Neo failed ({type(exc).__name__}: {exc}); GPT-Neo left unpatched")


def register() -> None:
    """Called once by ``import neofix``: read the environment and register the post-import hook."""
    from ._config import load_environment

    load_environment()
    _read_trace_environment()
    if os.environ.get("NEOFIX_DISABLE", "").strip().lower() in ("1", "true", "yes", "on"):
        return
    if GPT_NEO_MODULE in sys.modules:  # transformers already loaded GPT-Neo: wrapt's hook fires at once
        _register_hook()
    else:  # wait for it without importing wrapt, which alone takes longer than ``import neofix`` may
        sys.meta_path.insert(0, _GPTNeoWatcher())


def _register_hook() -> None:
    import wrapt

    wrapt.register_post_import_hook(_on_import, GPT_NEO_MODULE)


class _GPTNeoWatcher:
    """A ``sys.meta_path`` finder that waits for GPT-Neo's modeling module, then hands it to wrapt's import hook.

    It finds nothing itself.  The first time GPT-Neo's module is looked up, it registers wrapt's post-import hook
    (importing wrapt then, while transformers is being imported anyway) and returns what wrapt's finder returns:
    wrapt puts its finder first in ``sys.meta_path``, a place this lookup has already gone past.
    """

    handed_over = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != GPT_NEO_MODULE or self.handed_over:
            return None
        self.handed_over = True
        _register_hook()
        for finder in sys.meta_path:
            if finder is not self and type(finder).__module__.startswith("wrapt"):
                find_spec = getattr(finder, "find_spec", None)
                return find_spec(fullname, path, target) if find_spec is not None else None
        return None


def _read_trace_environment() -> None:
    """``NEOFIX_TRACE``: read once, at import, like the other variables; a value it does not understand warns."""
    global _log_steps
    from ._config import _FALSE, _TRUE

    value = os.environ.get("NEOFIX_TRACE")
    if value is None:
        return
    if value.strip().lower() in _TRUE:
        _log_steps = True
    elif value.strip().lower() not in _FALSE:
        _warn(f"NEOFIX_TRACE={value!r} is not a boolean (1/0, true/false); using 0")
