"""Python bytecodes neofix's model-forward wrapper executes per call: a deterministic proxy of its own instructions
that takes seconds where callgrind takes hours at the 125M shape.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_bytecodes.py                 # every kind, both shapes
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_bytecodes.py --top 20 --kinds decode
    PYTHONPATH=. python benchmarks/bench_bytecodes.py --instructions     # callgrind's instructions instead (minutes)

The wrapper (``make_model_forward`` around GPT-Neo's adapter) is rebuilt around ``bench_own_decode.py``'s stand-in for
transformers' forward, which returns at once, so every counted bytecode is neofix's (plus the cache's own
``get_seq_length`` that its reader calls, and torch's ``is_compiling``).  ``sys.settrace`` with opcode events counts
them over ``--calls`` calls after a warm-up.  Counts repeat exactly from run to run; they leave out the work done in C
(a torch operation, ``tolist``).  ``--instructions`` counts that too: the same calls run under ``valgrind
--tool=callgrind`` with collection switched on only around them (``bench_instructions.py``'s shim), and each row gives
the machine instructions per call (Ir), the measure issue 36's budget is stated in; unlike ``bench_instructions.py``
it runs no model, so the 125M shape takes minutes, not hours.  PYTHONPATH picks the tree measured, so two builds are
compared by running this script twice.

Shapes: ``tiny`` (2 layers, batch 2, 32 tokens) and ``125m`` (12 layers as gpt-neo-125M; batch 1 x 128 tokens,
``bench_forward.py``'s and ``bench_instructions.py``'s 125M shape, the one issue 36's budget is stated on, and batch 4
x 100, reported; widths do not change a count).  Kinds, as ``bench_instructions.py`` makes them: ``decode`` (generate's
step after a cache of the shape's tokens: one token, the mask one column longer, the positions generate built),
``decode loop`` (a hand loop's step without positions), ``decode loop+positions``, ``prefill`` (no cache; a training
step's and a classification head's forward are this call too), ``prefill+positions`` (given the mask's positions),
``chunked prefill`` (the second half of the tokens after a cache of the first, the mask over both) and
``chunk+positions`` (the same given the mask's positions).  Batched rows are counted unpadded and with rows 1 to 3
starting with five pads.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import warnings
from typing import Any

KINDS = (
    "decode", "decode loop", "decode loop+positions", "prefill", "prefill+positions", "chunked prefill",
    "chunk+positions",
)
SHAPES = {"tiny": (2, [(2, 32)]), "125m": (12, [(1, 128), (4, 100)])}


def build(layers: int, batch: int, length: int, kind: str, padded: bool) -> tuple[Any, Any, Any, dict]:
    import torch
    from transformers import GPTNeoConfig, GPTNeoModel
    from transformers.cache_utils import DynamicCache

    from bench_own_decode import stand_in  # transformers' forward returning at once (this folder is on sys.path)

    from neofix import _wrappers
    from neofix._families import FAMILIES

    config = GPTNeoConfig(
        num_layers=layers, hidden_size=32, num_heads=4, attention_types=[[["global", "local"], layers // 2]],
        window_size=256, vocab_size=100, max_position_embeddings=256, bos_token_id=0, eos_token_id=0,
    )
    model = GPTNeoModel(config)
    original = GPTNeoModel.forward.__wrapped__  # transformers' forward (import neofix wrapped it)
    forward = _wrappers.make_model_forward(functools.wraps(original)(stand_in), FAMILIES["gpt_neo"].load_adapter())
    keyword = "cache" if "cache" in original.__code__.co_varnames else "past_key_values"
    new = {"prefill": length, "prefill+positions": length}.get(kind, length // 2 if "chunk" in kind else 1)
    past = 0 if kind.startswith("prefill") else length - new if "chunk" in kind else length
    mask = torch.ones(batch, past + new, dtype=torch.long)
    if padded:
        mask[1:, :5] = 0
    ids = torch.ones(batch, new, dtype=torch.long)
    kwargs: dict[str, Any] = {"attention_mask": mask, "use_cache": True}
    if past:
        cache = DynamicCache(config=config) if "config" in DynamicCache.__init__.__code__.co_varnames else DynamicCache()
        for layer in range(layers):
            keys = torch.zeros(batch, 4, past, 8)
            cache.update(keys, keys, layer)
        kwargs[keyword] = cache
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -new:]
    if kind == "decode":
        _wrappers._trust(positions)  # what prepare_inputs_for_generation does with the positions it builds
    if kind.endswith("positions") or kind == "decode":
        kwargs["position_ids"] = positions
    return forward, model, ids, kwargs


def count(forward: Any, model: Any, ids: Any, kwargs: dict, calls: int, warmup: int) -> collections.Counter:
    for _ in range(warmup):  # CPython specialises a function's bytecode after several calls: not counted
        forward(model, ids, **kwargs)
    counts: collections.Counter = collections.Counter()

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            counts["/".join(code.co_filename.split("/")[-2:]) + ":" + code.co_name] += 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(calls):
            forward(model, ids, **kwargs)
    finally:
        sys.settrace(None)
    return counts


def callgrind_counts(args: argparse.Namespace, rows: list[tuple]) -> list[float]:
    """Instructions per call of each row (``inner_rows``' calls, under callgrind: about a minute a row)."""
    import re
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    from bench_instructions import build_shim

    folder = Path(tempfile.mkdtemp(prefix="neofix-bytecodes."))
    try:
        command = [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
            f"--callgrind-out-file={folder}/callgrind.out.%p", sys.executable, __file__, "--inner",
            "--shapes", args.shapes, "--kinds", args.kinds, "--calls", str(args.calls), "--warmup", str(args.warmup),
        ]
        env = {**os.environ, "NEOFIX_CALLGRIND_SHIM": str(build_shim(folder))}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-4000:])
        counts = {}
        for path in folder.glob("callgrind.out.*.*"):
            text = path.read_text(errors="replace")
            trigger = re.search(r"^desc: Trigger: Client Request: row (\d+)$", text, re.M)
            totals = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
            if trigger and totals:
                counts[int(trigger.group(1))] = int(totals.group(1)) / args.calls
        return [counts[index] for index in range(len(rows))]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def rows_of(args: argparse.Namespace) -> list[tuple]:
    rows = []
    for shape in args.shapes.split(","):
        layers, sizes = SHAPES[shape]
        for kind in args.kinds.split(","):
            for batch, length in sizes:
                for padded in (False, True) if batch > 1 else (False,):
                    rows.append((kind, shape, layers, batch, length, padded))
    return rows


