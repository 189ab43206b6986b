"""The doctor's scenarios themselves: the inputs each one feeds the model, the references it is judged against, the
pad and eos ids and table sizes its :class:`Context` reads from a model, and what each family expects of it.

``tests/test_doctor.py`` runs the whole doctor; these pin the pieces, on tiny models built from configs.  A
scenario's inputs are read with a forward pre-hook: what the scenario passed to the model, before neofix sees it.
"""

from __future__ import annotations

import contextlib
import importlib
import warnings

import pytest
import torch
import transformers
from transformers import PretrainedConfig

import neofix
from neofix._doctor import _scenarios
from neofix._doctor._scenarios import (
    BEAMS,
    ROW_LENGTHS,
    SCENARIOS,
    STEPS,
    Context,
    _finish_like_generate,
    _table_size,
    left_padded_batch,
)
from neofix._families import FAMILIES
from neofix.testing import reference_greedy, reference_positions, tiny_gpt_neo, tiny_model

from ._versions import TF_RELEASE, cache_keyword, output_cache

SCENARIO = {scenario.key: scenario for scenario in SCENARIOS}
WIDTH = max(ROW_LENGTHS)
#: the mask of the doctor's left-padded batch: real lengths 6, 3 and 5
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1]])


@pytest.fixture
def ctx():
    """A fresh context on the doctor's tiny GPT-Neo (its references not computed yet)."""
    return Context(tiny_gpt_neo(seed=0))


def family_context(name: str) -> Context:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module(FAMILIES[name].module)  # the import hook patches the family here
        model = tiny_model(name, seed=0)
    return Context(model, FAMILIES[name].load_adapter())


@contextlib.contextmanager
def recorded(model):
    """The keyword arguments of every call of ``model`` while the block runs (tensors copied)."""
    calls: list[dict] = []

    def hook(module, args, kwargs):
        assert not args, "the scenarios call the model with keywords only"
        calls.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield calls
    finally:
        handle.remove()


def assert_call(call, ctx, *, input_ids, attention_mask, position_ids=None, cached):
    """One forward call as the scenario made it: these tensors exactly, the cache passed or not."""
    assert torch.equal(call["input_ids"], input_ids)
    assert torch.equal(call["attention_mask"], attention_mask)
    if position_ids is None:
        assert "position_ids" not in call
    else:
        assert torch.equal(call["position_ids"], position_ids)
    assert call["use_cache"] is True
    assert (ctx.cache_keyword in call) is cached
    assert {"input_ids", "attention_mask", "use_cache"} <= set(call) <= {
        "input_ids", "attention_mask", "use_cache", "position_ids", ctx.cache_keyword
    }


def synced(mask, new_tokens):
    """The prompt's mask extended by one column per generated token."""
    return torch.cat([mask, mask.new_ones((mask.shape[0], new_tokens))], dim=-1)


# --- the context ------------------------------------------------------------------------------------------------


def test_context_of_the_tiny_gpt_neo(ctx):
    """What the scenarios read from the doctor's model: vocabulary, positions, the table that is a limit, the cache
    keyword of this release, eos and pad (token 0), and the left-padded batch of real lengths 6, 3 and 5."""
    assert ctx.vocab_size == 96
    assert ctx.positions_kind == "absolute"
    assert ctx.limit == 64 and ctx.max_positions == 64
    assert ctx.cache_keyword == cache_keyword(ctx.model)
    assert ctx.takes_positions is True
    assert (ctx.eos, ctx.pad) == (0, 0)
    assert ctx.ids.shape == (3, WIDTH) and torch.equal(ctx.mask, MASK)
    expected_ids, expected_mask = left_padded_batch(ROW_LENGTHS, 96, 0)
    assert torch.equal(ctx.ids, expected_ids) and torch.equal(ctx.mask, expected_mask)


