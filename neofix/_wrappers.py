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
from ._compat import (
    COMPILING,
    STEPPING_ASIDE,
    is_tracing,
    positional_names,
    rebound_by_fx,
    trace_original_as_root,
    tracer,
)
from ._config import settings
from ._core import (
    NO_CACHE,
    Aligned,
    CacheView,
    Limits,
    Policy,
    StepInputs,
    align,
    align_padding_mask,
    derive_positions,
    explain_index_error,
    keeps_every_rule,
)
from ._core._types import Offset
from ._errors import (
    AttentionWindowError,
    InputShapeError,
    MaskLengthError,
    MaskValueError,
    NeofixError,
    SequenceTooLongError,
    counted,
    warn_once,
)
from ._families._contract import Adapter, attention_of, for_model
from ._reports import StepInfo

#: Marks every function neofix installs (``neofix.trace`` tells a patched model by it).
MARK = "__neofix_wrapper__"


def _mark(function: Callable[..., Any]) -> Callable[..., Any]:
    setattr(function, MARK, True)
    return function


def make_model_forward(original: Any, adapter: Adapter) -> Callable[..., Any]:
    """``<Family>Model.forward``: every caller passes here (generate, hand-written loops, pipelines, heads).

    One path: read the call, check or align it (:func:`~neofix._core.align`: every rule of the step contract, each
    written once; a step that keeps them all passes without a torch operation), call the original once, and one
    ending (:func:`_call`).  While torch.jit, torch.fx or torch.export traces, the call passes untouched; inside
    ``torch.compile`` the same alignment runs from shapes alone (nothing read, warned or traced).
    """
    names = positional_names(original)
    takes_positions = "position_ids" in inspect.signature(original).parameters
    positions_of = adapter.positions_of  # (a family whose config decides its positions: Falcon)

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        if rebound_by_fx(args):  # torch.fx traces this forward as its root, its code rebound: vanilla's graph
            # (rebinding needs a local name per parameter of the original, up to 16 on transformers 4.57; the
            # names of _FX_ROOM keep room for them, tests/test_tracing_fx_families.py pins it)
            return trace_original_as_root(original)
        call = kwargs  # every argument by name, in this call's own dict
        for name, value in zip(names, args):
            if name in call:  # given twice: vanilla's own error, on every path (the call passed on included)
                raise TypeError(f"{original.__qualname__}() got multiple values for argument '{name}'")
            call[name] = value
        family = adapter if positions_of is None else for_model(adapter, self.config)  # (the one place it is read)
        input_ids = call.get("input_ids")
        traced = tracer(input_ids if input_ids is not None else call.get("inputs_embeds"))
        if traced == STEPPING_ASIDE or _passed_on(input_ids, family):
            return original(self, **call)
        eager = traced != COMPILING
        if eager and _reports.pending:
            _reports.poll()  # position reports of earlier steps, read once their copies have landed (never waiting)
        limits = model_limits(self, family) if eager else family.limits(self.config)  # (compiled: constants)
        view = _read_cache(self, call, family, eager)
        if view is _caches.EVICTING:  # (SinkCache: nothing can be judged against it)
            return original(self, **call)
        step = _step_inputs(call, view)
        try:
            kept, aligned = _judge(self, step, view, limits, call, family, eager)
        except NeofixError:
            fresh = model_limits(self, family, afresh=True) if eager else limits
            if fresh == limits:
                raise  # refused on the model as it is
            kept, aligned = _judge(self, step, view, fresh, call, family, eager)  # its config was edited since: again
        if kept:  # the usual step: nothing to change (see keeps_every_rule)
            return _call(original, self, call, view, family, eager)
        if aligned is None:  # neither input_ids nor inputs_embeds: transformers raises its own error
            return original(self, **call)
        _apply(aligned, call, takes_positions)
        if eager:
            _report(self, aligned, view, step.attention_mask)
        return _call(original, self, call, view, family, eager, aligned.right_padded, aligned.built)
        _a = _b = _c = _d = _e = _f = _g = _h = _i = _j = _k = None  # _FX_ROOM: never runs (see above)

    return _mark(forward)


