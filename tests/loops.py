"""Hand-written decoding loops, right and wrong, as GPT-Neo users write them; and running a call patched and vanilla."""

from __future__ import annotations

from typing import Any, Callable

import torch

import neofix
from neofix.testing import _takes_positions, reference_positions

from ._versions import as_cache_object, cache_keyword, legacy, output_cache


def left_padded_batch(lengths, width=None, vocab=96, seed=0):
    """input_ids and mask for rows of the given real lengths, left-padded to ``width`` with pad id 0."""
    width = width or max(lengths)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(lengths), width), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, : width - length] = 0
        mask[row, : width - length] = 0
    return ids, mask


def patched_and_vanilla(run: Callable[[], Any], *, vanilla_first: bool = False) -> tuple[Any, Any]:
    """``run()`` as the test left neofix (patched), and once inside ``with neofix.unpatched():``: ``(patched result,
    vanilla result)``.  Leaving the block puts back the patch state and which repairs were already reported.

    ``vanilla_first``: the vanilla run goes first (what transformers and torch warn about once per process then
    lands in it).
    """
    assert neofix.is_patched()
    if vanilla_first:
        with neofix.unpatched():
            plain = run()
        return run(), plain
    patched = run()
    with neofix.unpatched():
        plain = run()
    return patched, plain


def left_padded_chunk_after_a_cache(model) -> tuple[Any, Any, Any]:
    """Three tokens after a cache of six, rows left-padded by four and five, run patched and vanilla:
    ``(logits of one forward over the whole sequence at the chunk, patched outcome, vanilla outcome)``, each outcome
    the chunk's logits or the exception it raised (warnings silenced)."""
    import warnings

    ids, mask = left_padded_batch([9, 5, 4])
    key = cache_keyword(model)

    def chunked():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                cache = output_cache(model(input_ids=ids[:, :6], attention_mask=mask[:, :6], use_cache=True))
                return model(input_ids=ids[:, 6:], attention_mask=mask, use_cache=True, **{key: cache}).logits
            except Exception as exc:  # noqa: BLE001 - the outcome is asserted
                return exc

    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask).logits[:, 6:]
    patched, plain = patched_and_vanilla(chunked)
    return whole, patched, plain


@torch.no_grad()
def decode(
    model,
    ids,
    mask,
    steps,
    *,
    mask_mode="synced",
    positions="none",
    cache_format="native",
    chunks=(),
    pass_mask=True,
    cache_position="none",
):
    """Greedy decoding by hand with a KV cache; returns the ``steps`` generated tokens, shape (batch, steps).

    mask_mode   "synced": the mask covers cached + new tokens at every step; "stale": the prompt's mask is
                passed at every step (the classic bug).
    positions   "none" | "correct" (new tokens only) | "full" (every token so far) | "stale" (the prompt's) |
                "frozen" (correct for the prompt, then the prompt's last position again at every step: a loop that
                forgets to increment) | "prompt" (correct for the prompt, as generate gives them, then none) |
                "offset" (correct plus one at every step: consistent, a loop counting from 1) | "offset-prompt"
                (correct plus one for the prompt, then none) | "offset-frozen" (correct plus one for the prompt, then
                its last again at every step) | "arange" (arange over the padded width, then the sequence length: the
                classic batched-generation bug).
    cache_format "native" (what the model returned) | "legacy" (tuples) | "object" (a DynamicCache).
    chunks      split points: the prompt is fed in pieces with the cache (chunked prefill).
    cache_position "none" | "frozen" (the prompt's slots, then the prompt's last slot again at every step: a loop that
                forgets to advance it; for the releases whose models take it, 4.36 - 4.57).
    """
    keyword = cache_keyword(model)
    takes_positions = _takes_positions(model)
    prompt_mask = mask
    full_mask = mask
    cache = None
    generated = []
    bounds = [0, *chunks, ids.shape[1]]
    feeds = [ids[:, a:b] for a, b in zip(bounds, bounds[1:])]
    fed = 0
    next_tokens = None  # set by the last prefill step, before the first decode step reads it
    for step in range(len(feeds) - 1 + steps):
        new = feeds[step] if step < len(feeds) else next_tokens
        fed += new.shape[1]
        if step >= len(feeds):
            full_mask = torch.cat([full_mask, full_mask.new_ones((full_mask.shape[0], 1))], dim=-1)
        step_mask = full_mask[:, :fed]
        kwargs = {"input_ids": new, "use_cache": True}
        if pass_mask:
            kwargs["attention_mask"] = step_mask if mask_mode == "synced" else prompt_mask
        if not takes_positions:  # a model that takes no positions (ALiBi): nothing to pass
            pass
        elif positions == "correct":
            kwargs["position_ids"] = reference_positions(step_mask)[:, -new.shape[1]:]
        elif positions == "full":
            kwargs["position_ids"] = reference_positions(step_mask)
        elif positions == "stale":
            kwargs["position_ids"] = reference_positions(prompt_mask)
        elif positions == "offset":
            kwargs["position_ids"] = reference_positions(step_mask)[:, -new.shape[1]:] + 1
        elif positions == "prompt":
            if step < len(feeds):
                kwargs["position_ids"] = reference_positions(step_mask)[:, -new.shape[1]:]
        elif positions == "offset-prompt":
            if step < len(feeds):
                kwargs["position_ids"] = reference_positions(step_mask)[:, -new.shape[1]:] + 1
        elif positions == "offset-frozen":
            prompt_positions = reference_positions(prompt_mask) + 1
            kwargs["position_ids"] = prompt_positions if step < len(feeds) else prompt_positions[:, -1:]
        elif positions == "frozen":
            prompt_positions = reference_positions(prompt_mask)
            kwargs["position_ids"] = prompt_positions if step < len(feeds) else prompt_positions[:, -1:]
        elif positions == "arange":
            kwargs["position_ids"] = torch.arange(fed - new.shape[1], fed)[None]
        if cache_position == "frozen":
            last = torch.tensor([ids.shape[1] - 1])
            kwargs["cache_position"] = torch.arange(fed - new.shape[1], fed) if step < len(feeds) else last
        if cache is not None:
            if cache_format == "legacy":
                cache = legacy(cache)
            elif cache_format == "object":
                cache = as_cache_object(cache)
            kwargs[keyword] = cache
        out = model(**kwargs)
        cache = output_cache(out)
        if step >= len(feeds) - 1:
            next_tokens = out.logits[:, -1:].argmax(-1)
            generated.append(next_tokens)
    return torch.cat(generated, dim=-1)
