"""Qwen2-MoE's adapter (transformers 4.40 and later: patched from its arrival): Qwen2's
(:mod:`neofix._families.qwen2`), with a sparse mixture of experts and a shared expert in place of the MLP of some or
all layers, which changes nothing neofix reads.

Outside its experts the modeling code is Qwen2's (rotary positions, grouped-query attention, biased query, key and
value projections, an optional sliding window: ``use_sliding_window``, off in every released checkpoint's config),
a few releases behind it (read in the 4.40 - 4.56 sources, measured on 4.40, 4.45, 4.48, 4.53, 4.55, 4.57, 5.0 and
5.25 with ``neofix.testing.tiny_model("qwen2_moe")``):

* 4.40 - 4.41: the causal mask is built by transformers' ``_prepare_4d_causal_attention_mask`` helpers, which
  overflow for float64 models (neofix builds it in float32: the family's targets); no ``cache_position`` before 4.42.
* The config's ``head_dim`` is read from 4.53 (Qwen2's from 4.48); before, a head is ``hidden_size //
  num_attention_heads`` wide, whatever the config says.
* Legacy tuple caches: converted with a deprecation warning up to 4.53 (Qwen2 rejects them from 4.48), rejected from
  4.54 (``The `past_key_values` should be either a `Cache` object or `None```).
* With the window on (``use_sliding_window=True``), 4.56 - 4.57 decode wrong, vanilla alike: the model builds its own
  mask over every key while its ``DynamicCache`` keeps only the window's (sliding-window layers); neofix leaves it as
  transformers has it (measured with a window of 4 on 4.56 and 4.57; 4.45, 4.53 and 5.25 are right).

The router's auxiliary loss (``output_router_logits``) is computed by ``Qwen2MoeForCausalLM`` from the mask it is
given, outside the patched forward: neofix leaves it as transformers computes it.
"""

from __future__ import annotations

import dataclasses

from .. import _compat
from . import QWEN2_MOE
from .llama import rotary_limits
from .qwen2 import ADAPTER as QWEN2_ADAPTER

ADAPTER = dataclasses.replace(
    QWEN2_ADAPTER,
    family=QWEN2_MOE,
    limits=rotary_limits(head_dim_from=(4, 53)),
    legacy_cache_rejected=_compat.release() >= (4, 54),
)