def _passed_on(input_ids: Any, adapter: Adapter) -> bool:
    """1D ``input_ids`` on a release whose forward reads them as one row: transformers' own business."""
    return adapter.flat_input_ids_accepted and input_ids is not None and input_ids.dim() != 2


def _read_cache(model: Any, call: dict, adapter: Adapter, eager: bool) -> CacheView:
    """The call's cache read into a :class:`~neofix._core.CacheView` (a legacy tuple the release rejects wrapped
    first), checked against the family's own limits."""
    key, given = _caches.of_call(call)
    cache = given
    if type(cache) is tuple and cache and adapter.legacy_cache_rejected:
        call[key] = cache = _legacy_cache(cache, model.config)
    if cache is None and adapter.held_cache is not None:
        cache = adapter.held_cache(model)  # read only: the call is passed on without it, as the layers expect
    view = NO_CACHE if cache is None else adapter.read_cache(cache, adapter.layers(model))
    if eager and view is not _caches.EVICTING:
        adapter.check_step(model, view, call)
        if _RIGHT_PADDED:
            _check_right_padding(call, view.length)
        if _BUILT and view.length:
            built = _built(given)  # (a legacy tuple by its first key: generate may return its cache's own tensors)
            if built is not None:
                return view._replace(built=built)
    return view


def _step_inputs(call: dict, view: CacheView) -> StepInputs:
    """The call's tensors, by :class:`~neofix._core.StepInputs`' field names (``None`` where not given); over a static
    cache, the slots of the new tokens where no ``cache_position`` is given (:func:`_with_slots`)."""
    step = _new_tuple(  # (StepInputs' own constructor is a Python function: this runs every step)
        StepInputs,
        (
            call.get("input_ids"),
            call.get("inputs_embeds"),
            call.get("attention_mask"),
            call.get("position_ids"),
            call.get("token_type_ids"),
            call.get("cache_position"),
        ),
    )
    if view.layout == "static" and step.cache_position is None:
        return _with_slots(step, call)
    return step


_new_tuple = tuple.__new__


def _with_slots(step: StepInputs, call: dict) -> StepInputs:
    """A step over a static cache without ``cache_position``: the slots its tokens go to, as transformers counts them
    (the cache's own count, unread), so that the core takes the mask's columns there (a mask may be as wide as the
    slots).  For the core only: never passed on."""
    first = step.input_ids if step.input_ids is not None else step.inputs_embeds
    if first is None or first.dim() < 2:
        return step
    slots = _caches.static_slots(_caches.of_call(call)[1], first.shape[1], first.device)
    return step if slots is None else step._replace(cache_position=slots)


def _judge(
    model: Any, step: StepInputs, view: CacheView, limits: Limits, call: dict, adapter: Adapter, eager: bool
) -> tuple[bool, Aligned | None]:
    """``(True, None)`` for a step that keeps every rule (nothing to change: see keeps_every_rule), else ``(False,
    align's answer)``, given the values' facts where the first pass read them (a step's values are read once)."""
    facts = None
    if eager and not _reports.listeners:
        given = step.position_ids
        trusted = given is not None and _remembered(_TRUSTED, given)
        kept, facts = keeps_every_rule(
            step, view, limits, adapter.positions, trusted, settings.check_values, settings.strict
        )
        if kept:
            return True, None
    return False, align(step, view, limits, _policy(model, call, adapter, eager, view), facts)


#: The attention implementations that pad a 2D mask to the keys they attend to (a static cache's slots), so that a
#: mask may be widened to them; flash attention keeps as many keys as the mask has columns, and others are not known.
_PADDING_MASKS = ("eager", "sdpa")


