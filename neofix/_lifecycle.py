"""Patch lifecycle: ``patch()``, ``unpatch()``, ``is_patched()``, ``patched()`` / ``unpatched()``, and the import hooks.

Importing this module imports neither torch nor transformers: ``import neofix`` only registers, per model family, a
post-import hook on the family's modeling module (wrapt's, handed over when that module is first looked up, so that
the import does not pay for importing wrapt), which applies the patch when transformers loads the module (at once if
it already has).  Both verbs are idempotent and thread-safe; ``unpatch()`` restores transformers exactly (a wrapper
installed on a subclass over an inherited method is deleted, not replaced by a copy), or refuses, changing nothing,
when another library has wrapped one of the same attributes since.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings

from . import _errors
from ._errors import NeofixWarning, caller_stacklevel
from ._families import FAMILIES, GPT_NEO, Family, Target

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time (it is most of the import cost)
if TYPE_CHECKING:
    from typing import Any

_MISSING = object()
_lock = threading.RLock()


class _Applied:
    __slots__ = ("attribute", "installed", "original", "owner")

    def __init__(self, target: Target, owner: Any, original: Any, installed: Any) -> None:
        self.owner = owner
        self.attribute = target.attribute
        self.original = original  # the owner's own attribute before patching, or _MISSING when it was inherited
        self.installed = installed  # the plain function neofix put there

    def describe(self) -> str:
        return f"{getattr(self.owner, '__name__', repr(self.owner))}.{self.attribute}"


_applied: dict[str, list[_Applied]] = {}  # family name -> what neofix installed there
_status: dict[str, tuple[str, str]] = {}  # target name -> (state, reason)
_hooks_enabled = True  # False after unpatch(): the import hooks no longer patch on their own
_enabled: frozenset[str] = frozenset(FAMILIES)  # the families patch() and the import hooks patch (NEOFIX_FAMILIES)
# (family, target) -> (the original it wrapped, the factory, the wrapper): patching again over the same original
# reinstalls the very same function, so that whatever keyed on it (torch.compile's guards, a reference) stays valid
_built: dict[tuple[str, str], tuple[Any, Any, Any]] = {}


def is_patched() -> bool:
    """True while neofix's wrappers are installed on at least one family's classes.  Right after ``import neofix``
    it is False until transformers loads a family's modeling module (loading it fires neofix's import hook, which
    patches it); ``neofix doctor`` lists each patch target's state."""
    return any(_applied.values())


def patch(families: Any = None) -> bool:
    """Install neofix on transformers: GPT-Neo (importing its modeling module, if needed) and every other family
    whose modeling module is loaded; the others are patched by their import hooks when transformers loads them.

    ``families``: the model families to patch, by name (``"gpt_neo"``, ``"gpt2"``, ...; see ``neofix.FAMILIES``);
    default: those ``NEOFIX_FAMILIES`` names, else every family.  Families not named are left alone (and a family
    patched before stays patched: ``unpatch()`` removes them all).

    Returns True when this call installed a family's wrappers, False when it installed none: every family named was
    patched already, or its modeling module is not loaded yet (its import hook patches it when transformers loads
    it), or it could not be patched (an unsupported transformers, or none: a :class:`~neofix.NeofixWarning` says
    which).  Idempotent.
    """
    global _hooks_enabled, _enabled
    chosen = _chosen(families, "neofix.patch(families=...)") if families is not None else _enabled
    with _lock:
        _hooks_enabled = True
        if families is not None:
            _enabled = chosen
        installed = False
        for family in FAMILIES.values():
            if family.name not in chosen:
                continue
            if _applied.get(family.name):
                continue
            if family is not GPT_NEO and family.module not in sys.modules:
                continue  # not loaded: its import hook patches it when transformers loads it
            try:
                module = importlib.import_module(family.module)
            except Exception as exc:  # transformers missing or broken: tell, never crash the caller
                _warn(f"neofix: could not import {family.module} ({type(exc).__name__}: {exc}); nothing patched")
                continue
            if _applied.get(family.name):  # importing the module just now fired the post-import hook, which patched
                installed = True
                continue
            installed = _apply(family, module) or installed
        return installed


