"""Run-time settings: repair or strict mode, and whether decode steps get value checks.

Settings are process wide.  ``NEOFIX_MODE`` and ``NEOFIX_CHECK_VALUES`` are read once, at import; an invalid
value is reported with a warning and the default is used (an environment variable never crashes an import).
"""

from __future__ import annotations

import os
import warnings

from ._errors import NeofixWarning, caller_stacklevel

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time
if TYPE_CHECKING:
    from typing import Any

MODES = ("repair", "strict")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


class _Settings:
    __slots__ = ("check_values", "log_steps", "mode", "strict")

    def __init__(self) -> None:
        self.mode = "repair"
        self.strict = False
        self.check_values = False
        self.log_steps = False  # NEOFIX_TRACE=1: log one line per step through logging.getLogger("neofix")


settings = _Settings()


def configure(*, mode: str | None = None, check_values: bool | None = None) -> dict[str, Any]:
    """Change neofix's settings and return the previous ones (``neofix.configure(**old)`` restores them).

    mode
        ``"repair"`` (default): a step that can be repaired unambiguously (a mask that was not extended, stale
        position ids) is repaired and a :class:`~neofix.NeofixWarning` is emitted once per kind of repair.
        ``"strict"``: every step that would need a repair raises :class:`~neofix.NeofixError` instead.
    check_values
        ``False`` (default): token ids, and position ids passed by the caller, are range-checked on prefill and on
        every multi-token step (one host-device synchronisation, negligible there, and it keeps a bad id from
        becoming a device-side assert); single-token decode steps get shape checks only, so they add no
        synchronisation.  There, on the CPU, a bad id or position still becomes a ``TokenIdError`` /
        ``PositionError`` (translated from the embedding's ``IndexError``); on an accelerator it is the device's
        own error.  ``True``: every step also checks values: token ids, position ranges, and that the position ids
        of real (unmasked) tokens equal those derived from the attention mask (repaired in repair mode, an error
        in strict mode).  Costs one synchronisation per step on an accelerator.
    """
    previous = {"mode": settings.mode, "check_values": settings.check_values}
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"neofix.configure(mode={mode!r}): mode must be one of {MODES}")
        settings.mode = mode
        settings.strict = mode == "strict"
    if check_values is not None:
        if not isinstance(check_values, bool):
            raise ValueError(f"neofix.configure(check_values={check_values!r}): check_values must be True or False")
        settings.check_values = check_values
    return previous


def load_environment(environ: Any = os.environ) -> None:
    """Apply ``NEOFIX_MODE``, ``NEOFIX_CHECK_VALUES`` and ``NEOFIX_TRACE``; warn (never raise) on values it does not
    understand."""
    mode = environ.get("NEOFIX_MODE")
    if mode is not None and mode.strip():
        value = mode.strip().lower()
        if value in MODES:
            configure(mode=value)
        else:
            warnings.warn(
                f"NEOFIX_MODE={mode!r} is not one of {MODES}; using 'repair'",
                NeofixWarning,
                stacklevel=caller_stacklevel(),  # the user's `import neofix` line
            )
    check = environ.get("NEOFIX_CHECK_VALUES")
    if check is not None:
        value = check.strip().lower()
        if value in _TRUE:
            configure(check_values=True)
        elif value not in _FALSE:
            warnings.warn(
                f"NEOFIX_CHECK_VALUES={check!r} is not a boolean (1/0, true/false); using 0",
                NeofixWarning,
                stacklevel=caller_stacklevel(),
            )
    trace = environ.get("NEOFIX_TRACE")
    if trace is not None:
        value = trace.strip().lower()
        if value in _TRUE:
            settings.log_steps = True
        elif value not in _FALSE:
            warnings.warn(
                f"NEOFIX_TRACE={trace!r} is not a boolean (1/0, true/false); using 0",
                NeofixWarning,
                stacklevel=caller_stacklevel(),
            )
