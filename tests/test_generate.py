"""Patched ``generate`` on well-formed input is token-identical to vanilla and to a reference without a cache.

The reference: for greedy decoding, :func:`neofix.testing.reference_greedy` (full recompute); for beam search and
seeded sampling, transformers' own ``generate`` unpatched with ``use_cache=False`` (every step recomputes the whole
sequence; sampling draws the same random numbers per step with or without a cache).
"""

from __future__ import annotations

import inspect
import logging
import warnings

import pytest
import torch

import neofix
from neofix import _compat
from neofix._core import _values
from neofix.testing import reference_greedy, reference_logits, reference_positions, tiny_gpt_neo

from ._sync import read_values_on
from ._vanilla import assert_vanilla
from ._versions import cache_keyword, has, output_cache, requires
from .loops import left_padded_batch, patched_and_vanilla

NEW = 10


def both(run):
    """``run()`` patched, then vanilla: (patched result, vanilla result).  Each run gets fresh inputs."""
    return patched_and_vanilla(run)


def generate(model, ids, mask, **kwargs):
    kwargs.setdefault("max_new_tokens", NEW)
    kwargs.setdefault("pad_token_id", model.config.pad_token_id)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, **kwargs)


def without_cache(model, ids, mask, **kwargs):
    """Vanilla transformers' ``generate`` with ``use_cache=False``: the reference for beam search and sampling."""
    with neofix.unpatched():
        return generate(model, ids, mask, use_cache=False, **kwargs)


@pytest.fixture(scope="module")
def model(model):
    """Parity needs vanilla to run: transformers 4.36 - 4.44 cannot run GPT-Neo in float64 (neofix can)."""
    if has("float64 mask bug"):
        return tiny_gpt_neo(seed=0, dtype=torch.float32)
    return model


@pytest.fixture(scope="module")
def batch():
    return left_padded_batch([6, 2, 4, 6], width=6, seed=3)


def test_greedy_left_padded_matches_vanilla_and_reference(model, batch):
    ids, mask = batch
    patched, plain = both(lambda: generate(model, ids, mask, do_sample=False, min_new_tokens=NEW))
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(model, ids, mask, NEW))


def test_greedy_rows_equal_unpadded_prompts(model, batch):
    ids, mask = batch
    together = generate(model, ids, mask, do_sample=False, min_new_tokens=NEW)
    for row in range(ids.shape[0]):
        real = ids[row, mask[row].bool()][None]
        alone = generate(model, real, torch.ones_like(real), do_sample=False, min_new_tokens=NEW)
        assert torch.equal(together[row, -NEW:], alone[0, -NEW:])


def test_greedy_without_mask(model):
    ids, _ = left_padded_batch([5, 5], seed=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers may warn that no attention mask was passed
        patched, plain = both(lambda: generate(model, ids, None, do_sample=False, min_new_tokens=NEW))
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(model, ids, None, NEW))


@pytest.mark.parametrize("num_beams", [2, 3])
def test_beam_search(model, batch, num_beams):
    ids, mask = batch
    patched, plain = both(lambda: generate(model, ids, mask, num_beams=num_beams, do_sample=False))
    assert torch.equal(patched, plain)
    assert torch.equal(patched, without_cache(model, ids, mask, num_beams=num_beams, do_sample=False))


def test_beam_search_returns_several_sequences(model, batch):
    ids, mask = batch
    patched, plain = both(
        lambda: generate(model, ids, mask, num_beams=3, num_return_sequences=2, do_sample=False)
    )
    assert patched.shape[0] == 2 * ids.shape[0]
    assert torch.equal(patched, plain)
    reference = without_cache(model, ids, mask, num_beams=3, num_return_sequences=2, do_sample=False)
    assert torch.equal(patched, reference)


def test_sampling_with_seed(model, batch):
    """A temperature high enough that the sharpened model samples other tokens than greedy decoding picks."""
    ids, mask = batch

    def run(**kwargs):
        torch.manual_seed(1234)
        return generate(model, ids, mask, do_sample=True, top_k=20, temperature=30.0, **kwargs)

    patched, plain = both(run)
    assert torch.equal(patched, plain)
    with neofix.unpatched():
        reference = run(use_cache=False)  # the same seed: every step draws the same random numbers
    assert torch.equal(patched, reference)
    assert not torch.equal(patched, generate(model, ids, mask, do_sample=False))  # it sampled: not the greedy tokens


