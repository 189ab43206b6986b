"""The wrappers neofix installs (``neofix._wrappers``), seen from the outside: the whole messages they raise and warn,
what generate is told when it runs out of positions, and the bookkeeping they keep per cache and per tensor.

A model with 64 positions (``neofix.testing.tiny_gpt_neo``): a 64-token prompt fits and one new token may be
generated after it (the last token generated is never fed back); a 65-token prompt does not fit at all.
"""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

import neofix
from neofix import _caches, _compat, _errors, _wrappers
from neofix._families import gpt_neo
from neofix.testing import reference_greedy, tiny_gpt_neo

from ._versions import cache_keyword, has, output_cache, requires
from .test_generate_limits import Forwards, outcome  # the model forwards run inside a block; a call's outcome

TABLE = 64


@pytest.fixture(scope="module")
def model():
    """float32: vanilla transformers must run it on every release."""
    return tiny_gpt_neo(seed=0, dtype=torch.float32)


def prompt_of(length):
    return torch.randint(1, 96, (1, length), generator=torch.Generator().manual_seed(3))


def ones(*shape):
    return torch.ones(*shape, dtype=torch.long)


@torch.no_grad()
def never_generated(model, prompt, new):
    """A token greedy decoding does not produce in the ``new`` tokens that fit after ``prompt`` (an EOS that never
    comes)."""
    fitting = model.generate(prompt, max_new_tokens=new, eos_token_id=None, do_sample=False, pad_token_id=0)
    return next(token for token in range(1, 96) if token not in fitting[0, prompt.shape[1]:].tolist())


def overflow(model, prompt, **kwargs):
    """The error generate raises, and the forwards it ran first."""
    with Forwards(model) as forwards, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(neofix.SequenceTooLongError) as raised:
            model.generate(prompt, do_sample=False, pad_token_id=0, **kwargs)
    return raised.value, forwards.count


# -- generate past the position table --------------------------------------------------------------------------------

ONE_TOKEN = (
    "generate produced 1 new token after the 64-token prompt, and feeding it back would need position 64, but "
    "config.max_position_embeddings is 64 (positions 0 to 63): at most 1 new tokens fit after this prompt. Pass "
    "max_new_tokens=1 or fewer (generate stopped before this step's compute)"
)


def test_an_overflow_after_one_token_is_told_in_generate_terms(model):
    """A prompt filling the whole table, an EOS that could end it (so nothing is refused up front) but never comes:
    the prefill and the one token that fits run, then the step feeding that token back raises, in generate's
    terms (singular: one token, "it")."""
    prompt = prompt_of(TABLE)
    error, forwards = overflow(model, prompt, max_new_tokens=3, eos_token_id=never_generated(model, prompt, 1))
    assert str(error) == ONE_TOKEN
    assert forwards == 2  # the prefill, then the refused step
    assert (error.past, error.total, error.max_positions) == (64, 65, 64)


def test_an_overflow_after_several_tokens_is_told_in_generate_terms(model):
    prompt = prompt_of(58)
    error, forwards = overflow(model, prompt, max_new_tokens=10, eos_token_id=never_generated(model, prompt, 7))
    assert str(error) == (
        "generate produced 7 new tokens after the 58-token prompt, and feeding the last one back would need position "
        "64, but config.max_position_embeddings is 64 (positions 0 to 63): at most 7 new tokens fit after this "
        "prompt. Pass max_new_tokens=7 or fewer (generate stopped before this step's compute)"
    )
    assert forwards == 8  # the prefill, the 6 steps that fit, and the refused one


class Never(StoppingCriteria):
    """A stopping criterion of the caller's that never stops: generate may not be refused up front."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool) if transformers.__version__ >= "4.39" else False


def test_a_prompt_that_overflows_at_prefill_gets_the_model_forwards_error(model):
    """A 65-token prompt with a stopping criterion of the caller's: the prefill itself passes the table, so there is
    nothing generated to tell of; generate raises the model forward's own error, unchanged."""
    prompt = prompt_of(65)
    with torch.no_grad(), pytest.raises(neofix.SequenceTooLongError) as direct:
        model(input_ids=prompt)
    error, forwards = overflow(model, prompt, max_new_tokens=1, stopping_criteria=StoppingCriteriaList([Never()]))
    assert str(error) == str(direct.value)
    assert forwards == 1


