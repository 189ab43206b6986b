"""neofix's cost on forwards that are not single-token decode steps: vanilla and patched, interleaved call by call.

Run from the repository root with the environment neofix is installed in::

    python benchmarks/bench_forward.py             # the default run: a few minutes on one core
    python benchmarks/bench_forward.py --quick     # a smoke run
    python benchmarks/bench_forward.py --help

Forward kinds (each one call of the model, no cache given unless said):

``prefill``          ``model(input_ids, attention_mask, use_cache=True)`` under ``no_grad``: a decoding loop's first
                     forward, or scoring.
``chunked prefill``  the second half of the prompt fed with the cache of the first half (the timed forward is the
                     second one: a multi-token step after a cache).
``training step``    ``model(input_ids, attention_mask, labels=...)`` then ``loss.backward()``.
``classification``   ``GPTNeoForSequenceClassification`` (same weights where they exist) under ``no_grad``.

Shapes: the tiny random GPT-Neo of ``neofix.testing`` at batch 2 x 32 and 8 x 48 tokens, and a random model shaped
like gpt-neo-125M at 1 x 128 (built from configs, nothing downloaded).  Batches above 1 come unpadded and
left-padded (every other row a few pads short: neofix then derives positions from the mask, its most expensive
case).  Time is single-thread CPU time (``time.thread_time_ns``).  Calls alternate patched / vanilla (the order
flipping every pair), the patch put in and taken out by setting the class attributes ``neofix.patch()`` sets, outside
the timed interval; each pair gives a ratio, and the median of the ratios is judged against the targets of issue 12:
<= 1.02 on the tiny model, <= 1.005 on the 125M shape.  Outputs must equal vanilla's where the batch is unpadded
(left-padded rows differ by design: the positions neofix derives).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import WrapperSwitch, build_model, load, machine  # noqa: E402

torch.set_num_threads(1)

TARGETS = {"tiny": 1.02, "125m": 1.005}
SHAPES = {"tiny": [(2, 32), (8, 48)], "125m": [(1, 128)]}
KINDS = ("prefill", "chunked prefill", "training step", "classification")
DEFAULT_PAIRS = {False: {"tiny": 200, "125m": 12}, True: {"tiny": 40, "125m": 3}}


def inputs(model: Any, batch: int, length: int, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(1, min(model.config.vocab_size, 50000), (batch, length), generator=generator)
    mask = torch.ones_like(ids)
    if padded:
        for row in range(1, batch, 2):
            pads = 3 + row % 5
            ids[row, :pads] = model.config.pad_token_id or 0
            mask[row, :pads] = 0
    return ids, mask


def classifier_of(model: Any) -> Any:
    from transformers import GPTNeoForSequenceClassification

    config = model.config.__class__(**{**model.config.to_dict(), "num_labels": 3})
    config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else 0
    head = GPTNeoForSequenceClassification(config)
    head.transformer.load_state_dict(model.transformer.state_dict())
    return head.eval()


def call_of(kind: str, model: Any, classifier: Any, ids: torch.Tensor, mask: torch.Tensor) -> Callable[[], Any]:
    """The timed call of a forward kind (set-up that is not part of it, such as a chunk's cache, is done here)."""
    if kind == "prefill":
        def call() -> Any:
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask, use_cache=True).logits
        return call
    if kind == "chunked prefill":
        half = ids.shape[1] // 2
        keyword = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"

        def call() -> Any:
            with torch.no_grad():
                first = model(input_ids=ids[:, :half], attention_mask=mask[:, :half], use_cache=True)
                cache = first["cache"] if "cache" in first.keys() else first["past_key_values"]
                start = time.thread_time_ns()  # only the second, cached, multi-token forward is timed
                out = model(input_ids=ids[:, half:], attention_mask=mask, use_cache=True, **{keyword: cache})
                return out.logits, time.thread_time_ns() - start
        return call
    if kind == "training step":
        labels = ids.masked_fill(mask == 0, -100)

        def call() -> Any:
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
            return loss.detach()
        return call
    assert kind == "classification"

    def call() -> Any:
        with torch.no_grad():
            return classifier(input_ids=ids, attention_mask=mask).logits
    return call