def unpatch() -> bool:
    """Remove neofix and restore transformers exactly.  Returns False if it was not patched.

    After ``unpatch()`` the import hooks no longer patch on their own; ``patch()`` installs it again.  When another
    library has wrapped one of the attributes neofix patched since neofix did, removing neofix's wrapper would remove
    that library's too: nothing is changed then, a :class:`~neofix.NeofixWarning` names the attribute, and False is
    returned (remove the other wrapper first).
    """
    global _hooks_enabled
    with _lock:
        covered = [
            applied.describe()
            for applied_list in _applied.values()
            for applied in applied_list
            if vars(applied.owner).get(applied.attribute, _MISSING) is not applied.installed
        ]
        if covered:
            _warn(
                f"neofix: cannot unpatch: {', '.join(covered)} {'was' if len(covered) == 1 else 'were'} wrapped again "
                f"by another library after neofix, and removing neofix's wrapper would remove that one too. Nothing "
                f"was changed (neofix stays patched); remove the outer wrapper first, then call neofix.unpatch()"
            )
            return False
        _hooks_enabled = False  # after the refusal above, which changes nothing
        if not is_patched():
            return False
        for family_name in list(_applied):
            _restore(_applied.pop(family_name))
        _status.clear()
        return True


def status() -> list[tuple[str, str, str]]:
    """``(target, state, reason)`` for every patch target; state is ``patched``, ``missing`` or ``skipped``,
    ``pending`` for a family whose modeling module transformers has not loaded yet (its import hook patches it then),
    ``unpatched`` while neofix is not applied."""
    with _lock:
        rows = []
        for family in FAMILIES.values():
            if family.name not in _enabled:
                unpatched = ("unpatched", f"{family.title} is not among the families patched (NEOFIX_FAMILIES or "
                                          f"neofix.patch(families=...))")
            elif _hooks_enabled and family.module not in sys.modules:
                unpatched = ("pending", f"patched when transformers loads {family.module.rsplit('.', 1)[-1]}")
            else:
                unpatched = ("unpatched", "neofix is not applied")
            for target in family.targets:
                name = target_name(family, target)
                state = _status.get(name)
                if state is None and unpatched[0] == "pending" and target.since:
                    state = _predates(target)  # a family this release does not have: its module never loads
                rows.append((name, *(state or unpatched)))
        return rows


def _predates(target: Target) -> tuple[str, str] | None:
    """``("skipped", why)`` where the installed transformers predates ``target`` (its family is absent), else None."""
    from . import _compat

    try:
        if _compat.in_range(target.since, None):
            return None
        return ("skipped", f"not needed on transformers {_compat.transformers_version()}: {target.why or _gate(target)}")
    except Exception:  # noqa: BLE001 - no readable transformers version: pending, as before
        return None


def _chosen(names: Any, where: str) -> frozenset[str]:
    """The family names ``names`` (an iterable of names, or one comma-separated string), checked."""
    if isinstance(names, str):
        names = [name.strip() for name in names.split(",") if name.strip()]
    chosen = frozenset(names)
    unknown = sorted(chosen - set(FAMILIES))
    if unknown:
        raise ValueError(f"{where}: unknown model famil{'ies' if len(unknown) > 1 else 'y'} {unknown}; choose from "
                         f"{sorted(FAMILIES)}")
    return chosen


def target_name(family: Family, target: Target) -> str:
    """A target's name as ``neofix doctor`` shows it: ``Class.attribute``, or ``module.function``."""
    return target.name if target.owner else f"{family.module.rsplit('.', 1)[-1]}.{target.attribute}"


class patched:
    """``with neofix.patched():`` runs the block with neofix installed, then puts back what was there before: the
    patch state, whether the import hooks patch on their own, and which repairs were already reported."""

    def __enter__(self) -> None:
        self._saved = _save()
        patch()

    def __exit__(self, *exc: object) -> None:
        _restore_state(self._saved)