@pytest.mark.parametrize(
    "family, positions, limit, max_positions, takes_positions",
    [
        ("gpt2", "absolute", 64, 64, True),
        ("opt", "mask", None, 64, None),  # OPT names the overflow at the failing lookup, no limit up front
        ("bloom", "none", None, 2048, False),  # ALiBi: no table in the config, the default size
        # up to 4.53 GPT-BigCode derives missing positions from the mask itself; its table bounds the columns
        pytest.param(
            "gpt_bigcode", "mask" if TF_RELEASE < (4, 54) else "absolute", 64, 64, True,
            marks=pytest.mark.skipif(TF_RELEASE < (4, 30), reason="neofix patches GPT-BigCode from transformers 4.30"),
        ),
        # rotary (its tiny model's config; an ALiBi one reads as "none": tests/test_family_falcon.py); no table
        pytest.param(
            "falcon", "rotary", None, 64, True,
            marks=pytest.mark.skipif(TF_RELEASE < (4, 36), reason="neofix patches Falcon from transformers 4.36"),
        ),
    ],
)
def test_context_of_other_families(family, positions, limit, max_positions, takes_positions):
    """The table a family has is its size, whether or not running past it is an error up front."""
    context = family_context(family)
    assert context.positions_kind == positions
    assert context.limit == limit
    assert context.max_positions == max_positions
    if takes_positions is not None:  # OPT's forward takes position_ids only on later releases
        assert context.takes_positions is takes_positions
    assert (context.eos, context.pad) == (0, 0)


def gpt_neo_with(config_eos, config_pad, generation_eos, generation_pad):
    model = tiny_gpt_neo(seed=0, bos_token_id=None, eos_token_id=config_eos, pad_token_id=config_pad)
    model.generation_config.eos_token_id = generation_eos
    model.generation_config.pad_token_id = generation_pad
    return model


@pytest.mark.parametrize(
    "config_eos, config_pad, generation_eos, generation_pad, eos, pad",
    [
        (0, 0, 7, 9, 7, 9),  # the generation config's ids win
        (0, 0, [4, 6], [9, 2], 4, 9),  # a list: its first id
        (5, 3, None, None, 5, 3),  # none there: the model config's
        (5, None, None, None, 5, 5),  # no pad token (gpt-neo-125M): pad with eos
        (None, None, 5, None, 5, 5),
        (None, None, None, None, None, 0),  # neither: pad with 0
    ],
)
def test_context_eos_and_pad(config_eos, config_pad, generation_eos, generation_pad, eos, pad):
    """eos and pad come from the generation config, else the model config; without a pad id the batch is padded
    with eos, as users of checkpoints without a pad token do, else with 0; the prompts' real ids avoid it."""
    context = Context(gpt_neo_with(config_eos, config_pad, generation_eos, generation_pad))
    assert (context.eos, context.pad) == (eos, pad)
    assert torch.equal(context.mask, MASK)
    assert bool((context.ids[MASK == 0] == pad).all())
    assert not bool((context.ids[MASK == 1] == pad).any())


def test_table_size_names():
    """A config's position table under any of the names configs use, in this order; 2048 where none is given."""
    assert _table_size(PretrainedConfig(max_position_embeddings=40, n_positions=32)) == 40
    assert _table_size(PretrainedConfig(n_positions=32, n_ctx=24, seq_length=16)) == 32
    assert _table_size(PretrainedConfig(n_ctx=24, seq_length=16)) == 24
    assert _table_size(PretrainedConfig(seq_length=16)) == 16
    assert _table_size(PretrainedConfig(n_ctx="24")) == 2048  # not a size
    assert _table_size(PretrainedConfig()) == 2048


# --- the batch ------------------------------------------------------------------------------------------------


def test_left_padded_batch_layout():
    """Rows of the given real lengths, right-aligned: pads (and mask 0) on the left, never the pad id after."""
    ids, mask = left_padded_batch((2, 5, 1), 50, 7)
    assert torch.equal(mask, torch.tensor([[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]]))
    assert bool((ids[mask == 0] == 7).all()) and not bool((ids[mask == 1] == 7).any())
    assert bool((ids >= 0).all() and (ids < 50).all())


def test_left_padded_batch_is_a_function_of_its_seed():
    """The same seed gives the same prompts whatever the global RNG did (so the doctor's runs are comparable);
    the default seed is 0."""
    torch.manual_seed(123)
    first = left_padded_batch(ROW_LENGTHS, 96, 0)
    torch.manual_seed(456)
    again = left_padded_batch(ROW_LENGTHS, 96, 0, seed=0)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], left_padded_batch(ROW_LENGTHS, 96, 0, seed=1)[0])


@pytest.mark.parametrize("pad", [0, 1, 3])
def test_left_padded_batch_draws_every_id_but_the_pad(pad):
    """The real ids range over the whole vocabulary except the pad id."""
    ids, _ = left_padded_batch((400,), 4, pad)
    assert set(ids.flatten().tolist()) == {0, 1, 2, 3} - {pad}


def test_left_padded_batch_with_a_pad_outside_the_vocabulary():
    """A pad id the model does not have is not avoided: the draw is the same whatever it is."""
    below, _ = left_padded_batch((400,), 4, -1)
    above, _ = left_padded_batch((400,), 4, 4)
    assert torch.equal(below, above)
    assert set(below.flatten().tolist()) <= {0, 1, 2, 3}


