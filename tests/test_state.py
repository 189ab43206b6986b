"""neofix.DecodeState: hand-written loops against the full-recompute reference, token for token.

Every loop runs with neofix patched and unpatched (DecodeState must not depend on the patch), with the cache
handed back as the model output, as the cache itself, as legacy tuples and as Cache objects.
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

import neofix
from neofix import DecodeState
from neofix.testing import reference_greedy, reference_logits, reference_positions, tiny_gpt_neo

from ._sync import HostReads, simulated_accelerator
from ._vanilla import assert_vanilla
from ._versions import as_cache_object, cache_keyword, has, legacy, output_cache, requires
from .loops import left_padded_batch

STEPS = 8
PAD = 0
# GPT-Neo computes attention scores in float32 even in a float64 model: cached and full-recompute logits (scaled by
# the sharpened output layer) agree to about 1e-4.  Tokens are compared exactly.
TOLERANCE = dict(rtol=1e-4, atol=1e-3)
FORMATS = ["output", "cache", "legacy", pytest.param("object", marks=requires("Cache objects"))]


@pytest.fixture(params=["patched", "vanilla"])
def mode(request):
    """Run the test body with neofix patched and unpatched."""
    if request.param == "vanilla":
        request.getfixturevalue("vanilla")
    return request.param


@pytest.fixture
def net(mode, model):
    """The model of the test: float64, except unpatched on the releases whose float64 mask helper is broken."""
    if mode == "vanilla" and has("float64 mask bug"):
        return tiny_gpt_neo(seed=0, dtype=torch.float32)
    return model


def hand_back(out, cache_format):
    """What the loop passes to advance(): the output, or its cache in the given format."""
    if cache_format == "output":
        return out
    cache = output_cache(out)
    if cache_format == "legacy":
        return legacy(cache)
    if cache_format == "object":
        return as_cache_object(cache)
    return cache


@torch.no_grad()
def greedy_loop(model, ids, mask, steps=STEPS, cache_format="output", finish_at=None):
    """A DecodeState greedy loop.  ``finish_at[row]``: the step from which that row is finished (appends PAD).

    Returns the state and, per step, the logits the cached forward produced for each row's next token.
    """
    state = DecodeState(ids, mask)
    out = model(**state.model_inputs())
    logits = [out.logits[:, -1]]
    for step in range(steps):
        tokens = out.logits[:, -1].argmax(-1)
        finished = None
        if finish_at is not None:
            finished = torch.tensor([step >= at for at in finish_at])
            tokens = torch.where(finished, torch.full_like(tokens, PAD), tokens)
        state.advance(tokens, hand_back(out, cache_format), finished=finished)
        out = model(**state.model_inputs())
        logits.append(out.logits[:, -1])
    return state, torch.stack(logits, dim=1)


# -- the reference ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_format", FORMATS)
def test_left_padded_loop_equals_reference(net, cache_format):
    ids, mask = left_padded_batch([6, 3, 5])
    state, _ = greedy_loop(net, ids, mask, cache_format=cache_format)
    assert torch.equal(state.sequences, reference_greedy(net, ids, mask, STEPS))
    assert torch.equal(state.attention_mask, torch.cat([mask, torch.ones(3, STEPS, dtype=torch.long)], -1))


def test_loop_logits_equal_reference(net):
    """Not only the tokens: every cached step's logits equal the full recompute's."""
    ids, mask = left_padded_batch([6, 2, 4])
    state, logits = greedy_loop(net, ids, mask)
    full = reference_logits(net, state.sequences, state.attention_mask)[:, ids.shape[1] - 1 :]
    torch.testing.assert_close(logits, full, **TOLERANCE)


def test_unpadded_without_mask(net):
    ids, mask = left_padded_batch([5, 5])
    state, _ = greedy_loop(net, ids, None)
    assert torch.equal(state.sequences, reference_greedy(net, ids, mask, STEPS))


def test_batch_of_one_long_enough_to_cross_the_local_window(net):
    ids, mask = left_padded_batch([3])
    state, _ = greedy_loop(net, ids, mask, steps=12)  # window_size is 4: local layers must drop old tokens
    assert torch.equal(state.sequences, reference_greedy(net, ids, mask, 12))


def test_strict_mode_has_nothing_to_repair(model, strict):
    ids, mask = left_padded_batch([6, 3, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        state, _ = greedy_loop(model, ids, mask)
    assert torch.equal(state.sequences, reference_greedy(model, ids, mask, STEPS))


def test_vanilla_loop_without_the_state_is_wrong(model, vanilla):
    """The same loop written naively (prompt mask, no positions) is wrong unpatched: DecodeState is what fixes it.

    Up to transformers 5.0 the stale mask fails with a shape RuntimeError; from 5.10 on it runs and decodes other
    tokens (tests/_vanilla.py).
    """
    ids, mask = left_padded_batch([6, 3, 5])
    if has("float64 mask bug"):
        model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    expected = reference_greedy(model, ids, mask, STEPS)

    @torch.no_grad()
    def naive_loop():
        tokens, cache, generated = ids, None, []
        for _ in range(STEPS):
            kwargs = {} if cache is None else {cache_keyword(): cache}
            out = model(input_ids=tokens, attention_mask=mask, use_cache=True, **kwargs)
            cache = output_cache(out)
            tokens = out.logits[:, -1:].argmax(-1)
            generated.append(tokens)
        return torch.cat([ids, *generated], -1)

    assert_vanilla("loop keeping the prompt mask", naive_loop, wrong=lambda got: not torch.equal(got, expected))


# -- model_inputs ----------------------------------------------------------------------------------------------------


def test_model_inputs_prefill_then_decode(model):
    ids, mask = left_padded_batch([4, 2])
    state = DecodeState(ids, mask)
    first = state.model_inputs()
    assert set(first) == {"input_ids", "attention_mask", "position_ids", "use_cache"}
    assert torch.equal(first["input_ids"], ids)
    assert torch.equal(first["attention_mask"], mask)
    assert torch.equal(first["position_ids"], reference_positions(mask))
    assert first["use_cache"] is True
    with torch.no_grad():
        out = model(**first)
    state.advance(torch.tensor([[7], [9]]), out)  # (batch, 1) works as well as (batch,)
    second = state.model_inputs()
    keyword = cache_keyword()
    assert set(second) == {"input_ids", "attention_mask", "position_ids", "use_cache", keyword}
    assert torch.equal(second["input_ids"], torch.tensor([[7], [9]]))
    assert second["attention_mask"].shape == (2, 5)
    assert torch.equal(second["position_ids"], torch.tensor([[4], [2]]))
    assert second[keyword] is state.cache
    assert torch.equal(state.sequences, torch.cat([ids, torch.tensor([[7], [9]])], -1))
    assert repr(state) == "DecodeState(batch=2, tokens=5, cached=4)"


def test_cache_keyword_is_what_the_release_prefers():
    from transformers import GPTNeoForCausalLM
    import inspect

    parameters = inspect.signature(GPTNeoForCausalLM.forward).parameters
    state = DecodeState(torch.tensor([[1, 2]]))
    state._cache = object()  # any cache: only the keyword matters here
    (keyword,) = set(state.model_inputs()) - {"input_ids", "attention_mask", "position_ids", "use_cache"}
    assert keyword in parameters
    assert keyword == ("cache" if "cache" in parameters else "past_key_values")


@pytest.mark.parametrize("cache_format", ["output", "legacy"])
def test_no_deprecation_warning(net, cache_format):
    """Warnings as errors, and nothing deprecated logged by transformers (cache keyword, tuple caches)."""
    from transformers.utils import logging as hf_logging

    warning_once = getattr(logging.Logger, "warning_once", None)
    if hasattr(warning_once, "cache_clear"):
        warning_once.cache_clear()  # transformers logs each deprecation once per process
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = hf_logging.get_logger("transformers")
    logger.addHandler(handler)
    try:
        ids, mask = left_padded_batch([5, 3])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            state, _ = greedy_loop(net, ids, mask, steps=3, cache_format=cache_format)
    finally:
        logger.removeHandler(handler)
    messages = [record.getMessage() for record in records]
    assert not [m for m in messages if "deprecat" in m.lower() or "tuple" in m.lower()], messages
    assert torch.equal(state.sequences, reference_greedy(net, ids, mask, 3))


def test_the_cache_is_handed_on_not_copied(model):
    ids, mask = left_padded_batch([4, 2])
    state = DecodeState(ids, mask)
    with torch.no_grad():
        for _ in range(3):
            out = model(**state.model_inputs())
            state.advance(out.logits[:, -1].argmax(-1), out)
            if state.cache is not output_cache(out):  # only a prefill's tuple, converted once to a Cache object
                assert isinstance(output_cache(out), tuple) and state.sequences.shape[1] == 5
    assert state.cache is output_cache(out)


def test_decode_steps_read_nothing_back_from_the_device(model):
    """model_inputs() and advance() (with finished rows) never synchronise; only the prompt's mask is read once."""
    ids, mask = left_padded_batch([5, 3])
    with HostReads() as start:
        state = DecodeState(ids, mask)
    assert len(start.by_neofix) == 1, start.by_neofix  # the 0/1 check of the prompt's mask
    with torch.no_grad():
        out = model(**state.model_inputs())
        with simulated_accelerator(), HostReads() as steps:  # position reports take the accelerator's path
            for step in range(3):
                state.advance(out.logits[:, -1].argmax(-1), out, finished=torch.tensor([False, step > 0]))
                inputs = state.model_inputs()
                out = model(**inputs)
    assert steps.by_neofix == []  # neither the state nor the patched forwards


