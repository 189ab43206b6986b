"""generate near the end of the position table, and with static caches: never refused where vanilla completes.

A model with 64 positions (``neofix.testing.tiny_gpt_neo``; eos 0).  generate may be asked for more tokens than fit,
and still complete: an end-of-sequence token, a stopping criterion of the caller's, or a shorter limit transformers
resolves from the generation config can end it in time.  neofix refuses before any forward only what cannot possibly
run; a run that does go past the table raises :class:`neofix.SequenceTooLongError` at the step that would, before its
compute (vanilla: ``IndexError: index out of range in self`` at that same step).  Every completed run is compared with
vanilla's output, token for token.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import transformers
from transformers import StoppingCriteria, StoppingCriteriaList

import neofix
from neofix.testing import reference_greedy, tiny_gpt_neo

from ._versions import cache_keyword, has, requires
from .loops import patched_and_vanilla
from .test_static_cache import static_cache as empty_static_cache

PROMPT = 58  # of 64 positions: 7 new tokens fit (the last one generated is never fed back)


@pytest.fixture(scope="module")
def model():
    """float32: transformers 4.36 - 4.44 cannot run GPT-Neo in float64 unpatched, and every test runs vanilla too."""
    return tiny_gpt_neo(seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt():
    return torch.randint(1, 96, (1, PROMPT), generator=torch.Generator().manual_seed(3))


class Forwards:
    def __init__(self, model):
        self.model, self.count = model, 0

    def __enter__(self):
        self.handle = self.model.transformer.register_forward_pre_hook(lambda *_: setattr(self, "count", self.count + 1))
        return self

    def __exit__(self, *_):
        self.handle.remove()


def outcome(model, call):
    """``(tokens or the exception, forwards run)`` of ``call()``."""
    with Forwards(model) as forwards, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            result = call()
        except Exception as exc:  # noqa: BLE001 - the outcome is compared
            result = exc
    return result, forwards.count


def both(model, call):
    """The patched outcome, then vanilla's."""
    return patched_and_vanilla(lambda: outcome(model, call))


def first_token(model, prompt):
    with torch.no_grad():
        return int(model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)[0, -1])