def _policy(model: Any, call: dict, adapter: Adapter, eager: bool, view: CacheView) -> Policy:
    given = call.get("position_ids")
    return Policy(
        strict=settings.strict,
        check_values=settings.check_values and eager,
        # (not under torch.compile: the lookup by id() would break the graph, and compiled steps read nothing)
        trusted_positions=eager and given is not None and _remembered(_TRUSTED, given),
        compiling=not eager,
        uncached_positions=settings.uncached_positions,
        positions=adapter.positions,
        # (asked only over a static cache: the config's attribute read, a costly one, only there)
        pads_masks=view.capacity is None or attention_of(model.config) in _PADDING_MASKS,
    )


def _apply(aligned: Aligned, call: dict, takes_positions: bool) -> None:
    """Write the aligned tensors into the call (only those the forward takes)."""
    call["attention_mask"] = aligned.attention_mask
    if takes_positions and (aligned.position_ids is not None or "position_ids" in call):
        call["position_ids"] = aligned.position_ids
    if "token_type_ids" in call:
        call["token_type_ids"] = aligned.token_type_ids
    if "cache_position" in call:
        call["cache_position"] = aligned.cache_position


def _report(model: Any, aligned: Aligned, view: CacheView, given_mask: Any) -> None:
    """Say what alignment repaired (each kind once), deliver a decode step's position report (read once it lands),
    and tell the trace listeners about the step."""
    _reports.warn_repairs(aligned.repairs)
    if aligned.report is not None:
        _reports.deliver(aligned.report)
    if _reports.listeners:
        _reports.emit(_step_info(model, aligned, view, given_mask))


def _step_info(model: Any, aligned: Aligned, view: CacheView, given_mask: Any) -> StepInfo:
    return StepInfo(
        model,
        aligned.batch,
        aligned.new_tokens,
        view.length,
        None if given_mask is None else given_mask.shape[-1],
        aligned.attention_mask,
        aligned.position_ids,
        aligned.repair_kinds,
    )


def _call(
    original: Any,
    model: Any,
    call: dict,
    view: CacheView,
    adapter: Adapter,
    eager: bool,
    right_padded: tuple[int, ...] = (),
    built: str | Offset | None = None,
) -> Any:
    """Call transformers' forward once, with the call as aligned.  A bad id or position that no check read
    (single-token decode steps read nothing; on the CPU the lookup is the check) surfaces as the embedding's
    ``IndexError``: name the value instead.  A prefill that ended ``right_padded`` rows in padding marks the cache it
    returns, so that decoding from it says so; a rotary family's prompt marks the positions its cache is built with,
    as its values were read (``built``: transformers' own, where it was given none on a row with a pad before a real
    token, or what its given ones are; :func:`_mark_built`)."""
    try:
        output = original(model, **call)
    except IndexError as exc:
        positions = call.get("position_ids")
        limits = model_limits(model, adapter, afresh=True)  # (the model as it is: see model_limits)
        explain_index_error(exc, limits, call.get("input_ids"), call.get("token_type_ids"), positions)
        if adapter.explain_overflow is not None:
            adapter.explain_overflow(exc, model.config, call.get("attention_mask"), positions, view.length)
        raise
    if right_padded:
        _mark_right_padded(output, right_padded)
    # (eager before the registry: a compiled call reads none, or dynamo guards on it and compiles again once it changes)
    if (view.length == 0 or view.built) and eager and (built is not None or _BUILT) and adapter.positions.taken:
        if view.length:  # a prompt, or a step after a cache marked (a legacy tuple is new each step); a prompt that
            built = view.built  # builds with nothing to mark has no mark to drop either, where none is kept
        _mark_built(output, built)
    return output


# -- the model's limits ------------------------------------------------------------------------------------------

# id(config) -> (weak reference to it, the limits read from it)
_LIMITS: dict[int, tuple[Any, Limits]] = {}


