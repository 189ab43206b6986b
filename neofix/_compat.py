"""Everything that differs between transformers releases, in one place.

The alignment core (:mod:`neofix._align`) never looks at versions.  This module answers the version-specific
questions for it: which range is supported, how many tokens a cache holds and for how many rows, what the cache
keyword is called, and whether a trace or compilation is running.  It imports torch and transformers, so
``import neofix`` must not import it: the patch imports it once transformers is being loaded anyway.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

#: transformers releases neofix is tested against; setup.cfg's install_requires says the same (a test checks).
SUPPORTED_TRANSFORMERS = ">=4.26,<6"

GPT_NEO_MODULE = "transformers.models.gpt_neo.modeling_gpt_neo"


def transformers_version() -> str:
    import transformers

    return str(transformers.__version__)


def _release() -> tuple[int, int]:
    from packaging.version import Version

    return Version(transformers_version()).release[:2]  # type: ignore[return-value]


#: From 4.54 GPT-Neo's forward rejects legacy tuple caches ("should be either a `Cache` object or `None`").
LEGACY_CACHE_REJECTED = _release() >= (4, 54)

#: Up to 4.44 GPT-Neo's forward reads 1D ``input_ids`` as one row (later releases fail on them).
FLAT_INPUT_IDS_ACCEPTED = _release() < (4, 45)

#: From 4.36 ``prepare_inputs_for_generation`` slices the uncached tokens itself (before, only the last one was fed).
GENERATE_SLICES_UNCACHED = _release() >= (4, 36)

#: Up to 4.44 each attention layer gets its own ``(key, value)`` pair; from 4.45 every layer gets the Cache object.
ATTENTION_GETS_LAYER_PAIRS = _release() < (4, 45)

#: From 4.45 GPT-Neo's forward takes ``Cache`` objects (4.45 - 4.53 still take tuples, logging a deprecation).
CACHE_OBJECTS_ACCEPTED = _release() >= (4, 45)


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


# --- caches ---------------------------------------------------------------------------------------------------------


def layer_lengths(cache: Any, layers: int) -> tuple[int | None, ...]:
    """Tokens held by each of the first ``layers`` layers of a cache (0 past its last layer).

    ``None`` for a layer that cannot be told without a device synchronisation or at all (a length that is a tensor,
    as static caches report, or a cache type whose ``get_seq_length(i)`` raises).
    """
    if isinstance(cache, (tuple, list)):
        return tuple(layer_cache_length(cache[i], i) if i < len(cache) else 0 for i in range(layers))
    lengths: list[int | None] = []
    for i in range(layers):
        try:
            length = cache.get_seq_length(i)
        except (AttributeError, IndexError, TypeError, ValueError):
            length = None
        lengths.append(length if isinstance(length, int) else None)
    return tuple(lengths)


def _layer_length(layer: Any) -> int | None:
    try:
        length = layer.get_seq_length()
    except (AttributeError, IndexError, TypeError, ValueError):  # a layer that does not track a length
        return None
    return length if isinstance(length, int) else None


def cache_state(cache: Any) -> tuple[int | None, int | None]:
    """``(tokens held, batch)`` of a legacy tuple cache or a ``Cache`` object; ``None`` where it cannot be told.

    A fresh, empty cache holds 0 tokens and has no batch yet.  Caches whose length is a tensor (static caches)
    report ``None``: reading it would synchronise with the device.
    """
    if cache is None:
        return 0, None
    if isinstance(cache, (tuple, list)):
        if not cache or cache[0] is None or not cache[0]:
            return 0, None
        key = cache[0][0]
        return key.shape[-2], key.shape[0]
    get_seq_length = getattr(cache, "get_seq_length", None)
    if get_seq_length is None:
        return None, None
    length = get_seq_length()
    if not isinstance(length, int):
        return None, None
    return length, _cache_batch(cache)


def read_cache(cache: Any, layers: int) -> tuple[int | None, int | None, tuple[int | None, ...] | None]:
    """``(tokens held, batch, tokens held per layer)`` of a cache the model's ``layers`` layers will read.

    One pass for the model forward: layer 0's length is what the cache holds.  Where that cannot be told (a static
    cache reports a tensor), all three are ``None`` but the batch, and no length is checked.
    """
    if cache is None:
        return 0, None, None
    if type(cache) is tuple and cache and type(cache[0]) is tuple and len(cache[0]) == 2:  # legacy, up to 4.53
        lengths = []
        for layer in cache[:layers]:
            key = layer[0] if layer else None
            lengths.append(key.shape[-2] if key is not None else 0)
        if len(lengths) < layers:
            lengths += [0] * (layers - len(lengths))
        key = cache[0][0]
        return lengths[0], (key.shape[0] if key is not None else None), tuple(lengths)
    cache_layers = None if type(cache) is tuple else getattr(cache, "layers", None)
    if type(cache_layers) is list and cache_layers:  # transformers >= 4.56, the hot path of every decode step
        lengths = [_layer_length(layer) for layer in cache_layers[:layers]]
        if len(lengths) < layers:
            lengths += [0] * (layers - len(lengths))
        past = lengths[0]
        if past is None:
            return None, None, None
        key = getattr(cache_layers[0], "keys", None)
        batch = key.shape[0] if isinstance(key, torch.Tensor) and key.dim() == 4 else None
        return past, batch, tuple(lengths)
    lengths = layer_lengths(cache, layers)
    past = lengths[0] if lengths else cache_state(cache)[0]
    if past is None:
        return None, None, None
    if isinstance(cache, (tuple, list)):
        first = cache[0] if cache else None
        batch = first[0].shape[0] if first and first[0] is not None else None
    else:
        batch = _cache_batch(cache)
    return past, batch, lengths


def cache_length(cache: Any) -> int | None:
    """``cache_state(cache)[0]`` without reading the batch: what ``prepare_inputs_for_generation`` needs each step."""
    if cache is None:
        return 0
    if isinstance(cache, (tuple, list)):
        if not cache or cache[0] is None or not cache[0]:
            return 0
        return cache[0][0].shape[-2]  # type: ignore[no-any-return]
    get_seq_length = getattr(cache, "get_seq_length", None)
    if get_seq_length is None:
        return None
    length = get_seq_length()
    return length if isinstance(length, int) else None


def _cache_batch(cache: Any) -> int | None:
    layers = getattr(cache, "layers", None)  # transformers >= 4.56: one object per layer
    if layers is not None:
        key = getattr(layers[0], "keys", None) if len(layers) else None
    else:  # transformers 4.36 - 4.55: parallel lists of tensors
        key_cache = getattr(cache, "key_cache", None)
        key = key_cache[0] if key_cache else None
    if key is None or not isinstance(key, torch.Tensor) or key.dim() != 4:
        return None
    return key.shape[0]


def layer_cache_length(layer_past: Any, layer_idx: int | None) -> int | None:
    """Tokens held by one layer's cache as the attention layer sees it (a ``(key, value)`` pair or a Cache)."""
    if layer_past is None:
        return 0
    if isinstance(layer_past, (tuple, list)):
        return layer_past[0].shape[-2] if len(layer_past) and layer_past[0] is not None else 0
    if layer_idx is None:
        return None
    length = layer_past.get_seq_length(layer_idx)
    return length if isinstance(length, int) else None


def cache_from_legacy(legacy: Any, config: Any) -> Any:
    """A ``DynamicCache`` holding a legacy ``((key, value), ...)`` cache, built without deprecation warnings."""
    from transformers.cache_utils import DynamicCache

    if "ddp_cache_data" in inspect.signature(DynamicCache.__init__).parameters:  # 4.57 and later
        return DynamicCache(ddp_cache_data=legacy, config=config)
    return DynamicCache.from_legacy_cache(legacy)  # type: ignore[attr-defined]


def cache_keyword(forward: Any) -> str:
    """The keyword a forward takes its cache under: ``cache`` (transformers 5.x) or ``past_key_values``."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - C callables
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def positional_names(function: Any) -> tuple[str, ...]:
    """Names of the parameters a method takes positionally, without ``self``."""
    names = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD):
            names.append(parameter.name)
    return tuple(names[1:]) if names and names[0] == "self" else tuple(names)
