"""The overhead budget (issue 7): no host-device synchronisation added to decode steps, nothing heavy at import.

Speed itself is measured by ``benchmarks/bench_decode.py``, never asserted here: a shared CI machine is too noisy
for timed assertions on a decode step.  What is asserted is what must hold on any machine:

* during single-token decode steps neofix reads no tensor value on the host (``.item()``, ``bool()``, ``int()``,
  ``.tolist()``, ``nonzero()``, ``.cpu()``...): each one is a host-device synchronisation on an accelerator.  The
  counter of ``tests/_sync.py`` sees every such read and the Python frame that asked for it, on a simulated
  accelerator (position reports take the non-blocking path; reading their landed host copies is not counted).  The
  same loops run vanilla must make exactly as many reads in all, so neofix does not cause any indirectly either;
* the counter is proven to catch each kind of conversion: the tests put one into neofix's hot path (as code
  compiled under a neofix file name) and check that it is counted, and ``check_values=True`` (documented to cost
  one synchronisation per step) is counted too;
* ``import neofix`` imports neither torch nor transformers, and nothing beyond its own modules and what the
  standard library's ``threading`` needs (the import time, under 20 ms, is measured by
  ``benchmarks/bench_import.py``).
"""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
import warnings

import pytest
import torch

import neofix
from neofix import _wrappers

from ._sync import DecodeReads, simulated_accelerator
from .loops import decode, left_padded_batch

STEPS = 6  # tokens per run: a prefill forward, then STEPS - 1 single-token decode steps
DECODE_STEPS = STEPS - 1

def count_conversions(model, run):
    """The host reads of ``run()``'s decode steps, on a simulated accelerator (see tests/_sync.py)."""
    counter = DecodeReads(model)
    with warnings.catch_warnings(), simulated_accelerator():
        warnings.simplefilter("ignore")  # repairs warn once; transformers may warn too
        with counter:
            run()
    assert counter.forwards == STEPS, f"expected {STEPS} forwards, saw {counter.forwards}"
    return counter


def run_generate(model):
    ids, mask = left_padded_batch([6, 3, 5])
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=STEPS,
            min_new_tokens=STEPS,
            do_sample=False,
            pad_token_id=model.config.pad_token_id,
        )


def loop(mask_mode="synced", positions="none"):
    ids, mask = left_padded_batch([6, 3, 5])
    return lambda model: decode(model, ids, mask, STEPS, mask_mode=mask_mode, positions=positions)


# Each returns a callable taking the model.  "stale" needs neofix's repair (vanilla fails or decodes wrongly).
RUNS = {
    "generate": run_generate,
    "loop": loop(),
    "loop, positions given": loop(positions="correct"),
    "loop, full-length positions": loop(positions="full"),
    "loop, mask not extended (repaired)": loop(mask_mode="stale"),
    "loop, positions not incremented (repaired on the device)": loop(positions="frozen"),
    "loop, arange positions on left padding (repaired)": loop(positions="arange"),
}
MATCH_VANILLA = ("generate", "loop", "loop, positions given")  # vanilla rejects the others


@pytest.mark.parametrize("name", list(RUNS))
def test_decode_steps_make_no_conversion_in_neofix(model, name):
    counter = count_conversions(model, lambda: RUNS[name](model))
    assert counter.by_neofix == [], f"neofix read tensor values on the host in decode steps: {counter.by_neofix}"


@pytest.fixture(scope="module")
def model32():
    """Vanilla must run too: transformers 4.36 - 4.44 cannot run GPT-Neo in float64 (neofix can)."""
    from neofix.testing import tiny_gpt_neo

    return tiny_gpt_neo(seed=0, dtype=torch.float32)


@pytest.mark.parametrize("name", MATCH_VANILLA)
def test_decode_steps_convert_as_often_as_vanilla(model32, name):
    """neofix causes no conversion indirectly either (through a transformers helper it calls, say)."""
    model = model32
    patched = count_conversions(model, lambda: RUNS[name](model)).reads
    with neofix.unpatched():
        vanilla = count_conversions(model, lambda: RUNS[name](model)).reads
    assert sorted(name for name, _ in patched) == sorted(name for name, _ in vanilla)


