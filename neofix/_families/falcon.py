"""Falcon's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads Falcon's modeling module (so torch and transformers are loaded already); the family
arrived in transformers 4.33, and neofix patches it from 4.36, the first release of the test matrix that has it (4.33 -
4.35 are left as transformers has them).

Measured with tiny random models (``tiny_model("falcon")``: rotary, multi-query attention; and the same with
``alibi=True``, with ``multi_query=False``, and with ``new_decoder_architecture=True, num_kv_heads=2``), vanilla
transformers 4.36, 4.40, 4.45, 4.48, 4.53, 4.54, 4.55, 4.57, 5.0, 5.10 and 5.25, and read in the sources of 4.36 -
5.25:

* Positions depend on the model's config (``positions_of``).  ``alibi=True`` (the original Falcon-RW models): ALiBi
  built from the 2D mask (``build_alibi_tensor``, ``cumsum(mask) - 1`` over every column), as BLOOM's; the forward
  takes ``position_ids`` and never reads them, so neofix leaves them alone (``Positions.NONE``: stale ones decode
  right, as in vanilla) and aligns the mask.  ``alibi=False`` (Falcon-7B, -40B, -180B: the usual): rotary positions,
  as Llama's (``Positions.ROTARY``); ``max_position_embeddings`` is no table (the rotary embedding computes any
  position: 4.36 - 4.44 grow its cos/sin cache to the keys' count).  Missing positions are ``arange`` after the cache
  (4.36 - 4.44), ``cache_position`` (4.45 - 5.3), ``arange(q)`` after ``cache.get_seq_length()`` (from 5.4, which
  takes no ``cache_position``).  Up to 4.44 the rotary embedding is cut at the keys' count and indexed by the
  positions: positions past it fail (``IndexError``), as Llama's on 4.36 - 4.37.
* The cache holds keys ``(batch, heads, tokens, head_dim)``, ``head_dim = hidden_size // num_attention_heads``:
  one head with multi-query attention (``multi_query=True``, the default, without ``new_decoder_architecture``);
  ``num_kv_heads`` without multi-query; with ``new_decoder_architecture`` every query head up to 5.24 (its keys are
  broadcast to the queries before they are cached) and ``num_kv_heads`` from 5.25 (measured on 5.10 and 5.25, read in
  the 5.24 and 5.25 sources).
* Legacy tuple caches: the only cache 4.36 - 4.44 take; converted to a ``DynamicCache`` (the tuples returned) on 4.45 -
  4.53; rejected from 4.54 ("The `past_key_values` should be either a `Cache` object or `None`." on 4.54 - 4.56,
  ``'tuple' object has no attribute 'get_seq_length'`` from 4.57): repair mode wraps them.
* The causal mask: transformers' ``_prepare_4d_causal_attention_mask`` helpers on 4.36 - 4.44 (read in the 4.36 -
  4.44 sources), which overflow for float64 models (vanilla cannot run one: "value cannot be converted to type float
  without overflow", measured on 4.36 and 4.40; neofix builds it in float32, see the family's targets); the sdpa
  helper also unmasks a left-padded rotary chunk after a cache wrongly up to 4.38.  With ALiBi and sdpa (the default)
  4.36 - 4.38 unmask the rows of left-padding queries through ``AttentionMaskConverter._unmask_unattended(mask,
  mask_2d, 0.0)``, counting a chunk after a cache as if it started the sequence, as GPT-BigCode's sdpa path does
  there: neofix replaces it the same way (:func:`~neofix._families.gpt_bigcode.make_unmask_converter`).  The model's
  own ``_update_causal_mask`` from ``cache_position`` on 4.45 - 5.1; ``create_causal_mask`` from 5.2.
* Static caches: on 4.45 - 4.55 transformers' ``StaticCache`` gives every layer the config's
  ``num_key_value_heads``, which ``FalconConfig`` lacks (every query head is taken), so with multi-query attention
  (one key-value head written) ``generate(cache_implementation="static")`` and a hand loop over one fail in vanilla
  (``index_copy_(): Source/destination tensor must have same slice shapes``; measured on 4.45, 4.54 and 4.55; the
  multi-head and new-architecture configs decode).  neofix refuses such a step before the model runs, naming why
  (:func:`check_step`); from 4.56 the cache takes its layout from the keys written, and it decodes.
* ``parallel_attn`` and ``bias`` change nothing neofix reads (a left-padded hand loop and generate of either kind,
  serial attention and biased projections, give the reference's tokens: measured on 4.36, 4.45 and 5.25).
* 1D ``input_ids`` fail (``not enough values to unpack``: measured on 4.36, 4.45 and 5.25).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._core import CacheView, Limits, Positions
from .._errors import InputShapeError
from . import FALCON
from ._contract import Adapter, make_layers, no_check
from .gpt_bigcode import make_unmask_converter  # noqa: F401 - the family's 4.36 - 4.38 target (its registry line)

#: From 5.25 the new decoder architecture caches its ``num_kv_heads`` key-value heads; before, every query head's.
GROUPED_CACHE = _compat.release() >= (5, 25)


def positions_of(config: Any) -> Positions:
    """ALiBi (built from the mask: the model takes no positions it reads) where ``config.alibi``, else rotary."""
    return Positions.NONE if config.alibi else Positions.ROTARY


def limits(config: Any) -> Limits:
    """No position table (ALiBi and the rotary embedding both extrapolate); the cache's key-value heads (one with
    multi-query attention; with the new decoder architecture every query head's up to 5.24) of ``hidden_size //
    num_attention_heads`` each."""
    heads = config.num_attention_heads
    new = config.new_decoder_architecture
    key_value_heads = (config.num_kv_heads or heads) if new or not config.multi_query else 1
    return Limits(
        max_positions=None,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        heads=heads if new and not GROUPED_CACHE else key_value_heads,
        head_dim=config.hidden_size // heads,
    )


#: 4.45 - 4.55: transformers' StaticCache gives Falcon's layers every query head (its config has no
#: ``num_key_value_heads``), more than a multi-query model writes.
STATIC_CACHE_OF_EVERY_HEAD = (4, 45) <= _compat.release() < (4, 56)


def check_step(model: Any, view: CacheView, call: dict) -> None:
    """On 4.45 - 4.55: a static cache of more key-value heads than the model writes (multi-query attention), which
    transformers built for it and its attention cannot fill (vanilla: ``index_copy_`` fails), refused naming why."""
    if view.capacity is None or view.heads is None:
        return
    written = limits(model.config).heads
    if view.heads != written:
        raise InputShapeError(
            f"the static cache holds keys of {view.heads} heads, but this Falcon model writes {written} (multi-query "
            f"attention): transformers {_compat.transformers_version()} builds Falcon's StaticCache with every query "
            f"head, which its attention cannot fill (vanilla fails in index_copy_). Decode with a dynamic cache (no "
            f"cache_implementation='static'), or on transformers 4.56 or later"
        )


ADAPTER = Adapter(
    family=FALCON,
    positions=Positions.ROTARY,  # the usual config's (alibi=False); positions_of reads each model's
    positions_of=positions_of,
    limits=limits,
    layers=make_layers("h"),  # FalconModel's decoder layers
    check_step=check_step if STATIC_CACHE_OF_EVERY_HEAD else no_check,
    # no window: a static cache's empty slots are masked by the 4D mask transformers builds for it; 4.45 - 4.55 build
    # one a multi-query model cannot fill (refused).  Legacy tuples: rejected from 4.54 (4.45 - 4.53 convert them,
    # 4.36 - 4.44 take nothing else)
    legacy_cache_rejected=_compat.release() >= (4, 54),
    flat_input_ids_accepted=False,
)
