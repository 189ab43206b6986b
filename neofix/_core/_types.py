"""The values the core passes around: what a step was given, what its cache holds, what the model allows, and what
alignment made of it.  Plain ``NamedTuple`` s of tensors and ints: nothing here reads a tensor's values."""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import torch

# Repair kinds: the names traces list in ``repairs`` and warnings are remembered by (each is warned once).
MASK_EXTENDED = "mask_extended"
POSITIONS_DERIVED = "positions_derived"  # none were given: derived from the mask (warned once where it changes a
# forward without a cache: left padding, where transformers' own positions count the pads)
POSITIONS_SLICED = "positions_sliced"  # positions of cached plus new tokens: the last q taken (not warned)
POSITIONS_REDERIVED = "positions_rederived"  # positions of another length (stale): derived from the mask instead
POSITION_VALUES = "position_values_repaired"  # a cached step's positions disagree with the mask: the mask's used
POSITIONS_COUNT_PADDING = "positions_count_padding"  # prefill: arange over a left-padded row; re-derived
TOKEN_TYPES_SLICED = "token_type_ids_sliced"
CACHE_POSITION_DROPPED = "cache_position_dropped"
CACHE_POSITION_VALUES = "cache_position_repaired"  # cache_position not arange(p, p + q) after a cache: replaced
MASK_SLICED = "mask_sliced"  # a mask longer than cached plus new tokens whose every reading agrees: sliced (silent)


def is_integer(dtype: Any) -> bool:
    """Whether a tensor of ``dtype`` holds integers (indices into a table): not floating point, complex or bool.
    (torch's integer dtypes are looked up in a set first: one check on every step, which dynamo traces as a constant.)"""
    return dtype in _INTEGERS or not (dtype.is_floating_point or dtype.is_complex or dtype is torch.bool)


_INTEGERS = frozenset(
    value
    for value in vars(torch).values()
    if isinstance(value, torch.dtype) and not (value.is_floating_point or value.is_complex or value is torch.bool)
)


class Positions(enum.Enum):
    """What positions mean to a model family (its adapter's ``positions``), and so what alignment does with them.

    * ``ABSOLUTE`` (GPT-Neo, GPT-2): looked up in a table, so their values matter on their own.  Missing ones are
      derived from the mask; given ones are compared with the mask's; stale ones are derived again.  After a cache
      whose prompt was given the mask's plus one number (``CacheView.built`` an :class:`Offset`), those instead:
      given ones are judged as rotary ones are against them, missing ones derived as them.
    * ``MASK`` (OPT): absolute, but the model derives missing ones from the mask itself, from every column it is
      given.  Given ones are compared with the mask's (after an offset prompt, as ``ABSOLUTE``); stale ones are
      dropped (the model derives them); a static cache's mask read by slot is passed on as its tokens so far, where
      their count is known.
    * ``ROTARY`` (GPT-J, CodeGen, GPT-NeoX, Llama and the modern decoders): only differences matter, so
      transformers' own positions (which count left padding) are as right as the mask's, and a cache built with
      either must be continued with the same: missing positions are left to the model; given ones are left as they
      are where they are either scheme's (only the scheme the cache was built with, where its prompt told it:
      ``CacheView.built``), and after a cache repaired where they are not (positions that do not advance, see
      :func:`~neofix._core._values.rotary_truth`); stale ones cannot be told apart from either scheme:
      an error.  After a cache built with the mask's positions, missing ones are derived from the mask (transformers'
      own, the columns, would not continue it), and after one built with the mask's plus an offset, those; after one
      built with positions of no scheme (offsets that differ by row, say), the steps' positions are left as given, as
      vanilla does.
    * ``NONE`` (BLOOM; Falcon's ALiBi models, by their config): the model reads no positions (its ALiBi comes from
      the mask; Falcon's forward takes them and never reads them); they are left alone.
    """

    ABSOLUTE = "absolute"
    MASK = "mask"
    ROTARY = "rotary"
    NONE = "none"

    def __init__(self, value: str) -> None:
        # What each kind means, as member attributes: a step reads them where ``kind is Positions.X`` would look the
        # member up on the class (an enum's class attribute costs several times an instance attribute).
        #: Whether the model takes positions at all.
        self.taken = value != "none"
        #: Whether given positions are compared with the mask's (their values are looked up in a table).
        self.compared = value in ("absolute", "mask")
        #: Whether missing positions are derived from the mask (neofix's; ``MASK`` families derive their own).
        self.derived = value == "absolute"
        #: Whether only differences of positions matter (given ones after a cache are judged by ``rotary_truth``).
        self.rotary = value == "rotary"


class Offset(NamedTuple):
    """A cache built with positions off from a scheme's by one number (:attr:`CacheView.built`; of a family with a
    position table, from the mask's alone): ``by`` that
    number; ``told``: its prompt had a pad before a real token, so the positions were the mask's plus ``by`` (else
    the mask's and the columns agreed there, and either plus ``by`` continues the cache)."""

    by: int
    told: bool


