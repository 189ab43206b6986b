"""The pytest plugin and the CI helpers: they pass on correct decoding and fail, clearly, on broken decoding."""

from __future__ import annotations

import re
import subprocess
import sys
import types
import warnings

import pytest
import torch

import neofix
from neofix.testing import (
    assert_generation_consistent,
    assert_steps_aligned,
    reference_greedy,
    reference_positions,
    tiny_gpt_neo,
)

from ._versions import has
from .loops import decode, left_padded_batch

pytest_plugins = ("pytester",)


def broken_positions(model, monkeypatch, how):
    """Break the model's cached decoding through its own prepare_inputs_for_generation (per instance).

    "dropped": no position_ids on any step (unpatched GPT-Neo then counts from the cache length, ignoring padding;
    neofix derives them from the mask).  "shifted": decode steps get positions one too far (neofix compares them with
    the mask's on the device and repairs them).  "masked": decode steps mask out the newest token itself (a mask is
    the caller's to choose: nothing can tell that this one is wrong, but the reference can).
    """
    original = model.prepare_inputs_for_generation

    def prepare(self, *args, **kwargs):
        inputs = original(*args, **kwargs)
        if how == "dropped":
            inputs["position_ids"] = None
            return inputs
        new, mask = inputs["input_ids"].shape[1], inputs["attention_mask"]
        if mask.shape[1] > new:  # a decode step: the cache holds tokens
            if how == "shifted":
                inputs["position_ids"] = reference_positions(mask)[:, -new:] + 1
            else:
                inputs["attention_mask"] = torch.cat([mask[:, :-1], torch.zeros_like(mask[:, -1:])], -1)
        return inputs

    # bound, as transformers up to 4.3x looks at prepare_inputs_for_generation.__func__
    monkeypatch.setattr(model, "prepare_inputs_for_generation", types.MethodType(prepare, model))
    return model


def vanilla_model(model):
    return tiny_gpt_neo(seed=0) if has("float64 mask bug") else model


def first_difference(model, ids, mask, new=16):
    """(step, row) where vanilla generate first differs from the reference, found independently of the helper."""
    with torch.no_grad():
        got = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    expected = reference_greedy(model, ids, mask, new, eos_token_id=0, pad_token_id=0)
    width = min(got.shape[1], expected.shape[1])
    differs = (got[:, ids.shape[1] : width] != expected[:, ids.shape[1] : width]).nonzero()
    step = int(differs[:, 1].min())
    row = int(differs[differs[:, 1] == step][:, 0].min())
    return step, row


# -- assert_generation_consistent ------------------------------------------------------------------------------------


def test_passes_on_a_correct_model(model):
    assert_generation_consistent(model, *left_padded_batch([6, 3, 5]))


def test_passes_unpatched(model, vanilla):
    assert_generation_consistent(vanilla_model(model), *left_padded_batch([6, 3, 5]), max_new_tokens=8)


def test_fails_on_dropped_positions_unpatched(model, vanilla, monkeypatch):
    model = broken_positions(tiny_gpt_neo(seed=0, dtype=torch.float32), monkeypatch, "dropped")
    ids, mask = left_padded_batch([6, 3, 5])
    step, row = first_difference(model, ids, mask)
    assert row != 0  # the unpadded row is right: only padded rows go wrong
    with pytest.raises(AssertionError) as raised:
        assert_generation_consistent(model, ids, mask)
    message = str(raised.value)
    assert f"first at step {step} (new token {step}, sequence column {6 + step}), row {row}: generate produced" in message
    assert re.search(r"the reference prefers \d+ over \d+ by [\d.e+-]+ logits", message)
    assert f"the forward that produced it: step {step}: batch 3" in message
    assert "(neofix not patched)" in message
    assert "trace (" in message


def test_neofix_repairs_the_dropped_positions(model, monkeypatch):
    """The same broken model passes once neofix is patched: it derives the positions from the mask."""
    assert_generation_consistent(broken_positions(model, monkeypatch, "dropped"), *left_padded_batch([6, 3, 5]))


def test_fails_on_shifted_positions_unpatched(model, vanilla, monkeypatch):
    model = broken_positions(vanilla_model(model), monkeypatch, "shifted")
    ids, mask = left_padded_batch([6, 3, 5])
    with pytest.raises(AssertionError, match=r"first at step (\d+) .*\n.*\nthe forward that produced it: step \1:"):
        assert_generation_consistent(model, ids, mask)


