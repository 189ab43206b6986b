"""Qwen3-MoE's adapter (transformers 4.51 and later): Qwen3's shape (:mod:`neofix._families.qwen3`) with a sparse
mixture of experts in place of the MLP of some or all layers.

The experts change nothing neofix reads: rotary positions, grouped-query attention, ``head_dim`` from the config on
every release, an optional sliding window (``use_sliding_window``, off by default), the caches of Qwen3; measured on
4.53, 4.57, 5.0 and 5.25 with ``neofix.testing.tiny_model("qwen3_moe")``.  Every release that has it rejects legacy
tuple caches.  The router's auxiliary loss is computed by ``Qwen3MoeForCausalLM`` from the mask it is given, outside
the patched forward: neofix leaves it as transformers computes it.
"""

from __future__ import annotations

from .._core import Positions
from . import QWEN3_MOE
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=QWEN3_MOE,
    positions=Positions.ROTARY,
    limits=rotary_limits(),  # the config's head_dim on every release
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=True,
)
