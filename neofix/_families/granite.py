"""Granite's adapter (transformers 4.45 and later: patched from its arrival): Llama's
(:mod:`neofix._families.llama`), with scalar multipliers of the embeddings, the residual branches, the attention
scores and the logits, which change nothing neofix reads.

Read in the 4.45 - 4.48 sources, measured on 4.45, 4.48, 4.53, 4.55, 4.57, 5.0 and 5.25 with
``neofix.testing.tiny_model("granite")`` (its multipliers set away from 1, so that a test would see one skipped):
its causal mask is built by ``_update_causal_mask`` from ``cache_position`` (4.45 - 4.52) or transformers' mask
functions (later); the config's ``head_dim`` is read from 4.48 (before, a head is ``hidden_size //
num_attention_heads`` wide); legacy tuple caches are converted with a deprecation warning up to 4.47 and rejected
from 4.48, as Llama's.
"""

from __future__ import annotations

import dataclasses

from . import GRANITE
from .llama import ADAPTER as LLAMA_ADAPTER
from .llama import rotary_limits

ADAPTER = dataclasses.replace(LLAMA_ADAPTER, family=GRANITE, limits=rotary_limits(head_dim_from=(4, 48)))