def test_an_error_already_told_in_generate_terms_is_not_retold(model):
    """A generate running inside another (an assistant model's, during assisted generation) tells its overflow in its
    own terms; the outer generate, with its own prompt length, passes that error on as it is."""
    prompt = prompt_of(TABLE)
    error, _ = overflow(model, prompt, max_new_tokens=3, eos_token_id=never_generated(model, prompt, 1))
    assert _wrappers._in_generate_terms(error, 60) is error
    assert str(error) == ONE_TOKEN


def test_an_eos_list_may_end_generation_so_nothing_is_refused_up_front(model):
    """``eos_token_id=[a, b]`` can end generation as an int can: the run starts, and the overflowing step raises."""
    prompt = prompt_of(TABLE)
    never = never_generated(model, prompt, 1)
    error, forwards = overflow(model, prompt, max_new_tokens=3, eos_token_id=[never, never])
    assert str(error) == ONE_TOKEN and forwards == 2


def test_an_empty_eos_list_is_no_eos_and_is_refused_up_front(model):
    error, forwards = overflow(model, prompt_of(TABLE), max_new_tokens=3, eos_token_id=[])
    assert forwards == 0
    assert str(error).startswith(
        "generate cannot run within config.max_position_embeddings=64: no eos_token_id, so it runs to max_length=67"
    )


@pytest.mark.parametrize(
    "length, kwargs, message",
    [
        (
            65,
            dict(max_new_tokens=1),
            "generate cannot run within config.max_position_embeddings=64: the 65-token prompt itself, which needs 65 "
            "positions; the 65-token prompt alone is longer than that: shorten it",
        ),
        (
            64,
            dict(max_new_tokens=3, min_new_tokens=2),
            "generate cannot run within config.max_position_embeddings=64: min_new_tokens=2 forces 2 new tokens, "
            "which needs 65 positions; at most 1 new token fits after this 64-token prompt",
        ),
    ],
    ids=["prompt too long", "two forced tokens after a full prompt"],
)
def test_what_cannot_run_is_refused_with_the_whole_reason(model, length, kwargs, message):
    error, forwards = overflow(model, prompt_of(length), **kwargs)
    assert str(error) == message
    assert forwards == 0


def test_a_full_table_prompt_may_generate_its_one_token(model):
    """64 prompt tokens and ``max_new_tokens=1``: it fits exactly, and matches the full-recompute reference."""
    prompt = prompt_of(TABLE)
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference_greedy(model, prompt, None, 1))


EMPTY = (
    "generate was given a prompt of 0 tokens: the model needs at least one token to continue from. Start from the "
    "tokenizer's bos_token_id (input_ids=torch.tensor([[tokenizer.bos_token_id]])), or pass no input_ids and let "
    "generate start from config.bos_token_id"
)


@pytest.mark.parametrize("keyword", ["input_ids", "inputs"])
def test_an_empty_prompt_passed_by_keyword_is_refused(model, keyword):
    with Forwards(model) as forwards, pytest.raises(neofix.InputShapeError) as raised:
        model.generate(**{keyword: ones(1, 0)}, max_new_tokens=3, pad_token_id=0)
    assert str(raised.value) == EMPTY
    assert forwards.count == 0


# -- right padding at the start of decoding --------------------------------------------------------------------------


def right_padded_mask(width, rows):
    """Three rows of a 5-token prompt; ``rows`` end in 2 columns of padding, then the new tokens."""
    mask = ones(3, width)
    for row in rows:
        mask[row, 3:5] = 0
    return mask


def described(rows):
    named, them = ("row 1", "that row") if rows == (1,) else ("rows 0, 2", "those rows")
    return (
        f"decoding continues from a cache whose prompt had right padding in {named}: the prompt's last column there "
        f"is padding, so the next token of {them} was predicted from a pad, not from its last real token"
    )


FIX = "pad prompts on the left (tokenizer.padding_side = 'left') before decoding"


@pytest.mark.parametrize("rows", [(1,), (0, 2)], ids=["one row", "two rows"])
def test_decoding_from_a_right_padded_prompt_is_an_error_in_strict_mode(model, strict, rows):
    with torch.no_grad():
        cache = output_cache(model(input_ids=ones(3, 5), attention_mask=right_padded_mask(5, rows), use_cache=True))
        with pytest.raises(neofix.MaskValueError) as raised:
            model(input_ids=ones(3, 1), attention_mask=right_padded_mask(6, rows), past_key_values=cache, use_cache=True)
    assert str(raised.value) == f"{described(rows)}: {FIX}"


