"""GPT-J's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads GPT-J's modeling module (so torch and transformers are loaded already).
CodeGen's modeling module is a copy of GPT-J's in everything neofix reads, release for release (measured on the
same eleven releases): :mod:`neofix._families.codegen` takes these facts from here.

Measured with tiny random models, vanilla transformers 4.26 - 5.24:

* Positions are rotary: the attention scores of two tokens depend only on the difference of their positions, so a
  left-padded row decodes the same whether its positions count the padding (transformers' own, ``arange``) or start
  at its first real token (the mask's).  Up to 4.27 the attention layers ignore ``position_ids`` altogether (they
  rotate by ``arange`` after the cache, whatever is passed); from 4.28 (transformers PR #22069) they look each
  position up in a sinusoid table of ``n_positions`` rows.
* A sequence past ``n_positions`` fails on every release: up to 4.27 on the causal-mask buffer of
  ``n_positions`` columns (``RuntimeError: The size of tensor a (64) must match ...``), later on the sinusoid
  table (``index 64 is out of bounds``; on an accelerator a device-side assert).
* From 4.45 the attention keeps no causal buffer of ``n_positions`` columns (eager, and sdpa where it exists): a
  left-padded batch wider than the table whose positions fit (each row's real tokens, as generate gives them) runs
  right (measured on 4.26 - 5.25, ``tests/test_wider_than_table.py``; flash attention, not measurable on the CPU, is
  refused as before).
* ``token_type_ids`` are embedded with the token embedding (``wte``): past the vocabulary an ``IndexError``.
* Caches hold keys ``(batch, heads, tokens, head_dim)``: tuples up to 4.44, ``DynamicCache`` from 4.45 (tuples
  converted with a deprecation warning up to 4.53; from 4.54 they fail on ``tuple.get_seq_length``).
"""

from __future__ import annotations

from .. import _compat
from .._core import Positions
from . import GPTJ
from ._contract import Adapter, attention_of, make_layers, make_limits

#: Rotary positions, looked up by ``position_ids`` from 4.28; up to 4.27 the attention ignores the ``position_ids``
#: the forward takes, so neofix leaves them alone as well: stale ones decode right there.
POSITIONS = Positions.ROTARY if _compat.release() >= (4, 28) else Positions.NONE

ADAPTER = Adapter(
    family=GPTJ,
    positions=POSITIONS,
    # the sinusoid table (and up to 4.27 the causal-mask buffer) has n_positions rows: past it is an error
    limits=make_limits(
        table="n_positions",
        width="n_embd",
        heads="n_head",
        wider_than_table=lambda config: _compat.release() >= (4, 45) and attention_of(config) in ("eager", "sdpa"),
    ),
    layers=make_layers("h"),  # GPTJModel's blocks
    # its attention has no window, and a static cache's slots past the sequence are masked by the 4D mask
    # transformers builds for it: no check of its own.
    # Legacy tuple caches fail from 4.54 ('tuple' object has no attribute 'get_seq_length'; 4.53 converts them)
    legacy_cache_rejected=_compat.release() >= (4, 54),
    # up to 4.44 1D input_ids are read as one row (4.36 - 4.44 fail on them with an IndexError where
    # config.pad_token_id is set and no mask is given: transformers' own, passed on); 4.45 fails on every one
    flat_input_ids_accepted=_compat.release() < (4, 45),
)