def test_position_reports_read_only_landed_host_copies(model):
    """The decode-step position repair is reported from a non-blocking copy, read once it has landed: the warning
    comes at the next forward, and reading it is not a read of device memory (it is not counted).  Without the
    simulated accelerator (CPU tensors: nothing to wait for) the flag is read at once, and the counter sees that."""
    run = RUNS["loop, positions not incremented (repaired on the device)"]
    counter = DecodeReads(model)
    with simulated_accelerator(), warnings.catch_warnings(record=True) as caught, counter:
        warnings.simplefilter("always")
        run(model)
    said = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    assert len(said) == 1 and "position_ids[0, 0] is 5 at the step after 6 cached tokens" in said[0], said
    assert counter.by_neofix == []
    from neofix import _errors

    _errors.reset_warnings()
    cpu = DecodeReads(model)
    with warnings.catch_warnings(), cpu:
        warnings.simplefilter("ignore")
        RUNS["loop, positions not incremented (repaired on the device)"](model)
    assert [name for name, _ in cpu.by_neofix][:1] == ["__bool__"]  # the CPU path reads at once: seen


def test_check_values_is_counted(model):
    """``check_values=True`` costs one synchronisation per step, as documented: the counter sees it."""
    neofix.configure(check_values=True)
    counter = count_conversions(model, lambda: RUNS["loop"](model))
    assert len(counter.by_neofix) >= DECODE_STEPS, counter.reads


# A conversion slipped into neofix's hot path: compiled under a neofix file name, as if it were written there.
INJECTED = {
    "item": "input_ids[0, 0].item()",
    "bool": "bool((input_ids < 0).any())",
    "if": "1 if (input_ids >= 0).all() else 0",
    "int": "int(input_ids[0, 0])",
    "float": "float(input_ids[0, 0])",
    "tolist": "input_ids.tolist()",
    "__index__": "operator.index(input_ids[0, 0])",
    "list index": "list(range(200))[input_ids[0, 0]]",
    "nonzero": "(input_ids < 0).nonzero()",
    "cpu": "input_ids.cpu()",
}


@pytest.mark.parametrize("kind", list(INJECTED))
def test_counter_catches_a_conversion_added_to_neofix(model, monkeypatch, kind):
    source = (
        "def align(step, *args, **kwargs):\n"
        "    input_ids = step.input_ids\n"
        "    if input_ids is not None:\n"
        f"        {INJECTED[kind]}\n"
        "    return original(step, *args, **kwargs)\n"
    )
    namespace = {"original": _wrappers.align, "operator": operator}
    exec(compile(source, _wrappers.__file__, "exec"), namespace)
    monkeypatch.setattr(_wrappers, "align", namespace["align"])
    counter = count_conversions(model, lambda: RUNS["loop"](model))
    assert len(counter.by_neofix) >= DECODE_STEPS, counter.reads
    assert all(where.startswith(_wrappers.__file__) for _, where in counter.by_neofix)


def test_counter_ignores_conversions_outside_neofix(model):
    """A conversion the user's own code makes is not neofix's (the attribution is by frame, not by time)."""

    def user_loop():
        RUNS["loop"](model)
        for _ in range(STEPS):
            torch.ones(1).item()

    counter = count_conversions(model, user_loop)
    assert len(counter.reads) >= DECODE_STEPS
    assert counter.by_neofix == []


# --- import cost ---------------------------------------------------------------------------------------------------


def _python(*args, env=None):
    environ = dict(os.environ)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)  # users' imports read cached bytecode; let the first run write it
    environ.pop("NEOFIX_DISABLE", None)
    environ.update(env or {})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environ, timeout=120)


def test_import_neofix_imports_neither_torch_nor_transformers():
    code = (
        "import json, sys; import neofix; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))))"
    )
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def _new_modules(statement: str) -> set[str]:
    """The modules a fresh interpreter imports for ``statement`` (beyond its own start-up)."""
    code = (
        "import sys; before = set(sys.modules); "
        + statement
        + "; import json; print(json.dumps(sorted(set(sys.modules) - before)))"
    )
    result = _python("-c", code)
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.strip().splitlines()[-1]))


# __future__: what ``from __future__ import annotations`` loads (a few definitions; site may have loaded it already)
STDLIB_AT_IMPORT = "import __future__, threading, importlib, warnings, os"


