"""``neofix doctor``: the table, the JSON document, exit statuses, --strict, --model, and a process left as found.

The full self-check runs a few times here (in this process, and once as ``python -m neofix doctor``): every tox
env runs this file, so the vanilla column is checked against the known failures of each transformers release.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import inspect
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
from neofix._doctor import Cell, _scenarios, shorten_error
from neofix._families import FAMILIES
from neofix.testing import FAMILY_CONFIGS as _CONFIGS

#: the families the installed transformers has
HERE = [name for name in FAMILIES if hasattr(transformers, _CONFIGS[name][0]) and FAMILIES[name].patched_here()]
from neofix.testing import tiny_gpt_neo, tiny_model

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


def gpt_neo_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The doctor's runs check GPT-Neo's table only: the other families' quick checks, about 20 s of a run on 5.x, are
    :func:`test_command_prints_the_table`'s (every family, as a user runs it) and, with two scenarios each,
    :func:`test_every_family_is_loaded_before_the_check`'s (their JSON)."""
    monkeypatch.setattr(_doctor, "run", functools.partial(_doctor.run, others=False))


@pytest.fixture(scope="module")
def report():
    """One default ``neofix doctor --json`` run (GPT-Neo's table: :func:`gpt_neo_only`), in this process, shared by
    the tests that read it."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        gpt_neo_only(monkeypatch)
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
    assert not re.search(r"  pending  ", out), out  # every family's module loaded first: each target's state told
    assert "4 layers (global, local, global, local), local window 4" in out
    assert "every sequence crosses the local window" in out
    header = next(line for line in out.splitlines() if line.strip().startswith("scenario"))
    assert f"vanilla transformers {transformers.__version__}" in header and "neofix (repair mode)" in header
    main_table, _, other_lines = out.partition("Other families")
    rows = [line for line in main_table.splitlines() if line.endswith("  ok")]
    assert len(rows) == len(KEYS)
    # one line per other family, each with its quick self-check's verdicts, all right
    verdicts = [line for line in other_lines.splitlines() if "neofix verdicts right" in line]
    assert len(verdicts) == len(HERE) - 1 and all(line.endswith("  ok") for line in verdicts), other_lines
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
    # (a family whose module this process has not loaded is pending: the default run loads every family first, which
    # test_command_prints_the_table checks)
    assert set(states.values()) <= {"patched", "skipped", "missing", "pending"}
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


def test_strict_mode_turns_repairs_into_errors(monkeypatch):
    gpt_neo_only(monkeypatch)
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


def test_strict_table_says_what_right_means(monkeypatch, two_scenarios):
    gpt_neo_only(monkeypatch)  # the table's header and footer: the other families' lines are not read
    status, out, _ = run_main("doctor", "--strict")
    assert status == 0
    assert "neofix (strict mode)" in out
    assert "Strict mode: steps neofix would repair" in out


# --- exit status 1 ----------------------------------------------------------------------------------------------


def test_exit_status_1_when_neofix_gets_a_scenario_wrong(monkeypatch, two_scenarios):
    """A neofix whose model-forward wrapper does nothing: the stale-mask loop is not repaired."""
    from neofix import _wrappers

    monkeypatch.setattr(_wrappers, "make_model_forward", lambda original, adapter: original)
    # the doctor patches with the broken wrapper; leaving the block removes that patch and patches with the real one
    with neofix.unpatched():
        try:
            status, out, err = run_main("doctor")
        finally:
            monkeypatch.undo()
    assert status == 1, out + err
    stale = next(line for line in out.splitlines() if "hand-written loop, stale mask" in line)
    assert stale.endswith("WRONG, expected reference tokens")
    generate = next(line for line in out.splitlines() if "generate, greedy" in line)
    assert generate.endswith("  ok")
    # the other families' quick checks (the same two scenarios each) count too: the broken wrapper is theirs as well
    others = len(FAMILIES) - 1
    if len(HERE) == len(FAMILIES) and TF_RELEASE >= (4, 53):  # else families absent or Gemma's HybridCache limits
        assert re.search(rf"\b\d+ of {2 + 2 * others} neofix verdicts are WRONG", out), out
    else:
        assert re.search(r"\b\d+ of \d+ neofix verdicts are WRONG", out), out


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
    with neofix.unpatched():
        status, out, _ = run_main("doctor", "--json")
        assert status == 0, out
        document = json.loads(out)
        assert document["patched_on_arrival"] is False
        assert all(row["right"] for row in document["scenarios"])  # the neofix column was patched all the same
        assert document["patch_targets"][0]["state"] == "patched"
        assert not neofix.is_patched()
        assert not _lifecycle._hooks_enabled  # the import hook stays off, as neofix.unpatched() left it


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


# --- run(): what the self-check runs, on which model, and what it returns ------------------------------------------

from neofix import _doctor  # noqa: E402
from neofix._doctor import Row, _report  # noqa: E402

ALL_MODULES = [family.module for family in FAMILIES.values()]
GPT_NEO_MODULE = FAMILIES["gpt_neo"].module
CORRECT = Cell("correct", "correct")


def probe_scenario(seen):
    """A scenario that notes what the self-check runs it with (settings, threads, patch, model, adapter) and gives
    the reference tokens."""

    def probe(ctx):
        seen.append({"settings": neofix.configure(), "threads": torch.get_num_threads(), "patched": neofix.is_patched(),
                     "model": ctx.model, "adapter": ctx.adapter})
        return ctx.reference()

    return _scenarios.Scenario("probe", "probe", probe, _scenarios.Context.reference, None, None)


def scenarios(*keys):
    return tuple(s for s in _scenarios.SCENARIOS if s.key in keys)


@pytest.fixture
def process_threads():
    """The process runs on 2 threads (the suite's OMP_NUM_THREADS=1 would hide a doctor that sets none)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def test_run_checks_the_built_in_gpt_neo(monkeypatch, process_threads):
    """``run()``'s defaults: GPT-Neo's tiny model (seed 0: the same table every time), repair mode with
    check_values off whatever the process set, one thread for the tiny model (the process's threads put back), the
    numbered progress lines, no other family without ``others``, and the run's wall time to the hundredth."""
    seen = []
    monkeypatch.setattr(_scenarios, "SCENARIOS", (probe_scenario(seen), *scenarios("stale_mask")))
    clock = iter([100.0, 101.23456])
    monkeypatch.setattr(_doctor, "time", type("Clock", (), {"perf_counter": staticmethod(lambda: next(clock))}))
    neofix.configure(mode="strict", check_values=True)  # the process's settings: not the doctor's
    lines = []
    report = _doctor.run(progress=lines.append, others=False)
    assert torch.get_num_threads() == 2
    assert neofix.configure() == {"mode": "strict", "check_values": True, "uncached_positions": "mask"}
    assert (report.family, report.mode, report.others, report.seconds) == ("gpt_neo", "repair", (), 1.23)
    assert report.model == {
        "source": "built-in tiny random GPT-Neo (no download)",
        "family": "gpt_neo",
        "layers": 4,
        "attention_layers": ["global", "local", "global", "local"],
        "window_size": 4,
        "vocab_size": 96,
        "max_position_embeddings": 64,
        "dtype": "float32",
        "prompt_lengths": [6, 3, 5],
        "new_tokens": 8,
        "local_window_crossed": True,
    }
    assert report.rows[0] == Row("probe", "probe", CORRECT, CORRECT, "reference tokens", True)
    assert [row.key for row in report.rows] == ["probe", "stale_mask"] and report.exit_status == 0
    vanilla, fixed = seen
    assert (vanilla["patched"], fixed["patched"]) == (False, True)
    assert fixed["settings"] == {"mode": "repair", "check_values": False, "uncached_positions": "mask"}
    assert fixed["threads"] == 1
    built = tiny_model("gpt_neo", seed=0).state_dict()
    assert all(torch.equal(value, built[name]) for name, value in fixed["model"].state_dict().items())
    assert lines == [
        "loading torch and transformers",
        "building the tiny random GPT-Neo",
        "[ 1/2] probe",
        "[ 2/2] hand-written loop, stale mask",
    ]


def test_a_model_of_20_million_parameters_keeps_the_process_threads(monkeypatch, process_threads):
    """One thread only below ``_SMALL_MODEL`` parameters: a model of that size runs on the process's threads."""
    seen = []
    monkeypatch.setattr(_scenarios, "SCENARIOS", (probe_scenario(seen),))
    monkeypatch.setattr(_doctor, "_SMALL_MODEL", sum(p.numel() for p in tiny_model("gpt_neo").parameters()))
    assert _doctor.run(others=False).all_right
    assert [run["threads"] for run in seen] == [2, 2]


def test_run_checks_the_chosen_family(monkeypatch):
    """``family="gpt2"``: GPT-2's tiny model, with GPT-2's adapter, described as GPT-2 (no local layers)."""
    seen = []
    monkeypatch.setattr(_scenarios, "SCENARIOS", (probe_scenario(seen),))
    report = _doctor.run(family="gpt2", others=False)
    assert report.family == "gpt2" and report.all_right and report.others == ()
    assert report.model == {
        "source": "built-in tiny random GPT-2 (no download)",
        "family": "gpt2",
        "layers": 2,
        "attention_layers": [],
        "window_size": 0,
        "vocab_size": 96,
        "max_position_embeddings": 64,
        "dtype": "float32",
        "prompt_lengths": [6, 3, 5],
        "new_tokens": 8,
        "local_window_crossed": False,
    }
    assert type(seen[-1]["model"]) is transformers.GPT2LMHeadModel
    assert seen[-1]["adapter"] is FAMILIES["gpt2"].load_adapter()


@pytest.mark.parametrize(
    ("family", "described"),
    [("gpt2", "2 layers, vocab 96, 64 positions, float32"), ("bloom", "2 layers, vocab 96, no position table, float32")],
)
def test_the_table_describes_a_family_without_local_layers_as_it_is(monkeypatch, family, described):
    """No local window and no layer kinds where the family has none (they were GPT-Neo's "2 layers (?), local window
    0"), and no position table where it has none (BLOOM was said to have 2048 positions)."""
    monkeypatch.setattr(_scenarios, "SCENARIOS", (probe_scenario([]),))
    report = _doctor.run(family=family, others=False)
    lines = _report.as_table(report).splitlines()
    start = lines.index(f"Self-check on the built-in tiny random {FAMILIES[family].title} (no download):")
    assert lines[start + 1 : start + 3] == [f"  {described}", "  prompts of 6, 3, 5 tokens left-padded, 8 new tokens."]
    assert report.model["max_position_embeddings"] == (64 if family == "gpt2" else None)


def test_rotary_family_runs_the_scenarios_that_apply_to_it(monkeypatch):
    """GPT-NeoX (rotary positions): stale position_ids must raise PositionError (nothing tells which positions the
    cache was built with; where this release's GPT-NeoX takes no position_ids the scenario does not apply), a loop not
    incrementing them is repaired, the arange loop does not apply; the scenarios after them still run."""
    keys = ("stale_positions", "arange_positions", "frozen_positions", "chunked_prefill")
    monkeypatch.setattr(_scenarios, "SCENARIOS", scenarios(*keys))
    report = _doctor.run(family="gpt_neox", others=False)
    takes = "position_ids" in inspect.signature(type(tiny_model("gpt_neox")).forward).parameters  # not on 4.26
    stale = [("stale_positions", "clear error: PositionError", True)] if takes else []
    frozen = [("frozen_positions", "reference tokens", True)] if takes else []
    assert [(row.key, row.expected, row.right) for row in report.rows] == [
        *stale,
        *frozen,
        ("chunked_prefill", "reference tokens", True),
    ]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_the_modern_decoders_before_4_45_are_right_where_transformers_is_not(monkeypatch, family):
    """Before 4.45 (where tox.ini runs no full doctor table for them): a left-padded chunked prefill, which the sdpa
    mask helper of 4.36 - 4.38 unmasks wrongly (vanilla: wrong tokens; neofix builds the mask right), and beam search,
    whose full-recompute reference on 4.39 - 4.40 must leave out the stale cache_position generate passes without a
    cache (else the reference itself is wrong)."""
    if TF_RELEASE >= (4, 45) or not hasattr(transformers, _CONFIGS[family][0]) or not FAMILIES[family].patched_here():
        pytest.skip(f"transformers {transformers.__version__}: not a release before 4.45 that patches {family}")
    monkeypatch.setattr(_scenarios, "SCENARIOS", scenarios("chunked_prefill", "generate_beam"))
    report = _doctor.run(family=family, others=False)
    assert [(row.key, row.right) for row in report.rows] == [("chunked_prefill", True), ("generate_beam", True)]


def test_local_window_crossed_only_by_longer_sequences():
    """The longest sequence (6 + 8 tokens) crosses a local window of 13, not one of 14, which it fills exactly."""
    for window, crossed in ((13, True), (14, False)):
        context = _scenarios.Context(tiny_gpt_neo(window_size=window))
        assert _doctor._describe_context(context)["local_window_crossed"] is crossed


def test_invalid_input_without_a_reference_accepted_silently(monkeypatch):
    """Invalid input with nothing to compare with, taken without an error by both columns: "accepted, no error",
    and not right (neofix had to raise)."""
    taken = _scenarios.Scenario("taken", "taken silently", lambda ctx: ctx.ids, None, neofix.TokenIdError,
                                neofix.TokenIdError)
    monkeypatch.setattr(_scenarios, "SCENARIOS", (taken,))
    rows = _doctor._self_check(_scenarios.Context(tiny_gpt_neo()), True, False, lambda _: None)
    accepted = Cell("accepted", "accepted, no error")
    assert rows == [Row("taken", "taken silently", accepted, accepted, "clear error: TokenIdError", False)]


def test_unpatched_neofix_column_is_not_run():
    """Where the patch could not be installed the neofix column says "not patched" and is wrong."""
    rows = _doctor._self_check(_scenarios.Context(tiny_gpt_neo()), False, False, lambda _: None, ("stale_mask",))
    assert [(row.key, row.neofix, row.right) for row in rows] == [
        ("stale_mask", Cell("not_patched", "not patched"), False)
    ]


def test_the_scenarios_after_a_failing_reference_still_run(monkeypatch):
    def broken(context):
        raise RuntimeError("the reference broke")

    first, greedy = scenarios("stale_mask", "generate_greedy")
    monkeypatch.setattr(_scenarios, "SCENARIOS", (first._replace(reference=broken), greedy))
    report = _doctor.run(others=False)
    assert [(row.key, row.neofix.kind, row.right) for row in report.rows] == [
        ("stale_mask", "no_reference", False),
        ("generate_greedy", "correct", True),
    ]
    assert report.exit_status == 1


def test_quick_check_runs_the_quick_scenarios_only(monkeypatch):
    """Another family's quick self-check: the scenarios of ``QUICK`` only, judged as in the full table, announced
    by one progress line (no numbered line per scenario)."""
    monkeypatch.setattr(_scenarios, "SCENARIOS", scenarios("stale_mask", "arange_positions", "generate_greedy"))
    lines = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stale mask's repair (the doctor silences it too)
        rows = _doctor._quick_check(FAMILIES["gpt2"], True, False, lines.append)
    assert [(row.key, row.right) for row in rows] == [("stale_mask", True), ("generate_greedy", True)]
    assert lines == ["GPT-2: quick self-check"]


def spy_imports(monkeypatch, fail=()):
    """Record the modules the doctor imports (those in ``fail`` raise ImportError); returns (imported, imported
    by the time the model is built)."""
    imported, before_model = [], []

    def import_module(name):
        imported.append(name)
        if name in fail:
            raise ImportError(f"this transformers has no {name}\nsecond line")
        return importlib.import_module(name)

    monkeypatch.setattr(_doctor, "importlib", type("Importer", (), {"import_module": staticmethod(import_module)}))
    load = _doctor._load_model

    def load_model(*args):
        before_model.extend(imported)
        return load(*args)

    monkeypatch.setattr(_doctor, "_load_model", load_model)
    return imported, before_model


def test_every_family_is_loaded_before_the_check(monkeypatch, two_scenarios):
    """The default run imports every family's modeling module first (the import hooks patch them, so the patch
    targets show them patched), then gives each other family its quick check."""
    imported, before_model = spy_imports(monkeypatch)
    report = _doctor.run()
    assert before_model[0] == GPT_NEO_MODULE and set(before_model) == set(ALL_MODULES)
    assert [title for title, _ in report.others] == [f.title for f in FAMILIES.values() if f.name != "gpt_neo"]
    assert report.exit_status == 0
    # the JSON document lists each other family's quick check: its scenarios and verdicts, or why it was skipped
    listed = json.loads(_report.as_json(report))["other_families"]
    assert [entry["family"] for entry in listed] == [title for title, _ in report.others]
    for entry, (title, rows) in zip(listed, report.others):
        if isinstance(rows, str):
            assert entry == {"family": title, "skipped": rows}
        else:
            # (of the two scenarios, those that apply to the family on this release: Gemma2's own cache on 4.45 - 4.52
            # holds the prompt only, and no hand loop runs)
            assert entry["scenarios"] == len(rows) >= 1 and entry["right"] == len(rows), entry
            assert entry["wrong"] == [] and entry["vanilla_wrong"] == _report._vanilla_wrong(rows), entry
    assert any("scenarios" in entry for entry in listed)


def test_a_family_this_release_cannot_load_is_skipped(monkeypatch, two_scenarios):
    """A family's module that does not import: its quick check says why, the rest of the doctor runs."""
    opt = FAMILIES["opt"].module
    spy_imports(monkeypatch, fail=(opt,))
    report = _doctor.run()
    others = dict(report.others)
    assert others["OPT"] == f"not available on this transformers (this transformers has no {opt})"
    from neofix.testing import FAMILY_CONFIGS

    here = {family.title for name, family in FAMILIES.items() if hasattr(transformers, FAMILY_CONFIGS[name][0])}
    patched = {family.title for family in FAMILIES.values() if family.patched_here()}
    assert all(not isinstance(rows, str) for title, rows in others.items() if title != "OPT" and title in patched)
    assert all(rows.startswith("not available") for title, rows in others.items() if title not in here)
    assert all(rows.startswith("neofix patches") for title, rows in others.items() if title in here - patched)
    assert report.exit_status == 0


def test_a_checkpoint_is_loaded_offline_on_the_cpu_in_float32(tmp_path, monkeypatch, two_scenarios):
    """``--model``: config and weights read with local_files_only=True, a half-precision checkpoint checked in
    float32, and only the checkpoint's family imported and checked."""
    folder = tmp_path / "half"
    tiny_gpt_neo(seed=3, dtype=torch.float16).save_pretrained(folder)
    calls = []
    for auto in (transformers.AutoConfig, transformers.AutoModelForCausalLM):
        def spy(path, _real=auto.from_pretrained, _name=auto.__name__, **kwargs):
            calls.append((_name, path, kwargs))
            return _real(path, **kwargs)

        monkeypatch.setattr(auto, "from_pretrained", spy)
    imported, _ = spy_imports(monkeypatch)
    report = _doctor.run(model_path=str(folder))
    assert calls[0] == ("AutoConfig", str(folder), {"local_files_only": True})
    assert [call for call in calls if call[0] == "AutoModelForCausalLM"] == [
        ("AutoModelForCausalLM", str(folder), {"local_files_only": True})
    ]
    assert report.model["dtype"] == "float32" and report.model["family"] == "gpt_neo"
    assert report.model["source"] == f"checkpoint {folder}"
    assert imported == [GPT_NEO_MODULE] and report.others == ()
    assert report.exit_status == 0


def usage_error(path, family="gpt_neo"):
    with pytest.raises(_doctor.DoctorUsageError) as caught:
        _doctor.run(model_path=str(path), family=family)
    return str(caught.value)


def test_a_checkpoint_of_another_family_is_named(tmp_path):
    """A patched family's checkpoint: pass --family for it; its architectures, or that none are listed."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_head=2, n_embd=8).save_pretrained(tmp_path)
    assert usage_error(tmp_path) == (
        f"--model {tmp_path}: this is a 'gpt2' checkpoint (no architectures listed), not GPT-Neo: pass --family "
        f"gpt2 for it (the folder's config.json says \"model_type\": 'gpt2')"
    )


def test_a_checkpoint_of_a_family_neofix_does_not_patch(tmp_path):
    from transformers import BertConfig

    BertConfig(num_hidden_layers=1).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM", "BertModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    titles = ", ".join(family.title for family in FAMILIES.values())
    assert titles.startswith("GPT-Neo, GPT-2, GPT-J, CodeGen, GPT-NeoX, OPT, BLOOM, GPT-BigCode, Llama, Mistral")
    assert usage_error(tmp_path) == (
        f"--model {tmp_path}: this is a 'bert' checkpoint (BertForMaskedLM, BertModel), not GPT-Neo: neofix patches "
        f"{titles} (the folder's config.json says \"model_type\": 'bert')"
    )


@pytest.mark.parametrize(
    "overrides, table, vocab",
    [(dict(max_position_embeddings=15), 15, 96), (dict(vocab_size=1), 64, 1)],
)
def test_too_small_for_the_self_check(tmp_path, overrides, table, vocab):
    """The scenarios need 6 + 8 positions and 2 more (16), and 2 token ids."""
    tiny_gpt_neo(**overrides).config.save_pretrained(tmp_path)
    assert usage_error(tmp_path) == (
        f"--model {tmp_path}: this GPT-Neo is too small for the self-check (position table {table}, vocab_size "
        f"{vocab}; it needs at least 16 positions and 2 token ids)"
    )


@pytest.mark.parametrize("overrides", [dict(max_position_embeddings=16), dict(vocab_size=2)])
def test_just_large_enough_for_the_self_check(tmp_path, overrides):
    """16 positions and 2 token ids are enough: a folder with such a config gets as far as loading the weights."""
    tiny_gpt_neo(**overrides).config.save_pretrained(tmp_path)
    assert usage_error(tmp_path).startswith(f"--model {tmp_path}: cannot load the weights (")


def test_unreadable_config_and_weights_quote_the_error(tmp_path, monkeypatch):
    """The first line of transformers' error, in the usage error."""
    tiny_gpt_neo().config.save_pretrained(tmp_path)

    def fails(path, **kwargs):
        raise OSError("disk on fire\nsecond line")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fails)
    assert usage_error(tmp_path) == f"--model {tmp_path}: cannot load the weights (disk on fire)"
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", fails)
    assert usage_error(tmp_path) == f"--model {tmp_path}: cannot read its config.json (disk on fire)"