@pytest.mark.parametrize("rows", [(1,), (0, 2)], ids=["one row", "two rows"])
def test_decoding_from_a_right_padded_prompt_warns_once_in_repair_mode(model, rows):
    with torch.no_grad():
        cache = output_cache(model(input_ids=ones(3, 5), attention_mask=right_padded_mask(5, rows), use_cache=True))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for width in (6, 7):
                out = model(
                    input_ids=ones(3, 1), attention_mask=right_padded_mask(width, rows), past_key_values=cache,
                    use_cache=True,
                )
                cache = output_cache(out)
    told = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    assert told == [f"neofix: {described(rows)}. To fix: {FIX}. Reported once."]


@requires("attention layers get the whole cache")  # (before 4.45 GPT-Neo returns a new tuple at every step)
@pytest.mark.parametrize("again", ["unpadded", "right-padded"])
def test_a_cache_used_again_from_its_start_is_judged_by_its_new_prompt(model, strict, again):
    """A cache a right-padded prompt filled, cropped to nothing and filled again (a cache kept for the next request):
    its steps are judged by the new prompt.  Unpadded, they decode as from a fresh cache (the old prompt's right
    padding was still said, in strict mode a MaskValueError); right-padded, they are refused as it is."""
    from transformers import DynamicCache

    keyword = cache_keyword(model)
    second = ones(3, 5) if again == "unpadded" else right_padded_mask(5, (1,))

    def prompt_then_step(cache):
        filled = output_cache(model(input_ids=ones(3, 5), attention_mask=second, use_cache=True, **{keyword: cache}))
        return model(input_ids=ones(3, 1), attention_mask=torch.cat([second, ones(3, 1)], -1), use_cache=True,
                     **{keyword: filled}).logits

    with torch.no_grad():
        cache = output_cache(
            model(input_ids=ones(3, 5), attention_mask=right_padded_mask(5, (0, 2)), use_cache=True,
                  **{keyword: DynamicCache()})
        )
        cache.crop(-cache.get_seq_length())  # (4.x also reads crop(0) so; 5.x only this)
        assert cache.get_seq_length() == 0
        if again == "right-padded":
            with pytest.raises(neofix.MaskValueError, match="right padding in row 1:"):
                prompt_then_step(cache)
            return
        assert torch.equal(prompt_then_step(cache), prompt_then_step(DynamicCache()))


def test_a_right_padded_prompt_run_with_return_dict_false_is_still_followed(model, strict):
    """``return_dict=False`` returns ``(hidden, cache)``: the cache in that tuple is the one followed."""
    with torch.no_grad():
        out = model(input_ids=ones(3, 5), attention_mask=right_padded_mask(5, (1,)), use_cache=True, return_dict=False)
        with pytest.raises(neofix.MaskValueError, match="right padding in row 1"):
            model(input_ids=ones(3, 1), attention_mask=right_padded_mask(6, (1,)), past_key_values=out[1], use_cache=True)


def test_a_right_padded_forward_without_a_cache_returns_what_vanilla_does(model, strict):
    """``use_cache=False, return_dict=False``: a one-element tuple, no cache to follow; nothing but the output."""
    call = lambda: model(input_ids=ones(3, 5), attention_mask=right_padded_mask(5, (1,)), use_cache=False, return_dict=False)  # noqa: E731
    with torch.no_grad():
        out = call()
        with neofix.unpatched():
            plain = call()
    assert len(out) == len(plain) == 1 and torch.equal(out[0], plain[0])


def test_other_caches_decode_undisturbed_while_a_right_padded_one_lives(model, strict):
    """A right-padded prompt's cache is remembered; decoding from any other cache is not affected by it."""
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        padded = output_cache(model(input_ids=ones(3, 5), attention_mask=right_padded_mask(5, (1,)), use_cache=True))
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(out, reference_greedy(model, ids, mask, 4))
    del padded


def test_dropped_caches_and_positions_leave_no_bookkeeping_behind(model):
    """What neofix remembers per right-padded cache and per generate-built position tensor goes with the object."""
    gc.collect()
    padded_before, trusted_before = len(_wrappers._RIGHT_PADDED), len(_wrappers._TRUSTED)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = output_cache(model(input_ids=ones(3, 5), attention_mask=right_padded_mask(5, (1,)), use_cache=True))
        assert len(_wrappers._RIGHT_PADDED) == padded_before + 1
        del cache
        ids = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4]])
        mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
        model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    gc.collect()
    assert len(_wrappers._RIGHT_PADDED) == padded_before
    assert len(_wrappers._TRUSTED) == trusted_before