@requires("assisted decoding")
def test_assisted_decoding(model):
    # transformers supports assisted decoding with batch size 1
    ids, mask = left_padded_batch([6], seed=5)
    assistant = tiny_gpt_neo(seed=7, dtype=model.dtype)
    patched, plain = both(lambda: generate(model, ids, mask, assistant_model=assistant, do_sample=False))
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(model, ids, mask, patched.shape[1] - ids.shape[1]))


@requires("prompt lookup")
def test_prompt_lookup(model):
    # a repetitive prompt gives prompt lookup candidates to verify
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    mask = torch.ones_like(ids)
    patched, plain = both(lambda: generate(model, ids, mask, prompt_lookup_num_tokens=3, do_sample=False))
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(model, ids, mask, patched.shape[1] - ids.shape[1]))


@requires("group and constrained beam search")
@pytest.mark.parametrize(
    "kwargs",
    [dict(num_beams=4, num_beam_groups=2, diversity_penalty=1.0), dict(num_beams=4, force_words_ids=[[5, 7]])],
    ids=["group", "constrained"],
)
def test_group_and_constrained_beam_search(batch, kwargs):
    """float32: group beam search up to 4.3x cannot score a float64 model (vanilla neither)."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    ids, mask = batch
    patched, plain = both(lambda: generate(model, ids, mask, do_sample=False, **kwargs))
    assert torch.equal(patched, plain)
    assert torch.equal(patched, without_cache(model, ids, mask, do_sample=False, **kwargs))


@requires("DoLa decoding")
def test_dola_decoding(model, batch):
    ids, mask = batch
    kwargs = dict(dola_layers="high", repetition_penalty=1.2, do_sample=False)
    patched, plain = both(lambda: generate(model, ids, mask, **kwargs))
    assert torch.equal(patched, plain)
    assert torch.equal(patched, without_cache(model, ids, mask, **kwargs))


@requires("contrastive search")
def test_contrastive_search(model, batch):
    """Contrastive search needs a cache (transformers refuses ``use_cache=False``): the reference is each row's prompt
    alone, unpadded, which a left-padded row must decode exactly as."""
    ids, mask = batch
    kwargs = dict(penalty_alpha=0.6, top_k=4)
    patched, plain = both(lambda: generate(model, ids, mask, **kwargs))
    assert torch.equal(patched, plain)
    for row, length in enumerate(mask.sum(dim=1).tolist()):
        alone = ids[row : row + 1, ids.shape[1] - length :]
        with neofix.unpatched():
            expected = generate(model, alone, torch.ones_like(alone), **kwargs)
        assert patched[row, ids.shape[1] :].tolist() == expected[0, length:].tolist(), row


def _prefix_cache(model, ids, mask):
    """The cache of a well-formed prefix forward (explicit positions, so vanilla builds it right too)."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask), use_cache=True)
    return output_cache(out)


@pytest.mark.parametrize("uncached", [1, 3])
def test_continue_from_a_returned_cache(model, batch, uncached):
    """generate(full sequence, cache of a prefix): the same tokens as generating from scratch.

    With one uncached token every release is right; with several, transformers up to 4.35 feeds only the last one
    (a shape RuntimeError there), which neofix repairs.
    """
    ids, mask = batch
    prefix = ids.shape[1] - uncached
    expected = reference_greedy(model, ids, mask, NEW)

    def run():
        cache = _prefix_cache(model, ids[:, :prefix], mask[:, :prefix])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return generate(model, ids, mask, do_sample=False, min_new_tokens=NEW, **{cache_keyword(): cache})

    patched = run()
    assert torch.equal(patched, expected)
    with neofix.unpatched():
        name = f"generate continuing a cache, {uncached} uncached token{'s' if uncached > 1 else ''}"
        assert_vanilla(name, run, wrong=lambda plain: not torch.equal(plain, expected))