# -- finished rows ---------------------------------------------------------------------------------------------------
#
# The correct reference for a finished row: its tokens up to the step it finished are the full-recompute greedy
# tokens (rows of a batch are independent), the tokens appended after it are masked out (mask 0), and every later
# cached forward equals a full recompute over the same sequences with the same mask, positions derived from it: the
# masked tokens are invisible to every later token and do not move the row's position.  Other rows are unaffected.


def test_finished_rows(net, mode):
    ids, mask = left_padded_batch([6, 3, 5, 4])
    finish_at = [STEPS, 2, 5, 0]  # row 0 never finishes, row 3 finishes at once
    state, logits = greedy_loop(net, ids, mask, finish_at=finish_at)
    expected = reference_greedy(net, ids, mask, STEPS)
    prompt = ids.shape[1]
    for row, at in enumerate(finish_at):
        assert torch.equal(state.sequences[row, : prompt + at], expected[row, : prompt + at]), row
        assert (state.sequences[row, prompt + at :] == PAD).all()
        assert (state.attention_mask[row, prompt + at :] == 0).all()
        assert (state.attention_mask[row, prompt : prompt + at] == 1).all()
    # every cached step equals the full recompute over the same sequences and mask, finished rows included
    full = reference_logits(net, state.sequences, state.attention_mask)[:, prompt - 1 :]
    torch.testing.assert_close(logits, full, **TOLERANCE)
    # and that reference does see the masking: unmasked, the finished rows would have other logits
    unmasked = reference_logits(net, state.sequences, torch.ones_like(state.attention_mask))[:, prompt - 1 :]
    assert (unmasked[1, 3:] - full[1, 3:]).abs().max() > 1
    torch.testing.assert_close(unmasked[0], full[0], **TOLERANCE)