def test_unknown_family_lists_the_families():
    with pytest.raises(_doctor.DoctorUsageError) as caught:
        _doctor.run(family="gpt5")
    assert str(caught.value) == f"--family gpt5: no such family; choose from {', '.join(FAMILIES)}"


def test_imports_say_nothing_below_an_error_and_logging_is_restored():
    """What importing torch, transformers and the modeling modules logs (transformers 5.25 says, on every load of a
    modeling module in offline mode, that it skips a kernel's Hub check) is not the doctor's: nothing of warning
    level or below reaches its stderr, errors still do (unless logging was disabled for them before), and logging is
    as it was after."""
    from neofix._doctor import _quiet_imports

    logger = logging.getLogger("kernels._internals.hf_hub")
    heard: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    try:
        for before, expected in ((logging.NOTSET, ["a real error"]), (logging.CRITICAL, [])):
            logging.disable(before)
            heard.clear()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with _quiet_imports():
                    logger.warning("Skipping publisher trust check")
                    warnings.warn("an import-time deprecation notice", DeprecationWarning)
                    logger.error("a real error")
            assert logging.root.manager.disable == before and not caught
            assert heard == expected
            logger.warning("after")
            assert heard == expected + ([] if before else ["after"])
    finally:
        logging.disable(logging.NOTSET)
        logger.removeHandler(handler)
