"""GPT-Neo's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads GPT-Neo's modeling module (so torch and transformers are loaded already).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._core import CacheView, Positions
from .._errors import AttentionWindowError
from . import GPT_NEO
from ._contract import Adapter, make_layers, make_limits


def check_step(model: Any, cache: CacheView, call: Any = None) -> None:
    """GPT-Neo's own limit: its local attention layers slice their window out of a causal buffer at the cache's
    last slot, which is the token's position only for a cache that grows.  With a static cache of more slots than the
    window, local layers would attend to the wrong tokens (vanilla transformers silently gives wrong tokens)."""
    capacity = cache.capacity
    if capacity is None:
        return
    config = model.config
    window = config.window_size
    if capacity > window and "local" in config.attention_layers:
        raise AttentionWindowError(
            f"a static cache of {capacity} slots with GPT-Neo's local attention layers (window of {window} tokens): "
            f"transformers' GPT-Neo takes each local layer's window from the cache's last slot, not from the token's "
            f"position, so with more slots than the window the local layers attend to the wrong tokens (transformers "
            f"gives wrong tokens without an error). Use the default dynamic cache (drop "
            f"cache_implementation='static'), "
            f"or a static cache of at most {window} slots"
        )


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
