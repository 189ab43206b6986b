"""Test helpers: tiny random models of every patched family (GPT-Neo first) and the full-recompute reference every
correctness check compares with.

The reference runs one forward over the whole sequence, without a cache, with the attention mask and
``position_ids = (cumsum(mask) - 1).clamp(min=0)``: a left-padded row then produces exactly the tokens of the same
prompt alone.  Nothing here downloads anything.

For your own CI (the pytest plugin provides the ``gpt_neo_tiny`` fixture): :func:`assert_generation_consistent`
compares cached ``generate`` with the reference token for token, :func:`assert_steps_aligned` checks a
:func:`neofix.trace` against the decoding step contract.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "FAMILY_CONFIGS",
    "assert_generation_consistent",
    "assert_steps_aligned",
    "reference_greedy",
    "reference_logits",
    "reference_positions",
    "tiny_config",
    "tiny_gpt_neo",
    "tiny_gpt_neo_config",
    "tiny_model",
]

#: Defaults of :func:`tiny_gpt_neo_config`: global and local layers, a window of 4 so that short tests cross it.
TINY_CONFIG: dict[str, Any] = dict(
    vocab_size=96,
    max_position_embeddings=64,
    hidden_size=32,
    num_layers=4,
    num_heads=4,
    attention_types=[[["global", "local"], 2]],
    window_size=4,
    intermediate_size=64,
    embed_dropout=0.0,
    attention_dropout=0.0,
    resid_dropout=0.0,
    initializer_range=0.3,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)

#: The output layer is scaled by this much, so that the top two logits never sit within rounding of each other.
SHARPEN = 50.0


def tiny_gpt_neo_config(**overrides: Any) -> Any:
    """A ``GPTNeoConfig`` for a tiny model; ``attention_types`` is rebuilt when only ``num_layers`` changes."""
    from transformers import GPTNeoConfig

    values = dict(TINY_CONFIG)
    if "num_layers" in overrides and "attention_types" not in overrides:
        layers = overrides["num_layers"]
        values["attention_types"] = [[["global", "local"], layers // 2]] + ([[["global"], 1]] if layers % 2 else [])
    values.update(overrides)
    return GPTNeoConfig(**values)


def tiny_gpt_neo(seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides: Any) -> Any:
    """An eval-mode, randomly initialised ``GPTNeoForCausalLM`` with global and local layers (no download).

    The weights depend only on ``seed`` and the config; the output layer is sharpened so that greedy decoding
    never sits on a near-tie, which lets tests compare tokens exactly.
    """
    from transformers import GPTNeoForCausalLM

    return _built(GPTNeoForCausalLM, tiny_gpt_neo_config(**config_overrides), seed, dtype)


def _built(model_class: Any, config: Any, seed: int, dtype: torch.dtype) -> Any:
    """``model_class(config)`` initialised from ``seed`` (the global RNG left as it was), its output layer sharpened,
    in ``dtype`` and eval mode."""
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config)
    finally:
        torch.random.set_rng_state(state)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(SHARPEN)
    return model.to(dtype).eval()


#: Per model family: its config class and causal-LM class in transformers, and the config of its tiny model: a few
#: layers of width 32, a vocabulary of 96 and 64 positions (where the family has a table), token 0 as bos, eos and pad.
FAMILY_CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", TINY_CONFIG),
}

_COMMON: dict[str, Any] = dict(vocab_size=96, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)

FAMILY_CONFIGS["gpt2"] = (
    "GPT2Config",
    "GPT2LMHeadModel",
    dict(
        _COMMON, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, initializer_range=0.3,
    ),
)
#: GPT-J and CodeGen: rotary positions on half of each head's 8 dimensions (``rotary_dim``), as GPT-J itself rotates
#: part of each head; a table of 64 positions (``n_positions``).
_GPTJ: dict[str, Any] = dict(
    _COMMON, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_inner=64, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3,
)
FAMILY_CONFIGS["gptj"] = ("GPTJConfig", "GPTJForCausalLM", _GPTJ)
FAMILY_CONFIGS["codegen"] = ("CodeGenConfig", "CodeGenForCausalLM", dict(_GPTJ, n_ctx=64))
#: GPT-NeoX: rotary positions on half of each head (``rotary_pct``; transformers 5.x reads it into
#: ``rope_parameters``), 64 positions (``max_position_embeddings``: a table only up to 4.35, see its adapter).
FAMILY_CONFIGS["gpt_neox"] = (
    "GPTNeoXConfig",
    "GPTNeoXForCausalLM",
    dict(
        _COMMON, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, rotary_pct=0.5, attention_dropout=0.0, hidden_dropout=0.0, initializer_range=0.3,
    ),
)
#: OPT: a table of 64 positions for real tokens (plus OPT's offset of 2).
FAMILY_CONFIGS["opt"] = (
    "OPTConfig",
    "OPTForCausalLM",
    dict(
        _COMMON, max_position_embeddings=64, hidden_size=32, word_embed_proj_dim=32, num_hidden_layers=2,
        num_attention_heads=4, ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, layerdrop=0.0,
        init_std=0.3,
    ),
)
#: BLOOM: ALiBi, no position table.
FAMILY_CONFIGS["bloom"] = (
    "BloomConfig",
    "BloomForCausalLM",
    dict(_COMMON, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.3),
)

#: GPT-BigCode: learned positions (a table of 64, ``n_positions``), multi-query attention (its default: one
#: key-value head of width 8 for the 4 query heads).
FAMILY_CONFIGS["gpt_bigcode"] = (
    "GPTBigCodeConfig",
    "GPTBigCodeForCausalLM",
    dict(
        _COMMON, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64, multi_query=True, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.3,
    ),
)

#: Llama: rotary positions, grouped-query attention (4 query heads share 2 key-value heads), 64 positions
#: (``max_position_embeddings``: no table, the rotary embedding extrapolates).
FAMILY_CONFIGS["llama"] = (
    "LlamaConfig",
    "LlamaForCausalLM",
    dict(
        _COMMON, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, attention_dropout=0.0, initializer_range=0.3,
    ),
)

#: Mistral: Llama's shape with a sliding window of 4 (``sliding_window``), so that short tests cross it.
FAMILY_CONFIGS["mistral"] = (
    "MistralConfig",
    "MistralForCausalLM",
    dict(FAMILY_CONFIGS["llama"][2], sliding_window=4),
)
#: Mixtral: Mistral's shape (window 4) with four experts, two per token, run one by one (``experts_implementation``
#: "eager", read from 5.0: the grouped matrix products 5.x picks by default take no float64; earlier releases keep the
#: keyword as an attribute they never read).
FAMILY_CONFIGS["mixtral"] = (
    "MixtralConfig",
    "MixtralForCausalLM",
    dict(FAMILY_CONFIGS["mistral"][2], num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"),
)

#: Qwen2: Llama's shape with biased query, key and value projections (no sliding window: ``use_sliding_window`` off).
FAMILY_CONFIGS["qwen2"] = ("Qwen2Config", "Qwen2ForCausalLM", dict(FAMILY_CONFIGS["llama"][2]))
#: Qwen2-MoE: Qwen2's shape with four experts in every layer, two per token, and a shared expert, run one by one (as
#: Mixtral's).
FAMILY_CONFIGS["qwen2_moe"] = (
    "Qwen2MoeConfig",
    "Qwen2MoeForCausalLM",
    dict(
        FAMILY_CONFIGS["qwen2"][2], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, decoder_sparse_step=1, experts_implementation="eager",
    ),
)
#: Qwen3: Llama's shape with normalised queries and keys; ``head_dim`` set (its default is 128).
FAMILY_CONFIGS["qwen3"] = ("Qwen3Config", "Qwen3ForCausalLM", dict(FAMILY_CONFIGS["llama"][2], head_dim=8))
#: Qwen3-MoE: Qwen3's shape with four experts in every layer, two per token, run one by one (as Mixtral's).
FAMILY_CONFIGS["qwen3_moe"] = (
    "Qwen3MoeConfig",
    "Qwen3MoeForCausalLM",
    dict(
        FAMILY_CONFIGS["qwen3"][2], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        decoder_sparse_step=1, experts_implementation="eager",
    ),
)
#: Gemma2: alternating sliding-window (window 4) and global layers, ``head_dim`` set (its default is 256); no final
#: logit soft-capping, whose tanh would flatten the sharpened output layer into ties.
_GEMMA: dict[str, Any] = dict(
    FAMILY_CONFIGS["llama"][2], head_dim=8, sliding_window=4, query_pre_attn_scalar=8, final_logit_softcapping=None,
)
FAMILY_CONFIGS["gemma2"] = ("Gemma2Config", "Gemma2ForCausalLM", _GEMMA)
#: Gemma3 (text): Gemma2's shape, a sliding layer then a global one (``sliding_window_pattern`` up to 4.52,
#: ``layer_types`` from 4.53).
FAMILY_CONFIGS["gemma3"] = (
    "Gemma3TextConfig",
    "Gemma3ForCausalLM",
    dict(_GEMMA, sliding_window_pattern=2, layer_types=["sliding_attention", "full_attention"]),
)
#: Gemma: Llama's shape with ``head_dim`` set (its default is 256).
FAMILY_CONFIGS["gemma"] = ("GemmaConfig", "GemmaForCausalLM", dict(FAMILY_CONFIGS["llama"][2], head_dim=8))
#: Phi (Phi-1, Phi-1.5, Phi-2): Llama's shape with rotary positions on half of each head (``partial_rotary_factor``;
#: 4.36 gives the cache every query head: its config takes no ``num_key_value_heads``).
FAMILY_CONFIGS["phi"] = (
    "PhiConfig",
    "PhiForCausalLM",
    dict(FAMILY_CONFIGS["llama"][2], partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0),
)
#: Phi3: Llama's shape with fused projections (no sliding window).
FAMILY_CONFIGS["phi3"] = (
    "Phi3Config", "Phi3ForCausalLM", dict(FAMILY_CONFIGS["llama"][2], resid_pdrop=0.0, embd_pdrop=0.0),
)
#: Granite: Llama's shape with its multipliers away from 1 (embeddings, residual branches, attention scores, logits),
#: so that a forward that skipped one would differ.
FAMILY_CONFIGS["granite"] = (
    "GraniteConfig",
    "GraniteForCausalLM",
    dict(
        FAMILY_CONFIGS["llama"][2], embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.25,
        logits_scaling=0.5,
    ),
)
#: SmolLM3: Llama's shape with rotary positions in the first layer and none in the second (``no_rope_layers``: 1 where
#: a layer has them); ``head_dim`` set (its default is 128).
FAMILY_CONFIGS["smollm3"] = (
    "SmolLM3Config", "SmolLM3ForCausalLM", dict(FAMILY_CONFIGS["llama"][2], head_dim=8, no_rope_layers=[1, 0]),
)
#: GPT-OSS: Gemma3's layout (a sliding-window layer of window 4, then a full one; ``head_dim`` set, its default is 64)
#: with four experts in every layer, two per token, run one by one (as Mixtral's), and an attention sink per head.
FAMILY_CONFIGS["gpt_oss"] = (
    "GptOssConfig",
    "GptOssForCausalLM",
    dict(
        FAMILY_CONFIGS["llama"][2], head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager",
    ),
)
#: Falcon (Falcon-7B's layout): rotary positions (``alibi`` off), multi-query attention (one key-value head of width 8
#: for the 4 query heads), attention and MLP in parallel, no biases, no dropout; 64 positions
#: (``max_position_embeddings``: no table, the rotary embedding extrapolates).  ``tiny_model("falcon", alibi=True)``
#: builds the ALiBi kind (Falcon-RW's).
FAMILY_CONFIGS["falcon"] = (
    "FalconConfig",
    "FalconForCausalLM",
    dict(
        _COMMON, max_position_embeddings=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        multi_query=True, new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=False,
        hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.3,
    ),
)
#: Starcoder2: Mistral's shape (window 4) with biased projections and LayerNorm; no dropout.
FAMILY_CONFIGS["starcoder2"] = (
    "Starcoder2Config",
    "Starcoder2ForCausalLM",
    dict(FAMILY_CONFIGS["mistral"][2], residual_dropout=0.0, embedding_dropout=0.0),
)
#: OLMo2: Llama's shape with normalised queries and keys, the norms after attention and MLP.
FAMILY_CONFIGS["olmo2"] = ("Olmo2Config", "Olmo2ForCausalLM", dict(FAMILY_CONFIGS["llama"][2]))
#: OLMo (the first): Llama's shape with a layer norm without parameters, queries, keys and values clipped at 8
#: (``clip_qkv``, as OLMo-7B-0424's).
FAMILY_CONFIGS["olmo"] = ("OlmoConfig", "OlmoForCausalLM", dict(FAMILY_CONFIGS["llama"][2], clip_qkv=8.0))
#: Cohere: Llama's shape with interleaved rotary pairs, attention and MLP in parallel, its logits scaled by its default
#: ``logit_scale`` (1/16); ``use_qk_norm`` off, its default.
FAMILY_CONFIGS["cohere"] = ("CohereConfig", "CohereForCausalLM", dict(FAMILY_CONFIGS["llama"][2]))


def tiny_config(family: str = "gpt_neo", **overrides: Any) -> Any:
    """The config of a tiny model of ``family`` (a key of :data:`FAMILY_CONFIGS`), with ``overrides``."""
    if family == "gpt_neo":
        return tiny_gpt_neo_config(**overrides)
    if family not in FAMILY_CONFIGS:
        raise ValueError(f"neofix.testing: no tiny model for family {family!r}; choose from {sorted(FAMILY_CONFIGS)}")
    config_class, _, values = FAMILY_CONFIGS[family]
    return _transformers_class(config_class, family)(**{**values, **overrides})


def tiny_model(family: str = "gpt_neo", seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """An eval-mode, randomly initialised causal LM of ``family`` built from :func:`tiny_config` (no download).

    The weights depend only on ``seed`` and the config; the output layer is sharpened so that greedy decoding never
    sits on a near-tie, which lets tests compare tokens exactly.  ``tiny_model("gpt_neo")`` is :func:`tiny_gpt_neo`.
    """
    if family == "gpt_neo":
        return tiny_gpt_neo(seed, dtype, **overrides)
    config = tiny_config(family, **overrides)  # (an unknown family: its ValueError)
    return _built(_transformers_class(FAMILY_CONFIGS[family][1], family), config, seed, dtype)


def _transformers_class(name: str, family: str) -> Any:
    """``transformers.<name>``; a family this release does not have is a ``ValueError`` that says so."""
    import transformers

    found = getattr(transformers, name, None)
    if found is None:
        raise ValueError(
            f"neofix.testing: transformers {transformers.__version__} has no {name}, so it has no tiny {family!r} "
            f"model (neofix's \"Families and releases\" page lists the release each family needs)"
        )
    return found


def reference_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(cumsum(mask) - 1).clamp(min=0)``: the position of every column of a 2D mask, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def reference_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of one cache-free forward over the whole sequence, with mask-derived positions."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    kwargs = {}
    if _takes_positions(model):  # a model without position_ids (ALiBi, or derived from the mask) reads the mask
        kwargs["position_ids"] = reference_positions(attention_mask)
    return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs).logits


def _takes_positions(model: Any) -> bool:
    import inspect

    model = getattr(model, "_orig_mod", model)  # a torch.compile'd model: the model it compiled
    return "position_ids" in inspect.signature(type(model).forward).parameters


@torch.no_grad()
def reference_greedy(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 16,
    *,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
) -> torch.Tensor:
    """Greedy decoding by full recompute: every step reruns the whole sequence.  Returns prompt + new tokens.

    With ``eos_token_id`` it ends rows the way ``generate`` does: after a row's end-of-sequence token it gets
    ``pad_token_id`` (default: the first eos id), and decoding stops once every row has ended.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    eos = _ids(eos_token_id)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    sequences, mask = input_ids, attention_mask
    ended = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for _ in range(max_new_tokens):
        next_tokens = reference_logits(model, sequences, mask)[:, -1].argmax(-1)
        if eos:
            next_tokens = torch.where(ended, torch.full_like(next_tokens, pad_token_id), next_tokens)  # type: ignore[arg-type]
            ended = ended | torch.isin(next_tokens, torch.tensor(eos, device=next_tokens.device))
        sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
        if eos and bool(ended.all()):
            break
    return sequences


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.flatten().tolist()]
    if isinstance(value, (list, tuple, set)):
        return [int(v) for v in value]
    return [int(value)]


