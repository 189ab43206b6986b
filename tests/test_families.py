"""The step contract for every model family neofix patches, on the installed transformers release.

One set of scenarios, run per family on a tiny random model of it (``neofix.testing.tiny_model``, float64, built
from a config): hand-written loops (a stale mask, left padding without positions, stale positions, a sequence past
the position table, a token id past the vocabulary, a mask of another batch, a mask longer than cache plus input),
``generate`` parity with vanilla (greedy, beam, sampling, assisted, prompt lookup) and with the full-recompute
reference, and what must never break (training, a classification head, torch.jit, torch.compile, torch.export).

Families differ in what positions mean (``POSITIONS`` of their adapter, see ``neofix._core.Policy``): learned
absolute positions (GPT-Neo, GPT-2) are derived and repaired; OPT derives them from the mask itself; rotary positions
(GPT-J, CodeGen, GPT-NeoX) only need to be consistent, so left padding is harmless and stale positions are an error
(which positions the cache was built with cannot be told); ALiBi (BLOOM) takes none.  And in whether a sequence past
the position table is an error (it is not where the model extrapolates: GPT-NeoX from 4.45, BLOOM).
"""

from __future__ import annotations

import importlib
import inspect
import sys
import os
import warnings

import pytest
import torch
import transformers

import neofix
from neofix._families import FAMILIES
from neofix.testing import (
    FAMILY_CONFIGS,
    _takes_positions,
    reference_greedy,
    reference_positions,
    tiny_config,
    tiny_model,
)

from ._sync import HostReads, read_values_on, simulated_accelerator
from ._versions import TF_RELEASE, cache_keyword, legacy, output_cache, requires
from .loops import decode, left_padded_batch, patched_and_vanilla

STEPS = 5


def _names():
    """The families with a tiny model, limited by ``NEOFIX_TEST_FAMILIES`` (comma-separated names, or "all"; tox.ini
    sets it per release: see there what runs where)."""
    chosen = os.environ.get("NEOFIX_TEST_FAMILIES", "all").strip()
    names = [name for name in FAMILIES if name in FAMILY_CONFIGS]
    if chosen and chosen != "all":
        wanted = {name.strip() for name in chosen.split(",")}
        unknown = wanted - set(FAMILIES)
        assert not unknown, f"NEOFIX_TEST_FAMILIES names unknown families: {sorted(unknown)}"
        names = [name for name in names if name in wanted]
    return names


NAMES = _names()


def available(name):
    config_class = FAMILY_CONFIGS[name][0]
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    if not FAMILIES[name].patched_here():
        pytest.skip(f"transformers {transformers.__version__}: {FAMILIES[name].targets[0].why}")


@pytest.fixture(scope="module", params=NAMES)
def family(request):
    available(request.param)
    if request.param in ("gemma2", "gemma3") and TF_RELEASE < (4, 53):
        # these scenarios decode by hand on the model's own cache and generate left-padded batches, which Gemma2's and
        # Gemma3's HybridCache cannot do there (vanilla neither): tests/_modern_family.py asserts neofix's errors
        pytest.skip(f"transformers {transformers.__version__}: {request.param}'s own HybridCache holds the prompt only")
    return request.param


@pytest.fixture(scope="module")
def adapter(family):
    importlib.import_module(FAMILIES[family].module)  # the import hook patches it
    return FAMILIES[family].load_adapter()


@pytest.fixture(scope="module")
def lm(family):
    return tiny_model(family, seed=0, dtype=torch.float64)


@pytest.fixture(scope="module")
def lm32(family):
    """float32, for vanilla runs and the tracing paths."""
    return tiny_model(family, seed=0, dtype=torch.float32)


def reference(model, ids, mask, steps=STEPS):
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1] :]


def said(caught):
    return [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]


def run(call):
    """``call()`` with every warning recorded: (result or exception, NeofixWarning messages)."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the outcome is asserted
            result = exc
    return result, said(caught)


def table_size(model):
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        size = getattr(config, name, None)
        if isinstance(size, int):
            return size
    return None


# -- hand-written loops ---------------------------------------------------------------------------------------------


def test_the_family_is_patched(family, lm):
    base = getattr(importlib.import_module(FAMILIES[family].module), FAMILIES[family].base_model)
    assert getattr(base.forward, "__neofix_wrapper__", False), f"{FAMILIES[family].base_model}.forward is not patched"


def test_synced_left_padded_loop(lm):
    ids, mask = left_padded_batch([6, 3, 5])
    tokens, _ = run(lambda: decode(lm, ids, mask, STEPS))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))


def test_positions_given_to_the_prompt_alone_give_the_reference(lm):
    """A left-padded loop that gives its prompt the mask's positions (as generate gives them) and its decode steps
    none: the reference's tokens, nothing said, on every family.  Vanilla's are wrong on the rotary families: given
    none, a new token takes its column, which counts the pads its prompt's positions did not.  neofix read the
    prompt's positions, so it knows its cache holds the mask's, and derives the mask's for the steps."""
    ids, mask = left_padded_batch([6, 3, 5])
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, positions="prompt"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert messages == []


@pytest.mark.parametrize("lengths", [[6, 3, 5], [6, 6, 6]], ids=["left-padded", "unpadded"])
def test_positions_offset_from_the_masks_run_as_vanilla_on_a_rotary_family(lm, adapter, lengths):
    """Positions one past the mask's at every step (a loop counting from 1, as ``mask.cumsum(-1)`` does): consistent,
    so on a rotary family, where only differences matter, vanilla decodes the reference's tokens.  neofix reads the
    prompt's positions, which are neither scheme's (the caller's own), and leaves every step's as given: vanilla's
    tokens, nothing said.  (It "repaired" them to the mask's before: wrong tokens.)"""
    if not adapter.positions.rotary or not _takes_positions(lm):
        pytest.skip(f"{type(lm).__name__}: positions are {adapter.positions.value} (only differences matter: rotary)")
    ids, mask = left_padded_batch(lengths)
    (tokens, messages), (plain, _) = patched_and_vanilla(
        lambda: run(lambda: decode(lm, ids, mask, STEPS, positions="offset"))
    )
    if isinstance(plain, Exception):  # vanilla cannot run them (4.36 - 4.44 index a rotary table as long as the
        # sequence by them; a float64 mask that overflows): neofix runs them right or not at all
        assert isinstance(tokens, Exception) or torch.equal(tokens, reference(lm, ids, mask)), tokens
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, plain)
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert messages == []


def test_positions_offset_from_the_columns_without_a_mask_run_as_vanilla_on_a_rotary_family(lm, adapter):
    """No attention mask at all, positions one past the columns at every step (consistent): vanilla decodes the
    reference's tokens, and so does neofix, which reads the prompt's offset and continues it (it "repaired" them to
    the columns once it read the offset: wrong tokens)."""
    if not adapter.positions.rotary or not _takes_positions(lm):
        pytest.skip(f"{type(lm).__name__}: positions are {adapter.positions.value} (only differences matter: rotary)")
    ids, mask = left_padded_batch([6, 6, 6])
    (tokens, messages), (plain, _) = patched_and_vanilla(
        lambda: run(lambda: decode(lm, ids, mask, STEPS, positions="offset", pass_mask=False))
    )
    if isinstance(plain, Exception):  # (4.36 - 4.44: a rotary table as long as the sequence, indexed by them)
        assert isinstance(tokens, Exception) or torch.equal(tokens, reference(lm, ids, mask)), tokens
        return
    assert torch.equal(tokens, plain)
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert messages == []


@pytest.mark.parametrize("positions", ["offset-prompt", "offset-frozen"])
@pytest.mark.parametrize("lengths", [[6, 3, 5], [6, 6, 6]], ids=["left-padded", "unpadded"])
def test_steps_after_a_prompt_given_an_offset_continue_it_on_a_rotary_family(lm, adapter, lengths, positions):
    """A prompt given the mask's positions plus one (on every real token of every row), then steps given none, or
    the prompt's last position again at every step (a loop that does not increment): the cache holds the offset
    positions, so the steps must continue them.  neofix derives the missing ones, and repairs the frozen ones (said
    once), as the mask's plus one: the reference's tokens (rotary: only differences matter).  Vanilla's drop the
    offset (transformers' own) or do not advance: wrong tokens, but where the rows decode an end token at once."""
    if not adapter.positions.rotary or not _takes_positions(lm):
        pytest.skip(f"{type(lm).__name__}: positions are {adapter.positions.value} (only differences matter: rotary)")
    ids, mask = left_padded_batch(lengths)
    (tokens, messages), (plain, _) = patched_and_vanilla(
        lambda: run(lambda: decode(lm, ids, mask, STEPS, positions=positions))
    )
    if isinstance(plain, Exception):  # vanilla cannot run the prompt's (4.36 - 4.44 index a rotary table as long as
        # the sequence by them): neofix runs them right or not at all
        assert isinstance(tokens, Exception) or torch.equal(tokens, reference(lm, ids, mask)), tokens
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    if positions == "offset-frozen":
        assert len(messages) == 1 and "count of real tokens before it plus the same number" in messages[0], messages
    else:
        assert messages == []


