"""The modern decoders (Llama, Mistral): the step contract on a tiny random model of the family
(``neofix.testing.tiny_model(family)``: rotary positions, grouped-query attention, no position table; Mistral with a
sliding window of 4), with eager and sdpa attention.  ``tests/test_family_<name>.py`` runs these for one family (its
``family`` fixture), so that ``NEOFIX_TEST_FAMILIES`` selects it per release.

Every correctness check compares with the full-recompute reference token for token (float64, sharpened); what vanilla
does right (``generate``: greedy, beam, sampling; an unpadded hand loop) stays bit-identical.  Vanilla's outcome of
each classic mistake is asserted too, so that a release that fixes or changes one shows up here.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import neofix
from neofix._families import FAMILIES
from neofix.testing import FAMILY_CONFIGS, reference_greedy, tiny_model

from ._versions import TF, TF_RELEASE, cache_keyword, output_cache
from .loops import decode, left_padded_batch, patched_and_vanilla



def skip_unless_available(family: str, since: str) -> None:
    """Skip the calling test module where the installed transformers lacks the family."""
    if not hasattr(transformers, FAMILY_CONFIGS[family][0]):
        title = FAMILIES[family].title
        pytest.skip(f"transformers {TF} has no {title} (it arrived in {since})", allow_module_level=True)

STEPS = 8
ROWS = [6, 3, 5]
#: The forward takes cache_position (up to 4.57); 5.x takes none.
TAKES_CACHE_POSITION = TF_RELEASE < (5, 0)
#: 5.x pads a mask shorter than cache plus input with zeros on the right (masking_utils): a stale mask is silently
#: wrong there; 4.45 fails on the shapes.
STALE_MASK_SILENT = TF_RELEASE >= (4, 57)


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def lm(request, family):
    """float64 with sdpa; float32 with eager attention, whose softmax runs in float32: float64's most negative mask
    value becomes -inf there, so a left-padded row's pad queries see no key, their softmax is NaN, and the NaN
    reaches every token of the row through the values (vanilla 4.45 and 5.24 alike; neofix leaves it)."""
    dtype = torch.float64 if request.param == "sdpa" else torch.float32
    return tiny_model(family, seed=0, dtype=dtype, attn_implementation=request.param)


def reference(model, ids, mask, steps=STEPS):
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1] :]


def run(call):
    """``call()`` with NeofixWarnings recorded: (result or exception, their messages)."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the outcome is asserted
            result = exc
    return result, [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]


def vanilla(call):
    with neofix.unpatched():
        return run(call)[0]


def wrong_or_raises(outcome, expected):
    return not isinstance(outcome, torch.Tensor) or not torch.equal(outcome, expected)


def layers_ran(model, call):
    """``(outcome of call(), whether the first decoder layer ran)``."""
    ran = []
    handle = model.model.layers[0].register_forward_pre_hook(lambda *_: ran.append(True))
    try:
        return run(call)[0], bool(ran)
    finally:
        handle.remove()


# -- the patch ---------------------------------------------------------------------------------------------------------


def test_the_family_is_patched_without_a_position_limit(family):
    import importlib

    declared = FAMILIES[family]
    base = getattr(importlib.import_module(declared.module), declared.base_model)
    assert getattr(base.forward, "__neofix_wrapper__", False)
    states = {name: state for name, state, _ in neofix._lifecycle.status()}
    assert {target.name: states[target.name] for target in declared.targets} == {
        f"{declared.base_model}.forward": "patched",
        f"{declared.causal_lm}.prepare_inputs_for_generation": "patched",
        f"{declared.causal_lm}.generate": "patched",
        f"{declared.causal_lm}._get_stopping_criteria": "skipped",  # rotary: no table to stop at
    }
    adapter = declared.load_adapter()
    limits = adapter.limits(tiny_model(family).config)
    assert limits.max_positions is None
    assert (limits.heads, limits.head_dim) == (2, 8)  # the key-value heads of the cache (grouped-query attention)


# -- hand-written loops against the reference --------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["none", "correct", "full", "arange"])
def test_a_left_padded_loop_gives_the_reference(lm, positions):
    """Missing positions, the mask's, every token's so far (the last q taken) or arange over the padded width (rotary:
    only differences matter): the reference's tokens."""
    ids, mask = left_padded_batch(ROWS)
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, positions=positions))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert messages == []