@requires("GPT-J rotary positions")
@pytest.mark.parametrize("given", [False, True], ids=["given none", "given the mask's"])
def test_a_rotary_prompts_cache_leaves_no_bookkeeping_behind_once_dropped(given):
    """Which positions a rotary cache was built with (transformers' own: a prompt given none; the mask's: a left-padded
    prompt given them) is remembered per cache, and goes with it, as the right-padded caches' bookkeeping does; a
    forward that returns no cache (``use_cache=False``, ``return_dict=False``: a one-element tuple) marks nothing and
    runs as vanilla."""
    from neofix.testing import reference_positions, tiny_model

    lm = tiny_model("gptj", seed=0, dtype=torch.float32)  # (takes rotary positions on every release; tuples up to 4.35)
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    kwargs = dict(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask) if given else None)
    gc.collect()
    before = len(_wrappers._BUILT)
    with torch.no_grad():
        cache = output_cache(lm(**kwargs, use_cache=True))
        assert _wrappers._built(cache) == ("mask" if given else "columns")
        assert len(_wrappers._BUILT) > before
        del cache
        gc.collect()
        assert len(_wrappers._BUILT) == before
        patched = lm(**kwargs, use_cache=False, return_dict=False)
        with neofix.unpatched():
            plain = lm(**kwargs, use_cache=False, return_dict=False)
    assert len(patched) == len(plain) and all(torch.equal(a, b) for a, b in zip(patched, plain))
    assert len(_wrappers._BUILT) == before


@requires("GPT-J rotary positions")
def test_a_rotary_cache_used_again_by_a_prompt_that_tells_nothing_forgets_its_mark():
    """A rotary cache is marked with the positions its prompt was given (none: transformers' own); reset and used again
    by a prompt whose positions agree with both schemes (no pad), it is marked with nothing, so the steps after it are
    judged as after any cache, not by the first prompt's positions."""
    from neofix.testing import tiny_model

    lm = tiny_model("gptj", seed=0, dtype=torch.float32)
    ids, mask = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4]]), torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad():
        cache = output_cache(lm(input_ids=ids, attention_mask=mask, use_cache=True))
        assert _wrappers._built(cache) == "columns"
        if not hasattr(cache, "reset"):
            pytest.skip(f"transformers {transformers.__version__}: the cache has no reset() (a tuple, or before 4.56)")
        cache.reset()
        if cache.get_seq_length():
            pytest.skip(f"transformers {transformers.__version__}: reset() keeps the keys: the cache cannot start over")
        unpadded = torch.ones_like(mask)
        lm(input_ids=ids, attention_mask=unpadded, position_ids=torch.arange(4)[None], past_key_values=cache)
    assert _wrappers._built(cache) is None


# -- legacy tuple caches -----------------------------------------------------------------------------------------------


@pytest.mark.skipif(not gpt_neo.ADAPTER.legacy_cache_rejected, reason="only transformers 4.54 and later reject tuple caches")
def test_a_legacy_tuple_cache_is_wrapped_with_one_warning(model):
    """Repair mode: the tuple is wrapped in a DynamicCache, the step computes what the Cache object would, and the
    warning (whole text) is given once."""
    _errors.reset_warnings()
    with torch.no_grad():
        cache = output_cache(model(input_ids=ones(2, 5), use_cache=True))
        tuples = tuple((layer.keys, layer.values) for layer in cache.layers) if has("Cache objects") else cache
        expected = model(input_ids=ones(2, 1), past_key_values=cache, use_cache=True).logits
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = model(input_ids=ones(2, 1), past_key_values=tuples, use_cache=True).logits
            again = tuple((key[..., :5, :], value[..., :5, :]) for key, value in tuples)
            chunk = model(input_ids=ones(2, 2), attention_mask=ones(2, 7), past_key_values=again, use_cache=True).logits
        cache = output_cache(model(input_ids=ones(2, 5), use_cache=True))
        expected_chunk = model(input_ids=ones(2, 2), attention_mask=ones(2, 7), past_key_values=cache, use_cache=True)
    assert torch.equal(got, expected)
    assert torch.equal(chunk, expected_chunk.logits)
    told = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    assert told == [
        f"neofix: a legacy tuple cache was passed, which transformers {transformers.__version__} no longer accepts; "
        f"wrapped it in a DynamicCache. Reported once."
    ]


