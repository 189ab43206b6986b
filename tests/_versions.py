"""The one place tests ask which transformers release is installed and what it has.

Tests use :func:`requires` so that a feature a release lacks is skipped with a reason, never passed silently.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import transformers
from packaging.version import Version

TF = Version(transformers.__version__)
TF_RELEASE = TF.release[:2]

#: feature -> (first release that has it, why it matters)
FEATURES = {
    "assisted decoding": ((4, 29), "generate(assistant_model=...) arrived in transformers 4.29"),
    "prompt lookup": ((4, 37), "generate(prompt_lookup_num_tokens=...) arrived in transformers 4.37"),
    "Cache objects": ((4, 36), "transformers.cache_utils.DynamicCache arrived in 4.36"),
    "generate returns its cache": ((4, 36), "generate's outputs hold past_key_values from transformers 4.36"),
    "legacy tuple caches": ((0, 0), ""),
    "float64 mask bug": ((4, 36), "only transformers 4.36 - 4.44 build the causal mask through the buggy helper"),
    "fx tracing": ((0, 0), ""),
    "flash-attention-2 class": ((4, 36), "GPTNeoFlashAttention2 arrived in transformers 4.36"),
    "attention layers get the whole cache": (
        (4, 45),
        "up to 4.44 each GPT-Neo attention layer gets its own (key, value) pair; from 4.45 the whole Cache object",
    ),
    "GPT-J rotary positions": (
        (4, 28),
        "GPT-J's attention looks its position_ids up from transformers 4.28 (before, it ignores them)",
    ),
    "OPT static caches": ((4, 49), "OPT's decoder takes a StaticCache from transformers 4.49 (before, it subscripts it)"),
    "cache layer objects": (
        (4, 56),
        "transformers 4.56 made Cache objects hold one layer object (DynamicLayer) per layer; before, key lists",
    ),
    "generate slices uncached tokens": (
        (4, 36),
        "before 4.36 GPT-Neo's prepare_inputs_for_generation fed only the last token when a cache was given",
    ),
}


def has(feature: str) -> bool:
    if feature in PROBES:  # features told by looking at the installed packages (appended below)
        return PROBES[feature]()
    if feature == "legacy tuple caches":  # GPT-Neo's forward rejects them from 4.54 on (neofix converts them)
        return True
    if feature == "float64 mask bug":
        return (4, 36) <= TF_RELEASE < (4, 45)
    if feature == "fx tracing":
        try:
            from transformers.utils import fx  # noqa: F401
        except Exception:
            return False
        return True
    first, _ = FEATURES[feature]
    return TF_RELEASE >= first


def requires(feature: str) -> pytest.MarkDecorator:
    reason = FEATURES[feature][1] or f"{feature} is not available"
    return pytest.mark.skipif(not has(feature), reason=f"{reason}; installed: transformers {TF}")


def cache_keyword(model=None) -> str:
    """The keyword a model (default: the installed GPT-Neo) takes its cache under."""
    if model is None:
        from transformers import GPTNeoForCausalLM

        model = GPTNeoForCausalLM
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd model: the model it compiled
    forward = type(model).forward if not isinstance(model, type) else model.forward
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def output_cache(outputs):
    """The cache a model output carries (``.cache`` on transformers 5.x, ``.past_key_values`` before)."""
    if "cache" in outputs.keys():
        return outputs["cache"]
    return outputs["past_key_values"]


def legacy(cache):
    """The cache as a legacy tuple of (key, value) pairs, whatever the installed release returned (GPT-BigCode up to
    4.53: of its layers, each one tensor fusing keys and values)."""
    if isinstance(cache, tuple):
        return cache
    if isinstance(cache, list) and cache and isinstance(cache[0], torch.Tensor):
        return tuple(cache)
    cache = getattr(cache, "self_attention_cache", cache)  # GPT-BigCode 4.57: an EncoderDecoderCache (no cross keys)
    if hasattr(cache, "layers"):
        return tuple((layer.keys, layer.values) for layer in cache.layers)
    if hasattr(cache, "key_cache"):
        return tuple(zip(cache.key_cache, cache.value_cache))
    return tuple(tuple(layer) for layer in cache)


def as_cache_object(cache):
    """The cache as a ``DynamicCache`` (skip on releases without Cache objects)."""
    from neofix import _caches

    if not isinstance(cache, tuple):
        return cache
    from transformers import GPTNeoConfig

    return _caches.from_legacy(cache, GPTNeoConfig())


DTYPE = torch.float64


# -- the never-break paths (tests/test_never_break*.py): tracers, exporters and heads some releases lack ----------


def _dynamic_layer():
    """transformers' ``DynamicLayer`` class (4.56 and later), or ``None``."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None
    return DynamicLayer


def _importable(*modules: str) -> bool:
    """Whether the modules are installed (found, not imported: collection stays fast)."""
    from importlib.util import find_spec

    try:
        return all(find_spec(module) is not None for module in modules)
    except (ImportError, ValueError):  # a parent package missing or broken
        return False