def model_limits(model: Any, adapter: Adapter, afresh: bool = False) -> Limits:
    """The model's :class:`~neofix._core.Limits`, as the adapter reads them from ``model.config``.

    The one rule for when they are read afresh: before anything is refused on them.  They are remembered per config
    from its first forward (reading them costs microseconds a step on 5.x, whose config attributes pass two Python
    layers), and a step refused on remembered limits is judged again on the config as it is (``afresh``) where they
    differ; an ``IndexError`` is explained on the config as it is.  So a model edited between two calls
    (``resize_token_embeddings`` assigns ``config.vocab_size``) is never refused on what it was; nothing but a
    refusal depends on them.  (A limit edited smaller is enforced once a refusal reads the config again; until then
    transformers' own tables, which editing a config does not resize, decide what runs.)
    The model's layers are counted on every call (the adapter's ``layers``).  Eager calls only: inside
    ``torch.compile`` the config is read directly (dynamo makes its values constants, and a registry written during a
    compiled call would be a guard that fails on the next: one more compilation).
    """
    config = model.config
    remembered = _LIMITS.get(id(config))  # (_remembered, inlined: every step asks)
    if not afresh and remembered is not None and remembered[0]() is config:
        return remembered[1]
    limits = adapter.limits(config)
    _remember(_LIMITS, config, limits)
    return limits


# -- positions transformers' generate built (trusted: compared with nothing on decode steps) ------------------------

# id(tensor) -> (weak reference to it, True): the position_ids prepare_inputs_for_generation returned (the registries
# of this module share _remember and _remembered)
_TRUSTED: dict[int, tuple[Any, Any]] = {}


def _trust(positions: Any) -> None:
    if isinstance(positions, torch.Tensor):
        _remember(_TRUSTED, positions)


def _remember(registry: dict[int, tuple[Any, Any]], obj: Any, value: Any = True) -> None:
    """Remember ``value`` for ``obj`` in an identity registry (``id`` -> (weak reference, value): its entry goes
    with it).  An object that cannot be weakly referenced is not followed."""
    key = id(obj)
    try:
        reference = weakref.ref(obj, lambda _, key=key: registry.pop(key, None))
    except TypeError:
        return
    registry[key] = (reference, value)


def _remembered(registry: dict[int, tuple[Any, Any]], obj: Any) -> Any:
    """The value remembered for ``obj`` (the object itself, not one that reused its ``id``), else ``None``."""
    entry = registry.get(id(obj))
    return entry[1] if entry is not None and entry[0]() is obj else None


# -- right padding at the start of decoding ---------------------------------------------------------------------------

# id(cache, or for a legacy cache its first key) -> (weak reference to it, the rows that ended in padding at prefill)
_RIGHT_PADDED: dict[int, tuple[Any, tuple[int, ...]]] = {}


def _cache_key(cache: Any) -> Any:
    """What a cache is remembered by: the object, or a legacy cache's first key (a new tuple at every step), or its
    first layer where that is one tensor (GPT-BigCode up to 4.53 fuses each layer's keys and values in one)."""
    if type(cache) is tuple or type(cache) is list:
        first = cache[0] if cache else None
        if type(first) is torch.Tensor:
            return first
        return first[0] if isinstance(first, (tuple, list)) and first else None
    return cache


def _output_cache(output: Any) -> Any:
    """The cache a forward returned, or ``None``."""
    cache = _caches.of_output(output)
    if cache is None and isinstance(output, tuple) and len(output) > 1:  # return_dict=False: (hidden, cache, ...),
        cache = output[1]  # or without a cache (hidden, hidden states, ...: _cache_key takes the first hidden
        # state for a GPT-BigCode layer, which is only remembered weakly and never passed as a cache again)
    return cache


def _mark_right_padded(output: Any, rows: tuple[int, ...]) -> None:
    """Remember that the cache this prefill returned holds right-padded rows: if it is decoded from, say so then."""
    key = _cache_key(_output_cache(output))
    if key is not None:
        _remember(_RIGHT_PADDED, key, rows)


# -- which positions a rotary family's cache holds ---------------------------------------------------------------------

