"""Starcoder2's adapter: Mistral's (:mod:`neofix._families.mistral`), with biased projections, LayerNorm and a plain
MLP, which change nothing neofix reads.

Imported when transformers loads Starcoder2's modeling module; the family arrived in transformers 4.39, and neofix
patches it from 4.40 (4.39, which no release of the test matrix has, builds its sdpa mask without the window its
eager mask applies: read in the 4.39.3 source).  Its modeling code is Mistral's, copied release by release (rotary
positions, grouped-query attention, an optional sliding window: ``config.sliding_window``, off by default; the
causal-mask helpers of 4.40 - 4.41 that overflow for float64 models, the family's targets; no ``cache_position``
before 4.42; legacy tuple caches converted up to 4.47 and rejected from 4.48; from 4.56 the model's own
``DynamicCache`` holds sliding-window layers), with two differences: 4.42 - 4.45 build its mask as Llama does,
applying no window (in the uncached forward too, so that cached steps agree with it; the flash-attention-2 class
applies it), and its attention reads the config's ``head_dim`` from 4.48, not 4.43 (read in the 4.47.1 and 4.48.3
sources).  Measured on 4.40, 4.45, 4.48, 4.53, 4.55, 4.57, 5.0 and 5.25 with
``neofix.testing.tiny_model("starcoder2")``: vanilla cannot run a float64 model on 4.40; a config ``head_dim`` is
ignored by the cache's keys on 4.40 and fails vanilla's rotary embedding on 4.45, and is read from 4.48.
"""

from __future__ import annotations

import dataclasses

from . import STARCODER2
from .llama import rotary_limits
from .mistral import ADAPTER as MISTRAL_ADAPTER

ADAPTER = dataclasses.replace(MISTRAL_ADAPTER, family=STARCODER2, limits=rotary_limits(head_dim_from=(4, 48)))
