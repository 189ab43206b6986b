"""Python bytecodes neofix's model-forward wrapper executes per call: a deterministic proxy of its own instructions
that takes seconds where callgrind takes hours at the 125M shape.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_bytecodes.py                 # every kind, both shapes
    PYTHONPATH=/path/to/other/tree python benchmarks/bench_bytecodes.py --top 20 --kinds decode

The wrapper (``make_model_forward`` around GPT-Neo's adapter) is rebuilt around ``bench_own_decode.py``'s stand-in for
transformers' forward, which returns at once, so every counted bytecode is neofix's (plus the cache's own
``get_seq_length`` that its reader calls, and torch's ``is_compiling``).  ``sys.settrace`` with opcode events counts
them over ``--calls`` calls after a warm-up.  Counts repeat exactly from run to run; they leave out the work done in C
(a torch operation, ``tolist``), which ``bench_instructions.py`` counts.  PYTHONPATH picks the tree measured, so two
builds are compared by running this script twice.

Shapes: ``tiny`` (2 layers, batch 2, 32 tokens) and ``125m`` (12 layers as gpt-neo-125M, batch 1 and 4, 100 cached
or prompt tokens; widths do not change a count).  Kinds: ``decode`` (generate's step: one token, the mask one column
longer, the positions generate built), ``decode loop`` (a hand loop's step without positions), ``decode
loop+positions``, ``prefill`` (no cache) and ``chunk+positions`` (16 tokens after a cache, given the mask's
positions).  ``--padded`` rows start with five pads.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import warnings
from typing import Any

KINDS = ("decode", "decode loop", "decode loop+positions", "prefill", "chunk+positions")
SHAPES = {"tiny": (2, [(2, 32)]), "125m": (12, [(1, 100), (4, 100)])}


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
    new = {"prefill": length, "chunk+positions": 16}.get(kind, 1)
    past = 0 if kind == "prefill" else length
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
    if kind in ("decode", "decode loop+positions", "chunk+positions"):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="tiny,125m", help="comma-separated: tiny, 125m")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--calls", type=int, default=10, help="counted calls (default 10)")
    parser.add_argument("--warmup", type=int, default=50, help="uncounted calls first (default 50)")
    parser.add_argument("--top", type=int, default=0, help="also print the N costliest functions of each row")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    warnings.simplefilter("ignore")
    import neofix  # noqa: F401  (the patch, as users have it)
    import transformers

    print(f"neofix {neofix.__version__} from {os.path.dirname(neofix.__file__)}, transformers {transformers.__version__}")
    print(f"{'kind':22} {'shape':6} {'layers':>6} {'batch x tokens':>15} {'padding':>11} {'bytecodes/call':>15}")
    for shape in args.shapes.split(","):
        layers, sizes = SHAPES[shape]
        for kind in args.kinds.split(","):
            for batch, length in sizes:
                for padded in (False, True) if batch > 1 else (False,):
                    counts = count(*build(layers, batch, length, kind, padded), args.calls, args.warmup)
                    total = sum(counts.values()) / args.calls
                    padding = "left-padded" if padded else "unpadded"
                    print(f"{kind:22} {shape:6} {layers:6} {f'{batch} x {length}':>15} {padding:>11} {total:15.0f}")
                    for name, n in counts.most_common(args.top):
                        print(f"{'':8}{n / args.calls:8.0f}  {name}")


if __name__ == "__main__":
    main()
