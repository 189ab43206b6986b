"""The ``neofix`` command's usage errors: each names the usage of the command it belongs to, and exits 2.

Torch-free (argparse fails before the doctor imports anything): .ci/check_pythons.py runs this file on every
Python that setup.cfg claims (pytest --noconftest).  tests/test_doctor.py tests the doctor itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def neofix_command(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "neofix", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    "args, unknown",
    [
        (["doctor", "--bogus"], "--bogus"),
        (["doctor", "--json", "--bogus", "extra"], "--bogus extra"),
        (["doctor", "doctor"], "doctor"),
    ],
)
def test_an_argument_unknown_to_doctor_prints_doctors_usage(args, unknown):
    done = neofix_command(*args)
    assert done.returncode == 2, done
    assert done.stderr.startswith("usage: neofix doctor [-h] [--family NAME] [--model PATH] [--json] [--strict]\n"), done.stderr
    assert done.stderr.endswith(f"neofix doctor: error: unrecognized arguments: {unknown}\n"), done.stderr
    assert done.stdout == ""


def test_a_missing_option_value_prints_doctors_usage():
    done = neofix_command("doctor", "--model")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: neofix doctor "), done.stderr
    assert "error: argument --model: expected one argument" in done.stderr


@pytest.mark.parametrize("args", [["--bogus"], ["--bogus", "doctor"]])
def test_an_unknown_top_level_option_prints_the_top_level_usage(args):
    done = neofix_command(*args)
    assert done.returncode == 2, done
    assert done.stderr.startswith("usage: neofix [-h] [--version] COMMAND ...\n"), done.stderr
    assert done.stderr.endswith("neofix: error: unrecognized arguments: --bogus\n"), done.stderr


def test_an_unknown_command_lists_the_commands():
    done = neofix_command("doctr")
    assert done.returncode == 2
    assert done.stderr.startswith("usage: neofix [-h] [--version] COMMAND ...\n"), done.stderr
    assert "invalid choice: 'doctr'" in done.stderr
