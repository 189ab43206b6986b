"""Build the sdist and the wheel (from the sdist) and fail on any warning the build backend prints (tox.ini: pkg).

Usage: python .ci/build_dist.py SOURCE_DIR DIST_DIR
The log is printed as it is; a line with a deprecation, or one `python -m build` prints as ``WARNING ...`` (how it
shows the backend's Python warnings, e.g. setuptools' "License classifiers are deprecated"), fails the build.
distutils' own ``warning: build_py: byte-compiling is disabled`` notes (PYTHONDONTWRITEBYTECODE) are not warnings
about this project and pass.
"""

from __future__ import annotations

import re
import subprocess
import sys

WARNING = re.compile(r"^\s*WARNING\b|deprecat", re.IGNORECASE)
HARMLESS = re.compile(r"^warning: (build_py|install_lib): byte-compiling is disabled")


def main(source: str, dist: str) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "build", "--installer", "uv", "--outdir", dist, source],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    print(done.stdout, end="", flush=True)
    if done.returncode:
        print(f"build_dist: ERROR: python -m build exited with {done.returncode}", file=sys.stderr)
        return done.returncode
    warnings = [line for line in done.stdout.splitlines() if WARNING.search(line) and not HARMLESS.match(line)]
    if warnings:
        print("build_dist: ERROR: the build printed warnings:", *warnings, sep="\n  ", file=sys.stderr)
        return 1
    print("build_dist: sdist and wheel built, no warnings")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: python .ci/build_dist.py SOURCE_DIR DIST_DIR")
    sys.exit(main(*sys.argv[1:]))