def test_neofix_repairs_the_shifted_positions(model, monkeypatch):
    """Positions of the right shape but the wrong value: neofix compares them with the mask's and repairs them."""
    model = broken_positions(model, monkeypatch, "shifted")
    with pytest.warns(neofix.NeofixWarning, match=r"but the attention mask puts that real token of row \d at position"):
        assert_generation_consistent(model, *left_padded_batch([6, 3, 5]))


@pytest.mark.parametrize("patched", [True, False])
def test_fails_on_a_masked_newest_token(model, monkeypatch, patched):
    """A fault no patch can see (the mask is the caller's to choose): the reference catches it, patched or not."""
    with neofix.patched() if patched else neofix.unpatched():
        model = broken_positions(model if patched else vanilla_model(model), monkeypatch, "masked")
        ids, mask = left_padded_batch([6, 3, 5])
        with pytest.raises(AssertionError, match=r"first at step (\d+) .*\n.*\nthe forward that produced it: step \1:"):
            assert_generation_consistent(model, ids, mask)


def test_fails_on_a_corrupted_cache(model, monkeypatch):
    """A model whose cache is damaged before every decode step (patched: neofix cannot know values)."""
    from ._versions import cache_keyword, legacy

    keyword = cache_keyword()
    original = model.prepare_inputs_for_generation

    def prepare(self, *args, **kwargs):
        inputs = original(*args, **kwargs)
        cache = inputs.get(keyword)
        if cache is not None and inputs["input_ids"].shape[1] == 1:
            legacy(cache)[1][1][:, :, -1].mul_(0.5)  # layer 1's values of the newest cached token, in place
        return inputs

    monkeypatch.setattr(model, "prepare_inputs_for_generation", types.MethodType(prepare, model))
    with pytest.raises(AssertionError, match="cached generation differs from the full-recompute reference"):
        assert_generation_consistent(model, *left_padded_batch([6, 3, 5]))


def test_rows_ending_at_eos(model):
    """Rows that produce the end-of-sequence token end as generate ends them: padded, and generation stops early."""
    ids, mask = left_padded_batch([6, 3, 5])
    plain = reference_greedy(model, ids, mask, 8)
    eos = int(plain[1, 6 + 2])  # row 1's third new token
    ended = reference_greedy(model, ids, mask, 8, eos_token_id=eos, pad_token_id=95)
    assert (ended[1, 6 + 3 :] == 95).all()
    assert_generation_consistent(model, ids, mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=95)


def test_reference_stops_when_every_row_has_ended(model):
    ids, mask = left_padded_batch([4])
    eos = int(reference_greedy(model, ids, mask, 3)[0, -1])
    assert reference_greedy(model, ids, mask, 8, eos_token_id=[eos, 1000]).shape[1] <= 4 + 3


def test_fails_when_generate_stops_early(model, monkeypatch):
    original = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **k: original(*a, **k)[:, :-2])
    with pytest.raises(AssertionError, match="produced 6 new tokens, the full-recompute reference 8"):
        assert_generation_consistent(model, *left_padded_batch([6, 3]), max_new_tokens=8)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(do_sample=True), "do_sample=True is not greedy"),
        (dict(num_beams=2), "num_beams=2 is not greedy"),
        (dict(num_return_sequences=2), "num_return_sequences=2 is not greedy"),
        (dict(max_new_tokens=0), "max_new_tokens must be a positive int, got 0"),
        (dict(input_ids=torch.tensor([1, 2, 3])), r"input_ids must be a \(batch, length\) tensor, got \(3,\)"),
        (dict(input_ids=[[1, 2]]), "got list"),
    ],
)
def test_bad_arguments(model, kwargs, message):
    arguments = dict(input_ids=torch.tensor([[1, 2, 3]]))
    arguments.update(kwargs)
    with pytest.raises(ValueError, match=message):
        assert_generation_consistent(model, **arguments)


def test_training_mode_is_refused():
    model = tiny_gpt_neo().train()
    with pytest.raises(ValueError, match=r"training mode .* model.eval\(\)"):
        assert_generation_consistent(model, torch.tensor([[1, 2, 3]]))