def test_finished_row_position_does_not_advance(model):
    ids, mask = left_padded_batch([4, 2])
    state = DecodeState(ids, mask)
    positions = []
    with torch.no_grad():
        out = model(**state.model_inputs())
        for _ in range(3):
            state.advance(torch.tensor([5, PAD]), out, finished=torch.tensor([False, True]))
            inputs = state.model_inputs()
            positions.append(inputs["position_ids"][:, 0].tolist())
            out = model(**inputs)
    assert positions == [[4, 1], [5, 1], [6, 1]]


def test_all_rows_unfinished_is_the_same_as_no_finished(model):
    ids, mask = left_padded_batch([6, 3])
    plain, _ = greedy_loop(model, ids, mask, steps=4)
    marked, _ = greedy_loop(model, ids, mask, steps=4, finish_at=[99, 99])
    assert torch.equal(plain.sequences, marked.sequences)
    assert torch.equal(plain.attention_mask, marked.attention_mask)


# -- reorder (beam-style loops) --------------------------------------------------------------------------------------

BEAMS = [[2, 0, 0], [1, 1, 2], [0, 2, 1], [2, 2, 2], [0, 1, 2], [1, 0, 0]]


@torch.no_grad()
def beam_style_loop(model, ids, mask, cache_format, when):
    """Each step the rows are reselected by BEAMS[step]; a new row's token is the greedy token of its source row.

    when="between": reorder between the forward and advance (beam search).  "after": after advance, with the
    tokens chosen for the source rows.
    """
    state = DecodeState(ids, mask)
    out = model(**state.model_inputs())
    cached = [out.logits[:, -1]]
    for beam in BEAMS:
        index = torch.tensor(beam)
        greedy = out.logits[:, -1].argmax(-1)
        if when == "between":
            state.reorder(index)
            state.advance(greedy[index], hand_back(out, cache_format))
        else:
            state.advance(greedy, hand_back(out, cache_format))
            state.reorder(index)
        out = model(**state.model_inputs())
        cached.append(out.logits[:, -1])
    return state, torch.stack(cached, 1)


