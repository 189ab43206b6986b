"""GPT-2's adapter: how its forward, config and cache read on each transformers release.

Imported when transformers loads GPT-2's modeling module (so torch and transformers are loaded already).

Measured with tiny random models, vanilla transformers 4.26 - 5.24: GPT-2 fails exactly as GPT-Neo does.

* Learned absolute positions from a table of ``n_positions`` rows: a left-padded row decodes wrong unless its
  positions start at its first real token, and a sequence past the table fails (``IndexError: index out of range
  in self``; on an accelerator a device-side assert).
* A left-padded batch wider than the table whose positions fit (each row's real tokens) runs right where the
  attention keeps no causal buffer of ``n_positions`` columns: sdpa from 4.42, eager from 5.2 (4.26 - 5.1's eager
  attention slices that buffer and fails on ``The size of tensor a ... must match``).  Measured on 4.26 - 5.25
  (``tests/test_wider_than_table.py``); flash attention, not measurable on the CPU, is refused as before.  On
  4.42 - 4.53 the sdpa attention falls back to the eager one when asked for attentions or given a ``head_mask``,
  and vanilla fails such a wide step: refused before its compute (:func:`check_step`).
* ``token_type_ids`` are embedded with the token embedding (``wte``): past the vocabulary an ``IndexError``.
* 1D ``input_ids`` are read as one row on every release.
* Caches hold keys ``(batch, heads, tokens, head_dim)``: tuples up to 4.56, ``DynamicCache`` from 4.57 (tuples still
  converted up to 4.57; 5.0 fails on ``'tuple' object has no attribute 'get_seq_length'``).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._core import CacheView, Positions
from .._core._align import cache_problem
from .._core._values import sequence_too_long
from .._errors import SequenceTooLongError
from . import GPT2
from ._contract import Adapter, attention_of, make_layers, make_limits, no_check


def _wider_than_table(config: Any) -> bool:
    attention = attention_of(config)
    return (attention == "sdpa" and _compat.release() >= (4, 42)) or (
        attention == "eager" and _compat.release() >= (5, 2)
    )


def check_step(model: Any, cache: CacheView, call: dict) -> None:
    """4.42 - 4.53: the sdpa attention falls back to the eager one when asked for attentions or given a ``head_mask``,
    and the eager one slices a causal buffer of ``n_positions`` columns: a step wider than the table, which sdpa runs
    (``_wider_than_table``), fails there (vanilla: a size mismatch).  Refused before its compute, on its columns (the
    core's own rule, :func:`~neofix._core._align.cache_problem`)."""
    config = model.config
    wants = call.get("output_attentions")
    if not (wants or (wants is None and config.output_attentions) or call.get("head_mask") is not None):
        return  # (the usual step: nothing more is read)
    first = call.get("input_ids")
    first = first if first is not None else call.get("inputs_embeds")
    if attention_of(config) != "sdpa" or first is None or first.dim() < 2:
        return
    problem = cache_problem(cache, first.shape[0], first.shape[1], ADAPTER.limits(config))
    if type(problem) is SequenceTooLongError:
        raise sequence_too_long(
            problem.past,  # type: ignore[attr-defined]
            first.shape[1],
            problem.max_positions,  # type: ignore[attr-defined]
            why=f". (Asked for attentions or given a head_mask, GPT-2's sdpa attention runs its eager one on transformers "
            f"{_compat.transformers_version()}, which holds {problem.max_positions} columns; without them a "  # type: ignore[attr-defined]
            f"left-padded batch wider than the table runs while its positions fit)",
        )


ADAPTER = Adapter(
    family=GPT2,
    positions=Positions.ABSOLUTE,  # learned absolute positions
    limits=make_limits(table="n_positions", width="n_embd", heads="n_head", wider_than_table=_wider_than_table),
    layers=make_layers("h"),  # GPT2Model's blocks
    legacy_cache_rejected=_compat.release() >= (5, 0),  # measured: 4.57 converts tuples, 5.0 fails
    check_step=check_step if (4, 42) <= _compat.release() < (4, 54) else no_check,
    flat_input_ids_accepted=True,  # every release reads 1D input_ids as one row (view(-1, length))
)