def inner(args: argparse.Namespace) -> None:
    """Under callgrind: each row's calls counted, one dump per row."""
    import ctypes

    cg = ctypes.CDLL(os.environ["NEOFIX_CALLGRIND_SHIM"])
    for index, (kind, shape, layers, batch, length, padded) in enumerate(rows_of(args)):
        forward, model, ids, kwargs = build(layers, batch, length, kind, padded)
        for _ in range(args.warmup):
            forward(model, ids, **kwargs)
        cg.neofix_start()  # (instrumentation from the first row's counted calls on: importing torch under it is slow)
        cg.neofix_zero()
        cg.neofix_toggle()
        for _ in range(args.calls):
            forward(model, ids, **kwargs)
        cg.neofix_toggle()
        cg.neofix_dump(f"row {index}".encode())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,125m", help="comma-separated: tiny, 125m")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--calls", type=int, default=10, help="counted calls (default 10)")
    parser.add_argument("--warmup", type=int, default=50, help="uncounted calls first (default 50)")
    parser.add_argument("--top", type=int, default=0, help="also print the N costliest functions of each row")
    parser.add_argument(
        "--instructions", action="store_true", help="also count machine instructions per call, under callgrind"
    )
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore")
    import neofix  # noqa: F401  (the patch, as users have it)
    import transformers

    if args.inner:
        inner(args)
        return
    instructions = callgrind_counts(args, rows_of(args)) if args.instructions else None

    print(f"neofix {neofix.__version__} from {os.path.dirname(neofix.__file__)}, transformers {transformers.__version__}")
    extra = f" {'instructions/call':>17}" if instructions else ""
    print(f"{'kind':22} {'shape':6} {'layers':>6} {'batch x tokens':>15} {'padding':>11} {'bytecodes/call':>15}{extra}")
    for index, (kind, shape, layers, batch, length, padded) in enumerate(rows_of(args)):
        counts = count(*build(layers, batch, length, kind, padded), args.calls, args.warmup)
        total = sum(counts.values()) / args.calls
        padding = "left-padded" if padded else "unpadded"
        extra = f" {instructions[index]:17.0f}" if instructions else ""
        print(f"{kind:22} {shape:6} {layers:6} {f'{batch} x {length}':>15} {padding:>11} {total:15.0f}{extra}")
        for name, n in counts.most_common(args.top):
            print(f"{'':8}{n / args.calls:8.0f}  {name}")


if __name__ == "__main__":
    main()