# id(cache, or for a legacy cache its first key) -> (weak reference to it, the positions a rotary family's prompt
# built it with: BY_COLUMNS, BY_MASK, an Offset or BY_GIVEN, see :func:`_mark_built`), for the caches such a prompt
# returned and those continued from them
_BUILT: dict[int, tuple[Any, str | Offset]] = {}


def _built(cache: Any) -> str | Offset | None:
    """The positions ``cache`` was built with, where its prompt told (:attr:`~neofix._core.CacheView.built`); a cache
    object of 4.36 - 4.55 also by its first key tensor (:func:`_first_key`)."""
    built = _remembered(_BUILT, _cache_key(cache))
    if built is None and _compat.release() < (4, 56):
        return _remembered(_BUILT, _first_key(cache))
    return built


def _first_key(cache: Any) -> Any:
    """A cache object's first key tensor (``None`` where it has none), by which it is also remembered on 4.36 - 4.55:
    there generate turns a legacy tuple it is given into a cache object holding the tuple's own tensors, and returns
    its cache as a legacy tuple of its own on some releases."""
    layers = getattr(cache, "layers", None)
    if type(layers) is list:  # 4.55: layers of keys (its key_cache, a view of them, logs a deprecation when read)
        return getattr(layers[0], "keys", None) if layers else None
    keys = getattr(cache, "key_cache", None)
    return keys[0] if type(keys) is list and keys else None


def _mark_built(output: Any, built: str | Offset | None) -> None:
    """Remember the positions the cache a rotary family's prompt returned is built with (``built``, see
    :attr:`~neofix._core.CacheView.built`: transformers' own where the prompt was given no ``position_ids``, else
    what its given ones were read to be; ``None``: not known), so that the steps after it are judged against those
    (:func:`~neofix._core._values.rotary_truth`, :func:`~neofix._core._values.value_plan`); a step after such a cache
    marks the one it returns (a legacy tuple is a new object at every step).  A cache object of 4.36 - 4.55 is also
    remembered by its first key tensor: generate returns it as a legacy tuple of its own tensors on some releases."""
    cache = _output_cache(output)
    key = _cache_key(cache)
    if key is None:
        return
    first = _first_key(cache) if _compat.release() < (4, 56) else None
    for each in (key, first) if first is not None else (key,):
        if built is None:
            _BUILT.pop(id(each), None)  # (a cache used again from its start, its prompt given other positions)
        elif _remembered(_BUILT, each) != built:
            _remember(_BUILT, each, built)


def _check_right_padding(kwargs: dict, past: int | None) -> None:
    """Say (strict mode: raise) that a step decodes from a cache a right-padded prompt filled (once per cache).  A
    cache used again from its start (cropped to nothing, or reset) forgets it: its new prompt is judged afresh."""
    key = _cache_key(_caches.of_call(kwargs)[1])
    rows = _remembered(_RIGHT_PADDED, key)
    if rows is None:
        return
    if past == 0:
        del _RIGHT_PADDED[id(key)]
        return
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


