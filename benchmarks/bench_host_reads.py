"""Host reads per decode step: tensor-to-Python conversions made during single-token decode steps, patched and vanilla.

Run from the repository root with the environment neofix is installed in::

    python benchmarks/bench_host_reads.py                 # tiny and 125M shape, batch 1 and 4 left-padded rows
    python benchmarks/bench_host_reads.py --models tiny --steps 4

A host read (``.item()``, ``bool()``, ``.tolist()``, ``nonzero()``, ``.cpu()``...) is a host-device synchronisation on
an accelerator.  They are counted by the test suite's one counter (``tests/_sync.HostReads``, as
``bench_decode.py`` and ``tests/test_overhead.py`` count them), from the end of the model's first (prefill) forward to
the end of the run, divided by the decode steps.  ``neofix`` is the reads a frame in neofix's files asked for, ``all``
every read (transformers' ``generate`` makes its own: the same patched and vanilla).  Each decode run is counted on the
CPU as it is, and on a simulated accelerator (``tests/_sync.simulated_accelerator()``: neofix treats CPU tensors as
device tensors) where the checkout's test helpers offer it.  On the CPU a read waits for nothing, and neofix may
read there (it compares given positions with the mask's at once); the exit status is 1 when neofix reads on the
simulated accelerator (or, where the helpers offer none, on the CPU).

Decode runs, each after a prompt of 16 tokens (``bench_decode.make_inputs``):

``generate``               greedy ``model.generate``;
``loop``                   a hand loop: one token per step, the 2D mask one column longer each step, no positions;
``loop+positions``         the same given the mask's positions of the new token.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import _sync, build_model, make_inputs, set_patched  # noqa: E402

import torch  # noqa: E402

RUNS = ("generate", "loop", "loop+positions")


def run_of(kind: str, model: Any, ids: torch.Tensor, mask: torch.Tensor, steps: int) -> Callable[[], None]:
    if kind == "generate":
        def run() -> None:
            with torch.no_grad():
                model.generate(
                    input_ids=ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                    do_sample=False, num_beams=1, pad_token_id=model.config.pad_token_id,
                )
        return run

    def loop() -> None:
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            step_mask = mask
            for _ in range(steps):
                cache = out["cache"] if "cache" in out.keys() else out["past_key_values"]
                keyword = "cache" if "cache" in out.keys() else "past_key_values"
                step_mask = torch.cat([step_mask, step_mask.new_ones((step_mask.shape[0], 1))], dim=-1)
                given = {}
                if kind == "loop+positions":
                    given["position_ids"] = (step_mask.cumsum(-1) - 1).clamp(min=0)[:, -1:]
                new = out.logits[:, -1:].argmax(-1)
                out = model(input_ids=new, attention_mask=step_mask, use_cache=True, **{keyword: cache}, **given)
    return loop


def count(model: Any, run: Callable[[], None], simulated: bool) -> tuple[float, float, int]:
    """(neofix's host reads per decode step, all host reads per decode step, decode steps) of ``run()``."""
    reads = _sync.HostReads()
    reads.paused = True  # until the prefill forward has returned
    forwards = [0]

    def after(*_: Any) -> None:
        forwards[0] += 1
        reads.paused = False

    handle = model.base_model.register_forward_hook(after)
    device = _sync.simulated_accelerator() if simulated else contextlib.nullcontext()
    try:
        with warnings.catch_warnings(), device:
            warnings.simplefilter("ignore")
            with reads:
                run()
    finally:
        handle.remove()
    steps = forwards[0] - 1
    return len(reads.by_neofix) / steps, len(reads.reads) / steps, steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,125m", help="comma-separated: tiny, 125m (default: both)")
    parser.add_argument("--batches", default="1,4", help="comma-separated: 1, 4 (4: left-padded rows; default: both)")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per run (default 8)")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")  # neofix says once that it derives left-padded positions; transformers' own
    simulations = [False]
    if hasattr(_sync, "simulated_accelerator"):
        simulations.append(True)
    header = (
        f"{'run':15} {'model':5} {'batch':>5} {'device':>21} {'steps':>5}  {'neofix reads/step':>17}  "
        f"{'all reads/step patched':>22}  {'vanilla':>7}"
    )
    print(header)
    print("-" * len(header))
    failed = 0
    for name in args.models.split(","):
        model = build_model(name)
        for batch in map(int, args.batches.split(",")):
            ids, mask = make_inputs(model, batch)
            for kind in RUNS:
                run = run_of(kind, model, ids, mask, args.steps)
                for simulated in simulations:
                    try:
                        set_patched(True)
                        run()  # warm: say once what is said once
                        ours, patched, steps = count(model, run, simulated)
                        set_patched(False)
                        run()
                        _, vanilla, _ = count(model, run, simulated)
                    except AttributeError as exc:  # the checkout's simulated accelerator reaches a name now gone
                        print(f"{kind:15} {name:5} {batch:5d} {'simulated accelerator':>21}: not run ({exc})")
                        continue
                    finally:
                        set_patched(True)
                    failed += ours != 0 and (simulated or len(simulations) == 1)
                    print(
                        f"{kind:15} {name:5} {batch:5d} {'simulated accelerator' if simulated else 'CPU':>21} "
                        f"{steps:5d}  {ours:17.2f}  {patched:22.2f}  {vanilla:7.2f}",
                        flush=True,
                    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