class CacheView(NamedTuple):
    """What a step's KV cache holds, read once per step from shapes alone (never a tensor's values).

    ``length``: tokens held (0 without a cache; ``None`` when it cannot be told without reading the device, as for a
    static cache).  ``batch``: rows (``None`` for an empty cache).  ``layer_lengths``: tokens held per layer the
    model will read (``None`` entries where one cannot be told).  ``capacity``: slots of a fixed-size cache (static),
    ``None`` for one that grows.  ``heads`` and ``head_dim``: the layout of its keys, to tell a cache built by another
    model.  ``layout``: ``"none"``, ``"legacy"`` (tuples), ``"object"`` (a transformers ``Cache``), ``"static"`` or
    ``"unknown"``.
    """

    length: int | None
    batch: int | None
    layer_lengths: tuple[int | None, ...] | None
    capacity: int | None
    heads: int | None
    head_dim: int | None
    layout: str
    #: The positions its tokens were given, where its caller saw a rotary family's prompt build it: ``BY_COLUMNS``,
    #: transformers' own, each its column (left padding counted: the prompt was given none, or those); ``BY_MASK``, the
    #: mask's (the prompt was given them, and a row with a pad before a real token tells them from the columns);
    #: an :class:`Offset`, the mask's plus one number on every real token of every row (the caller's offset, which
    #: the steps continue); ``BY_GIVEN``, none of these (the caller's own, which only the caller can continue);
    #: ``None``: not known (no prompt seen, or one whose positions agree with both schemes).
    built: str | Offset | None = None


NO_CACHE = CacheView(0, None, None, None, None, None, "none")


class Limits(NamedTuple):
    """What the model allows, read from its config.

    ``max_positions``: size of the position table (``None``: positions are not looked up in a table, or reading past
    it is not an error).  ``heads`` / ``head_dim``: the cache layout the model writes (``None``: not checked).
    ``wider_than_table``: only the positions looked up are bounded by the table, not the cached plus new tokens (the
    attention keeps no buffer of ``max_positions`` columns): a left-padded step wider than the table runs right
    while its positions fit, and its positions are read to tell (see :func:`~neofix._core._align.check_cache`).
    ``unused_head_dim``: a config ``head_dim`` other than ``head_dim`` that this release's attention does not read
    (where the static cache transformers builds does: the error of such a cache names it), else ``None``.
    """

    max_positions: int | None
    vocab_size: int
    hidden_size: int
    heads: int | None = None
    head_dim: int | None = None
    wider_than_table: bool = False
    unused_head_dim: int | None = None


class StepInputs(NamedTuple):
    """The tensors one model forward was given (``None`` where not given)."""

    input_ids: Any
    inputs_embeds: Any
    attention_mask: Any
    position_ids: Any
    token_type_ids: Any = None
    cache_position: Any = None


class Policy(NamedTuple):
    """How to align a step: the settings in force and what the caller knows about where the step comes from.

    ``strict``: raise instead of repairing.  ``check_values``: read token ids and position ranges on every step.
    ``trusted_positions``: the positions were built from the mask by transformers' generate (no need to compare).
    ``compiling``: inside ``torch.compile``: shapes only, nothing read off the device, nothing reported.
    ``uncached_positions``: ``"mask"`` derives the positions of a left-padded forward without a cache from the mask;
    ``"transformers"`` leaves transformers' own there.  ``positions``: what positions mean to the model family
    (:class:`Positions`).  ``pads_masks``: the model's attention pads a 2D mask to the keys it attends to (eager,
    sdpa), so a mask may be widened to a static cache's slots; flash attention instead keeps as many keys as the
    mask has columns.
    """

    strict: bool = False
    check_values: bool = False
    trusted_positions: bool = False
    compiling: bool = False
    uncached_positions: str = "mask"
    positions: Positions = Positions.ABSOLUTE
    pads_masks: bool = True


#: What a repaired position after a cache is taken from (a :class:`Report`'s ``truth``): the attention mask; the mask
#: shifted by the row's leading pads, where the cache holds transformers' own positions (a rotary prompt given none,
#: its real tokens at their columns); or, with no mask, the count of tokens.  The first two also name the positions a
#: rotary cache was built with (:attr:`CacheView.built`), beside a third: positions of neither scheme, the caller's own.
#: ``BY_OFFSET``: a scheme's plus a number (a cache built with them: ``built`` is an :class:`Offset`).
BY_MASK, BY_COLUMNS, BY_COUNT, BY_GIVEN, BY_OFFSET = "mask", "columns", "count", "given", "offset"


class Report(NamedTuple):
    """A decode step's position repair, made on the device without reading it back: ``wrong`` (rows whose position
    disagreed with the mask), what was ``given`` and the ``derived`` position, all of shape (batch, 1).  The caller
    reads it when that costs nothing (at once on the CPU; on an accelerator once a non-blocking copy has landed)."""

    wrong: Any
    given: Any
    derived: Any
    past: int | None
    truth: str = BY_MASK  # what ``derived`` was taken from (BY_MASK, BY_COLUMNS or BY_COUNT)


class Repair(NamedTuple):
    """Something alignment changed.  ``message`` is the warning to show once per kind ("" for silent adjustments), or
    a function returning it (called only if that kind has not been reported yet: building it may read values)."""

    kind: str
    message: Any


class Aligned(NamedTuple):
    """A step after alignment: the tensors to call the model with, and what was changed (for the caller to report)."""

    attention_mask: Any
    position_ids: Any
    token_type_ids: Any
    cache_position: Any
    batch: int
    new_tokens: int
    repairs: tuple[Repair, ...]
    report: Report | None = None
    right_padded: tuple[int, ...] = ()
    #: A rotary prompt's given positions, where its values told them (see :attr:`CacheView.built`), else None.
    built: str | Offset | None = None

    @property
    def repair_kinds(self) -> tuple[str, ...]:
        return tuple(repair.kind for repair in self.repairs)