def _hf_fx_traces_gpt_neo() -> bool:
    if not _importable("transformers.utils.fx"):
        return False
    from transformers.utils import fx

    return "gpt_neo" in getattr(fx, "_REGULAR_SUPPORTED_MODEL_NAMES_AND_TASKS", ())


FEATURES.update(
    {
        "transformers fx tracer": (
            (0, 0),
            "transformers.utils.fx (symbolic_trace, HFTracer) with GPT-Neo support exists up to 4.57; transformers "
            "5.0 removed it",
        ),
        "GPTNeoForQuestionAnswering": ((4, 29), "transformers.GPTNeoForQuestionAnswering arrived in transformers 4.29"),
        "GPTNeoForTokenClassification": (
            (4, 29),
            "transformers.GPTNeoForTokenClassification arrived in transformers 4.29",
        ),
        "left-padded sequence classification": (
            (4, 36),
            "GPTNeoForSequenceClassification pools the last token of a left-padded row from transformers 4.36 on "
            "(before, it pooled the token at index count(non-pad) - 1, right padding only)",
        ),
        "sink caches": ((0, 0), "transformers.SinkCache exists from 4.36 to 4.52"),
        "onnx": ((0, 0), "torch.onnx.export needs the onnx package (pip install 'transformers-neofix[test]')"),
        "onnxscript": (
            (0, 0),
            "torch.onnx.export(dynamo=True) needs the onnx and onnxscript packages "
            "(pip install 'transformers-neofix[test]')",
        ),
        "onnxruntime": (
            (0, 0),
            "running an exported ONNX model needs onnxruntime (pip install 'transformers-neofix[test]')",
        ),
    }
)

def _static_caches() -> bool:
    try:
        from transformers.cache_utils import StaticCache  # noqa: F401
        from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoPreTrainedModel
    except ImportError:
        return False
    # generate refuses them where the model class says it lacks them: up to 4.53 by _supports_static_cache, on 4.54 -
    # 4.55 by _can_compile_fullgraph (both False for GPT-Neo); from 4.56 it asks neither
    if TF_RELEASE < (4, 54):
        return getattr(GPTNeoPreTrainedModel, "_supports_static_cache", False) is True
    if TF_RELEASE < (4, 56):
        return getattr(GPTNeoPreTrainedModel, "_can_compile_fullgraph", False) is True
    return True


def _sink_caches() -> bool:
    """Whether transformers' ``SinkCache`` runs (4.36 - 4.52; 4.53 and later keep a stub that raises)."""
    try:
        transformers.SinkCache(window_length=4, num_sink_tokens=1)
    except (AttributeError, NotImplementedError):
        return False
    return True


FEATURES.update(
    {
        "contrastive search": (
            (0, 0),
            "generate(penalty_alpha=..., top_k=...) runs in transformers up to 4.55 (4.56 moved it to a Hub repository, "
            "which needs trust_remote_code and a download)",
        ),
        "DoLa decoding": (
            (4, 43),
            "generate(dola_layers=...) runs in transformers 4.43 - 4.55 (4.56 moved it to a Hub repository)",
        ),
        "StaticCache": ((4, 38), "transformers.StaticCache arrived in transformers 4.38"),
        "generate slices given positions": (
            (4, 46),
            "generate(position_ids=...) feeds a decode step the prompt's positions whole up to 4.45 (a shape error in "
            "vanilla, a PositionError with neofix)",
        ),
        "attention interfaces": (
            (0, 0),
            "transformers.AttentionInterface and masking_utils.AttentionMaskInterface (registering an attention and "
            "its mask) arrived in transformers 4.53",
        ),
        "group and constrained beam search": (
            (0, 0),
            "generate(num_beam_groups=...) and generate(force_words_ids=...) run in transformers up to 4.56 (4.57 moved "
            "them to Hub repositories)",
        ),
    }
)

FEATURES["static caches"] = (
    (0, 0),
    "generate(cache_implementation='static') works for GPT-Neo from transformers 4.56 (before, it is refused)",
)

#: feature -> how to tell whether the installed packages have it (consulted first by :func:`has`)
PROBES = {
    "static caches": _static_caches,
    "transformers fx tracer": _hf_fx_traces_gpt_neo,
    "GPTNeoForQuestionAnswering": lambda: hasattr(transformers, "GPTNeoForQuestionAnswering"),
    "GPTNeoForTokenClassification": lambda: hasattr(transformers, "GPTNeoForTokenClassification"),
    "cache layer objects": lambda: _dynamic_layer() is not None,
    "sink caches": lambda: _sink_caches(),
    "onnx": lambda: _importable("onnx"),
    "onnxscript": lambda: _importable("onnx", "onnxscript"),
    "onnxruntime": lambda: _importable("onnxruntime"),
    "StaticCache": lambda: hasattr(transformers, "StaticCache"),
    "attention interfaces": lambda: _importable("transformers.masking_utils") and hasattr(transformers, "AttentionInterface"),
    "contrastive search": lambda: TF_RELEASE < (4, 56),
    "DoLa decoding": lambda: (4, 43) <= TF_RELEASE < (4, 56),
    "group and constrained beam search": lambda: TF_RELEASE < (4, 57),
}

