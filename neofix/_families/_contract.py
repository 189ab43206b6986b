"""The contract between the family-neutral wrappers and one model family: :class:`Adapter`.

Every family module of this package declares one ``ADAPTER``; the wrappers read a family only through it.  Adding
a family is one module that declares its :class:`~neofix._families.Family` (in ``__init__``'s registry) and its
``ADAPTER``; nothing in :mod:`neofix._core` or :mod:`neofix._wrappers` changes.  A family whose models differ in what
positions mean to them, by their config (Falcon: ALiBi or rotary), says so with ``positions_of``: the model forward
reads each model through the adapter of its kind (:func:`for_model`).

Imported by the adapters only (torch and transformers are loaded already).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .. import _caches
from .._core import CacheView, Limits, Positions

from . import Family


def read_window_cache(cache: Any, layers: int) -> CacheView:
    """What a cache holds (:func:`neofix._caches.read`), for a family with sliding-window layers (Mistral, Gemma2,
    Gemma3): a static cache of sliding-window layers (5.x, as ``generate(cache_implementation="static")`` builds)
    has as many slots as the window, but the 4D mask transformers builds spans the prefill's own keys where the
    prefill is longer; which width a step's mask has is the layer's business, so no capacity is given to check it
    against (the mask is used as given).  The window itself is checked by the attention against the cache it is
    given (its 4D mask, or its sliding-window cache layers that keep the window's keys and count every token)."""
    view = _caches.read(cache, layers)
    if view.capacity is not None and any("SlidingWindow" in type(layer).__name__ for layer in _cache_layers(cache)):
        return view._replace(capacity=None)
    return view


def _cache_layers(cache: Any) -> list:
    cache_layers = getattr(cache, "layers", None)
    return cache_layers if isinstance(cache_layers, list) else [cache]


def no_check(model: Any, cache: CacheView, call: dict) -> None:
    """Nothing of the family's own to refuse (its attention has no window the cache could break)."""


@dataclass(frozen=True)
class Adapter:
    """How neofix reads one family's forward, config and cache on the installed transformers release.

    Every field is a fact of the family on that release, measured on tiny random models (each family module says
    where and how); the wrappers decide nothing per family but what these say.
    """

    #: The declaration: modeling module, base model and causal-LM classes, the attributes neofix replaces.
    family: Family
    #: What positions mean to the family (learned table, mask-derived, rotary, none): how alignment treats them.  For a
    #: family whose config decides (``positions_of``), what they mean to its usual config.
    positions: Positions
    #: ``limits(config)``: the position table's size (``None`` where running past it is no error), vocabulary,
    #: hidden width, heads and head width, read from the model's config.
    limits: Callable[[Any], Limits]
    #: ``layers(model)``: the base model's attention layers, each reading one layer of the cache.
    layers: Callable[[Any], int]
    #: ``read_cache(cache, layers)``: what a cache holds (:class:`~neofix._core.CacheView`), from shapes alone.
    read_cache: Callable[[Any, int], CacheView] = _caches.read
    #: ``check_step(model, view, call)``: the family's own refusal of a cache its attention would read wrong, or of
    #: inputs its cache would read wrong (raises).  ``call``: the forward's arguments by name, as given (never
    #: changed); read tensors' values only on a prefill (which reads its values anyway), never on a decode step.
    check_step: Callable[[Any, CacheView, dict], None] = no_check
    #: The forward rejects legacy tuple caches on this release: repair mode wraps them in a ``DynamicCache``.
    legacy_cache_rejected: bool = False
    #: The forward reads 1D ``input_ids`` as one row on this release: such a call is passed on untouched.
    flat_input_ids_accepted: bool = False
    #: ``held_cache(model)``: the cache the model's attention layers hold themselves, read where the forward is given
    #: none (Llama 4.38 - 4.40: ``generate(cache_implementation="static")`` sets a ``StaticCache`` on every attention
    #: layer and passes ``past_key_values=None``); ``None`` for a family whose layers hold none.
    held_cache: Optional[Callable[[Any], Any]] = None
    #: ``explain_overflow(error, config, mask, positions, past)``: for a family whose position limit depends on the
    #: mask's values (OPT), turns the lookup's ``IndexError`` into :class:`~neofix.SequenceTooLongError` (raises).
    explain_overflow: Optional[Callable[..., None]] = None
    #: ``positions_of(config)``: what positions mean to one model, for a family whose config decides (Falcon: ALiBi,
    #: built from the mask, where ``config.alibi``; else rotary); the model forward reads the adapter of that kind in
    #: place of this one (:func:`for_model`, once per call).  ``None``: ``positions`` hold for every model.
    positions_of: Optional[Callable[[Any], Positions]] = None


#: (id of an adapter, a kind of positions) -> (the adapter, its copy with that kind): made once each (adapters live as
#: long as their modules)
_OF_KIND: dict[tuple[int, Positions], tuple[Adapter, Adapter]] = {}


def for_model(adapter: Adapter, config: Any) -> Adapter:
    """The adapter as a model of ``config`` reads: ``adapter`` itself, or, where its ``positions_of`` gives that model
    another kind of positions than its ``positions``, its copy with that kind (every other fact the same)."""
    kind = adapter.positions_of(config) if adapter.positions_of is not None else adapter.positions
    if kind is adapter.positions:
        return adapter
    made = _OF_KIND.get((id(adapter), kind))
    if made is None:
        made = _OF_KIND[id(adapter), kind] = (adapter, dataclasses.replace(adapter, positions=kind))
    return made[1]


def make_limits(
    *, table: str | None, width: str, heads: str, wider_than_table: Callable[[Any], bool] | None = None
) -> Callable[[Any], Limits]:
    """``limits(config)`` from the names of the config's attributes: the position table's size (``None``: no table
    that running past is an error), the hidden width and the head count; ``wider_than_table(config)``: whether only
    the positions looked up are bounded by the table (see :class:`~neofix._core.Limits`; ``None``: never)."""

    def limits(config: Any) -> Limits:
        count, size = getattr(config, heads), getattr(config, width)
        return Limits(
            max_positions=getattr(config, table) if table is not None else None,
            vocab_size=config.vocab_size,
            hidden_size=size,
            heads=count,
            head_dim=size // count,
            wider_than_table=wider_than_table is not None and wider_than_table(config),
        )

    return limits


def attention_of(config: Any) -> str:
    """The attention implementation a model runs (``config._attn_implementation``; before 4.36, which has none,
    eager)."""
    return getattr(config, "_attn_implementation", None) or "eager"


def make_layers(attribute: str, run: str | None = None) -> Callable[[Any], int]:
    """``layers(model)``: the number of attention layers a forward runs (``model.<attribute>`` is the base model's
    blocks).  ``run``: the config's count of them, where the forward runs only that many of its blocks (the modern
    decoders from 4.47: ``generate(assistant_early_exit=k)`` drafts with the first ``k``, and the cache of those
    drafts holds nothing in the others)."""

    def layers(model: Any) -> int:
        blocks = model._modules.get(attribute)  # (a submodule: read where nn.Module keeps it, without __getattr__)
        count = len(blocks if blocks is not None else getattr(model, attribute))
        if run is None:
            return count
        limit = getattr(model.config, run, None)
        return min(count, limit) if type(limit) is int else count

    return layers
