"""neofix.trace and NEOFIX_TRACE: one entry per forward of the traced model, with the step's shapes."""

from __future__ import annotations

import dataclasses
import logging
import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch

import neofix
from neofix import _config, _trace
from neofix._reports import listeners as STEP_LISTENERS
from neofix.testing import tiny_gpt_neo

from .loops import decode, left_padded_batch


def generate(model, ids, mask, new=3):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)


def test_one_entry_per_forward(model):
    ids, mask = left_padded_batch([6, 3, 5])
    with neofix.trace(model) as steps:
        decode(model, ids, mask, 3)  # prefill + 2 decode forwards
    assert [(s.index, s.batch, s.new_tokens, s.cached_tokens) for s in steps] == [
        (0, 3, 6, 0),
        (1, 3, 1, 6),
        (2, 3, 1, 7),
    ]
    prefill, first, second = steps
    assert (prefill.mask_length_given, prefill.mask_length) == (6, 6)
    assert (prefill.position_min, prefill.position_max) == (0, 5)
    assert prefill.last_positions == (5, 2, 4)
    assert prefill.real_tokens == (6, 3, 5)
    assert (first.mask_length_given, first.mask_length, first.position_min, first.position_max) == (7, 7, 3, 6)
    assert (second.mask_length_given, second.mask_length) == (8, 8)  # the mask as given, already covering the cache
    assert first.last_positions == (6, 3, 5)
    assert second.real_tokens == (8, 5, 7)
    assert all(step.patched for step in steps)
    assert all(step.repairs == ("positions_derived",) for step in steps)  # the loop passes no position_ids


def test_str_is_one_readable_line(model):
    ids, mask = left_padded_batch([6, 3])
    with neofix.trace(model) as steps, warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        decode(model, ids, mask, 2, mask_mode="stale", positions="correct")
    assert str(steps[0]) == "step 0: batch 2, 6 new + 0 cached, mask 6, positions 0..5, repaired: nothing"
    assert str(steps[1]) == "step 1: batch 2, 1 new + 6 cached, mask 6 -> 7, positions 3..6, repaired: mask_extended"