def test_a_chunked_prefill_without_positions_gives_the_reference(lm):
    ids, mask = left_padded_batch(ROWS)
    tokens, _ = run(lambda: decode(lm, ids, mask, STEPS, chunks=(2, 4)))
    assert torch.equal(tokens, reference(lm, ids, mask))


def test_the_stale_mask_is_extended(lm):
    """The prompt's mask at every step: 5.x pads it with zeros on the right (silently wrong), 4.45 fails on shapes;
    neofix extends it with ones and says so once."""
    ids, mask = left_padded_batch(ROWS)
    expected = reference(lm, ids, mask)
    plain = vanilla(lambda: decode(lm, ids, mask, STEPS, mask_mode="stale"))
    if STALE_MASK_SILENT:
        assert isinstance(plain, torch.Tensor) and not torch.equal(plain, expected)
    else:
        assert isinstance(plain, RuntimeError), plain
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, mask_mode="stale"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    assert len(messages) == 1 and "extended it with ones on the right" in messages[0], messages


def test_stale_prompt_positions_are_a_clear_error(lm):
    """The prompt's position_ids on a decode step: vanilla fails on shapes deep inside attention; with rotary
    positions neofix cannot tell which scheme the cache was built with, so it names the mistake."""
    ids, mask = left_padded_batch(ROWS)
    assert isinstance(vanilla(lambda: decode(lm, ids, mask, STEPS, positions="stale")), RuntimeError)
    error, _ = run(lambda: decode(lm, ids, mask, STEPS, positions="stale"))
    assert isinstance(error, neofix.PositionError), error
    assert str(error).startswith(
        "position_ids has 6 columns, but this step feeds 1 new token (the cache holds 6): with rotary positions"
    )


@pytest.mark.xfail(
    strict=True,
    reason="issue 38: rotary positions are never compared (Positions.ROTARY.compared is False), so positions that do "
    "not advance pass through as in vanilla: silently wrong tokens",
)
def test_positions_that_do_not_advance_are_repaired_or_refused(lm):
    ids, mask = left_padded_batch(ROWS)
    expected = reference(lm, ids, mask)
    plain = vanilla(lambda: decode(lm, ids, mask, STEPS, positions="frozen"))
    assert isinstance(plain, torch.Tensor) and not torch.equal(plain, expected)  # vanilla: silently wrong
    tokens, _ = run(lambda: decode(lm, ids, mask, STEPS, positions="frozen"))
    assert isinstance(tokens, neofix.PositionError) or torch.equal(tokens, expected), tokens


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_token_id_past_the_vocabulary_is_named(lm, where):
    """vanilla: ``IndexError: index out of range in self``.  neofix names the id; on the prefill before any layer runs
    (a decode step reads no value: the embedding's lookup fails first, and its IndexError is explained)."""
    ids, mask = left_padded_batch(ROWS)
    vocab = lm.config.vocab_size
    if where == "prefill":
        ids[0, -1] = vocab
        call = lambda: lm(input_ids=ids, attention_mask=mask)  # noqa: E731
        assert isinstance(vanilla(call), IndexError)
        error, ran = layers_ran(lm, call)
        assert not ran
        assert isinstance(error, neofix.TokenIdError), error
        assert str(error).startswith(f"input_ids[0, 5] is {vocab}, outside the vocabulary")
        return

    def step():
        out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
        longer = torch.cat([mask, mask.new_ones(3, 1)], -1)
        bad = torch.full((3, 1), vocab)
        return lm(input_ids=bad, attention_mask=longer, use_cache=True, **{cache_keyword(lm): output_cache(out)})

    assert isinstance(vanilla(step), IndexError)
    error, _ = run(step)
    assert isinstance(error, neofix.TokenIdError), error
    assert str(error).startswith(f"input_ids[0, 0] is {vocab}, outside the vocabulary")


def test_a_mask_of_another_batch_is_refused_before_any_layer_runs(lm):
    ids, mask = left_padded_batch(ROWS)
    call = lambda: lm(input_ids=ids, attention_mask=mask[:2])  # noqa: E731
    assert isinstance(vanilla(call), (IndexError, RuntimeError))  # 5.x: IndexError; 4.45: RuntimeError
    error, ran = layers_ran(lm, call)
    assert not ran
    assert isinstance(error, neofix.BatchMismatchError), error
    assert str(error) == "attention_mask has 2 rows, but this step feeds 3: pass one mask row per input row"