class unpatched:
    """``with neofix.unpatched():`` runs the block on vanilla transformers, then puts back what was there before: the
    patch state, whether the import hooks patch on their own, and which repairs were already reported.

    Raises ``RuntimeError`` on entry when neofix cannot be removed (another library wrapped one of its targets).
    """

    def __enter__(self) -> None:
        self._saved = _save()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NeofixWarning)
            unpatch()
        if is_patched():
            _restore_state(self._saved)
            raise RuntimeError(
                "neofix.unpatched(): neofix cannot be removed, because another library wrapped one of the "
                "attributes it patched after it did (neofix.unpatch() says which)"
            )

    def __exit__(self, *exc: object) -> None:
        _restore_state(self._saved)


def _save() -> tuple[frozenset[str], bool, set[str], frozenset[str]]:
    with _lock, _errors._warned_lock:
        patched = frozenset(name for name, applied in _applied.items() if applied)
        return patched, _hooks_enabled, set(_errors._warned), _enabled


def _restore_state(saved: tuple[frozenset[str], bool, set[str], frozenset[str]]) -> None:
    global _hooks_enabled, _enabled
    patched, hooks_enabled, warned, enabled = saved
    if hooks_enabled:
        # the import hooks were on: a family whose module was first loaded inside the block (its hook then off) is
        # patched now, as its hook would have patched it
        patched |= {name for name, family in FAMILIES.items() if name in enabled and family.module in sys.modules}
    with _lock:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", NeofixWarning)
            unpatch()
            if patched:
                patch(patched)
        _hooks_enabled, _enabled = hooks_enabled, enabled
    with _errors._warned_lock:
        _errors._warned.clear()
        _errors._warned.update(warned)


def _apply(family: Family, module: Any) -> bool:
    from . import _compat

    version = _compat.transformers_version()
    names = [(target, target_name(family, target)) for target in family.targets]
    if not _compat.is_supported(version):
        for _, name in names:
            _status[name] = ("skipped", f"transformers {version} is outside {_compat.SUPPORTED_TRANSFORMERS}")
        _warn(
            f"neofix: transformers {version} is outside the tested range {_compat.SUPPORTED_TRANSFORMERS}; "
            f"{family.title} left unpatched. Install a supported transformers, or set NEOFIX_DISABLE=1 to silence "
            f"this"
        )
        return False
    adapter = family.load_adapter()
    applied: list[_Applied] = []
    _applied[family.name] = applied
    try:
        for target, name in names:
            installed = _install(family, module, target, name, adapter, version)
            if installed is not None:
                applied.append(installed)
    except Exception:
        # never leave a half-applied patch behind
        _restore(_applied.pop(family.name))
        for _, name in names:
            _status.pop(name, None)
        raise
    from ._config import settings

    if settings.log_steps:  # NEOFIX_TRACE=1: log every step (needs torch, which transformers has imported by now)
        from ._trace import log_steps

        log_steps()
    return bool(applied)  # (a family this release has but neofix does not patch here installs nothing)


def _install(family: Family, module: Any, target: Any, name: str, adapter: Any, version: str) -> _Applied | None:
    """Install one target's wrapper (the status says why not, where it is not installed)."""
    from . import _compat, _wrappers

    owner = getattr(module, target.owner, None) if target.owner else module
    if owner is None or not hasattr(owner, target.attribute):
        where = target.owner or module.__name__
        reason = f"{where}.{target.attribute} does not exist in transformers {version}"
        if target.required:
            _status[name] = ("missing", reason)
            _warn(f"neofix: {reason}; that part of {family.title} is left unpatched")
        else:
            _status[name] = ("skipped", f"not needed: this release has no {where}.{target.attribute}")
        return None
    if not target.wrapper:
        _status[name] = ("skipped", f"not needed on transformers {version}: {target.why}")
        return None
    if not _compat.in_range(target.since, target.until):
        _status[name] = ("skipped", f"not needed on transformers {version}: {target.why or _gate(target)}")
        return None
    original = vars(owner).get(target.attribute, _MISSING)
    # the factory wraps what the class resolves (its own attribute or the inherited one) in a plain function
    resolved = getattr(owner, target.attribute)
    factory = getattr(_wrappers, target.wrapper, None)  # else the family's own, in its adapter's module
    if factory is None:
        factory = getattr(importlib.import_module(family.adapter), target.wrapper)
    built = _built.get((family.name, name))
    if built is not None and built[0] is resolved and built[1] is factory:
        installed = built[2]
    else:
        installed = factory(resolved, adapter)
        _built[(family.name, name)] = (resolved, factory, installed)
    setattr(owner, target.attribute, installed)
    inherited = " (inherited; wrapper installed on the class)" if original is _MISSING else ""
    _status[name] = ("patched", f"transformers {version}{inherited}")
    return _Applied(target, owner, original, installed)