def test_entries_are_frozen(model):
    with neofix.trace(model) as steps:
        decode(model, *left_padded_batch([3]), 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        steps[0].new_tokens = 2
    assert hash(steps[0]) == hash(dataclasses.replace(steps[0]))


def test_generate_is_traced(model):
    ids, mask = left_padded_batch([6, 3])
    with neofix.trace(model) as steps:
        generate(model, ids, mask, new=4)
    assert [s.new_tokens for s in steps] == [6, 1, 1, 1]
    assert [s.cached_tokens for s in steps] == [0, 6, 7, 8]
    assert [s.mask_length for s in steps] == [6, 7, 8, 9]
    assert [s.last_positions for s in steps] == [(5, 2), (6, 3), (7, 4), (8, 5)]


def test_unpatched_model_records_what_it_was_given(model, vanilla):
    ids, mask = left_padded_batch([6, 3])
    model = tiny_gpt_neo(seed=0) if _float64_broken() else model
    with neofix.trace(model) as steps:
        decode(model, ids, mask, 2)
    # no position_ids given: unpatched GPT-Neo counts from the cache length, ignoring the padding
    assert [(s.position_min, s.position_max, s.last_positions) for s in steps] == [(0, 5, (5, 5)), (6, 6, (6, 6))]
    assert [s.real_tokens for s in steps] == [(6, 3), (7, 4)]
    assert not any(s.patched or s.repairs for s in steps)
    assert str(steps[1]).endswith("repaired: nothing (neofix not patched)")


def test_an_unpatched_forward_given_no_tokens_fails_as_vanilla_and_records_nothing(model, vanilla):
    """Neither ``input_ids`` nor ``inputs_embeds``: nothing to record, and the trace's hook leaves transformers' own
    error to the caller."""
    with neofix.trace(model) as steps, pytest.raises(ValueError, match="input_ids (or|and) inputs_embeds"):
        model(attention_mask=torch.ones(1, 3, dtype=torch.long))
    assert steps == []


def _float64_broken():
    from ._versions import has

    return has("float64 mask bug")


def test_only_the_traced_model_is_recorded(model):
    other = tiny_gpt_neo(seed=1, dtype=torch.float64)
    ids, mask = left_padded_batch([4])
    with neofix.trace(other) as steps:
        decode(model, ids, mask, 2)
        decode(other, ids, mask, 3)
    assert len(steps) == 3


@pytest.mark.parametrize("pick", ["causal lm", "base model", "classifier", "wrapper"])
def test_resolves_the_gpt_neo_model_inside(model, pick):
    from transformers import GPTNeoForSequenceClassification

    ids, mask = left_padded_batch([4])
    if pick == "classifier":
        traced = runner = GPTNeoForSequenceClassification(model.config).to(torch.float64).eval()
    elif pick == "wrapper":
        traced = torch.nn.Sequential(torch.nn.Identity(), torch.nn.ModuleDict({"neo": model}))
        runner = model
    else:
        traced, runner = (model if pick == "causal lm" else model.transformer), model
    with neofix.trace(traced) as steps, torch.no_grad():
        runner(input_ids=ids, attention_mask=mask)
    assert len(steps) == 1 and steps[0].new_tokens == 4


def test_inputs_embeds(model):
    ids, mask = left_padded_batch([4, 2])
    with neofix.trace(model) as steps, torch.no_grad():
        model(inputs_embeds=model.get_input_embeddings()(ids), attention_mask=mask)
    assert (steps[0].batch, steps[0].new_tokens, steps[0].last_positions) == (2, 4, (3, 1))


def test_no_mask(model):
    ids, _ = left_padded_batch([4, 4])
    with neofix.trace(model) as steps, torch.no_grad():
        model(input_ids=ids)
    assert str(steps[0]) == "step 0: batch 2, 4 new + 0 cached, mask none, positions 0..3, repaired: nothing"
    assert steps[0].real_tokens == (4, 4)


@pytest.mark.parametrize(
    "what, error, message",
    [
        ("text", TypeError, "needs a model .* got str"),
        (torch.nn.Linear(2, 2), TypeError, r"Linear contains no transformers model neofix patches \(GPTNeoModel"),
        ("two", ValueError, r"contains 2 such models \(GPTNeoModel, \.\.\.\); pass the one to trace"),
    ],
)
def test_bad_model(model, what, error, message):
    if what == "two":
        what = torch.nn.ModuleList([model, tiny_gpt_neo(seed=1)])
    before = len(STEP_LISTENERS)
    with pytest.raises(error, match=message):
        with neofix.trace(what):
            pass
    assert len(STEP_LISTENERS) == before


def listeners_and_hooks(model):
    return len(STEP_LISTENERS), len(model.transformer._forward_pre_hooks)


def test_removed_on_exit_and_on_exceptions(model):
    before = listeners_and_hooks(model)
    with neofix.trace(model):
        assert listeners_and_hooks(model) == (before[0] + 1, before[1] + 1)
    assert listeners_and_hooks(model) == before
    with pytest.raises(neofix.BatchMismatchError):
        with neofix.trace(model) as steps:
            model(input_ids=torch.ones(2, 3, dtype=torch.long), attention_mask=torch.ones(3, 3, dtype=torch.long))
    assert steps == []
    assert listeners_and_hooks(model) == before


def test_nested(model):
    ids, mask = left_padded_batch([4])
    with neofix.trace(model) as outer:
        decode(model, ids, mask, 1)
        with neofix.trace(model) as inner:
            decode(model, ids, mask, 2)
        decode(model, ids, mask, 1)
    assert len(outer) == 4 and len(inner) == 2
    assert [s.index for s in outer] == [0, 1, 2, 3] and [s.index for s in inner] == [0, 1]


def test_concurrent_traces_of_different_models(model):
    models = [model, tiny_gpt_neo(seed=1, dtype=torch.float64)]
    results, errors = {}, []
    barrier = threading.Barrier(2, timeout=300)

    def run(which, steps):
        try:
            with neofix.trace(models[which]) as recorded:
                barrier.wait()
                decode(models[which], *left_padded_batch([4, 2]), steps)
                barrier.wait()
            results[which] = recorded
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(which, 2 + which)) for which in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert [len(results[0]), len(results[1])] == [2, 3]