# --- references -----------------------------------------------------------------------------------------------


def test_reference_is_full_recompute_computed_once(ctx):
    """The STEPS new tokens of full recompute over the left-padded batch, computed once and then reused."""
    expected = reference_greedy(ctx.model, ctx.ids, ctx.mask, STEPS)[:, WIDTH:]
    reference = ctx.reference()
    assert reference.shape == (3, STEPS) and torch.equal(reference, expected)
    assert ctx.reference() is reference


@contextlib.contextmanager
def generate_calls(model):
    """The keyword arguments of every ``model.generate`` call while the block runs."""
    calls: list[dict] = []
    original = model.generate

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    model.generate = spy
    try:
        yield calls
    finally:
        del model.generate


def test_generate_references(ctx):
    """The greedy reference is full recompute finished as generate finishes rows, never generate itself; the beam
    reference is transformers' beam search with the cache off, run once, not the greedy one."""
    with generate_calls(ctx.model) as calls:
        greedy = ctx.generate_reference(1)
        assert calls == []
        assert torch.equal(greedy, _finish_like_generate(ctx.reference(), ctx.eos, ctx.pad))
        beams = ctx.generate_reference(BEAMS)
        assert len(calls) == 1
        assert calls[0]["num_beams"] == BEAMS and calls[0]["use_cache"] is False
        assert calls[0]["max_new_tokens"] == STEPS and calls[0]["pad_token_id"] == ctx.pad
        assert beams.shape == (3, STEPS)
        assert ctx.generate_reference(BEAMS) is beams and ctx.generate_reference(1) is greedy
        assert len(calls) == 1


def test_finish_like_generate():
    """After a row's eos it gets pad, and the tokens stop at the step where every row has ended."""
    tokens = torch.tensor([[5, 1, 2, 3], [1, 5, 3, 4]])
    assert torch.equal(_finish_like_generate(tokens, 5, 9), torch.tensor([[5, 9], [1, 5]]))
    assert torch.equal(_finish_like_generate(tokens, 2, 9), torch.tensor([[5, 1, 2, 9], [1, 5, 3, 4]]))
    assert torch.equal(_finish_like_generate(tokens, None, 9), tokens)
    assert torch.equal(tokens, torch.tensor([[5, 1, 2, 3], [1, 5, 3, 4]]))  # not changed in place


def test_greedy_reference_matches_generate_when_a_row_ends():
    """With an eos one row generates early and a pad that is not eos, the greedy reference is what generate gives."""
    plain = Context(gpt_neo_with(0, 7, 0, 7))
    eos = int(plain.reference()[1, 2])
    context = Context(gpt_neo_with(eos, 7, eos, 7))  # both configs: up to 4.3x generate reads the model's
    expected = context.generate_reference(1)
    assert (expected == 7).any(), "no row ended before the last step"
    assert torch.equal(context.generate(1), expected)


def test_output_cache_under_either_name(ctx):
    """A forward's cache as the scenarios (and DecodeState, and the right-padding check) read it back
    (``_caches.of_output``): ``cache`` (transformers 5.x), else ``past_key_values``, read by the name the output has
    (never through 5.x's deprecated alias), a name holding None skipped; None when the output carries none."""
    from neofix._caches import of_output

    cache = object()
    assert of_output({"logits": 1, "cache": cache}) is cache
    assert of_output({"logits": 1, "past_key_values": cache}) is cache
    assert of_output({"logits": 1, "cache": None, "past_key_values": cache}) is cache
    assert of_output({"logits": 1}) is None and of_output({"cache": None}) is None and of_output((cache,)) is None
    with torch.no_grad():
        out = ctx.model(input_ids=ctx.ids, attention_mask=ctx.mask, use_cache=True)
    assert of_output(out) is output_cache(out)


# --- what the decoding scenarios feed the model -----------------------------------------------------------------


def test_stale_mask_feeds_the_prompts_mask_with_correct_positions(ctx):
    """The prompt's mask at every step, with the right position_ids for the new tokens; neofix repairs it."""
    with recorded(ctx.model) as calls:
        tokens = SCENARIO["stale_mask"].run(ctx)
    assert torch.equal(tokens, ctx.reference())
    assert len(calls) == STEPS
    assert_call(calls[0], ctx, input_ids=ctx.ids, attention_mask=MASK, position_ids=reference_positions(MASK),
                cached=False)
    for step, call in enumerate(calls[1:], 1):
        positions = reference_positions(synced(MASK, step))[:, -1:]
        assert_call(call, ctx, input_ids=tokens[:, step - 1:step], attention_mask=MASK, position_ids=positions,
                    cached=True)


