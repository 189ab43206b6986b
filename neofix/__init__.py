"""neofix: GPT-Neo text generation that is correct at every decoding step.

``import neofix`` registers a patch on transformers' GPT-Neo (applied when transformers loads GPT-Neo, or at once
if it already has).  On every forward step the attention mask is made to cover the cached plus the new tokens,
position ids are derived from the mask and advance by one per real token, and the KV cache, mask, positions and
inputs are validated against each other.  What can be repaired is repaired (with a one-time
:class:`NeofixWarning`); what cannot raises :class:`NeofixError`, a ``ValueError`` naming the lengths involved.

Importing neofix imports neither torch nor transformers.  ``NEOFIX_DISABLE=1`` makes the import register nothing.
"""

from __future__ import annotations

import warnings as _warnings

from ._config import configure
from ._errors import (
    AttentionWindowError,
    BatchMismatchError,
    CacheLengthError,
    InputShapeError,
    MaskLengthError,
    MaskValueError,
    NeofixError,
    NeofixWarning,
    PositionError,
    SequenceTooLongError,
    TokenIdError,
)
from ._families import FAMILIES as _FAMILY_DECLARATIONS
from ._lifecycle import is_patched, patch, patched, unpatch, unpatched
from ._version import __version__

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing at run time
if TYPE_CHECKING:
    from typing import Any
del TYPE_CHECKING

#: The model families neofix patches, by name: what ``neofix.patch(families=...)`` and ``NEOFIX_FAMILIES`` take.
FAMILIES = tuple(_FAMILY_DECLARATIONS)

__all__ = [
    "FAMILIES",
    "AttentionWindowError",
    "BatchMismatchError",
    "CacheLengthError",
    "DecodeState",
    "InputShapeError",
    "MaskLengthError",
    "MaskValueError",
    "NeofixError",
    "NeofixWarning",
    "PositionError",
    "SequenceTooLongError",
    "TokenIdError",
    "__version__",
    "configure",
    "is_patched",
    "patch",
    "patched",
    "trace",
    "unpatch",
    "unpatched",
]

# Names that need torch are loaded on first use, so that ``import neofix`` stays cheap.
_LAZY = {"DecodeState": "neofix._state", "trace": "neofix._trace"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'neofix' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def _register() -> None:
    from ._lifecycle import register

    try:
        register()
    except Exception as exc:  # importing neofix must never crash a program
        _warnings.warn(
            f"neofix: could not register its GPT-Neo patch ({type(exc).__name__}: {exc}); GPT-Neo is unpatched",
            NeofixWarning,
            stacklevel=2,
        )


_register()
