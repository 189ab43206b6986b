"""Check the built sdist and wheel, then install the wheel in a clean venv and import it (tox.ini: pkg).

Usage: python .ci/check_dist.py DIST_DIR CLEAN_VENV_DIR CONSTRAINTS_FILE
Run after `python -m build` (which builds the wheel from the sdist) and `twine check --strict`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

IMPORT_CHECK = r"""
import importlib.metadata, importlib.resources, importlib.util, sys
import neofix
version = importlib.metadata.version("neofix")
assert neofix.__version__ == version, f"neofix.__version__ {neofix.__version__!r} != metadata version {version!r}"
assert neofix.__file__.startswith(sys.prefix), f"imported {neofix.__file__}, not the clean env's copy"
assert importlib.resources.files("neofix").joinpath("py.typed").is_file(), "py.typed is not installed"
heavy = sorted({"torch", "transformers"} & set(sys.modules))
assert not heavy, f"import neofix imported {heavy}"
print(f"import neofix {neofix.__version__} from {neofix.__file__}: ok")
plugins = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "neofix"]
assert [e.value for e in plugins] == ["pytest_neofix"], f"pytest11 entry points named neofix: {plugins}"
spec = importlib.util.find_spec("pytest_neofix")  # found, not imported: a clean env has no pytest
assert spec is not None and spec.origin.startswith(sys.prefix), f"pytest_neofix is not installed: {spec}"
print(f"pytest plugin pytest_neofix: installed at {spec.origin}")
"""


def fail(message: str) -> None:
    raise SystemExit(f"check_dist: ERROR: {message}")


def only(dist: Path, pattern: str) -> Path:
    found = sorted(dist.glob(pattern))
    if len(found) != 1:
        fail(f"expected one {pattern} in {dist}, found {[p.name for p in found]}")
    return found[0]


def main(dist_dir: str, venv_dir: str, constraints: str) -> None:
    dist = Path(dist_dir)
    wheel, sdist = only(dist, "*.whl"), only(dist, "*.tar.gz")

    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = HeaderParser().parsestr(archive.read(info).decode())
    version = metadata["Version"]
    for required in ("neofix/__init__.py", "neofix/py.typed", "pytest_neofix.py"):
        if required not in names:
            fail(f"{wheel.name} lacks {required}")
    stray = sorted({n.split("/")[0] for n in names} - {"neofix", "pytest_neofix.py", info.split("/")[0]})
    if stray:
        fail(f"{wheel.name} ships more than the neofix package and its pytest plugin: {stray}")
    if not wheel.name.startswith(f"neofix-{version}-"):
        fail(f"{wheel.name} does not match its metadata version {version}")
    with tarfile.open(sdist) as archive:
        for required in ("neofix/py.typed", "pytest_neofix.py"):
            if f"neofix-{version}/{required}" not in archive.getnames():
                fail(f"{sdist.name} lacks {required} (or its version is not {version})")
    print(f"{wheel.name} and {sdist.name}: contents ok, version {version}", flush=True)

    venv = Path(venv_dir)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        ["uv", "pip", "install", "--quiet", "--python", str(python), "--constraint", constraints, str(wheel)],
        check=True,
    )
    subprocess.run([str(python), "-c", IMPORT_CHECK], check=True, cwd=venv)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        fail(__doc__.strip().splitlines()[2])
    main(*sys.argv[1:])