@pytest.mark.parametrize("reader", ["host", "device"])
@pytest.mark.parametrize("positions", ["offset", "offset-prompt"])
def test_a_float_mask_after_an_offset_prompt_decodes_as_a_long_one_on_a_rotary_family(
    lm, adapter, positions, reader, monkeypatch
):
    """A float attention mask (0. and 1.) and a prompt given the mask's positions plus one, then steps given them
    (consistent) or none: the offset read off the float mask is an int, as off a long one (it was a float: the steps
    failed inside neofix with a TypeError, or fed the model float positions); the reference's tokens, read on the
    host or by the device reader."""
    if not adapter.positions.rotary or not _takes_positions(lm):
        pytest.skip(f"{type(lm).__name__}: positions are {adapter.positions.value} (only differences matter: rotary)")
    ids, mask = left_padded_batch([6, 3])
    read_values_on(monkeypatch, reader == "host")
    tokens, _ = run(lambda: decode(lm, ids, mask.float(), STEPS, positions=positions))
    usual, _ = run(lambda: decode(lm, ids, mask, STEPS, positions=positions))
    if isinstance(usual, Exception):  # 4.36 - 4.44 index a rotary table as long as the sequence by the prompt's
        assert type(tokens) is type(usual) and str(tokens) == str(usual), tokens  # positions: vanilla's IndexError
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))


@pytest.mark.parametrize("reader", ["host", "device"])
@pytest.mark.parametrize("positions", ["offset", "offset-prompt", "offset-frozen"])
def test_steps_after_a_prompt_given_an_offset_continue_it_on_a_family_with_a_position_table(
    lm32, adapter, positions, reader, monkeypatch
):
    """A prompt given the mask's positions plus one (a loop counting from 1) on a family whose positions index a table
    (GPT-Neo, GPT-2, OPT): its real tokens look those up (left as given: a scheme of the caller's), so its cache must
    be continued with them.  Steps given the mask's plus one are left as given (they were "repaired" to the mask's,
    which mixed the two: neither vanilla's tokens nor the reference's); steps given none get the mask's plus one;
    steps given the prompt's last again at every step are repaired to them, said once.  Each decodes what vanilla
    decodes given the mask's plus one at every step, consistently (the prompt's values read on the host, or by the
    device reader)."""
    if not adapter.positions.compared or not _takes_positions(lm32):
        pytest.skip(f"{type(lm32).__name__}: positions are {adapter.positions.value}, or not taken")
    ids, mask = left_padded_batch([6, 3])
    with neofix.unpatched():
        expected, _ = run(lambda: decode(lm32, ids, mask, STEPS, positions="offset"))
    read_values_on(monkeypatch, reader == "host")
    tokens, messages = run(lambda: decode(lm32, ids, mask, STEPS, positions=positions))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    if positions == "offset-frozen":
        assert len(messages) == 1 and "count of real tokens before it plus the same number" in messages[0], messages
        neofix.configure(mode="strict")
        refused, _ = run(lambda: decode(lm32, ids, mask, STEPS, positions=positions))
        assert isinstance(refused, neofix.PositionError), refused
    else:
        assert messages == []


@requires("generate slices given positions")
def test_generate_given_positions_offset_from_the_masks_continues_them_on_a_family_with_a_position_table(
    lm32, adapter, monkeypatch
):
    """``generate(position_ids=...)`` with the mask's positions plus one, on a family whose positions index a table:
    the steps continue them (from 5.2 generate advances them itself, and vanilla's tokens are those; on 4.46 - 5.0 it
    passes the prompt's last one again at every step, and neofix repairs them to the mask's plus one): the tokens of a
    loop given the mask's plus one at every step, vanilla's."""
    if not adapter.positions.compared or not _takes_positions(lm32):
        pytest.skip(f"{type(lm32).__name__}: positions are {adapter.positions.value}, or not taken")
    monkeypatch.setattr(lm32.generation_config, "eos_token_id", None)  # every row runs STEPS tokens, as the loop
    ids, mask = left_padded_batch([6, 3])
    with neofix.unpatched():
        expected, _ = run(lambda: decode(lm32, ids, mask, STEPS, positions="offset"))
    given = reference_positions(mask) + 1
    tokens, _ = run(lambda: generate(lm32, ids, mask, position_ids=given, do_sample=False))
    assert isinstance(tokens, torch.Tensor), tokens
    if adapter.family.name == "gpt_bigcode" and TF_RELEASE < (4, 54):
        # its own prepare_inputs_for_generation drops position_ids given with a mask, and its forward derives the
        # mask's: vanilla decodes the reference's tokens (no offset anywhere), and neofix leaves that as it is
        with neofix.unpatched():
            plain, _ = run(lambda: generate(lm32, ids, mask, position_ids=given, do_sample=False))
        assert torch.equal(tokens, plain)
        assert torch.equal(tokens[:, ids.shape[1]:], reference(lm32, ids, mask))
        return
    assert torch.equal(tokens[:, ids.shape[1]:], expected)


@requires("generate slices given positions")
def test_generate_given_positions_offset_from_the_masks_gives_the_reference_on_a_rotary_family(lm, adapter):
    """``generate(position_ids=...)`` with the mask's positions plus 5: on 4.46 - 5.0 transformers passes the prompt's
    last one again at every step (wrong tokens); neofix, which read the prompt's offset, repairs them to the mask's
    plus 5: the full-recompute reference's tokens, with those positions (up to a row's first end token, which the
    reference does not stop at).  From 5.2, vanilla's, which advance them."""
    if not adapter.positions.rotary or not _takes_positions(lm):
        pytest.skip(f"{type(lm).__name__}: positions are {adapter.positions.value} (only differences matter: rotary)")
    ids, mask = left_padded_batch([6, 3, 5])
    given = reference_positions(mask) + 5

    def call():
        return generate(lm, ids, mask, position_ids=given, do_sample=False, min_new_tokens=STEPS)

    (tokens, _), (plain, _) = patched_and_vanilla(lambda: run(call))
    assert isinstance(tokens, torch.Tensor), tokens
    for got, expected in zip(tokens[:, ids.shape[1]:].tolist(), reference(lm, ids, mask).tolist()):
        ended = expected.index(0) if 0 in expected else STEPS
        assert got[:ended] == expected[:ended]
    if TF_RELEASE >= (5, 2):
        assert torch.equal(tokens, plain)


@requires("generate returns its cache")
def test_a_hand_loop_continues_generates_cache_by_the_masks_positions(lm):
    """``generate`` gives a left-padded prompt the mask's positions; a hand loop continuing from the cache it returns,
    given no positions, continues the mask's: the full-recompute reference's tokens on every family (vanilla's are
    wrong on the rotary ones, whose own positions count the pads).  On 4.42 - 4.48 generate returns its cache as a
    legacy tuple of the cache object's own tensors: the cache is followed by its first key."""
    ids, mask = left_padded_batch([6, 3, 5])
    first = 3

    def loop():
        out = lm.generate(
            ids, attention_mask=mask, max_new_tokens=first, min_new_tokens=first, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True, use_cache=True,
        )
        cache, new, full = out.past_key_values, out.sequences[:, -1:], torch.cat([mask, torch.ones(3, first)], -1)
        generated = []
        for _ in range(STEPS):
            step = lm(input_ids=new, attention_mask=full.long(), use_cache=True, **{cache_keyword(lm): cache})
            cache, new = output_cache(step), step.logits[:, -1:].argmax(-1)
            generated.append(new)
            full = torch.cat([full, torch.ones(3, 1)], -1)
        return out.sequences, torch.cat(generated, -1)

    (outcome, messages), (plain, _) = patched_and_vanilla(lambda: run(loop))
    if isinstance(outcome, Exception):  # where vanilla cannot run the model at all (4.42's GPT-NeoX: a float64 mask
        assert repr(outcome) == repr(plain)  # that overflows), neofix fails alike
        return
    sequences, tokens = outcome
    full = torch.cat([mask, torch.ones(3, first, dtype=mask.dtype)], -1)
    assert torch.equal(tokens, reference_greedy(lm, sequences, full, STEPS)[:, sequences.shape[1]:])
    assert [said for said in messages if "a legacy tuple cache was passed" not in said] == []  # (4.48's generate
    # returns a legacy tuple, which the releases that reject one get wrapped, said once)


def test_stale_mask_is_extended(lm):
    ids, mask = left_padded_batch([6, 3, 5])
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, mask_mode="stale", positions="correct"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert any("extended it with ones on the right" in m for m in messages), messages


