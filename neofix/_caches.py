"""Reading transformers' KV caches into a :class:`~neofix._core.CacheView`, on every supported release.

The one place that knows the cache formats: legacy tuples of per-layer ``(key, value)`` pairs (every release;
GPT-Neo's forward rejects them from 4.54), ``Cache`` objects holding parallel ``key_cache`` lists (4.36 - 4.53) or
one object per layer in ``layers`` (4.54 and later), and static caches, whose length is a tensor (reading it would
synchronise with the device) and whose keys are preallocated to a fixed capacity.  Only shapes are read.

Keys are laid out ``(batch, heads, tokens, head_dim)`` unless a family's adapter says otherwise (``key_layout``).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from ._compat import release
from ._core import NO_CACHE, CacheView

#: Key layout: the dimension of each of (batch, heads, tokens, head_dim) in a layer's key tensor.
BHSD = (0, 1, 2, 3)

_Tensor = torch.Tensor
# CacheView's own constructor is a Python function (a NamedTuple's ``__new__``): the readers of every step build the
# tuple directly, which is what that function does, at a fraction of its cost right after a forward.
_new = tuple.__new__


#: A cache that drops old tokens (transformers' ``SinkCache``, 4.36 - 4.52): the tokens it holds are not the tokens
#: seen, so neither the mask's width nor the positions can be judged against it.  A call over one is passed on as
#: given (the wrappers step aside).
EVICTING = CacheView(None, None, None, None, None, None, "evicting")


#: transformers 4.54 - 4.55: a cache of layers may carry a processor (quantization, offloading)
_PROCESSORS = (4, 54) <= release() < (4, 56)
#: A cache whose length its shapes do not tell: a call over one is checked as one over a cache of unknown length.
UNTOLD = CacheView(None, None, None, None, None, None, "unknown")


def read(cache: Any, layers: int, key_layout: tuple[int, int, int, int] = BHSD) -> CacheView:
    """What ``cache`` holds for a model of ``layers`` layers; shapes only."""
    cache_layers = getattr(cache, "layers", None)
    if type(cache_layers) is list:  # transformers >= 4.54: one object per layer (the hot path of every decode step)
        if _PROCESSORS and _quantizes(cache):
            return UNTOLD
        return _read_layers(cache_layers, layers, key_layout)
    if cache is None:
        return NO_CACHE
    if type(cache) is tuple or type(cache) is list:
        return _read_legacy(cache, layers, key_layout)
    return _read_key_cache(cache, layers, key_layout)


def _quantizes(cache: Any) -> bool:
    """Whether a cache of transformers 4.54 - 4.55 quantizes what it holds.  Its layers then hold only the tokens not
    quantized yet (none after the prompt), and its ``get_seq_length()`` adds a count of the quantized ones that every
    layer's quantization adds to again: two layers that quantize 2 tokens each add 4 (read in the 4.54 and 4.55
    sources, measured with a lossless quantization).  Neither tells the tokens held."""
    processor = getattr(cache, "cache_processor", None)
    return processor is not None and hasattr(processor, "erased_length")


def layer_key(layer: Any) -> Any:
    """A legacy cache layer's key: its first entry, of a ``(key, value)`` pair or of one tensor stacking the two (PEFT's
    prefix tuning passes ``(2, batch, heads, tokens, head_dim)`` tensors, which transformers only indexes); ``None``
    for a missing or empty layer.  Never a tensor's truth value, which raises for more than one element."""
    return layer[0] if layer is not None and len(layer) else None


def first_key(cache: Any) -> Any:
    """A legacy cache's first key (see :func:`layer_key`), ``None`` for none, an empty one or ``(None,) * layers``."""
    return layer_key(cache[0]) if cache else None


def _read_legacy(cache: Any, layers: int, layout: tuple[int, int, int, int]) -> CacheView:
    key = first_key(cache)
    if key is None:
        return CacheView(0, None, (0,) * layers if cache else None, None, None, None, "legacy")
    b, h, s, d = layout
    lengths = []
    for layer in cache[:layers]:
        layer_past = layer_key(layer)
        lengths.append(layer_past.shape[s] if layer_past is not None else 0)
    if len(lengths) < layers:
        lengths += [0] * (layers - len(lengths))
    shape = key.shape
    if len(shape) != 4:
        return CacheView(lengths[0], None, tuple(lengths), None, None, None, "legacy")
    return CacheView(lengths[0], shape[b], tuple(lengths), None, shape[h], shape[d], "legacy")


