"""``neofix doctor``: the table, the JSON document, exit statuses, --strict, --model, and a process left as found.

The full self-check runs a few times here (in this process, and once as ``python -m neofix doctor``): every tox
env runs this file, so the vanilla column is checked against the known failures of each transformers release.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import transformers

import neofix
from neofix import _cli, _errors, _lifecycle
from neofix._doctor import Cell, _judge, _Outcome, _scenarios, shorten_error
from neofix._families import FAMILIES
from neofix.testing import tiny_gpt_neo

from ._versions import TF_RELEASE

KEYS = [
    "stale_mask",
    "padded_no_positions",
    "stale_positions",
    "arange_positions",
    "frozen_positions",
    "chunked_prefill",
    "mask_too_long",
    "batch_mismatch",
    "position_overflow",
    "out_of_vocabulary",
    "generate_greedy",
    "generate_beam",
    "generate_eos_near_the_end",
]
TARGETS = [name for name, _, _ in _lifecycle.status()]


def run_main(*args: str) -> tuple[int, str, str]:
    """``neofix ARGS`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = _cli.main(list(args))
        except SystemExit as exc:  # argparse
            status = exc.code
    return status, out.getvalue(), err.getvalue()


def run_command(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "neofix", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def report():
    """One default ``neofix doctor --json`` run, in this process, shared by the tests that read it."""
    status, out, err = run_main("doctor", "--json")
    assert status == 0, out + err
    return json.loads(out)


@pytest.fixture
def two_scenarios(monkeypatch):
    """A quick doctor: the stale-mask loop and greedy generate only."""
    chosen = tuple(s for s in _scenarios.SCENARIOS if s.key in ("stale_mask", "generate_greedy"))
    monkeypatch.setattr(_scenarios, "SCENARIOS", chosen)


# --- the default run ------------------------------------------------------------------------------------------


def test_command_prints_the_table():
    """``python -m neofix doctor``, as a user runs it: the table on stdout, progress (and nothing else) on stderr,
    even with NEOFIX_TRACE=1 (which logs every patched step)."""
    done = run_command("doctor", NEOFIX_TRACE="1")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("neofix doctor\n")
    assert f"transformers  {transformers.__version__}" in out
    assert f"torch         {torch.__version__}" in out
    assert f"neofix        {neofix.__version__}" in out
    assert "inside the tested range (>=4.26,<6)" in out
    assert "patched in this process" in out
    for target in TARGETS:
        assert f"  {target}  " in out
    assert "4 layers (global, local, global, local), local window 4" in out
    assert "every sequence crosses the local window" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("scenario"))
    assert f"vanilla transformers {transformers.__version__}" in header and "neofix (repair mode)" in header
    main_table, _, other_lines = out.partition("Other families")
    rows = [line for line in main_table.splitlines() if line.endswith("  ok")]
    assert len(rows) == len(KEYS)
    # one line per other family, each with its quick self-check's verdicts, all right
    verdicts = [line for line in other_lines.splitlines() if "neofix verdicts right" in line]
    assert len(verdicts) == len(FAMILIES) - 1 and all(line.endswith("  ok") for line in verdicts), other_lines
    quick = sum(int(line.split(" of ")[1].split()[0]) for line in verdicts)
    assert f"All {len(KEYS) + quick} neofix verdicts are right" in out
    assert "WRONG" not in out and "Traceback" not in done.stderr
    # the vanilla failures and neofix's answers, in the table's words
    table = {line.split("  ")[1]: line for line in rows}
    assert "repaired" in table["hand-written loop, stale mask"]
    assert "wrong tokens, no error" in table["left-padded loop, no position_ids"]
    assert "IndexError: index out of range in self" in table["token id >= vocab_size"]
    assert "clear error: TokenIdError" in table["token id >= vocab_size"]
    assert "clear error: SequenceTooLongError" in table["past max_position_embeddings"]
    # progress on stderr, one line per step; no warnings from the vanilla runs
    progress = done.stderr.splitlines()
    assert f"neofix doctor: [{len(KEYS)}/{len(KEYS)}] generate past the table, EOS in time" in progress
    assert all(line.startswith("neofix doctor: ") for line in progress), done.stderr


def test_json_document(report):
    assert report["schema"] == 1
    assert report["versions"] == {
        "python": report["versions"]["python"],
        "torch": str(torch.__version__),
        "transformers": transformers.__version__,
        "neofix": neofix.__version__,
    }
    assert report["transformers_supported"] is True
    assert report["transformers_tested_range"] == ">=4.26,<6"
    assert report["patched_on_arrival"] is True
    assert [t["target"] for t in report["patch_targets"]] == TARGETS
    states = {t["target"]: t["state"] for t in report["patch_targets"]}
    assert states["GPTNeoModel.forward"] == "patched"
    assert set(states.values()) <= {"patched", "skipped", "missing"}
    assert report["mode"] == "repair"
    assert report["model"]["source"].startswith("built-in tiny random GPT-Neo")
    assert report["model"]["local_window_crossed"] is True
    assert [s["key"] for s in report["scenarios"]] == KEYS
    for scenario in report["scenarios"]:
        assert set(scenario) == {"key", "title", "vanilla", "neofix", "expected", "right"}
        for column in ("vanilla", "neofix"):
            assert set(scenario[column]) == {"kind", "text", "error_class", "message"}
        assert scenario["right"] is True, scenario
    assert report["all_right"] is True and report["exit_status"] == 0
    assert isinstance(report["seconds"], float)


def by_key(report):
    return {s["key"]: s for s in report["scenarios"]}


def test_vanilla_column_shows_the_known_failures(report):
    """DESIGN.md's vanilla behaviour, release by release, as the doctor measures it (never hard-coded there)."""
    rows = by_key(report)
    vanilla = {key: row["vanilla"] for key, row in rows.items()}
    if TF_RELEASE < (5, 10):
        assert vanilla["stale_mask"]["kind"] == "error"
        assert vanilla["stale_mask"]["error_class"] == "RuntimeError"
        assert "must match" in vanilla["stale_mask"]["text"]
    else:
        assert vanilla["stale_mask"]["kind"] == "wrong_tokens"
        assert vanilla["stale_mask"]["text"] == "wrong tokens, no error"
    assert vanilla["padded_no_positions"]["kind"] == "wrong_tokens"
    assert vanilla["stale_positions"]["error_class"] == "RuntimeError"
    assert vanilla["chunked_prefill"]["kind"] == "wrong_tokens"
    if TF_RELEASE <= (4, 40):
        assert vanilla["mask_too_long"]["error_class"] == "RuntimeError"
    else:
        assert vanilla["mask_too_long"]["kind"] == "accepted"
    assert vanilla["batch_mismatch"]["error_class"] in ("RuntimeError", "IndexError")
    for key in ("position_overflow", "out_of_vocabulary"):
        assert vanilla[key]["text"] == "IndexError: index out of range in self"
    for key in ("generate_greedy", "generate_beam"):
        assert vanilla[key]["kind"] == "correct"
    for row in rows.values():
        assert not row["vanilla"]["text"].startswith("clear error"), "the vanilla column ran with neofix"


def test_neofix_column_repairs_or_names_the_error(report):
    rows = by_key(report)
    for key in ("stale_mask", "padded_no_positions", "stale_positions", "chunked_prefill"):
        assert rows[key]["neofix"]["kind"] == "repaired", rows[key]
        assert rows[key]["expected"] == "reference tokens"
    errors = {
        "mask_too_long": "MaskLengthError",
        "batch_mismatch": "BatchMismatchError",
        "position_overflow": "SequenceTooLongError",
        "out_of_vocabulary": "TokenIdError",
    }
    for key, name in errors.items():
        assert rows[key]["neofix"]["kind"] == "clear_error"
        assert rows[key]["neofix"]["text"] == f"clear error: {name}"
        assert rows[key]["neofix"]["message"]  # the whole first line of neofix's message
    for key in ("generate_greedy", "generate_beam"):
        assert rows[key]["neofix"]["text"] == "correct"
        assert rows[key]["expected"] == "reference tokens, identical to vanilla"


# --- --strict -------------------------------------------------------------------------------------------------


def test_strict_mode_turns_repairs_into_errors():
    status, out, err = run_main("doctor", "--strict", "--json")
    assert status == 0, out + err
    document = json.loads(out)
    assert document["mode"] == "strict"
    rows = by_key(document)
    assert rows["stale_mask"]["neofix"]["text"] == "clear error: MaskLengthError"
    assert rows["stale_positions"]["neofix"]["text"] == "clear error: PositionError"
    # missing positions are derived from the mask in strict mode too: no repair, no error
    assert rows["padded_no_positions"]["neofix"]["kind"] == "repaired"
    assert rows["chunked_prefill"]["neofix"]["kind"] == "repaired"
    assert rows["out_of_vocabulary"]["neofix"]["text"] == "clear error: TokenIdError"
    assert rows["generate_beam"]["neofix"]["text"] == "correct"
    assert all(row["right"] for row in rows.values())
    assert neofix.configure() == {"mode": "repair", "check_values": False, "uncached_positions": "mask"}, (
        "strict mode leaked out of the doctor"
    )


def test_strict_table_says_what_right_means(two_scenarios):
    status, out, _ = run_main("doctor", "--strict")
    assert status == 0
    assert "neofix (strict mode)" in out
    assert "Strict mode: steps neofix would repair" in out


# --- exit status 1 ----------------------------------------------------------------------------------------------


def test_exit_status_1_when_neofix_gets_a_scenario_wrong(monkeypatch, two_scenarios):
    """A neofix whose model-forward wrapper does nothing: the stale-mask loop is not repaired."""
    from neofix import _wrappers

    monkeypatch.setattr(_wrappers, "make_model_forward", lambda original, adapter: original)
    neofix.unpatch()  # the doctor patches with the broken wrapper
    try:
        status, out, err = run_main("doctor")
    finally:
        neofix.unpatch()  # the doctor put back a patch built with the broken wrapper
        monkeypatch.undo()
        neofix.patch()
    assert status == 1, out + err
    stale = next(line for line in out.splitlines() if "hand-written loop, stale mask" in line)
    assert stale.endswith("WRONG, expected reference tokens")
    generate = next(line for line in out.splitlines() if "generate, greedy" in line)
    assert generate.endswith("  ok")
    # the other families' quick checks (the same two scenarios each) count too: the broken wrapper is theirs as well
    others = len(FAMILIES) - 1
    assert re.search(rf"\b\d+ of {2 + 2 * others} neofix verdicts are WRONG", out), out


class _Fake:
    def __init__(self, error=None, strict_error=None, parity=False):
        self.key, self.title = "fake", "fake scenario"
        self.error, self.strict_error, self.parity = error, strict_error, parity

    def expected_error(self, strict):
        return self.strict_error if strict else self.error


TOKENS = torch.tensor([[1, 2, 3]])
OTHER = torch.tensor([[1, 2, 4]])


@pytest.mark.parametrize(
    "scenario, vanilla, fixed, right, text",
    [
        (_Fake(), _Outcome(OTHER, None), _Outcome(TOKENS, None), True, "repaired"),
        (_Fake(), _Outcome(TOKENS, None), _Outcome(TOKENS, None), True, "correct"),
        (_Fake(), _Outcome(OTHER, None), _Outcome(OTHER, None), False, "wrong tokens, no error"),
        (_Fake(), _Outcome(OTHER, None), _Outcome(None, neofix.MaskLengthError("x")), False, "clear error: MaskLengthError"),
        (_Fake(neofix.TokenIdError), _Outcome(None, IndexError("index out of range in self")),
         _Outcome(None, neofix.TokenIdError("x")), True, "clear error: TokenIdError"),
        (_Fake(neofix.TokenIdError), _Outcome(None, IndexError("i")), _Outcome(None, neofix.PositionError("x")),
         False, "clear error: PositionError"),
        (_Fake(neofix.TokenIdError), _Outcome(None, IndexError("i")), _Outcome(None, IndexError("index out")),
         False, "IndexError: index out"),
        (_Fake(neofix.TokenIdError), _Outcome(TOKENS, None), _Outcome(TOKENS, None), False,
         "accepted, no error (tokens as intended)"),
        (_Fake(parity=True), _Outcome(OTHER, None), _Outcome(TOKENS, None), False, "differs from vanilla"),
        (_Fake(parity=True), _Outcome(TOKENS, None), _Outcome(TOKENS, None), True, "correct"),
    ],
)
def test_verdicts(scenario, vanilla, fixed, right, text):
    row = _judge(scenario, TOKENS, vanilla, fixed, strict=False)
    assert row.right is right
    assert row.neofix.text == text


def test_strict_verdicts_use_the_strict_expectation():
    scenario = _Fake(error=None, strict_error=neofix.MaskLengthError)
    wrong = _Outcome(OTHER, None)
    assert _judge(scenario, TOKENS, wrong, _Outcome(None, neofix.MaskLengthError("x")), strict=True).right
    assert not _judge(scenario, TOKENS, wrong, _Outcome(TOKENS, None), strict=True).right
    assert not _judge(scenario, TOKENS, wrong, _Outcome(None, neofix.MaskLengthError("x")), strict=False).right


def test_not_patched_is_wrong():
    row = _judge(_Fake(), TOKENS, _Outcome(OTHER, None), None, strict=False)
    assert row.neofix == Cell("not_patched", "not patched") and not row.right


def test_errors_are_shortened_to_one_line():
    error = RuntimeError(
        "The size of tensor a (6) must match the size of tensor b (5) at non-singleton dimension 3\nmore"
    )
    assert shorten_error(error) == "RuntimeError: size of tensor a (6) must match b (5)"
    long = shorten_error(ValueError("x" * 200))
    assert len(long) == 66 and long.endswith("...")
    assert shorten_error(KeyError()) == "KeyError"


# --- the process is left as found -------------------------------------------------------------------------------


def test_leaves_the_process_as_found(two_scenarios):
    previous = neofix.configure(mode="strict", check_values=True)
    _errors._warned.add("a repair reported before the doctor")
    reported = set(_errors._warned)
    verbosity = transformers.logging.get_verbosity()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            filters = list(warnings.filters)
            status, out, _ = run_main("doctor")
            assert warnings.filters == filters
        assert status == 0, out
        assert "neofix (repair mode)" in out  # the doctor's own mode, not the process's
        assert neofix.is_patched()
        assert neofix.configure() == {"mode": "strict", "check_values": True, "uncached_positions": "mask"}
        assert _errors._warned == reported
        assert transformers.logging.get_verbosity() == verbosity
        assert not logging.getLogger("neofix").disabled
        assert torch.is_grad_enabled()
    finally:
        neofix.configure(**previous)


def test_unpatched_on_arrival_stays_unpatched(two_scenarios):
    neofix.unpatch()
    status, out, _ = run_main("doctor", "--json")
    assert status == 0, out
    document = json.loads(out)
    assert document["patched_on_arrival"] is False
    assert all(row["right"] for row in document["scenarios"])  # the neofix column was patched all the same
    assert document["patch_targets"][0]["state"] == "patched"
    assert not neofix.is_patched()
    assert not _lifecycle._hooks_enabled  # the import hook stays off, as neofix.unpatch() left it


# --- --model ------------------------------------------------------------------------------------------------------


def test_model_from_a_local_checkpoint(tmp_path):
    folder = tmp_path / "my-gpt-neo"
    tiny_gpt_neo(seed=3).save_pretrained(folder)
    status, out, err = run_main("doctor", "--model", str(folder), "--json")
    assert status == 0, out + err
    document = json.loads(out)
    assert document["model"]["source"] == f"checkpoint {folder}"
    assert [s["key"] for s in document["scenarios"]] == KEYS
    assert all(s["right"] for s in document["scenarios"])
    assert f"loading {folder}" in err


def expect_usage_error(*args: str) -> str:
    status, out, err = run_main(*args)
    assert status == 2, out + err
    assert out == "" and "Traceback" not in err
    return err


def test_model_that_is_not_gpt_neo(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    config = GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=50, n_positions=32, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    err = expect_usage_error("doctor", "--model", str(folder))
    assert "this is a 'gpt2' checkpoint (GPT2LMHeadModel), not GPT-Neo" in err


def test_model_path_missing(tmp_path):
    err = expect_usage_error("doctor", "--model", str(tmp_path / "nowhere"))
    assert f"--model {tmp_path / 'nowhere'}: no such directory" in err


def test_model_path_is_a_file(tmp_path):
    file = tmp_path / "config.json"
    file.write_text("{}")
    assert "this is a file" in expect_usage_error("doctor", "--model", str(file))


def test_model_folder_without_config(tmp_path):
    assert "no config.json in this folder" in expect_usage_error("doctor", "--model", str(tmp_path))


def test_model_folder_with_a_broken_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    assert "cannot read its config.json" in expect_usage_error("doctor", "--model", str(tmp_path))


def test_model_folder_without_weights(tmp_path):
    tiny_gpt_neo().config.save_pretrained(tmp_path)
    assert "cannot load the weights" in expect_usage_error("doctor", "--model", str(tmp_path))


def test_model_too_small_for_the_check(tmp_path):
    tiny_gpt_neo(max_position_embeddings=8).config.save_pretrained(tmp_path)
    assert "too small for the self-check" in expect_usage_error("doctor", "--model", str(tmp_path))


# --- usage ----------------------------------------------------------------------------------------------------


def test_unknown_option_is_a_usage_error():
    status, out, err = run_main("doctor", "--bogus")
    assert status == 2 and "unrecognized arguments: --bogus" in err


def test_no_command_shows_help_and_status_2():
    status, out, err = run_main()
    assert status == 2 and "doctor" in err and "name a command" in err


def test_help_explains_the_command():
    status, out, _ = run_main("doctor", "--help")
    assert status == 0
    for words in ("--model PATH", "--json", "--strict", "exit status:", "vanilla transformers", "nothing is downloaded"):
        assert words in " ".join(out.split()), words


def test_version():
    status, out, _ = run_main("--version")
    assert status == 0 and out.strip() == f"neofix {neofix.__version__}"


def test_help_does_not_import_torch():
    code = "import sys, neofix._cli as c; c.build_parser(); print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[]", done.stderr


def test_console_script_is_declared():
    scripts = importlib.metadata.entry_points(group="console_scripts")
    assert [ep.value for ep in scripts if ep.name == "neofix"] == ["neofix._cli:main"]


def test_a_failing_reference_is_reported_not_raised(monkeypatch):
    def broken(context):
        raise RuntimeError("the reference broke")

    first = _scenarios.SCENARIOS[0]
    monkeypatch.setattr(_scenarios, "SCENARIOS", (first._replace(reference=broken),))
    status, out, err = run_main("doctor")
    assert status == 1, out + err
    assert "no reference: RuntimeError: the reference broke" in out
    assert "WRONG, expected a full-recompute reference" in out


def test_unknown_family_is_a_usage_error():
    status, out, err = run_main("doctor", "--family", "gpt5")
    assert status == 2
    assert "--family gpt5: no such family; choose from gpt_neo" in err