def test_the_patch_being_removed_inside_a_trace(model):
    ids, mask = left_padded_batch([4])
    model = tiny_gpt_neo(seed=0) if _float64_broken() else model
    with neofix.trace(model) as steps:
        decode(model, ids, mask, 1)
        with neofix.unpatched():
            decode(model, ids, mask, 1)
    assert [s.patched for s in steps] == [True, False]


# -- NEOFIX_TRACE=1 --------------------------------------------------------------------------------------------------


@pytest.fixture
def logging_listener():
    yield _trace.log_steps
    while _trace._log_listener in STEP_LISTENERS:
        STEP_LISTENERS.remove(_trace._log_listener)


def test_log_steps_logs_one_line_per_step(model, logging_listener, caplog):
    logging_listener()
    logging_listener()  # idempotent: still one line per step
    with caplog.at_level(logging.INFO, logger="neofix"):
        decode(model, *left_padded_batch([5, 3]), 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "neofix"]
    assert lines == [
        "neofix: GPTNeoModel step 0: batch 2, 5 new + 0 cached, mask 5, positions 0..4, repaired: positions_derived",
        "neofix: GPTNeoModel step 1: batch 2, 1 new + 5 cached, mask 6, positions 3..5, repaired: positions_derived",
    ]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.name == "neofix")


def test_log_steps_without_logging_configured(model, logging_listener, monkeypatch, capsys):
    """Unconfigured logging would drop INFO lines: NEOFIX_TRACE=1 must never be silent, so they go to stderr."""
    logging_listener()
    monkeypatch.setattr(_trace._LOGGER, "hasHandlers", lambda: False)
    decode(model, *left_padded_batch([5]), 1)
    assert capsys.readouterr().err.splitlines() == [
        # an unpadded prompt: transformers' own positions are the mask's already, nothing to change
        "neofix: GPTNeoModel step 0: batch 1, 5 new + 0 cached, mask 5, positions 0..4, repaired: nothing"
    ]


def test_traced_generate_is_recorded_as_it_runs(model):
    """A traced run runs the path users run: generate's decode steps are recorded with the positions generate built,
    and nothing repaired."""
    ids, mask = left_padded_batch([6, 4])
    with neofix.trace(model) as steps, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert [(s.new_tokens, s.cached_tokens, s.mask_length) for s in steps] == [(6, 0, 6), (1, 6, 7), (1, 7, 8), (1, 8, 9)]
    assert [s.last_positions for s in steps[1:]] == [(6, 4), (7, 5), (8, 6)]
    assert all(s.repairs == () for s in steps)


def test_not_logging_without_the_environment_variable():
    assert os.environ.get("NEOFIX_TRACE", "0") in ("", "0")
    assert _trace._log_listener not in STEP_LISTENERS


SCRIPT = """
import logging, torch
logging.basicConfig(format="%(levelname)s:%(name)s:%(message)s")
import neofix
from neofix.testing import tiny_gpt_neo
model = tiny_gpt_neo()
with torch.no_grad():
    model.generate(torch.tensor([[0, 5, 6], [7, 8, 9]]), attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]),
                   max_new_tokens=2, do_sample=False, pad_token_id=0)
"""


