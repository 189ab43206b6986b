"""Gemma3's adapter, text only: ``Gemma3ForCausalLM`` over ``Gemma3TextModel`` (transformers 4.50 and later).

Gemma2's shape (:mod:`neofix._families.gemma2`): rotary positions (a separate base frequency for the sliding
layers), sliding-window layers among global ones (``sliding_window_pattern`` up to 4.52, ``layer_types`` from 4.53),
no position table; measured on 4.57 and 5.24 with ``neofix.testing.tiny_model("gemma3")``.  Its cache is a
``DynamicCache`` of sliding-window and full layers that count every token (4.57 and 5.x), so the cache's length read
from it is the sequence's.  Legacy tuple caches are rejected on every release that has it.  Up to 4.52 a growing
cache passed past the sliding window is read wrong as Gemma2's (a size error): refused by Gemma2's
:func:`~neofix._families.gemma2.check_past_window`.
"""

from __future__ import annotations

from .._core import Positions
from . import GEMMA3
from ._contract import Adapter, make_layers, no_check, read_window_cache
from .gemma2 import GROWING_CACHE_MISREAD_PAST_WINDOW, check_past_window
from .llama import rotary_limits

ADAPTER = Adapter(
    family=GEMMA3,
    positions=Positions.ROTARY,
    limits=rotary_limits(),  # the config's head_dim on every release
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    check_step=check_past_window if GROWING_CACHE_MISREAD_PAST_WINDOW else no_check,
    legacy_cache_rejected=True,
)