# -- assertions for your own CI --------------------------------------------------------------------------------------

_SAMPLING = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1}


def assert_generation_consistent(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 16,
    **generate_kwargs: Any,
) -> None:
    """Check that cached ``model.generate`` (greedy) produces exactly the tokens of the full-recompute reference.

    Runs ``model.generate(input_ids, attention_mask=..., max_new_tokens=..., do_sample=False, **generate_kwargs)``
    under :func:`neofix.trace`, then :func:`reference_greedy` (one cache-free forward per token, mask-derived
    positions, rows ending at ``eos_token_id`` as generate ends them).  On a difference it raises
    ``AssertionError`` naming the first diverging step and row, the two tokens, how strongly the reference prefers
    its token, and the shapes of the forward that produced it.

    ``generate_kwargs`` must keep decoding greedy and the scores unprocessed (``assistant_model=``,
    ``prompt_lookup_num_tokens=``, ``eos_token_id=``, ``pad_token_id=`` are fine; sampling and beams are refused,
    logits processors would make the comparison meaningless).  Compare exactly only where the top two logits never
    sit within rounding of each other: a float64 or sharpened model (like ``gpt_neo_tiny``) is safest; the message
    reports the reference's margin so that a near-tie can be told from a bug.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, then this assertion's message
    from ._trace import trace

    _check_greedy_call(model, input_ids, max_new_tokens, generate_kwargs)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    eos = generate_kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    pad = generate_kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
    if pad is None and _ids(eos):
        pad = _ids(eos)[0]
    kwargs = {**_SAMPLING, "max_new_tokens": max_new_tokens, **generate_kwargs}
    if pad is not None:
        kwargs["pad_token_id"] = pad

    with torch.no_grad(), trace(model) as steps:
        output = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
    generated = getattr(output, "sequences", output)
    expected = reference_greedy(
        model, input_ids, attention_mask, max_new_tokens, eos_token_id=eos, pad_token_id=pad
    ).to(generated.device)

    prompt = input_ids.shape[1]
    common = min(generated.shape[1], expected.shape[1])
    differs = generated[:, prompt:common] != expected[:, prompt:common]
    if not bool(differs.any()):
        if generated.shape[1] != expected.shape[1]:
            raise AssertionError(
                f"cached generation produced {generated.shape[1] - prompt} new tokens, the full-recompute reference "
                f"{expected.shape[1] - prompt} (the tokens they share agree): a stopping criterion the reference does "
                f"not know about?\n{_describe_trace(steps)}"
            )
        return
    raise AssertionError(_first_difference(model, attention_mask, generated, expected, differs, prompt, eos, steps))


def _check_greedy_call(model: Any, input_ids: Any, max_new_tokens: Any, generate_kwargs: dict) -> None:
    """Refuse a call :func:`assert_generation_consistent` cannot compare with its greedy reference."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"assert_generation_consistent: input_ids must be a (batch, length) tensor, got {shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"assert_generation_consistent: max_new_tokens must be a positive int, got {max_new_tokens!r}")
    for name, greedy in _SAMPLING.items():
        if name in generate_kwargs and generate_kwargs[name] not in (None, greedy):
            raise ValueError(
                f"assert_generation_consistent compares greedy decoding with its reference: {name}="
                f"{generate_kwargs[name]!r} is not greedy (leave it out)"
            )
    if getattr(model, "training", False):
        raise ValueError("assert_generation_consistent: the model is in training mode (dropout); call model.eval()")


