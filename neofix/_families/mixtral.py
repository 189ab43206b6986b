"""Mixtral's adapter: Mistral's (:mod:`neofix._families.mistral`), with a sparse mixture of experts in place of each
block's MLP, which changes nothing neofix reads.

Imported when transformers loads Mixtral's modeling module; the family arrived in transformers 4.36, and neofix
patches it from then.  Outside its experts Mixtral's modeling code is Mistral's, copied release by release (rotary
positions, grouped-query attention, an optional sliding window: ``config.sliding_window``, off by default from 4.40;
the causal-mask helpers of 4.36 - 4.41 that overflow for float64 models, the family's targets; no ``cache_position``
before 4.42; legacy tuple caches converted up to 4.47 and rejected from 4.48), with two differences: 4.42 - 4.45
build its mask as Llama does, applying no window (in the uncached forward too, so that cached steps agree with it),
and its attention reads the config's ``head_dim`` from 4.47, not 4.43 (read in the 4.46.3 and 4.47.1 sources).  The
router's auxiliary loss (``output_router_logits``) is computed by ``MixtralForCausalLM`` from the mask it is given,
outside the patched forward: neofix leaves it as transformers computes it.
"""

from __future__ import annotations

import dataclasses

from . import MIXTRAL
from .llama import rotary_limits
from .mistral import ADAPTER as MISTRAL_ADAPTER

ADAPTER = dataclasses.replace(MISTRAL_ADAPTER, family=MIXTRAL, limits=rotary_limits(head_dim_from=(4, 47)))
