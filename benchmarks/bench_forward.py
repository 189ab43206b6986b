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
``prefill+positions`` and ``chunk+positions``
                     the prefill and the chunk given the caller's positions (the mask's, made outside the timed
                     call), as transformers' ``generate`` passes them on its prefill and a careful loop does.

Shapes: the tiny random GPT-Neo of ``neofix.testing`` at batch 2 x 32 and 8 x 48 tokens, and a random model shaped
like gpt-neo-125M at 1 x 128 (built from configs, nothing downloaded).  Batches above 1 come unpadded and
left-padded (every other row a few pads short: neofix then derives positions from the mask, its most expensive
case).  Time is single-thread CPU time (``time.thread_time_ns``).  Calls alternate patched / vanilla (the order
flipping every pair), the patch put in and taken out by setting the class attributes ``neofix.patch()`` sets, outside
the timed interval; each pair gives a ratio (its median is printed).  Outputs must equal vanilla's where the batch
is unpadded or positions are given (left-padded rows given none differ by design: the positions neofix derives).

A ratio of two whole forwards carries the forward's own noise (on a shared machine single pairs scatter by 10 - 30%,
so the median of 200 moves by 1 - 2%).  So each row gives two measures taken in place:

``own``  neofix's own time per forward (see :class:`OwnTime`: wall time inside the wrapper, cold as in practice,
         the timer's floor subtracted), and ``1 + own / vanilla``.  It leaves out the work vanilla no longer does
         when neofix gives it positions (left-padded batches), so it overstates neofix's cost there.
``net``  in the same interleaved pairs, the patched call's time in the code that differs minus the vanilla call's
         (see :class:`DifferingPart`: the base model's forward without its blocks, which run the same code either
         way; ``blocks`` is that difference for the blocks, the check that it is about 0), and
         ``1 + net / vanilla``: what the pairs' ratio would be without the blocks' noise.

