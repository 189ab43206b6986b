"""OPT's adapter: how its decoder's forward, config and cache read on each transformers release.

Imported when transformers loads OPT's modeling module (so torch and transformers are loaded already).

Measured with tiny random models, vanilla transformers 4.26 - 5.24:

* Learned absolute positions, but OPT derives them from the mask itself (``cumsum(mask) - 1``, shifted by the
  table's offset of 2): left padding takes no positions, so a left-padded batch is right without any.  From 4.48 the
  decoder also takes ``position_ids`` (given ones are compared with the mask's; stale ones are dropped and the
  decoder derives them).
* Over a ``StaticCache`` (4.49 and later) a mask wider than the tokens so far fails inside transformers (the
  positions derived from every column, less the cache's tokens, outnumber the new tokens): the core gives OPT the
  tokens so far where their count is known (``Positions.MASK``).
* The table has ``max_position_embeddings`` rows for real tokens (plus the 2 of the offset): a row of more real
  tokens fails with ``IndexError: index out of range in self``.  Left padding does not count, so whether a step
  overflows depends on the mask's values: neofix sets no limit up front (a padded batch may run past the table in
  columns, and vanilla completes it) and names the overflow when the lookup fails.
* No ``token_type_ids``.  1D ``input_ids`` fail up to 4.48 and are read as one row from 4.53.
* Caches hold keys ``(batch, heads, tokens, head_dim)``: tuples up to 4.56, ``DynamicCache`` from 4.57; tuples are
  converted up to 4.53 and fail from 4.54 (``'tuple' object has no attribute 'get_seq_length'``).
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from .._core import Positions
from .._errors import SequenceTooLongError
from . import OPT
from ._contract import Adapter, make_layers, make_limits


def explain_overflow(cause: IndexError, config: Any, mask: Any, positions: Any, past: int | None) -> None:
    """Turn the ``IndexError`` of OPT's position lookup into :class:`SequenceTooLongError`, when a row holds more real
    tokens (or a given position reaches further) than ``config.max_position_embeddings``.  Runs only after the
    lookup failed: reading the mask then costs nothing that matters.  Returns when that was not the cause."""
    size = config.max_position_embeddings
    if mask is not None and mask.dim() == 2:
        real = mask.long().sum(-1)
        row = int(real.argmax())
        most = int(real[row])
        if most > size:
            error = SequenceTooLongError(
                f"row {row} of this step holds {most} real tokens (the mask's ones, cached and new), but OPT's "
                f"config.max_position_embeddings is {size}: OPT gives every real token a position (left padding "
                f"takes none), so at most {size} real tokens fit in a row; shorten the prompt or generate fewer tokens"
            )
            error.past, error.total, error.max_positions = past, most, size
            raise error from cause
    if positions is not None and positions.numel() and int(positions.max()) >= size:
        error = SequenceTooLongError(
            f"position_ids reach {int(positions.max())}, but OPT's config.max_position_embeddings is {size}: "
            f"positions must lie in [0, {size - 1}]; pass none and OPT derives them from the mask"
        )
        error.past, error.total, error.max_positions = past, int(positions.max()) + 1, size
        raise error from cause


ADAPTER = Adapter(
    family=OPT,
    positions=Positions.MASK,  # absolute positions the model derives from the mask
    # no limit in columns (max_positions None): see the module's docstring and explain_overflow
    limits=make_limits(table=None, width="hidden_size", heads="num_attention_heads"),
    layers=make_layers("layers"),  # OPTDecoder's blocks
    legacy_cache_rejected=_compat.release() >= (4, 54),  # measured: 4.53 converts tuples, 4.54 fails
    # 1D input_ids: 4.26 - 4.27 read a one-token one as one row (longer ones fail inside: transformers' own error,
    # passed on), 4.28 - 4.48 fail on every one, 4.53 reads them as one row
    flat_input_ids_accepted=_compat.release() < (4, 28) or _compat.release() >= (4, 53),
    explain_overflow=explain_overflow,
)
