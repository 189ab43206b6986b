"""Llama's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads Llama's modeling module (so torch and transformers are loaded already); the family
arrived in transformers 4.28.

Measured with tiny random models (``neofix.testing.tiny_model("llama")``), vanilla transformers 4.45, 4.57 and 5.24:

* Positions are rotary: only differences matter, so a left-padded row decodes the same whether its positions count
  the padding (transformers' own) or start at its first real token (the mask's), and a chunked prefill without
  positions is right.  Missing positions come from ``cache_position`` (4.45 - 4.57) or ``arange(q)`` after
  ``cache.get_seq_length()`` (5.x, which takes no ``cache_position``).
* ``max_position_embeddings`` is no table: the rotary embedding computes any position, and cached decoding past it
  equals the full recompute.  neofix adds no limit there.
* Keys are ``(batch, key_value_heads, tokens, head_dim)``: with grouped-query attention fewer heads than the
  queries', and ``head_dim`` from the config where it says (4.45 on), else ``hidden_size // num_attention_heads``.
* Legacy tuple caches: converted with a deprecation warning up to 4.47 (measured on 4.45); from 4.48, where
  ``LlamaModel.forward`` lost its ``DynamicCache.from_legacy_cache`` (read in the 4.47.1 and 4.48.0 sources), they
  fail (``'tuple' object has no attribute 'get_seq_length'``, measured on 4.57 and 5.24).
* 1D ``input_ids`` fail on every release measured.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._core import Limits, Positions
from . import LLAMA
from ._contract import Adapter, make_layers


def limits(config: Any) -> Limits:
    """No position table (rotary: running past ``max_position_embeddings`` is no error); the cache's keys have the
    key-value heads (grouped-query attention) of ``head_dim`` each."""
    heads = config.num_attention_heads
    key_value_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return Limits(
        max_positions=None,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        heads=key_value_heads,
        head_dim=head_dim,
    )


ADAPTER = Adapter(
    family=LLAMA,
    positions=Positions.ROTARY,
    limits=limits,
    layers=make_layers("layers"),  # LlamaModel's decoder layers
    # no window: a static cache's empty slots are masked by the 4D mask transformers builds for it (no check of its
    # own).  Legacy tuple caches fail from 4.48 (4.45 converts them with a deprecation warning)
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
