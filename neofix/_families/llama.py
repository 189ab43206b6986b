"""Llama's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads Llama's modeling module (so torch and transformers are loaded already); the family
arrived in transformers 4.28, and neofix patches it from 4.30 (4.28 - 4.29 are not tested).

Measured with tiny random models (``neofix.testing.tiny_model("llama")``), vanilla transformers 4.30, 4.36, 4.40,
4.45, 4.57 and 5.24:

* Positions are rotary: only differences matter, so a left-padded row decodes the same whether its positions count
  the padding (transformers' own) or start at its first real token (the mask's), and a chunked prefill without
  positions is right.  Missing positions come from ``cache_position`` (4.45 - 5.3) or ``arange(q)`` after
  ``cache.get_seq_length()`` (from 5.4, which takes no ``cache_position``: measured on 5.0 - 5.5).
* ``max_position_embeddings`` is no table: the rotary embedding computes any position, and cached decoding past it
  equals the full recompute.  neofix adds no limit there.
* Keys are ``(batch, key_value_heads, tokens, head_dim)``: with grouped-query attention (4.31 on; 4.30 gives the
  cache every query head, whatever the config says) fewer heads than the queries', and ``head_dim`` from the config
  where it says (4.45 on), else ``hidden_size // num_attention_heads``.
* The causal mask: built by the model itself up to 4.35 (in the scores' dtype); through transformers'
  ``_prepare_4d_causal_attention_mask`` helpers on 4.36 - 4.37, which overflow for float64 models (vanilla cannot
  run one: neofix builds it in float32, see the family's targets); by ``_update_causal_mask`` from ``cache_position``
  from 4.38.  4.36 - 4.37's sdpa helper unmasks the wrong rows of a left-padded chunk after a cache (vanilla: wrong
  tokens, or an ``IndexError``); neofix builds that mask right
  (:func:`~neofix._wrappers.make_prepare_4d_sdpa_mask`).
* ``cache_position``: taken from 4.38.  On 4.39 - 4.40 candidate decoding (assisted, prompt lookup) passes a wrong one
  (generate advances it by one per step, however many candidates were accepted), from which vanilla builds its mask:
  its tokens differ from greedy decoding's.  neofix replaces it, as any cache_position that does not follow the cache
  (said once), and gives greedy decoding's tokens.
* Static caches on 4.38 - 4.40: ``generate(cache_implementation="static")`` sets a ``StaticCache`` on every attention
  layer (``_setup_cache``) and gives the forward ``past_key_values=None``; neofix reads that cache
  (:func:`held_cache`).
* Legacy tuple caches: converted with a deprecation warning up to 4.47 (measured on 4.45); from 4.48, where
  ``LlamaModel.forward`` lost its ``DynamicCache.from_legacy_cache`` (read in the 4.47.1 and 4.48.0 sources), they
  fail (``'tuple' object has no attribute 'get_seq_length'``, measured on 4.57 and 5.24).
* 1D ``input_ids`` fail on every release measured.
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _compat
from .._core import Limits, Positions
from . import LLAMA
from ._contract import Adapter, make_layers


def rotary_limits(
    *, grouped_query_from: tuple[int, int] | None = None, head_dim_from: tuple[int, int] | None = None
) -> Callable[[Any], Limits]:
    """``limits(config)`` for a decoder of Llama's shape: no position table (rotary: running past
    ``max_position_embeddings`` is no error); the cache's keys have the key-value heads of ``head_dim`` each.  On
    transformers releases before ``grouped_query_from`` the attention gives the cache every query head, and before
    ``head_dim_from`` it takes ``hidden_size // num_attention_heads`` for a head's width, whatever the config says (a
    config may carry either: a checkpoint saved by a newer release, a config built with them); ``None``: it reads the
    config on every release that has the family."""
    grouped = grouped_query_from is None or _compat.release() >= grouped_query_from
    own_head_dim = head_dim_from is None or _compat.release() >= head_dim_from

    def limits(config: Any) -> Limits:
        heads = config.num_attention_heads
        key_value_heads = (getattr(config, "num_key_value_heads", None) if grouped else None) or heads
        configured = getattr(config, "head_dim", None)
        head_dim = (configured if own_head_dim else None) or config.hidden_size // heads
        return Limits(
            max_positions=None,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            heads=key_value_heads,
            head_dim=head_dim,
            unused_head_dim=configured if configured and configured != head_dim else None,
        )

    return limits


#: Llama's attention reads ``num_key_value_heads`` (grouped-query attention) from 4.31 (4.28 - 4.30 give the cache
#: every query head, whatever the config says: the config keeps any keyword it is given), and ``head_dim`` from 4.45
#: (read in the 4.44 and 4.45 sources).
limits = rotary_limits(grouped_query_from=(4, 31), head_dim_from=(4, 45))


def held_cache(model: Any) -> Any:
    """The static cache ``generate(cache_implementation="static")`` sets on every attention layer on transformers 4.38
    - 4.40 (``LlamaForCausalLM._setup_cache``; the forward is then given ``past_key_values=None``, and each layer reads
    its own), or ``None``."""
    layers = model._modules.get("layers")
    attention = getattr(layers[0], "self_attn", None) if layers else None
    return getattr(attention, "past_key_value", None)


ADAPTER = Adapter(
    family=LLAMA,
    positions=Positions.ROTARY,
    limits=limits,
    layers=make_layers("layers", run="num_hidden_layers"),  # LlamaModel's decoder layers
    # no window: a static cache's empty slots are masked by the 4D mask transformers builds for it (no check of its
    # own).  Legacy tuple caches fail from 4.48 (4.45 converts them with a deprecation warning)
    legacy_cache_rejected=_compat.release() >= (4, 48),
    held_cache=held_cache if (4, 38) <= _compat.release() < (4, 41) else None,
)
