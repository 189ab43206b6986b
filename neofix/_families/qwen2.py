"""Qwen2's adapter (transformers 4.37 and later: patched from its arrival).

Llama's shape (:mod:`neofix._families.llama`: rotary positions, grouped-query attention, no position table, legacy
tuple caches converted up to 4.47 and rejected from 4.48) with biased query, key and value projections; measured the
same way on 4.40, 4.45, 4.57 and 5.24 with ``neofix.testing.tiny_model("qwen2")``.  On 4.37 - 4.41 (read in the
4.37, 4.38, 4.39 and 4.41 sources, measured on 4.40) its causal mask is built by transformers'
``_prepare_4d_causal_attention_mask`` helpers, which overflow for float64 models (neofix builds it in float32: the
family's targets; up to 4.38 the sdpa helper unmasks the wrong rows of a left-padded chunk after a cache, which neofix
builds right: :func:`~neofix._wrappers.make_prepare_4d_sdpa_mask`), and the forward takes no ``cache_position``.  Its config's optional sliding window
(``use_sliding_window``, off in every released checkpoint's config) is the attention's own, applied in its mask.
"""

from __future__ import annotations

from .. import _compat
from .._core import Positions
from . import QWEN2
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=QWEN2,
    positions=Positions.ROTARY,
    limits=rotary_limits(head_dim_from=(4, 48)),  # the config's head_dim from 4.48
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
