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
is the cheapest thing to call on every decode step.  Every wrapper steps aside while a trace or compilation runs
(see :func:`neofix._compat.is_tracing`).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch

from . import _caches, _compat, _reports
from ._compat import is_tracing, positional_names
from ._config import settings
from ._core import Limits, StepInputs, align, derive_positions, explain_index_error, step_unchanged
from ._errors import AttentionWindowError, MaskLengthError, NeofixError, SequenceTooLongError, warn_once
from ._reports import StepInfo

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
    listeners = _reports.listeners

    @functools.wraps(original)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else kwargs.get("input_ids")
        if first is None:
            first = kwargs.get("inputs_embeds")
        if is_tracing(first):
            return original(self, *args, **kwargs)
        layers, limits = _model_facts(self, adapter)
        if len(args) <= 1 and first is not None and not settings.check_values and (args or "input_ids" in kwargs):
            cache = aligned_decode_step(first, kwargs, layers, limits, read_cache, legacy_cache_rejected)
            if cache is not None:
                # the usual decode step, already aligned: align() would return every input unchanged
                if listeners:
                    mask = kwargs.get("attention_mask")
                    _reports.emit(
                        StepInfo(
                            self, first.shape[0], 1, cache.length, None if mask is None else mask.shape[-1], mask,
                            kwargs.get("position_ids"), (),
                        )
                    )
                try:
                    return original(self, *args, **kwargs)
                except IndexError as exc:
                    explain_index_error(exc, limits, first, None, kwargs.get("position_ids"))
                    raise
        if args:  # generate and the heads pass input_ids alone positionally: skip zip() for that case
            kwargs = {first_name: args[0], **kwargs} if len(args) == 1 else {**dict(zip(names, args)), **kwargs}
        input_ids = kwargs.get("input_ids")
        if input_ids is not None and input_ids.dim() != 2 and flat_input_ids_accepted:
            return original(self, **kwargs)  # 1D input_ids: transformers up to 4.44 read them as one row
        key, cache = _caches.of_call(kwargs)
        if type(cache) is tuple and cache and legacy_cache_rejected:
            kwargs[key] = cache = _legacy_cache(cache, self.config)
        view = read_cache(cache, layers)
        mask = kwargs.get("attention_mask")
        step = StepInputs(
            input_ids,
            kwargs.get("inputs_embeds"),
            mask,
            kwargs.get("position_ids"),
            kwargs.get("token_type_ids"),
            kwargs.get("cache_position"),
        )
        aligned = align(step, view, limits, strict=settings.strict, check_values=settings.check_values)
        if aligned is None:
            return original(self, **kwargs)
        _reports.warn_repairs(aligned.repairs)
        positions = aligned.position_ids
        kwargs["attention_mask"] = aligned.attention_mask
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
            return original(self, **kwargs)
        except IndexError as exc:
            # Single-token decode steps skip the value checks (they would synchronise with the device).  On the CPU
            # a bad id or position surfaces as this IndexError: name the value instead.
            explain_index_error(exc, limits, input_ids, aligned.token_type_ids, positions)
            raise

    return _mark(forward)


def aligned_decode_step(
    input_ids: Any, kwargs: dict, layers: int, limits: Limits, read_cache: Any, legacy_cache_rejected: bool
) -> Any:
    """The cache view of a decode step :func:`~neofix._core.align` would leave as it is (see
    :func:`~neofix._core.step_unchanged`, read from the call's arguments and the cache's shapes; no tensor is read),
    or ``None``.  The model forward then calls transformers with the caller's arguments untouched."""
    shape = input_ids.shape
    if len(shape) != 2 or kwargs.get("inputs_embeds") is not None:
        return None
    cache = kwargs["cache"] if "cache" in kwargs else kwargs.get("past_key_values")
    if cache is None or (type(cache) is tuple and legacy_cache_rejected):
        return None
    mask = kwargs.get("attention_mask")
    positions = kwargs.get("position_ids")
    cache_position = kwargs.get("cache_position")
    view = read_cache(cache, layers)
    unchanged = step_unchanged(  # positional: this runs on every decode step
        shape[0],  # batch
        shape[1],  # new tokens
        None if mask is None else mask.shape,
        None if positions is None else positions.shape,
        kwargs.get("token_type_ids") is not None,
        None if cache_position is None else cache_position.shape[-1],
        view,
        limits.max_positions,
    )
    return view if unchanged else None


# id(model) -> (weak reference to it, its layer count, its Limits), read once per model: both are Python-level
# reads (a ModuleList length, transformers' config __getattribute__) worth skipping per step
_FACTS: dict[int, tuple[Any, int, Limits]] = {}


def _model_facts(model: Any, adapter: Any) -> tuple[int, Limits]:
    key = id(model)
    facts = _FACTS.get(key)
    if facts is None or facts[0]() is not model:
        facts = (
            weakref.ref(model, lambda _, key=key: _FACTS.pop(key, None)),
            adapter.layers(model),
            adapter.limits(model.config),
        )
        _FACTS[key] = facts
    return facts[1], facts[2]


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