# -- assert_steps_aligned --------------------------------------------------------------------------------------------


def test_steps_aligned_for_generate(model):
    ids, mask = left_padded_batch([6, 3])
    with neofix.trace(model) as steps, torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert len(steps) == 4
    assert_steps_aligned(steps)


def test_steps_aligned_for_a_decode_state_loop_with_finished_rows(model):
    ids, mask = left_padded_batch([6, 3])
    state = neofix.DecodeState(ids, mask)
    with neofix.trace(model) as steps, torch.no_grad():
        out = model(**state.model_inputs())
        for step in range(4):
            state.advance(out.logits[:, -1].argmax(-1), out, finished=torch.tensor([False, step >= 1]))
            out = model(**state.model_inputs())
    assert all(s.repairs == () for s in steps)  # nothing for neofix to repair
    assert steps[-1].real_tokens == (6 + 4, 3 + 1)
    assert_steps_aligned(steps)


def test_steps_aligned_fails_on_a_stale_mask(model):
    with neofix.trace(model) as steps, warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        decode(model, *left_padded_batch([6, 3]), 3, mask_mode="stale")
    with pytest.raises(AssertionError) as raised:
        assert_steps_aligned(steps)
    lines = str(raised.value).splitlines()
    assert lines[:3] == [
        "decoding steps are not aligned:",
        "step 1: the attention mask passed has 6 columns, but the cache holds 6 tokens and the step feeds 1: "
        "expected 7 (neofix extended it)",
        "step 2: the attention mask passed has 6 columns, but the cache holds 7 tokens and the step feeds 1: "
        "expected 8 (neofix extended it)",
    ]
    assert lines[3] == "trace (3 forwards):"


def test_steps_aligned_fails_on_padding_blind_positions(model, vanilla):
    model = vanilla_model(model)
    with neofix.trace(model) as steps:
        decode(model, *left_padded_batch([6, 3]), 2)
    with pytest.raises(AssertionError) as raised:
        assert_steps_aligned(steps)
    assert str(raised.value).splitlines()[1:3] == [
        "step 0, row 1: the last new token is at position 5, but the mask holds 3 real tokens: expected 2 "
        "(positions must advance by one per real token)",
        "step 1, row 1: the last new token is at position 6, but the mask holds 4 real tokens: expected 3 "
        "(positions must advance by one per real token)",
    ]


def test_steps_aligned_fails_on_several_tokens_after_the_prefill(model):
    with neofix.trace(model) as steps:
        decode(model, *left_padded_batch([7, 3], width=7), 1, chunks=(4,))  # the prompt in two pieces
    with pytest.raises(AssertionError, match="step 1 feeds 3 new tokens per row after the prefill; expected 1"):
        assert_steps_aligned(steps)


def test_steps_aligned_fails_on_an_empty_trace():
    with pytest.raises(AssertionError, match="the trace is empty"):
        assert_steps_aligned([])


# -- the plugin ------------------------------------------------------------------------------------------------------


