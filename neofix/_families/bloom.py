"""BLOOM's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads BLOOM's modeling module (so torch and transformers are loaded already).

BLOOM biases attention with ALiBi, built from the attention mask: it takes no position ids and has no position table,
so a sequence of any length is no error (it extrapolates) and left padding needs no positions.  Up to transformers
4.43 it keeps its cache fused: each layer's keys are ``(batch * heads, head_dim, tokens)`` and its values
``(batch * heads, tokens, head_dim)``; from 4.44 it keeps the usual ``(batch, heads, tokens, head_dim)`` in a
``Cache`` object (4.44 - 4.53 still take and return legacy tuples of that layout).
"""

from __future__ import annotations

from typing import Any

from .. import _caches, _compat
from .._core import CacheView, Positions
from .._errors import InputShapeError
from . import BLOOM
from ._contract import Adapter, make_limits

#: Up to 4.43 BLOOM's cache is fused: keys ``(batch * heads, head_dim, tokens)``, values ``(batch * heads, tokens,
#: head_dim)`` (``BloomPreTrainedModel._convert_to_bloom_cache``); from 4.44 a ``Cache`` object of the usual layout.
FUSED_CACHE = _compat.release() < (4, 44)


class LayerCount(int):
    """The number of layers of a BLOOM model on a fused-cache release, carrying its ``heads`` and ``head_dim``.

    A fused key ``(batch * heads, head_dim, tokens)`` tells its batch only to who knows the model's head count, and
    :func:`read_cache` receives only ``layers(model)``: this int carries the head count to it.
    """

    heads: int
    head_dim: int

    def __new__(cls, count: int, heads: int, head_dim: int) -> LayerCount:
        self = super().__new__(cls, count)
        self.heads, self.head_dim = heads, head_dim
        return self


def layers(model: Any) -> int:
    """The number of attention layers of a ``BloomModel`` (each reads one layer of the cache); on releases with the
    fused cache a :class:`LayerCount` that also carries the model's head count (a plain int while compiling)."""
    count = len(model.h)
    if not FUSED_CACHE or _compat.is_compiling():
        return count
    config = model.config
    return LayerCount(count, config.n_head, config.hidden_size // config.n_head)


def read_cache(cache: Any, layer_count: int) -> CacheView:
    """What the cache holds (up to 4.43, the fused cache: :func:`read_fused`).  BLOOM builds ALiBi from the 2D mask,
    so transformers' generate pads that mask with zeros to a static cache's slots (BLOOM's own
    ``prepare_inputs_for_generation`` from 4.44, ``create_masks_for_generate`` on 5.x): a mask as wide as the slots,
    which the core reads by slot and passes on as given."""
    if FUSED_CACHE and (type(cache) is tuple or type(cache) is list):
        return read_fused(cache, layer_count)
    return _caches.read(cache, layer_count)


def read_fused(cache: Any, layer_count: int) -> CacheView:
    """A BLOOM cache of transformers up to 4.43: per layer a key ``(batch * heads, head_dim, tokens)`` and a value
    ``(batch * heads, tokens, head_dim)``.  Its batch is ``batch * heads // heads``, told only when ``layer_count`` is
    a :class:`LayerCount` (the model's head count); else the batch is left unchecked, as the cache's width is."""
    layers = int(layer_count)
    key = _caches.first_key(cache)
    if key is None:  # no cache, or (None,) * layers
        return CacheView(0, None, (0,) * layers if cache else None, None, None, None, "legacy")
    if key.dim() == 4:
        raise InputShapeError(
            f"the cache holds keys of shape {tuple(key.shape)}: the standard layout (batch, heads, head_dim, tokens) "
            f"of BloomForCausalLM._convert_to_standard_cache, but BLOOM's forward on transformers "
            f"{_compat.transformers_version()} takes its own fused layout (batch * heads, head_dim, tokens). Pass the "
            f"cache the model returned, or convert it with model._convert_to_bloom_cache(cache)"
        )
    lengths = []
    for layer in cache[:layers]:
        layer_key = _caches.layer_key(layer)
        lengths.append(layer_key.shape[-1] if layer_key is not None and layer_key.dim() == 3 else 0)
    if len(lengths) < layers:
        lengths += [0] * (layers - len(lengths))
    if key.dim() != 3 or not isinstance(layer_count, LayerCount):
        return CacheView(lengths[0], None, tuple(lengths), None, None, None, "legacy")
    rows, head_dim = key.shape[0], key.shape[1]
    heads, width = layer_count.heads, layer_count.head_dim
    if head_dim != width or rows % heads:
        raise InputShapeError(
            f"the cache holds keys of shape {tuple(key.shape)} (batch * heads, head_dim, tokens), but this model "
            f"has {heads} heads of width {width}: "
            + (
                f"its keys are {head_dim} wide"
                if head_dim != width
                else f"{rows} rows are not a whole number of batches of {heads} heads"
            )
            + ". The cache was built by another model: pass the cache this model returned, or none (the prompt is "
            "then encoded again)"
        )
    return CacheView(lengths[0], rows // heads, tuple(lengths), None, heads, head_dim, "legacy")


ADAPTER = Adapter(
    family=BLOOM,
    positions=Positions.NONE,  # ALiBi: the model takes no positions
    # no position table (max_positions None): ALiBi extrapolates, a sequence of any length is no error
    limits=make_limits(table=None, width="hidden_size", heads="n_head"),
    layers=layers,
    read_cache=read_cache,
    # no refusal of its own: no position table, no attention window
    legacy_cache_rejected=_compat.release() >= (4, 54),  # 'tuple' object has no attribute 'get_seq_length'
    flat_input_ids_accepted=False,  # every release fails on 1D input_ids ("not enough values to unpack")
)