``1 + net / vanilla`` is judged against the target of issue 36: <= 1.003 on the 125M shape (``--strict`` exits 1
where it misses); the tiny model's is reported, not targeted.
"""

from __future__ import annotations

import argparse
import functools
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

TARGETS = {"tiny": None, "125m": 1.003}  # None: reported, not targeted
SHAPES = {"tiny": [(2, 32), (8, 48)], "125m": [(1, 128)]}
KINDS = ("prefill", "chunked prefill", "training step", "classification", "prefill+positions", "chunk+positions")
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
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # the caller's, as generate and careful loops pass them
    if kind == "prefill+positions":
        def call() -> Any:
            with torch.no_grad():
                return model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).logits
        return call
    if kind in ("chunked prefill", "chunk+positions"):
        half = ids.shape[1] // 2
        given = kind == "chunk+positions"
        start_given = {"position_ids": positions[:, :half]} if given else {}
        given_after = {"position_ids": positions[:, half:]} if given else {}
        keyword = "cache" if "cache" in model.forward.__code__.co_varnames else "past_key_values"

        def call() -> Any:
            with torch.no_grad():
                first = model(input_ids=ids[:, :half], attention_mask=mask[:, :half], use_cache=True, **start_given)
                cache = first["cache"] if "cache" in first.keys() else first["past_key_values"]
                start = time.thread_time_ns()  # only the second, cached, multi-token forward is timed
                rest = {keyword: cache, **given_after}
                out = model(input_ids=ids[:, half:], attention_mask=mask, use_cache=True, **rest)
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


class OwnTime:
    """neofix's own time per model forward, measured in place: the model-forward wrapper is rebuilt around a shim
    of transformers' forward, and the time from the wrapper's entry to the shim plus from the shim's return to the
    wrapper's exit is neofix's alone, cold as in practice (right after the previous forward), without the forward's
    noise.  A pass-through wrapper timed the same way gives the floor (the timer and one call), subtracted."""

    def __init__(self, switch: WrapperSwitch) -> None:
        self.switch = switch
        self.owner, original, wrap = switch.model_forward()  # GPTNeoModel, its forward, neofix's factory
        now = time.perf_counter_ns
        marks = [0, 0]

        @functools.wraps(original)  # the wrapper reads the original's signature through it
        def shim(model: Any, *args: Any, **kwargs: Any) -> Any:
            marks[0] = now()
            out = original(model, *args, **kwargs)
            marks[1] = now()
            return out

        def passing(model: Any, *args: Any, **kwargs: Any) -> Any:
            return shim(model, *args, **kwargs)

        self.costs: list[int] = []

        def timed_around(inner: Callable[..., Any]) -> Callable[..., Any]:
            def forward(model: Any, *args: Any, **kwargs: Any) -> Any:
                start = now()
                out = inner(model, *args, **kwargs)
                self.costs.append(marks[0] - start + now() - marks[1])
                return out

            return forward

        self.forwards = {
            "neofix": timed_around(wrap(shim)),
            "floor": timed_around(passing),
        }

    def measure(self, call: Callable[[], Any], calls: int) -> float:
        """Median µs neofix adds to the last model forward of ``call`` (a chunk's second forward)."""
        medians = {}
        self.switch(True)
        try:
            for name, forward in self.forwards.items():
                setattr(self.owner, "forward", forward)
                per_call = []
                for _ in range(calls + 2):
                    self.costs.clear()
                    call()
                    per_call.append(self.costs[-1])
                medians[name] = statistics.median(per_call[2:])
        finally:
            self.switch(True)
        return (medians["neofix"] - medians["floor"]) / 1e3


class DifferingPart:
    """The part of a forward whose code differs patched and vanilla, timed in place in the interleaved pairs.

    Forward hooks mark four moments of each base model's forward: its entry (a pre-hook on the base model: before
    neofix's wrapper runs), its first block's entry, its final layer norm's entry and its exit.  The *edges*, entry
    to first block and final norm to exit, hold all the code that differs: neofix's wrapper, and vanilla's own
    preamble, which does work of its own where neofix gives it nothing (transformers builds ``arange`` positions
    when given none: neofix's derived positions replace them) and the same work otherwise.  Between them the blocks
    run the same code patched or not, on tensors of the same shapes (a left-padded row's values differ, not its
    cost), and they hold most of the forward's time and noise.  So ``net`` (the median over pairs of the patched
    call's edges minus the vanilla call's) is what neofix adds to the forward, with vanilla's saved work counted;
    ``blocks`` (the same difference for the blocks) is the check that they cost the same (about 0, within the
    noise).  A training step's backward is outside both: there the position embeddings of a left-padded batch are
    looked up per row, and their gradient costs about what the broadcast one does (measured apart: 0 - 20 us).
    The hooks run in both calls of a pair alike."""

    def __init__(self, *models: Any) -> None:
        now = time.perf_counter_ns
        self.marks: dict[str, list[int]] = {"entry": [], "blocks": [], "norm": [], "exit": []}

        def mark(name: str) -> Callable[..., None]:
            stamps = self.marks[name]

            def hook(*_: Any) -> None:
                stamps.append(now())

            return hook

        for model in models:
            if model is None:
                continue
            base = model.base_model
            base.register_forward_pre_hook(mark("entry"))
            base.h[0].register_forward_pre_hook(mark("blocks"))
            base.ln_f.register_forward_pre_hook(mark("norm"))
            base.register_forward_hook(mark("exit"))

    def clear(self) -> None:
        for stamps in self.marks.values():
            stamps.clear()

    def last(self) -> tuple[int, int]:
        """(edges, blocks) of the last base-model forward run (a chunk's second), in ns."""
        entry, blocks, norm, exit_ = (self.marks[name][-1] for name in ("entry", "blocks", "norm", "exit"))
        return blocks - entry + exit_ - norm, norm - blocks


def measure(
    switch: WrapperSwitch, call: Callable[[], Any], pairs: int, padded: bool, part: DifferingPart, given: bool = False
) -> dict[str, Any]:
    for patched in (True, False, True, False):  # warm up both, and say once what neofix says once
        switch(patched)
        timed(call)
    ratios, times = [], {True: [], False: []}
    edges, blocks = [], []
    for index in range(pairs):
        outs, parts = {}, {}
        for patched in (True, False) if index % 2 else (False, True):
            switch(patched)
            part.clear()
            elapsed, outs[patched] = timed(call)
            times[patched].append(elapsed)
            parts[patched] = part.last()
        ratios.append(times[True][-1] / times[False][-1])
        edges.append(parts[True][0] - parts[False][0])
        blocks.append(parts[True][1] - parts[False][1])
        if (not padded or given) and not torch.equal(outs[True], outs[False]):
            raise SystemExit("patched and vanilla outputs differ on an unpadded batch, or given positions")
    switch(True)
    return {
        "pairs": pairs,
        "vanilla_us": statistics.median(times[False]) / 1e3,
        "patched_us": statistics.median(times[True]) / 1e3,
        "ratio_min": min(ratios),
        "ratio_median": statistics.median(ratios),
        "ratio_max": max(ratios),
        "net_us": statistics.median(edges) / 1e3,
        "blocks_delta_us": statistics.median(blocks) / 1e3,
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
        f"{'kind':18} {'model':5} {'shape':>7} {'padding':>11} {'pairs':>5}  {'vanilla':>10} {'patched':>10} "
        f"{'ratio min / median / max':>24}  {'own':>6} {'1+own/vanilla':>13}  {'net':>6} {'blocks':>7} "
        f"{'1+NET/vanilla':>13}  target"
    )
    print(header)
    print("-" * len(header))
    warnings.simplefilter("ignore")  # neofix says once that it derives left-padded positions; transformers' own
    switch = WrapperSwitch()
    own = OwnTime(switch)
    rows, failed = [], []
    try:
        for name in models:
            model = build_model(name)
            classifier = classifier_of(model) if "classification" in kinds else None
            part = DifferingPart(model, classifier)
            for batch, length in SHAPES[name]:
                for padded in ([False, True] if batch > 1 else [False]):
                    ids, mask = inputs(model, batch, length, padded)
                    for kind in kinds:
                        if kind == "training step":
                            model.train()  # dropout is 0 in these configs: the step is deterministic
                        pairs = args.pairs or DEFAULT_PAIRS[args.quick][name]
                        call = call_of(kind, model, classifier, ids, mask)
                        row = measure(switch, call, pairs, padded, part, kind.endswith("positions"))
                        row["own_us"] = own.measure(call, pairs)
                        row["own_ratio"] = 1 + row["own_us"] / row["vanilla_us"]
                        row["net_ratio"] = 1 + row["net_us"] / row["vanilla_us"]
                        model.eval()
                        target = TARGETS[name]
                        verdict = ("PASS" if row["net_ratio"] <= target else "MISS") if target else "(info)"
                        if verdict == "MISS" and args.strict:
                            failed.append(f"{kind} {name} {batch}x{length}: {row['net_ratio']:.4f}")
                        row.update(kind=kind, model=name, batch=batch, length=length, padded=padded)
                        rows.append(row)
                        print(
                            f"{kind:18} {name:5} {batch:>2}x{length:<4} {'left-padded' if padded else 'unpadded':>11} "
                            f"{pairs:5d}  {row['vanilla_us']:8.0f}us {row['patched_us']:8.0f}us "
                            f"{row['ratio_min']:7.3f} / {row['ratio_median']:.4f} / {row['ratio_max']:.3f}  "
                            f"{row['own_us']:4.0f}us {row['own_ratio']:13.4f}  {row['net_us']:4.0f}us "
                            f"{row['blocks_delta_us']:5.0f}us {row['net_ratio']:13.4f}  {verdict} <= {target or '-'}",
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