def test_environment_variable():
    """NEOFIX_TRACE=1, end to end: set before the import, it logs every step through logging.getLogger("neofix")."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEOFIX_")}
    env["NEOFIX_TRACE"] = "1"
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if "neofix" in line] == [
        "INFO:neofix:neofix: GPTNeoModel step 0: batch 2, 3 new + 0 cached, mask 3, positions 0..2, repaired: nothing",
        "INFO:neofix:neofix: GPTNeoModel step 1: batch 2, 1 new + 3 cached, mask 4, positions 2..3, repaired: nothing",
    ]


@pytest.mark.parametrize("value, logs", [("1", True), ("on", True), ("0", False), ("off", False), ("", False)])
def test_environment_values(monkeypatch, value, logs):
    monkeypatch.setattr(_config.settings, "log_steps", False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _config.load_environment({"NEOFIX_TRACE": value})
    assert _config.settings.log_steps is logs


def test_environment_value_it_does_not_understand(monkeypatch):
    monkeypatch.setattr(_config.settings, "log_steps", False)
    with pytest.warns(neofix.NeofixWarning, match="NEOFIX_TRACE='banana' is not a boolean"):
        _config.load_environment({"NEOFIX_TRACE": "banana"})
    assert _config.settings.log_steps is False


# -- what a step records, field by field ----------------------------------------------------------------------------


def step_of(**fields):
    values = dict(
        index=3, batch=2, new_tokens=1, cached_tokens=5, mask_length_given=6, mask_length=6, position_min=4,
        position_max=5, last_positions=(5, 4), real_tokens=(6, 5), repairs=(), patched=True,
    )
    return _trace.Step(**{**values, **fields})


@pytest.mark.parametrize(
    "fields, line",
    [
        ({}, "step 3: batch 2, 1 new + 5 cached, mask 6, positions 4..5, repaired: nothing"),
        ({"cached_tokens": None}, "step 3: batch 2, 1 new + ? cached, mask 6, positions 4..5, repaired: nothing"),
        ({"mask_length": None, "mask_length_given": None}, "step 3: batch 2, 1 new + 5 cached, mask none, "),
        ({"mask_length_given": None}, "step 3: batch 2, 1 new + 5 cached, mask 6, positions"),
        ({"mask_length": 7}, "step 3: batch 2, 1 new + 5 cached, mask 6 -> 7, positions"),
        ({"position_min": 5}, "step 3: batch 2, 1 new + 5 cached, mask 6, positions 5, repaired"),
        ({"position_min": None, "position_max": None}, "cached, mask 6, positions ?, repaired"),
        ({"repairs": ("mask_extended", "positions_derived")}, "repaired: mask_extended, positions_derived"),
        ({"patched": False}, "positions 4..5, repaired: nothing (neofix not patched)"),
    ],
)
def test_str_of_every_kind_of_field(fields, line):
    text = str(step_of(**fields))
    assert line in text
    assert text.endswith(" (neofix not patched)") == (fields.get("patched") is False)


def test_unpatched_steps_record_the_mask_as_given_and_the_positions_as_passed(model, vanilla):
    """Unpatched, a step is read off the call itself: positional input_ids, the given mask's length, given
    positions (one row for the batch, broadcast), inputs_embeds."""
    ids, mask = left_padded_batch([5, 3])
    model = tiny_gpt_neo(seed=0) if _float64_broken() else model
    positions = torch.tensor([[2, 3, 4, 5, 6]])  # one row for both (what a caller may pass)
    with neofix.trace(model) as steps, torch.no_grad():
        model.transformer(ids, attention_mask=mask, position_ids=positions)
        model.transformer(inputs_embeds=model.transformer.wte(ids))  # no mask, no positions
    first, second = steps
    assert (first.index, first.batch, first.new_tokens, first.cached_tokens) == (0, 2, 5, 0)
    assert (first.mask_length_given, first.mask_length) == (5, 5)
    assert (first.position_min, first.position_max, first.last_positions) == (2, 6, (6, 6))
    assert first.real_tokens == (5, 3)
    assert (second.index, second.batch, second.new_tokens, second.mask_length_given) == (1, 2, 5, None)
    assert (second.position_min, second.position_max, second.real_tokens) == (0, 4, (5, 5))
    assert str(second) == (
        "step 1: batch 2, 5 new + 0 cached, mask none, positions 0..4, repaired: nothing (neofix not patched)"
    )


def test_a_step_of_unknown_cache_length_without_positions_or_mask():
    """Nothing to read (the cache's length unknown, no positions, no 2D mask): every per-row field is None, and no
    empty tensor is concatenated."""
    step = _trace._summarise(0, 2, 3, None, None, None, None, (), False, None)
    assert (step.position_min, step.position_max, step.last_positions, step.real_tokens) == (None, None, None, None)
    assert (step.mask_length, step.cached_tokens) == (None, None)


def test_a_step_of_unknown_cache_length_with_a_2d_mask():
    """The cache's length unknown and no positions given: the positions stay unknown, but a 2D mask still counts
    each row's real tokens (the mask's counts are the only numbers read off the device)."""
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [1, 1, 1, 1]])
    step = _trace._summarise(4, 3, 1, None, 4, mask, None, (), False, None)
    assert (step.position_min, step.position_max, step.last_positions) == (None, None, None)
    assert (step.mask_length_given, step.mask_length, step.real_tokens) == (4, 4, (2, 3, 4))
    assert str(step) == (
        "step 4: batch 3, 1 new + ? cached, mask 4, positions ?, repaired: nothing (neofix not patched)"
    )


def test_a_4d_mask_gives_its_key_length_and_no_real_token_counts():
    """A 4D mask is the model's own: its length is its last dimension, and it counts no real tokens per row."""
    mask = torch.zeros(2, 1, 3, 8)
    step = _trace._summarise(0, 2, 3, 5, None, mask, None, (), True, None)
    assert (step.mask_length, step.real_tokens) == (8, None)
    assert (step.position_min, step.position_max, step.last_positions) == (5, 7, (7, 7))