@pytest.mark.skipif(not gpt_neo.ADAPTER.legacy_cache_rejected, reason="only transformers 4.54 and later reject tuple caches")
@pytest.mark.parametrize("keyword", sorted({"past_key_values", cache_keyword(transformers.GPTNeoModel)}))
def test_a_legacy_tuple_given_to_the_base_model_goes_back_under_the_callers_keyword(model, keyword):
    """The base model called with a tuple cache under either name it takes (5.x: ``cache``, and ``past_key_values``,
    deprecated): the wrapped cache is passed on under that name, and the step computes what the Cache object would."""
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cache = output_cache(model.transformer(input_ids=ones(2, 5), use_cache=True))
        tuples = tuple((layer.keys, layer.values) for layer in cache.layers) if has("Cache objects") else cache
        got = model.transformer(input_ids=ones(2, 1), attention_mask=ones(2, 6), use_cache=True, **{keyword: tuples})
        expected = model.transformer(
            input_ids=ones(2, 1), attention_mask=ones(2, 6), use_cache=True, **{cache_keyword(model.transformer): cache}
        )
    assert torch.equal(got.last_hidden_state, expected.last_hidden_state)
    assert _caches.length(output_cache(got)) == 6


# -- the base model called directly ------------------------------------------------------------------------------------


def test_a_loop_on_the_base_model_passing_past_key_values_computes_what_vanilla_does(model):
    """``model.transformer(..., past_key_values=cache)`` (the keyword every release accepts, deprecated for ``cache``
    on 5.x), one token per step: exactly vanilla's hidden states."""
    ids = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])

    def loop():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = model.transformer(input_ids=ids, attention_mask=ones(2, 4), use_cache=True)
            hidden, cache = [out.last_hidden_state], output_cache(out)
            for step in range(3):
                out = model.transformer(
                    input_ids=ones(2, 1) * (step + 9), attention_mask=ones(2, 5 + step), past_key_values=cache,
                    use_cache=True,
                )
                hidden.append(out.last_hidden_state)
                cache = output_cache(out)
        return torch.cat(hidden, dim=1)

    patched = loop()
    with neofix.unpatched():
        plain = loop()
    assert torch.equal(patched, plain)


def test_the_base_model_without_a_cache_computes_what_the_head_feeds_on(model):
    """``model.transformer(input_ids, attention_mask)`` called directly, no cache keyword at all: the same hidden
    states the causal-LM head gets (left padding: positions from the mask in both)."""
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hidden = model.transformer(input_ids=ids, attention_mask=mask).last_hidden_state
        through_head = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
    assert torch.equal(hidden, through_head)