@pytest.mark.parametrize("when", ["between", "after"])
@pytest.mark.parametrize("cache_format", FORMATS)
def test_beam_style_reorder(net, cache_format, when):
    ids, mask = left_padded_batch([6, 3, 5])
    state, cached = beam_style_loop(net, ids, mask, cache_format, when)
    prompt = ids.shape[1]
    full = reference_logits(net, state.sequences, state.attention_mask)
    # every generated token is the full-recompute greedy token of its own row's prefix ...
    assert torch.equal(full[:, prompt - 1 : -1].argmax(-1), state.sequences[:, prompt:])
    # ... and the last cached forward saw exactly that row's history
    torch.testing.assert_close(cached[:, -1], full[:, -1], **TOLERANCE)
    # the rows really were reselected: row 0's history follows the beams back
    source = 0
    for beam in reversed(BEAMS):
        source = beam[source]
    assert torch.equal(state.sequences[0, :prompt], ids[source])


#: Row permutations none of which is its own square: a reorder applied twice reads other rows than applied once.
PERMUTATIONS = [[1, 2, 0], [2, 0, 1], [0, 2, 1], [1, 2, 0], [1, 0, 2]]



@pytest.mark.parametrize(
    "cache_format, taken",
    [
        ("output", "before reorder"),
        ("cache", "before reorder"),
        ("legacy", "before reorder"),
        pytest.param("object", "before reorder", marks=requires("Cache objects")),
        ("output", "after reorder"),
        ("cache", "after reorder"),
        # on 4.45 and later the forward grows the held Cache object in place and reorder() reorders that object: a
        # tuple made from it after reorder() holds its reordered tensors, and must not be reordered again
        ("legacy", "after reorder"),
    ],
)
def test_a_reorder_between_forward_and_advance_is_applied_once(net, cache_format, taken):
    """Rows are permuted, never merged, so every row keeps a history of its own: the reorder reaches the cache once,
    whether the forward returned a new cache (tuples) or grew the held Cache object in place (which reorder() has
    reordered already), and whether the loop takes the cache from the output before or after reorder()."""
    ids, mask = left_padded_batch([6, 3, 5])
    state = DecodeState(ids, mask)
    source = torch.arange(3)
    with torch.no_grad():
        out = net(**state.model_inputs())
        for permutation in PERMUTATIONS:
            index = torch.tensor(permutation)
            assert not torch.equal(index[index], index)
            tokens = out.logits[:, -1].argmax(-1)
            handed = hand_back(out, cache_format) if taken == "before reorder" else None
            state.reorder(index)
            state.advance(tokens[index], handed if handed is not None else hand_back(out, cache_format))
            source = source[index]
            out = net(**state.model_inputs())
            # this step's cached logits: every row's own history, as the full recompute of the rows as they are now
            full = reference_logits(net, state.sequences, state.attention_mask)
            torch.testing.assert_close(out.logits[:, -1], full[:, -1], **TOLERANCE)
    prompt = ids.shape[1]
    assert torch.equal(state.sequences[:, :prompt], ids[source])  # the rows moved as told
    assert torch.equal(full[:, prompt - 1 : -1].argmax(-1), state.sequences[:, prompt:])


