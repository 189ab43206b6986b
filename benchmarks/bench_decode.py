"""neofix's per-step cost: vanilla and patched ``generate`` in one process, interleaved.

Run from the repository root with the environment neofix is installed in::

    python benchmarks/bench_decode.py              # the default run: a few minutes on one core
    python benchmarks/bench_decode.py --quick      # a smoke run: about a minute
    python benchmarks/bench_decode.py --help       # every flag

Models: the tiny random GPT-Neo of ``neofix.testing`` and a random model shaped like gpt-neo-125M (12 layers, width
768, 12 heads, window 256, vocabulary 50257, 2048 positions; built from a config, nothing is downloaded).  Batches:
1, and 4 left-padded rows.  Greedy ``generate`` of 48 new tokens (``min_new_tokens`` = ``max_new_tokens``: every
run decodes all 48).  Time is single-thread CPU time (``torch.set_num_threads(1)``, ``time.thread_time()``), so
the time the thread waits for a core on a busy machine is not counted.  A logits processor reads the clock once per
token: each run yields 47 decode-step times (steps 2 to 48; the prefill is not a decode step).

Two interleavings, both in one process:

``run``   pairs of whole runs, ``neofix.patch()`` / ``neofix.unpatch()`` between them (never timed), the order
          alternating from pair to pair.  A run's step time is the median of its 47 steps; the pair's ratio is
          patched / vanilla.  The end-to-end ratio (whole ``generate``: the one-time checks and the prefill too) is
          shown beside it.  On a machine other processes load, two runs a fraction of a second apart can differ by
          tens of percent, so the median of the pairs moves by a few percent from one invocation to the next.
``step``  within each ``generate``, decode steps alternate between patched and vanilla: at every token the logits
          processor swaps the class attributes neofix's patch sets (its wrappers of prepare_inputs_for_generation,
          GPTNeoModel.forward and the attention forward) with the originals, outside the timed interval.  Adjacent
          steps see the same machine load, so this is the precise one; each pair of runs (patched on odd steps, then
          on even steps, so that the one-token growth of the cache cancels) gives one ratio.  The tokens must equal
          vanilla's.

Then, once per model and batch, outside the timed runs:

* peak memory of one patched and one vanilla ``generate``: tensor memory from the torch profiler's allocation
  events (``profile_memory=True``) and the Python heap from ``tracemalloc``;
* neofix's own tensor work: a ``TorchFunctionMode`` attributes every torch call to the innermost Python frame
  outside torch; the calls made from neofix's files during decode steps are counted, and the run fails if any
  touches a cache-shaped (4-D) tensor (a copy of the KV cache) or converts a tensor to a Python value (a host-device
  synchronisation on an accelerator).

Target (issue 36): median patched/vanilla step ratio <= 1.003 on the 125M shape (the tiny model's is reported, not
targeted: its steps are too short to tell neofix's microseconds from the machine's noise); the ``step`` interleaving
decides PASS / MISS.  The exit status is 1 when a correctness check fails, or (with
``--strict``) a target is missed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
import warnings
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import neofix  # noqa: E402  (registers the patch before transformers loads GPT-Neo)
import torch  # noqa: E402

torch.set_num_threads(1)

NEW_TOKENS = 48
PROMPT = 16
TARGETS = {"tiny": None, "125m": 1.003}  # None: reported, not targeted
LENGTHS = {1: [PROMPT], 4: [PROMPT, 11, 6, 13]}  # real tokens per row; shorter rows are left-padded
DEFAULT_PAIRS = {  # (run pairs, step pairs) per repeat; --quick: the second table
    False: {"tiny": (20, 10), "125m": (4, 3)},
    True: {"tiny": (6, 4), "125m": (1, 1)},
}

#: tensor -> Python conversions (host reads): each one is a host-device synchronisation on an accelerator.  Counted by
#: the test suite's one counter (tests/_sync.py), read from the checkout this script lives in.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests import _sync  # noqa: E402

sys.path.pop(0)
#: torch calls that only read metadata (no tensor work, no synchronisation)
METADATA = frozenset({"__get__", "dim", "size", "numel", "__len__", "stride", "is_floating_point", "data_ptr"})


# --- models and inputs --------------------------------------------------------------------------------------------


def build_model(name: str, family: str = "gpt_neo") -> Any:
    if name == "tiny":
        from neofix.testing import tiny_model

        return tiny_model(family, seed=0)
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        vocab_size=50257,
        max_position_embeddings=2048,
        hidden_size=768,
        num_layers=12,
        num_heads=12,
        attention_types=[[["global", "local"], 6]],
        window_size=256,
        intermediate_size=None,  # 4 * hidden_size, as gpt-neo-125M
        bos_token_id=50256,
        eos_token_id=50256,
        pad_token_id=50256,
    )
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        model = GPTNeoForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)
    return model.eval()


def make_inputs(model: Any, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = LENGTHS[batch]
    pad = model.config.pad_token_id
    generator = torch.Generator().manual_seed(batch)
    ids = torch.randint(1, min(model.config.vocab_size, 50000), (batch, PROMPT), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate(lengths):
        ids[row, : PROMPT - length] = pad
        mask[row, : PROMPT - length] = 0
    return ids, mask


class StepClock:
    """A logits processor that reads the thread's CPU clock once per token, calling ``between`` in between.

    ``ends[j]`` closes step ``j - 1``; ``starts[j]`` opens step ``j``: whatever ``between`` does is not timed.
    """

    def __init__(self, between: Callable[[int], Any] | None = None) -> None:
        self.between = between
        self.ends: list[float] = []
        self.starts: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.ends.append(time.thread_time())
        if self.between is not None:
            self.between(len(self.ends))
        self.starts.append(time.thread_time())
        return scores

    def steps(self) -> list[float]:
        """The decode steps' CPU seconds: from each token's processor call to the next."""
        return [end - start for start, end in zip(self.starts, self.ends[1:])]


def generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, clock: StepClock | None = None) -> torch.Tensor:
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList([clock] if clock is not None else [])
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            num_beams=1,
            pad_token_id=model.config.pad_token_id,
            logits_processor=processors,
        )


def set_patched(patched: bool) -> None:
    if patched:
        neofix.patch()
    else:
        neofix.unpatch()
    assert neofix.is_patched() == patched


def summary(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


# --- run interleaving ---------------------------------------------------------------------------------------------


def timed_run(model: Any, ids: torch.Tensor, mask: torch.Tensor, patched: bool) -> tuple[float, float, torch.Tensor]:
    """(median decode-step CPU seconds, whole-generate CPU seconds, output) of one run."""
    set_patched(patched)
    clock = StepClock()
    start = time.thread_time()
    out = generate(model, ids, mask, clock)
    total = time.thread_time() - start
    steps = clock.steps()
    assert len(steps) == NEW_TOKENS - 1, f"expected {NEW_TOKENS - 1} decode steps, clocked {len(steps)}"
    return statistics.median(steps), total, out


def measure_runs(model: Any, ids: torch.Tensor, mask: torch.Tensor, pairs: int, warmup: int) -> dict[str, Any]:
    for index in range(warmup):
        timed_run(model, ids, mask, index % 2 == 0)
    rows = []
    for index in range(pairs):
        result = {}
        for patched in (True, False) if index % 2 else (False, True):
            result[patched] = timed_run(model, ids, mask, patched)
        if not torch.equal(result[True][2], result[False][2]):
            raise SystemExit("patched and vanilla generate produced different tokens")
        rows.append([result[True][0], result[False][0], result[True][1], result[False][1]])
    set_patched(True)

    def median_ms(column: int, per: int = 1) -> float:
        return statistics.median(row[column] for row in rows) / per * 1e3

    return {
        "pairs": pairs,
        "patched_step_ms": median_ms(0),
        "vanilla_step_ms": median_ms(1),
        "patched_ms_per_token": median_ms(2, NEW_TOKENS),
        "vanilla_ms_per_token": median_ms(3, NEW_TOKENS),
        "step_ratio": summary([row[0] / row[1] for row in rows]),
        "total_ratio": summary([row[2] / row[3] for row in rows]),
    }


# --- step interleaving --------------------------------------------------------------------------------------------


class WrapperSwitch:
    """Puts neofix's per-step wrappers in or takes them out by setting the class attributes ``patch()`` sets.

    The ``generate`` wrapper (one check per call, not per step) stays out.  While switched, ``neofix.is_patched()``
    says False; :meth:`close` leaves GPT-Neo patched again.

    This and :meth:`model_forward` are the benchmarks' one reach into neofix's internals: the family registry
    (``neofix._families.FAMILIES``: a family's ``module``, ``base_model``, ``load_adapter()`` and ``targets``, each
    with ``owner``, ``attribute`` and ``wrapper``, the name of its factory in ``neofix._wrappers``).
    """

    _MISSING = object()

    def __init__(self, family: str = "gpt_neo") -> None:
        from neofix._families import FAMILIES

        chosen = FAMILIES[family]
        module = importlib.import_module(chosen.module)
        self.family = chosen
        self.slots = []
        self.targets = []
        for target in chosen.targets:
            owner = getattr(module, target.owner, None) if target.owner else module
            if owner is not None and target.attribute != "generate":
                self.slots.append((owner, target.attribute))
                self.targets.append(target)
        set_patched(True)
        self.patched = [vars(owner).get(name, self._MISSING) for owner, name in self.slots]
        set_patched(False)
        self.vanilla = [vars(owner).get(name, self._MISSING) for owner, name in self.slots]

    def __call__(self, patched: bool) -> None:
        for (owner, name), value in zip(self.slots, self.patched if patched else self.vanilla):
            if value is not self._MISSING:
                setattr(owner, name, value)
            elif name in vars(owner):
                delattr(owner, name)

    def close(self) -> None:
        self(False)
        set_patched(True)

    def model_forward(self) -> tuple[Any, Any, Callable[[Any], Any]]:
        """``(owner, original, wrap)``: the base model class (``GPTNeoModel``), its vanilla ``forward``, and
        ``wrap(inner)``, which builds neofix's model-forward wrapper around ``inner`` as ``neofix.patch()`` does (the
        factory the family's target names, given the family's adapter).  ``inner`` should carry ``original``'s
        signature (``functools.wraps(original)``): the wrapper reads it."""
        from neofix import _wrappers

        for (owner, name), target, vanilla in zip(self.slots, self.targets, self.vanilla):
            if name == "forward" and owner.__name__ == self.family.base_model and target.wrapper:
                factory = getattr(_wrappers, target.wrapper)
                adapter = self.family.load_adapter()
                return owner, vanilla, lambda inner: factory(inner, adapter)
        raise LookupError(f"no forward of {self.family.base_model} among {self.family.name}'s patch targets")


def measure_steps(
    model: Any, ids: torch.Tensor, mask: torch.Tensor, pairs: int, family: str = "gpt_neo"
) -> dict[str, Any]:
    set_patched(False)
    expected = generate(model, ids, mask)
    switch = WrapperSwitch(family)
    try:

        def run(phase: int) -> tuple[list[float], list[float]]:
            states: list[bool] = []

            def between(token: int) -> None:
                states.append((token + phase) % 2 == 0)
                switch(states[-1])

            clock = StepClock(between)
            out = generate(model, ids, mask, clock)
            switch(False)
            if not torch.equal(out, expected):
                raise SystemExit("generate with alternating patched / vanilla steps produced different tokens")
            steps = clock.steps()
            return [t for t, on in zip(steps, states) if on], [t for t, on in zip(steps, states) if not on]

        run(0)  # warm
        ratios, patched_ms, vanilla_ms = [], [], []
        for index in range(pairs):
            patched, vanilla = [], []
            for phase in (index % 2, 1 - index % 2):
                p, v = run(phase)
                patched += p
                vanilla += v
            patched_ms.append(statistics.median(patched) * 1e3)
            vanilla_ms.append(statistics.median(vanilla) * 1e3)
            ratios.append(patched_ms[-1] / vanilla_ms[-1])
    finally:
        switch.close()
    return {
        "pairs": pairs,
        "patched_step_ms": statistics.median(patched_ms),
        "vanilla_step_ms": statistics.median(vanilla_ms),
        "step_ratio": summary(ratios),
    }


# --- memory -------------------------------------------------------------------------------------------------------


def tensor_peak(run: Callable[[], Any]) -> int:
    """Peak bytes of tensor memory allocated during ``run()``, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            run()
    events = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()  # type: ignore[union-attr]
        if event.name() == "[memory]"
    )
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def python_peak(run: Callable[[], Any]) -> int:
    """Peak bytes of Python heap (tracemalloc) above the level before ``run()``."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def memory(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for patched in (True, False):
        set_patched(patched)
        generate(model, ids, mask)  # warm
        side = "patched" if patched else "vanilla"
        result[f"{side}_tensor_peak"] = tensor_peak(lambda: generate(model, ids, mask))
        result[f"{side}_python_peak"] = python_peak(lambda: generate(model, ids, mask))
    set_patched(True)
    return result


# --- neofix's own tensor work during decode steps ---------------------------------------------------------------

NEOFIX_DIR = os.path.dirname(os.path.abspath(neofix.__file__)) + os.sep
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def neofix_caller() -> bool:
    """True when the innermost Python frame outside torch (and the host-read counter's mode) belongs to neofix."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(TORCH_DIR) and filename != _sync.__file__:
            return filename.startswith(NEOFIX_DIR)
        frame = frame.f_back
    return False


def neofix_work(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, Any]:
    """Every torch call neofix makes during the decode steps of one patched generate."""
    from torch.overrides import TorchFunctionMode

    calls: list[tuple[str, list[tuple[int, ...]]]] = []
    forwards = [0]

    class Recorder(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if forwards[0] and neofix_caller():
                name = getattr(func, "__name__", str(func))
                shapes = [tuple(a.shape) for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
                calls.append((name, shapes))
            return func(*args, **(kwargs or {}))

    reads = _sync.HostReads()  # the host reads (conversions), counted as the test suite counts them
    reads.paused = True

    def count_forward(module: Any, inputs: Any, output: Any) -> None:
        forwards[0] += 1  # after the first (prefill) forward, every call belongs to a decode step
        reads.paused = False

    set_patched(True)
    from neofix._families import FAMILIES

    bases = {family.base_model for family in FAMILIES.values()}  # the module every step passes (OPT: its decoder)
    base = next(module for module in model.modules() if type(module).__name__ in bases)
    handle = base.register_forward_hook(count_forward)
    try:
        with Recorder(), reads:  # the counter innermost: it names the frame that asked for each read
            generate(model, ids, mask)
    finally:
        handle.remove()
    steps = NEW_TOKENS - 1
    work = [(name, shapes) for name, shapes in calls if name not in METADATA]
    ops: dict[str, int] = {}
    for name, _ in work:
        ops[name] = ops.get(name, 0) + 1
    return {
        "decode_steps": steps,
        "metadata_reads_per_step": (len(calls) - len(work)) / steps,
        "tensor_ops_per_step": len(work) / steps,
        "tensor_ops": ops,
        "conversions": len(reads.by_neofix),
        "cache_tensor_ops": sum(1 for _, shapes in work if any(len(shape) == 4 for shape in shapes)),
    }


# --- report -------------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import transformers

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "neofix": neofix.__version__,
    }


def load() -> str:
    try:
        return " ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:  # pragma: no cover - not on Windows
        return "n/a"


def fmt_ratio(ratio: dict[str, float]) -> str:
    return f"{ratio['min']:.3f} / {ratio['median']:.4f} / {ratio['max']:.3f}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer pairs and one repeat: a smoke run")
    parser.add_argument("--models", default="tiny,125m", help="comma-separated: tiny, 125m (default: both)")
    parser.add_argument("--family", default="gpt_neo", help="the model family of the tiny model (neofix.testing."
                        "FAMILY_CONFIGS: gpt_neo, gpt2, gptj, codegen, gpt_neox, opt, bloom); 125m is GPT-Neo's only")
    parser.add_argument("--batches", default="1,4", help="comma-separated: 1, 4 (default: both)")
    parser.add_argument("--interleave", default="run,step", help="comma-separated: run, step (default: both)")
    parser.add_argument("--pairs", type=int, help="pairs per model, batch, interleaving and repeat (default: 20 / 10 "
                        "run / step pairs on the tiny model, 4 / 3 on the 125M shape; --quick: 6 / 4 and 1 / 1)")
    parser.add_argument("--repeat", type=int, help="independent repeats of the timing (default 2; --quick: 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs before each run-interleaved measure")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory comparison")
    parser.add_argument("--no-work", action="store_true", help="skip the check of neofix's own tensor work")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a median step ratio misses its target")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.batches = [int(b) for b in args.batches.split(",") if b.strip()]
    args.interleave = [i.strip() for i in args.interleave.split(",") if i.strip()]
    for name in args.models:
        if name not in TARGETS:
            parser.error(f"unknown model {name!r}: choose from {sorted(TARGETS)}")
    for batch in args.batches:
        if batch not in LENGTHS:
            parser.error(f"unknown batch {batch}: choose from {sorted(LENGTHS)}")
    for mode in args.interleave:
        if mode not in ("run", "step"):
            parser.error(f"unknown interleaving {mode!r}: choose from run, step")
    from neofix.testing import FAMILY_CONFIGS

    if args.family not in FAMILY_CONFIGS:
        parser.error(f"unknown family {args.family!r}: choose from {', '.join(FAMILY_CONFIGS)}")
    if args.family != "gpt_neo" and "125m" in args.models:
        parser.error("--models 125m is GPT-Neo's 125M shape: use --models tiny with another --family")
    args.repeat = args.repeat or (1 if args.quick else 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    info = machine()
    print(
        f"neofix {info['neofix']}, transformers {info['transformers']}, torch {info['torch']}, "
        f"Python {info['python']}; {info['cpu']} ({info['cpus']} CPUs), {info['torch_threads']} torch thread; "
        f"load average {load()}"
    )
    print(f"family {args.family}: greedy generate of {NEW_TOKENS} new tokens after a {PROMPT}-token prompt; "
          "single-thread CPU time\n")
    results: dict[str, Any] = {"machine": info, "load_start": load(), "timing": [], "checks": []}
    failed = []
    built = {name: build_model(name, args.family) for name in args.models}
    header = (
        f"{'model':5} {'batch':>5} {'interleave':>10} {'rep':>3} {'pairs':>5}  {'vanilla':>9} {'patched':>9} "
        f"{'+us/step':>8}  {'step ratio min / MEDIAN / max':>29}  {'target':>12}  {'end-to-end ratio':>25}"
    )
    print(header)
    print("-" * len(header))
    for rep in range(1, args.repeat + 1):
        for name in args.models:
            for batch in args.batches:
                model = built[name]
                ids, mask = make_inputs(model, batch)
                for mode in args.interleave:
                    default = DEFAULT_PAIRS[args.quick][name][0 if mode == "run" else 1]
                    pairs = args.pairs or default
                    if mode == "run":
                        row = measure_runs(model, ids, mask, pairs, args.warmup)
                    else:
                        row = measure_steps(model, ids, mask, pairs, args.family)
                    median = row["step_ratio"]["median"]
                    target = TARGETS[name]
                    verdict = ("PASS" if median <= target else "MISS") if mode == "step" and target else "(info)"
                    if verdict == "MISS" and args.strict:
                        failed.append(f"{name} batch {batch} repeat {rep}: median step ratio {median:.4f}")
                    row.update(model=name, batch=batch, interleave=mode, repeat=rep, load=load())
                    results["timing"].append(row)
                    total = fmt_ratio(row["total_ratio"]) if "total_ratio" in row else ""
                    extra_us = (row["patched_step_ms"] - row["vanilla_step_ms"]) * 1e3
                    print(
                        f"{name:5} {batch:5d} {mode:>10} {rep:3d} {pairs:5d}  {row['vanilla_step_ms']:7.3f}ms "
                        f"{row['patched_step_ms']:7.3f}ms {extra_us:+8.1f}  "
                        f"{fmt_ratio(row['step_ratio']):>29}  {verdict:>6} <= {target or '-':<5}  {total:>25}",
                        flush=True,
                    )
    print(f"\nload average at the end: {load()}")
    if args.interleave == ["run"] or "run" in args.interleave:
        print("ms per token (whole generate / 48), run interleaving, median of the pairs:")
        for row in results["timing"]:
            if row["interleave"] == "run":
                print(
                    f"  {row['model']:5} batch {row['batch']} repeat {row['repeat']}: vanilla "
                    f"{row['vanilla_ms_per_token']:.3f}, patched {row['patched_ms_per_token']:.3f}"
                )

    if not (args.no_memory and args.no_work):
        print()
    for name in args.models:
        for batch in args.batches:
            model = built[name]
            ids, mask = make_inputs(model, batch)
            extra: dict[str, Any] = {"model": name, "batch": batch}
            if not args.no_memory:
                mem = memory(model, ids, mask)
                extra["memory"] = mem
                delta = mem["patched_tensor_peak"] - mem["vanilla_tensor_peak"]
                print(
                    f"memory  {name:5} batch {batch}: tensor peak vanilla "
                    f"{mem['vanilla_tensor_peak'] / 2**20:.3f} MiB, patched {mem['patched_tensor_peak'] / 2**20:.3f} "
                    f"MiB ({delta:+d} B); Python heap peak "
                    f"vanilla {mem['vanilla_python_peak'] / 1024:.1f} KiB, patched "
                    f"{mem['patched_python_peak'] / 1024:.1f} KiB",
                    flush=True,
                )
            if not args.no_work:
                work = neofix_work(model, ids, mask)
                extra["neofix_work"] = work
                ops = ", ".join(f"{op} x{count}" for op, count in sorted(work["tensor_ops"].items())) or "none"
                print(
                    f"neofix  {name:5} batch {batch}: per decode step {work['tensor_ops_per_step']:.2f} tensor ops "
                    f"({ops}), {work['metadata_reads_per_step']:.1f} shape reads; tensor->Python conversions "
                    f"{work['conversions']}, ops on cache-shaped tensors {work['cache_tensor_ops']}",
                    flush=True,
                )
                if work["conversions"]:
                    failed.append(f"{name} batch {batch}: neofix converted tensors to Python values in decode steps")
                if work["cache_tensor_ops"]:
                    failed.append(f"{name} batch {batch}: neofix ran tensor ops on cache-shaped tensors")
            results["checks"].append(extra)
    results["load_end"] = load()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"\nwrote {args.json}")
    for line in failed:
        print(f"FAILED: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
