"""Print one line per tox env from a `tox --result-json` report: result, time, transformers, pytest summary.

Usage: python .ci/summary.py RESULT_JSON ENV...
Exits non-zero if an env is missing from the report, failed, or (for a test env) printed no pytest summary.
"""

from __future__ import annotations

import json
import re
import sys

SUMMARY = re.compile(r"\b(\d+ (passed|failed|errors?|skipped)|no tests ran)\b.* in \d+(\.\d+)?s\b")


#: What .ci/unless_pinned.py prints instead of running pytest (tflatest while the newest release is tf525's).
NOT_RUN = "not run again:"


def runs_pytest(command: dict) -> bool:
    args = command["command"]
    return any(arg.rsplit("/", 1)[-1] in ("pytest", "unless_pinned.py") for arg in args[:3])


def pytest_summary(env: dict) -> str | None:
    for command in env.get("test", []):
        if not runs_pytest(command):
            continue
        output = command["output"].splitlines()
        lines = [line.strip(" =") for line in output if SUMMARY.search(line) or line.startswith(NOT_RUN)]
        return lines[-1] if lines else None
    return None


def failure(env: dict) -> str | None:
    """The last line printed by the env's first failing command (its ERROR line, for the pkg env's checks)."""
    for command in env.get("test", []):
        if command.get("retcode"):
            text = command.get("output", "") + "\n" + command.get("err", "")
            lines = [line.strip() for line in text.splitlines() if line.strip()]
            name = " ".join(command["command"][:2]).rsplit("/", 1)[-1]
            return f"{name} exited with {command['retcode']}: {lines[-1] if lines else '(no output)'}"
    return None


def main(report: str, envs: list[str]) -> int:
    with open(report, encoding="utf-8") as file:
        results = json.load(file)["testenvs"]
    bad = 0
    print(f"{'env':<16} {'result':<7} {'time':>6}  {'transformers':<13} pytest")
    for name in envs:
        env = results.get(name, {})
        if "result" not in env:
            print(f"{name:<16} {'MISSING':<7} {'':>6}  {'':<13} (not in {report})")
            bad += 1
            continue
        result = env["result"]
        packages = dict(line.split("==", 1) for line in env.get("installed_packages", []) if "==" in line)
        summary = pytest_summary(env)
        is_test_env = any(runs_pytest(command) for command in env.get("test", []))
        ok = result["success"] and (summary is not None or not is_test_env)
        bad += not ok
        line = summary if is_test_env else (failure(env) if not ok else None) or "(no pytest in this env)"
        print(
            f"{name:<16} {'ok' if ok else 'FAILED':<7} {result['duration']:>5.0f}s  "
            f"{packages.get('transformers', '-'):<13} {line or 'no pytest summary line: see the log above'}"
        )
    return 1 if bad else 0


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__.strip().splitlines()[2])
    sys.exit(main(sys.argv[1], sys.argv[2:]))
