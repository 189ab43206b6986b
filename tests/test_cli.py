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


# --- the --help texts say what the commands do (issue 37) ----------------------------------------------------------


def test_the_top_level_help_names_every_family():
    from neofix import _cli
    from neofix._families import FAMILIES

    done = neofix_command("--help")
    assert done.returncode == 0, done
    text = " ".join(done.stdout.split())
    from neofix._families import count_in_words

    assert f"correct at every step, for {count_in_words()} decoder families" in text
    for family in FAMILIES.values():
        assert family.title in text, family.title


def test_the_doctors_help_lists_the_families_it_takes():
    from neofix._families import FAMILIES

    done = neofix_command("doctor", "--help")
    assert done.returncode == 0, done
    text = " ".join(done.stdout.split())
    assert f"one of: {', '.join(FAMILIES)})" in text, text
    assert "neofix doctor --family gpt2" in done.stdout
    assert "GPT-Neo checkpoint" not in text and "each place in GPT-Neo" not in text


def test_the_doctors_help_counts_its_scenarios():
    """SCENARIO_COUNT and QUICK_COUNT (in the help) are the doctor's own lists' lengths."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from neofix import _cli, _doctor
    from neofix._doctor._scenarios import SCENARIOS

    assert _cli.SCENARIO_COUNT == len(SCENARIOS)
    assert _cli.QUICK_COUNT == len(_doctor.QUICK)
    text = " ".join(neofix_command("doctor", "--help").stdout.split())
    assert f"Up to {len(SCENARIOS)} decoding scenarios" in text
    assert f"quick self-check of {len(_doctor.QUICK)} scenarios" in text


def test_an_unknown_family_is_a_usage_error():
    """Exit status 2, as the help says, before torch is imported (torch-free)."""
    from neofix._families import FAMILIES

    done = neofix_command("doctor", "--family", "gemma5")
    assert done.returncode == 2, done
    assert f"--family gemma5: no such family; choose from {', '.join(FAMILIES)}" in " ".join(done.stderr.split())


def test_a_folder_without_a_checkpoint_is_a_usage_error(tmp_path):
    done = neofix_command("doctor", "--model", str(tmp_path))
    assert done.returncode == 2, done
    assert "no config.json in this folder" in done.stderr
    done = neofix_command("doctor", "--model", str(tmp_path / "missing"))
    assert done.returncode == 2 and "holding a checkpoint of the family" in done.stderr, done


def test_a_checkpoint_of_another_family_is_a_usage_error(tmp_path):
    """--model of a GPT-2 checkpoint without --family gpt2: exit 2, naming the option to pass."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=32).save_pretrained(tmp_path)
    done = neofix_command("doctor", "--model", str(tmp_path))
    assert done.returncode == 2, done
    assert "this is a 'gpt2' checkpoint" in done.stderr and "pass --family gpt2 for it" in done.stderr, done.stderr