def test_stale_positions(lm, adapter):
    ids, mask = left_padded_batch([6, 3])
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, positions="stale"))
    if adapter.positions.value == "none" or not _takes_positions(lm):  # takes none (the loop passes none)
        assert torch.equal(tokens, reference(lm, ids, mask))
    elif adapter.positions.value == "rotary":  # which positions the cache was built with cannot be told
        assert isinstance(tokens, neofix.PositionError), tokens
        assert "with rotary positions the new tokens must continue the positions the cache was built with" in str(
            tokens
        )
    else:
        assert isinstance(tokens, torch.Tensor), tokens
        assert torch.equal(tokens, reference(lm, ids, mask))
        assert any("derived them from the attention mask instead" in m for m in messages), messages


@pytest.mark.parametrize("lengths", [[6], [6, 3]], ids=["one row", "left-padded"])
def test_a_cache_position_that_does_not_advance_is_repaired(lm, lm32, lengths):
    """A hand loop that passes the prompt's last slot as ``cache_position`` at every step (it forgets to advance it).
    The releases whose models take it (4.36 - 4.57) build the causal mask from it, and without positions the positions
    too, so vanilla's tokens are wrong; neofix replaces it with the new tokens' slots, said once, and the tokens are
    the reference's, on a row without padding (the usual step, which the cheap pass would let through) as well.
    Strict mode refuses it.  Where vanilla's tokens are right all the same (Phi3's head on 4.45 takes it but does not
    pass it on; OPT's one-row sdpa step on 4.57 ignores it), the tokens alone are compared."""
    if "cache_position" not in inspect.signature(type(lm).forward).parameters:
        pytest.skip(f"{type(lm).__name__} takes no cache_position on transformers {transformers.__version__}")
    ids, mask = left_padded_batch(lengths)
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, cache_position="frozen"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    with neofix.unpatched():
        plain, _ = run(lambda: decode(lm32, ids, mask, STEPS, cache_position="frozen"))
    if torch.equal(plain, reference(lm32, ids, mask)):
        return
    assert any(m.startswith(f"neofix: cache_position is [{ids.shape[1] - 1}] at a step after") for m in messages), messages
    neofix.configure(mode="strict")
    refused, _ = run(lambda: decode(lm, ids, mask, STEPS, cache_position="frozen"))
    assert isinstance(refused, neofix.PositionError), refused
    assert str(refused).startswith(f"cache_position is [{ids.shape[1] - 1}] at a step after {ids.shape[1]} cached"), refused


@pytest.mark.parametrize("mask_mode", ["synced", "stale"])
def test_decode_steps_read_no_value_by_default(lm, mask_mode):
    """A default decode step reads no value off the device (on an accelerator, each read waits for the device):
    neither the usual step nor one whose stale mask is extended on the general path, for every family."""
    ids, mask = left_padded_batch([5, 3])
    keyword = cache_keyword(lm)
    full = mask
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
        for _ in range(3):
            full = torch.cat((full, torch.ones(2, 1, dtype=torch.long)), 1)
            step = {"input_ids": out.logits[:, -1:].argmax(-1), "attention_mask": full if mask_mode == "synced" else mask}
            with HostReads() as reads:
                out = lm(**step, use_cache=True, **{keyword: output_cache(out)})
            assert reads.by_neofix == [], reads.by_neofix


def test_given_positions_that_count_the_padding_are_repaired(lm, adapter):
    """Positions that count the left padding (arange over the padded width, the classic batched-generation bug)
    given to a family whose positions index a table (learned, or OPT's from the mask): compared with the mask's at
    every step, repaired, and said; the tokens are the reference's."""
    if not adapter.positions.compared or not _takes_positions(lm):
        pytest.skip(f"{type(lm).__name__} on this release: positions are {adapter.positions.value}, or not taken")
    ids, mask = left_padded_batch([6, 3])
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, positions="arange"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert any("position_ids[1, 0] is 6" in m for m in messages), messages


def test_past_the_position_table(lm, lm32, adapter):
    size = table_size(lm) or 64  # a family without a position table (ALiBi): past the other tiny models' 64
    limit = adapter.limits(lm.config).max_positions
    ids = torch.randint(1, 96, (1, size - 2), generator=torch.Generator().manual_seed(1))
    tokens, _ = run(lambda: decode(lm, ids, torch.ones_like(ids), 4))
    if adapter.explain_overflow is not None:  # the limit counts real tokens (OPT): named when the lookup fails
        assert isinstance(tokens, neofix.SequenceTooLongError), tokens
        assert f"at most {size} real tokens fit in a row" in str(tokens)
    elif limit is None:  # the model extrapolates: no error, and nothing changed (vanilla compared in float32:
        # BLOOM on 4.36 - 4.43 cannot run float64 models unpatched)
        assert isinstance(tokens, torch.Tensor), tokens
        assert torch.equal(tokens, reference(lm, ids, torch.ones_like(ids), 4))
        patched32, _ = run(lambda: decode(lm32, ids, torch.ones_like(ids), 4))
        with neofix.unpatched():
            plain, _ = run(lambda: decode(lm32, ids, torch.ones_like(ids), 4))
        assert isinstance(plain, torch.Tensor), plain
        assert torch.equal(patched32, plain)
    else:
        assert isinstance(tokens, neofix.SequenceTooLongError), tokens
        assert f"is {limit}: 0 more new tokens fit" in str(tokens)


def test_the_longest_row_past_the_table_is_named(lm, adapter):
    """OPT counts real tokens: of a left-padded batch, the row holding more real tokens than the table is named, with
    its count."""
    if adapter.explain_overflow is None:
        pytest.skip("the family's limit counts columns")
    size = table_size(lm)
    ids, mask = left_padded_batch([size - 4, size + 1])
    error, _ = run(lambda: lm(input_ids=ids, attention_mask=mask))
    assert isinstance(error, neofix.SequenceTooLongError), error
    assert str(error) == (
        f"row 1 of this step holds {size + 1} real tokens (the mask's ones, cached and new), but OPT's "
        f"config.max_position_embeddings is {size}: OPT gives every real token a position (left padding takes none), "
        f"so at most {size} real tokens fit in a row; shorten the prompt or generate fewer tokens"
    )
    assert (error.past, error.total, error.max_positions) == (0, size + 1, size)
    assert isinstance(error.__cause__, IndexError)  # the position lookup's own error, kept as the cause


def test_given_positions_past_the_table_are_named(lm, adapter):
    """OPT: position_ids reaching past the table are named, with or without a mask (one of ``size`` real tokens,
    which fit)."""
    if adapter.explain_overflow is None:
        pytest.skip("the family's limit counts columns")
    if not _takes_positions(lm):
        pytest.skip(f"OPT takes no position_ids on transformers {transformers.__version__}")
    size = table_size(lm)
    ids = torch.randint(1, 96, (1, size), generator=torch.Generator().manual_seed(1))
    for mask, positions in (
        (torch.ones_like(ids), torch.arange(1, size + 1)[None]),
        (None, torch.arange(size - 3, size + 7)[None]),
    ):
        fed = ids[:, : positions.shape[1]]
        error, _ = run(lambda: lm(input_ids=fed, attention_mask=mask, position_ids=positions))
        reach = int(positions.max())
        assert isinstance(error, neofix.SequenceTooLongError), error
        assert str(error) == (
            f"position_ids reach {reach}, but OPT's config.max_position_embeddings is {size}: positions must lie in "
            f"[0, {size - 1}]; pass none and OPT derives them from the mask"
        )
        assert (error.past, error.total, error.max_positions) == (0, reach + 1, size)
        assert isinstance(error.__cause__, IndexError)


def test_left_padding_past_the_table_in_columns_runs_as_vanilla(lm, lm32, adapter):
    """OPT gives left padding no positions: a batch wider than the table, whose rows hold few enough real tokens,
    completes in vanilla transformers, so neofix must not refuse it (nor change it).  Compared in float32 (vanilla
    OPT 4.36 - 4.48 cannot run float64 models) and against the float64 reference."""
    if adapter.explain_overflow is None:
        pytest.skip("the family's limit counts columns")
    size = table_size(lm)
    ids, mask = left_padded_batch([size - 4, 8])
    ids = torch.cat([ids.new_ones(2, 6), ids], -1)
    mask = torch.cat([mask.new_zeros(2, 6), mask], -1)  # size + 2 columns, at most size - 4 + 3 real tokens a row
    tokens, _ = run(lambda: decode(lm32, ids, mask, 3))
    assert isinstance(tokens, torch.Tensor), tokens
    with neofix.unpatched():
        plain, _ = run(lambda: decode(lm32, ids, mask, 3))
    assert isinstance(plain, torch.Tensor), plain
    assert torch.equal(tokens, plain)
    assert torch.equal(tokens, reference(lm, ids, mask, 3))


def test_token_id_past_the_vocabulary(lm):
    ids, mask = left_padded_batch([6, 3])
    ids[0, -1] = lm.config.vocab_size
    tokens, _ = run(lambda: decode(lm, ids, mask, STEPS))
    assert isinstance(tokens, neofix.TokenIdError), tokens
    assert f"input_ids[0, 5] is {lm.config.vocab_size}" in str(tokens)