def _mask_for_generate(input_ids: Any, kwargs: dict) -> None:
    """From 5.3, generate given a cache reads ``input_ids`` as the whole sequence (and feeds the tokens after the
    cache) only where the 2D attention mask is exactly as wide; otherwise as the new tokens alone, fed after the cache,
    and it builds their positions from that mask (dropping an all-ones one before the model sees it).  So a mask not
    extended for the new tokens is judged here, before generate reads it, by the model forward's own rule (extended,
    said once; refused where its readings differ; strict: refused).  Where ``input_ids`` outnumber the cached tokens
    and the mask is as wide as neither reading asks, which tokens are new cannot be told: refused."""
    mask = kwargs.get("attention_mask")
    cache = _caches.of_call(kwargs)[1]
    if input_ids is None or cache is None or mask is None or mask.dim() != 2 or input_ids.dim() != 2:
        return
    (batch, fed), columns = input_ids.shape, mask.shape[1]
    if columns == fed or mask.shape[0] != batch:  # the usual call: the whole sequence (its cache not read)
        return
    past = _caches.length(cache)
    if not past or columns == past + fed:
        return
    if fed > past:
        raise MaskLengthError(
            f"generate was given {counted(fed, 'token')} of input_ids, a cache of {counted(past, 'token')} and an "
            f"attention_mask of {counted(columns, 'column')}: as the whole sequence (the cache its first {past}), "
            f"the mask must have {fed} columns; as the new tokens alone, {past + fed} (transformers feeds them after "
            f"the cache, as it does with any mask not as wide as input_ids). Which tokens are new cannot be told: "
            f"pass the mask of the whole sequence, as wide as input_ids (torch.cat([previous_mask, new_mask], -1))"
        )
    repairs: list[Any] = []
    kwargs["attention_mask"] = align_padding_mask(mask, batch, fed, past, past + fed, settings.strict, repairs)
    _reports.warn_repairs(repairs)


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


# The generate call running in this context (this thread or task): (the model, its prompt length, its attention mask
# or None).  Set by the generate wrapper, read by the stopping-criteria wrapper and by the overflow report.
_GENERATING: contextvars.ContextVar[tuple[Any, int, Any] | None] = contextvars.ContextVar("neofix_generating", default=None)
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

    reads_new_tokens_by_mask = _compat.release() >= (5, 3)  # see _mask_for_generate

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
        if reads_new_tokens_by_mask:
            _mask_for_generate(args[0] if args else kwargs.get("input_ids", kwargs.get("inputs")), kwargs)
        token = _GENERATING.set((self, length, kwargs.get("attention_mask")))
        try:
            return original(self, *args, **kwargs)
        except SequenceTooLongError as exc:
            raise _in_generate_terms(exc, length, kwargs.get("attention_mask")) from None
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


