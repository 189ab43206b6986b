"""Run what needs no torch on every Python version setup.cfg claims (called by .ci/run, before the tox matrix).

Usage: python .ci/check_pythons.py [SOURCE_DIR]     (default: this checkout)

The tox matrix runs the whole suite on Python 3.11 only: the CPU torch wheel on the CI machine is a cp311 one.
setup.cfg claims more (its `Programming Language :: Python :: 3.X` classifiers and `python_requires`), so on each
claimed version this script
  1. byte-compiles every module of the package and the pytest plugin (in memory: nothing written to the tree),
  2. installs the wheel (built once, here) with `--no-deps` into a clean venv of that Python, which also checks that
     the wheel's Requires-Python admits it, plus the wheel's torch-free requirements (wrapt, packaging) and pytest,
  3. checks that torch and transformers are not installable-by-accident there (not installed), that `import neofix`
     works and imports neither, and
  4. runs the torch-free tests with `pytest --noconftest` (tests/conftest.py needs torch): the import hook
     (tests/test_import_hook.py), where warnings about NEOFIX_* values point (tests/test_env_warnings.py) and the
     command's usage errors (tests/test_cli.py) and the name-clash check (tests/test_name_clash.py; its slow test,
     which builds two venvs, runs in the tox envs).

Interpreters are looked up as pyenv installs them, $(pyenv root)/versions/3.X.*/bin/python3.X (the CI machine's
layout; PYENV_ROOT, else `pyenv root`, else ~/.pyenv).  A claimed version with no interpreter FAILS the check (a
claim CI cannot run is the thing this check exists to prevent): install it, or drop its classifier and raise
python_requires.  Packages come from uv's index and cache, as in the tox envs.  Takes about 25 s.
"""

from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from email.parser import HeaderParser
from pathlib import Path

TORCH_FREE_TESTS = (
    "tests/test_import_hook.py", "tests/test_env_warnings.py", "tests/test_cli.py", "tests/test_name_clash.py"
)
HEAVY = ("torch", "transformers")

COMPILE_ALL = r"""
import pathlib, sys
files = sorted(pathlib.Path("neofix").rglob("*.py")) + [pathlib.Path("pytest_neofix.py")]
for path in files:
    compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
print(f"byte-compiled {len(files)} modules")
"""

IMPORT_CHECK = r"""
import importlib.util, sys
missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
assert missing == ["torch", "transformers"], f"this venv must have neither torch nor transformers: {missing}"
import neofix
heavy = sorted({"torch", "transformers", "wrapt"} & set(sys.modules))
assert not heavy, f"import neofix imported {heavy}"
assert neofix.__file__.startswith(sys.prefix), f"imported {neofix.__file__}, not the venv's copy"
print(f"import neofix {neofix.__version__}: ok, nothing heavy imported")
"""


def claimed_versions(setup_cfg: Path) -> tuple[list[str], str]:
    config = configparser.ConfigParser()
    config.read(setup_cfg, encoding="utf-8")
    classifiers = config["metadata"]["classifiers"]
    versions = re.findall(r"Programming Language :: Python :: (3\.\d+)\s*$", classifiers, re.MULTILINE)
    return sorted(versions, key=lambda v: int(v.split(".")[1])), config["options"]["python_requires"].strip()


def pyenv_root() -> Path:
    if os.environ.get("PYENV_ROOT"):
        return Path(os.environ["PYENV_ROOT"])
    if shutil.which("pyenv"):
        done = subprocess.run(["pyenv", "root"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip():
            return Path(done.stdout.strip())
    return Path.home() / ".pyenv"


def find_interpreter(root: Path, version: str) -> Path | None:
    found = sorted(
        root.glob(f"versions/{version}.*/bin/python{version}"),
        key=lambda p: int(p.parts[-3].split(".")[2]) if p.parts[-3].split(".")[2].isdigit() else -1,
    )
    return found[-1] if found else None  # the newest patch release installed


def run(command: list, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)


def main(source: Path) -> int:
    start = time.monotonic()
    versions, python_requires = claimed_versions(source / "setup.cfg")
    lowest = f">={versions[0]}" if versions else None
    if python_requires != lowest:
        print(
            f"check_pythons: ERROR: python_requires is {python_requires!r}, but the lowest Python classifier is "
            f"{versions[:1]}: they must agree ({lowest!r})",
            file=sys.stderr,
        )
        return 1
    uv = shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if uv is None:
        print("check_pythons: ERROR: uv not found (it comes with tox-uv, .ci/requirements.txt)", file=sys.stderr)
        return 2
    root = pyenv_root()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOFIX_", "PYTHON", "VIRTUAL_ENV", "PYTEST_"))}
    env.update(HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    failures = []
    with tempfile.TemporaryDirectory(prefix="neofix-pythons-") as tmp:
        work = Path(tmp)
        built = run([uv, "build", "--quiet", "--wheel", "--out-dir", work / "dist", source], env=env)
        wheels = sorted((work / "dist").glob("*.whl"))
        if built.returncode or len(wheels) != 1:
            print(built.stdout, built.stderr, "check_pythons: ERROR: could not build the wheel", file=sys.stderr)
            return 1
        wheel = wheels[0]
        with zipfile.ZipFile(wheel) as archive:
            info = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            requires = HeaderParser().parsestr(archive.read(info).decode()).get_all("Requires-Dist", [])
        light = [r for r in requires if re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() not in HEAVY]
        light = [r for r in light if "extra ==" not in r]
        print(f"check_pythons: {python_requires}, classifiers {', '.join(versions)}; {wheel.name}; "
              f"interpreters under {root}")
        for version in versions:
            began = time.monotonic()
            python = find_interpreter(root, version)
            if python is None:
                failures.append(f"Python {version}: no interpreter {root}/versions/{version}.*/bin/python{version}")
                print(f"  Python {version}: MISSING: no {root}/versions/{version}.*/bin/python{version}")
                continue
            venv = work / f"venv{version}"
            steps = [
                ("byte-compile", [python, "-c", COMPILE_ALL], source),
                ("venv", [uv, "venv", "--quiet", "--python", python, venv], work),
                ("install", [uv, "pip", "install", "--quiet", "--python", venv / "bin" / "python", "--no-deps",
                             wheel], work),
                ("install", [uv, "pip", "install", "--quiet", "--python", venv / "bin" / "python", "pytest",
                             *light], work),
                ("import", [venv / "bin" / "python", "-c", IMPORT_CHECK], work),
                ("tests", [venv / "bin" / "python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                           "--import-mode=importlib", "-m", "not slow", *TORCH_FREE_TESTS], source),
            ]
            for name, command, cwd in steps:
                done = run(command, cwd=cwd, env=env)
                if done.returncode:
                    failures.append(f"Python {version}: {name} failed")
                    print(f"  Python {version} ({python}): {name} FAILED:\n{done.stdout}{done.stderr}")
                    break
            else:
                summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
                print(f"  Python {version} ({python}): ok ({summary}, {time.monotonic() - began:.1f} s)")
    took = time.monotonic() - start
    if failures:
        print(f"check_pythons: FAILED ({took:.0f} s):", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"check_pythons: every claimed Python passed ({took:.0f} s)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2:
        raise SystemExit("usage: python .ci/check_pythons.py [SOURCE_DIR]")
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) == 2 else Path(__file__).resolve().parent.parent).resolve()))