def _read_layers(cache_layers: list, layers: int, layout: tuple[int, int, int, int]) -> CacheView:
    if not cache_layers:
        return CacheView(0, None, None, None, None, None, "object")
    shape = _held_alike(cache_layers, layers)
    if shape is not None and len(shape) == 4:  # the usual growing cache: every layer holds keys of this shape
        b, h, _, d = layout
        held = shape[-2]
        return _new(CacheView, (held, shape[b], (held,) * layers, None, shape[h], shape[d], "object", None))
    first = cache_layers[0]
    capacity = getattr(first, "max_cache_len", None)
    if capacity is not None:  # a static layer: its length is a tensor, its keys preallocated to the capacity
        key = getattr(first, "keys", None)
        batch = heads = head_dim = None
        if isinstance(key, _Tensor) and key.dim() == 4:
            batch, heads, head_dim = key.shape[layout[0]], key.shape[layout[1]], key.shape[layout[3]]
        length = _static_length(first)
        return CacheView(length, batch, None, capacity, heads, head_dim, "static")
    try:  # every layer at once (one call each), read again one by one if one of them does not tell
        lengths = [layer.get_seq_length() for layer in cache_layers[:layers]]
    except (AttributeError, IndexError, TypeError, ValueError):
        lengths = [_layer_length(layer) for layer in cache_layers[:layers]]
    lengths = [length if type(length) is int else None for length in lengths]  # (a length of another type: None)
    past = lengths[0] if lengths else None
    if len(lengths) < layers:
        lengths += [0] * (layers - len(lengths))
    key = getattr(first, "keys", None)
    if past is None:
        return CacheView(None, None, None, None, None, None, "unknown")
    shape = key.shape if isinstance(key, _Tensor) else ()
    if len(shape) == 4:
        b, h, _, d = layout
        if not shape[b]:  # keys of no rows: a layer counts 0 tokens (it asks numel()), whatever its columns
            return CacheView(None, 0, None, None, shape[h], shape[d], "unknown")
        return CacheView(past, shape[b], tuple(lengths), None, shape[h], shape[d], "object")
    return CacheView(past, None, tuple(lengths), None, None, None, "object")


def _held_alike(cache_layers: list, layers: int) -> Any:
    """The shape of the keys every one of the first ``layers`` layers holds, where each is the usual growing layer
    (``DynamicLayer``, which has no capacity) and their keys, of some elements, have one shape; else ``None`` (the
    layers are asked, one call each).

    Such a layer's ``get_seq_length()`` is its keys' token count, ``shape[-2]`` (transformers' own definition, 4.56 to
    5.x: 0 for keys of no elements, and before the first update, or after ``reset()`` on 5.x, when its keys are not a
    tensor), so keys of one shape hold one count: read here from the shapes, one ``.shape`` a layer where the call into
    transformers costs about twice that on every cached step.  ``tests/test_reads.py`` checks that the two readings
    agree on the installed release."""
    usual = _usual_layer()
    first = cache_layers[0]
    if type(first) is not usual or len(cache_layers) < layers:
        return None
    keys = first.keys
    if type(keys) is not _Tensor or not keys.numel():
        return None
    shape = keys.shape
    for layer in cache_layers[1:layers]:
        if type(layer) is not usual or type(keys := layer.keys) is not _Tensor or keys.shape != shape:
            return None
    return shape


_USUAL: list[Any] = []  # [transformers' DynamicLayer, or None], looked up at the first read of a cache of layers


def _usual_layer() -> Any:
    if not _USUAL:  # (a cache of layer objects exists: transformers.cache_utils is loaded)
        _USUAL.append(getattr(sys.modules.get("transformers.cache_utils"), "DynamicLayer", None))
    return _USUAL[0]


def _read_key_cache(cache: Any, layers: int, layout: tuple[int, int, int, int]) -> CacheView:
    """transformers 4.36 - 4.53: a Cache object with parallel key/value lists (or, 4.38 - 4.40's StaticCache, one per
    attention layer, one layer's keys), or one that only answers ``get_seq_length``."""
    get_seq_length = getattr(cache, "get_seq_length", None)
    if get_seq_length is None:
        return CacheView(None, None, None, None, None, None, "unknown")
    if getattr(cache, "num_sink_tokens", None) is not None:  # SinkCache: it keeps its first tokens and the last ones
        return EVICTING
    capacity = getattr(cache, "max_cache_len", None)
    lengths: list[int | None] = []
    for i in range(layers):
        try:
            length = get_seq_length(i)
        except (AttributeError, IndexError, TypeError, ValueError):
            length = None
        lengths.append(length if type(length) is int else None)
    quantized = getattr(cache, "_quantized_key_cache", None)
    if type(quantized) is list:  # 4.42 - 4.53's QuantizedCache: every layer but the first answers one token less than
        # it holds (a count transformers' attention reads in the middle of a forward), so each holds the first's count
        lengths = [lengths[0] if i < len(quantized) else 0 for i in range(layers)]
    past = lengths[0] if lengths else None
    key_cache = getattr(cache, "key_cache", None)
    if isinstance(key_cache, _Tensor):  # 4.38 - 4.40's StaticCache: one per attention layer, its keys one tensor
        key = key_cache
    else:
        key = key_cache[0] if key_cache else None
    batch = heads = head_dim = None
    if isinstance(key, _Tensor) and key.dim() == 4:
        batch, heads, head_dim = key.shape[layout[0]], key.shape[layout[1]], key.shape[layout[3]]
    if capacity is not None:
        return CacheView(past if past == 0 else None, batch, None, capacity, heads, head_dim, "static")
    if past is None:
        return CacheView(None, batch, None, None, heads, head_dim, "unknown")
    return CacheView(past, batch, tuple(lengths), None, heads, head_dim, "object")


