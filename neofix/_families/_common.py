"""What the adapters share: limits read from config attributes, the layer count, and no check of their own.

Imported by the adapters (so torch and transformers are loaded already).
"""

from __future__ import annotations

from typing import Any, Callable

from .. import _caches
from .._core import CacheView, Limits

#: The cache reader of every family whose caches hold keys ``(batch, heads, tokens, head_dim)``.
read_cache: Callable[[Any, int], CacheView] = _caches.read


def make_limits(*, table: str | None, width: str, heads: str) -> Callable[[Any], Limits]:
    """``limits(config)`` from the names of the config's attributes: the position table's size (``None``: no table
    that running past is an error), the hidden width and the head count."""

    def limits(config: Any) -> Limits:
        count, size = getattr(config, heads), getattr(config, width)
        return Limits(
            max_positions=getattr(config, table) if table is not None else None,
            vocab_size=config.vocab_size,
            hidden_size=size,
            heads=count,
            head_dim=size // count,
        )

    return limits


def make_layers(attribute: str) -> Callable[[Any], int]:
    """``layers(model)``: the number of attention layers, each reading one layer of the cache (``model.<attribute>``
    is the base model's list of blocks)."""

    def layers(model: Any) -> int:
        return len(getattr(model, attribute))

    return layers


def no_check(model: Any, cache: CacheView) -> None:
    """Nothing of the family's own to refuse: its attention has no window."""