class AfterLength(StoppingCriteria):
    """Stops once sequences reach ``length`` tokens."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        done = input_ids.shape[-1] >= self.length
        if transformers.__version__ >= "4.39":  # a per-row answer from 4.39 on
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)
        return done


def test_eos_within_the_table_completes_as_vanilla(model, prompt):
    """Asked for 10 tokens where 7 fit, but the first token is EOS: vanilla completes, so neofix must too."""
    eos = first_token(model, prompt)
    call = lambda: model.generate(prompt, max_new_tokens=10, eos_token_id=eos, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, _), (plain, _) = both(model, call)
    assert isinstance(plain, torch.Tensor) and plain.shape == (1, PROMPT + 1)
    assert isinstance(patched, torch.Tensor) and torch.equal(patched, plain)


def test_a_stopping_criterion_within_the_table_completes_as_vanilla(model, prompt):
    criteria = lambda: StoppingCriteriaList([AfterLength(PROMPT + 3)])  # noqa: E731
    call = lambda: model.generate(  # noqa: E731
        prompt, max_length=80, stopping_criteria=criteria(), do_sample=False, pad_token_id=0, eos_token_id=None
    )
    (patched, _), (plain, _) = both(model, call)
    assert isinstance(plain, torch.Tensor) and plain.shape == (1, PROMPT + 3)
    assert isinstance(patched, torch.Tensor) and torch.equal(patched, plain)


def test_lengths_are_the_ones_transformers_resolved(model, prompt):
    """generation_config.max_new_tokens=4 with a max_length=80 argument: transformers decides which wins (4 new tokens
    from 4.3x on, 80 before), and neofix follows: the same tokens, or the same step failing."""
    model.generation_config.max_new_tokens = 4
    try:
        call = lambda: model.generate(prompt, max_length=80, do_sample=False, pad_token_id=0, eos_token_id=None)  # noqa: E731
        (patched, steps), (plain, plain_steps) = both(model, call)
    finally:
        model.generation_config.max_new_tokens = None
    if isinstance(plain, torch.Tensor):
        assert plain.shape == (1, PROMPT + 4)
        assert isinstance(patched, torch.Tensor) and torch.equal(patched, plain)
    else:  # max_length won: vanilla runs out of positions; neofix refuses up front (no EOS: it runs to max_length)
        assert isinstance(plain, IndexError) and plain_steps > 1
        assert isinstance(patched, neofix.SequenceTooLongError) and steps == 0, patched


def test_overflow_is_reported_at_the_step_that_would_pass_the_table(model, prompt):
    """EOS could end it (so it may not be refused), but does not come: the step that would need position 64 raises
    before its compute, after the 7 tokens that fit; vanilla computes the same steps, then an IndexError."""
    with torch.no_grad():  # the 7 tokens that fit, then an EOS that is none of them
        fitting = model.generate(prompt, max_new_tokens=7, eos_token_id=None, do_sample=False, pad_token_id=0)
    never = next(token for token in range(1, 96) if token not in fitting[0, PROMPT:].tolist())
    call = lambda: model.generate(prompt, max_new_tokens=10, eos_token_id=never, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, steps), (plain, plain_steps) = both(model, call)
    assert isinstance(plain, IndexError) and "index out of range in self" in str(plain)
    assert isinstance(patched, neofix.SequenceTooLongError), patched
    assert steps == plain_steps == 64 - PROMPT + 2  # the prefill, the steps that fit, and the failing one
    message = str(patched)
    assert "generate produced 7 new tokens after the 58-token prompt" in message
    assert "would need position 64, but config.max_position_embeddings is 64" in message
    assert "at most 7 new tokens fit after this prompt. Pass max_new_tokens=7 or fewer" in message


def test_an_overflow_after_a_padded_prompt_counts_its_columns(model, prompt):
    """GPT-Neo's attention holds at most ``max_position_embeddings`` columns, pads included: after a left-padded
    prompt the step that overflows is told in columns (it said "would need position 64", a position no real token of
    the row reaches), with the same fit."""
    padded, mask = prompt.clone(), torch.ones_like(prompt)
    padded[:, :5], mask[:, :5] = 0, 0
    with torch.no_grad():
        fitting = model.generate(padded, attention_mask=mask, max_new_tokens=7, eos_token_id=None, do_sample=False,
                                 pad_token_id=0)
    never = next(token for token in range(1, 96) if token not in fitting[0, PROMPT:].tolist())
    with pytest.raises(neofix.SequenceTooLongError) as raised, torch.no_grad():
        model.generate(padded, attention_mask=mask, max_new_tokens=10, eos_token_id=never, do_sample=False,
                       pad_token_id=0)
    assert str(raised.value) == (
        "generate produced 7 new tokens after the 58-token prompt, and feeding the last one back would make the "
        "sequence 65 columns long, but this model's attention holds at most config.max_position_embeddings = 64 "
        "columns, the prompt's padding included: at most 7 new tokens fit after this prompt. Pass max_new_tokens=7 or "
        "fewer (generate stopped before this step's compute)"
    )


def test_no_eos_runs_to_max_length_and_is_refused_up_front(model, prompt):
    call = lambda: model.generate(prompt, max_new_tokens=10, eos_token_id=None, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, steps), (plain, plain_steps) = both(model, call)
    assert isinstance(plain, IndexError) and plain_steps == 64 - PROMPT + 2
    assert isinstance(patched, neofix.SequenceTooLongError) and steps == 0, "a forward ran before the refusal"
    assert re.search(r"no eos_token_id, so it runs to max_length=68, which needs 67 positions", str(patched))
    assert "at most 7 new tokens fit after this 58-token prompt" in str(patched)


@pytest.mark.parametrize(
    "kwargs, why", [(dict(min_new_tokens=8), "min_new_tokens=8 forces 8 new tokens"), (dict(min_length=67), "min_length=67")]
)
def test_minimum_lengths_past_the_table_are_refused_up_front(model, prompt, kwargs, why):
    call = lambda: model.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0, **kwargs)  # noqa: E731
    (patched, steps), (plain, _) = both(model, call)
    assert isinstance(plain, IndexError)
    assert isinstance(patched, neofix.SequenceTooLongError) and steps == 0
    assert why in str(patched) and "at most 7 new tokens fit" in str(patched)


def test_a_minimum_that_fits_runs_as_vanilla(model, prompt):
    call = lambda: model.generate(prompt, max_new_tokens=10, min_new_tokens=7, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, _), (plain, _) = both(model, call)
    if isinstance(plain, torch.Tensor):  # EOS after the 7th token ends it; else both run past the table
        assert isinstance(patched, torch.Tensor) and torch.equal(patched, plain)
    else:
        assert isinstance(patched, neofix.SequenceTooLongError), patched


def test_a_prompt_longer_than_the_table_is_refused_up_front(model):
    call = lambda: model.generate(torch.ones(1, 65, dtype=torch.long), max_new_tokens=1, pad_token_id=0)  # noqa: E731
    (patched, steps), (plain, _) = both(model, call)
    assert isinstance(plain, IndexError)
    assert isinstance(patched, neofix.SequenceTooLongError) and steps == 0
    assert "the 65-token prompt alone is longer than that: shorten it" in str(patched)


# -- static caches ------------------------------------------------------------------------------------------------


def batch():
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [0, 0, 3, 4, 5, 6]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    return ids, mask


def static_generate(model, new=10):
    ids, mask = batch()
    kwargs = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    return lambda: model.generate(ids, cache_implementation="static", **kwargs)


@requires("static caches")
def test_static_cache_is_token_identical_to_vanilla():
    """An all-global model: transformers' static cache is right, and neofix leaves it exactly as it is (the 4D mask
    generate builds covers the cache's slots, not the tokens so far)."""
    ids, mask = batch()
    patched, _ = outcome(model := tiny_gpt_neo(seed=0, attention_types=[[["global"], 4]]), static_generate(model))
    with neofix.unpatched():
        plain, _ = outcome(fresh := tiny_gpt_neo(seed=0, attention_types=[[["global"], 4]]), static_generate(fresh))
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(model, ids, mask, 10))


