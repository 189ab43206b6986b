"""The wrappers neofix installs on GPT-Neo.  Each is thin: read the step, call the pure core, call the original.

Data flows one way::

    generate ──> prepare_inputs_for_generation ──> GPTNeoModel.forward ──> each attention layer
                 (feed exactly the uncached tokens)  (align the step)        (check this layer's cache)

Every wrapper steps aside while a trace or compilation runs (see :func:`neofix._compat.is_tracing`).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable, NamedTuple

import torch

from ._align import Limits, align, derive_positions, raise_token_id_error
from . import _compat
from ._compat import cache_state, is_tracing, layer_cache_length, positional_names
from ._config import settings
from ._errors import CacheLengthError, MaskLengthError, NeofixError, SequenceTooLongError, warn_once


class StepInfo(NamedTuple):
    """What one ``GPTNeoModel.forward`` was given and what neofix made of it (for traces)."""

    model: Any
    batch: int
    new_tokens: int
    cached_tokens: int | None
    mask_length_given: int | None
    attention_mask: Any
    position_ids: Any
    repairs: tuple[str, ...]


#: Callables receiving a :class:`StepInfo` for every aligned forward (``neofix.trace`` registers here).
STEP_LISTENERS: list[Callable[[StepInfo], None]] = []

# The step being run in this thread/task: (tokens in the cache, the GPTNeoModel).  Attention layers compare
# their own cache length with it.
_STEP: ContextVar[tuple[int | None, Any] | None] = ContextVar("neofix_step", default=None)


def _limits(config: Any) -> Limits:
    return Limits(config.max_position_embeddings, config.vocab_size, config.hidden_size)


def make_model_forward(original: Any) -> Callable[..., Any]:
    """Wrapper for ``GPTNeoModel.forward``: every caller passes here (generate, loops, pipelines, heads)."""
    names = positional_names(original)

    def model_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        first = args[0] if args else kwargs.get("input_ids")
        if first is None:
            first = kwargs.get("inputs_embeds")
        if is_tracing(first):
            return wrapped(*args, **kwargs)
        if args:
            kwargs = {**dict(zip(names, args)), **kwargs}
        cache_key = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(cache_key)
        if type(cache) is tuple and cache and _compat.LEGACY_CACHE_REJECTED:
            kwargs[cache_key] = cache = _legacy_cache(cache, instance.config)
        past, cache_batch = cache_state(cache)
        input_ids = kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        aligned = align(
            input_ids=input_ids,
            inputs_embeds=kwargs.get("inputs_embeds"),
            attention_mask=mask,
            position_ids=kwargs.get("position_ids"),
            token_type_ids=kwargs.get("token_type_ids"),
            cache_position=kwargs.get("cache_position"),
            past_length=past,
            cache_batch=cache_batch,
            limits=_limits(instance.config),
            strict=settings.strict,
            check_values=settings.check_values,
        )
        if aligned is None:
            return wrapped(**kwargs)
        kwargs["attention_mask"] = aligned.attention_mask
        kwargs["position_ids"] = aligned.position_ids
        if "token_type_ids" in kwargs:
            kwargs["token_type_ids"] = aligned.token_type_ids
        if "cache_position" in kwargs:
            kwargs["cache_position"] = aligned.cache_position
        if STEP_LISTENERS:
            info = StepInfo(
                instance,
                aligned.batch,
                aligned.new_tokens,
                past,
                None if mask is None else mask.shape[-1],
                aligned.attention_mask,
                aligned.position_ids,
                aligned.repairs,
            )
            for listener in tuple(STEP_LISTENERS):
                listener(info)
        token = _STEP.set((past, instance))
        try:
            return wrapped(**kwargs)
        except IndexError as exc:
            # Single-token decode steps skip the id check (it would synchronise with the device).  On the CPU a
            # bad id surfaces as this IndexError: name the id instead.
            if input_ids is not None and not aligned.values_checked:
                raise_token_id_error(input_ids, instance.config.vocab_size, exc)
            raise
        finally:
            _STEP.reset(token)

    return model_forward


def _legacy_cache(legacy: tuple, config: Any) -> Any:
    described = (
        f"a legacy tuple cache was passed, which transformers {_compat.transformers_version()} no longer accepts"
    )
    if settings.strict:
        raise NeofixError(
            f"{described}: pass the Cache object the model returned (outputs.past_key_values), or wrap the tuple "
            f"in transformers.DynamicCache"
        )
    warn_once("legacy_cache", f"neofix: {described}; wrapped it in a DynamicCache. Reported once.")
    return _compat.cache_from_legacy(legacy, config)


def attention_forward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper for the GPT-Neo self-attention forward: this layer's cache must hold what layer 0 holds."""
    step = _STEP.get()
    if step is not None and step[0] is not None:
        layer_past = kwargs["layer_past"] if "layer_past" in kwargs else (args[2] if len(args) > 2 else None)
        held = layer_cache_length(layer_past, getattr(instance, "layer_id", None))
        if held is not None and held != step[0]:
            layer = _layer_index(step[1], instance)
            raise CacheLengthError(
                f"cache layer {layer} holds {held} tokens, but layer 0 holds {step[0]}: every layer of the cache "
                f"must hold the same tokens. Was the cache built for another model, cropped or edited per layer?"
            )
    return wrapped(*args, **kwargs)


