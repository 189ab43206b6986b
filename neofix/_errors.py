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
    """The attention mask's width cannot be told apart: a 2D mask longer than the cached plus the new tokens whose
    readings differ (one whose readings agree, such as all ones, is sliced), or shorter (in strict mode; repaired
    otherwise); a 3D or 4D mask of another shape than the step's; a ``DecodeState`` prompt mask of another width than
    its ``input_ids``."""


class MaskValueError(NeofixError):
    """The 2D attention mask holds values other than 0 (padding) and 1 (a real token); in strict mode, also decoding
    from the cache of a right-padded prompt."""


class BatchMismatchError(NeofixError):
    """The attention mask, position ids or cache hold a different batch size than the inputs (in ``DecodeState``:
    than the state, its ``tokens`` and ``finished`` too)."""


class PositionError(NeofixError):
    """The position ids cannot be used: not 1D or 2D integers, or a value outside the position table; in strict
    mode also a length other than the new tokens' or values other than the mask's (repaired otherwise)."""


class SequenceTooLongError(NeofixError):
    """The sequence would pass ``config.max_position_embeddings``."""


class TokenIdError(NeofixError):
    """A token id (in ``input_ids`` or ``token_type_ids``) lies outside ``[0, config.vocab_size)``, or the ids are
    not integers."""


class CacheLengthError(NeofixError):
    """The layers of the KV cache hold different numbers of tokens, or fewer layers than the model has, or a mask
    wider than a static cache's slots; in ``DecodeState``, a cache that does not hold the tokens the state expects."""


class InputShapeError(NeofixError):
    """The step's inputs have an impossible shape (no new tokens, wrong embedding width, ...)."""


class AttentionWindowError(NeofixError):
    """A local or sliding attention window would be applied wrong and neofix cannot repair it: GPT-Neo's local layers
    with flash-attention-2 (no window at all), or a static cache of more slots than the window where the repair does
    not run (a fixed-capacity cache whose slots are not the tokens' positions); Gemma2's and Gemma3's sliding-window
    layers over a growing cache past the window, up to transformers 4.52.  A ``StaticCache`` with the eager attention
    on transformers 4.45 and later is repaired, not refused."""


class NeofixWarning(UserWarning):
    """neofix repaired a decoding step (each kind of repair reported once per process), or has something to say about
    the environment: decoding from a right-padded prompt, an unsupported transformers, a patch target missing, an
    environment variable it does not understand, the unrelated ``neofix`` distribution installed alongside."""


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
