"""OLMo2's adapter: Llama's (:mod:`neofix._families.llama`), with normalised queries and keys and its norms after
attention and MLP, which change nothing neofix reads.

Imported when transformers loads OLMo2's modeling module; the family arrived in transformers 4.47, and neofix patches
it from 4.48 (4.47, which no release of the test matrix has, is older code: it converts legacy tuple caches, ignores
a config ``head_dim`` and runs every decoder layer, not the config's ``num_hidden_layers``; read in the 4.47.1
source).  From 4.48 ``Olmo2Model.forward`` and ``Olmo2ForCausalLM`` are Llama's, generated from them (their sources
differ in names only on 4.48, 4.53, 4.57, 5.0 and 5.25), so Llama's facts of those releases hold: rotary positions,
grouped-query attention, no position table, the config's ``head_dim``, ``cache_position`` taken up to 5.0 (not on
5.24 and 5.25), legacy tuple caches rejected (4.51 - 4.53 with a ``ValueError`` of their own, the others on the
tuple's missing ``get_seq_length``).  Measured on 4.48, 4.53, 4.55, 4.57, 5.0 and 5.25 with
``neofix.testing.tiny_model("olmo2")``.
"""

from __future__ import annotations

import dataclasses

from . import OLMO2
from .llama import ADAPTER as LLAMA_ADAPTER

ADAPTER = dataclasses.replace(LLAMA_ADAPTER, family=OLMO2)