def _first_difference(
    model: Any, attention_mask: Any, generated: Any, expected: Any, differs: Any, prompt: int, eos: Any, steps: Any
) -> str:
    """The message of a difference: the first diverging step and row, the two tokens, the reference's margin and the
    forward that produced it."""
    step = int(differs.any(0).nonzero()[0, 0])
    rows = differs[:, step].nonzero()[:, 0].tolist()
    row = rows[0]
    column = prompt + step
    got, want = int(generated[row, column]), int(expected[row, column])
    lines = [
        f"cached generation differs from the full-recompute reference: first at step {step} (new token {step}, "
        f"sequence column {column}), row {row}: generate produced {got}, the reference {want}"
        + (f"; rows differing at that step: {rows}" if len(rows) > 1 else "")
    ]
    ended = bool(set(_ids(eos)) & set(expected[row, prompt:column].tolist()))
    if not ended:
        logits = reference_logits(model, expected[row : row + 1, :column], _reference_mask(attention_mask, row, column))
        margin = float(logits[0, -1, want] - logits[0, -1, got])
        lines.append(
            f"the reference prefers {want} over {got} by {margin:.6g} logits"
            + (" (within rounding: a near-tie, not necessarily a bug)" if margin < _tie(logits) else "")
        )
    producer = _producer(steps, column)
    lines.append(
        f"the forward that produced it: {producer}" if producer is not None else "no traced forward produced it"
    )
    lines.append(_describe_trace(steps))
    return "\n".join(lines)