@pytest.mark.parametrize("cache_format", FORMATS)
def test_reorder_can_drop_rows(model, cache_format):
    ids, mask = left_padded_batch([6, 3, 5])
    state = DecodeState(ids, mask)
    with torch.no_grad():
        out = model(**state.model_inputs())
        state.advance(out.logits[:, -1].argmax(-1), hand_back(out, cache_format))
        state.reorder(torch.tensor([2, 0]))  # drop row 1 (finished, say)
        for _ in range(4):
            out = model(**state.model_inputs())
            state.advance(out.logits[:, -1].argmax(-1), hand_back(out, cache_format))
    expected = reference_greedy(model, ids, mask, 5)[[2, 0]]
    assert torch.equal(state.sequences, expected)
    state.check()


def test_reorder_before_the_first_forward(model):
    ids, mask = left_padded_batch([6, 3])
    state = DecodeState(ids, mask)
    state.reorder(torch.tensor([1, 0, 1]))
    state, _ = greedy_loop(model, state.sequences, state.attention_mask, steps=4)
    assert torch.equal(state.sequences, reference_greedy(model, ids[[1, 0, 1]], mask[[1, 0, 1]], 4))


# -- check -----------------------------------------------------------------------------------------------------------


def prefilled(model, lengths=(4, 2)):
    ids, mask = left_padded_batch(list(lengths))
    state = DecodeState(ids, mask)
    with torch.no_grad():
        out = model(**state.model_inputs())
    return state, out


def test_check_accepts_the_state_and_its_own_cache(model):
    state, out = prefilled(model)
    state.check()  # nothing cached yet
    state.advance(out.logits[:, -1].argmax(-1), out)
    state.check()
    state.check(state.cache)


def test_check_rejects_a_cache_of_another_length(model):
    state, out = prefilled(model)
    state.advance(out.logits[:, -1].argmax(-1), out)
    with torch.no_grad():
        longer = output_cache(model(**state.model_inputs()))
    longer = legacy(longer) if not isinstance(longer, tuple) else longer
    with pytest.raises(neofix.CacheLengthError) as raised:
        state.check(longer)
    assert str(raised.value) == (  # model_inputs() was handed out since advance(): the hint says so
        "DecodeState.check: the cache holds 5 tokens, but the state expected 4: it must hold every token but the "
        "ones model_inputs() feeds next (a forward already ran on this state? then pass its output to advance() "
        "first). Was the output of another step, model or state passed?"
    )
    advanced, out = prefilled(model)  # right after advance(): no forward is pending, so no word of advance()
    advanced.advance(out.logits[:, -1].argmax(-1), out)
    with pytest.raises(neofix.CacheLengthError) as raised:
        advanced.check(longer)
    assert str(raised.value) == (
        "DecodeState.check: the cache holds 5 tokens, but the state expected 4: it must hold every token but the "
        "ones model_inputs() feeds next. Was the output of another step, model or state passed?"
    )
    fresh = DecodeState(*left_padded_batch([4, 2]))  # no forward yet: expects no cache, and says nothing of advance()
    with pytest.raises(neofix.CacheLengthError) as raised:
        fresh.check(longer)
    assert str(raised.value) == (
        "DecodeState.check: the cache holds 5 tokens, but the state expected 0: it must hold every token but the "
        "ones model_inputs() feeds next. Was the output of another step, model or state passed?"
    )
    with pytest.raises(TypeError, match=r"^DecodeState.check: expected the model output or its cache .* got str$"):
        state.check("a cache")


def test_check_between_a_forward_and_advance(model):
    """A Cache object grows in place during the forward: check() then says to call advance() first."""
    state, out = prefilled(model)
    state.advance(out.logits[:, -1].argmax(-1), out)
    with torch.no_grad():
        out = model(**state.model_inputs())
    if isinstance(state.cache, tuple):  # transformers < 4.45: the model returned a new tuple, the held one is intact
        state.check()
    else:
        with pytest.raises(neofix.CacheLengthError) as raised:
            state.check()
        assert str(raised.value) == (
            "DecodeState.check: the cache holds 5 tokens, but the state expected 4: it must hold every token but the "
            "ones model_inputs() feeds next (a forward already ran on this state? then pass its output to advance() "
            "first). Was the output of another step, model or state passed?"
        )
    state.advance(out.logits[:, -1].argmax(-1), out)
    state.check()