def _in_generate_terms(exc: SequenceTooLongError, prompt: int, mask: Any = None) -> SequenceTooLongError:
    """The model forward's overflow error, retold for a generate call with a ``prompt``-token prompt (its ``mask``:
    where the attention bounds the columns, a padded prompt's pads count, and the message says columns)."""
    past, total, limit = getattr(exc, "past", None), getattr(exc, "total", None), getattr(exc, "max_positions", None)
    if past is None or total is None or limit is None or getattr(exc, "in_generate", False) or past < prompt:
        return exc
    generated = past - prompt + 1  # the step feeds back the token generated last
    fit = max(limit - (total - generated) + 1, 0)  # (total - generated: the prompt's positions, its real tokens')
    fed = f"feeding {'it' if generated == 1 else 'the last one'} back"
    if getattr(exc, "columns", False) and isinstance(mask, torch.Tensor) and not bool(mask.all()):  # (an error: a read)
        needs = (
            f"{fed} would make the sequence {total} columns long, but this model's attention holds at most "
            f"config.max_position_embeddings = {limit} columns, the prompt's padding included"
        )
    else:
        needs = (
            f"{fed} would need position {total - 1}, but config.max_position_embeddings is {limit} (positions 0 to "
            f"{limit - 1})"
        )
    told = SequenceTooLongError(
        f"generate produced {counted(generated, 'new token')} after the {prompt}-token prompt, "
        f"and {needs}: at most {fit} new tokens fit after this prompt. Pass max_new_tokens={fit} or fewer (generate "
        f"stopped before this step's compute)"
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
            _, prompt, mask = running
            limits = adapter.limits(self.config)
            _refuse_what_cannot_run(
                config, criteria, prompt, limits.max_positions, mask if limits.wider_than_table else None
            )
        return criteria

    return _mark(_get_stopping_criteria)


def _fewest_pads(mask: Any, prompt: int) -> int:
    """The pads of the prompt's row with the most real tokens (positions count real tokens only, where
    ``Limits.wider_than_table``; generate builds them so); 0 where the mask is not a 2D mask of the prompt's width.
    Reads the mask: only for a generate call that its columns alone would refuse."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[-1] != prompt or not mask.numel():
        return 0
    return max(prompt - int((mask != 0).sum(-1).max()), 0)


def _refuse_what_cannot_run(config: Any, criteria: Any, prompt: int, limit: int | None, mask: Any = None) -> None:
    """Refuse a generate call that cannot run within the position table whatever it generates.  ``prompt``: its
    columns; ``mask``: its attention mask where positions count real tokens only (``Limits.wider_than_table``), so
    that the pads of its longest row take no position."""
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
    # the last token generated is never fed back: the forwards reach forced - 1 positions (less the pads of the
    # longest row, where positions count real tokens only)
    pads = _fewest_pads(mask, prompt) if forced - 1 > limit else 0
    needs = forced - 1 - pads
    if needs > limit:
        fit = max(limit - (prompt - pads) + 1, 0)
        rows = f" (its longest row: {prompt - pads} real tokens)" if pads else ""
        raise SequenceTooLongError(
            f"generate cannot run within config.max_position_embeddings={limit}: {why}, which needs {needs} positions"
            + (
                f"; at most {fit} new token{' fits' if fit == 1 else 's fit'} after this {prompt}-token prompt{rows}"
                if fit
                else f"; the {prompt}-token prompt{rows} alone is longer than that: shorten it"
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


def make_prepare_4d_sdpa_mask(original: Any, adapter: Any) -> Callable[..., Any]:
    """``_prepare_4d_causal_attention_mask_for_sdpa`` as Llama, Mistral and Qwen2 imported it (transformers 4.36 -
    4.41): float64 models as :func:`make_prepare_4d_mask_in_float64`, and, up to 4.38, a left-padded chunk of several
    tokens after a cache.

    There ``AttentionMaskConverter._unmask_unattended`` (which lets the rows of left-padding queries attend to every
    key, for sdpa's memory-efficient kernel) counts those rows as if the chunk started the sequence: it unmasks the
    rows of real tokens (wrong tokens, no error) or indexes past the chunk (``IndexError``), vanilla transformers
    alike.  neofix builds that step's mask with the eager helper (the same 4D mask, not unmasked) and unmasks the rows
    every key of which is masked, as transformers 4.39 does.
    """
    float64 = make_prepare_4d_mask_for_float64(original, adapter, widen=True)
    if _compat.release() >= (4, 39):
        return float64
    from transformers import modeling_attn_mask_utils

    eager = make_prepare_4d_mask_for_float64(
        modeling_attn_mask_utils._prepare_4d_causal_attention_mask, adapter, widen=True
    )
    names = ("attention_mask", "input_shape", "inputs_embeds", "past_key_values_length", "sliding_window")

    @functools.wraps(original)
    def prepare_4d_causal_attention_mask_for_sdpa(*args: Any, **kwargs: Any) -> Any:
        bound = {**dict(zip(names, args)), **kwargs}
        mask, shape = bound.get("attention_mask"), bound.get("input_shape")
        past = bound.get("past_key_values_length")
        if (
            isinstance(mask, torch.Tensor) and not is_tracing(mask) and mask.dim() == 2 and shape is not None
            and shape[-1] > 1 and isinstance(past, int) and past > 0 and not bool(torch.all(mask == 1))
        ):
            expanded = eager(**bound)
            masked = torch.all(expanded == torch.finfo(expanded.dtype).min, dim=-1, keepdim=True)
            return expanded.mul(~masked)
        return float64(*args, **kwargs)

    return _mark(prepare_4d_causal_attention_mask_for_sdpa)


__all__ = [
    "MARK",
    "make_flash_attention_forward",
    "make_generate",
    "make_get_stopping_criteria",
    "make_model_forward",
    "make_prepare_4d_mask_for_float64",
    "make_prepare_4d_mask_in_float64",
    "make_prepare_4d_sdpa_mask",
    "make_prepare_inputs_for_generation",
]