def _layer_index(model: Any, attention: Any) -> Any:
    layer_id = getattr(attention, "layer_id", None)
    if layer_id is not None:
        return layer_id
    for index, block in enumerate(getattr(model, "h", ())):
        if block.attn.attention is attention:
            return index
    return "?"  # pragma: no cover - an attention module outside its model


def prepare_inputs_for_generation(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper for ``GPTNeoForCausalLM.prepare_inputs_for_generation``: feed exactly the uncached tokens.

    transformers up to 4.35 feeds only the last token whenever a cache is present, which silently drops tokens
    when generation continues from a cache with several new tokens.  Later releases slice correctly, and this
    wrapper then changes nothing.
    """
    inputs = wrapped(*args, **kwargs)
    full = args[0] if args else kwargs.get("input_ids")
    fed = inputs.get("input_ids") if isinstance(inputs, dict) else None
    if full is None or fed is None or is_tracing(full) or full.dim() != 2:
        return inputs
    cache = inputs.get("cache", inputs.get("past_key_values"))
    if cache is None:
        return inputs
    past, _ = cache_state(cache)
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
        inputs["position_ids"] = (
            derive_positions(mask, uncached) if mask is not None and mask.dim() == 2 else None
        )
    token_types = inputs.get("token_type_ids")
    if token_types is not None and token_types.shape[-1] != uncached:
        full_types = kwargs.get("token_type_ids")
        inputs["token_type_ids"] = full_types[:, past:] if full_types is not None else None
    warn_once("generate_sliced", f"neofix: {described}; fed the uncached tokens. Reported once.")
    return inputs


def generate(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper for ``GPTNeoForCausalLM.generate``: refuse, before any forward, a length the model cannot reach."""
    prompt = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
    if prompt is None:
        embeds = kwargs.get("inputs_embeds")
        length = embeds.shape[1] if embeds is not None and embeds.dim() == 3 else None
    else:
        length = prompt.shape[-1] if isinstance(prompt, torch.Tensor) and prompt.dim() >= 1 else None
    if length is not None and not is_tracing(prompt):
        limit = instance.config.max_position_embeddings
        total, reason = _generate_length(instance, kwargs, length)
        if total is not None and total > limit:
            fit = max(limit - length, 0)
            raise SequenceTooLongError(
                f"generate would run to {total} tokens ({reason}), but config.max_position_embeddings is "
                f"{limit}: "
                + (
                    f"at most max_new_tokens={fit} fit after this {length}-token prompt"
                    if fit
                    else f"the {length}-token prompt already fills every position; shorten it"
                )
            )
    return wrapped(*args, **kwargs)


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


def prepare_4d_mask_float64(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Wrapper for ``_prepare_4d_causal_attention_mask`` (transformers 4.36 - 4.44) in float64.

    Its causal-mask helper fills a float32 tensor with ``finfo(float64).min`` and raises "value cannot be converted
    to type float without overflow".  GPT-Neo computes attention scores in float32 anyway, so the mask is built in
    float32, which is the dtype it is added to.
    """
    names = ("attention_mask", "input_shape", "inputs_embeds", "past_key_values_length", "sliding_window")
    bound = {**dict(zip(names, args)), **kwargs}
    embeds = bound.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dtype == torch.float64 and not is_tracing(embeds):
        bound["inputs_embeds"] = torch.empty(0, dtype=torch.float32, device=embeds.device)
        return wrapped(**bound)
    return wrapped(*args, **kwargs)


__all__ = [
    "STEP_LISTENERS",
    "StepInfo",
    "attention_forward",
    "generate",
    "make_model_forward",
    "prepare_4d_mask_float64",
    "prepare_inputs_for_generation",
]
