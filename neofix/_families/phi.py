"""Phi's adapter (Phi-1, Phi-1.5, Phi-2: transformers 4.36 and later).

Llama's shape (:mod:`neofix._families.llama`: rotary positions, no position table) with rotary positions on part of
each head (``partial_rotary_factor``), biased projections and a layer norm; measured with
``neofix.testing.tiny_model("phi")``.  Its config takes ``num_key_value_heads`` from 4.37 (read in the 4.36 and 4.37
sources): 4.36 gives the cache every query head; its attention reads ``head_dim`` from 4.48 (``hidden_size //
num_attention_heads`` before, whatever the config says).  On 4.36 - 4.41 its causal mask is built by transformers'
``_prepare_4d_causal_attention_mask`` helpers, which overflow for float64 models (neofix builds it in float32: the
family's targets).
"""

from __future__ import annotations

from .. import _compat
from .._core import Positions
from . import PHI
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=PHI,
    positions=Positions.ROTARY,
    # grouped-query attention from 4.37 (4.36 gives the cache every query head), the config's head_dim from 4.48
    limits=rotary_limits(grouped_query_from=(4, 37), head_dim_from=(4, 48)),
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