def test_inputs_asked_again_after_a_forward_without_advance_are_refused(model):
    """A loop that forgets ``advance()``: the forward updated the state's cache in place, so the inputs asked for next
    would feed the last token again over a cache that holds it (the patch then warned of a stale mask and positions,
    blaming the loop's mask): refused at ``model_inputs()``, naming the lengths.  Asked again with no forward between,
    the inputs are handed out as before."""
    state, out = prefilled(model)
    state.advance(out.logits[:, -1].argmax(-1), out)
    inputs = state.model_inputs()
    assert state.model_inputs().keys() == inputs.keys()  # no forward ran: asked again, nothing to refuse
    with torch.no_grad():
        out = model(**inputs)
    if isinstance(out.past_key_values, tuple):  # a legacy cache (GPT-Neo before 4.45) is not updated in place
        pytest.skip("this release returns a new tuple cache: the state's own is left as it was")
    with pytest.raises(neofix.CacheLengthError) as raised:
        state.model_inputs()
    assert str(raised.value) == (
        "DecodeState.model_inputs: the cache holds 5 tokens, but the state expected 4: a forward already ran on the "
        "inputs handed out last and updated the cache; pass its output to advance() before asking for the next inputs"
    )
    state.advance(out.logits[:, -1].argmax(-1), out)  # the loop goes on as it should
    state.check()


def test_check_rejects_a_cache_of_another_batch(model):
    state, out = prefilled(model)
    state.advance(out.logits[:, -1].argmax(-1), out)
    other, other_out = prefilled(model, (4, 2, 3))
    with pytest.raises(neofix.BatchMismatchError, match="the cache holds 3 rows, but the state holds 2"):
        state.check(other_out)
    one, one_out = prefilled(model, (4,))
    with pytest.raises(neofix.BatchMismatchError, match="the cache holds 1 row, but the state holds 2: reorder"):
        state.check(one_out)


def test_a_legacy_cache_of_stacked_layers_is_named_and_taken_as_pairs(model):
    """PEFT's prefix tuning stacks each layer's key and value in one tensor, (2, batch, heads, tokens, head_dim): the
    state names that format, as a tuple or a list (not read as GPT-BigCode's fused layers, keys and values side by side
    in one tensor whose first dimension is the rows), and decodes from its pairs as from the model's own cache."""
    state, out = prefilled(model, (4, 2, 3))
    twin, twin_out = prefilled(model, (4, 2, 3))
    token = out.logits[:, -1].argmax(-1)
    pairs = output_cache(out)
    pairs = legacy(pairs) if not isinstance(pairs, tuple) else pairs
    stacked = tuple(torch.stack(tuple(layer[:2])) for layer in pairs)
    for given in (stacked, list(stacked)):
        with pytest.raises(TypeError) as raised:
            state.check(given)
        assert str(raised.value) == (
            "DecodeState.check: got a legacy cache whose layers each stack key and value in one tensor (PEFT's prefix "
            "tuning); pass it as one (key, value) pair per layer: tuple(tuple(layer) for layer in cache)"
        )
    state.advance(token, tuple(tuple(layer) for layer in stacked))
    twin.advance(token, twin_out)
    with torch.no_grad():
        logits = model(**state.model_inputs()).logits
        expected = model(**twin.model_inputs()).logits
    torch.testing.assert_close(logits, expected)


