"""Phi3's adapter (transformers 4.45 and later: the family arrived in 4.41, and no release of the test matrix has
4.41 - 4.44, so neofix leaves it as transformers has it there).

Llama's shape (:mod:`neofix._families.llama`) with fused query-key-value and gate-up projections; measured on 4.45,
4.57 and 5.24 with ``neofix.testing.tiny_model("phi3")``.  ``Phi3ForCausalLM`` on 4.45 accepts ``cache_position`` but
does not pass it on to ``Phi3Model`` (which neofix patches): the model then counts from its cache, as it does with
none given.
"""

from __future__ import annotations

from .. import _compat
from .._core import Positions
from . import PHI3
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=PHI3,
    positions=Positions.ROTARY,
    limits=rotary_limits(head_dim_from=(4, 48)),  # the config's head_dim from 4.48
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
