"""A left-padded batch wider than the position table, whose rows' real tokens fit.

Where the attention keeps no causal buffer of the table's width (``Limits.wider_than_table``: GPT-2 with sdpa from
4.42 and with eager from 5.2, GPT-J and CodeGen from 4.45, GPT-BigCode from 4.54), vanilla transformers computes
such a batch right, as each row alone: positions count real tokens only, and only positions are looked up in the
table.  neofix must not refuse it (it did, on the columns), and must still refuse, before any compute, a step whose
positions do not fit.
Where the attention slices a buffer of the table's width (GPT-Neo on every release; the others before those
releases), vanilla fails on a size mismatch, and neofix refuses the step on its columns as before.

The fact each adapter states is checked against vanilla on the installed release (``test_the_fact_is_vanillas``).
"""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

import neofix
from neofix._core import NO_CACHE, Limits, Policy, StepInputs, align
from neofix._families import FAMILIES
from neofix.testing import FAMILY_CONFIGS, reference_greedy, tiny_model

from ._versions import TF_RELEASE
from .loops import decode, left_padded_batch
from .test_families import NAMES, run

FAMILIES_HERE = [name for name in ("gpt_neo", "gpt2", "gptj", "codegen", "gpt_bigcode") if name in NAMES]
TABLE = 64  # the tiny models' position table (neofix.testing.tiny_config)
STEPS = 3


def model_of(name, attention=None):
    """The family's tiny model running ``attention`` (``None``: the release's default for it, as users get it).
    float32: CodeGen's float64 models decode nothing but NaN on 4.45, vanilla as patched."""
    if not hasattr(transformers, FAMILY_CONFIGS[name][0]):
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILY_CONFIGS[name][0]}")
    if not FAMILIES[name].patched_here():
        pytest.skip(f"transformers {transformers.__version__}: {FAMILIES[name].targets[0].why}")
    if attention is None:
        return tiny_model(name, seed=0)
    try:
        model = tiny_model(name, seed=0, attn_implementation=attention)
    except ValueError:  # the release refuses the implementation for this family
        model = None
    if model is None or (getattr(model.config, "_attn_implementation", None) or "eager") != attention:
        pytest.skip(f"{name} has no {attention} attention on transformers {transformers.__version__}")
    return model


def limits_of(name, model):
    return FAMILIES[name].load_adapter().limits(model.config)


def wide_batch(real=(20, 30), width=TABLE + 6):
    """Rows of ``real`` tokens left-padded to ``width`` columns, more than the table holds: every row fits."""
    return left_padded_batch(list(real), width=width, seed=3)


def alone(model, ids, mask, steps=STEPS):
    """Each row's greedy tokens decoded alone, unpadded (the reference: well inside the table)."""
    rows = []
    for row in range(ids.shape[0]):
        real = ids[row][mask[row] == 1][None]
        rows.append(reference_greedy(model, real, torch.ones_like(real), steps)[0, real.shape[1] :])
    return torch.stack(rows)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("name", FAMILIES_HERE)
def test_the_fact_is_vanillas(name, attention):
    """The adapter's ``wider_than_table`` is what vanilla does with a wide left-padded batch given the mask's
    positions: right where it says so, a failure where it does not."""
    model = model_of(name, attention)
    ids, mask = wide_batch()
    with neofix.unpatched():
        plain, _ = run(lambda: decode(model, ids, mask, STEPS, positions="correct"))
    if limits_of(name, model).wider_than_table:
        assert isinstance(plain, torch.Tensor), plain
        assert torch.equal(plain, alone(model, ids, mask))
    else:
        assert isinstance(plain, Exception), plain  # the causal buffer's size mismatch


@pytest.mark.parametrize("positions", ["none", "correct"])
@pytest.mark.parametrize("name", FAMILIES_HERE)
def test_a_wide_left_padded_batch_decodes_as_each_row_alone(name, positions):
    model = model_of(name)
    ids, mask = wide_batch()
    tokens, said = run(lambda: decode(model, ids, mask, STEPS, positions=positions))
    limits = limits_of(name, model)
    if not limits.wider_than_table:
        assert isinstance(tokens, neofix.SequenceTooLongError), tokens  # as before: vanilla fails here
        assert f"would reach sequence length {TABLE + 6}" in str(tokens)
        return
    if positions == "none" and FAMILIES[name].load_adapter().positions is not neofix._core.Positions.ABSOLUTE:
        # rotary: transformers' own positions are the columns, past the table (vanilla: IndexError)
        assert isinstance(tokens, neofix.SequenceTooLongError), tokens
        assert f"would reach sequence length {TABLE + 6}" in str(tokens)
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, alone(model, ids, mask))