def test_fixture_is_a_factory(gpt_neo_tiny):
    model = gpt_neo_tiny(seed=3, dtype=torch.float64, num_layers=3)
    assert not model.training
    assert model.dtype == torch.float64
    assert model.config.num_layers == 3
    assert model.config.attention_layers == ["global", "local", "global"]
    again = gpt_neo_tiny(seed=3, dtype=torch.float64, num_layers=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_registered_as_a_pytest11_entry_point():
    from importlib.metadata import entry_points

    found = [e for e in entry_points(group="pytest11") if e.name == "neofix"]
    assert [e.value for e in found] == ["pytest_neofix"]


def test_loading_the_plugin_imports_nothing_heavy():
    """A session that never asks for neofix runs GPT-Neo unpatched: the plugin imports neither neofix nor torch."""
    code = (
        "import sys, pytest_neofix; "
        "print(sorted({'neofix', 'torch', 'transformers'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


DOWNSTREAM = '''
import types

import pytest
import torch

import neofix
from neofix.testing import assert_generation_consistent, assert_steps_aligned

IDS = torch.tensor([[0, 0, 11, 12, 13], [21, 22, 23, 24, 25]])
MASK = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])


def test_generation_is_consistent(gpt_neo_tiny):
    assert_generation_consistent(gpt_neo_tiny(dtype=torch.float64), IDS, MASK, max_new_tokens=6)


def test_steps_are_aligned(gpt_neo_tiny):
    model = gpt_neo_tiny(seed=1)
    with neofix.trace(model) as steps, torch.no_grad():
        model.generate(IDS, attention_mask=MASK, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert_steps_aligned(steps)


def test_my_broken_model(gpt_neo_tiny, monkeypatch):
    model = gpt_neo_tiny(dtype=torch.float64)
    original = model.prepare_inputs_for_generation

    def prepare(self, *args, **kwargs):
        inputs = original(*args, **kwargs)
        if inputs["input_ids"].shape[1] == 1:  # decode steps: the newest token masked out
            mask = inputs["attention_mask"]
            inputs["attention_mask"] = torch.cat([mask[:, :-1], torch.zeros_like(mask[:, -1:])], -1)
        return inputs

    monkeypatch.setattr(model, "prepare_inputs_for_generation", types.MethodType(prepare, model))
    assert_generation_consistent(model, IDS, MASK, max_new_tokens=6)
'''


UNTOUCHED = """
import sys

from transformers import GPTNeoConfig, GPTNeoForCausalLM


def test_gpt_neo_is_vanilla_when_nothing_asks_for_neofix(request):
    assert request.config.pluginmanager.has_plugin("neofix")
    # small: the default width builds 200M parameters (4 s of CPU) and proves nothing more
    GPTNeoForCausalLM(GPTNeoConfig(num_layers=2, num_heads=2, hidden_size=16,
                                   attention_types=[[["global", "local"], 1]]))
    assert "neofix" not in sys.modules
"""


@pytest.fixture
def downstream(pytester, monkeypatch):
    """A fresh project that only has neofix installed: no conftest, no neofix test code."""
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    pytester.makepyfile(
        test_downstream=DOWNSTREAM,
        test_plain="def test_needs_the_fixture(gpt_neo_tiny):\n    pass\n",
        test_untouched=UNTOUCHED,
    )
    return pytester


def test_downstream_project_uses_the_fixture_and_helpers(downstream):
    result = downstream.runpytest_subprocess("-p", "no:cacheprovider", "test_downstream.py")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*test_my_broken_model*",
            "*AssertionError: cached generation differs from the full-recompute reference: first at step 1*row 0*",
            "*the forward that produced it: step 1: batch 2, 1 new + 5 cached, mask 6, positions 3..5*",
        ]
    )


def test_downstream_can_disable_the_plugin(downstream):
    result = downstream.runpytest_subprocess("-p", "no:neofix", "-p", "no:cacheprovider", "test_plain.py")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'gpt_neo_tiny' not found*"])


def test_plugin_loads_without_patching_gpt_neo(downstream):
    result = downstream.runpytest_subprocess("-p", "no:cacheprovider", "test_untouched.py")
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("family", sorted(__import__("neofix.testing", fromlist=["x"]).FAMILY_CONFIGS))
def test_tiny_model_fixture_for_every_family(tiny_model, family):
    """The family-neutral fixture: a tiny model of each family, guarded by the same assertion."""
    import transformers

    from neofix._families import FAMILIES
    from neofix.testing import FAMILY_CONFIGS

    if not hasattr(transformers, FAMILY_CONFIGS[family][0]):
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILY_CONFIGS[family][0]}")
    if not FAMILIES[family].patched_here():
        pytest.skip(f"transformers {transformers.__version__}: {FAMILIES[family].targets[0].why}")
    from neofix import _compat

    if family in ("gemma2", "gemma3") and _compat.release() < (4, 53):
        pytest.skip(f"transformers {transformers.__version__}: {family}'s HybridCache decodes no left-padded batch "
                    f"(neofix refuses it; tests/_modern_family.py)")
    model = tiny_model(family, dtype=torch.float64)
    assert type(model).__name__ == FAMILY_CONFIGS[family][1]
    assert_generation_consistent(model, *left_padded_batch([6, 3]), max_new_tokens=4)
    with neofix.trace(model) as steps, torch.no_grad():
        model.generate(*left_padded_batch([6, 3])[:1], max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert_steps_aligned(steps)