def test_mask_too_long_feeds_a_preallocated_mask(ctx):
    """After the prompt, a mask as long as the whole generation (prompt + STEPS) with the right positions: neofix
    raises MaskLengthError at the first decode step."""
    with recorded(ctx.model) as calls, pytest.raises(neofix.MaskLengthError) as raised:
        SCENARIO["mask_too_long"].run(ctx)
    assert str(raised.value).startswith(f"attention_mask has {WIDTH + STEPS} columns, but the cache holds {WIDTH}")
    assert len(calls) == 2
    assert_call(calls[0], ctx, input_ids=ctx.ids, attention_mask=MASK, position_ids=reference_positions(MASK),
                cached=False)
    assert calls[1]["attention_mask"].shape == (3, WIDTH + STEPS)
    assert_call(calls[1], ctx, input_ids=calls[1]["input_ids"], attention_mask=synced(MASK, STEPS),
                position_ids=reference_positions(synced(MASK, 1))[:, -1:], cached=True)


def test_chunked_prefill_feeds_the_prompt_in_two_halves(ctx):
    """The prompt in two halves of 3 columns (the second with the cache), then one token per step; no position_ids
    anywhere; neofix gives the reference tokens."""
    with recorded(ctx.model) as calls:
        tokens = SCENARIO["chunked_prefill"].run(ctx)
    assert torch.equal(tokens, ctx.reference())
    assert len(calls) == 1 + STEPS
    assert_call(calls[0], ctx, input_ids=ctx.ids[:, :3], attention_mask=MASK[:, :3], cached=False)
    assert_call(calls[1], ctx, input_ids=ctx.ids[:, 3:], attention_mask=MASK, cached=True)
    for step, call in enumerate(calls[2:], 1):
        assert_call(call, ctx, input_ids=tokens[:, step - 1:step], attention_mask=synced(MASK, step), cached=True)


def test_batch_mismatch_feeds_a_mask_one_row_short(ctx):
    with recorded(ctx.model) as calls, pytest.raises(neofix.BatchMismatchError) as raised:
        SCENARIO["batch_mismatch"].run(ctx)
    assert str(raised.value) == "attention_mask has 2 rows, but this step feeds 3: pass one mask row per input row"
    assert len(calls) == 1
    assert_call(calls[0], ctx, input_ids=ctx.ids, attention_mask=MASK[:2], cached=False)


def test_out_of_vocabulary_puts_vocab_size_at_the_end_of_row_1(ctx):
    """The last (real) token of the second row is vocab_size; the mask is the batch's."""
    with recorded(ctx.model) as calls, pytest.raises(neofix.TokenIdError) as raised:
        SCENARIO["out_of_vocabulary"].run(ctx)
    assert str(raised.value).startswith(f"input_ids[1, {WIDTH - 1}] is 96, outside the vocabulary")
    assert len(calls) == 1
    expected = ctx.ids.clone()
    expected[1, -1] = 96
    assert_call(calls[0], ctx, input_ids=expected, attention_mask=MASK, cached=False)
    assert int(ctx.ids[1, -1]) != 96  # the context's batch is left as it was


def overflow_prompt(ctx):
    return torch.randint(0, ctx.vocab_size, (1, ctx.max_positions - 2), generator=torch.Generator().manual_seed(1))


def test_position_overflow_runs_past_the_table_at_the_fourth_step(ctx):
    """One unpadded row 2 short of the table: the prompt and two tokens fit, the next step needs position 64 and
    neofix raises SequenceTooLongError there."""
    with recorded(ctx.model) as calls, pytest.raises(neofix.SequenceTooLongError) as raised:
        SCENARIO["position_overflow"].run(ctx)
    assert str(raised.value).startswith(
        "this step would reach sequence length 65 (the cache holds 64 tokens and the step feeds 1), but "
        "config.max_position_embeddings is 64"
    )
    assert len(calls) == 4
    prompt = overflow_prompt(ctx)
    assert_call(calls[0], ctx, input_ids=prompt, attention_mask=torch.ones_like(prompt), cached=False)
    for step, call in enumerate(calls[1:], 1):
        assert call["input_ids"].shape == (1, 1)
        assert torch.equal(call["attention_mask"], torch.ones(1, 62 + step, dtype=torch.long))