def test_import_neofix_imports_only_its_own_modules_and_threading():
    """The import-time budget, asserted without a clock: ``import neofix`` loads its own small modules and the
    standard library's ``threading`` (with what it imports), nothing else: no torch, transformers, wrapt,
    packaging, logging, importlib.metadata, not even ``typing`` (which alone costs more than all of neofix).  The
    time itself (budget 20 ms; about 6 ms) is measured by ``benchmarks/bench_import.py``: a timed assertion would
    fail on a loaded CI machine."""
    allowed = _new_modules(STDLIB_AT_IMPORT)
    imported = _new_modules("import neofix")
    own = {name for name in imported if name == "neofix" or name.startswith("neofix.")}
    assert own == {
        "neofix", "neofix._config", "neofix._errors", "neofix._families", "neofix._lifecycle", "neofix._version"
    }
    assert sorted(imported - own - allowed) == []


def test_the_import_check_sees_a_heavy_import():
    """The check above is not vacuous: a module that imports more than threading is caught."""
    allowed = _new_modules(STDLIB_AT_IMPORT)
    assert {"typing", "wrapt"} <= _new_modules("import typing, wrapt") - allowed


def wrong_position_loop(model, wrong_at, steps=4, masked=True):
    """A hand-written loop over a left-padded batch passing the mask's positions, except at decode step ``wrong_at``
    where row 0's position is not incremented (repaired on the device).  Returns the NeofixWarnings of each decode
    step's forward.  ``masked=False``: an unpadded batch, and no mask passed at any step."""
    from neofix.testing import reference_positions

    from ._versions import cache_keyword, output_cache

    ids, mask = left_padded_batch([6, 3, 5] if masked else [6, 6, 6])
    positions = reference_positions(mask)
    said = []
    with torch.no_grad():
        out = model(
            input_ids=ids, attention_mask=mask if masked else None, position_ids=positions, use_cache=True
        )
        for step in range(steps):
            token = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(token)], -1)
            positions = torch.cat([positions, positions[:, -1:] + 1], -1)
            given = positions[:, -1:].clone()
            if step == wrong_at:
                given[0] -= 1
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                out = model(
                    input_ids=token, attention_mask=mask if masked else None, position_ids=given, use_cache=True,
                    **{cache_keyword(): output_cache(out)},
                )
            said.append([str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)])
    return said


def test_a_device_side_repair_without_a_mask_is_said_in_the_cpu_words(model):
    """A loop that passes no mask: the delayed report names the positions after the cache, as the CPU path does."""
    from neofix import _errors

    _errors.reset_warnings()
    at_once = wrong_position_loop(model, wrong_at=1, masked=False)
    assert [len(step) for step in at_once] == [0, 1, 0, 0]
    assert at_once[1][0].startswith(
        "neofix: position_ids[0, 0] is 6 at the step after 7 cached tokens, but with no attention mask every token "
        "is real, so that token is at position 7 (arange over a left-padded batch, or a loop that does not increment "
        "its positions?); used positions continuing after the cache."
    ), at_once
    _errors.reset_warnings()
    with simulated_accelerator():
        later = wrong_position_loop(model, wrong_at=1, masked=False)
    assert later == [[], [], [], at_once[1]]


def test_a_device_side_repair_is_said_once_its_copy_lands(model):
    """On an accelerator a decode step's position repair is copied off the device without blocking and said at a
    later forward, once the copy has landed (the simulated event lands from the first poll after the step: the
    warning comes at the second forward after the wrong step, never at the first), in the words the CPU path uses at
    once.  Once said, no later step reads or copies anything for it."""
    from neofix import _errors, _reports

    _errors.reset_warnings()
    at_once = wrong_position_loop(model, wrong_at=1)
    assert [len(step) for step in at_once] == [0, 1, 0, 0]
    assert "position_ids[0, 0] is 6 at the step after 7 cached tokens" in at_once[1][0], at_once
    reads = DecodeReads(model)
    with reads:  # said already: the next wrong step reads nothing on the CPU either
        again = wrong_position_loop(model, wrong_at=0)
    assert again == [[], [], [], []] and reads.by_neofix == []

    _errors.reset_warnings()
    with simulated_accelerator():
        later = wrong_position_loop(model, wrong_at=1)
        assert [len(step) for step in later] == [0, 0, 0, 1]
        assert later[3] == at_once[1]
        wrong_position_loop(model, wrong_at=0)
        assert _reports.pending == []  # said already: nothing was copied for the new wrong step
