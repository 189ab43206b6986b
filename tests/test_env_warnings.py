"""A NEOFIX_* value neofix does not understand is reported at the user's ``import neofix`` line, not inside neofix.

Torch-free: .ci/check_pythons.py runs this file on every Python that setup.cfg claims (pytest --noconftest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

VARIABLES = {
    "NEOFIX_MODE": "NEOFIX_MODE='bogus' is not one of",
    "NEOFIX_CHECK_VALUES": "NEOFIX_CHECK_VALUES='bogus' is not a boolean",
    "NEOFIX_TRACE": "NEOFIX_TRACE='bogus' is not a boolean",
    "NEOFIX_DISABLE": "NEOFIX_DISABLE='bogus' is not a boolean",
}


def run_script(directory, main: str, variable: str, **files: str) -> str:
    for name, source in {"main.py": main, **files}.items():
        (directory / name).write_text(textwrap.dedent(source).lstrip("\n"), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOFIX_")}
    env[variable] = "bogus"
    result = subprocess.run(
        [sys.executable, "-W", "always", str(directory / "main.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=directory,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stderr


@pytest.mark.parametrize("variable", sorted(VARIABLES))
def test_warning_names_the_import_line(tmp_path, variable):
    stderr = run_script(
        tmp_path,
        """
        import os

        import neofix  # line 3
        """,
        variable,
    )
    assert f"{tmp_path / 'main.py'}:3: NeofixWarning: {VARIABLES[variable]}" in stderr, stderr


@pytest.mark.parametrize("variable", sorted(VARIABLES))
def test_warning_names_the_import_in_the_users_module(tmp_path, variable):
    """neofix imported by the user's own module, itself imported, and through importlib.import_module."""
    stderr = run_script(
        tmp_path,
        """
        import importlib

        importlib.import_module("mypackage")
        """,
        variable,
        **{"mypackage.py": '"""A module of the user\'s project."""\nimport neofix  # line 2\n'},
    )
    assert f"{tmp_path / 'mypackage.py'}:2: NeofixWarning: {VARIABLES[variable]}" in stderr, stderr