def test_position_overflow_where_the_model_extrapolates():
    """A family with no limit (GPT-NeoX from transformers 4.36 on): the overflow scenario decodes 4 tokens past the
    table's end, the tokens of full recompute, identical with neofix and without (its adapted reference)."""
    context = family_context("gpt_neox")
    if context.limit is not None:
        pytest.skip("GPT-NeoX's position table is a limit on this transformers release")
    scenario = SCENARIO["position_overflow"].for_family(context)
    assert scenario.reference is _scenarios._overflow_vanilla
    tokens = scenario.run(context)
    prompt = overflow_prompt(context)
    assert torch.equal(tokens, reference_greedy(context.model, prompt, None, 4)[:, prompt.shape[1]:])
    assert torch.equal(scenario.reference(context), tokens)
    assert neofix.is_patched()


def test_eos_near_the_end(ctx):
    """A prompt 6 short of the table and, as eos, the first token full recompute generates: generate ends after it
    (max_new_tokens=10 would run past the table) and so does the reference."""
    ids, eos = _scenarios._near_the_end(ctx)
    expected_ids = torch.randint(0, 96, (1, 58), generator=torch.Generator().manual_seed(2))
    assert torch.equal(ids, expected_ids)
    assert eos == int(reference_greedy(ctx.model, expected_ids, None, 1)[0, -1])
    scenario = SCENARIO["generate_eos_near_the_end"]
    assert torch.equal(scenario.run(ctx), torch.tensor([[eos]]))
    assert torch.equal(scenario.reference(ctx), torch.tensor([[eos]]))


# --- what each family expects ---------------------------------------------------------------------------------

POSITION_KEYS = ("stale_positions", "arange_positions", "frozen_positions")


def test_every_scenario_applies_as_declared_to_gpt_neo(ctx):
    for scenario in SCENARIOS:
        assert scenario.for_family(ctx) is scenario, scenario.key


def test_positions_scenarios_do_not_apply_to_alibi():
    context = family_context("bloom")
    for key in POSITION_KEYS:
        assert SCENARIO[key].for_family(context) == "the model takes no position_ids (ALiBi)"


def test_positions_scenarios_on_rotary_positions():
    """Rotary positions: stale position_ids apply as an error (the cache's positions cannot be told apart); a loop
    that does not increment them gives neither scheme's positions and is repaired (as declared); arange positions
    keep their differences, so they do not apply."""
    context = family_context("gptj")
    if context.positions_kind != "rotary":
        pytest.skip("GPT-J takes no position_ids on this transformers release")
    stale = SCENARIO["stale_positions"]
    assert stale.for_family(context) == stale._replace(
        reference=None, error=neofix.PositionError, strict_error=neofix.PositionError
    )
    assert SCENARIO["arange_positions"].for_family(context) == "rotary positions: only their differences matter"
    assert SCENARIO["frozen_positions"].for_family(context) is SCENARIO["frozen_positions"]


def test_position_overflow_per_family():
    """Where running past the table is no error (no limit, no overflow to name) the scenario runs as vanilla and
    must be identical to it; OPT names the overflow at the lookup, so the error stays expected."""
    overflow = SCENARIO["position_overflow"]
    as_vanilla = overflow._replace(reference=_scenarios._overflow_vanilla, error=None, strict_error=None, parity=True)
    assert overflow.for_family(family_context("bloom")) == as_vanilla
    assert overflow.for_family(family_context("opt")) is overflow
    assert overflow.for_family(family_context("gpt2")) is overflow
    assert overflow.error is neofix.SequenceTooLongError and overflow.parity is False


def test_the_gemma_hybrid_cache_releases_expect_neofixs_errors():
    """Gemma2 up to 4.52 (Gemma3 too): the model's own HybridCache holds the prompt only, so no hand-loop scenario
    applies; Gemma2 up to 4.47 refuses a left-padded generate (MaskValueError).  Elsewhere: as Llama."""
    from neofix import _compat

    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip("no Gemma2 on this transformers release")
    context = family_context("gemma2")
    stale, greedy = SCENARIO["stale_mask"], SCENARIO["generate_greedy"]
    if _compat.release() >= (4, 53):
        assert stale.for_family(context) is stale and greedy.for_family(context) is greedy
        return
    assert stale.for_family(context).startswith("the model's own HybridCache holds the prompt only")
    if _compat.release() < (4, 48):
        assert greedy.for_family(context) == greedy._replace(
            reference=None, error=neofix.MaskValueError, strict_error=neofix.MaskValueError, parity=False
        )