# -- bad input: each gets a clear error ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ids, mask, error, message",
    [
        ([[1, 2]], None, TypeError, "input_ids must be a torch.Tensor, got list"),
        (torch.ones(1, 3), None, TypeError, "input_ids must hold integer token ids, got dtype torch.float32"),
        (torch.ones(1, 3, dtype=torch.bool), None, TypeError, "input_ids must hold integer token ids, got dtype torch.bool"),
        (torch.tensor([1, 2, 3]), None, neofix.InputShapeError, r"shape \(3,\); expected \(batch, length\) .*\[None\]"),
        (torch.ones(1, 2, 3, dtype=torch.long), None, neofix.InputShapeError, r"shape \(1, 2, 3\); expected \(batch, length\)$"),
        (torch.ones(2, 0, dtype=torch.long), None, neofix.InputShapeError, "at least one row and one token"),
        (torch.ones(0, 3, dtype=torch.long), None, neofix.InputShapeError, r"shape \(0, 3\); the prompt needs at least one row"),
        (torch.ones(2, 3, dtype=torch.long), [[1, 1, 1]], TypeError, "attention_mask must be a torch.Tensor"),
        (torch.ones(2, 4, dtype=torch.long), torch.ones(3, 4), neofix.BatchMismatchError, "attention_mask has 3 rows, but input_ids has 2$"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 4), neofix.MaskLengthError, "4 columns, but input_ids has 3"),
        (torch.ones(2, 3, dtype=torch.long), torch.ones(2, 1, 3), neofix.InputShapeError, "expected a 2D"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[1, 2, 1], [1, 1, 1]]), neofix.NeofixError, r"\[0, 1\] is 2"),
        (torch.ones(2, 3, dtype=torch.long), torch.tensor([[0, 1, 2], [1, 1, 1]]), neofix.NeofixError, r"\[0, 2\] is 2"),
    ],
)
def test_bad_prompt(ids, mask, error, message):
    with pytest.raises(error, match=message) as raised:
        DecodeState(ids, mask)
    assert str(raised.value).startswith("DecodeState: ")  # every message names where it comes from


@pytest.mark.parametrize(
    "tokens, finished, error, message",
    [
        ([1, 2], None, TypeError, "tokens must be a torch.Tensor, got list"),
        (torch.tensor([1.0, 2.0]), None, TypeError, "tokens must hold integer token ids"),
        (torch.tensor([[1, 2], [3, 4]]), None, neofix.InputShapeError, r"shape \(2, 2\); expected \(2,\) or \(2, 1\)"),
        (torch.tensor(1), None, neofix.InputShapeError, r"shape \(\); expected"),
        (torch.tensor([1, 2, 3]), None, neofix.BatchMismatchError, "tokens has 3 rows, but the state holds 2"),
        (torch.tensor([1, 2]), torch.tensor([0, 1]), TypeError, "finished must be a bool tensor"),
        (torch.tensor([1, 2]), [True, False], TypeError, "finished must be a torch.Tensor"),
        (torch.tensor([1, 2]), torch.tensor([[True, False]]), neofix.InputShapeError, r"finished has shape \(1, 2\)"),
        (torch.tensor([1, 2]), torch.tensor([True]), neofix.BatchMismatchError, "finished has 1 row, but the state holds 2$"),
    ],
)
def test_bad_advance_tokens(model, tokens, finished, error, message):
    state, out = prefilled(model)
    with pytest.raises(error, match=message) as raised:
        state.advance(tokens, out, finished=finished)
    assert str(raised.value).startswith("DecodeState.advance: ")
    state.advance(torch.tensor([1, 2]), out)  # a failed advance leaves the state as it was
    assert state.sequences.shape == (2, 5)


def test_advance_needs_a_cache(model):
    state = DecodeState(*left_padded_batch([4, 2]))
    inputs = {**state.model_inputs(), "use_cache": False, "output_hidden_states": True}
    with torch.no_grad():
        out = model(**inputs)
    with pytest.raises(neofix.NeofixError) as raised:
        state.advance(torch.tensor([1, 2]), out)
    assert str(raised.value) == (
        "DecodeState.advance: the model output carries no cache (its fields: logits, hidden_states): call the "
        "model with use_cache=True, as model(**state.model_inputs()) does"
    )
    from transformers.utils import ModelOutput

    with pytest.raises(neofix.NeofixError, match=r"carries no cache \(its fields: none\)"):
        state.advance(torch.tensor([1, 2]), ModelOutput())


def test_advance_rejects_a_plain_output_tuple(model):
    state = DecodeState(*left_padded_batch([4, 2]))
    with torch.no_grad():
        out = model(**state.model_inputs(), return_dict=False)
    with pytest.raises(TypeError, match=r"plain tuple \(return_dict=False\)"):
        state.advance(torch.tensor([1, 2]), out)