def test_mask_of_another_batch(lm):
    ids, mask = left_padded_batch([6, 3])
    tokens, _ = run(lambda: decode(lm, ids, mask[:1], STEPS))
    assert isinstance(tokens, neofix.BatchMismatchError), tokens


def test_mask_longer_than_cache_and_input(lm):
    ids, mask = left_padded_batch([6, 3])
    key = cache_keyword(lm)

    def step():
        out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
        longer = torch.cat([mask, mask.new_ones(2, 3)], -1)
        return lm(input_ids=ids[:, -1:], attention_mask=longer, use_cache=True, **{key: output_cache(out)})

    out, _ = run(step)
    assert isinstance(out, neofix.MaskLengthError), out
    assert "A longer mask is ambiguous" in str(out)


def test_a_cache_given_as_a_list_gets_vanillas_outcome(lm32):
    """A legacy cache passed as a list, not a tuple: the step ends as it does unpatched (the same logits, or, where
    transformers rejects it, an error of the same type).  Unpadded rows: vanilla's positions are right for them."""
    ids, mask = left_padded_batch([6, 6])
    key = cache_keyword(lm32)
    longer = torch.cat([mask, mask.new_ones(2, 1)], -1)

    def step(model):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            cache = list(legacy(output_cache(out)))
        return run(lambda: model(input_ids=ids[:, -1:], attention_mask=longer, use_cache=True, **{key: cache}))[0]

    patched, plain = both(lm32, step)
    if "sliding_attention" in (getattr(lm32.config, "layer_types", None) or ()) and isinstance(plain, AttributeError):
        # Gemma2/Gemma3 (4.53, 5.x): sliding layers' tuples hold only the window's keys, global layers' every token;
        # vanilla fails on the list ('list' object has no attribute 'get_seq_length'); neofix on the layers' lengths
        # (5.x), or as vanilla (4.53, where the model's own cache conversion fails first)
        assert isinstance(patched, (neofix.CacheLengthError, type(plain))), patched
        return
    assert_same_outcome(*(getattr(outcome, "logits", outcome) for outcome in (patched, plain)))


def test_a_legacy_cache_of_stacked_layers_gets_vanillas_outcome(lm32):
    """PEFT's prefix tuning (peft 0.13) passes a legacy cache each of whose layers is one tensor stacking key and value
    (``(2, batch, heads, tokens, head_dim)``, split from its virtual tokens' table), which transformers only indexes.
    neofix took such a layer's truth value (``RuntimeError: Boolean value of Tensor with more than one value is
    ambiguous``); now the step ends as the same cache given as pairs, and, where the release takes tuples, as it does
    unpatched (the same logits, or an error of the same type).  Unpadded rows: vanilla's positions are right there."""
    ids, mask = left_padded_batch([6, 6])
    key = cache_keyword(lm32)
    longer = torch.cat([mask, mask.new_ones(2, 1)], -1)
    with torch.no_grad():
        pairs = legacy(output_cache(lm32(input_ids=ids, attention_mask=mask, use_cache=True)))
    if isinstance(pairs[0], torch.Tensor):
        pytest.skip(f"transformers {transformers.__version__}: GPT-BigCode's layers are one tensor each, not pairs")
    if pairs[0][0].shape != pairs[0][1].shape:
        pytest.skip(f"transformers {transformers.__version__}: BLOOM's fused keys and values cannot be stacked")
    stacked = tuple(torch.stack(layer[:2]) for layer in pairs)

    def step(cache):
        with torch.no_grad():
            out, _ = run(lambda: lm32(input_ids=ids[:, -1:], attention_mask=longer, use_cache=True, **{key: cache}))
        return getattr(out, "logits", out)

    patched, plain = both(stacked, step)
    as_pairs, plain_pairs = both(pairs, step)
    assert_same_outcome(patched, as_pairs)
    if not isinstance(plain_pairs, Exception):  # (a release that takes no tuple: neofix wraps it, stacked or not)
        assert_same_outcome(patched, plain)


def test_a_bloom_cache_of_other_heads_is_refused_naming_them():
    """BLOOM: the cache of a BLOOM with 2 heads of width 16, passed to one with 4 heads of width 8, is refused before
    the model runs.  Up to 4.43 the cache is fused (keys ``(batch * heads, head_dim, tokens)``, rows the model's head
    count splits): named in that layout, held in a tuple or a list; from 4.44 a legacy tuple of the usual layout."""
    if "bloom" not in NAMES:
        pytest.skip("NEOFIX_TEST_FAMILIES leaves BLOOM out")
    available("bloom")
    model, other = tiny_model("bloom"), tiny_model("bloom", n_head=2)
    ids = torch.ones(2, 4, dtype=torch.long)
    with torch.no_grad():
        cache = legacy(output_cache(other(input_ids=ids, use_cache=True)))
    if sys.modules[FAMILIES["bloom"].adapter].FUSED_CACHE:
        caches, expected = (tuple(cache), list(cache)), (
            "the cache holds keys of shape (4, 16, 4) (batch * heads, head_dim, tokens), but this model has 4 heads "
            "of width 8: its keys are 16 wide. The cache was built by another model: pass the cache this model "
            "returned, or none (the prompt is then encoded again)"
        )
    else:
        caches, expected = (tuple(cache),), (
            "the cache holds keys of 2 heads of width 16, but this model has 4 heads of width 8: the cache was built "
            "by another model. Pass the cache this model returned, or none (the prompt is then encoded again)"
        )
    for given in caches:
        error, _ = run(
            lambda: model(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 5, dtype=torch.long), use_cache=True,
                          **{cache_keyword(model): given})
        )
        assert isinstance(error, neofix.InputShapeError), (type(given), error)
        assert str(error) == expected


#: Per family: the config attributes of its head counts (Llama: its query heads and its key-value heads).
HEADS = {
    "gpt_neo": ("num_heads",), "gpt2": ("n_head",), "gptj": ("n_head",), "codegen": ("n_head",),
    "gpt_neox": ("num_attention_heads",), "opt": ("num_attention_heads",), "bloom": ("n_head",),
    # multi-query attention: the cache holds one key-value head of the head width (8 heads: one of width 4)
    "gpt_bigcode": ("n_head",),
    "falcon": ("num_attention_heads",),  # multi-query too: one key-value head (8 heads: one of width 4)
    **dict.fromkeys(
        ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "phi", "phi3", "granite", "starcoder2", "olmo2", "olmo",
         "cohere"),
        ("num_attention_heads", "num_key_value_heads"),
    ),
    # head_dim set in their tiny configs: 8 heads of width 4 named as such
    **dict.fromkeys(
        ("qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3", "smollm3", "gpt_oss"),
        ("num_attention_heads", "num_key_value_heads", "head_dim"),
    ),
}
#: The head count, or the width of a head_dim (4), of the other model.
OTHER = {"head_dim": 4}


def test_a_decode_step_on_another_models_cache_is_refused(family, adapter, lm32):
    """A well-formed single-token step, with a mask over cache and token or without one, on the cache of a model of
    8 heads of width 4 (this one has 4 of width 8): refused before the model runs, naming both layouts.  The usual
    decode step skips alignment (the fast path), and must not skip this check: vanilla fails inside attention with
    a tensor size mismatch, or, with the cache object a model returns, did so through neofix too."""
    other = tiny_model(family, seed=1, **{name: OTHER.get(name, 8) for name in HEADS[family]})
    ids = torch.ones(2, 4, dtype=torch.long)
    limits = adapter.limits(lm32.config)  # the key-value heads of the cache it writes (4, or Llama's 2 of width 8)
    written = adapter.limits(other.config)  # 8 heads of width 4 (GPT-BigCode's multi-query attention: one of 4)
    expected = (
        f"the cache holds keys of {written.heads} heads of width {written.head_dim}, but this model has {limits.heads} "
        f"heads of width {limits.head_dim}: the cache was built by another model. Pass the cache this model returned, "
        f"or none (the prompt is then encoded again)"
    )
    if family == "bloom" and sys.modules[adapter.family.adapter].FUSED_CACHE:  # keys (batch * heads, head_dim, tokens)
        expected = (
            "the cache holds keys of shape (16, 4, 4) (batch * heads, head_dim, tokens), but this model has 4 heads "
            "of width 8: its keys are 4 wide. The cache was built by another model: pass the cache this model "
            "returned, or none (the prompt is then encoded again)"
        )
    for mask in (torch.ones(2, 5, dtype=torch.long), None):
        with torch.no_grad():
            cache = output_cache(other(input_ids=ids, use_cache=True))
        step = dict(input_ids=ids[:, -1:], use_cache=True, **{cache_keyword(lm32): cache})
        if mask is not None:
            step["attention_mask"] = mask
        error, _ = run(lambda: lm32(**step))
        assert isinstance(error, neofix.InputShapeError), (mask is None, error)
        assert str(error) == expected


