"""Cohere's adapter (Command-R: ``CohereForCausalLM``): Llama's (:mod:`neofix._families.llama`), with rotary positions
on interleaved pairs of a head's dimensions, a layer norm without bias, attention and MLP in parallel, optional
normalised queries and keys (``use_qk_norm``) and scaled logits (``logit_scale``), which change nothing neofix reads.

Imported when transformers loads Cohere's modeling module; the family arrived in transformers 4.40, and neofix patches
it from there. ``CohereModel.forward`` and ``CohereForCausalLM.prepare_inputs_for_generation`` are Llama's (copied from
them up to 4.47, generated from them from 4.48): their sources differ from ``LlamaModel``'s and ``LlamaForCausalLM``'s
in names only on 4.40, 4.45, 4.48, 4.53, 4.55, 4.57, 5.0, 5.10 and 5.25 (the causal LM's forward differs by its logit
scale). So Llama's facts of those releases hold: rotary positions, grouped-query attention, no position table, no
sliding window; the causal mask built by the model from ``cache_position`` up to 4.52 (none of the float64 helpers: a
float64 model runs on 4.40) and by ``create_causal_mask`` from 4.53 (a stale mask silently wrong there);
``cache_position`` taken up to 5.3 (read in the 5.3 and 5.4 signatures), and on 4.40 passed wrong by assisted decoding
and by ``generate(use_cache=False)`` (vanilla's tokens differ from the reference's; neofix's do not); legacy tuple
caches converted up to 4.47 and rejected from 4.48 (4.53 with a ``ValueError`` of its own, the others on the tuple's
missing ``get_seq_length``); 1D ``input_ids`` fail. On 4.40 ``generate(cache_implementation="static")`` sets a static
cache on every attention layer (``_setup_cache``, Llama's), read through Llama's ``held_cache``.

One fact differs from Llama's: its attention reads a config ``head_dim`` from 4.48, not 4.45 (read in the 4.44 - 4.48
sources; the cache's keys ignore one on 4.40, and on 4.45 - 4.47 it fails vanilla's rotary embedding, which reads it:
measured on 4.40, 4.45 and 4.47). Measured on 4.40, 4.45, 4.48, 4.53, 4.55, 4.57, 5.0, 5.10 and 5.25 with
``neofix.testing.tiny_model("cohere")`` (``use_qk_norm=True`` too on 4.40 and 5.25).
"""

from __future__ import annotations

import dataclasses

from . import COHERE
from .llama import ADAPTER as LLAMA_ADAPTER
from .llama import rotary_limits

ADAPTER = dataclasses.replace(LLAMA_ADAPTER, family=COHERE, limits=rotary_limits(head_dim_from=(4, 48)))
