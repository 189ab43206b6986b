"""Gemma2's adapter (transformers 4.42 and later).

Rotary positions, grouped-query attention, ``head_dim`` from the config, no position table (as
:mod:`neofix._families.llama`), and sliding-window layers (window ``config.sliding_window``) alternating with global
ones; measured on 4.45, 4.57 and 5.24 with ``neofix.testing.tiny_model("gemma2")``.

* Up to 4.52 ``Gemma2Model.forward`` given no cache builds a static ``HybridCache`` as long as the prompt: a hand
  loop's next step does not fit (vanilla: a shape ``RuntimeError``; neofix: the core's ``CacheLengthError``, a 2D mask
  wider than a static cache's slots).  From 4.53 it builds a ``DynamicCache`` (read in the 4.50.3 and 4.53.3 sources).
* Up to 4.47 the ``HybridCache`` decodes left-padded rows wrong: ``get_seq_length`` counts row 0's non-zero key
  slots, and the sliding layers take the mask's first columns instead of the window's (transformers PR 35681, in
  4.48: read in the 4.48.3 source).  Measured on 4.45: ``generate`` of a left-padded batch gives the padded rows
  wrong tokens from the first cached step on (float32).  :func:`check_step` refuses such a prefill into a
  ``HybridCache`` there, before anything is computed (generate's, or one a hand loop passes).
* Up to 4.52 the sliding-window layers read a growing cache (a ``DynamicCache`` or tuples a hand loop passes) that
  would hold more tokens than the window wrong: 4.45 - 4.47 give wrong tokens from the first such step, without an
  error, and 4.48 - 4.52 fail inside attention on shapes (measured on each, eager and sdpa; right from 4.53).
  :func:`check_past_window` refuses that step with ``AttentionWindowError`` before anything runs (Gemma3's 4.50 -
  4.52 too).
* Not covered (measured on 4.45 and 4.47 - 4.52: wrong on 4.45 - 4.51, right from 4.52): an unpadded prompt
  shorter than the window, decoded past the window with a ``HybridCache`` (``generate``'s), gives every row wrong
  tokens from the first token fed past the window.  Telling that step
  apart needs the step's position, which only a value read or per-cache state would give.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _caches, _compat
from .._core import CacheView, Positions
from .._errors import AttentionWindowError, MaskValueError
from . import GEMMA2
from ._contract import Adapter, make_layers, no_check, read_window_cache
from .llama import rotary_limits

#: transformers' HybridCache decodes left-padded rows wrong before 4.48 (PR 35681)
HYBRID_CACHE_MISREADS_LEFT_PADDING = _compat.release() < (4, 48)
#: the sliding-window layers read a growing cache of more tokens than the window wrong before 4.53
GROWING_CACHE_MISREAD_PAST_WINDOW = _compat.release() < (4, 53)


def check_step(model: Any, cache: CacheView, call: dict) -> None:
    """The checks of this release (installed only where one applies: nothing from 4.53)."""
    check_past_window(model, cache, call)
    if HYBRID_CACHE_MISREADS_LEFT_PADDING:
        check_hybrid_prefill(model, cache, call)


def check_past_window(model: Any, cache: CacheView, call: dict) -> None:
    """Refuse a step over a growing cache (``DynamicCache``, tuples) whose cached and new tokens would pass
    ``config.sliding_window``, where the release's sliding-window layers read it wrong (up to 4.52)."""
    past, window = cache.length, getattr(model.config, "sliding_window", None)
    new = _new_tokens(call)
    if cache.layout not in ("object", "legacy") or not past or not isinstance(window, int) or new is None:
        return
    if past + new <= window:
        return
    release = _compat.transformers_version()
    outcome = "wrong tokens, without an error" if _compat.release() < (4, 48) else "a size error inside attention"
    raise AttentionWindowError(
        f"this step attends over {past + new} tokens (the cache holds {past}), past the sliding window of "
        f"{window} (config.sliding_window), and on transformers {release} the sliding-window layers read a "
        f"{type(_caches.of_call(call)[1]).__name__} that holds more than the window wrong ({outcome}; right from 4.53). Decode "
        f"with generate(), or pass a HybridCache with room for the whole sequence (max_cache_len) from the first step, "
        f"or upgrade transformers to 4.53 or later"
    )


def _new_tokens(call: dict) -> int | None:
    """The step's new tokens (its ``input_ids``' or ``inputs_embeds``' columns), ``None`` where neither is 2D+."""
    first = call.get("input_ids")
    if first is None:
        first = call.get("inputs_embeds")
    return None if first is None or first.dim() < 2 else first.shape[1]


def check_hybrid_prefill(model: Any, cache: CacheView, call: dict) -> None:
    """Refuse, where the release's ``HybridCache`` misreads left padding, a prefill of left-padded rows into one (the
    cache ``generate`` makes for Gemma2, or one a hand loop passes): its first token would be right, later ones of a
    padded row wrong (measured in float32; float64 happens to survive), once the sequence passes the window: a cache of
    no more slots than ``config.sliding_window`` is let through (within the window vanilla is right).  Read on
    prefills only (the cache's own length
    is a tensor, not read): a 2D mask as wide as the new tokens, or the 4D mask ``generate`` builds for a static cache
    on a step of several new tokens (its last query's row: a column of the step it does not attend to is a pad)."""
    mask = call.get("attention_mask")
    if cache.layout != "static" or mask is None:
        return
    window = getattr(model.config, "sliding_window", None)
    if isinstance(window, int) and cache.capacity is not None and cache.capacity <= window:
        return  # no step fits past the window, within which the sliding layers read the mask right
    new = _new_tokens(call)
    if new is None:
        return
    if mask.dim() == 2 and mask.shape[1] == new:
        padded = (mask[:, 1:].long() > mask[:, :-1].long()).any(-1)
    elif mask.dim() == 4 and new > 1:
        last = mask[:, 0, -1, :new]
        padded = (~last if last.dtype == torch.bool else last != 0).any(-1)
    else:
        return
    fixed = "fixed in transformers 4.48, PR 35681"
    rows = padded.nonzero().flatten().tolist()
    if not rows:
        return
    named = f"row {rows[0]} is" if len(rows) == 1 else f"rows {', '.join(map(str, rows))} are"
    raise MaskValueError(
        f"{named} left-padded, and Gemma2's HybridCache on transformers {_compat.transformers_version()} decodes "
        f"left-padded rows wrong after the first new token (it counts the cache's length from row 0 and its sliding "
        f"layers read the mask's first columns; {fixed}). Upgrade transformers to 4.48 or later, or decode rows of "
        f"the same length together (no padding)"
    )


ADAPTER = Adapter(
    family=GEMMA2,
    positions=Positions.ROTARY,
    limits=rotary_limits(),  # the config's head_dim on every release
    layers=make_layers("layers", run="num_hidden_layers"),
    read_cache=read_window_cache,
    check_step=check_step if GROWING_CACHE_MISREAD_PAST_WINDOW else no_check,
    legacy_cache_rejected=_compat.release() >= (4, 48),
)