@pytest.mark.parametrize(
    "out, message",
    [
        (None, r"expected the model output or its cache .*, got NoneType$"),
        ("cache", r"expected the model output or its cache .*, got str$"),
        ((), r"got a tuple that is not a cache"),
        ([(1, 2)], r"got a list that is not a cache"),
    ],
)
def test_advance_rejects_what_is_not_a_cache(out, message):
    state = DecodeState(torch.tensor([[1, 2], [3, 4]]))
    with pytest.raises(TypeError, match="^DecodeState.advance: " + message):
        state.advance(torch.tensor([1, 2]), out)


def test_advance_twice_with_the_same_output(model):
    state, out = prefilled(model)
    state.advance(torch.tensor([1, 2]), out)
    with pytest.raises(neofix.CacheLengthError) as raised:
        state.advance(torch.tensor([1, 2]), out)
    assert str(raised.value) == (
        "DecodeState.advance: the cache holds 4 tokens, but the state expected 5: it must hold every token fed so "
        "far. Was the output of another step, model or state passed?"
    )


def test_advance_with_another_batch(model):
    state, _ = prefilled(model)
    _, other = prefilled(model, (4, 2, 3))
    with pytest.raises(neofix.BatchMismatchError, match="the cache holds 3 rows, but the state holds 2"):
        state.advance(torch.tensor([1, 2]), other)


@pytest.mark.parametrize(
    "index, error, message",
    [
        ([1, 0], TypeError, "beam_idx must be a torch.Tensor"),
        (torch.tensor([1.0, 0.0]), TypeError, "beam_idx must hold integer row indices, got dtype torch.float32$"),
        (torch.tensor([[1, 0]]), neofix.InputShapeError, r"shape \(1, 2\); expected a non-empty 1D"),
        (torch.tensor([], dtype=torch.long), neofix.InputShapeError, r"shape \(0,\)"),
        (torch.tensor([0, 2]), neofix.NeofixError, r"beam_idx\[1\] is 2, but the state holds 2 rows \(valid indices: 0 to 1\)"),
        (torch.tensor([-1, 0]), neofix.NeofixError, r"beam_idx\[0\] is -1"),
    ],
)
def test_bad_reorder(model, index, error, message):
    state, out = prefilled(model)
    state.advance(torch.tensor([1, 2]), out)
    before = state.sequences
    with pytest.raises(error, match=message) as raised:
        state.reorder(index)
    assert str(raised.value).startswith("DecodeState.reorder: ")
    assert state.sequences is before


def test_errors_are_value_errors():
    with pytest.raises(ValueError):
        DecodeState(torch.tensor([1, 2]))


def test_a_reorder_that_drops_rows_between_forward_and_advance(model):
    """The forward's cache still has the old rows: advance() checks it against them, then reorders it."""
    ids, mask = left_padded_batch([6, 3, 5])
    state = DecodeState(ids, mask)
    with torch.no_grad():
        out = model(**state.model_inputs())
        tokens = out.logits[:, -1].argmax(-1)
        state.reorder(torch.tensor([2, 0]))
        state.advance(tokens[[2, 0]], out)
        for _ in range(3):
            out = model(**state.model_inputs())
            state.advance(out.logits[:, -1].argmax(-1), out)
    assert torch.equal(state.sequences, reference_greedy(model, ids, mask, 4)[[2, 0]])
    state.check()


def test_the_state_reads_the_models_own_cache_keyword_and_checks_the_model(model):
    """A model gets its cache under the name its own forward takes (``past_key_values`` or ``cache``: a user's
    wrapper, say), whatever the installed GPT-Neo calls it; what is not a model is refused."""

    class Wrapper(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None):
            raise NotImplementedError

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
            raise NotImplementedError

    common = {"input_ids", "attention_mask", "position_ids", "use_cache"}
    for model, keyword in ((Wrapper(), "past_key_values"), (Renamed(), "cache")):
        state = DecodeState(torch.tensor([[1, 2]]), model=model)
        state._cache = object()  # any cache: only the keyword matters here
        assert set(state.model_inputs()) == common | {keyword}
    with pytest.raises(TypeError, match="^DecodeState: model must be a transformers model, got object$"):
        DecodeState(torch.tensor([[1, 2]]), model=object())


def test_the_mask_is_long_whatever_the_ids_dtype():
    state = DecodeState(torch.tensor([[1, 2, 3]], dtype=torch.int32))
    assert state.attention_mask.dtype == torch.long and state.attention_mask.tolist() == [[1, 1, 1]]