def test_positions_of_one_flat_row_are_read_for_every_row():
    step = _trace._summarise(0, 2, 3, 0, 3, torch.ones(2, 3, dtype=torch.long), torch.tensor([4, 5, 7]), (), True, None)
    assert (step.position_min, step.position_max, step.last_positions, step.real_tokens) == (4, 7, (7, 7), (3, 3))


def test_resolving_needs_only_the_loaded_modeling_modules(model, monkeypatch):
    """A family whose modeling module transformers has not loaded is skipped, not looked up."""
    from neofix._families import FAMILIES

    for family in FAMILIES.values():
        if family.name != "gpt_neo":
            monkeypatch.delitem(sys.modules, family.module, raising=False)
    with neofix.trace(model) as steps, torch.no_grad():
        model(input_ids=torch.tensor([[1, 2]]))
    assert len(steps) == 1


def test_bad_model_messages_name_everything():
    from neofix._families import FAMILIES
    from neofix.testing import tiny_model

    names = ", ".join(family.base_model for family in FAMILIES.values())
    with pytest.raises(TypeError) as caught:
        with neofix.trace(torch.nn.Linear(2, 2)):
            pass
    assert str(caught.value) == (
        f"neofix.trace: Linear contains no transformers model neofix patches ({names}); pass one (a causal LM "
        f"such as GPTNeoForCausalLM, its base model, or a module holding one)"
    )
    two = torch.nn.ModuleList([tiny_model("gpt2"), tiny_gpt_neo(seed=1)])
    with pytest.raises(ValueError) as caught:
        with neofix.trace(two):
            pass
    assert str(caught.value) == (
        "neofix.trace: ModuleList contains 2 such models (GPT2Model, ...); pass the one to trace"
    )


def test_log_steps_numbers_a_sequence_it_joins_halfway_from_zero(logging_listener, caplog):
    """A model first logged at a cached step (logging switched on after its prefill) starts at step 0."""
    model = tiny_gpt_neo(seed=0)  # never logged before (the counters are per model)
    ids, mask = left_padded_batch([4])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    from ._versions import cache_keyword, output_cache

    logging_listener()
    with caplog.at_level(logging.INFO, logger="neofix"), torch.no_grad():
        model(input_ids=ids[:, -1:], attention_mask=torch.ones(1, 5, dtype=torch.long),
              **{cache_keyword(): output_cache(out)})
    lines = [r.getMessage() for r in caplog.records if r.name == "neofix"]
    assert len(lines) == 1 and lines[0].startswith("neofix: GPTNeoModel step 0: batch 1, 1 new + 4 cached"), lines


def test_log_steps_sets_info_only_where_no_level_was_chosen(logging_listener, monkeypatch):
    monkeypatch.setattr(_trace._LOGGER, "level", logging.NOTSET)
    logging_listener()
    assert _trace._LOGGER.level == logging.INFO
    monkeypatch.setattr(_trace._LOGGER, "level", logging.WARNING)
    logging_listener()
    assert _trace._LOGGER.level == logging.WARNING  # the user's choice stays


def test_generate_decode_steps_record_the_mask_they_were_given(model):
    """generate's decode steps (already aligned: the forward's fast path) record the mask's length as given."""
    ids, mask = left_padded_batch([5, 3])
    with neofix.trace(model) as steps:
        generate(model, ids, mask, new=3)
    assert [(s.new_tokens, s.mask_length_given, s.mask_length) for s in steps] == [(5, 5, 5), (1, 6, 6), (1, 7, 7)]
