"""SmolLM3's adapter (transformers 4.53 and later: patched from its arrival).

Llama's shape (:mod:`neofix._families.llama`) with rotary positions left out of some layers (``no_rope_layers``: by
default every fourth layer attends without positions, "NoPE"), which changes nothing neofix reads: a NoPE layer's
keys do not depend on positions at all, so a cache stays right whichever scheme its rotary layers were built with.
Grouped-query attention, ``head_dim`` from the config on every release, an optional sliding window on the NoPE
layers (``use_sliding_window``, off by default); legacy tuple caches are rejected on every release that has it.
Measured on 4.53, 4.55, 4.57, 5.0 and 5.25 with ``neofix.testing.tiny_model("smollm3")`` (one rotary layer, then one
NoPE layer).
"""

from __future__ import annotations

from .._core import Positions
from . import SMOLLM3
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=SMOLLM3,
    positions=Positions.ROTARY,
    limits=rotary_limits(),  # the config's head_dim on every release
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=True,
)
