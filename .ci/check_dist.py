"""Check the built sdist and wheel, then install the wheel in a clean venv and import it (tox.ini: pkg).

Usage: python .ci/check_dist.py DIST_DIR CLEAN_VENV_DIR CONSTRAINTS_FILE
Run after .ci/build_dist.py (which builds the wheel from the sdist) and `twine check --strict`.

The names: the distribution is `transformers-neofix` (`neofix` on the package index is an unrelated project); the
import name, the console script and the pytest11 entry point are `neofix`.  The license is an SPDX expression.
Last, the name clash: a stand-in for that unrelated project (a wheel named `neofix` whose import package is `neofix`)
installed before this wheel in a second clean venv must make `import neofix` and `python -m neofix doctor` say so.
"""

from __future__ import annotations

import configparser
import shutil
import subprocess
import sys
import tarfile
import zipfile
from email.parser import HeaderParser
from pathlib import Path

DISTRIBUTION = "transformers-neofix"
LICENSE = "Apache-2.0"
ENTRY_POINTS = {"console_scripts": {"neofix": "neofix._cli:main"}, "pytest11": {"neofix": "pytest_neofix"}}

IMPORT_CHECK = r"""
import importlib.metadata, importlib.resources, importlib.util, sys
import neofix
version = importlib.metadata.version("transformers-neofix")
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
try:
    other = importlib.metadata.distribution("neofix")
except importlib.metadata.PackageNotFoundError:
    pass
else:
    raise AssertionError(f"a distribution named neofix {other.version} is installed: the unrelated project's name")
"""


CLASH_ADVICE = "`pip uninstall neofix`, then `pip install --force-reinstall transformers-neofix`"


def other_neofix_wheel(folder: Path) -> Path:
    """A wheel of a distribution named neofix 0.1.0 that installs an import package neofix (tests/test_name_clash.py
    builds the same)."""
    info = "neofix-0.1.0.dist-info"
    files = {
        "neofix/__init__.py": '__version__ = "0.1.0"\n',
        "neofix/cli.py": "def main():\n    print('the other neofix')\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: neofix\nVersion: 0.1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "neofix-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


def check_name_clash(wheel: Path, venv: Path) -> None:
    """The other neofix installed first, then this wheel (--no-deps: nothing here needs torch)."""
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    for package in (other_neofix_wheel(venv.parent / f"{venv.name}-wheel"), wheel):
        subprocess.run(["uv", "pip", "install", "--quiet", "--no-deps", "--python", str(python), str(package)],
                       check=True)
    imported = subprocess.run([str(python), "-W", "always", "-c", "import neofix"], capture_output=True, text=True,
                              cwd=venv)
    if imported.returncode or "the unrelated distribution 'neofix' 0.1.0" not in imported.stderr \
            or CLASH_ADVICE not in imported.stderr:
        fail(f"import neofix beside the unrelated neofix did not warn as it should:\n{imported.stderr}")
    doctor = subprocess.run([str(python), "-m", "neofix", "doctor", "--family", "nosuch"], capture_output=True,
                            text=True, cwd=venv)
    said = [line for line in doctor.stderr.splitlines() if line.startswith("neofix doctor: WARNING: ")]
    if doctor.returncode != 2 or not said or CLASH_ADVICE not in said[0]:
        fail(f"neofix doctor beside the unrelated neofix did not warn as it should:\n{doctor.stderr}")
    print("name clash: import neofix and neofix doctor warn beside the unrelated neofix, with the repair")


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
        entry_points = configparser.ConfigParser(delimiters=("=",))
        entry_points.optionxform = str  # keep names as written
        entry_points.read_string(archive.read(info.replace("METADATA", "entry_points.txt")).decode())
    version = metadata["Version"]
    if metadata["Name"] != DISTRIBUTION:
        fail(f"{wheel.name}: the distribution is named {metadata['Name']!r}, not {DISTRIBUTION!r}")
    if metadata["License-Expression"] != LICENSE or metadata["License"] is not None:
        fail(
            f"{wheel.name}: License-Expression {metadata['License-Expression']!r}, License {metadata['License']!r}: "
            f"expected the SPDX expression {LICENSE!r} and no License field"
        )
    classifiers = [c for c in metadata.get_all("Classifier", []) if c.startswith("License ::")]
    if classifiers:
        fail(f"{wheel.name}: license classifiers are deprecated in favour of License-Expression: {classifiers}")
    found = {group: dict(entry_points[group]) for group in entry_points.sections()}
    if found != ENTRY_POINTS:
        fail(f"{wheel.name}: entry points {found}, expected {ENTRY_POINTS}")
    for required in ("neofix/__init__.py", "neofix/py.typed", "pytest_neofix.py"):
        if required not in names:
            fail(f"{wheel.name} lacks {required}")
    stray = sorted({n.split("/")[0] for n in names} - {"neofix", "pytest_neofix.py", info.split("/")[0]})
    if stray:
        fail(f"{wheel.name} ships more than the neofix package and its pytest plugin: {stray}")
    stem = f"{DISTRIBUTION.replace('-', '_')}-{version}"  # file names normalise '-' to '_'
    if not wheel.name.startswith(f"{stem}-"):
        fail(f"{wheel.name} does not match its metadata name and version {stem}")
    with tarfile.open(sdist) as archive:
        for required in ("neofix/py.typed", "pytest_neofix.py"):
            if f"{stem}/{required}" not in archive.getnames():
                fail(f"{sdist.name} lacks {required} (or its name and version are not {stem})")
    print(
        f"{wheel.name} and {sdist.name}: contents ok; distribution {DISTRIBUTION} {version}, import name neofix, "
        f"console script neofix, pytest plugin neofix, License-Expression {LICENSE}",
        flush=True,
    )

    venv = Path(venv_dir)
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        ["uv", "pip", "install", "--quiet", "--python", str(python), "--constraint", constraints, str(wheel)],
        check=True,
    )
    subprocess.run([str(python), "-c", IMPORT_CHECK], check=True, cwd=venv)
    command = subprocess.run([str(venv / "bin" / "neofix"), "--version"], capture_output=True, text=True, cwd=venv)
    if command.returncode or command.stdout.strip() != f"neofix {version}":
        fail(f"the console script: `neofix --version` printed {command.stdout!r} {command.stderr!r}")
    print(f"console script: {command.stdout.strip()}")
    check_name_clash(wheel, venv.parent / f"{venv.name}-clash")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        fail(__doc__.strip().splitlines()[2])
    main(*sys.argv[1:])
