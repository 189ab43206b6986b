"""Run pytest, unless the installed transformers is the release a pinned env already tests.

Usage (tox.ini, env tflatest): python .ci/unless_pinned.py PINNED_VERSION ENV_NAME -- PYTEST_ARGS...

`tflatest` installs the newest transformers on every run, to catch a new release the day it appears.  While the
newest is still the release `py311-tf525` pins, its whole suite would run twice on the same code: then this prints
one line saying so (`.ci/summary.py` shows it) and exits 0.  Otherwise it runs the env's `pytest PYTEST_ARGS`, as
the other envs do, and exits with pytest's status.  (Not `python -m pytest`: that puts the working directory, the
checkout, first on `sys.path`, and the tests would import the checkout's neofix instead of the wheel tox installed.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version

#: The line .ci/summary.py looks for in place of pytest's summary.
NOT_RUN = "not run again:"


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[2] != "--":
        raise SystemExit(__doc__.strip().splitlines()[2])
    pinned, env, pytest_args = argv[0], argv[1], argv[3:]
    installed = version("transformers")
    if installed == pinned:
        print(f"{NOT_RUN} transformers {installed} is the release {env} pins, and its tests ran there", flush=True)
        return 0
    pytest = shutil.which("pytest", path=os.path.dirname(sys.executable))
    command = [pytest] if pytest else [sys.executable, "-P", "-m", "pytest"]  # -P: nothing prepended to sys.path
    return subprocess.call([*command, *pytest_args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