@pytest.mark.parametrize("new", [2, STEPS])  # (2: the columns pass the table by one position only)
@pytest.mark.parametrize("name", FAMILIES_HERE)
def test_generate_pads_a_batch_past_the_table_as_vanilla_does(name, new):
    """``padding="max_length"`` to the table, then generate: the rows fit, the columns do not."""
    model = model_of(name)
    ids, mask = wide_batch(width=TABLE)
    call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0)
    call["eos_token_id"] = None
    patched, _ = run(lambda: model.generate(**call))
    if not limits_of(name, model).wider_than_table:
        assert isinstance(patched, neofix.SequenceTooLongError), patched
        assert "generate cannot run within config.max_position_embeddings=64" in str(patched)
        return
    with neofix.unpatched():
        plain, _ = run(lambda: model.generate(**call))
    assert isinstance(plain, torch.Tensor), plain
    assert torch.equal(patched, plain)
    assert torch.equal(patched[:, TABLE:], alone(model, ids, mask, new))


def wide_ok(name):
    model = model_of(name)
    if not limits_of(name, model).wider_than_table:
        pytest.skip(f"{name} on transformers {transformers.__version__}: the table bounds the columns")
    return model


@pytest.mark.parametrize("name", FAMILIES_HERE)
def test_a_row_past_the_table_is_refused_before_its_step(name):
    """The longest row reaches the table during a hand loop: the step that would look up position 64 is refused,
    naming it, and nothing of it runs."""
    model = wide_ok(name)
    ids, mask = wide_batch(real=(TABLE - 1, 30))
    error, _ = run(lambda: decode(model, ids, mask, STEPS, positions="correct"))
    assert isinstance(error, neofix.SequenceTooLongError), error
    assert str(error) == (
        f"this step would look up position {TABLE} (each row's positions count its real tokens) (the cache holds "
        f"{TABLE + 7} tokens and the step feeds 1), but config.max_position_embeddings is {TABLE}: 0 more new tokens "
        f"fit; shorten the prompt or generate fewer tokens"
    )
    assert (error.past, error.total, error.max_positions) == (TABLE + 7, TABLE + 1, TABLE)


@pytest.mark.parametrize("name", FAMILIES_HERE)
def test_generate_counts_the_longest_rows_real_tokens(name):
    """Up front, generate is refused on the real tokens of the prompt's longest row, not on its columns; a call
    that can start runs until the step that would overflow, told in generate's terms."""
    model = wide_ok(name)
    ids, mask = wide_batch(real=(TABLE - 2, 30), width=TABLE + 4)
    call = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    refused, _ = run(lambda: model.generate(**call, max_new_tokens=5))
    assert isinstance(refused, neofix.SequenceTooLongError), refused
    assert str(refused) == (
        f"generate cannot run within config.max_position_embeddings={TABLE}: no eos_token_id, so it runs to "
        f"max_length={TABLE + 9}, which needs {TABLE + 2} positions; at most 3 new tokens fit after this "
        f"{TABLE + 4}-token prompt (its longest row: {TABLE - 2} real tokens)"
    )
    tokens, _ = run(lambda: model.generate(**call, max_new_tokens=3))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens[:, TABLE + 4 :], alone(model, ids, mask))


# -- the rule, on the core alone -------------------------------------------------------------------------------------

WIDE = Limits(max_positions=8, vocab_size=96, hidden_size=32, heads=4, head_dim=8, wider_than_table=True)


def step_of(mask, positions=None):
    return StepInputs(torch.ones(mask.shape[0], mask.shape[1], dtype=torch.long), None, mask, positions)


def test_the_core_runs_a_wide_step_whose_positions_fit_and_refuses_one_whose_do_not():
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])  # 10 columns, 7 and 6 real
    aligned = align(step_of(mask), NO_CACHE, WIDE)
    assert aligned.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]
    with pytest.raises(neofix.SequenceTooLongError, match="would reach sequence length 10"):
        align(step_of(mask), NO_CACHE, WIDE._replace(wider_than_table=False))  # the columns bound it
    with pytest.raises(neofix.SequenceTooLongError, match="would reach sequence length 10"):
        align(step_of(mask), NO_CACHE, WIDE, Policy(compiling=True))  # nothing is read inside torch.compile
    with pytest.raises(neofix.SequenceTooLongError, match="would reach sequence length 10"):
        align(step_of(torch.ones(1, 10, dtype=torch.long)), NO_CACHE, WIDE)  # every token real: positions 0 to 9
    full = torch.tensor([[0, 1, 1, 1, 1, 1, 1, 1, 1, 1]])  # 9 real tokens: position 8 is past the table
    with pytest.raises(neofix.SequenceTooLongError, match="would look up position 8"):
        align(step_of(full), NO_CACHE, WIDE)
    given = torch.tensor([[0, 0, 0, 0, 1, 2, 3, 4, 5, 6]])
    assert align(step_of(mask[:1], given), NO_CACHE, WIDE).position_ids is given  # the caller's, as they are


