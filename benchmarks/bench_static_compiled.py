"""Compiled static-cache decoding of the gpt-neo-125M shape: vanilla against neofix, and neofix past the window.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_static_compiled.py            # a few minutes on a CPU
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_static_compiled.py --steps 16 --past 272   # shorter

A random model shaped like gpt-neo-125M (12 layers, width 768, 12 heads, window 256, vocabulary 50257, 2048
positions; built from ``GPTNeoConfig``, nothing downloaded; its output layer sharpened as ``neofix.testing`` does, so
that greedy tokens do not sit on near-ties), batch 1, greedy, by hand: ``torch.compile(model.forward,
fullgraph=True)`` over a ``StaticCache``, the 2D mask of the tokens so far, ``cache_position`` where the release's
forward takes it.

1. Per-token time, vanilla and neofix, with a static cache of ``--window`` slots (vanilla's local layers are right
   only up to the window): the prompt and the first decode steps compile and warm up, then ``--steps`` decode steps
   are timed one by one; the median per token and the ratio neofix / vanilla (vanilla and neofix alternate
   ``--rounds`` times).
2. Past the window (``--past`` tokens in all, a cache of as many slots): neofix's compiled tokens against a dynamic
   cache's (eager), token for token; and vanilla's compiled static tokens, which go wrong past the window.

Prints a table; ``--json PATH`` writes the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import statistics
import time

import torch
import transformers
from transformers import GPTNeoConfig, GPTNeoForCausalLM
from transformers.cache_utils import StaticCache

import neofix


def build(seed: int = 0) -> GPTNeoForCausalLM:
    config = GPTNeoConfig(num_layers=12, hidden_size=768, num_heads=12, attention_types=[[["global", "local"], 6]],
                          window_size=256, vocab_size=50257, max_position_embeddings=2048, embed_dropout=0.0,
                          attention_dropout=0.0, resid_dropout=0.0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = GPTNeoForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # (untied from the embeddings: only the logits are sharpened)
    return model


def static_cache(model, slots: int):
    parameters = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": slots}
    for name in ("batch_size", "max_batch_size"):
        if name in parameters:
            kwargs.update({name: 1, "dtype": model.dtype})
    return StaticCache(**kwargs)


def keyword(model) -> str:
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


@torch.no_grad()
def run(forward, model, prompt, new: int, slots: int, *, timed_from: int | None = None):
    """Greedy decoding of ``new`` tokens over a static cache of ``slots``; returns (tokens, per-step seconds of the
    decode steps from ``timed_from``)."""
    cache, key = static_cache(model, slots), keyword(model)
    takes_slots = "cache_position" in inspect.signature(type(model).forward).parameters
    fed, mask, tokens, times = prompt, torch.ones_like(prompt), [], []
    for step in range(new):
        extra = {"cache_position": torch.arange(mask.shape[1] - fed.shape[1], mask.shape[1])} if takes_slots else {}
        start = time.perf_counter()
        out = forward(input_ids=fed, attention_mask=mask, use_cache=True, **{key: cache}, **extra)
        fed = out.logits[:, -1:].argmax(-1)
        if timed_from is not None and step >= timed_from:
            times.append(time.perf_counter() - start)
        tokens.append(int(fed))
        mask = torch.cat([mask, mask.new_ones((1, 1))], dim=-1)
    return tokens, times


@torch.no_grad()
def dynamic(model, prompt, new: int) -> list[int]:
    key, cache, fed, mask, tokens = keyword(model), None, prompt, torch.ones_like(prompt), []
    for _ in range(new):
        out = model(input_ids=fed, attention_mask=mask, use_cache=True, **({key: cache} if cache is not None else {}))
        cache = out[key] if key in out.keys() else out["past_key_values"]
        fed = out.logits[:, -1:].argmax(-1)
        tokens.append(int(fed))
        mask = torch.cat([mask, mask.new_ones((1, 1))], dim=-1)
    return tokens


def compiled(model, mode: str | None):
    torch._dynamo.reset()
    return torch.compile(model.forward, fullgraph=True, mode=mode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    parser.add_argument("--window", type=int, default=256, help="slots of the timed static cache (default 256)")
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per round (default 48)")
    parser.add_argument("--warmup", type=int, default=4, help="untimed decode steps first (default 4)")
    parser.add_argument("--rounds", type=int, default=2, help="vanilla / neofix alternations (default 2)")
    parser.add_argument("--past", type=int, default=320, help="tokens in all for the run past the window (default 320)")
    parser.add_argument("--mode", default=None, help="torch.compile mode (default: inductor's default)")
    parser.add_argument("--no-timing", action="store_true", help="only the run past the window")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build()
    prompt = torch.randint(1, 50257, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, CPU, 1 thread; gpt-neo-125M shape, "
          f"batch 1, prompt {args.prompt}, torch.compile(model.forward, fullgraph=True, mode={args.mode!r})")

    if not args.no_timing:
        timing(model, prompt, args)
    past(model, prompt, args)


def timing(model, prompt, args) -> None:
    """1. per-token time within the window"""
    new = 1 + args.warmup + args.steps
    assert args.prompt + new <= args.window, "the timed run must stay within the window"
    medians: dict[str, list[float]] = {"vanilla": [], "neofix": []}
    tokens: dict[str, list[int]] = {}
    compile_s: dict[str, float] = {}
    for _ in range(args.rounds):
        for name in ("vanilla", "neofix"):
            context = neofix.unpatched() if name == "vanilla" else contextlib.nullcontext()
            with context:
                forward = compiled(model, args.mode)
                start = time.perf_counter()
                run(forward, model, prompt, 1 + args.warmup, args.window)  # compile: prefill and decode graphs
                compile_s[name] = time.perf_counter() - start
                got, times = run(forward, model, prompt, new, args.window, timed_from=1 + args.warmup)
            tokens[name] = got
            medians[name].append(statistics.median(times))
    vanilla_ms = statistics.median(medians["vanilla"]) * 1e3
    neofix_ms = statistics.median(medians["neofix"]) * 1e3
    print(f"\nwithin the window ({args.window} slots, {args.prompt + new} tokens), median per decode step over "
          f"{args.steps} steps x {args.rounds} rounds:")
    print(f"  vanilla  {vanilla_ms:8.2f} ms/token   (compile + warmup {compile_s['vanilla']:.0f} s)")
    print(f"  neofix   {neofix_ms:8.2f} ms/token   (compile + warmup {compile_s['neofix']:.0f} s)")
    print(f"  ratio    {neofix_ms / vanilla_ms:8.3f}   (neofix / vanilla; rounds: "
          f"{', '.join(f'{n / v:.3f}' for n, v in zip(medians['neofix'], medians['vanilla']))})")
    print(f"  tokens equal: {tokens['vanilla'] == tokens['neofix']}")

    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"vanilla_ms": vanilla_ms, "neofix_ms": neofix_ms, "rounds": medians, "compile_s": compile_s},
                      handle)


def past(model, prompt, args) -> None:
    """2. past the window"""
    new = args.past - args.prompt
    forward = compiled(model, args.mode)
    mine, _ = run(forward, model, prompt, new, args.past)
    with neofix.unpatched():
        forward = compiled(model, args.mode)
        plain, _ = run(forward, model, prompt, new, args.past)
        reference = dynamic(model, prompt, new)
    first = lambda got: next((i for i, (a, b) in enumerate(zip(got, reference)) if a != b), None)  # noqa: E731
    print(f"\npast the window ({args.past} tokens, a static cache of {args.past} slots), against the dynamic "
          f"cache (eager, vanilla):")
    print(f"  neofix compiled static:  {sum(a == b for a, b in zip(mine, reference))}/{new} tokens equal, first "
          f"difference at {first(mine)}")
    print(f"  vanilla compiled static: {sum(a == b for a, b in zip(plain, reference))}/{new} tokens equal, first "
          f"difference at {first(plain)}")
    eager, _ = run(model, model, prompt, min(new, 4), args.past)
    print(f"  (first tokens: neofix {mine[:4]}, vanilla {plain[:4]}, dynamic {reference[:4]}, eager static {eager})")


if __name__ == "__main__":
    main()