@pytest.mark.skipif(not _compat.release() >= (5, 3), reason="from 5.3 generate reads input_ids by the mask's width")
@pytest.mark.parametrize("fed, columns", [(4, 6), (6, 8), (7, 6)])
def test_generate_given_no_more_input_ids_than_the_cache_holds_reads_them_as_the_new_tokens(model, fed, columns):
    """From 5.3, ``input_ids`` no longer than a 6-token cache cannot be the whole sequence (no token would be new):
    with a mask not extended for all of them (the cache's own, or two columns more, all ones: every reading agrees)
    they are the new tokens, the mask is extended, and the tokens are the reference's.  One token more than the cache
    and they may be the whole sequence: refused (tests/test_families.py has the same for a second turn)."""
    ids = torch.randint(1, 90, (1, 6 + fed), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    cache = _prefix_cache(model, ids[:, :6], mask[:, :6])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tokens = generate(model, ids[:, 6:], mask[:, :columns], do_sample=False, **{cache_keyword(): cache})
        except neofix.MaskLengthError as exc:
            tokens = exc
    if fed <= 6:
        assert isinstance(tokens, torch.Tensor), tokens
        assert torch.equal(tokens[:, -NEW:], reference_greedy(model, ids, mask, NEW)[:, -NEW:])
        said = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
        assert said == [
            f"neofix: attention_mask has {columns} columns, but the cache holds 6 tokens and this step feeds {fed}: "
            f"expected {6 + fed}; extended it with ones on the right (the classic 'mask not extended' decoding bug). "
            f"To fix your loop: append a column of ones per new token "
            f"(torch.cat([mask, mask.new_ones(batch, new_tokens)], -1)). Reported once."
        ]
        neofix.configure(mode="strict")
        with pytest.raises(neofix.MaskLengthError, match="The mask was not extended for the new tokens"):
            generate(model, ids[:, 6:], mask[:, :columns], do_sample=False, **{cache_keyword(): _prefix_cache(model, ids[:, :6], mask[:, :6])})
    else:
        assert isinstance(tokens, neofix.MaskLengthError), tokens
        assert "generate was given 7 tokens of input_ids, a cache of 6 tokens and an attention_mask of 6 columns" in str(tokens)


@requires("Cache objects")
def test_continue_from_generate_output_cache(model, batch):
    """The cache returned by generate(return_dict_in_generate=True) continues the same sequences."""
    ids, mask = batch
    first = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=4,
        min_new_tokens=4,
        do_sample=False,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    cache = output_cache(first)
    sequences = first.sequences
    full_mask = torch.cat([mask, mask.new_ones((mask.shape[0], 4))], -1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        continued = generate(model, sequences, full_mask, do_sample=False, min_new_tokens=6, max_new_tokens=6,
                             **{cache_keyword(): cache})
    assert torch.equal(continued, reference_greedy(model, ids, mask, 10))


def test_patch_adds_no_transformers_warnings(model, batch, caplog):
    """Everything transformers warns about on a patched run, it warns about unpatched too: neofix adds nothing."""
    ids, mask = batch

    def run():
        caplog.clear()
        once = getattr(logging.Logger, "warning_once", None)  # transformers logs some warnings once per process
        if hasattr(once, "cache_clear"):
            once.cache_clear()
        with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
            warnings.simplefilter("always")
            generate(model, ids, mask, do_sample=False)
            generate(model, ids, mask, num_beams=2, do_sample=False)
            with torch.no_grad():
                out = model(
                    input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask), use_cache=True
                )
                model(
                    input_ids=ids[:, -1:],
                    attention_mask=torch.cat([mask, mask[:, -1:]], -1),
                    position_ids=reference_positions(mask)[:, -1:] + 1,
                    use_cache=True,
                    **{cache_keyword(): output_cache(out)},
                )
        return (
            {(w.category.__name__, str(w.message)) for w in caught},
            {r.getMessage() for r in caplog.records if r.name.startswith("transformers")},
        )

    (patched_warnings, patched_logs), (plain_warnings, plain_logs) = both(run)
    assert not [w for w in patched_warnings if w[0] == "NeofixWarning"]
    assert patched_warnings <= plain_warnings
    assert patched_logs <= plain_logs


@pytest.mark.parametrize("positions", ["arange", "mask"])
def test_generate_given_position_ids_decodes_as_the_reference(model, batch, positions):
    """``generate(..., position_ids=...)``: generate continues the caller's positions (5.10 and later add one per
    step; 5.0 and 4.57 repeat the last, 4.40 passes them whole, 4.26 drops them), so they are compared with the
    mask's like any caller's, not trusted as positions generate built.  The tokens are the full recompute's on every
    release.  An arange over the left-padded batch (the classic bug) is repaired at the prefill and at the decode
    steps, where vanilla's tokens are wrong (or it fails); from 5.10 that is said twice, once each, and the mask's
    own positions, which those releases continue correctly, are left alone without a word."""
    ids, mask = batch
    given = torch.arange(ids.shape[1]).expand_as(ids) if positions == "arange" else reference_positions(mask)
    kwargs = dict(do_sample=False, min_new_tokens=NEW, position_ids=given)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = generate(model, ids, mask, **kwargs)
    said = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    expected = reference_greedy(model, ids, mask, NEW)
    assert torch.equal(patched, expected)
    if positions == "arange":
        with neofix.unpatched():
            try:
                plain = generate(model, ids, mask, **kwargs)
            except RuntimeError as exc:  # 4.40: the whole positions at a decode step
                plain = exc
        assert not isinstance(plain, torch.Tensor) or not torch.equal(plain, expected)
    if _compat.release() >= (5, 10):
        if positions == "mask":
            assert said == []
        else:
            assert len(said) == 2, said
            assert said[0].startswith("neofix: position_ids count the left padding of rows 1, 2")
            assert said[1].startswith("neofix: position_ids[1, 0] is 6 at the step after 6 cached tokens")


def _resize(model, size):
    """``resize_token_embeddings``, without the random mean resizing transformers 4.46 and later warn about."""
    if "mean_resizing" in inspect.signature(model.resize_token_embeddings).parameters:
        model.resize_token_embeddings(size, mean_resizing=False)
    else:
        model.resize_token_embeddings(size)


def _remove_blocks(model, keep):
    model.transformer.h = model.transformer.h[:keep]
    model.config.num_layers = keep
    model.config.attention_layers = model.config.attention_layers[:keep]


@pytest.mark.parametrize("scalars", [True, False], ids=["cpu reads", "accelerator reads"])
@pytest.mark.parametrize("edit", ["grown vocabulary", "blocks removed"])
def test_a_model_edited_after_a_forward_generates_as_vanilla(batch, edit, scalars, monkeypatch):
    """neofix remembers a model's layer count and limits at its first forward.  An edit after it (a tokenizer's new
    token and ``resize_token_embeddings``, blocks removed) must neither refuse nor change what vanilla generates:
    judged on the remembered facts, the new token was refused as outside the vocabulary, and the smaller cache as
    uneven across the layers the model no longer has."""
    read_values_on(monkeypatch, scalars)
    model = tiny_gpt_neo(seed=4, dtype=torch.float32)
    ids, mask = batch
    generate(model, ids, mask, do_sample=False)  # the facts are remembered here
    if edit == "grown vocabulary":
        vocab = model.config.vocab_size
        _resize(model, vocab + 4)
        ids = ids.clone()
        ids[:, -1] = vocab + 1  # (a real token in every left-padded row) held by the new vocabulary only
    else:
        _remove_blocks(model, 2)
    patched, plain = both(lambda: generate(model, ids, mask, do_sample=False))
    assert torch.equal(patched, plain)
    # (rows end at the end-of-sequence token, as generate ends them: the resized model's greedy choice on 4.26)
    eos = model.config.eos_token_id
    assert torch.equal(patched, reference_greedy(model, ids, mask, NEW, eos_token_id=eos, pad_token_id=eos))


@pytest.mark.parametrize("scalars", [True, False], ids=["cpu reads", "accelerator reads"])
def test_a_forward_after_the_vocabulary_grew_is_vanilla(batch, scalars, monkeypatch):
    """A forward without a cache (training, scoring) given a token that ``resize_token_embeddings`` added after the
    model's first forward: vanilla's logits, not a refusal on the vocabulary neofix saw at that first forward (the
    path accelerators take reads the ids there)."""
    read_values_on(monkeypatch, scalars)
    model = tiny_gpt_neo(seed=4, dtype=torch.float32)
    ids = batch[0].clone()
    mask = torch.ones_like(ids)  # no padding: vanilla's positions are the mask's
    vocab = model.config.vocab_size
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # the limits are remembered here
        _resize(model, vocab + 4)
        ids[:, -1] = vocab + 1
        patched, plain = both(lambda: model(input_ids=ids, attention_mask=mask).logits)
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_logits(model, ids, mask))
