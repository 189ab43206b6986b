"""Mistral's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads Mistral's modeling module (so torch and transformers are loaded already); the family
arrived in transformers 4.34, and neofix patches it from 4.36 (4.34 - 4.35 are not tested).  Mistral is Llama's shape
(rotary positions, grouped-query attention, no position table: everything :mod:`neofix._families.llama` says holds,
measured the same way on 4.36, 4.40, 4.45, 4.57 and 5.24) plus a sliding window (``config.sliding_window``: each token
attends to the last ``sliding_window`` tokens):

* 4.36 - 4.41: the causal mask is built by transformers' ``_prepare_4d_causal_attention_mask`` helpers (the window
  included), which overflow for float64 models (neofix builds it in float32: the family's targets); 4.36 has eager
  attention only (and flash-attention-2), 4.40 sdpa too (whose helper, up to 4.38, unmasks the wrong rows of a
  left-padded chunk after a cache: :func:`~neofix._wrappers.make_prepare_4d_sdpa_mask`, read in the sources).  No
  ``cache_position`` before 4.42.
* 4.45: the cache keeps every token; the window is applied in the 4D mask transformers builds.
* 4.56 and later: the model's own ``DynamicCache`` holds sliding-window layers that keep only the last
  ``sliding_window - 1`` keys but count every token (``get_seq_length``), so the cache's length read from it is the
  sequence's, as the step contract needs.  A static cache (``generate(cache_implementation="static")``) holds
  ``sliding_window`` slots per layer, and the 4D mask of a prefill longer than that spans the prefill's own keys: see
  :func:`~neofix._families._contract.read_window_cache`.
* A hand loop's cached steps, chunked prefills and ``generate`` cross the window and equal the full recompute, which
  applies the same window.
* Legacy tuple caches: converted up to 4.47, rejected from 4.48 (read in the 4.47.1 and 4.48.0 sources, as for
  Llama).  Tuples of a sliding-window layer hold only the window's keys: the tokens before cannot be counted, and a
  mask of the whole sequence is then refused as wider than the cache (vanilla: ``'tuple' object has no attribute
  'get_seq_length'``).
"""

from __future__ import annotations

from .. import _compat
from .._core import Positions
from . import MISTRAL
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=MISTRAL,
    positions=Positions.ROTARY,
    limits=rotary_limits(head_dim_from=(4, 43)),  # the config's head_dim from 4.43
    layers=make_layers("layers", run="num_hidden_layers"),  # MistralModel's decoder layers
    read_cache=read_window_cache,
    # the window is the attention's own (its mask, or its sliding-window cache layers): no check of its own.  Legacy
    # tuple caches fail from 4.48 (4.45 converts them with a deprecation warning)
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
