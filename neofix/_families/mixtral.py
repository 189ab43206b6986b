"""Mixtral's adapter: Mistral's shape with a sparse mixture of experts in place of each block's MLP.

Imported when transformers loads Mixtral's modeling module; the family arrived in transformers 4.36, and neofix
patches it from then.  The experts change nothing neofix reads: rotary positions, grouped-query attention, an optional
sliding window (``config.sliding_window``, off by default from 4.40) and the caches of
:mod:`neofix._families.mistral`, whose notes hold here too, release by release (its modeling code is Mistral's,
copied, except that 4.42 - 4.45 build its mask as Llama does, applying no window, in the uncached forward too, so
that cached steps agree with it): the causal-mask helpers of 4.36 - 4.41 overflow for float64 models (the family's
targets), no ``cache_position`` before 4.42, legacy tuple caches converted up to 4.47 and rejected from 4.48.  Its attention reads
the config's ``head_dim`` from 4.47 (read in the 4.46.3 and 4.47.1 sources).  The router's auxiliary loss
(``output_router_logits``) is computed by ``MixtralForCausalLM`` from the mask it is given, outside the patched
forward: neofix leaves it as transformers computes it.
"""

from __future__ import annotations

from .. import _compat
from .._core import Positions
from . import MIXTRAL
from ._contract import Adapter, make_layers, read_window_cache
from .llama import rotary_limits

ADAPTER = Adapter(
    family=MIXTRAL,
    positions=Positions.ROTARY,
    limits=rotary_limits(head_dim_from=(4, 47)),  # the config's head_dim from 4.47
    layers=make_layers("layers", run="num_hidden_layers"),  # MixtralModel's decoder layers
    read_cache=read_window_cache,
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
