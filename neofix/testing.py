"""Test helpers: a tiny random GPT-Neo and the full-recompute reference every correctness check compares with.

The reference runs one forward over the whole sequence, without a cache, with the attention mask and
``position_ids = (cumsum(mask) - 1).clamp(min=0)``: a left-padded row then produces exactly the tokens of the same
prompt alone.  Nothing here downloads anything.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["tiny_gpt_neo", "tiny_gpt_neo_config", "reference_positions", "reference_logits", "reference_greedy"]

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

    config = tiny_gpt_neo_config(**config_overrides)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = GPTNeoForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    return model.to(dtype).eval()


def reference_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``(cumsum(mask) - 1).clamp(min=0)``: the position of every column of a 2D mask, pads at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def reference_logits(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Logits of one cache-free forward over the whole sequence, with mask-derived positions."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=reference_positions(attention_mask),
        use_cache=False,
    ).logits


@torch.no_grad()
def reference_greedy(
    model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 16
) -> torch.Tensor:
    """Greedy decoding by full recompute: every step reruns the whole sequence.  Returns prompt + new tokens."""
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    sequences, mask = input_ids, attention_mask
    for _ in range(max_new_tokens):
        next_tokens = reference_logits(model, sequences, mask)[:, -1].argmax(-1, keepdim=True)
        sequences = torch.cat([sequences, next_tokens], dim=-1)
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=-1)
    return sequences