def timed(call: Callable[[], Any]) -> tuple[int, Any]:
    start = time.thread_time_ns()
    out = call()
    elapsed = time.thread_time_ns() - start
    if isinstance(out, tuple):  # the call timed its own part
        out, elapsed = out
    return elapsed, out


def measure(switch: WrapperSwitch, call: Callable[[], Any], pairs: int, padded: bool) -> dict[str, Any]:
    for patched in (True, False, True, False):  # warm up both, and say once what neofix says once
        switch(patched)
        timed(call)
    ratios, times = [], {True: [], False: []}
    for index in range(pairs):
        outs = {}
        for patched in (True, False) if index % 2 else (False, True):
            switch(patched)
            elapsed, outs[patched] = timed(call)
            times[patched].append(elapsed)
        ratios.append(times[True][-1] / times[False][-1])
        if not padded and not torch.equal(outs[True], outs[False]):
            raise SystemExit("patched and vanilla outputs differ on an unpadded batch")
    switch(True)
    return {
        "pairs": pairs,
        "vanilla_us": statistics.median(times[False]) / 1e3,
        "patched_us": statistics.median(times[True]) / 1e3,
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer pairs: a smoke run")
    parser.add_argument("--models", default="tiny,125m", help="comma-separated: tiny, 125m (default: both)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--pairs", type=int, help="pairs per measurement (default 200 tiny / 12 125M; --quick 40 / 3)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a median ratio misses its target")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    kinds = [kind.strip() for kind in args.kinds.split(",") if kind.strip()]
    for kind in kinds:
        if kind not in KINDS:
            parser.error(f"unknown kind {kind!r}: choose from {', '.join(KINDS)}")
    info = machine()
    print(
        f"neofix {info['neofix']}, transformers {info['transformers']}, torch {info['torch']}, Python {info['python']}; "
        f"{info['cpu']} ({info['cpus']} CPUs), 1 torch thread; load average {load()}"
    )
    header = (
        f"{'kind':16} {'model':5} {'shape':>7} {'padding':>11} {'pairs':>5}  {'vanilla':>10} {'patched':>10} "
        f"{'ratio min / MEDIAN / max':>24}  target"
    )
    print(header)
    print("-" * len(header))
    warnings.simplefilter("ignore")  # neofix says once that it derives left-padded positions; transformers' own
    switch = WrapperSwitch()
    rows, failed = [], []
    try:
        for name in models:
            model = build_model(name)
            classifier = classifier_of(model) if "classification" in kinds else None
            for batch, length in SHAPES[name]:
                for padded in ([False, True] if batch > 1 else [False]):
                    ids, mask = inputs(model, batch, length, padded)
                    for kind in kinds:
                        if kind == "training step":
                            model.train()  # dropout is 0 in these configs: the step is deterministic
                        pairs = args.pairs or DEFAULT_PAIRS[args.quick][name]
                        row = measure(switch, call_of(kind, model, classifier, ids, mask), pairs, padded)
                        model.eval()
                        verdict = "PASS" if row["ratio_median"] <= TARGETS[name] else "MISS"
                        if verdict == "MISS" and args.strict:
                            failed.append(f"{kind} {name} {batch}x{length}: {row['ratio_median']:.4f}")
                        row.update(kind=kind, model=name, batch=batch, length=length, padded=padded)
                        rows.append(row)
                        print(
                            f"{kind:16} {name:5} {batch:>2}x{length:<4} {'left-padded' if padded else 'unpadded':>11} "
                            f"{pairs:5d}  {row['vanilla_us']:8.0f}us {row['patched_us']:8.0f}us "
                            f"{row['ratio_min']:7.3f} / {row['ratio_median']:.4f} / {row['ratio_max']:.3f}  "
                            f"{verdict} <= {TARGETS[name]}",
                            flush=True,
                        )
    finally:
        switch.close()
    print(f"\nload average at the end: {load()}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"machine": info, "rows": rows}, indent=2))
    for line in failed:
        print(f"MISSED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