def _step_with_mask(lm, make_mask):
    """A prefill of the left-padded batch, then one decode step given ``make_mask(full)`` (full: the right mask)."""
    ids, mask = left_padded_batch(ROWS)
    full = torch.cat([mask, mask.new_ones(3, 1)], -1)

    def step():
        out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        cache = {cache_keyword(lm): output_cache(out)}
        return lm(input_ids=nxt, attention_mask=make_mask(full), use_cache=True, **cache)

    return step


def test_a_longer_left_padded_mask_is_refused(lm):
    """Two more columns of padding on the left: vanilla reads the first columns (silently wrong logits; with Mistral's
    window of 4 the misread columns lie outside the window, so vanilla happens to be right there); which columns
    belong to the cache cannot be told, so neofix refuses it."""
    right = run(_step_with_mask(lm, lambda full: full))[0].logits
    longer = _step_with_mask(lm, lambda full: torch.cat([full.new_zeros(3, 2), full], -1))
    plain = vanilla(longer)
    if getattr(lm.config, "sliding_window", None) is None:
        assert not torch.equal(plain.logits, right)
    error, _ = run(longer)
    assert isinstance(error, neofix.MaskLengthError), error
    assert "A longer mask is ambiguous" in str(error)


def test_a_longer_all_ones_mask_is_sliced_as_vanilla_does(lm):
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(4))
    key = cache_keyword(lm)

    def step():
        out = lm(input_ids=ids, use_cache=True)
        return lm(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 9, dtype=torch.long), use_cache=True,
                  **{key: output_cache(out)}).logits

    patched, plain = patched_and_vanilla(lambda: run(step)[0])
    assert torch.equal(patched, plain)


def test_past_max_position_embeddings_runs_as_vanilla(lm):
    """Rotary positions extrapolate: past the 64 of max_position_embeddings cached decoding equals the reference and
    vanilla, and neofix adds no limit (generate neither)."""
    ids = torch.randint(1, 96, (1, 62), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    patched, plain = patched_and_vanilla(lambda: run(lambda: decode(lm, ids, mask, 6))[0])
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference(lm, ids, mask, 6))
    with torch.no_grad():
        generated = lm.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape[1] == 68


def test_a_legacy_tuple_cache_decodes_on_every_release(lm):
    """Tuples: converted by 4.45 itself, rejected from 4.48 (``'tuple' object has no attribute 'get_seq_length'``),
    where neofix wraps them in a DynamicCache and says so once."""
    ids, mask = left_padded_batch(ROWS)
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, cache_format="legacy"))
    if getattr(lm.config, "sliding_window", None) is not None and TF_RELEASE >= (4, 56):
        # the model's own cache keeps only the window's keys (sliding-window layers): its tuples cannot tell how many
        # tokens came before, so the mask is wider than the cache (vanilla: 'tuple' object has no attribute ...)
        assert isinstance(tokens, neofix.MaskLengthError), tokens
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    wrapped = [m for m in messages if "legacy tuple cache" in m]
    assert len(wrapped) == (1 if TF_RELEASE >= (4, 48) else 0), messages


# -- cache_position (the forward takes it up to 4.57) -----------------------------------------------------------------


@torch.no_grad()
def loop_with_cache_position(lm, ids, mask, mode, mask_mode="synced"):
    """A greedy hand loop passing ``cache_position``: "correct" (arange(p, p + q)), "stale" (the prompt's at every
    step) or "frozen" (the prompt's length at every decode step: a loop that forgets to increment it)."""
    key, cache, full, past, new, generated = cache_keyword(lm), None, mask, 0, ids, []
    for step in range(STEPS):
        q = new.shape[1]
        positions = {
            "correct": torch.arange(past, past + q),
            "stale": torch.arange(ids.shape[1]),
            "frozen": torch.arange(past, past + q) if step == 0 else torch.tensor([ids.shape[1]]),
        }[mode]
        kwargs = dict(input_ids=new, attention_mask=full if mask_mode == "synced" else mask, cache_position=positions)
        if cache is not None:
            kwargs[key] = cache
        out = lm(**kwargs, use_cache=True)
        cache, past = output_cache(out), past + q
        new = out.logits[:, -1:].argmax(-1)
        generated.append(new)
        full = torch.cat([full, full.new_ones(full.shape[0], 1)], -1)
    return torch.cat(generated, -1)


needs_cache_position = pytest.mark.skipif(
    not TAKES_CACHE_POSITION, reason=f"transformers {TF}: the forward takes no cache_position"
)