def make_flash_attention_forward(original: Any, adapter: Any) -> Callable[..., Any]:
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


def make_prepare_inputs_for_generation(original: Any, adapter: Any) -> Callable[..., Any]:
    """``GPTNeoForCausalLM.prepare_inputs_for_generation``: feed exactly the uncached tokens.

    transformers up to 4.35 feeds only the last token whenever a cache is present, which silently drops tokens
    when generation continues from a cache with several new tokens.  Later releases slice correctly, and this
    wrapper then changes nothing.
    """

    slices_uncached = _compat.release() >= (4, 36)  # transformers >= 4.36 feeds the uncached tokens itself

    @functools.wraps(original)
    def prepare_inputs_for_generation(self: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = original(self, *args, **kwargs)
        if slices_uncached:
            return inputs
        return _uncached_inputs(inputs, args, kwargs)

    return _mark(prepare_inputs_for_generation)


def _uncached_inputs(inputs: Any, args: tuple, kwargs: dict) -> Any:
    full = args[0] if args else kwargs.get("input_ids")
    fed = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if full is None or fed is None or is_tracing(full) or full.dim() != 2:
        return inputs
    cache = inputs.get("cache", inputs.get("past_key_values"))
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


def make_generate(original: Any, adapter: Any) -> Callable[..., Any]:
    """``GPTNeoForCausalLM.generate``: refuse, before any forward, a length the model cannot reach."""

    @functools.wraps(original)
    def generate(self: Any, *args: Any, **kwargs: Any) -> Any:
        _check_generate_length(self, args, kwargs)
        return original(self, *args, **kwargs)

    return _mark(generate)


def _check_generate_length(instance: Any, args: tuple, kwargs: dict) -> None:
    prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if prompt is None:
        embeds = kwargs.get("inputs_embeds")
        length = embeds.shape[1] if embeds is not None and embeds.dim() == 3 else None
    else:
        length = prompt.shape[-1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 else None
    if length is not None and not is_tracing(prompt):
        limit = instance.config.max_position_embeddings
        total, reason = _generate_length(instance, kwargs, length)
        # the last token generated is never fed back: the forwards reach total - 1 positions
        if total is not None and total - 1 > limit:
            fit = max(limit + 1 - length, 0)
            raise SequenceTooLongError(
                f"generate would run to {total} tokens ({reason}), feeding the model {total - 1}, but "
                f"config.max_position_embeddings is {limit}: "
                + (
                    f"at most max_new_tokens={fit} fit after this {length}-token prompt"
                    if fit
                    else f"the {length}-token prompt alone is longer than that; shorten it"
                )
            )


def _generate_length(model: Any, kwargs: dict, prompt_length: int) -> tuple[int | None, str]:
    """The length generate may reach, resolved the way transformers does: max_new_tokens wins over max_length."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    max_new = kwargs.get("max_new_tokens")
    max_length = kwargs.get("max_length")
    if max_new is None and max_length is None and config is not None:
        max_new = getattr(config, "max_new_tokens", None)
        if max_new is None:
            max_length = getattr(config, "max_length", None)
    if max_new is not None:
        return prompt_length + max_new, f"a {prompt_length}-token prompt plus max_new_tokens={max_new}"
    if max_length is not None:
        return max(max_length, prompt_length), f"max_length={max_length}"
    return None, ""


def make_prepare_4d_mask_for_float64(original: Any, adapter: Any) -> Callable[..., Any]:
    """``_prepare_4d_causal_attention_mask`` of GPT-Neo's module (transformers 4.36 - 4.44), for float64 models.

    Its causal-mask helper fills a float32 tensor with ``finfo(float64).min`` and raises "value cannot be converted
    to type float without overflow".  GPT-Neo computes attention scores in float32 anyway, so the mask is built in
    float32, which is the dtype it is added to.
    """
    names = ("attention_mask", "input_shape", "inputs_embeds", "past_key_values_length", "sliding_window")

    @functools.wraps(original)
    def prepare_4d_causal_attention_mask(*args: Any, **kwargs: Any) -> Any:
        bound = {**dict(zip(names, args)), **kwargs}
        embeds = bound.get("inputs_embeds")
        if isinstance(embeds, torch.Tensor) and embeds.dtype == torch.float64 and not is_tracing(embeds):
            bound["inputs_embeds"] = torch.empty(0, dtype=torch.float32, device=embeds.device)
            return original(**bound)
        return original(*args, **kwargs)

    return _mark(prepare_4d_causal_attention_mask)


__all__ = [
    "MARK",
    "make_flash_attention_forward",
    "make_generate",
    "make_model_forward",
    "make_prepare_4d_mask_for_float64",
    "make_prepare_inputs_for_generation",
]
