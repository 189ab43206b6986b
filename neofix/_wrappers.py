"""The wrappers neofix installs.  Each is thin: read the step, call the pure core, call the original.

Data flows one way::

    generate ──> prepare_inputs_for_generation ──> <Family>Model.forward ──> flash-attention-2 layers
                 (feed exactly the uncached tokens)  (align the step, and     (refuse a step past the
                                                      check every layer's      local window)
                                                      cache before any runs)

Each ``make_*`` factory takes the original function and the family's adapter (:mod:`neofix._families`) and returns
the plain function that replaces it on its class (``functools.wraps``: same name, docstring and signature,
``__wrapped__`` set).  Plain functions rather than wrapt proxies, because dynamo cannot build its guards on a proxy
(``torch.compile`` would fail with "Guard failed on the same frame it was created"), and because a plain function
is the cheapest thing to call on every decode step.  Every wrapper steps aside while torch.jit, torch.fx or
torch.export traces (see :func:`neofix._compat.tracer`); under ``torch.compile`` the model forward runs its shape
logic only, which dynamo traces into the graph.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import weakref
from typing import Any, Callable

import torch

from . import _caches, _compat, _reports
from ._compat import STEPPING_ASIDE, is_tracing, positional_names, tracer
from ._config import settings
from ._core import Aligned, Limits, Policy, StepInputs, align, derive_positions, explain_index_error, step_unchanged
from ._core._align import check_cache
from ._core import _values
from ._core._values import (
    _CHUNK_UNCHANGED,
    _DERIVED_IN_CHUNK_ONLY,
    COMPARED_KINDS,
    Settled,
    _counting,
    _new,
    read_given,
    read_prefill,
    shapes_fit,
)
from ._errors import (
    AttentionWindowError,
    InputShapeError,
    MaskLengthError,
    MaskValueError,
    NeofixError,
    SequenceTooLongError,
    warn_once,
)
from ._reports import StepInfo

_LONG = torch.long
_Tensor = torch.Tensor
_frombuffer = torch.frombuffer

#: Marks every function neofix installs (``neofix.trace`` tells a patched model by it).
MARK = "__neofix_wrapper__"


def _mark(function: Callable[..., Any]) -> Callable[..., Any]:
    setattr(function, MARK, True)
    return function


def make_model_forward(original: Any, adapter: Any) -> Callable[..., Any]:
    """``<Family>Model.forward``: every caller passes here (generate, hand-written loops, pipelines, heads)."""
    names = positional_names(original)
    first_name = names[0] if names else "input_ids"
    flat_input_ids_accepted = adapter.FLAT_INPUT_IDS_ACCEPTED
    legacy_cache_rejected = adapter.LEGACY_CACHE_REJECTED
    read_cache = adapter.read_cache
    check_step = adapter.check_step
    positions_kind = adapter.POSITIONS
    explain_overflow = getattr(adapter, "explain_overflow", None)  # a family whose limit depends on values (OPT)
    takes_positions = "position_ids" in names or "position_ids" in inspect.signature(original).parameters
    listeners = _reports.listeners
    pending = _reports.pending
    right_padded = _RIGHT_PADDED
    usual = _caches.usual_layer(read_cache)

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("input_ids")
        if first is None:
            first = kwargs.get("inputs_embeds")
        traced = tracer(first)
        if traced:
            if traced == STEPPING_ASIDE:
                return original(self, *args, **kwargs)
            return _compiled_step(self, original, names, args, kwargs, adapter)
        if pending:  # position reports of earlier steps, read once their copies have landed (never waiting)
            _reports.poll()
        facts = _FACTS.get(id(self))  # (inlined: this runs on every forward)
        if facts is None or facts[0]() is not self:
            facts = _read_model_facts(self, adapter)
        layers, limits = facts[1], facts[2]
        prefilled = view = None  # view: the cache's CacheView, once read (read once per step)
        if len(args) <= 1 and first is not None and (args or "input_ids" in kwargs):
            shape = first.shape
            cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")  # _caches.of_call, inlined
            if len(shape) == 2 and shape[1] == 1 and not settings.check_values:
                view, unchanged = aligned_decode_step(shape, kwargs, cache, layers, limits, adapter)
                if unchanged:
                    # the usual decode step, already aligned: align() would return every input unchanged
                    if right_padded:
                        _check_right_padding(kwargs)
                    if listeners:
                        mask = kwargs.get("attention_mask")
                        _reports.emit(
                            StepInfo(
                                self, shape[0], 1, view.length, None if mask is None else mask.shape[-1], mask,
                                kwargs.get("position_ids"), (),
                            )
                        )
                    try:
                        return original(self, *args, **kwargs)
                    except IndexError as exc:
                        explain_index_error(exc, _fresh_facts(self, adapter, facts)[2], first, None,
                                            kwargs.get("position_ids"))
                        if explain_overflow is not None:
                            explain_overflow(exc, self.config, kwargs.get("attention_mask"),
                                             kwargs.get("position_ids"), view.length)
                        raise
            if view is None:  # (a decode step whose cache was read is no prefill and no chunk)
                try:
                    prefilled, past, view = plain_forward(first, shape, kwargs, cache, layers, limits, adapter, usual)
                except NeofixError:
                    if _fresh_facts(self, adapter, facts) is facts:
                        raise  # refused on the model as it is
                    # refused on what the model was before an edit: the general path reads it afresh (below)
            if prefilled is not None:
                positions, _, _, padded_rows, repairs = prefilled
                if not padded_rows and (positions is None or takes_positions):
                    # The usual forward without a cache (training, scoring, heads, a loop's first forward), or a
                    # chunk of a prompt after a cache with a mask over both: values read, and nothing to change but
                    # the positions derived from a left-padded mask.  (No check_step: a chunk's cache grows.  A
                    # fixed-capacity one has no length to tell without reading the device: the general path has it.)
                    if past and right_padded:
                        _check_right_padding(kwargs)
                    if positions is not None:
                        kwargs["position_ids"] = positions
                        if not past:  # a chunk's repair has no message (warned at prefill)
                            _reports.warn_repairs(repairs)
                    if listeners:
                        mask = kwargs.get("attention_mask")
                        _reports.emit(
                            StepInfo(
                                self, shape[0], shape[1], past, None if mask is None else mask.shape[-1], mask,
                                kwargs.get("position_ids"), tuple(repair.kind for repair in repairs),
                            )
                        )
                    try:
                        return original(self, *args, **kwargs)
                    except IndexError as exc:
                        explain_index_error(exc, _fresh_facts(self, adapter, facts)[2], first, None, positions)
                        if explain_overflow is not None:
                            explain_overflow(exc, self.config, kwargs.get("attention_mask"), positions, past)
                        raise
        if args:  # generate and the heads pass input_ids alone positionally: skip zip() for that case
            kwargs = {first_name: args[0], **kwargs} if len(args) == 1 else {**dict(zip(names, args)), **kwargs}
        input_ids = kwargs.get("input_ids")
        if input_ids is not None and input_ids.dim() != 2 and flat_input_ids_accepted:
            return original(self, **kwargs)  # 1D input_ids: transformers up to 4.44 read them as one row
        # The general path reads the model's facts afresh (microseconds, against align's torch operations): the
        # remembered ones, which the fast paths read, go stale when a model is edited after a forward
        # (resize_token_embeddings, blocks removed), and a call must not be refused on what the model was
        fresh = _fresh_facts(self, adapter, facts)
        if fresh is not facts:
            layers, limits = fresh[1], fresh[2]
            view = prefilled = None  # both read on the stale facts: read again
        if view is None:
            key, cache = _caches.of_call(kwargs)
            if type(cache) is tuple and cache and legacy_cache_rejected:  # (neither read above reads such a tuple)
                kwargs[key] = cache = _legacy_cache(cache, self.config)
            view = read_cache(cache, layers)
        check_step(self, view)
        if right_padded and view.length != 0:
            _check_right_padding(kwargs)
        mask = kwargs.get("attention_mask")
        given = kwargs.get("position_ids")
        step = StepInputs(
            input_ids,
            kwargs.get("inputs_embeds"),
            mask,
            given,
            kwargs.get("token_type_ids"),
            kwargs.get("cache_position"),
        )
        if prefilled is not None:  # read already: the tokens, and positions derived from a left-padded mask
            aligned = Aligned(
                mask, prefilled.positions, None, None, first.shape[0], first.shape[1], prefilled.repairs, True, None,
                prefilled.right_padded,
            )
        else:
            policy = Policy(
                settings.strict,
                settings.check_values,
                given is not None and _is_trusted(given),
                False,
                settings.uncached_positions,
                positions_kind,
            )
            aligned = align(step, view, limits, policy)
            if aligned is None:
                return original(self, **kwargs)
        _reports.warn_repairs(aligned.repairs)
        if aligned.report is not None:
            _reports.deliver(aligned.report)
        positions = aligned.position_ids
        kwargs["attention_mask"] = aligned.attention_mask
        if takes_positions:
            kwargs["position_ids"] = positions
        if "token_type_ids" in kwargs:
            kwargs["token_type_ids"] = aligned.token_type_ids
        if "cache_position" in kwargs:
            kwargs["cache_position"] = aligned.cache_position
        if listeners:
            _reports.emit(
                StepInfo(
                    self,
                    aligned.batch,
                    aligned.new_tokens,
                    view.length,
                    None if mask is None else mask.shape[-1],
                    aligned.attention_mask,
                    positions,
                    aligned.repair_kinds,
                )
            )
        try:
            output = original(self, **kwargs)
        except IndexError as exc:
            # Single-token decode steps skip the value checks (they would synchronise with the device).  On the CPU
            # a bad id or position surfaces as this IndexError: name the value instead.
            explain_index_error(exc, limits, input_ids, aligned.token_type_ids, positions)
            if explain_overflow is not None:
                explain_overflow(exc, self.config, aligned.attention_mask, positions, view.length)
            raise
        if aligned.right_padded:
            _mark_right_padded(output, aligned.right_padded)
        return output

    return _mark(forward)


def plain_forward(
    input_ids: Any, shape: Any, kwargs: dict, cache: Any, layers: int, limits: Limits, adapter: Any, usual: Any = None
) -> tuple[Any, int, Any]:
    """The values of a forward given ``input_ids`` and a 2D mask (or none), and no token types, embeddings or
    ``cache_position``: without a cache (the usual training, scoring and classification call, and a loop's first
    forward), or a chunk of two or more tokens after a cache whose every layer holds the same ``p`` tokens of the same
    rows, with a mask over the ``p`` cached and the new tokens.  A prefill without positions is read by
    :func:`~neofix._core.read_prefill`; with the caller's (for the families whose positions ``align`` compares with
    the mask), by :func:`~neofix._core._values.read_given`, which passes them on only where every check passes.  A
    chunk here (the usual masks on the CPU), else as a prefill.  As :func:`~neofix._core.align` would read them:
    ``(settled, p, view)`` (``p`` 0 without a cache), or ``(None, 0, view)`` for any other call, and for any call
    ``align`` would refuse, repair or read differently (the general path aligns those, and says what is wrong);
    ``view``: the cache's :class:`~neofix._caches.CacheView` where this read it whole (the general path then reads
    it no more), else ``None``.  Shapes are checked first, from the call's arguments alone.  Positions are derived
    from a left-padded mask for the families that take absolute ones (``adapter.POSITIONS``), as ``align`` derives
    them.  ``cache``: the call's (``kwargs``' ``cache`` or ``past_key_values``); ``usual``: the family's
    :func:`~neofix._caches.usual_layer`, or ``None``.

    After the decode step a chunk is the most frequent forward, and it is read in this one function: each call, torch
    operation or line of Python costs several times as much right after a forward (its code has gone cold) as it does
    warm, and a call of a helper about a microsecond (measured in place)."""
    derive = (kind := adapter.POSITIONS) == "absolute"  # positions derived from a left-padded mask
    if (
        kwargs.get("token_type_ids") is not None
        or kwargs.get("inputs_embeds") is not None
        or kwargs.get("cache_position") is not None
    ):
        return None, 0, None
    if len(shape) != 2:  # (``shape``: input_ids.shape)
        return None, 0, None
    batch, new = shape  # (unpacked once: each subscript of a torch.Size is a call into torch)
    if not new:
        return None, 0, None
    given = kwargs.get("position_ids")
    if given is not None:
        # the caller's positions, for a family that compares them with the mask, and whose table (if it has one) it
        # looks them up in (read_given and the chunk's read below leave their range to that lookup), and long.  Their
        # shape (2D, one row or one per input row, a column per new token) is checked where they are read: a chunk's
        # from their list, for a .shape costs as much as a small tolist() right after a forward
        if kind not in COMPARED_KINDS or (not derive and limits[0] is not None) or given.dtype != _LONG:
            return None, 0, None
    mask = kwargs.get("attention_mask")
    if cache is None:
        limit = limits[0]  # max_positions
        if (limit is not None and new > limit) or not shapes_fit(
            0, input_ids, shape, mask, None if mask is None else mask.shape
        ):
            return None, 0, None
        if given is not None:  # the caller's positions: unchanged where every check passes, else the general path
            fits = given.shape
            if len(fits) != 2 or fits[1] != new or fits[0] not in (1, batch):
                return None, 0, None
            return read_given(input_ids, given, mask), 0, None
        return read_prefill(input_ids, mask, limits, settings.uncached_positions, derive=derive), 0, None
    if mask is None or new < 2 or (type(cache) is tuple and adapter.LEGACY_CACHE_REJECTED):
        return None, 0, None  # no chunk (a decode step's cache is read by aligned_decode_step); such tuples: wrapped
    # The usual growing cache (transformers 4.56 and later, ``usual``: its layers' type), read from its keys' shapes,
    # one ``.shape`` per layer in place of each layer's ``get_seq_length`` (a call into transformers costs several
    # microseconds right after a forward): ``layers`` or more layers of that type, each holding keys of the same shape
    # (batch, heads, p, head_dim), those of the model (``limits``), and p + new within the position table; what
    # _caches.read then check_cache would find.  Any other cache is read whole and checked below, which says what is
    # wrong.  (A layer's keys are None until its first update, and after reset() from 4.57: not a tensor.)
    past = 0
    cache_layers = getattr(cache, "layers", None) if usual is not None else None
    if type(cache_layers) is list and len(cache_layers) >= layers and batch and layers:
        keys_shape = None
        for layer in cache_layers[:layers]:
            if type(layer) is not usual or type(keys := layer.keys) is not _Tensor:
                break
            if keys_shape is None:
                keys_shape = keys.shape
            elif keys.shape != keys_shape:
                break
        else:
            max_positions, _, _, heads, head_dim = limits
            if len(keys_shape) == 4:
                keys_batch, keys_heads, held, keys_dim = keys_shape
                if (
                    keys_batch == batch
                    and keys_heads == heads
                    and keys_dim == head_dim
                    and (max_positions is None or held + new <= max_positions)
                ):
                    past = held
    view = None
    if not past:
        view = adapter.read_cache(cache, layers)
        past = view[0]  # length
    mask_shape = mask.shape
    # what shapes_fit checks of a chunk (a mask over the cached and new tokens), and the mask's rows: inlined
    if not past or len(mask_shape) != 2:
        return None, 0, view
    mask_rows, width = mask_shape
    if mask_rows != batch or width != past + new or input_ids.dtype != _LONG or mask.dtype != _LONG:
        return None, 0, view
    if view is not None:
        check_cache(view, batch, new, limits)  # what align checks (and raises) before it reads a value
    if _values.READ_SCALARS_ON_CPU and input_ids.is_cpu and mask.is_cpu and (given is None or given.is_cpu):
        # A chunk on the CPU, read here (after the decode step the most frequent forward: each call, torch
        # operation or line of Python costs several times as much right after a forward as it does warm).  What
        # _read_once would settle it to, where every row is real tokens, or pads then real tokens: the given
        # positions unchanged where each row's real new tokens sit at the mask's positions; none given, positions
        # derived from a left-padded mask (for the families that take absolute ones; silent: said at prefill).
        # Anything else is read below, or aligned.  Token ids and the range of positions are left to the
        # embedding, as read_prefill and read_given leave them.
        rows = mask.tolist()  # the one read of the mask
        if given is not None:
            # the one read of the positions, and of their shape: one row or one per input row, each a list (a 1D
            # tensor's rows are ints, and a 0D tensor's tolist() an int).  A row's length and its ints (2D, not 3D)
            # need no check: each row is compared whole with a list of as many ints as there are new tokens
            values = given.tolist()
            if type(values) is not list or not rows or len(values) not in (1, len(rows)) or type(values[0]) is not list:
                return None, 0, view
            counts = _values._COUNTING[0]
            if len(counts) < width:
                counts = _counting(width)[0]
            if len(values) == 1:  # one row of positions for every row
                values *= len(rows)
            unpadded = counts[past:width]  # the positions of a row without pads: on from the cache
            for row, own in zip(rows, values):  # _left_pads, inlined, and each row's positions with its pads
                pads = width - row.count(1)
                if not pads:
                    if own != unpadded:
                        return None, 0, view
                elif pads == width or row.count(0) != pads or row.index(1) != pads:
                    return None, 0, view  # right padding, a gap, a row of pads, a value neither 0 nor 1
                # a padded row's real new tokens count from 0 at its first real token: every new token, where the
                # pads end within the cache (``own`` from column ``past``), else those from column ``pads``
                elif pads <= past:
                    if own != counts[past - pads : width - pads]:
                        return None, 0, view
                elif own[pads - past :] != counts[: width - pads]:
                    return None, 0, view
            # the caller's positions pass as they are: the call is unchanged (no Settled of its own to build, and
            # no position_ids to set: a microsecond on a 2 x 32 chunk right after a forward)
            return _CHUNK_UNCHANGED, past, view
        pads_of = []
        padded = False
        for row in rows:  # _left_pads, inlined
            pads = width - row.count(1)
            if pads:
                if pads == width or row.count(0) != pads or row.index(1) != pads:
                    break  # right padding, a gap, a row of pads, a value neither 0 nor 1
                padded = True
            pads_of.append(pads)
        else:
            if not padded or not derive:  # every real token at its column: transformers' positions are right
                return _CHUNK_UNCHANGED, past, view
            # each row one slice of the table of zeros then counts (int64 bytes), copied into one bytearray,
            # handed to torch with one frombuffer: right after a forward, a quarter cheaper than a cumsum and its
            # slice (callgrind), and a new tensor, as the caller's positions must be
            counts, table = _values._COUNTING
            if len(counts) < width:
                counts, table = _counting(width)
            start = 8 * (len(counts) + past)  # a row without pads: the counts from ``past`` on; a pad: 8 bytes left
            stop = 8 * (len(counts) + width)
            joined = bytearray()
            for pads in pads_of:
                pads *= 8
                joined += table[start - pads : stop - pads]
            positions = _frombuffer(joined, dtype=_LONG).view(len(pads_of), width - past)
            return _new(Settled, (positions, True, None, (), _DERIVED_IN_CHUNK_ONLY)), past, view
    if given is not None:
        return None, 0, view
    # an accelerator (its reads are torch operations), or a mask of right padding, a gap or other values
    settled = read_prefill(input_ids, mask, limits, settings.uncached_positions, past, derive)
    return settled, past, view


def _compiled_step(self: Any, original: Any, names: tuple[str, ...], args: tuple, kwargs: dict, adapter: Any) -> Any:
    """The model forward inside ``torch.compile``: the same alignment, traced into the graph from shapes alone.

    Nothing is read off the device, nothing warned or traced, no cache marked (dynamo would break the graph for
    each); a repair is made silently, and an error of the step contract still raises.
    """
    if args:
        kwargs = {**dict(zip(names, args)), **kwargs}
    input_ids = kwargs.get("input_ids")
    if input_ids is not None and input_ids.dim() != 2:
        return original(self, **kwargs)
    view = adapter.read_cache(_caches.of_call(kwargs)[1], adapter.layers(self))
    step = StepInputs(
        input_ids,
        kwargs.get("inputs_embeds"),
        kwargs.get("attention_mask"),
        kwargs.get("position_ids"),
        kwargs.get("token_type_ids"),
        kwargs.get("cache_position"),
    )
    policy = Policy(settings.strict, False, False, True, settings.uncached_positions, adapter.POSITIONS)
    aligned = align(step, view, adapter.limits(self.config), policy)
    if aligned is None:
        return original(self, **kwargs)
    kwargs["attention_mask"] = aligned.attention_mask
    if "position_ids" in kwargs or aligned.position_ids is not None:
        kwargs["position_ids"] = aligned.position_ids
    if "token_type_ids" in kwargs:
        kwargs["token_type_ids"] = aligned.token_type_ids
    if "cache_position" in kwargs:
        kwargs["cache_position"] = aligned.cache_position
    return original(self, **kwargs)


def aligned_decode_step(
    shape: Any, kwargs: dict, cache: Any, layers: int, limits: Limits, adapter: Any
) -> tuple[Any, bool]:
    """``(view, unchanged)`` for a decode step (``shape``: its input_ids' shape, two dimensions, one new token;
    ``cache``: the call's):
    ``unchanged`` where :func:`~neofix._core.align` would leave the step as it is (see
    :func:`~neofix._core.step_unchanged`, read from the call's arguments and the cache's shapes; no tensor is read),
    and the model forward then calls transformers with the caller's arguments untouched.  ``view``: the cache's
    :class:`~neofix._caches.CacheView` where it was read (the general path reads it no more), else ``None``.

    Positions must be none, or generate's own (built from the mask by transformers): positions a caller passes are
    compared with the mask's on the device, which the general path does.
    """
    if kwargs.get("inputs_embeds") is not None:
        return None, False
    if cache is None or (type(cache) is tuple and adapter.LEGACY_CACHE_REJECTED):
        return None, False
    positions = kwargs.get("position_ids")
    if positions is not None and not _is_trusted(positions):
        return None, False
    mask = kwargs.get("attention_mask")
    cache_position = kwargs.get("cache_position")
    view = adapter.read_cache(cache, layers)
    unchanged = step_unchanged(  # positional: this runs on every decode step
        shape[0],  # batch
        shape[1],  # new tokens
        None if mask is None else mask.shape,
        None if positions is None else positions.shape,
        kwargs.get("token_type_ids") is not None,
        None if cache_position is None else cache_position.shape[-1],
        view,
        limits,
        adapter.POSITIONS != "absolute",  # missing positions are the model's own business
    )
    return view, unchanged


# -- positions transformers' generate built (trusted: compared with nothing on decode steps) ------------------------

# id(tensor) -> weak reference to it: the position_ids prepare_inputs_for_generation returned
_TRUSTED: dict[int, Any] = {}


def _trust(positions: Any) -> None:
    if isinstance(positions, torch.Tensor):
        key = id(positions)
        _TRUSTED[key] = weakref.ref(positions, lambda _, key=key: _TRUSTED.pop(key, None))


def _is_trusted(positions: Any) -> bool:
    ref = _TRUSTED.get(id(positions))
    return ref is not None and ref() is positions


# -- right padding at the start of decoding ---------------------------------------------------------------------------

# id(cache, or for a legacy cache its first key) -> (weak reference to it, the rows that ended in padding at prefill)
_RIGHT_PADDED: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _cache_key(cache: Any) -> Any:
    if type(cache) is tuple or type(cache) is list:
        first = cache[0] if cache else None
        return first[0] if first else None
    return cache


def _mark_right_padded(output: Any, rows: tuple[int, ...]) -> None:
    """Remember that the cache this prefill returned holds right-padded rows: if it is decoded from, say so then."""
    cache = _caches.of_output(output)
    if cache is None and isinstance(output, tuple) and len(output) > 1:  # return_dict=False: (hidden, cache, ...)
        cache = output[1]
    key = _cache_key(cache)
    if key is None:
        return
    try:
        reference = weakref.ref(key, lambda _, k=id(key): _RIGHT_PADDED.pop(k, None))
    except TypeError:  # not weakly referenceable: not followed
        return
    _RIGHT_PADDED[id(key)] = (reference, rows)


def _check_right_padding(kwargs: dict) -> None:
    key = _cache_key(_caches.of_call(kwargs)[1])
    entry = _RIGHT_PADDED.get(id(key)) if key is not None else None
    if entry is None or entry[0]() is not key:
        return
    rows = entry[1]
    named = f"row {rows[0]}" if len(rows) == 1 else f"rows {', '.join(map(str, rows))}"
    described = (
        f"decoding continues from a cache whose prompt had right padding in {named}: the prompt's last column "
        f"there is padding, so the next token of {'that row' if len(rows) == 1 else 'those rows'} was predicted from a "
        f"pad, not from its last real token"
    )
    fix = "pad prompts on the left (tokenizer.padding_side = 'left') before decoding"
    if settings.strict:
        raise MaskValueError(f"{described}: {fix}")
    del _RIGHT_PADDED[id(key)]
    warn_once("right_padded", f"neofix: {described}. To fix: {fix}. Reported once.")


# id(model) -> (weak reference to it, its layer count, its Limits), read once per model: both are Python-level
# reads (a ModuleList length, transformers' config __getattribute__) worth skipping per step
_FACTS: dict[int, tuple[Any, int, Limits]] = {}


def _fresh_facts(model: Any, adapter: Any, facts: tuple[Any, int, Limits]) -> tuple[Any, int, Limits]:
    """``model``'s facts read again: ``facts`` (those remembered) where they still hold, else the new ones,
    remembered in their place.  Whatever refuses a call or names a bad value reads them so: a model may be edited
    after its first forward (``resize_token_embeddings`` grows or shrinks ``config.vocab_size``, blocks are removed),
    and a call must be judged on the model as it is."""
    layers, limits = adapter.layers(model), adapter.limits(model.config)
    if layers == facts[1] and limits == facts[2]:
        return facts
    facts = (facts[0], layers, limits)  # (the same weak reference: it already removes the entry with the model)
    _FACTS[id(model)] = facts
    return facts


def _read_model_facts(model: Any, adapter: Any) -> tuple[Any, int, Limits]:
    """Read and remember ``model``'s facts (the model forward looks them up in ``_FACTS`` first)."""
    key = id(model)
    facts = (
        weakref.ref(model, lambda _, key=key: _FACTS.pop(key, None)),
        adapter.layers(model),
        adapter.limits(model.config),
    )
    _FACTS[key] = facts
    return facts


def _legacy_cache(legacy: tuple, config: Any) -> Any:
    described = (
        f"a legacy tuple cache was passed, which transformers {_compat.transformers_version()} no longer accepts"
    )
    if settings.strict:
        raise NeofixError(
            f"{described}: pass the Cache object the model returned (the cache of its outputs), or wrap the tuple "
            f"in transformers.DynamicCache"
        )
    warn_once("legacy_cache", f"neofix: {described}; wrapped it in a DynamicCache. Reported once.")
    return _caches.from_legacy(legacy, config)


def make_flash_attention_forward(original: Any, _adapter: Any) -> Callable[..., Any]:
    """GPT-Neo's flash-attention-2 forward: refuse a step its missing local window would get wrong.

    transformers' flash-attention-2 path for GPT-Neo applies no sliding window, so a local layer attends to every
    cached token instead of the last ``window_size``.  That is right only while the sequence fits in the window.
    Every layer checks, so the error comes from the first layer, before any layer has added the step to the cache.
    """

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not is_tracing():
            _check_local_window(self, args, kwargs)
        return original(self, *args, **kwargs)

    return _mark(forward)


def _check_local_window(attention: Any, args: tuple, kwargs: dict) -> None:
    config = attention.config
    window = config.window_size
    if "local" not in config.attention_layers:
        return
    hidden = args[0] if args else kwargs["hidden_states"]
    layer_past = kwargs["layer_past"] if "layer_past" in kwargs else (args[2] if len(args) > 2 else None)
    held = _caches.layer_length(layer_past, getattr(attention, "layer_id", None))
    if held is None:
        return
    total = held + hidden.shape[-2]
    if total > window:
        raise AttentionWindowError(
            f"this step attends over {total} tokens (the cache holds {held}), but GPT-Neo's local attention layers "
            f"see only the last {window} (config.window_size), and transformers' flash_attention_2 path for "
            f"GPT-Neo applies no window: the local layers would silently attend to every token. Load the model with "
            f"attn_implementation='eager', or keep sequences within {window} tokens"
        )


def make_prepare_inputs_for_generation(original: Any, _adapter: Any) -> Callable[..., Any]:
    """``GPTNeoForCausalLM.prepare_inputs_for_generation``: feed exactly the uncached tokens.

    transformers up to 4.35 feeds only the last token whenever a cache is present, which silently drops tokens
    when generation continues from a cache with several new tokens.  Later releases slice correctly, and this
    wrapper then changes nothing.
    """

    slices_uncached = _compat.release() >= (4, 36)  # transformers >= 4.36 feeds the uncached tokens itself

    @functools.wraps(original)
    def prepare_inputs_for_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = original(self, *args, **kwargs)
        if not slices_uncached:
            inputs = _uncached_inputs(inputs, args, kwargs)
        if isinstance(inputs, dict) and not _CALLER_POSITIONS.get():
            _trust(inputs.get("position_ids"))  # generate built them from the mask: decode steps compare nothing
        return inputs

    return _mark(prepare_inputs_for_generation)


def _uncached_inputs(inputs: Any, args: tuple, kwargs: dict) -> Any:
    full = args[0] if args else kwargs.get("input_ids")
    fed = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if full is None or fed is None or is_tracing(full) or full.dim() != 2:
        return inputs
    cache = _caches.of_call(inputs)[1]
    if cache is None:
        return inputs
    past = _caches.length(cache)
    if past is None or past == 0:
        return inputs
    uncached = full.shape[-1] - past
    if uncached <= 0 or fed.shape[-1] == uncached:
        return inputs
    described = (
        f"generate fed {fed.shape[-1]} token(s) to the model, but the cache holds {past} of the {full.shape[-1]} "
        f"tokens so far, so {uncached} are uncached"
    )
    if settings.strict:
        raise MaskLengthError(f"{described}: upgrade transformers (>= 4.36 slices correctly) or use repair mode")
    inputs["input_ids"] = full[:, past:]
    mask = inputs.get("attention_mask")
    positions = inputs.get("position_ids")
    if positions is not None and positions.shape[-1] != uncached:
        inputs["position_ids"] = derive_positions(mask, uncached) if mask is not None and mask.dim() == 2 else None
    token_types = inputs.get("token_type_ids")
    if token_types is not None and token_types.shape[-1] != uncached:
        full_types = kwargs.get("token_type_ids")
        inputs["token_type_ids"] = full_types[:, past:] if full_types is not None else None
    warn_once("generate_sliced", f"neofix: {described}; fed the uncached tokens. Reported once.")
    return inputs


# The generate call running in this context (this thread or task): (the model, its prompt length).  Set by the
# generate wrapper, read by the stopping-criteria wrapper and by the overflow report.
_GENERATING: contextvars.ContextVar[tuple[Any, int] | None] = contextvars.ContextVar("neofix_generating", default=None)
# Whether the generate call running in this context was given position_ids: generate then continues the caller's
# positions (5.10 and later add one per step; 5.0 and 4.57 repeat the last, 4.40 passes them whole), which are not
# built from the mask, so its decode steps' positions are compared with the mask's like any caller's (on the device,
# reported without blocking).
_CALLER_POSITIONS: contextvars.ContextVar[bool] = contextvars.ContextVar("neofix_caller_positions", default=False)


def make_generate(original: Any, _adapter: Any) -> Callable[..., Any]:
    """``<Family>ForCausalLM.generate``: an empty prompt is refused before anything runs; a step that would pass the
    position table raises :class:`~neofix.SequenceTooLongError` before its compute (from the model forward), here
    told in generate's terms: how many tokens were generated and how many fit.

    How far generate may run is never re-derived from its arguments: generate resolves that itself (max_new_tokens
    against max_length, arguments against generation_config), and the stopping-criteria wrapper reads the result.
    """

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        given = _CALLER_POSITIONS.set(kwargs.get("position_ids") is not None)
        try:
            return _generate(self, args, kwargs)
        finally:
            _CALLER_POSITIONS.reset(given)

    def _generate(self: Any, args: tuple, kwargs: dict) -> Any:
        length = _prompt_length(args, kwargs)
        if length is None:
            return original(self, *args, **kwargs)
        if length == 0:
            raise InputShapeError(
                "generate was given a prompt of 0 tokens: the model needs at least one token to continue from. "
                "Start from the tokenizer's bos_token_id (input_ids=torch.tensor([[tokenizer.bos_token_id]])), or "
                "pass no input_ids and let generate start from config.bos_token_id"
            )
        token = _GENERATING.set((self, length))
        try:
            return original(self, *args, **kwargs)
        except SequenceTooLongError as exc:
            raise _in_generate_terms(exc, length) from None
        finally:
            _GENERATING.reset(token)

    return _mark(generate)


def _prompt_length(args: tuple, kwargs: dict) -> int | None:
    prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if prompt is None:
        embeds = kwargs.get("inputs_embeds")
        return embeds.shape[1] if isinstance(embeds, torch.Tensor) and embeds.dim() == 3 else None
    if not isinstance(prompt, torch.Tensor) or prompt.dim() < 1 or is_tracing(prompt):
        return None
    return int(prompt.shape[-1])


def _in_generate_terms(exc: SequenceTooLongError, prompt: int) -> SequenceTooLongError:
    """The model forward's overflow error, retold for a generate call with a ``prompt``-token prompt."""
    past, total, limit = getattr(exc, "past", None), getattr(exc, "total", None), getattr(exc, "max_positions", None)
    if past is None or total is None or limit is None or getattr(exc, "in_generate", False) or past < prompt:
        return exc
    generated = past - prompt + 1  # the step feeds back the token generated last
    fit = max(limit - prompt + 1, 0)
    told = SequenceTooLongError(
        f"generate produced {generated} new token{'s' if generated != 1 else ''} after the {prompt}-token prompt, "
        f"and feeding {'it' if generated == 1 else 'the last one'} back would need position {total - 1}, but "
        f"config.max_position_embeddings is {limit} (positions 0 to {limit - 1}): at most {fit} new tokens fit "
        f"after this prompt. Pass max_new_tokens={fit} or fewer (generate stopped before this step's compute)"
    )
    told.past, told.total, told.max_positions, told.in_generate = past, total, limit, True
    return told


def make_get_stopping_criteria(original: Any, adapter: Any) -> Callable[..., Any]:
    """``GenerationMixin._get_stopping_criteria`` as a family's model sees it: generate calls it once, before the
    first forward, with the lengths it has resolved.  Refuses a generate call that cannot possibly run within the
    position table; everything that might still stop in time (an end-of-sequence token, a stopping criterion of the
    caller's, a time limit) runs, and a step that would overflow raises then."""

    @functools.wraps(original)
    def _get_stopping_criteria(self: Any, *args: Any, **kwargs: Any) -> Any:
        criteria = original(self, *args, **kwargs)
        running = _GENERATING.get()
        if running is not None and running[0] is self:
            config = kwargs.get("generation_config", args[0] if args else None)
            _refuse_what_cannot_run(config, criteria, running[1], adapter.limits(self.config).max_positions)
        return criteria

    return _mark(_get_stopping_criteria)


def _refuse_what_cannot_run(config: Any, criteria: Any, prompt: int, limit: int | None) -> None:
    if limit is None or config is None:
        return
    max_length = None
    for criterion in criteria:
        name = type(criterion).__name__
        if name == "MaxLengthCriteria":
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif name != "EosTokenCriteria":
            return  # a criterion of the caller's, a time limit or stop strings may end it in time
    if max_length is None:
        return
    eos = getattr(config, "eos_token_id", None)
    if eos is None or (isinstance(eos, (list, tuple)) and not eos):
        forced, why = max_length, f"no eos_token_id, so it runs to max_length={max_length}"
    else:  # generation may end at the first end-of-sequence token not suppressed by the minimum lengths
        min_new = getattr(config, "min_new_tokens", None) or 0
        least = max(getattr(config, "min_length", None) or 0, prompt + min_new, prompt + 1)
        forced = min(max_length, least)
        if forced <= prompt + 1:
            why = f"the {prompt}-token prompt itself"
        else:
            why = f"min_length={config.min_length}" if forced != prompt + min_new else f"min_new_tokens={min_new}"
            why = f"{why} forces {forced - prompt} new tokens"
    # the last token generated is never fed back: the forwards reach forced - 1 positions
    if forced - 1 > limit:
        fit = max(limit - prompt + 1, 0)
        raise SequenceTooLongError(
            f"generate cannot run within config.max_position_embeddings={limit}: {why}, which needs "
            f"{forced - 1} positions"
            + (
                f"; at most {fit} new tokens fit after this {prompt}-token prompt"
                if fit
                else f"; the {prompt}-token prompt alone is longer than that: shorten it"
            )
        )


def make_prepare_4d_mask_for_float64(original: Any, _adapter: Any, *, widen: bool = False) -> Callable[..., Any]:
    """``_prepare_4d_causal_attention_mask`` (or its ``_for_sdpa`` twin) as a family's module imported it, for float64
    models (GPT-Neo on transformers 4.36 - 4.44, BLOOM 4.36 - 4.43; with ``widen``, GPT-2 4.42 - 4.51 and OPT 4.36 -
    4.48: see each family's targets).

    The helper fills a float32 tensor with ``finfo(float64).min`` and raises "value cannot be converted to type float
    without overflow" (vanilla transformers cannot run such a model at all).  The mask is built in float32: GPT-Neo
    adds it to float32 scores anyway and BLOOM turns it into booleans.  With ``widen`` (families whose scores are
    float64) the float32 mask is then turned into the float64 mask the helper meant to build: float32's minimum
    becomes float64's, zeros stay zeros.
    """
    names = ("attention_mask", "input_shape", "inputs_embeds", "past_key_values_length", "sliding_window")

    @functools.wraps(original)
    def prepare_4d_causal_attention_mask(*args: Any, **kwargs: Any) -> Any:
        bound = {**dict(zip(names, args)), **kwargs}
        embeds = bound.get("inputs_embeds")
        if isinstance(embeds, torch.Tensor) and embeds.dtype == torch.float64 and not is_tracing(embeds):
            # float32 in the shape of the embeddings (the sdpa helper reads it), as a view of one element
            bound["inputs_embeds"] = torch.zeros((), dtype=torch.float32, device=embeds.device).expand(embeds.shape)
            mask = original(**bound)
            if widen and isinstance(mask, torch.Tensor) and mask.dtype == torch.float32:
                masked = mask == torch.finfo(torch.float32).min
                mask = mask.to(torch.float64).masked_fill_(masked, torch.finfo(torch.float64).min)
            return mask
        return original(*args, **kwargs)

    return _mark(prepare_4d_causal_attention_mask)


def make_prepare_4d_mask_in_float64(original: Any, adapter: Any) -> Callable[..., Any]:
    """:func:`make_prepare_4d_mask_for_float64` for families that add the mask to float64 scores (GPT-2, OPT)."""
    return make_prepare_4d_mask_for_float64(original, adapter, widen=True)


__all__ = [
    "MARK",
    "make_flash_attention_forward",
    "make_generate",
    "make_get_stopping_criteria",
    "make_model_forward",
    "make_prepare_4d_mask_for_float64",
    "make_prepare_4d_mask_in_float64",
    "make_prepare_inputs_for_generation",
]