def _gate(target: Target) -> str:
    if target.since and target.until:
        return f"only transformers {target.since} to below {target.until} need it"
    return f"only transformers {target.since} and later have it" if target.since else f"only below {target.until}"


def _restore(applied: list[_Applied]) -> None:
    for item in reversed(applied):
        if vars(item.owner).get(item.attribute, _MISSING) is item.installed:
            if item.original is _MISSING:
                delattr(item.owner, item.attribute)
            else:
                setattr(item.owner, item.attribute, item.original)


def _warn(message: str) -> None:
    # the first caller outside neofix: the user's `import neofix` line (NEOFIX_TRACE), `patch()` call, or import
    # of transformers (the post-import hook)
    warnings.warn(message, NeofixWarning, stacklevel=caller_stacklevel())


def _on_import(module: Any) -> None:
    """Post-import hook: patch a family as its module finishes loading.  Never raises into the user's import."""
    family = next((f for f in FAMILIES.values() if f.module == module.__name__), None)
    if family is None:
        return
    with _lock:
        if _applied.get(family.name) or not _hooks_enabled or family.name not in _enabled:
            return
        try:
            _apply(family, module)
        except Exception as exc:
            _warn(f"neofix: patching {family.title} failed ({type(exc).__name__}: {exc}); it is left unpatched")


def register() -> None:
    """Called once by ``import neofix``: read the environment and register the post-import hooks."""
    global _enabled
    from ._config import environment_flag, load_environment

    load_environment()
    if environment_flag("NEOFIX_DISABLE"):
        return
    names = os.environ.get("NEOFIX_FAMILIES", "").strip()
    if names:
        try:
            _enabled = _chosen(names, f"NEOFIX_FAMILIES={names!r}")
        except ValueError as exc:  # an environment variable never crashes an import
            _warn(f"{exc}; patching every family")
    waiting = []
    for family in FAMILIES.values():
        if family.name not in _enabled:
            continue
        if family.module in sys.modules:  # transformers already loaded the module: wrapt's hook fires at once
            _register_hook(family.module)
        else:
            waiting.append(family.module)
    if waiting:  # wait for them without importing wrapt, which alone takes longer than ``import neofix`` may
        sys.meta_path.insert(0, _ModuleWatcher(waiting))


def _register_hook(module_name: str) -> None:
    import wrapt

    wrapt.register_post_import_hook(_on_import, module_name)


class _ModuleWatcher:
    """A ``sys.meta_path`` finder that waits for the families' modeling modules, then hands each to wrapt's hook.

    It finds nothing itself.  The first time one of the modules is looked up, it registers wrapt's post-import hook
    for it (importing wrapt then, while transformers is being imported anyway) and returns what wrapt's finder
    returns: wrapt puts its finder first in ``sys.meta_path``, a place this lookup has already gone past.
    """

    def __init__(self, modules: list[str]) -> None:
        self.waiting = set(modules)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.waiting:
            return None
        self.waiting.discard(fullname)
        _register_hook(fullname)
        for finder in sys.meta_path:
            if finder is not self and type(finder).__module__.startswith("wrapt"):
                find_spec = getattr(finder, "find_spec", None)
                return find_spec(fullname, path, target) if find_spec is not None else None
        return None
