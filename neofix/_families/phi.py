"""Phi's adapter (Phi-1, Phi-1.5, Phi-2: transformers 4.36 and later).

Llama's shape (:mod:`neofix._families.llama`: rotary positions, no position table) with rotary positions on part of
each head (``partial_rotary_factor``), biased projections and a layer norm; measured with
``neofix.testing.tiny_model("phi")``.  Its config takes ``num_key_value_heads`` from 4.37 (read in the 4.36 and 4.37
sources): 4.36 gives the cache every query head.  On 4.36 - 4.41 its causal mask is built by transformers'
``_prepare_4d_causal_attention_mask`` helpers, which overflow for float64 models (neofix builds it in float32: the
family's targets).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._core import Limits, Positions
from . import PHI
from ._contract import Adapter, make_layers, read_window_cache
from . import llama

#: Phi's attention has grouped-query attention from 4.37; 4.36 gives the cache every query head.
GROUPED_QUERY = _compat.release() >= (4, 37)


def limits(config: Any) -> Limits:
    """Llama's limits; on 4.36 the cache has every query head."""
    read = llama.limits(config)
    return read if GROUPED_QUERY else read._replace(heads=config.num_attention_heads)


ADAPTER = Adapter(
    family=PHI,
    positions=Positions.ROTARY,
    limits=limits,
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