def _layer_length(layer: Any) -> int | None:
    try:
        length = layer.get_seq_length()
    except (AttributeError, IndexError, TypeError, ValueError):  # a layer that does not track a length
        return None
    return length if type(length) is int else None


def _static_length(layer: Any) -> int | None:
    """0 for a static layer nothing was written to yet, else ``None`` (its length is a tensor: reading it would
    synchronise)."""
    if not getattr(layer, "is_initialized", True) or getattr(layer, "keys", None) is None:
        return 0
    return None


def length(cache: Any) -> int | None:
    """Tokens a cache holds (0 for none or an empty one; ``None`` where that cannot be told from shapes)."""
    if cache is None:
        return 0
    if isinstance(cache, (tuple, list)):
        key = first_key(cache)
        return 0 if key is None else key.shape[-2]
    get_seq_length = getattr(cache, "get_seq_length", None)
    if get_seq_length is None:
        return None
    held = get_seq_length()
    return held if type(held) is int else None


def layer_length(layer_past: Any, layer_idx: int | None) -> int | None:
    """Tokens held by one layer's cache as an attention layer sees it (a ``(key, value)`` pair, or the Cache object
    with the layer's index)."""
    if layer_past is None:
        return 0
    if isinstance(layer_past, (tuple, list, _Tensor)):  # (a tensor: a pair stacked, see layer_key)
        key = layer_key(layer_past)
        return 0 if key is None else key.shape[-2]
    if layer_idx is None:
        return None
    held = layer_past.get_seq_length(layer_idx)
    return held if type(held) is int else None


def from_legacy(legacy: Any, config: Any) -> Any:
    """A ``DynamicCache`` holding a legacy ``((key, value), ...)`` cache, built without deprecation warnings."""
    from transformers.cache_utils import DynamicCache

    if release() >= (4, 56):  # (4.54 - 4.55 take ddp_cache_data, but given the config they fail to build its layers)
        return DynamicCache(ddp_cache_data=legacy, config=config)
    return DynamicCache.from_legacy_cache(legacy)  # type: ignore[attr-defined]


def is_legacy(cache: Any) -> bool:
    """A legacy cache: a non-empty tuple of per-layer ``(key, value)`` pairs of 4D tensors."""
    return (
        isinstance(cache, (tuple, list))
        and len(cache) > 0
        and all(
            isinstance(layer, (tuple, list))
            and len(layer) >= 2
            and all(isinstance(t, _Tensor) and t.dim() == 4 for t in layer[:2])
            for layer in cache
        )
    )


def keyword(forward: Any) -> str:
    """The keyword a forward takes its cache under: ``cache`` (transformers 5.x) or ``past_key_values``."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # pragma: no cover - C callables
        return "past_key_values"
    return "cache" if "cache" in parameters else "past_key_values"


def of_call(kwargs: dict) -> tuple[str, Any]:
    """``(keyword, cache)`` of a forward call: 5.x's ``cache``, or ``past_key_values`` (the old name, or before 5.0)."""
    if "cache" in kwargs:
        return "cache", kwargs["cache"]
    return "past_key_values", kwargs.get("past_key_values")


def of_output(output: Any) -> Any:
    """The cache a model output (or any mapping) carries (``cache`` on 5.x, ``past_key_values`` before), or None."""
    keys = getattr(output, "keys", None)
    if keys is None:
        return None
    for name in ("cache", "past_key_values"):
        if name in keys() and output[name] is not None:
            return output[name]
    return None


def static_slots(cache: Any, new: int, device: Any) -> Any:
    """The slots a static cache writes a step's ``new`` tokens to where the call gives no ``cache_position``, counted
    as transformers counts them (the cache's own count of written slots, a tensor on its device, unread, plus
    ``arange(new)``, on ``device``); ``None`` where the cache does not count them, or counts a sliding-window layer's
    slots, which stop at the window (up to 4.55: its count is not the tokens so far, and neither are the slots)."""
    layers = getattr(cache, "layers", None)
    if type(layers) is list:  # 4.55 and later: per layer (5.x keeps the count as a tensor, 4.57 counts the keys)
        if not layers or ("Sliding" in type(layers[0]).__name__ and not hasattr(layers[0], "cumulative_length")):
            return None  # (from 4.56 a sliding-window layer counts every token)
        count: Any = 0 if _static_length(layers[0]) == 0 else _layer_length_tensor(layers[0])
    elif "Sliding" in type(cache).__name__ or "Hybrid" in type(cache).__name__:  # up to 4.54: its first layer's slots
        return None
    else:
        get_seq_length = getattr(cache, "get_seq_length", None)
        try:
            count = get_seq_length(0) if get_seq_length is not None else None
        except (AttributeError, IndexError, TypeError, ValueError):
            count = None
    if type(count) is int:
        return torch.arange(count, count + new, device=device)
    if isinstance(count, _Tensor) and count.numel() == 1:  # (one element: of no dimension, or of one on 5.5 - 5.12)
        return count.reshape(()).to(device) + torch.arange(new, device=device)
    return None


def _layer_length_tensor(layer: Any) -> Any:
    try:
        return layer.get_seq_length()
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