@requires("static caches")
def test_static_cache_with_local_layers_is_repaired():
    """transformers' GPT-Neo takes a local layer's window from the static cache's last slot, not from the token's
    position: with more slots than the window, vanilla gives wrong tokens; neofix takes it at the tokens' slots
    (tests/test_static_cache.py covers hand loops, beam search and torch.compile)."""
    ids, mask = batch()
    model = tiny_gpt_neo(seed=0)  # global and local layers, window 4
    with neofix.unpatched():
        plain, _ = outcome(model, static_generate(model))
    assert isinstance(plain, torch.Tensor) and not torch.equal(plain, reference_greedy(model, ids, mask, 10))
    model = tiny_gpt_neo(seed=0)  # a fresh one: generate keeps its static cache on the model
    patched, _ = outcome(model, static_generate(model))
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, reference_greedy(model, ids, mask, 10))


@requires("static caches")
def test_static_cache_within_the_window_runs():
    """No more slots than the window: the local layers see the right tokens, and neofix lets it run."""
    ids, mask = batch()
    model = tiny_gpt_neo(seed=0, window_size=15)
    patched, _ = outcome(model, static_generate(model))
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, reference_greedy(model, ids, mask, 10))


def static_cache(model, prompt=None):
    """A static cache of 16 slots for ``model``, filled with ``prompt`` (2 rows) where one is given."""
    cache = empty_static_cache(model, 2, 16)
    if prompt is not None:
        with torch.no_grad():
            model(input_ids=prompt, **{cache_keyword(model): cache})
    return cache


@requires("static caches")
@pytest.mark.parametrize("width", [5, 7, 16])
def test_a_static_caches_4d_mask_needs_a_column_per_slot(width):
    """A 4D mask given with a static cache spans its 16 slots (the keys do): with as many columns as the tokens so
    far (5) or any other width, every release's attention fails on the shapes (``The size of tensor a (16) must
    match the size of tensor b (5)``), so neofix refuses it by name; 16 columns run as vanilla runs them."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, attention_types=[[["global"], 4]])
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 1, 5, width, dtype=torch.bool).tril()
    call = lambda: model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): static_cache(model)}).logits
    patched, plain = both(model, call)
    if width == 16:
        assert isinstance(plain[0], torch.Tensor) and torch.equal(patched[0], plain[0])
        return
    assert isinstance(plain[0], RuntimeError) and "must match the size of tensor b" in str(plain[0])
    assert isinstance(patched[0], neofix.MaskLengthError)
    assert str(patched[0]) == (
        f"the 4D attention_mask has shape (2, 1, 5, {width}), but this step needs 5 rows of queries (one per new "
        f"token) and 16 columns, one per slot of the static cache: pass a mask of that shape, or pass the 2D (batch, "
        f"cached + new tokens) padding mask and let the model build the rest"
    )


@requires("static caches")
def test_a_static_cache_of_other_rows_or_heads_is_refused_by_name():
    """A static cache's rows and heads are read from its preallocated keys' shape: a step of 3 rows after a prompt
    of 2, or a cache another model (2 heads of width 16) filled, is refused before transformers' ``index_copy_``
    fails on the shapes."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, attention_types=[[["global"], 4]])
    other = tiny_gpt_neo(seed=0, dtype=torch.float32, attention_types=[[["global"], 4]], num_heads=2)
    prompt = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    keyword = cache_keyword(model)
    with torch.no_grad(), pytest.raises(neofix.BatchMismatchError) as rows:
        model(input_ids=torch.tensor([[1], [2], [3]]), attention_mask=torch.ones(3, 6, dtype=torch.long),
              **{keyword: static_cache(model, prompt)})
    assert str(rows.value) == (
        "the cache holds 2 rows, but this step feeds 3: the cache, attention_mask and inputs must hold the same rows "
        "(reorder or select the cache with the inputs, e.g. after beam search)"
    )
    with torch.no_grad(), pytest.raises(neofix.InputShapeError) as heads:
        model(input_ids=prompt[:, :1], attention_mask=torch.ones(2, 6, dtype=torch.long),
              **{keyword: static_cache(other, prompt)})
    assert str(heads.value) == (
        "the cache holds keys of 2 heads of width 16, but this model has 4 heads of width 8: the cache was built by "
        "another model. Pass the cache this model returned, or none (the prompt is then encoded again)"
    )


