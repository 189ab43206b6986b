"""OLMo's adapter (the first OLMo: ``OlmoForCausalLM``): Llama's (:mod:`neofix._families.llama`), with a layer norm
without parameters and optional clipping of queries, keys and values (``clip_qkv``), which change nothing neofix reads.

Imported when transformers loads OLMo's modeling module; the family arrived in transformers 4.40, and neofix patches it
from there. ``OlmoModel.forward`` and ``OlmoForCausalLM.prepare_inputs_for_generation`` are Llama's (copied from them up
to 4.47, generated from them from 4.48): their sources differ from ``LlamaModel``'s and ``LlamaForCausalLM``'s in names
only on 4.40, 4.48, 4.53, 4.55, 4.57, 5.0, 5.10 and 5.25, and on 4.45 the forward differs only in leaving the rotary
embedding to each attention layer. So Llama's facts of those releases hold: rotary positions, grouped-query attention,
no position table, no sliding window; the causal mask built by the model from ``cache_position`` up to 4.52 (none of the
float64 helpers: a float64 model runs on 4.40) and by ``create_causal_mask`` from 4.53 (a stale mask silently wrong
there); ``cache_position`` taken up to 5.3 (read in the 5.3 and 5.4 signatures), and on 4.40 passed wrong by assisted
decoding and by ``generate(use_cache=False)`` (vanilla's tokens differ from the reference's; neofix's do not); legacy
tuple caches converted up to 4.47 and rejected from 4.48 (4.53 with a ``ValueError`` of its own, the others on the
tuple's missing ``get_seq_length``); 1D ``input_ids`` fail.

One fact differs from Llama's: its attention reads a config ``head_dim`` from 4.48, not 4.45 (read in the 4.44 - 4.48
sources; the cache's keys ignore one on 4.40 - 4.47, measured on 4.40, 4.45 and 4.47). On 4.40
``generate(cache_implementation="static")`` fails in vanilla (its ``_setup_cache`` reads the weight of a layer norm that
has none): left as it is. Measured on 4.40, 4.45, 4.48, 4.53, 4.55, 4.57, 5.0, 5.10 and 5.25 with
``neofix.testing.tiny_model("olmo")``.
"""

from __future__ import annotations

import dataclasses

from . import OLMO
from .llama import ADAPTER as LLAMA_ADAPTER
from .llama import rotary_limits

ADAPTER = dataclasses.replace(LLAMA_ADAPTER, family=OLMO, limits=rotary_limits(head_dim_from=(4, 48)))