# -- generate parity ---------------------------------------------------------------------------------------------------


def generate(model, ids, mask, **kwargs):
    kwargs.setdefault("max_new_tokens", STEPS)
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, pad_token_id=0, **kwargs)


def both(model, call):
    """``call(model)`` patched, then vanilla: ``(patched, vanilla)``."""
    return patched_and_vanilla(lambda: call(model))


@requires("Cache objects")
@pytest.mark.parametrize("lengths", [[6], [6, 3]], ids=["one row", "left-padded"])
@pytest.mark.parametrize("given", ["whole mask", "first turn's mask"])
def test_a_second_turn_continues_the_first_turns_cache(lm32, lengths, given, monkeypatch):
    """Turn 2 of a chat: ``generate`` given turn 1's sequences plus three new tokens and turn 1's cache.  With the
    mask of the whole sequence, the reference's tokens.  Given turn 1's mask instead (not extended: the classic bug,
    a turn later), up to 5.2 generate feeds the tokens after the cache and builds their positions from that mask;
    neofix extends the mask and derives the positions from it (generate's, left as they were, would be wrong on every
    family), so the tokens are the reference's.  From 5.3 generate reads ``input_ids`` as the new tokens alone where
    the mask is not as wide as them, and feeds all of them after the cache: which tokens are new cannot be told, and
    neofix refuses the call, naming the lengths."""
    ids, mask = left_padded_batch(lengths)
    user = torch.randint(3, 90, (len(lengths), 3), generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(lm32.generation_config, "eos_token_id", None)  # every row runs STEPS tokens, as the reference
    greedy = dict(do_sample=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = generate(lm32, ids, mask, return_dict_in_generate=True, **greedy)
    sequences = torch.cat([first.sequences, user], -1)
    whole = torch.cat([mask, mask.new_ones(len(lengths), sequences.shape[1] - mask.shape[1])], -1)
    cache = {cache_keyword(lm32): output_cache(first)}
    given_mask = whole if given == "whole mask" else mask
    second, messages = run(lambda: generate(lm32, sequences, given_mask, **greedy, **cache))
    if given == "first turn's mask" and TF_RELEASE >= (5, 3):
        assert isinstance(second, neofix.MaskLengthError), second
        assert str(second).startswith(
            f"generate was given {sequences.shape[1]} tokens of input_ids, a cache of {sequences.shape[1] - 4} tokens "
            f"and an attention_mask of {mask.shape[1]} columns: as the whole sequence"
        ), second
        with torch.no_grad(), pytest.raises(neofix.MaskLengthError):  # the prompt by generate's own name too
            lm32.generate(inputs=sequences, attention_mask=mask, pad_token_id=0, max_new_tokens=STEPS, **greedy, **cache)
        return
    assert isinstance(second, torch.Tensor), second
    assert torch.equal(second[:, sequences.shape[1]:], reference(lm32, sequences, whole)), messages
    if given == "first turn's mask":  # one cause, said once: generate's positions follow the extended mask unsaid
        assert len(messages) == 1 and "extended it with ones on the right" in messages[0], messages


@requires("Cache objects")
def test_generate_continuing_a_prefix_run_without_positions_gives_the_reference(lm32, monkeypatch):
    """A left-padded prefix run by hand without positions (a rotary family's cache then holds transformers' own, the
    columns), then ``generate`` given the prefix plus three tokens and that cache: generate gives the new tokens the
    mask's positions, which do not continue such a cache (vanilla's tokens are wrong on the padded rows); neofix
    repairs them to the columns, as it does a hand loop's, and the tokens are the reference's on every family."""
    monkeypatch.setattr(lm32.generation_config, "eos_token_id", None)  # every row runs STEPS tokens, as the reference
    ids, mask = left_padded_batch([6, 4, 2])
    whole = torch.cat([ids, torch.randint(3, 90, (3, 3), generator=torch.Generator().manual_seed(2))], -1)
    whole_mask = torch.cat([mask, mask.new_ones(3, 3)], -1)

    def call():
        prefix = lm32(input_ids=ids, attention_mask=mask, use_cache=True)
        return generate(lm32, whole, whole_mask, do_sample=False, **{cache_keyword(lm32): output_cache(prefix)})

    tokens, _ = run(call)
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens[:, whole.shape[1]:], reference(lm32, whole, whole_mask))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(do_sample=False, min_new_tokens=STEPS),
        dict(do_sample=False, num_beams=3),
        dict(do_sample=True, top_k=20, temperature=30.0, seed=7),
    ],
    ids=["greedy", "beam", "sampling"],
)
def test_generate_is_identical_to_vanilla(lm32, kwargs):
    ids, mask = left_padded_batch([6, 3, 5], seed=3)
    kwargs = dict(kwargs)
    seed = kwargs.pop("seed", None)

    def call(model):
        if seed is not None:
            torch.manual_seed(seed)
        return generate(model, ids, mask, **kwargs)

    patched, plain = both(lm32, call)
    assert torch.equal(patched, plain)
    if kwargs.get("num_beams", 1) == 1 and not kwargs.get("do_sample"):
        # min_new_tokens suppresses the end-of-sequence token (0), which the reference does not: each row is compared
        # up to the reference's first one (Qwen3's row 0 generates it at its fourth token)
        for got, expected in zip(patched[:, 6:].tolist(), reference_greedy(lm32, ids, mask, STEPS)[:, 6:].tolist()):
            ended = expected.index(0) if 0 in expected else STEPS
            assert got[:ended] == expected[:ended]


def test_a_prompt_given_as_embeddings_is_identical_to_vanilla(lm32):
    """``inputs_embeds`` instead of ``input_ids`` (as multimodal models feed a decoder): neofix checks their width
    against the family's hidden size (its ``Limits``) and takes the batch and length from them; the logits are
    vanilla's.  (Unpadded rows: on a left-padded one vanilla's positions differ by release and family.)"""
    ids, mask = left_padded_batch([6, 6], seed=3)
    with torch.no_grad():
        embeds = lm32.get_input_embeddings()(ids)

    def call(model):
        with torch.no_grad():
            return model(inputs_embeds=embeds, attention_mask=mask).logits

    patched, plain = both(lm32, call)
    assert patched.shape == (2, 6, lm32.config.vocab_size)
    torch.testing.assert_close(patched, plain)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param(dict(penalty_alpha=0.6, top_k=4), marks=requires("contrastive search"), id="contrastive"),
        pytest.param(dict(dola_layers="high", repetition_penalty=1.2), marks=requires("DoLa decoding"), id="dola"),
        pytest.param(
            dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0),
            marks=requires("group and constrained beam search"),
            id="group-beam",
        ),
        pytest.param(
            dict(num_beams=4, force_words_ids=[[5, 7]]),
            marks=requires("group and constrained beam search"),
            id="constrained-beam",
        ),
    ],
)
def test_other_decoding_strategies_are_identical_to_vanilla(lm32, kwargs):
    """The strategies that expand, select and crop the cache their own way (top-k candidates, beam groups, forced
    words) or read every layer's hidden states (DoLa), on the releases that still run them in transformers itself.
    Where transformers refuses one (contrastive search over GPT-BigCode's fused cache up to 4.53), neofix leaves its
    refusal exactly as it is."""
    ids, mask = left_padded_batch([6, 3, 5], seed=3)
    patched, plain = both(lm32, lambda model: run(lambda: generate(model, ids, mask, do_sample=False, **kwargs))[0])
    if isinstance(plain, Exception):
        assert NO_STANDARD_CACHE in str(plain), plain
        assert type(patched) is type(plain) and str(patched) == str(plain), (patched, plain)
        return
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, plain)


#: Vanilla's own refusal of contrastive search for a cache it cannot split by layer and head: GPT-BigCode's fused one,
#: up to 4.53.
NO_STANDARD_CACHE = "does not have a standard cache format"


#: Vanilla's own failure on transformers 5.0: candidate decoding crops the cache after a rejected guess, and a
#: ``DynamicSlidingWindowLayer`` that has seen a whole window refuses to be cropped (Mistral, Gemma 2, Gemma 3 here,
#: whose tiny window is 4).  neofix must leave that failure exactly as it is.
CANNOT_CROP_A_WINDOW = "Cannot `crop` a `DynamicSlidingWindowLayer`"


#: Vanilla's own wrong tokens on transformers 4.39 and 4.40: candidate decoding (assisted, prompt lookup) advances
#: generate's ``cache_position`` by one per step, however many candidate tokens were accepted (4.41 advances it by
#: their number), and the families that take it (Llama here) build their causal mask from it: a step after 10 cached
#: tokens gets ``[13, 11, 12, 13]``.  neofix repairs that cache_position (said once), so its tokens are greedy
#: decoding's, as candidate decoding's must be; vanilla's are not.
STALE_CANDIDATE_CACHE_POSITION = "neofix: cache_position is ["


