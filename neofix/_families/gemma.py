"""Gemma's adapter (transformers 4.40 and later: the family arrived in 4.38, and no release of the test matrix has
4.38 - 4.39, so neofix leaves it as transformers has it there).

Llama's shape (:mod:`neofix._families.llama`: rotary positions, grouped-query attention, no position table) with
``head_dim`` from the config and embeddings scaled by the square root of the hidden size; measured with
``neofix.testing.tiny_model("gemma")``.
"""

from __future__ import annotations

from .. import _compat
from .._core import Positions
from . import GEMMA
from ._contract import Adapter, make_layers, read_window_cache
from .llama import held_cache, rotary_limits

ADAPTER = Adapter(
    family=GEMMA,
    positions=Positions.ROTARY,
    limits=rotary_limits(),  # the config's head_dim on every release
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=_compat.release() >= (4, 48),
    held_cache=held_cache if _compat.release() < (4, 41) else None,
)
