"""CodeGen's adapter.  CodeGen's modeling module is GPT-J's with a fused query/key/value projection: everything
neofix reads (positions, the sinusoid table of ``n_positions`` rows, token types embedded with the token
embedding, the cache layout, which inputs the forward takes) reads as GPT-J's on every release (measured on
4.26 - 5.24; see :mod:`neofix._families.gptj`).

Imported when transformers loads CodeGen's modeling module.
"""

from __future__ import annotations

import dataclasses

from . import CODEGEN
from .gptj import ADAPTER as GPTJ_ADAPTER

ADAPTER = dataclasses.replace(GPTJ_ADAPTER, family=CODEGEN)