def assert_generates_as_vanilla(model, call, greedy=None):
    """``call(model)`` patched and vanilla end alike: the same tokens, or, where vanilla cannot run it at all,
    the same error (only the known failures above: any other vanilla error fails the test).  ``greedy``: the
    reference tokens (candidate decoding's must be greedy decoding's), where vanilla's own cache_position is wrong."""
    (patched, messages), plain = both(model, lambda m: run(lambda: call(m)))
    plain = plain[0]
    if isinstance(plain, Exception):
        assert CANNOT_CROP_A_WINDOW in str(plain), plain
        assert getattr(model.config, "sliding_window", None) is not None, plain
        assert type(patched) is type(plain) and str(patched) == str(plain), (patched, plain)
        return
    if greedy is not None and (4, 39) <= TF_RELEASE < (4, 41) and not torch.equal(patched, plain):
        assert any(message.startswith(STALE_CANDIDATE_CACHE_POSITION) for message in messages), messages
        assert not torch.equal(plain, greedy)
        assert torch.equal(patched, greedy)
        return
    assert torch.equal(patched, plain)


@requires("assisted decoding")
def test_assisted_generate_is_identical_to_vanilla(family, lm32):
    ids, mask = left_padded_batch([6], seed=5)
    assistant = tiny_model(family, seed=7, dtype=torch.float32)
    greedy = reference_greedy(lm32, ids, mask, STEPS)
    assert_generates_as_vanilla(
        lm32, lambda m: generate(m, ids, mask, assistant_model=assistant, do_sample=False), greedy
    )


def test_early_exit_assisted_generate_is_identical_to_vanilla(lm32):
    """``generate(assistant_early_exit=1)`` (4.47 and later): the model drafts with its first layer alone, so the
    drafts' cache holds nothing in the other layers.  neofix refused that cache as one of layers of different lengths
    (the error escaped before transformers restored ``config.num_hidden_layers``, which stayed 1); it now checks the
    layers a forward runs: vanilla's tokens, the greedy reference's, and the config as it was, where vanilla runs
    (Gemma3 on 4.50 - 4.57 fails to find its base model, and families without early exit fail inside transformers:
    there the same error)."""
    if TF_RELEASE < (4, 47):
        pytest.skip(f"transformers {transformers.__version__}: no assistant_early_exit")
    ids, mask = left_padded_batch([6], seed=5)
    layers, after = lm32.config.num_hidden_layers, []

    def call(model):
        try:
            return run(lambda: generate(model, ids, mask, assistant_early_exit=1, do_sample=False))
        finally:  # (where generate fails, transformers leaves its count at 1: put back for the next run)
            after.append(model.config.num_hidden_layers)
            model.config.num_hidden_layers = layers

    (patched, _), (plain, _) = both(lm32, call)
    if isinstance(plain, Exception):  # (GPT-2, OPT, BLOOM, ...: an IndexError inside transformers, vanilla too)
        assert type(patched) is type(plain) and str(patched) == str(plain), patched
        return
    assert after == [layers, layers]
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, plain)
    eos = lm32.generation_config.eos_token_id
    assert torch.equal(patched, reference_greedy(lm32, ids, mask, STEPS, eos_token_id=eos, pad_token_id=0))


@requires("prompt lookup")
def test_prompt_lookup_is_identical_to_vanilla(lm32):
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    mask = torch.ones_like(ids)
    greedy = reference_greedy(lm32, ids, mask, STEPS)
    assert_generates_as_vanilla(
        lm32, lambda m: generate(m, ids, mask, prompt_lookup_num_tokens=3, do_sample=False), greedy
    )


# -- never break -------------------------------------------------------------------------------------------------------


def test_training_step_is_identical_to_vanilla(lm32):
    ids = torch.randint(1, 96, (2, 7), generator=torch.Generator().manual_seed(11))

    def step(model):
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    (loss, grads), (plain_loss, plain_grads) = both(lm32, step)
    lm32.zero_grad(set_to_none=True)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads)) and len(grads) == len(plain_grads)


