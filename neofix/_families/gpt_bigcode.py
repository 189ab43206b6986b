"""GPT-BigCode's adapter (StarCoder, SantaCoder): how its forward, config and cache read on each transformers release.

Imported when transformers loads GPT-BigCode's modeling module (so torch and transformers are loaded already).

Measured with tiny random models (``tiny_model("gpt_bigcode")``, multi-query attention, and the same with
``multi_query=False``), vanilla transformers 4.30, 4.36, 4.38, 4.40, 4.45, 4.53, 4.54, 4.55, 4.57, 5.0, 5.10 and
5.25 (neofix patches it from 4.30, the first release of the test matrix that has it; 4.28 - 4.29 are left as
transformers has them):

* Learned absolute positions from a table of ``n_positions`` rows (``wpe``), as GPT-2's.  Up to 4.53 the base model
  derives missing positions from a 2D mask itself, as OPT does (``cumsum(mask) - 1`` over every column, sliced after
  the cache's length, pads at 1): a left-padded loop that extends its mask decodes right without positions, and
  neofix leaves them to it (``Positions.MASK``: vanilla's logits bit for bit, pads included); the prompt's mask at
  every step (not extended) fails (``The size of tensor a (7) must match the size of tensor b (6)``), given positions
  that count the padding decode wrong tokens.  Its ``generate`` drops ``position_ids`` given with a mask (its own
  ``prepare_inputs_for_generation``).  From 4.54 missing positions are the columns (``cache_position``; on 5.x
  ``arange`` after the cache), as GPT-2's: a left-padded row decodes wrong unless its positions start at its first
  real token, and neofix derives them from the mask (``Positions.ABSOLUTE``).  A sequence past the table fails
  (``IndexError: index out of range in self``; on an accelerator a device-side assert).
* Up to 4.53 the forward slices a causal buffer of ``n_positions`` columns: a step of more cached plus new tokens
  than the table fails on a size mismatch, whatever its positions.  From 4.54 it builds its mask with
  ``create_causal_mask`` and keeps no such buffer (eager and sdpa): a left-padded batch wider than the table whose
  positions fit runs right (``tests/test_wider_than_table.py``; flash attention, not measurable on the CPU, is
  refused on its columns as before).
* 4.36 - 4.38: the sdpa path (the default) unmasks the rows of left-padding queries as if a step of several tokens
  started the sequence: a left-padded chunk after a cache decodes wrong tokens or fails (``IndexError``).  neofix
  replaces that unmasking (:func:`make_unmask_converter`); 4.39 unmasks the rows every key of which is masked (read
  in the 4.37 - 4.39 sources).
* Up to 4.53 its cache is its own: a list of one fused key-value tensor per layer, ``(batch, tokens, 2 * head_dim)``
  with multi-query attention (``multi_query=True``, the default: one key-value head) or ``(batch, heads, tokens, 2 *
  head_dim)`` without, which the forward reads as ``past_key_values[0].size(-2)`` (:func:`read_fused`); a ``Cache``
  object or ``(key, value)`` pairs fail there, and transformers refuses contrastive search over it ("does not have
  a standard cache format").  From 4.54 a ``Cache`` object of the usual layout, ``(batch, 1, tokens,
  head_dim)`` with multi-query attention: 4.54 - 4.56 return legacy tuples of ``(key, value)`` pairs where given
  none, 4.57 an ``EncoderDecoderCache`` wrapping a ``DynamicCache`` (read through its self-attention cache; its
  cross-attention cache stays empty), 5.x a ``DynamicCache``.  Tuples of pairs are converted up to 4.57; 5.0 fails on
  them (``'tuple' object has no attribute 'get_seq_length'``): repair mode wraps them.
  ``generate(cache_implementation="static")`` decodes the reference's tokens on 4.45, 4.57 and 5.25 and is refused
  by transformers on 4.55 ("This model does not support cache_implementation='static'"), vanilla and patched alike.
* ``token_type_ids`` are embedded with the token embedding (``wte``): past the vocabulary an ``IndexError``.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _caches, _compat
from .._core import CacheView, Limits, Positions
from .._compat import is_tracing
from .._errors import InputShapeError
from . import GPT_BIGCODE
from ._contract import Adapter, attention_of, make_layers

#: Up to 4.53 the cache is one fused key-value tensor per layer (its keys and values concatenated on the last
#: dimension, tokens on the one before); from 4.54 a ``Cache`` object of ``(batch, heads, tokens, head_dim)`` keys.
FUSED_CACHE = _compat.release() < (4, 54)


#: Learned absolute positions.  Up to 4.53 the forward derives missing ones from a 2D mask itself, from every column
#: it is given (``cumsum(mask) - 1`` after the cache's length, pads at 1), as OPT does: left to it.  From 4.54 it
#: takes its columns for missing ones: neofix derives them from the mask.
POSITIONS = Positions.MASK if FUSED_CACHE else Positions.ABSOLUTE


def limits(config: Any) -> Limits:
    """The table of ``n_positions`` rows, and the layout of the cache the model writes: one key-value head with
    multi-query attention (``config.multi_query``), else ``n_head``, each ``n_embd // n_head`` wide.  From 4.54 only
    the positions looked up are bounded by the table (eager and sdpa keep no causal buffer of its width)."""
    heads, width = config.n_head, config.n_embd
    return Limits(
        max_positions=config.n_positions,
        vocab_size=config.vocab_size,
        hidden_size=width,
        heads=1 if config.multi_query else heads,
        head_dim=width // heads,
        wider_than_table=not FUSED_CACHE and attention_of(config) in ("eager", "sdpa"),
    )


def read_cache(cache: Any, layer_count: int) -> CacheView:
    """What the cache holds: up to 4.53 a list (or tuple) of fused tensors (:func:`read_fused`), and nothing else (the
    forward indexes its cache by layer and reads a tensor: a ``Cache`` object fails, ``'StaticCache' object is not
    subscriptable``, refused here naming it); 4.57's ``EncoderDecoderCache`` through the ``DynamicCache`` of its
    self-attention (its cross-attention cache stays empty); else the usual reading."""
    if FUSED_CACHE:
        if type(cache) is tuple or type(cache) is list:
            return read_fused(cache, int(layer_count))
        raise InputShapeError(
            f"the cache is a {type(cache).__name__}, but GPT-BigCode's forward on transformers "
            f"{_compat.transformers_version()} takes only the list it returns, one tensor per layer fusing its keys "
            f"and values ((batch, tokens, 2 * head_dim) with multi-query attention), and no Cache object. Pass the "
            f"cache the model returned, or none (the prompt is then encoded again)"
        )
    inner = getattr(cache, "self_attention_cache", None)
    return _caches.read(inner if inner is not None else cache, layer_count)


def read_fused(cache: Any, layers: int) -> CacheView:
    """A GPT-BigCode cache of transformers up to 4.53: per layer one tensor ``(batch, tokens, 2 * head_dim)`` (one
    key-value head, multi-query attention) or ``(batch, heads, tokens, 2 * head_dim)``.  A cache of ``(key, value)``
    pairs (the layout of 4.54 and later), which the forward fails on, is refused naming both layouts."""
    first = cache[0] if cache else None
    if first is None:  # no cache, or (None,) * layers
        return CacheView(0, None, (0,) * layers if cache else None, None, None, None, "legacy")
    if not isinstance(first, torch.Tensor):
        raise InputShapeError(
            f"the cache holds a {type(first).__name__} per layer: the (key, value) pairs of transformers 4.54 and "
            f"later, but GPT-BigCode's forward on transformers {_compat.transformers_version()} takes one fused "
            f"key-value tensor per layer, (batch, tokens, 2 * head_dim) with multi-query attention. Pass the cache "
            f"the model returned, or none (the prompt is then encoded again)"
        )
    lengths = [
        layer.shape[-2] if isinstance(layer, torch.Tensor) and layer.dim() >= 2 else 0 for layer in cache[:layers]
    ]
    lengths += [0] * (layers - len(lengths))
    shape = first.shape
    if first.dim() not in (3, 4):
        return CacheView(lengths[0], None, tuple(lengths), None, None, None, "legacy")
    heads = 1 if first.dim() == 3 else shape[1]
    return CacheView(lengths[0], shape[0], tuple(lengths), None, heads, shape[-1] // 2, "legacy")


def make_unmask_converter(original: Any, _adapter: Any) -> Any:
    """``AttentionMaskConverter`` as GPT-BigCode's modeling module imported it on transformers 4.36 - 4.38, whose sdpa
    path calls its ``_unmask_unattended(mask, attention_mask, True)`` on every step of several tokens.

    That helper lets the rows of left-padding queries attend to every key (for sdpa's memory-efficient kernel),
    counting those rows as if the step started the sequence: after a cache it unmasks the rows of real tokens (wrong
    tokens, no error) or indexes past the step (``IndexError: index 3 is out of bounds``), vanilla transformers
    alike.  The replacement unmasks, after a cache, the rows the same helper unmasks in one forward without a cache
    (the queries at columns before their row's first real token), so that a chunk after a cache computes what the
    whole sequence does; without a cache it is transformers' own."""
    from .. import _wrappers

    unmask = original._unmask_unattended

    def _unmask_unattended(expanded_mask: Any, attention_mask: Any, unmasked_value: Any) -> Any:
        queries, keys = expanded_mask.shape[-2], expanded_mask.shape[-1]
        if expanded_mask.dim() != 4 or attention_mask.dim() != 2 or queries >= keys or is_tracing(attention_mask):
            return unmask(expanded_mask, attention_mask, unmasked_value)
        columns = attention_mask.shape[1]
        first = torch.argmax(attention_mask * torch.arange(columns, 0, -1, device=attention_mask.device), 1)
        rows = torch.arange(keys - queries, keys, device=first.device)[None, :] < first[:, None]  # (batch, queries)
        return expanded_mask.masked_fill(rows[:, None, :, None].to(expanded_mask.device), unmasked_value)

    converter = type(original.__name__, (original,), {"_unmask_unattended": staticmethod(_unmask_unattended)})
    converter.__module__, converter.__qualname__ = __name__, original.__qualname__
    converter.__wrapped__ = original  # (as every wrapper's: what it replaced)
    return _wrappers._mark(converter)


ADAPTER = Adapter(
    family=GPT_BIGCODE,
    positions=POSITIONS,
    limits=limits,
    layers=make_layers("h"),  # GPTBigCodeModel's blocks
    read_cache=read_cache,
    legacy_cache_rejected=_compat.release() >= (5, 0),  # measured: 4.57 converts tuples of pairs, 5.0 fails
    # 1D input_ids are read as one row up to 4.57 (4.36 - 4.53 fail on them where config.pad_token_id is set and no
    # mask is given, "too many indices for tensor of dimension 1": transformers' own, passed on); 5.x fails on every
    # one (an IndexError; from 5.10 a size mismatch)
    flat_input_ids_accepted=_compat.release() < (5, 0),
)
