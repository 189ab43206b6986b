"""Qwen3's adapter (transformers 4.51 and later).

Llama's shape (:mod:`neofix._families.llama`) with normalised queries and keys and ``head_dim`` from the config;
measured on 4.57 and 5.24 with ``neofix.testing.tiny_model("qwen3")``.  Every release that has it rejects legacy
tuple caches (from 4.48, as Llama).
"""

from __future__ import annotations

from .._core import Positions
from . import QWEN3
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=QWEN3,
    positions=Positions.ROTARY,
    limits=rotary_limits(),  # the config's head_dim on every release
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=True,
)
