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

from typing import Any

from .. import _caches, _compat
from .._core import CacheView, Limits
from . import GPT2

FAMILY = GPT2

#: From 5.0 GPT-2's forward rejects legacy tuple caches (measured: 4.57 converts them, 5.0 fails).
LEGACY_CACHE_REJECTED = _compat.release() >= (5, 0)

#: GPT-2's forward reads 1D ``input_ids`` as one row on every release (``view(-1, length)``).
FLAT_INPUT_IDS_ACCEPTED = True

#: GPT-2 embeds ``token_type_ids`` with its token embedding: they are token ids, range-checked against the vocab.
TOKEN_TYPES_ARE_IDS = True

#: Learned absolute positions (see neofix._core.Policy).
POSITIONS = "absolute"


def limits(config: Any) -> Limits:
    heads = config.n_head
    return Limits(
        max_positions=config.n_positions,
        vocab_size=config.vocab_size,
        hidden_size=config.n_embd,
        heads=heads,
        head_dim=config.n_embd // heads,
    )


def layers(model: Any) -> int:
    """The number of attention layers of a ``GPT2Model`` (each reads one layer of the cache)."""
    return len(model.h)


def read_cache(cache: Any, layer_count: int) -> CacheView:
    return _caches.read(cache, layer_count)


def check_step(model: Any, cache: CacheView) -> None:
    """Nothing of GPT-2's own: its attention has no window."""
