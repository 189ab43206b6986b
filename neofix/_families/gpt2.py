"""GPT-2's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads GPT-2's modeling module (so torch and transformers are loaded already).

Measured with tiny random models, vanilla transformers 4.26 - 5.24: GPT-2 fails exactly as GPT-Neo does.

* Learned absolute positions from a table of ``n_positions`` rows: a left-padded row decodes wrong unless its
  positions start at its first real token, and a sequence past the table fails (``IndexError: index out of range
  in self``; on an accelerator a device-side assert).
* ``token_type_ids`` are embedded with the token embedding (``wte``): past the vocabulary an ``IndexError``.
* 1D ``input_ids`` are read as one row on every release.
* Caches hold keys ``(batch, heads, tokens, head_dim)``: tuples up to 4.56, ``DynamicCache`` from 4.57 (tuples still
  converted up to 4.57; 5.0 fails on ``'tuple' object has no attribute 'get_seq_length'``).
"""

from __future__ import annotations

from .. import _compat
from . import GPT2
from ._common import make_layers, make_limits, no_check
from ._common import read_cache as read_cache

FAMILY = GPT2

#: From 5.0 GPT-2's forward rejects legacy tuple caches (measured: 4.57 converts them, 5.0 fails).
LEGACY_CACHE_REJECTED = _compat.release() >= (5, 0)

#: GPT-2's forward reads 1D ``input_ids`` as one row on every release (``view(-1, length)``).
FLAT_INPUT_IDS_ACCEPTED = True

#: GPT-2 embeds ``token_type_ids`` with its token embedding: they are token ids, range-checked against the vocab.
TOKEN_TYPES_ARE_IDS = True

#: Learned absolute positions (see neofix._core.Policy).
POSITIONS = "absolute"


limits = make_limits(table="n_positions", width="n_embd", heads="n_head")
layers = make_layers("h")  # GPT2Model's blocks
check_step = no_check