@requires("static caches")
def test_an_empty_static_caches_mask_wider_than_the_prompt_is_read_by_slot_as_vanilla_reads_it():
    """A static cache nothing was written to holds 0 tokens (known without reading the device); a 5-token prefill's
    2D mask of 7 columns (a loop's mask allocated up front, zeros past the prompt) is read by slot, as transformers
    reads a static cache's mask: its first 5 columns are the prompt.  It was refused as a longer mask whose readings
    differ; the logits are vanilla's, bit for bit.  Wider than the slots it is refused (see below)."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, attention_types=[[["global"], 4]])
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(2, 7, dtype=torch.long)
    mask[:, :5] = 1
    runs = []
    for context in (neofix.patched, neofix.unpatched):
        with context(), torch.no_grad():
            runs.append(model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): static_cache(model)}).logits)
    assert torch.equal(runs[0], runs[1])


@requires("static caches")
def test_a_hand_written_loop_on_a_static_cache_decodes_as_vanilla():
    """A prefill into a static cache, then decode steps with the 2D mask of the tokens so far: the cache's length is
    a tensor (not read), so neofix checks only what the shapes tell, and every step's logits are vanilla's."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, attention_types=[[["global"], 4]])
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(0))
    runs = []
    for context in (neofix.patched, neofix.unpatched):
        with context(), torch.no_grad():
            cache, fed, logits = static_cache(model), ids, []
            for step in range(3):
                mask = torch.ones(2, 5 + step, dtype=torch.long)
                out = model(input_ids=fed, attention_mask=mask, **{cache_keyword(model): cache})
                logits.append(out.logits)
                fed = out.logits[:, -1:].argmax(-1)
        runs.append(logits)
    for patched, plain in zip(*runs):
        assert torch.equal(patched, plain)


def test_static_caches_are_probed_right():
    """The feature flag above is not vacuous: GPT-Neo refuses static caches up to 4.53, runs them from 4.57 on."""
    from ._versions import TF_RELEASE

    if TF_RELEASE <= (4, 53) or TF_RELEASE >= (4, 57):
        assert has("static caches") == (TF_RELEASE >= (4, 57))


def test_a_prompt_of_embeddings_is_counted_as_the_prompt(model, prompt):
    """``generate(inputs_embeds=...)``: the embeddings' 58 tokens are the prompt, as 58 token ids would be, so the step
    that would pass the table is told after them.  Releases whose GPT-Neo cannot generate from embeddings (4.26 -
    4.30 refuse it with a ValueError) refuse it patched in the same words."""
    embeds = model.get_input_embeddings()(prompt).detach()
    call = lambda: model.generate(  # noqa: E731
        inputs_embeds=embeds, max_new_tokens=10, eos_token_id=None, do_sample=False, pad_token_id=0
    )
    (patched, steps), (plain, plain_steps) = both(model, call)
    if isinstance(plain, ValueError) and "inputs_embeds" in str(plain):  # measured: this release cannot
        assert type(patched) is type(plain) and str(patched) == str(plain) and steps == plain_steps == 0
        return
    assert isinstance(plain, IndexError) and "index out of range in self" in str(plain)
    assert isinstance(patched, neofix.SequenceTooLongError), patched
    assert steps == plain_steps == 64 - PROMPT + 2  # the prefill, the 7 steps that fit, and the failing one
    assert "generate produced 7 new tokens after the 58-token prompt" in str(patched)
    assert "at most 7 new tokens fit after this prompt. Pass max_new_tokens=7 or fewer" in str(patched)


@pytest.mark.parametrize("shape", ["one dimension", "no dimension", "a list"])
def test_a_prompt_that_is_not_a_batch_of_tensors_fails_as_vanilla_fails(model, prompt, shape):
    """generate given a 1-D prompt (no batch dimension), a 0-D one, or a Python list: every release fails inside
    generate with an error of its own words (4.30, a 1-D prompt: after a forward); patched, the same error in the
    same words, after as many forwards."""
    given = {"one dimension": prompt[0], "no dimension": prompt[0, 0], "a list": prompt.tolist()}[shape]
    call = lambda: model.generate(given, max_new_tokens=3, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, steps), (plain, plain_steps) = both(model, call)
    assert isinstance(plain, Exception) and steps == plain_steps
    assert type(patched) is type(plain) and str(patched) == str(plain)
