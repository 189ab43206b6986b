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


POSITION_SOURCES = ("mask", "transformers")


class _Settings:
    __slots__ = ("check_values", "log_steps", "mode", "strict", "uncached_positions")

    def __init__(self) -> None:
        self.mode = "repair"
        self.strict = False
        self.check_values = False
        self.uncached_positions = "mask"
        self.log_steps = False  # NEOFIX_TRACE=1: log one line per step through logging.getLogger("neofix")


settings = _Settings()


def configure(
    *, mode: str | None = None, check_values: bool | None = None, uncached_positions: str | None = None
) -> dict[str, Any]:
    """Change neofix's settings and return the previous ones (``neofix.configure(**old)`` restores them).

    mode
        ``"repair"`` (default): a step that can be repaired unambiguously (a mask that was not extended, stale
        position ids, positions that disagree with the mask) is repaired and a :class:`~neofix.NeofixWarning` is
        emitted once per kind of repair.  ``"strict"``: every step that would need a repair raises
        :class:`~neofix.NeofixError` instead.  Strict mode may read values off the device on decode steps (to raise
        at the step where positions go wrong): one synchronisation per step where the caller passes positions.
    check_values
        ``False`` (default): token ids and the range of given positions are checked on prefill and multi-token steps
        (one host-device synchronisation there, negligible, and it keeps a bad id from becoming a device-side
        assert); single-token decode steps read nothing: their positions are compared with the mask's and repaired on
        the device.  On the CPU a bad id or position on such a step still becomes a ``TokenIdError`` /
        ``PositionError`` (translated from the embedding's ``IndexError``); on an accelerator it is the device's own
        error.  ``True``: every step also range-checks token ids and positions, at one synchronisation per step.
    uncached_positions
        ``"mask"`` (default): a forward without a cache and without position_ids (training, scoring, classification
        heads) on a left-padded batch gets positions from the attention mask, so that a padded row computes what it
        computes alone (warned once: its logits and losses differ from an unpatched run).  ``"transformers"``: such
        forwards keep transformers' own positions, exactly as unpatched (for a model fine-tuned on them).
    """
    previous = {
        "mode": settings.mode,
        "check_values": settings.check_values,
        "uncached_positions": settings.uncached_positions,
    }
    if mode is not None:
        if mode not in MODES:
            raise ValueError(f"neofix.configure(mode={mode!r}): mode must be one of {MODES}")
        settings.mode = mode
        settings.strict = mode == "strict"
    if check_values is not None:
        if not isinstance(check_values, bool):
            raise ValueError(f"neofix.configure(check_values={check_values!r}): check_values must be True or False")
        settings.check_values = check_values
    if uncached_positions is not None:
        if uncached_positions not in POSITION_SOURCES:
            raise ValueError(
                f"neofix.configure(uncached_positions={uncached_positions!r}): must be one of {POSITION_SOURCES}"
            )
        settings.uncached_positions = uncached_positions
    return previous


def load_environment(environ: Any = os.environ) -> None:
    """Apply ``NEOFIX_MODE``, ``NEOFIX_CHECK_VALUES``, ``NEOFIX_UNCACHED_POSITIONS`` and ``NEOFIX_TRACE``; warn (never
    raise) on values it does not understand, pointing at the user's ``import neofix`` line."""
    for variable, choices, default, apply in (
        ("NEOFIX_MODE", MODES, "'repair'", lambda value: configure(mode=value)),
        ("NEOFIX_CHECK_VALUES", None, "0", lambda value: configure(check_values=value)),
        ("NEOFIX_UNCACHED_POSITIONS", POSITION_SOURCES, "'mask'", lambda value: configure(uncached_positions=value)),
        ("NEOFIX_TRACE", None, "0", lambda value: setattr(settings, "log_steps", value)),
    ):
        value = environment_flag(variable, environ) if choices is None else _choice(variable, choices, default, environ)
        if value is not None:
            apply(value)


def _choice(variable: str, choices: tuple[str, ...], default: str, environ: Any) -> str | None:
    """One of ``choices`` (any case, spaces around); ``None`` where unset, empty or not understood (warned)."""
    given = environ.get(variable)
    if given is None or not given.strip():
        return None
    if given.strip().lower() in choices:
        return given.strip().lower()
    _warn_not_understood(variable, given, f"one of {choices}", default)
    return None


def environment_flag(variable: str, environ: Any = os.environ) -> bool | None:
    """A boolean environment variable: ``True`` for 1/true/yes/on, ``False`` for 0/false/no/off or empty (any case,
    spaces around), ``None`` where unset or not understood (warned: the user's ``import neofix`` line)."""
    given = environ.get(variable)
    if given is None:
        return None
    value = given.strip().lower()
    if value in _TRUE + _FALSE:
        return value in _TRUE
    _warn_not_understood(variable, given, "a boolean (1/0, true/false)", "0")
    return None


def _warn_not_understood(variable: str, given: str, expected: str, default: str) -> None:
    warnings.warn(
        f"{variable}={given!r} is not {expected}; using {default}",
        NeofixWarning,
        stacklevel=caller_stacklevel(),  # the user's `import neofix` line
    )
