"""neofix: cached decoding in Hugging Face transformers, correct at every step, for twenty-eight decoder families.

``import neofix`` registers a patch on transformers' GPT-Neo, GPT-2, GPT-J, CodeGen, GPT-NeoX, OPT, BLOOM, GPT-BigCode,
Llama, Mistral, Mixtral, Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, Gemma, Gemma2, Gemma3, Phi, Phi3, Granite, SmolLM3,
GPT-OSS, Starcoder2, OLMo2, OLMo, Cohere and Falcon (each applied when transformers loads that family's modeling module,
or at once if it already has; a family the installed release lacks is skipped).  On every forward step the attention mask is made to
cover the cached plus the new tokens, position ids are derived from the mask and advance by one per real token, and the
KV cache, mask, positions and inputs are validated against each other.  What can be repaired is repaired (with a
one-time :class:`NeofixWarning`); what cannot raises :class:`NeofixError`, a ``ValueError`` naming the lengths
involved.

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


def _name_clash(directories: Any = None) -> str | None:
    """What to do about the unrelated PyPI distribution named ``neofix``, if one is installed here; else ``None``.

    That project installs an import package ``neofix`` too: installed beside transformers-neofix, each overwrites
    the other's files, and uninstalling either deletes both.  Read from installed metadata only (the
    ``neofix-VERSION.dist-info`` or ``.egg-info`` folder in the site-packages folders on ``sys.path`` and the folder
    this package sits in): the other package is never imported, and neither is ``importlib.metadata`` (``import
    neofix`` must stay cheap).  Never raises.
    """
    import os
    import sys

    try:
        if directories is None:
            here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            directories = [here] + [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
        seen = set()
        for directory in directories:
            directory = os.path.abspath(directory)
            if directory in seen:
                continue
            seen.add(directory)
            try:
                names = os.listdir(directory)
            except OSError:
                continue
            for name in names:
                lowered = name.lower()
                if not lowered.endswith((".dist-info", ".egg-info")):
                    continue
                stem = lowered.rsplit(".", 1)[0]
                project, _, version = stem.partition("-")
                if project.replace(".", "_") != "neofix":
                    continue
                version = version.split("-", 1)[0]
                found = f"'neofix' {version}" if version else "'neofix'"
                return (
                    f"neofix: the unrelated distribution {found} is installed in {directory}. It is not "
                    f"transformers-neofix, but it installs an import package named `neofix` too: each overwrites "
                    f"the other's files, and uninstalling either deletes files of both. To repair, uninstall it "
                    f"first, then reinstall this one: `pip uninstall neofix`, then `pip install --force-reinstall "
                    f"transformers-neofix` (from a checkout: `pip install --force-reinstall .`)"
                )
    except Exception:  # a check that cannot run says nothing: importing neofix must never crash a program
        return None
    return None


def _warn_about_a_name_clash() -> None:
    clash = _name_clash()
    if clash is not None:
        from ._errors import caller_stacklevel

        _warnings.warn(clash, NeofixWarning, stacklevel=caller_stacklevel())  # the user's `import neofix` line


def _register() -> None:
    from ._lifecycle import register

    try:
        register()
    except Exception as exc:  # importing neofix must never crash a program
        _warnings.warn(
            f"neofix: registering its patches failed ({type(exc).__name__}: {exc}); the families not patched by "
            f"then stay unpatched (`neofix doctor` lists each patch target's state)",
            NeofixWarning,
            stacklevel=2,
        )


_warn_about_a_name_clash()
_register()
