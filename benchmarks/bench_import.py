"""How long ``import neofix`` takes: ``python -X importtime -c "import neofix"``, repeated in fresh interpreters.

Reports neofix's cumulative import time (its own modules plus the standard-library modules it is the first to
import: ``typing``, ``threading``) and its own modules' self time, as min / median / max over the runs.  The budget
of issue 7 is 20 ms cumulative; ``--strict`` exits 1 when the median misses it.

    python benchmarks/bench_import.py            # 30 runs
    python benchmarks/bench_import.py --runs 100 --strict
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys

BUDGET_MS = 20.0
LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)$")


def one_run() -> tuple[float, float]:
    """(cumulative ms of ``neofix``, self ms of neofix's own modules) in one fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k not in ("NEOFIX_DISABLE", "PYTHONDONTWRITEBYTECODE")}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import neofix"], capture_output=True, text=True, env=env, check=True
    )
    cumulative = None
    own_us = 0
    for line in done.stderr.splitlines():
        found = LINE.match(line)
        if not found:
            continue
        self_us, cumulative_us, _, name = found.groups()
        if name == "neofix" or name.startswith("neofix."):
            own_us += int(self_us)
        if name == "neofix":
            cumulative = int(cumulative_us) / 1000
    if cumulative is None:
        raise SystemExit(f"no 'neofix' line in the importtime output:\n{done.stderr}")
    own = own_us / 1000
    return cumulative, own


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="fresh interpreters to time (default 30)")
    parser.add_argument("--strict", action="store_true", help=f"exit 1 when the median exceeds {BUDGET_MS:g} ms")
    options = parser.parse_args()
    one_run()  # write bytecode caches first, as any earlier run on a user's machine has
    runs = [one_run() for _ in range(options.runs)]
    print(
        f"python {sys.version.split()[0]}, {options.runs} fresh interpreters, python -X importtime -c 'import neofix'"
    )
    for label, values in (
        ("cumulative (neofix + what it first imports)", [r[0] for r in runs]),
        ("self time of neofix's own modules", [r[1] for r in runs]),
    ):
        print(
            f"  {label:45s} min {min(values):6.2f} ms  median {statistics.median(values):6.2f} ms  "
            f"max {max(values):6.2f} ms"
        )
    median = statistics.median(r[0] for r in runs)
    verdict = "PASS" if median <= BUDGET_MS else "MISS"
    print(f"  budget {BUDGET_MS:g} ms cumulative (median): {verdict}")
    return 1 if options.strict and verdict == "MISS" else 0


if __name__ == "__main__":
    sys.exit(main())