class Logits(torch.nn.Module):
    """A model's logits from positional tensors only: what torch.jit and torch.export take."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=False)[0]


FLAT = torch.tensor([5, 17, 33, 41])
FLAT_CALLS = {  # (1D input_ids, the same as one row)
    "4 tokens": (lambda m: m(FLAT).logits, lambda m: m(FLAT[None]).logits),
    "1 token": (lambda m: m(FLAT[:1]).logits, lambda m: m(FLAT[None, :1]).logits),
    "2 after a cache": (
        lambda m: m(FLAT[2:], past_key_values=m(FLAT[None, :2], use_cache=True).past_key_values).logits,
        lambda m: m(FLAT[None, 2:], past_key_values=m(FLAT[None, :2], use_cache=True).past_key_values).logits,
    ),
}


@pytest.mark.parametrize("pad", [None, 0], ids=["no pad_token_id", "pad_token_id 0"])
@pytest.mark.parametrize("call", sorted(FLAT_CALLS))
def test_one_dimensional_input_ids_run_wherever_vanilla_reads_them_as_one_row(family, call, pad):
    """1D ``input_ids``: where vanilla computes what the same ids as one row compute, so does neofix (GPT-J and
    CodeGen 4.36 - 4.44, OPT 4.26 - 4.27's one token were refused with ``InputShapeError``); where vanilla fails or
    computes something else, neofix's error or vanilla's own."""
    flat, row = FLAT_CALLS[call]
    model = tiny_model(family, pad_token_id=pad)
    patched, plain = both(model, lambda m: run(lambda: flat(m))[0])
    with neofix.unpatched():
        expected = run(lambda: row(model))[0]
    if isinstance(plain, torch.Tensor) and plain.numel() == expected.numel() and torch.equal(
        plain.reshape(expected.shape), expected
    ):
        assert isinstance(patched, torch.Tensor), patched
        assert torch.equal(patched, plain)
    else:
        assert isinstance(patched, Exception) or not isinstance(plain, torch.Tensor) or torch.equal(patched, plain)


def assert_falcons_static_cache_refused(patched):
    """Falcon on 4.45 - 4.55: transformers' StaticCache has every query head, its multi-query attention writes one
    (vanilla: ``index_copy_`` fails); neofix refuses the step before the model runs, naming why."""
    assert TF_RELEASE < (4, 56) and isinstance(patched, neofix.InputShapeError), patched
    assert str(patched).startswith("the static cache holds keys of 4 heads, but this Falcon model writes 1"), patched


def assert_same_outcome(patched, plain):
    """The same tensor, or (where vanilla cannot trace or export a family on a release) the same error."""
    if isinstance(plain, Exception):
        assert type(patched) is type(plain), (patched, plain)
        return
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, plain)


def test_jit_trace_is_identical_to_vanilla(lm32):
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    module = Logits(lm32)
    inputs = (ids, torch.ones_like(ids))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own tracer warnings
        patched, plain = both(module, lambda m: run(lambda: torch.jit.trace(m, inputs, check_trace=False)(*inputs))[0])
    assert_same_outcome(patched, plain)  # torch.jit cannot trace GPT-2 and GPT-NeoX on 4.57: the same error


@pytest.mark.slow  # torch.compile / torch.export of seven models: on the oldest and newest releases
def test_compiled_forward_is_identical_to_eager(lm32):
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(2))

    def compiled_forward():
        torch._dynamo.reset()
        try:
            compiled = torch.compile(lm32, backend="eager")
            with torch.no_grad():
                return compiled(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        finally:
            torch._dynamo.reset()

    with neofix.unpatched():
        plain, _ = run(compiled_forward)
    got, _ = run(compiled_forward)
    if isinstance(plain, Exception):  # torch.compile cannot trace this family on this release (CodeGen on 4.26)
        assert type(got) is type(plain), (got, plain)
        return
    assert isinstance(got, torch.Tensor), got
    with torch.no_grad():
        expected = lm32(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    assert torch.equal(got, expected)
    assert torch.equal(got, plain)


@pytest.mark.slow  # torch.compile / torch.export of seven models: on the oldest and newest releases
def test_torch_export_is_identical_to_vanilla(lm32):
    """``torch.export`` (non-strict): neofix steps aside, so the exported program is vanilla's; where vanilla cannot
    export the family on this release, neither can the patched model, with the same error."""
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    inputs = (ids, torch.ones_like(ids))

    def exported(module):
        def call():
            with torch.no_grad():
                return torch.export.export(module, inputs, strict=False).module()(*inputs)

        return run(call)[0]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched, plain = both(Logits(lm32), exported)
    assert_same_outcome(patched, plain)


def test_classification_head_is_identical_to_vanilla(family):
    """A sequence-classification head on an unpadded and a right-padded batch: bit-identical logits and loss."""
    name = FAMILY_CONFIGS[family][1].replace("ForCausalLM", "ForSequenceClassification")
    # Gemma3ForSequenceClassification is the multimodal model's (it reads a vision_config): the text model has its own
    name = {"Gemma3ForSequenceClassification": "Gemma3TextForSequenceClassification"}.get(name, name)
    head_class = getattr(transformers, name.replace("LMHeadModel", "ForSequenceClassification"), None)
    if head_class is None:
        pytest.skip(f"transformers has no sequence-classification head for {family}")
    torch.manual_seed(0)
    head = head_class(tiny_config(family, num_labels=3)).eval()
    ids, mask = left_padded_batch([6, 4], seed=4)
    ids, mask = ids.flip(-1), mask.flip(-1)  # right-padded
    labels = torch.tensor([0, 2])

    def call(model):
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, labels=labels)
        return out.logits, out.loss

    (logits, loss), (plain_logits, plain_loss) = both(head, call)
    assert torch.equal(logits, plain_logits) and torch.equal(loss, plain_loss)


# -- DecodeState and trace ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("patched", [True, False], ids=["patched", "unpatched"])
def test_decode_state_loop_matches_the_reference(lm, lm32, patched):
    """The state alone keeps a left-padded loop right, patched or not (unpatched in float32: vanilla GPT-2 4.42 -
    4.51 and OPT 4.36 - 4.48 cannot run float64 models)."""
    ids, mask = left_padded_batch([6, 3, 5])
    lm = lm if patched else lm32

    def loop():
        state = neofix.DecodeState(ids, mask, model=lm)
        with torch.no_grad():
            for _ in range(STEPS):
                out = lm(**state.model_inputs())
                state.advance(out.logits[:, -1].argmax(-1), out)
        return state.sequences[:, ids.shape[1] :]

    if patched:
        tokens, messages = run(loop)
    else:
        with neofix.unpatched():
            tokens, messages = run(loop)
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert messages == []  # nothing to repair


def test_trace_records_every_generate_step(lm32):
    ids, mask = left_padded_batch([6, 3], seed=2)
    with neofix.trace(lm32) as steps:
        generate(lm32, ids, mask, max_new_tokens=3, do_sample=False)
    assert [(step.new_tokens, step.cached_tokens) for step in steps] == [(6, 0), (1, 6), (1, 7)]
    assert all(step.patched and step.repairs == () for step in steps), steps
    assert steps[-1].real_tokens == (8, 5)


@pytest.mark.parametrize("lengths", [[6, 3], [3, 2]], ids=["prompt past the window", "prompt inside the window"])
def test_static_cache_generate_is_identical_to_vanilla(family, lengths):
    """``generate`` with a static cache (BLOOM: a mask padded to the cache's capacity; Llama 4.38 - 4.40: a cache set
    on every attention layer, the forward given none): vanilla's tokens, or where the family cannot decode with one on
    this release, vanilla's error.  A model of its own: on 4.38 - 4.40 such a generate leaves every attention layer a
    ``past_key_value`` of None, after which the model returns no cache (vanilla too).  Sliding-window layers (Mistral's
    window of 4) make a static cache of the window's slots, whose 4D mask at the prefill spans those slots or the
    prompt's own keys: it was refused on 4.57 (every prompt) and on 5.x (a prompt inside the window)."""
    if family == "gpt_neo":
        pytest.skip("GPT-Neo's local layers: neofix refuses a static cache wider than the window")
    model = tiny_model(family, seed=0, dtype=torch.float32)
    ids, mask = left_padded_batch(lengths, seed=2)
    patched, plain = both(
        model, lambda m: run(lambda: generate(m, ids, mask, do_sample=False, cache_implementation="static"))[0]
    )
    if family == "falcon" and isinstance(plain, RuntimeError) and "index_copy_" in str(plain):
        assert_falcons_static_cache_refused(patched)  # 4.45 - 4.55: a cache of every head for one written
    else:
        assert_same_outcome(patched, plain)
    with simulated_accelerator():  # where each step's mask is extended to every slot, unread: the CPU's outcome
        accelerated = run(lambda: generate(model, ids, mask, do_sample=False, cache_implementation="static"))[0]
    assert_same_outcome(accelerated, patched)


@requires("StaticCache")
@pytest.mark.parametrize("lengths", [[6, 3, 5], [6, 6, 6]], ids=["left-padded", "unpadded"])
def test_a_static_loop_with_a_stale_mask_on_an_accelerator_gives_the_reference_tokens(family, lengths):
    """The prompt's mask at every step (the classic bug) of a hand loop over a static cache, ``cache_position`` given,
    on an accelerator (simulated: values read by the device reader, nothing read back): the cache's length is not
    known there without a read, so the mask is extended to every slot on the device, and the tokens are the
    reference's, as on the CPU.  Where the family cannot decode over a static cache on this release (the right mask
    gives other tokens or an error, patched too: Llama 4.38 - 4.40 sets a cache on every attention layer), and where
    neofix leaves the mask as given (OPT, which derives a position for each column it is given; sliding-window
    layers, whose slots are not the tokens' positions), the outcome is vanilla's.  With the mask right, the outcome
    on the accelerator is the CPU's."""
    from .test_static_cache import static_cache, static_loop

    model = tiny_model(family, seed=0, dtype=torch.float32)
    ids, mask = left_padded_batch(lengths)
    try:
        cache = static_cache(model, len(lengths))
    except (AttributeError, TypeError) as exc:  # up to 4.44 StaticCache reads attributes of Llama's config
        pytest.skip(f"transformers {transformers.__version__} builds no StaticCache for {family}'s config: {exc}")
    windowed = any("Sliding" in type(layer).__name__ for layer in getattr(cache, "layers", ()))

    def loop(stale):
        return run(lambda: static_loop(model, model, ids, mask, STEPS, stale_mask=stale, slots=True))[0]

    expected = reference(model, ids, mask)
    whole = loop(False)  # on the CPU, the mask right
    with simulated_accelerator():
        patched, right = loop(True), loop(False)
    assert_same_outcome(right, whole)  # the mask right: the CPU's outcome
    with neofix.unpatched():
        plain = loop(True)
    if family == "gpt_bigcode" and isinstance(plain, TypeError) and "is not subscriptable" in str(plain):
        # up to 4.53 GPT-BigCode indexes its cache by layer (its own fused tensors): no Cache object runs, refused
        assert isinstance(patched, neofix.InputShapeError), patched
        assert str(patched).startswith("the cache is a StaticCache, but GPT-BigCode's forward"), patched
        return
    if family == "falcon" and isinstance(plain, RuntimeError) and "index_copy_" in str(plain):
        assert_falcons_static_cache_refused(patched)  # 4.45 - 4.55: a cache of every head for one written
        return
    if isinstance(whole, Exception) or not torch.equal(whole, expected) or family == "opt" or windowed:
        assert_same_outcome(patched, plain)
        return
    assert torch.equal(patched, expected)


# -- the declarations -------------------------------------------------------------------------------------------------


def targets(family):
    return [(t.name, t.wrapper, t.required, t.since, t.until, t.why) for t in family.targets]


def test_a_standard_family_declares_its_targets():
    """A family patched the usual way: its base model's forward, input preparation and generate (required), and the
    stopping criteria (required; left alone with the reason where ``no_stopping`` says why); a float64-mask helper
    is a module-level target, optional, gated to its releases."""
    from neofix._families import _float64_mask, _standard

    assert targets(_standard("gpt_neo", "GPT-Neo", "GPTNeoModel", "GPTNeoForCausalLM")) == [
        ("GPTNeoModel.forward", "make_model_forward", True, None, None, ""),
        ("GPTNeoForCausalLM.prepare_inputs_for_generation", "make_prepare_inputs_for_generation", True, None, None, ""),
        ("GPTNeoForCausalLM.generate", "make_generate", True, None, None, ""),
        ("GPTNeoForCausalLM._get_stopping_criteria", "make_get_stopping_criteria", True, None, None, ""),
    ]
    helper = _float64_mask("_prepare_4d_causal_attention_mask", "OPT", "4.36", "4.49", widen=True)
    family = _standard(
        "opt", "OPT", "OPTDecoder", "OPTForCausalLM", helper, no_stopping="no table", prepare_since="4.36",
        prepare_why="before 4.36",
    )
    assert (family.name, family.title, family.module, family.base_model, family.causal_lm, family.adapter) == (
        "opt", "OPT", "transformers.models.opt.modeling_opt", "OPTDecoder", "OPTForCausalLM", "neofix._families.opt"
    )
    assert targets(family) == [
        ("OPTDecoder.forward", "make_model_forward", True, None, None, ""),
        ("OPTForCausalLM.prepare_inputs_for_generation", "make_prepare_inputs_for_generation", True, "4.36", None,
         "before 4.36"),
        ("OPTForCausalLM.generate", "make_generate", True, None, None, ""),
        ("OPTForCausalLM._get_stopping_criteria", "", False, None, None, "no table"),
        ("_prepare_4d_causal_attention_mask", "make_prepare_4d_mask_in_float64", False, "4.36", "4.49",
         "only transformers 4.36 - 4.48 build OPT's causal mask through this helper, which overflows in float64"),
    ]
    plain = _float64_mask("_prepare_4d_causal_attention_mask", "GPT-Neo", "4.36", "4.45")  # not widened
    assert targets(_standard("gpt_neo", "GPT-Neo", "GPTNeoModel", "GPTNeoForCausalLM", plain))[-1] == (
        "_prepare_4d_causal_attention_mask", "make_prepare_4d_mask_for_float64", False, "4.36", "4.45",
        "only transformers 4.36 - 4.44 build GPT-Neo's causal mask through this helper, which overflows in float64",
    )


def test_every_declared_wrapper_is_a_factory_of_neofix_wrappers():
    """Every target of every family names a factory of ``neofix._wrappers`` or of the family's adapter module (as
    ``_lifecycle`` looks it up; or none, with the reason it is left alone), release-gated ones included: a misspelt
    name would break patching only on the releases it is for."""
    from neofix import _wrappers

    for family in FAMILIES.values():
        for target in family.targets:
            if target.wrapper:
                factory = getattr(_wrappers, target.wrapper, None)
                if factory is None:
                    factory = getattr(importlib.import_module(family.adapter), target.wrapper, None)
                assert callable(factory), (family.name, target.name, target.wrapper)
            else:
                assert target.why and not target.required, (family.name, target.name)


def test_gpt_neox_limits_its_table_only_where_the_causal_buffer_is_fixed():
    """GPT-NeoX up to 4.30 slices its causal mask from a buffer of ``max_position_embeddings`` columns, which a longer
    sequence overflows (a limit); from 4.36 the buffer grows, then is gone: no limit."""
    importlib.import_module(FAMILIES["gpt_neox"].module)
    adapter = FAMILIES["gpt_neox"].load_adapter()
    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if (4, 31) <= release < (4, 36):
        pytest.skip("not measured on 4.31 - 4.35 (the attention class tells)")
    fixed = release < (4, 31)
    module = sys.modules[FAMILIES["gpt_neox"].adapter]
    assert module._causal_buffer_is_fixed() is fixed
    assert module.TABLE_IS_A_LIMIT is fixed
    assert adapter.limits(tiny_config("gpt_neox")).max_positions == (64 if fixed else None)



def test_limits_are_the_models_own_sizes(lm32, adapter):
    """The limits read off the config are the model's sizes, as Python ints: the vocabulary and hidden width of its
    embedding, and the heads and head size of the cache it writes (compared with the cache on releases whose caches
    have layers)."""
    limits = adapter.limits(lm32.config)
    embedding = lm32.get_input_embeddings()
    assert (limits.vocab_size, limits.hidden_size) == (embedding.num_embeddings, embedding.embedding_dim)
    assert {type(limits.heads), type(limits.head_dim)} == {int}  # every family's cache layout is checked
    query_heads = limits.hidden_size // limits.head_dim  # (no tiny model sets a head width of its own)
    assert query_heads % limits.heads == 0  # every query head's keys, or a group's (Llama: grouped-query attention)
    with torch.no_grad():
        cache = output_cache(lm32(input_ids=torch.ones(2, 3, dtype=torch.long), use_cache=True))
    if not hasattr(cache, "layers"):
        return  # a legacy tuple cache (before 4.54): its layout differs by family (BLOOM folds heads into the batch)
    keys = cache.layers[0].keys
    assert (keys.shape[1], keys.shape[-1]) == (limits.heads, limits.head_dim)


# -- the general path's value reads, for every kind of positions -----------------------------------------------------


def test_a_mask_of_other_values_is_refused_on_every_path(family, lm32):
    """A float mask holding 0.5 (weights, or an additive mask) is refused by name in every family, whether the family
    takes absolute positions (checked with them) or makes its own (rotary, from the mask, none: read by the same
    step), as a long mask holding 2 is."""
    ids = torch.tensor([[11, 12, 13], [21, 22, 23]])
    for mask in (torch.tensor([[1.0, 1.0, 0.5], [1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 2], [1, 1, 1]])):
        result, _ = run(lambda: lm32(input_ids=ids, attention_mask=mask))
        assert isinstance(result, neofix.MaskValueError), result


def test_a_bool_mask_computes_what_the_same_long_mask_computes(family, lm32):
    """A left-padded prompt given a bool mask (read by the general path's torch operations) and then a decode step:
    the logits of each forward are those the same mask as integers gives (read on the fast path), whichever
    positions the family takes (the mask's, or transformers' own for rotary and mask-derived ones)."""
    ids, mask = left_padded_batch([5, 3])
    outputs = []
    for step_mask in (mask, mask.bool()):
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            prompt = lm32(input_ids=ids, attention_mask=step_mask, use_cache=True)
            step = torch.cat((step_mask, step_mask.new_ones((2, 1))), 1)
            decoded = lm32(input_ids=torch.tensor([[7], [8]]), attention_mask=step,
                           **{cache_keyword(lm32): output_cache(prompt)})
        outputs.append((prompt.logits, decoded.logits))
    assert torch.equal(outputs[0][0], outputs[1][0])
    assert torch.equal(outputs[0][1], outputs[1][1])


def test_decoding_from_a_right_padded_bool_mask_prompt_is_an_error_in_strict_mode(family, lm32):
    """The right padding of a prompt read by the general path (a bool mask) is followed to the decode step, which
    strict mode refuses in every family."""
    ids = torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]).bool()
    neofix.configure(mode="strict")
    with torch.no_grad():
        cache = output_cache(lm32(input_ids=ids, attention_mask=mask, use_cache=True))
        step = torch.cat((mask, mask.new_ones((2, 1))), 1)
        with pytest.raises(neofix.MaskValueError, match="right padding in row 1"):
            lm32(input_ids=torch.tensor([[7], [8]]), attention_mask=step, **{cache_keyword(lm32): cache})


