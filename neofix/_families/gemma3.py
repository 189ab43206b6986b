"""Gemma3's adapter, text only: ``Gemma3ForCausalLM`` over ``Gemma3TextModel`` (transformers 4.50 and later).

Gemma2's shape (:mod:`neofix._families.gemma2`): rotary positions (a separate base frequency for the sliding
layers), sliding-window layers among global ones (``sliding_window_pattern`` up to 4.52, ``layer_types`` from 4.53),
no position table; measured on 4.57 and 5.24 with ``neofix.testing.tiny_model("gemma3")``.  Its cache is a
``DynamicCache`` of sliding-window and full layers that count every token (4.57 and 5.x), so the cache's length read
from it is the sequence's.  Legacy tuple caches are rejected on every release that has it.
"""

from __future__ import annotations

from .._core import Positions
from . import GEMMA3
from ._contract import Adapter, make_layers, read_window_cache
from .llama import limits

ADAPTER = Adapter(
    family=GEMMA3,
    positions=Positions.ROTARY,
    limits=limits,
    layers=make_layers("layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=True,
)
