"""GPT-Neo's adapter: how its forward, config and cache read on each transformers release; and the local attention
window over a static cache (:func:`make_static_window_forward`).

Imported when transformers loads GPT-Neo's modeling module (so torch and transformers are loaded already).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .. import _compat
from .._core import CacheView, Positions
from .._errors import AttentionWindowError
from . import GPT_NEO
from ._contract import Adapter, make_layers, make_limits

#: Marks the eager attention's forward when neofix installed :func:`make_static_window_forward` on it.
WINDOW_MARK = "__neofix_static_window__"

# transformers 4.45 - 4.53: the eager attention returns ``(output, layer_past[, weights])``; from 4.54
# ``(output, weights)``.  Releases whose forward takes ``cache_position`` write the new keys at those slots; from 5.10
# a static layer counts its own tokens (``cumulative_length``).
_RETURNS_CACHE = _compat.release() < (4, 54)


def _static_kinds() -> frozenset[type]:
    """The cache classes whose slots are positions (a token's keys sit at the slot of its position, from 0): the
    ``StaticCache`` of transformers 4.45 - 4.55 (and its offloaded twin), and from 4.56 the ``StaticLayer`` of every
    static cache.  Exactly these classes: other fixed-capacity ones (sliding-window layers and caches, which roll
    their slots, or a subclass) are refused where the window matters."""
    try:
        from transformers import cache_utils
    except ImportError:  # no cache classes at all (before 4.36): no static cache either
        return frozenset()

    def found(*names: str) -> frozenset[type]:
        return frozenset(getattr(cache_utils, name) for name in names if hasattr(cache_utils, name))

    return found("StaticLayer") or found("StaticCache", "OffloadedStaticCache")


def _window_repaired(model: Any) -> bool:
    """Whether this model's local attention layers run the eager attention neofix repairs (not flash-attention-2)."""
    for block in model.h:
        if block.attn.attention_type == "local":
            return bool(getattr(type(block.attn.attention).forward, WINDOW_MARK, False))
    return True


def check_step(model: Any, cache: CacheView, call: Any = None) -> None:
    """GPT-Neo's own limit: its local attention layers slice their window out of a causal buffer at the cache's
    last slot, which is the token's position only for a cache that grows.  neofix repairs the eager attention from
    transformers 4.45 on (:func:`make_static_window_forward`); a static cache of more slots than the window is refused
    where that repair does not run (flash-attention-2; transformers before 4.45, whose GPT-Neo takes no cache
    object)."""
    capacity = cache.capacity
    if capacity is None:
        return
    config = model.config
    window = config.window_size
    if capacity > window and "local" in config.attention_layers and not _window_repaired(model):
        raise window_error(capacity, window, "")


def window_error(capacity: int, window: int, kind: str) -> AttentionWindowError:
    where = (
        f"a {kind} cache, whose slots are not the tokens' positions"
        if kind
        else f"this model's attention (attn_implementation={_implementation()!r}, transformers "
        f"{_compat.transformers_version()})"
    )
    return AttentionWindowError(
        f"a static cache of {capacity} slots with GPT-Neo's local attention layers (window of {window} tokens): "
        f"transformers' GPT-Neo takes each local layer's window from the cache's last slot, not from the token's "
        f"position, so with more slots than the window the local layers attend to the wrong tokens (transformers "
        f"gives wrong tokens without an error). neofix repairs that for a StaticCache with the eager attention on "
        f"transformers 4.45 and later, but not for {where}. Use a StaticCache with attn_implementation='eager' on "
        f"transformers >= 4.45, the default dynamic cache (drop cache_implementation='static'), or a static cache of "
        f"at most {window} slots"
    )


def _implementation() -> str:
    return "flash_attention_2" if _compat.release() >= (4, 36) else "eager"


def make_static_window_forward(original: Any, _adapter: Any) -> Callable[..., Any]:
    """``GPTNeoSelfAttention.forward`` (the eager attention, transformers 4.45 and later): a local layer over a static
    cache attends to the window at each token's position, as it does over a dynamic cache.

    transformers takes the local window's rows of the causal buffer at the key length
    (``bias[:, :, key_length - query_length : key_length]``), which is the tokens' position only for a cache that
    grows; over a static cache the key length is the slot count.  Here a local layer over a static cache takes the
    rows at the new tokens' slots instead (``bias[:, :, slots]``; the slots are ``cache_position``, or from 5.10 the
    layer's own count before the update): a gather on the device, no value read, no branch on a value, so it
    compiles into one graph that serves every step.  Every other call (global layers, dynamic caches) is
    transformers' own.  A fixed-capacity cache whose slots roll (sliding-window caches) is refused with
    :class:`~neofix.AttentionWindowError` by every layer, so by the first, before any layer writes to it.
    """
    from .. import _wrappers
    from .._compat import positional_names

    names = positional_names(original)
    at = names.index("layer_past")
    positional = _static_kinds()
    takes_cache_position = "cache_position" in names

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        cache = args[at] if len(args) > at else kwargs.get("layer_past")
        layers = getattr(cache, "layers", None)
        if type(layers) is list:  # 4.56 and later: the layer's own object (a cache's own max_cache_len is a max over
            # its layers, which fails on a cache of none yet: assisted generation's)
            held = layers[self.layer_id] if self.layer_id < len(layers) else None
        else:  # a static cache of 4.45 - 4.55
            held = cache
        capacity = getattr(held, "max_cache_len", None)
        if capacity is None:  # no cache, or one that grows: transformers' own window is right
            return original(self, *args, **kwargs)
        if type(held) not in positional:
            _refuse_other(self, held, capacity)
            return original(self, *args, **kwargs)
        if self.config.attention_layers[self.layer_id] != "local":  # (the layer's type: 4.x keeps it on no attribute)
            return original(self, *args, **kwargs)
        call = {**dict(zip(names, args)), **kwargs}
        return _local_over_static(self, call, cache, held, takes_cache_position)

    setattr(forward, WINDOW_MARK, True)
    return _wrappers._mark(forward)


def _refuse_other(attention: Any, held: Any, capacity: int) -> None:
    """A fixed-capacity cache whose slots are not positions (sliding-window layers roll theirs): refused by every
    layer (so by the first, before any writes to it) where a local window is shorter than the slots."""
    config = attention.config
    if capacity > config.window_size and "local" in config.attention_layers:
        raise window_error(capacity, config.window_size, type(held).__name__)


def _local_over_static(attention: Any, call: dict, cache: Any, held: Any, takes_cache_position: bool) -> Any:
    """transformers' eager attention forward for a local layer over a static cache, the window taken at the slots."""
    hidden = call["hidden_states"]
    heads, width = attention.num_heads, attention.head_dim
    query = attention._split_heads(attention.q_proj(hidden), heads, width)
    key = attention._split_heads(attention.k_proj(hidden), heads, width)
    value = attention._split_heads(attention.v_proj(hidden), heads, width)
    new = hidden.shape[-2]
    cache_position = call.get("cache_position")
    if takes_cache_position:  # 4.45 - 5.0: the model gives the slots, the cache writes there
        slots = cache_position if cache_position is not None else torch.arange(new, device=hidden.device)
        key, value = cache.update(key, value, attention.layer_id, {"cache_position": cache_position})
    else:  # 5.10 and later: the layer counts its tokens (a tensor on the device) and writes after them
        slots = held.cumulative_length + torch.arange(new, device=hidden.device) if held.is_initialized else (
            torch.arange(new, device=hidden.device)
        )
        key, value = cache.update(key, value, attention.layer_id)
    output, weights = _attend(attention, slots.reshape(-1), query, key, value, call.get("attention_mask"),
                              call.get("head_mask"))
    output = attention.resid_dropout(attention.out_proj(attention._merge_heads(output, heads, width)))
    if _RETURNS_CACHE:
        return (output, cache, weights) if call.get("output_attentions") else (output, cache)
    return output, weights


def _attend(attention: Any, slots: Any, query: Any, key: Any, value: Any, mask: Any, head_mask: Any) -> Any:
    """transformers' ``GPTNeoSelfAttention._attn``, the causal buffer's rows taken at the new tokens' slots."""
    query = query.to(torch.float32)
    key = key.to(torch.float32)
    weights = torch.matmul(query, key.transpose(-1, -2))
    keys = key.size(-2)
    causal = attention.bias[:, :, slots, :keys]
    floor = torch.tensor(torch.finfo(weights.dtype).min, dtype=weights.dtype, device=weights.device)
    weights = torch.where(causal, weights, floor)
    if mask is not None:
        weights = weights + mask[:, :, :, :keys]
    weights = torch.nn.functional.softmax(weights, dim=-1).to(value.dtype)
    weights = attention.attn_dropout(weights)
    if head_mask is not None:
        weights = weights * head_mask
    return torch.matmul(weights, value), weights


ADAPTER = Adapter(
    family=GPT_NEO,
    positions=Positions.ABSOLUTE,  # learned absolute positions
    limits=make_limits(table="max_position_embeddings", width="hidden_size", heads="num_heads"),
    layers=make_layers("h"),  # GPTNeoModel's blocks
    check_step=check_step,
    # from 4.54 the forward rejects legacy tuple caches ("should be either a `Cache` object or `None`")
    legacy_cache_rejected=_compat.release() >= (4, 54),
    flat_input_ids_accepted=_compat.release() < (4, 45),  # up to 4.44 1D input_ids are read as one row
)