def _reference_mask(attention_mask: torch.Tensor, row: int, column: int) -> torch.Tensor:
    mask = attention_mask[row : row + 1]
    extra = column - mask.shape[1]
    return torch.cat([mask, mask.new_ones((1, extra))], dim=-1) if extra > 0 else mask[:, :column]


def _tie(logits: torch.Tensor) -> float:
    scale = max(1.0, float(logits[0, -1].abs().max()))
    return float(torch.finfo(logits.dtype).eps) ** 0.5 * scale


def _producer(steps: list[Any], column: int) -> Any:
    """The last traced forward whose logits predicted sequence ``column`` (it fed columns cached .. cached+new-1)."""
    found = None
    for step in steps:
        if step.cached_tokens is not None and step.cached_tokens + 1 <= column <= step.cached_tokens + step.new_tokens:
            found = step
    return found


def _describe_trace(steps: list[Any], limit: int = 40) -> str:
    if not steps:
        return "neofix.trace recorded no forward (a compiled or traced model?)"
    shown = [f"  {step}" for step in steps[:limit]]
    more = [f"  ... {len(steps) - limit} more"] if len(steps) > limit else []
    return "\n".join([f"trace ({len(steps)} forwards):", *shown, *more])


def assert_steps_aligned(steps: Any) -> None:
    """Check a trace recorded by :func:`neofix.trace` against the decoding step contract.

    * after a prefill (a step with an empty cache), every step feeds one new token per row;
    * the attention mask passed covers exactly the cached plus the new tokens;
    * positions advance by one per real token: each row's last position is its number of real (unmasked) tokens
      minus one.

    Raises ``AssertionError`` listing every violation with the step's shapes.  An empty trace fails too: a guard that
    saw nothing guards nothing.  Multi-token verification steps (assisted decoding, prompt lookup) fail the first
    guard by design.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, then this assertion's message
    steps = list(steps)
    if not steps:
        raise AssertionError("assert_steps_aligned: the trace is empty (did the model run inside neofix.trace?)")
    problems = []
    for step in steps:
        cached, new = step.cached_tokens, step.new_tokens
        if cached and new != 1:
            problems.append(f"step {step.index} feeds {new} new tokens per row after the prefill; expected 1")
        if cached is not None and step.mask_length_given is not None and step.mask_length_given != cached + new:
            problems.append(
                f"step {step.index}: the attention mask passed has {step.mask_length_given} columns, but the cache "
                f"holds {cached} tokens and the step feeds {new}: expected {cached + new}"
                + (" (neofix extended it)" if "mask_extended" in step.repairs else "")
            )
        if step.last_positions is not None and step.real_tokens is not None:
            for row, (last, real) in enumerate(zip(step.last_positions, step.real_tokens)):
                if real and last != real - 1:
                    problems.append(
                        f"step {step.index}, row {row}: the last new token is at position {last}, but the mask holds "
                        f"{real} real tokens: expected {real - 1} (positions must advance by one per real token)"
                    )
                    break
    if problems:
        raise AssertionError("\n".join(["decoding steps are not aligned:", *problems, _describe_trace(steps)]))
