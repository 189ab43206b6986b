"""The unrelated PyPI distribution named ``neofix`` (issue 37): it installs an import package ``neofix`` too.

Installed beside transformers-neofix, each overwrites the other's files and uninstalling either deletes both.
``import neofix`` tells it from installed metadata (a ``neofix-VERSION.dist-info`` folder), cheaply and without
importing that package; ``neofix doctor`` tells it with importlib.metadata (which still works when that package
overwrote our ``neofix/__init__.py``).  Both say what to do: uninstall it first, then
``pip install --force-reinstall transformers-neofix``.

Torch-free: .ci/check_pythons.py runs this file on every claimed Python (``-m "not slow"``).  The slow test builds
both distributions (ours from this checkout with uv, a stand-in for the other as a hand-made wheel) into one venv.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import neofix
from neofix import _cli

ROOT = Path(__file__).resolve().parents[1]
ADVICE = ("`pip uninstall neofix`", "`pip install --force-reinstall transformers-neofix`")


def test_no_clash_here():
    """The test environments hold transformers-neofix only."""
    assert neofix._name_clash() is None
    assert _cli.name_clash() is None


@pytest.mark.parametrize(
    "folder", ["neofix-0.1.0.dist-info", "NeoFix-0.1.0.dist-info", "neofix.egg-info", "neofix-0.1.0-py3.11.egg-info"]
)
def test_the_other_distributions_metadata_is_found(tmp_path, folder):
    (tmp_path / "transformers_neofix-0.2.0.dist-info").mkdir()
    (tmp_path / folder).mkdir()
    said = neofix._name_clash([tmp_path / "missing", tmp_path])
    assert said is not None and str(tmp_path) in said, said
    assert all(advice in said for advice in ADVICE), said
    if "0.1.0" in folder:
        assert "'neofix' 0.1.0 is installed" in said


@pytest.mark.parametrize(
    "folder", ["transformers_neofix-0.2.0.dist-info", "neofixer-1.0.dist-info", "neofix", "neofix-1.0.tar.gz"]
)
def test_other_names_are_not_a_clash(tmp_path, folder):
    (tmp_path / folder).mkdir()
    assert neofix._name_clash([tmp_path]) is None


def test_the_check_never_raises(tmp_path):
    """Unreadable folders are skipped; a wrong argument gives no answer rather than an error."""
    unreadable = tmp_path / "locked"
    unreadable.mkdir()
    (unreadable / "neofix-0.1.0.dist-info").mkdir()
    unreadable.chmod(0)
    try:
        if os.access(unreadable, os.R_OK):  # root reads it anyway
            pytest.skip("this user reads a folder without permissions")
        assert neofix._name_clash([unreadable]) is None
    finally:
        unreadable.chmod(0o755)
    assert neofix._name_clash(42) is None
    assert neofix._name_clash([None]) is None


def test_the_doctors_report_says_it():
    """The table shows the warning under the versions; the JSON document carries it as ``name_clash``."""
    import json

    from neofix._doctor import Report, _report

    said = "the unrelated distribution 'neofix' 0.1.0 is installed in /x. " + ADVICE[1]
    model = {
        "source": "built-in tiny random GPT-Neo (no download)", "attention_layers": ["global"], "layers": 1,
        "window_size": 4, "vocab_size": 96, "max_position_embeddings": 64, "dtype": "float32",
        "prompt_lengths": [6], "new_tokens": 8, "local_window_crossed": False,
    }
    versions = {"python": "3.11", "torch": "2.13", "transformers": "5.24.0", "neofix": neofix.__version__}
    report = Report(versions, ">=4.26,<6", True, True, [("GPTNeoModel.forward", "patched", "")], "repair", model, [],
                    0.1, name_clash=said)
    table = _report.as_table(report)
    assert "  WARNING: the unrelated distribution 'neofix' 0.1.0" in table
    assert ADVICE[1] in " ".join(table.split())
    assert json.loads(_report.as_json(report))["name_clash"] == said
    assert json.loads(_report.as_json(report._replace(name_clash=None)))["name_clash"] is None
    assert "WARNING" not in _report.as_table(report._replace(name_clash=None))


# --- both distributions in one venv ------------------------------------------------------------------------------

OTHER_FILES = {
    "neofix/__init__.py": '"""A stand-in for the unrelated neofix on PyPI."""\n__version__ = "0.1.0"\n',
    "neofix/cli.py": 'def main():\n    print("the other neofix")\n',
}


def build_other_wheel(folder: Path) -> Path:
    """A pure-Python wheel of a distribution named ``neofix`` 0.1.0 whose import package is ``neofix``."""
    info = "neofix-0.1.0.dist-info"
    files = dict(OTHER_FILES)
    files[f"{info}/METADATA"] = "Metadata-Version: 2.1\nName: neofix\nVersion: 0.1.0\nSummary: not ours\n"
    files[f"{info}/WHEEL"] = "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    files[f"{info}/entry_points.txt"] = "[console_scripts]\nneofix = neofix.cli:main\n"
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    wheel = folder / "neofix-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return wheel


def find_uv() -> str | None:
    return shutil.which("uv", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.mark.slow  # builds the wheel and two venvs: about 10 s
def test_both_distributions_in_one_venv(tmp_path):
    uv = find_uv()
    if uv is None:
        pytest.skip("uv not found (it comes with tox-uv, .ci/requirements.txt)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOFIX_", "PYTHON", "VIRTUAL_ENV", "PYTEST_"))}
    env["PYTHONDONTWRITEBYTECODE"] = "1"

    def run(*command, check=True):
        done = subprocess.run([str(c) for c in command], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=300)
        assert not check or done.returncode == 0, f"{command}:\n{done.stdout}{done.stderr}"
        return done

    run(uv, "build", "--quiet", "--wheel", "--out-dir", tmp_path / "dist", ROOT)
    (ours,) = (tmp_path / "dist").glob("transformers_neofix-*.whl")
    other = build_other_wheel(tmp_path)
    python = tmp_path / "venv" / "bin" / "python"

    def install(*args):
        run(uv, "pip", "install", "--quiet", "--no-deps", "--python", python, *args)

    # the other one first, then ours: ours wrote neofix/__init__.py last, so `import neofix` is ours, and warns
    run(uv, "venv", "--quiet", "--python", sys.executable, tmp_path / "venv")
    install(other)
    install(ours)
    imported = run(python, "-W", "always", "-c", "import neofix")
    assert "NeofixWarning: neofix: the unrelated distribution 'neofix' 0.1.0 is installed in" in imported.stderr
    assert all(advice in imported.stderr for advice in ADVICE), imported.stderr
    assert "import neofix" in imported.stderr.splitlines()[-1] or "<string>" in imported.stderr  # the user's line
    doctor = run(python, "-m", "neofix", "doctor", "--family", "nosuch", check=False)
    assert doctor.returncode == 2, doctor
    said = [line for line in doctor.stderr.splitlines() if line.startswith("neofix doctor: WARNING: ")]
    assert said and said[0].startswith("neofix doctor: WARNING: the unrelated distribution 'neofix' 0.1.0"), doctor
    assert all(advice in said[0] for advice in ADVICE), said

    # the recovery the warning gives: uninstall the other one (which deletes our __init__.py), then reinstall ours
    run(uv, "pip", "uninstall", "--quiet", "--python", python, "neofix")
    broken = run(python, "-c", "import neofix; print(getattr(neofix, '__version__', 'no __version__'))", check=False)
    assert "no __version__" in broken.stdout or broken.returncode, broken  # the empty namespace package the docs name
    install("--force-reinstall", ours)
    fixed = run(python, "-W", "always", "-c", "import neofix; print(neofix.__version__)")
    assert fixed.stdout.strip() == neofix.__version__ and "NeofixWarning" not in fixed.stderr, fixed

    # ours first, then the other one: `import neofix` is the other's, but `python -m neofix doctor` still says it
    install(other)
    doctor = run(python, "-m", "neofix", "doctor", "--family", "nosuch", check=False)
    assert doctor.returncode == 2, doctor
    assert doctor.stderr.startswith("neofix doctor: WARNING: the unrelated distribution 'neofix' 0.1.0"), doctor.stderr
    assert "NeofixWarning" not in doctor.stderr  # the other package's __init__.py ran: only the doctor could say it