def test_a_chunk_after_a_cache_without_a_mask_continues_the_sequence(model):
    """Three new tokens after a 4-token cache and no attention mask: the logits of one 7-token forward."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18]])
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :4], use_cache=True))
        chunk = model(input_ids=ids[:, 4:], past_key_values=cache, use_cache=True).logits
        whole = model(input_ids=ids).logits[:, 4:]
    torch.testing.assert_close(chunk, whole, rtol=0, atol=1e-5)


def test_transformers_positions_are_kept_where_configured(model):
    """``uncached_positions='transformers'``: a left-padded forward without a cache computes exactly what vanilla
    computes (no positions derived from the mask, nothing warned)."""
    ids = torch.tensor([[5, 6, 7, 8], [0, 0, 3, 4]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])
    neofix.configure(uncached_positions="transformers")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patched = model(input_ids=ids, attention_mask=mask).logits
    with torch.no_grad(), neofix.unpatched():
        plain = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(patched, plain)
    assert [w for w in caught if issubclass(w.category, neofix.NeofixWarning)] == []


# -- what the model forward and generate pass through unread ----------------------------------------------------------


@pytest.mark.parametrize("call", ["head", "base model"])
def test_one_dimensional_input_ids_run_as_vanilla_runs_them(model, call):
    """transformers up to 4.44 reads 1D ``input_ids`` as one row (4.26 completes the forward, 4.40 fails with an
    ``IndexError``); neofix passes them through unread, so the outcome is vanilla's, logits or error alike.  From
    4.45 vanilla fails inside the model (``The size of tensor a (4) must match ...``) and neofix says why instead."""
    ids = torch.tensor([5, 6, 7, 8])
    forward = (lambda: model(input_ids=ids).logits) if call == "head" else (lambda: model.transformer(ids)[0])
    patched, _ = outcome(model, forward)
    with neofix.unpatched():
        plain, _ = outcome(model, forward)
    if gpt_neo.ADAPTER.flat_input_ids_accepted:
        if isinstance(plain, torch.Tensor):
            assert isinstance(patched, torch.Tensor) and torch.equal(patched, plain)
        else:
            assert (type(patched), str(patched)) == (type(plain), str(plain))
        if _compat.release() < (4, 27):
            assert isinstance(plain, torch.Tensor)  # the path ran: vanilla's logits, compared above
    else:
        assert isinstance(patched, neofix.InputShapeError) and str(patched) == (
            "input_ids has shape (4,), but the model expects (batch, new_tokens): add the batch dimension "
            "(input_ids[None]) or flatten extra ones"
        )
        assert type(plain) is RuntimeError


def test_generate_without_a_prompt_starts_from_bos_as_vanilla(model):
    """``generate()`` given no prompt at all starts from ``bos_token_id`` (token 0 here): neofix cannot measure a
    prompt it does not see, and passes the call on; the tokens are vanilla's and the full recompute's.  (The pad is
    not the bos here: generate would mask the one prompt token.)"""
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=95, eos_token_id=None)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        patched = model.generate(**kwargs)
        with neofix.unpatched():
            plain = model.generate(**kwargs)
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(model, torch.tensor([[0]]), max_new_tokens=4))


# -- the causal-mask helpers of transformers 4.36 - 4.51, for float64 models -------------------------------------------

HELPERS = ["_prepare_4d_causal_attention_mask", "_prepare_4d_causal_attention_mask_for_sdpa"]


@pytest.mark.parametrize("widen", [False, True], ids=["float32 mask", "widened"])
@pytest.mark.parametrize("helper", HELPERS)
def test_a_float64_models_causal_mask_is_built_in_float32_and_widened_where_asked(helper, widen):
    """The wrapped helper builds a float64 model's mask from float32 embeddings (vanilla fills a float32 tensor with
    float64's minimum and overflows on 4.36 - 4.44): GPT-Neo and BLOOM get that float32 mask; GPT-2 and OPT, whose
    scores are float64, get it widened to the float64 mask the helper meant, float32's minimum made float64's."""
    utils = pytest.importorskip("transformers.modeling_attn_mask_utils", reason="helpers of transformers >= 4.36")
    original = getattr(utils, helper)
    wrapped = _wrappers.make_prepare_4d_mask_for_float64(original, None, widen=widen)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])  # left padding: the sdpa helper returns a mask, not None
    embeds = torch.zeros(2, 4, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="cannot be converted to type float without overflow"):
        original(mask, (2, 4), embeds, 0)  # what the wrapper is for (the helper is the same on 4.36 - 4.57)
    built = wrapped(mask, (2, 4), embeds, 0)
    as_float32 = original(mask, (2, 4), embeds.float(), 0)
    assert as_float32.dtype == torch.float32
    masked = as_float32 == torch.finfo(torch.float32).min
    assert masked.any() and not masked.all()
    if widen:
        assert built.dtype == torch.float64
        assert torch.equal(built == torch.finfo(torch.float64).min, masked)
        assert torch.equal(built.masked_fill(masked, 0), as_float32.double().masked_fill(masked, 0))
    else:
        assert torch.equal(built, as_float32)
    # by keyword, as some modules call it; and a float32 model's call is the helper's own
    assert torch.equal(wrapped(attention_mask=mask, input_shape=(2, 4), inputs_embeds=embeds, past_key_values_length=0),
                       built)
    assert torch.equal(wrapped(mask, (2, 4), embeds.float(), 0), as_float32)


@pytest.mark.parametrize("patched", [True, False])
def test_an_argument_given_twice_is_vanillas_type_error(model, patched):
    """A positional argument also given by keyword raises transformers' own ``TypeError`` with neofix as without it
    (the wrapper reads every argument by name: it must not let the keyword silently win)."""
    ids = torch.ones(1, 3, dtype=torch.long)
    context = contextlib.nullcontext() if patched else neofix.unpatched()
    with context, pytest.raises(TypeError, match="got multiple values for argument 'input_ids'"):
        model.transformer(ids, input_ids=ids)
