"""The errors and warnings neofix raises.  Importing this module imports neither torch nor transformers."""

from __future__ import annotations

import sys
import threading
import warnings

__all__ = [
    "NeofixError",
    "MaskLengthError",
    "MaskValueError",
    "BatchMismatchError",
    "PositionError",
    "SequenceTooLongError",
    "TokenIdError",
    "CacheLengthError",
    "InputShapeError",
    "AttentionWindowError",
    "NeofixWarning",
]


def counted(count: Any, thing: str) -> str:
    """``"1 row"``, ``"2 rows"``: a count and its noun, for messages."""
    return f"{count} {thing}" if count == 1 else f"{count} {thing}s"


class NeofixError(ValueError):
    """A decoding step whose attention mask, positions, cache and inputs cannot be made to agree.

    Subclasses name the kind of problem; catching ``NeofixError`` (or ``ValueError``) catches them all.
    """


class MaskLengthError(NeofixError):
    """The attention mask does not cover exactly the cached plus the new tokens."""


class MaskValueError(NeofixError):
    """The 2D attention mask holds values other than 0 (padding) and 1 (a real token)."""


class BatchMismatchError(NeofixError):
    """The attention mask, position ids or cache hold a different batch size than the inputs."""


class PositionError(NeofixError):
    """The position ids do not fit the step (length or, with ``check_values=True``, values)."""


class SequenceTooLongError(NeofixError):
    """The sequence would pass ``config.max_position_embeddings``."""


class TokenIdError(NeofixError):
    """A token id lies outside ``[0, config.vocab_size)``."""


class CacheLengthError(NeofixError):
    """The layers of the KV cache hold different numbers of tokens."""


class InputShapeError(NeofixError):
    """The step's inputs have an impossible shape (no new tokens, wrong embedding width, ...)."""


class AttentionWindowError(NeofixError):
    """GPT-Neo's local attention window would be applied wrong and neofix cannot repair it: flash-attention-2 (no
    window at all), or a static cache of more slots than the window where the repair does not run (flash-attention-2,
    a fixed-capacity cache whose slots are not the tokens' positions).  A ``StaticCache`` with the eager attention on
    transformers 4.45 and later is repaired, not refused."""


class NeofixWarning(UserWarning):
    """neofix repaired a decoding step.  Each kind of repair is reported once per process."""


# tracebacks and reprs name the public path (neofix.MaskLengthError), where users import them from
for _public in (
    NeofixError,
    MaskLengthError,
    MaskValueError,
    BatchMismatchError,
    PositionError,
    SequenceTooLongError,
    TokenIdError,
    CacheLengthError,
    InputShapeError,
    AttentionWindowError,
    NeofixWarning,
):
    _public.__module__ = "neofix"
del _public


_warned: set[str] = set()
_warned_lock = threading.Lock()


_INTERNAL = ("neofix", "torch", "transformers", "wrapt", "contextlib", "functools")


def warn_once(kind: str, message: str, stacklevel: int = 0) -> None:
    """Emit ``message`` as a :class:`NeofixWarning` the first time ``kind`` is repaired in this process.

    The warning points at the first caller outside neofix, torch and transformers: the user's loop.
    """
    if kind in _warned:
        return
    # recorded only once the warning is out: where warnings are errors (-W error), every repair raises
    warnings.warn(message, NeofixWarning, stacklevel=stacklevel or _user_stacklevel())
    with _warned_lock:
        _warned.add(kind)


def _user_stacklevel() -> int:
    frame = sys._getframe(2)  # the caller of warn_once
    level = 2
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.split(".")[0] not in _INTERNAL:
            return level
        frame = frame.f_back
        level += 1
    return 2


def caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside neofix, importlib and ``_INTERNAL``.

    Call it in the arguments of the ``warnings.warn`` call.  Levels are counted the way ``warnings.warn`` counts
    them: it skips importlib's bootstrap frames (``<frozen importlib._bootstrap>``), which a warning issued
    during ``import neofix`` sits under, so that the warning names the user's ``import neofix`` line.
    """
    frame = sys._getframe(2)  # the caller of the function that calls warnings.warn (stacklevel 2)
    level = 2
    while frame is not None:
        filename = frame.f_code.co_filename
        if not ("importlib" in filename and "_bootstrap" in filename):  # warnings.warn does not count these
            if frame.f_globals.get("__name__", "").split(".")[0] not in (*_INTERNAL, "importlib"):
                return level
            level += 1
        frame = frame.f_back
    return 2


def reset_warnings() -> None:
    """Forget which repairs were already reported (tests use this)."""
    with _warned_lock:
        _warned.clear()