@needs_cache_position
@pytest.mark.parametrize("case", ["correct", "correct, stale mask", "stale"])
def test_cache_position_is_kept_consistent(lm, case):
    """A right cache_position is passed on (the mask extended around it); the prompt's on a decode step (vanilla: a
    shape RuntimeError) is left out, and the model counts from its cache."""
    ids, mask = left_padded_batch(ROWS)
    mode, _, mask_mode = case.partition(", ")
    mask_mode = "stale" if mask_mode else "synced"
    call = lambda: loop_with_cache_position(lm, ids, mask, mode, mask_mode)  # noqa: E731
    expected = reference(lm, ids, mask)
    if case != "correct":
        assert wrong_or_raises(vanilla(call), expected)
    tokens, messages = run(call)
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    if mode == "stale":
        said = "neofix: cache_position has 6 entries, but this step feeds 1 new token"
        assert any(m.startswith(said) for m in messages), messages


@needs_cache_position
@pytest.mark.xfail(
    strict=True,
    reason="issue 38: cache_position's values are never compared with the cache's length (only its length is "
    "checked), and 4.45 - 4.57 build the causal mask and the positions from them: silently wrong tokens",
)
def test_a_cache_position_that_does_not_advance_is_repaired_or_refused(lm):
    ids, mask = left_padded_batch(ROWS)
    expected = reference(lm, ids, mask)
    call = lambda: loop_with_cache_position(lm, ids, mask, "frozen")  # noqa: E731
    assert wrong_or_raises(vanilla(call), expected)
    tokens, _ = run(call)
    assert isinstance(tokens, neofix.PositionError) or torch.equal(tokens, expected), tokens


# -- what vanilla does right stays bit-identical ----------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["none", "correct"])
def test_an_unpadded_hand_loop_is_bit_identical_to_vanilla(lm, positions):
    """Every forward's logits, bit for bit (an unpadded batch: vanilla's positions are right)."""
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)

    @torch.no_grad()
    def logits():
        key, cache, full, new, every = cache_keyword(lm), None, mask, ids, []
        for _ in range(STEPS):
            kwargs = dict(input_ids=new, attention_mask=full, use_cache=True)
            if positions == "correct":
                kwargs["position_ids"] = torch.arange(full.shape[1] - new.shape[1], full.shape[1])[None]
            if cache is not None:
                kwargs[key] = cache
            out = lm(**kwargs)
            cache, new = output_cache(out), out.logits[:, -1:].argmax(-1)
            every.append(out.logits)
            full = torch.cat([full, full.new_ones(2, 1)], -1)
        return every

    patched, plain = patched_and_vanilla(lambda: run(logits)[0])
    assert all(torch.equal(a, b) for a, b in zip(patched, plain))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(do_sample=False),
        dict(do_sample=False, num_beams=3),
        dict(do_sample=True, top_k=20, temperature=30.0, seed=7),
    ],
    ids=["greedy", "beam", "sampling"],
)
def test_generate_is_bit_identical_to_vanilla(lm, kwargs):
    ids, mask = left_padded_batch(ROWS, seed=3)
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)

    def call():
        if seed is not None:
            torch.manual_seed(seed)
        with torch.no_grad():
            return lm.generate(ids, attention_mask=mask, max_new_tokens=STEPS, pad_token_id=0, **kwargs,
                               output_scores=True, return_dict_in_generate=True)

    patched, plain = patched_and_vanilla(call)
    assert torch.equal(patched.sequences, plain.sequences)
    assert all(torch.equal(a, b) for a, b in zip(patched.scores, plain.scores))
    if kwargs == dict(do_sample=False):
        assert torch.equal(patched.sequences, reference_greedy(lm, ids, mask, STEPS))


def test_generate_continues_from_a_returned_cache_as_vanilla(lm):
    ids, mask = left_padded_batch(ROWS, seed=3)  # no row generates the end-of-sequence token (0) within 7 tokens

    def call():
        with torch.no_grad():
            first = lm.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                                return_dict_in_generate=True)
            longer = torch.cat([mask, mask.new_ones(3, first.sequences.shape[1] - ids.shape[1])], -1)
            cache = first.get("cache", first.get("past_key_values"))
            return lm.generate(first.sequences, attention_mask=longer, max_new_tokens=4, do_sample=False,
                               pad_token_id=0, **{cache_keyword(lm): cache})

    patched, plain = patched_and_vanilla(call)
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(lm, ids, mask, 7))