@pytest.mark.parametrize("name", FAMILIES_HERE)
def test_generate_that_could_stop_in_time_is_told_in_its_terms_where_it_overflows(name):
    """With an end-of-sequence token generate may stop in time, so it starts; the step that would look up position
    64 is refused before its compute and told in generate's terms, counting the longest row's real tokens."""
    model = wide_ok(name)
    ids, mask = wide_batch(real=(TABLE - 2, 30), width=TABLE + 4)
    call = dict(input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=0, max_new_tokens=6)
    plain_tokens = alone(model, ids, mask, 3)
    eos = next(token for token in range(1, 96) if token not in plain_tokens.flatten().tolist())
    error, _ = run(lambda: model.generate(**call, eos_token_id=eos))
    assert isinstance(error, neofix.SequenceTooLongError), error
    assert str(error).startswith(
        f"generate produced 3 new tokens after the {TABLE + 4}-token prompt, and feeding the last one back would need "
        f"position {TABLE}, but config.max_position_embeddings is {TABLE} (positions 0 to {TABLE - 1}): at most 3 new "
        f"tokens fit after this prompt. Pass max_new_tokens=3 or fewer"
    ), error


@pytest.mark.parametrize("ask", [{"output_attentions": True}, {"head_mask": "ones"}])
def test_gpt2s_eager_fallback_is_refused_where_vanilla_fails(ask):
    """On 4.42 - 4.53 GPT-2's sdpa attention runs its eager one when asked for attentions or given a head mask: a
    wide step fails there in vanilla (a size mismatch) and is refused by neofix before its compute; elsewhere it runs
    as in vanilla."""
    if "gpt2" not in FAMILIES_HERE:
        pytest.skip("GPT-2 is not tested on this release (NEOFIX_TEST_FAMILIES)")
    model = wide_ok("gpt2")
    ids, mask = wide_batch()
    if "head_mask" in ask:
        ask = {"head_mask": torch.ones(model.config.n_layer, model.config.n_head)}
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    call = dict(input_ids=ids, attention_mask=mask, position_ids=positions, **ask)
    patched, _ = run(lambda: model(**call).logits)
    with neofix.unpatched():
        plain, _ = run(lambda: model(**call).logits)
    if isinstance(plain, Exception):
        assert isinstance(patched, neofix.SequenceTooLongError), patched
        assert "GPT-2's sdpa attention runs its eager one" in str(patched)
    else:
        assert isinstance(patched, torch.Tensor), patched
        assert torch.equal(patched, plain)


@pytest.mark.parametrize("name", FAMILIES_HERE)
def test_generate_of_an_unpadded_prompt_is_refused_on_its_columns(name):
    """Every token real: the columns are the positions, and one position too many is refused up front."""
    model = wide_ok(name)
    ids = torch.randint(1, 96, (1, TABLE - 2), generator=torch.Generator().manual_seed(4))
    call = dict(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    refused, _ = run(lambda: model.generate(**call, eos_token_id=None, max_new_tokens=4))
    assert isinstance(refused, neofix.SequenceTooLongError), refused
    assert str(refused) == (
        f"generate cannot run within config.max_position_embeddings={TABLE}: no eos_token_id, so it runs to "
        f"max_length={TABLE + 2}, which needs {TABLE + 1} positions; at most 3 new tokens fit after this "
        f"{TABLE - 2}-token prompt"
    )


def test_the_pads_generate_counts_come_from_a_mask_of_the_prompts_width():
    from neofix._wrappers import _fewest_pads

    assert _fewest_pads(torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1]]), 5) == 1  # the longest row's pads
    assert _fewest_pads(torch.tensor([[0, 0, 1, 1, 1]]), 7) == 0  # another width: not this prompt's mask
    assert _fewest_pads(torch.tensor([0, 1, 1, 1, 1]), 5) == 0  # not a 2D mask
    assert _fewest_pads(torch.ones(0, 5, dtype=torch.long), 5) == 0  # no rows
    assert _fewest_pads(None, 5) == 0


@pytest.mark.parametrize("name", ["gpt2", "gptj", "codegen"])
@pytest.mark.parametrize("attention", ["eager", "sdpa", "flash_attention_2"])
def test_the_fact_by_release_and_attention(name, attention):
    """What each adapter says, on the installed release, for every attention implementation: flash attention, which
    the CPU cannot run, keeps the refusal on columns."""
    import types

    config = types.SimpleNamespace(n_positions=64, vocab_size=96, n_embd=32, n_head=4, _attn_implementation=attention)
    release = TF_RELEASE
    if name == "gpt2":
        expected = (attention == "sdpa" and release >= (4, 42)) or (attention == "eager" and release >= (5, 2))
    else:
        expected = attention in ("eager", "sdpa") and release >= (4, 45)
    importlib.import_module(FAMILIES[name].module)
    assert FAMILIES[name].load_adapter().limits(config).wider_than_table is expected
