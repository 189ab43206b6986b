"""Qwen3-MoE's adapter (transformers 4.51 and later): Qwen3's (:mod:`neofix._families.qwen3`), with a sparse mixture
of experts in place of the MLP of some or all layers, which changes nothing neofix reads.

Outside its experts the modeling code is Qwen3's: rotary positions, grouped-query attention, ``head_dim`` from the
config on every release, an optional sliding window (``use_sliding_window``, off by default), Qwen3's caches, and
legacy tuple caches rejected on every release that has it; measured on 4.53, 4.57, 5.0 and 5.25 with
``neofix.testing.tiny_model("qwen3_moe")``.  The router's auxiliary loss is computed by ``Qwen3MoeForCausalLM`` from
the mask it is given, outside the patched forward: neofix leaves it as transformers computes it.
"""

from __future__ import annotations

import dataclasses

from . import QWEN3_MOE
from .qwen3 import ADAPTER as QWEN3_ADAPTER

ADAPTER = dataclasses.replace(QWEN3_ADAPTER, family=QWEN3_MOE)
