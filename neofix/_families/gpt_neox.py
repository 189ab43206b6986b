"""GPT-NeoX's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads GPT-NeoX's modeling module (so torch and transformers are loaded already).

Measured with tiny random models, vanilla transformers 4.26 - 5.24:

* Positions are rotary: only differences matter, so a left-padded row decodes the same whether its positions count
  the padding (transformers' own) or start at its first real token (the mask's).  Up to 4.27 the forward takes no
  ``position_ids`` (the attention rotates by ``arange`` after the cache); they arrived in 4.28 (transformers PR
  #22382).
* ``max_position_embeddings`` is no table: the rotary embedding grows its cos/sin cache with the sequence.  Up to
  4.30 the attention layers slice their causal mask from a buffer of ``max_position_embeddings`` columns, so a
  longer sequence fails (``RuntimeError: The size of tensor a (64) must match the size of tensor b (65)``); 4.36
  grows that buffer too (``GPTNeoXAttention._init_bias``), and 4.53 builds masks without it: from there a longer
  sequence runs, and cached decoding past it equals the full recompute.
* No ``token_type_ids``; 1D ``input_ids`` fail on every release.
* Caches hold keys ``(batch, heads, tokens, head_dim)``: tuples up to 4.44, ``DynamicCache`` from 4.45 (tuples
  converted with a deprecation warning up to 4.48; 4.53 fails on ``tuple.get_seq_length``).
"""

from __future__ import annotations

import sys

from .. import _compat
from .._core import Positions
from . import GPT_NEOX
from ._contract import Adapter, make_layers, make_limits


def _causal_buffer_is_fixed() -> bool:
    """Whether the attention layers slice their causal mask from a buffer of ``max_position_embeddings`` columns that
    never grows: measured on 4.26 and 4.30, not on 4.36 and later.  Between those (4.31 - 4.35, not measured) the
    attention class tells: the buffer grows where it has ``_init_bias``."""
    if _compat.release() >= (4, 36):
        return False
    module = sys.modules.get(GPT_NEOX.module)
    attention = getattr(module, "GPTNeoXAttention", None)
    return attention is not None and not hasattr(attention, "_init_bias")


#: A sequence past ``max_position_embeddings`` fails (only where the causal buffer is fixed); elsewhere it runs and
#: is right (the rotary embedding extrapolates), so neofix adds no limit there.
TABLE_IS_A_LIMIT = _causal_buffer_is_fixed()


ADAPTER = Adapter(
    family=GPT_NEOX,
    # rotary; up to 4.27 the forward takes no position_ids (nothing to align)
    positions=Positions.ROTARY if _compat.release() >= (4, 28) else Positions.NONE,
    limits=make_limits(
        table="max_position_embeddings" if TABLE_IS_A_LIMIT else None, width="hidden_size", heads="num_attention_heads"
    ),
    layers=make_layers("layers"),  # GPTNeoXModel's blocks
    # tuples fail from 4.49, where the attention was rewritten on transformers' attention interface (4.48 converts)
    legacy_cache_rejected=_compat.release() >= (4, 49),
)