@pytest.mark.parametrize("name", [name for name in NAMES if name in ("gpt_neo", "gpt2", "opt")])
def test_a_chunk_without_a_mask_given_stale_positions_is_told_the_positions_it_gets(name):
    """Three new tokens after a 4-token cache, no mask, and a stale prompt's 5 positions, in the families that take
    absolute positions or derive them from the mask (OPT, left to derive them from its mask of ones): the new tokens
    get positions 4 to 6, and the words say so (there is no attention mask to derive them from); the tokens are the
    full recompute's."""
    available(name)
    model = tiny_model(name, seed=0, dtype=torch.float64)
    if not _takes_positions(model):
        pytest.skip(f"{type(model).__name__} takes no position_ids on transformers {transformers.__version__}")
    ids = torch.randint(1, 90, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :4], use_cache=True))
    result, words = run(lambda: model(input_ids=ids[:, 4:], position_ids=torch.arange(5)[None],
                                      **{cache_keyword(model): cache}).logits)
    with torch.no_grad():
        expected = model(input_ids=ids).logits[:, 4:]
    assert torch.equal(result.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-3)
    assert words == [
        "neofix: position_ids has 5 columns, but this step feeds 3 new tokens (the cache holds 4); gave them the "
        "positions after the cache instead, 4 to 6 (with no attention mask every token is real) (stale prompt positions?). "
        "To fix your loop: pass only the new tokens' positions, or none at all and neofix derives them from the mask. "
        "Reported once."
    ]


def test_a_masked_token_after_an_unpadded_prompt_is_as_in_one_forward_on_a_rotary_family(lm32, adapter):
    """An unpadded prompt given no positions (its cache built with positions on which the mask and the columns
    agree), then a token masked out (a finished row's), then a real one given no positions: its logits are those of
    one forward of the whole sequence with that mask and no positions, as vanilla gives them (transformers' own
    positions, the columns, on a rotary family), not the mask's count.  (float32: vanilla's float64 masks overflow on
    4.36 - 4.44.)"""
    if not adapter.positions.rotary:
        pytest.skip(f"{adapter.family.name}: not a rotary family")
    keyword = cache_keyword(lm32)
    mask = torch.tensor([[1, 1, 1, 1, 0, 1]])
    whole = torch.tensor([[11, 12, 13, 14, 21, 22]])
    with torch.no_grad():
        cache = output_cache(lm32(input_ids=whole[:, :4], attention_mask=mask[:, :4], use_cache=True))
        cache = output_cache(
            lm32(input_ids=whole[:, 4:5], attention_mask=mask[:, :5], use_cache=True, **{keyword: cache})
        )
        last = lm32(input_ids=whole[:, 5:], attention_mask=mask, use_cache=True, **{keyword: cache}).logits[:, -1]
        with neofix.unpatched():
            expected = lm32(input_ids=whole, attention_mask=mask).logits[:, -1]
            counted = lm32(input_ids=whole, attention_mask=mask, position_ids=reference_positions(mask)).logits[:, -1]
    torch.testing.assert_close(last, expected, rtol=1e-4, atol=1e-3)  # (float32 logits of up to a few hundred)
    assert not torch.allclose(last, counted)  # (the mask's count would give other logits: the test can tell)
