"""A downstream project pins the built wheel and runs its tests with neofix's pytest plugin (tox.ini: pkg).

Usage: python .ci/check_downstream.py DIST_DIR WORK_DIR CONSTRAINTS_FILE
Run after .ci/build_dist.py.  In WORK_DIR it writes a throwaway project whose requirements.txt pins
`transformers-neofix==<the wheel's version>` (found through `--find-links DIST_DIR`, as a project would pin a
release), installs it into a clean venv (no system site-packages; torch is the CPU build from the constraints
file and UV_FIND_LINKS, as in every tox env), checks that what got installed is this wheel, byte for byte, and
that no distribution named `neofix` (an unrelated project on PyPI) came with it, then runs the project's pytest,
whose test uses the plugin's `gpt_neo_tiny` fixture and `neofix.testing.assert_generation_consistent`.
Fails if the pin resolves to anything else, if the plugin is not registered, or if the test fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

DISTRIBUTION = "transformers-neofix"
# The project pins transformers as a real one would: tox.ini's newest pinned release (tf525), already in uv's cache
# after a CI run, so this check resolves nothing new.
TRANSFORMERS = "transformers==5.25.0"

TEST_FILE = '''\
"""A downstream project's test: its own (here: the plugin's tiny) GPT-Neo must decode like a full recompute."""
import torch

import neofix
from neofix.testing import assert_generation_consistent

IDS = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def test_generate_matches_full_recompute(gpt_neo_tiny):
    model = gpt_neo_tiny(dtype=torch.float64)
    assert neofix.is_patched()  # building the model loaded GPT-Neo, which neofix's import hook patched
    assert_generation_consistent(model, IDS, MASK, max_new_tokens=6)
'''

# run in the downstream venv: where transformers-neofix came from, and a digest of every file it installed
INSTALLED = r"""
import hashlib, importlib.metadata as md, json
dist = md.distribution("transformers-neofix")
try:
    other = md.distribution("neofix").version
except md.PackageNotFoundError:
    other = None
files = {
    str(f): hashlib.sha256(f.read_binary()).hexdigest()
    for f in dist.files
    if f.parts[0] in ("neofix", "pytest_neofix.py") and f.suffix != ".pyc"
}
print(json.dumps({"version": dist.version, "files": files, "neofix_dist": other}))
"""


def fail(message: str) -> None:
    raise SystemExit(f"check_downstream: ERROR: {message}")


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    print("$", " ".join(c if "\n" not in c else "'...'" for c in command), flush=True)
    return subprocess.run(command, **kwargs)


def main(dist_dir: str, work_dir: str, constraints: str) -> None:
    dist = Path(dist_dir).resolve()
    wheels = sorted(dist.glob("*.whl"))
    if len(wheels) != 1:
        fail(f"expected one wheel in {dist}, found {[w.name for w in wheels]}")
    wheel = wheels[0]
    version = wheel.name.split("-")[1]
    with zipfile.ZipFile(wheel) as archive:
        expected = {
            name: hashlib.sha256(archive.read(name)).hexdigest()
            for name in archive.namelist()
            if name.split("/")[0] in ("neofix", "pytest_neofix.py")
        }

    work = Path(work_dir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    project, venv = work / "project", work / "venv"
    (project / "tests").mkdir(parents=True)
    (project / "requirements.txt").write_text(
        textwrap.dedent(
            f"""\
            # the release of neofix this project is tested with (published as transformers-neofix)
            --find-links {dist}
            {DISTRIBUTION}=={version}
            {TRANSFORMERS}
            pytest
            """
        )
    )
    (project / "tests" / "test_generation.py").write_text(TEST_FILE)
    # its own pytest config: WORK_DIR may lie inside this checkout (.tox/pkg/tmp), whose setup.cfg pytest would use
    (project / "pytest.ini").write_text("[pytest]\ntestpaths = tests\n")

    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOFIX_", "PYTEST_", "PYTHON", "VIRTUAL_ENV"))}
    env["HF_HUB_OFFLINE"] = "1"
    run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, env=env)
    python = venv / "bin" / "python"
    run(
        # --refresh-package: uv caches a wheel found through --find-links by its name and path, so a rebuilt wheel of
        # the same version at the same path (the pkg env's dist folder, run after run) would install the old build
        ["uv", "pip", "install", "--quiet", "--python", str(python), "--constraint", constraints]
        + ["--refresh-package", DISTRIBUTION, "-r", "requirements.txt"],
        check=True,
        env=env,
        cwd=project,
    )

    installed = json.loads(
        run([str(python), "-c", INSTALLED], check=True, capture_output=True, text=True, env=env, cwd=project).stdout
    )
    if installed["version"] != version or installed["files"] != expected:
        differ = sorted(set(installed["files"].items()) ^ set(expected.items()))
        fail(f"the pin {DISTRIBUTION}=={version} installed {installed['version']}, not {wheel.name}: {differ[:6]}")
    if installed["neofix_dist"] is not None:
        fail(f"a distribution named neofix {installed['neofix_dist']} got installed: the unrelated project")
    print(f"{DISTRIBUTION}=={version} resolved to {wheel.name}: {len(expected)} files identical", flush=True)

    done = run(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-v", "tests"],
        capture_output=True,
        text=True,
        env=env,
        cwd=project,
    )
    print(done.stdout, done.stderr, sep="", end="", flush=True)
    if done.returncode:
        fail(f"the downstream project's tests failed (pytest exited with {done.returncode})")
    if f"rootdir: {project}\n" not in done.stdout:
        fail(f"pytest ran with another rootdir than the downstream project {project}")
    # pytest lists plugins in entry-point order, which follows the file system's order of site-packages: any place
    plugins = [line for line in done.stdout.splitlines() if line.startswith("plugins: ")]
    listed = [p.strip() for p in plugins[0][len("plugins: ") :].split(",")] if plugins else []
    if f"{DISTRIBUTION}-{version}" not in listed:
        fail(f"pytest does not list the plugin of {DISTRIBUTION} {version} in its header (plugins: {listed})")
    print(f"check_downstream: a project pinning {DISTRIBUTION}=={version} installs it and runs its plugin: ok")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        fail(__doc__.strip().splitlines()[2])
    main(*sys.argv[1:])
