"""GPT-Neo's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads GPT-Neo's modeling module (so torch and transformers are loaded already).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._core import CacheView
from .._errors import AttentionWindowError
from . import GPT_NEO
from ._common import make_layers, make_limits
from ._common import read_cache as read_cache

FAMILY = GPT_NEO

#: From 4.54 GPT-Neo's forward rejects legacy tuple caches ("should be either a `Cache` object or `None`").
LEGACY_CACHE_REJECTED = _compat.release() >= (4, 54)

#: Up to 4.44 GPT-Neo's forward reads 1D ``input_ids`` as one row (later releases fail on them).
FLAT_INPUT_IDS_ACCEPTED = _compat.release() < (4, 45)

#: From 4.45 GPT-Neo's forward takes ``Cache`` objects (4.45 - 4.53 still take tuples, logging a deprecation).
CACHE_OBJECTS_ACCEPTED = _compat.release() >= (4, 45)

#: Up to 4.44 each attention layer gets its own ``(key, value)`` pair; from 4.45 every layer gets the Cache object.
ATTENTION_GETS_LAYER_PAIRS = _compat.release() < (4, 45)

#: GPT-Neo embeds ``token_type_ids`` with its token embedding: they are token ids, range-checked against the vocab.
TOKEN_TYPES_ARE_IDS = True

#: Learned absolute positions (see neofix._core.Policy).
POSITIONS = "absolute"


limits = make_limits(table="max_position_embeddings", width="hidden_size", heads="num_heads")
layers = make_layers("h")  # GPTNeoModel's blocks


def check_step(model: Any, cache: CacheView) -> None:
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
