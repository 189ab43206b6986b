"""The modern decoders (Llama, Mistral): the step contract on a tiny random model of the family
(``neofix.testing.tiny_model(family)``: rotary positions, grouped-query attention, no position table; Mistral with a
sliding window of 4), with eager and sdpa attention.  ``tests/test_family_<name>.py`` runs these for one family (its
``family`` fixture), so that ``NEOFIX_TEST_FAMILIES`` selects it per release.

Every correctness check compares with the full-recompute reference token for token (float64, sharpened); what vanilla
does right (``generate``: greedy, beam, sampling; an unpadded hand loop) stays bit-identical.  Vanilla's outcome of
each classic mistake is asserted too, so that a release that fixes or changes one shows up here.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import transformers

import neofix
from neofix import _compat
from neofix._families import FAMILIES
from neofix.testing import FAMILY_CONFIGS, reference_greedy, reference_positions, tiny_model

from ._versions import TF, TF_RELEASE, cache_keyword, output_cache
from .loops import decode, left_padded_batch, patched_and_vanilla
from .test_families import run  # call() with warnings recorded: (result or error, NeofixWarning messages)



def skip_unless_available(family: str, since: str) -> None:
    """Skip the calling test module where the installed transformers lacks the family."""
    if not hasattr(transformers, FAMILY_CONFIGS[family][0]):
        title = FAMILIES[family].title
        pytest.skip(f"transformers {TF} has no {title} (it arrived in {since})", allow_module_level=True)
    if not FAMILIES[family].patched_here():
        pytest.skip(f"transformers {TF}: {FAMILIES[family].targets[0].why}", allow_module_level=True)

STEPS = 8
ROWS = [6, 3, 5]
def stale_mask_silent(family):
    """Whether vanilla pads a mask shorter than cache plus input with zeros on the right (masking_utils, from 4.53;
    Qwen2-MoE, which builds its own mask up to 4.57, from 5.0; Falcon, which builds its own up to 5.1, from 5.2): a
    stale mask is silently wrong there (measured on 4.53, 4.57, 5.x; Falcon on 5.1 and 5.2); before, it fails on the
    shapes."""
    return TF_RELEASE >= {"qwen2_moe": (5, 0), "falcon": (5, 2)}.get(family, (4, 53))


def legacy_tuples_rejected(family):
    """Whether the forward rejects legacy tuple caches: from 4.48 (Qwen2-MoE and Falcon from 4.54, read in the sources
    and measured on 4.53 and 4.55); before, it converts them itself with a deprecation warning (Falcon up to 4.44 takes
    nothing else)."""
    return TF_RELEASE >= ((4, 54) if family in ("qwen2_moe", "falcon") else (4, 48))


def takes_cache_position(family):
    """The forward takes cache_position: Llama from 4.38, Mistral and Qwen2 from 4.42, up to 5.3; from 5.4 none."""
    causal_lm = getattr(transformers, FAMILY_CONFIGS[family][1])
    return "cache_position" in inspect.signature(causal_lm.forward).parameters


def own_cache_too_small(family):
    """Gemma2 and Gemma3 up to 4.52: the forward given no cache builds a static HybridCache as long as the prompt, so
    a hand loop's next step does not fit (vanilla: a shape RuntimeError; neofix: CacheLengthError, see
    :func:`test_a_hand_loop_on_the_models_own_hybrid_cache_is_a_clear_error`)."""
    return family in ("gemma2", "gemma3") and TF_RELEASE < (4, 53)


def hybrid_cache_misreads_left_padding(family):
    """Gemma2 up to 4.47: its HybridCache decodes left-padded rows wrong, in generate too (transformers PR 35681)."""
    return family == "gemma2" and TF_RELEASE < (4, 48)


def hand_loop(test):
    """A test of a hand-written loop on the model's own cache (skipped where :func:`own_cache_too_small`)."""
    test.hand_loop = True
    return test


def left_padded_generate(test):
    """A test of generate on a left-padded batch (skipped where :func:`hybrid_cache_misreads_left_padding`)."""
    test.left_padded_generate = True
    return test


@pytest.fixture(autouse=True)
def what_vanilla_can_run(request, family):
    """Skips the tests :func:`hand_loop`, :func:`needs_cache_position` and :func:`left_padded_generate` mark where
    vanilla cannot run them."""
    title = FAMILIES[family].title
    if getattr(request.function, "hand_loop", False) and own_cache_too_small(family):
        pytest.skip(f"transformers {TF}: {title}'s own cache holds the prompt only, no hand loop runs (vanilla too)")
    if getattr(request.function, "cache_position", False) and not takes_cache_position(family):
        pytest.skip(f"transformers {TF}: {FAMILIES[family].causal_lm}.forward takes no cache_position")
    if getattr(request.function, "left_padded_generate", False) and hybrid_cache_misreads_left_padding(family):
        pytest.skip(f"transformers {TF}: {title}'s HybridCache misreads left padding; neofix refuses it (tested below)")


@pytest.fixture(scope="module", params=["first", pytest.param("second", marks=pytest.mark.slow)])
def lm(request, family):
    """The family's tiny model with sdpa attention ("first") and with eager ("second"); a family without sdpa on
    this release (Gemma2 on 5.x, Mistral on 4.36, Llama on 4.30) runs eager first and skips the second.  The second
    is marked slow (run on the oldest and the newest release: tox.ini), which halves these scenarios elsewhere.

    float64 with sdpa; float32 with eager attention, whose softmax runs in float32: float64's most negative mask value
    becomes -inf there, so a left-padded row's pad queries see no key, their softmax is NaN, and the NaN reaches every
    token of the row through the values (vanilla 4.45 and 5.24 alike; neofix leaves it).  float32 with sdpa too where
    vanilla cannot run float64 (:func:`float64_mask_overflows`)."""
    causal_lm = getattr(transformers, FAMILY_CONFIGS[family][1])
    sdpa = getattr(causal_lm, "_supports_sdpa", TF_RELEASE >= (4, 36))  # (before 4.36: eager attention only)
    kinds = ["sdpa", "eager"] if sdpa else ["eager"]
    if request.param == "second" and len(kinds) == 1:
        pytest.skip(f"transformers {TF}: {FAMILIES[family].title} has no sdpa attention (eager only)")
    attention = kinds[0] if request.param == "first" else kinds[1]
    dtype = torch.float64 if attention == "sdpa" and not float64_mask_overflows(family) else torch.float32
    return tiny_model(family, seed=0, dtype=dtype, attn_implementation=attention)


def float64_mask_overflows(family):
    """Where the family builds its causal mask through transformers' float64-overflowing helper (Llama 4.36 - 4.37,
    Mistral 4.36 - 4.41, Qwen2 4.37 - 4.41: its float64 targets), vanilla cannot run a float64 model at all ("value
    cannot be converted to type float without overflow"), so these scenarios, which compare with vanilla, run in
    float32 there; neofix's float64 path is tested by ``tests/test_families.py``."""
    return any(
        target.wrapper.startswith("make_prepare_4d_") and _compat.in_range(target.since, target.until)
        for target in FAMILIES[family].targets
    )


def reference(model, ids, mask, steps=STEPS):
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1] :]


def vanilla(call):
    with neofix.unpatched():
        return run(call)[0]


def wrong_or_raises(outcome, expected):
    return not isinstance(outcome, torch.Tensor) or not torch.equal(outcome, expected)


def windowed(model):
    """Whether the model's own cache has sliding-window layers (Mistral, Gemma2, Gemma3; Qwen's window is off)."""
    config = model.config
    if getattr(config, "use_sliding_window", True) is False:
        return False
    return "sliding_attention" in (getattr(config, "layer_types", None) or ["sliding_attention"])


def layers_ran(model, call):
    """``(outcome of call(), whether the first decoder layer ran)``."""
    ran = []
    # (the base model is .model, or, for Falcon, .transformer, whose blocks are .h; base_model is not: Gemma3's causal
    # LM names another prefix on 4.57, and is its own base_model there)
    base = model.model if hasattr(model, "model") else model.transformer
    blocks = base.layers if hasattr(base, "layers") else base.h
    handle = blocks[0].register_forward_pre_hook(lambda *_: ran.append(True))
    try:
        return run(call)[0], bool(ran)
    finally:
        handle.remove()


# -- the patch ---------------------------------------------------------------------------------------------------------


def test_the_family_is_patched_without_a_position_limit(family):
    import importlib

    declared = FAMILIES[family]
    module = importlib.import_module(declared.module)
    base = getattr(module, declared.base_model)
    assert getattr(base.forward, "__neofix_wrapper__", False)
    states = {name: state for name, state, _ in neofix._lifecycle.status()}
    named = neofix._lifecycle.target_name
    # the float64 causal-mask helpers (Llama 4.36 - 4.37, Mistral and Phi 4.36 - 4.41, Qwen2 4.37 - 4.41): patched
    # where the release's module builds its mask through them, skipped elsewhere
    helpers = {
        named(declared, target): "patched"
        if _compat.in_range(target.since, target.until) and hasattr(module, target.attribute)
        else "skipped"
        for target in declared.targets[4:]
    }
    assert {named(declared, target): states[named(declared, target)] for target in declared.targets} == {
        f"{declared.base_model}.forward": "patched",
        f"{declared.causal_lm}.prepare_inputs_for_generation": "patched",
        f"{declared.causal_lm}.generate": "patched",
        f"{declared.causal_lm}._get_stopping_criteria": "skipped",  # rotary: no table to stop at
        **helpers,
    }
    adapter = declared.load_adapter()
    limits = adapter.limits(tiny_model(family).config)
    assert limits.max_positions is None
    # the key-value heads of the cache (grouped-query attention; Llama before 4.31 and Phi before 4.37 have none:
    # every query head's)
    every_head = (family == "llama" and TF_RELEASE < (4, 31)) or (family == "phi" and TF_RELEASE < (4, 37))
    heads = 1 if family == "falcon" else 4 if every_head else 2  # (Falcon's tiny model: multi-query attention)
    assert (limits.heads, limits.head_dim) == (heads, 8)


# -- hand-written loops against the reference --------------------------------------------------------------------------


@hand_loop
@pytest.mark.parametrize("positions", ["none", "correct", "full", "arange"])
def test_a_left_padded_loop_gives_the_reference(lm, positions):
    """Missing positions, the mask's, every token's so far (the last q taken) or arange over the padded width (rotary:
    only differences matter): the reference's tokens."""
    ids, mask = left_padded_batch(ROWS)
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, positions=positions))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert messages == []


@hand_loop
@pytest.mark.parametrize("chunks", [(2, 4), (3,)])
def test_a_chunked_prefill_without_positions_gives_the_reference(lm, chunks):
    """Up to 4.38 the sdpa mask helper unmasks the wrong rows of a left-padded chunk after a cache: vanilla fails
    (``IndexError``, chunks of 2 and 4) or gives wrong tokens (a chunk of 3); neofix builds that mask right."""
    ids, mask = left_padded_batch(ROWS)
    tokens, _ = run(lambda: decode(lm, ids, mask, STEPS, chunks=chunks))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))


@hand_loop
def test_the_stale_mask_is_extended(family, lm):
    """The prompt's mask at every step: 5.x pads it with zeros on the right (silently wrong), 4.45 fails on shapes;
    neofix extends it with ones and says so once."""
    ids, mask = left_padded_batch(ROWS)
    expected = reference(lm, ids, mask)
    plain = vanilla(lambda: decode(lm, ids, mask, STEPS, mask_mode="stale"))
    if stale_mask_silent(family):
        assert isinstance(plain, torch.Tensor) and not torch.equal(plain, expected)
    else:  # a shape RuntimeError, or (the mask helpers before 4.45) a ValueError naming the mask's size
        assert isinstance(plain, (RuntimeError, ValueError)), plain
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, mask_mode="stale"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    assert len(messages) == 1 and "extended it with ones on the right" in messages[0], messages


@hand_loop
def test_stale_prompt_positions_are_a_clear_error(lm):
    """The prompt's position_ids on a decode step: vanilla fails on shapes deep inside attention; with rotary
    positions neofix cannot tell which scheme the cache was built with, so it names the mistake."""
    ids, mask = left_padded_batch(ROWS)
    # (a ValueError where the eager attention checks its weights' size: Llama up to 4.37)
    assert isinstance(vanilla(lambda: decode(lm, ids, mask, STEPS, positions="stale")), (RuntimeError, ValueError))
    error, _ = run(lambda: decode(lm, ids, mask, STEPS, positions="stale"))
    assert isinstance(error, neofix.PositionError), error
    assert str(error).startswith(
        "position_ids has 6 columns, but this step feeds 1 new token (the cache holds 6): with rotary positions"
    )


@torch.no_grad()
def frozen_loop(lm, ids, mask, scheme, steps=STEPS, decode_reads=None):
    """A greedy hand loop that gives the prompt its positions (``scheme``: "mask", the mask's; "column", ``arange``
    over the padded width, transformers' own) and then passes the prompt's last position again at every step (a loop
    that forgets to increment).  ``decode_reads``: a :class:`tests._sync.HostReads` active over the decode steps."""
    key, cache, full, new, generated = cache_keyword(lm), None, mask, ids, []
    prompt = reference_positions(mask) if scheme == "mask" else torch.arange(ids.shape[1])[None].expand_as(ids)
    for step in range(steps):
        positions = prompt if step == 0 else prompt[:, -1:]
        kwargs = dict(input_ids=new, attention_mask=full, position_ids=positions, use_cache=True)
        if cache is not None:
            kwargs[key] = cache
        if step == 1 and decode_reads is not None:
            decode_reads.__enter__()
        out = lm(**kwargs)
        cache, new = output_cache(out), out.logits[:, -1:].argmax(-1)
        generated.append(new)
        full = torch.cat([full, full.new_ones(full.shape[0], 1)], -1)
    if decode_reads is not None:
        decode_reads.__exit__(None, None, None)
    return torch.cat(generated, -1)


def assert_repaired_to_the_reference(lm, loop, said):
    """``loop(ids, mask)`` on the left-padded batch: vanilla's tokens are wrong; neofix's are the reference's, and
    one warning, ``said`` in it."""
    ids, mask = left_padded_batch(ROWS)
    expected = reference(lm, ids, mask)
    plain = vanilla(lambda: loop(ids, mask))
    assert isinstance(plain, torch.Tensor) and not torch.equal(plain, expected)
    tokens, messages = run(lambda: loop(ids, mask))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    assert len(messages) == 1 and said in messages[0], messages


@hand_loop
@pytest.mark.parametrize("scheme", ["mask", "column"])
def test_positions_that_do_not_advance_are_repaired(lm, scheme):
    """vanilla: silently wrong tokens.  neofix: a real token's position after a cache must be its column's or the
    mask's (either scheme a cache can be built with); one that is neither is repaired to the scheme the rows agree on
    (a position shared by differently padded rows counts columns), on the device, and said once."""
    assert_repaired_to_the_reference(lm, lambda ids, mask: frozen_loop(lm, ids, mask, scheme), "does not increment")
@torch.no_grad()
def mask_positions_loop(
    lm, ids, mask, *, cache=None, prompt_positions=False, advance=True, decode="mask", steps=STEPS
):
    """A greedy hand loop whose decode steps pass the mask's positions (``decode="mask"``), advancing or (not
    ``advance``) the prompt's last again (a loop that forgets to increment), or none (``"none"``), or each new token's
    column (``"columns"``: ``arange`` after the cache, one row for every row); and whose prompt is given the mask's
    (``prompt_positions``) or none (transformers' own: each token's column, left padding counted, which its cache then
    holds).  ``cache``: the one to start from (``None``: the model's own).  Returns the new tokens, each step's logits
    and the cache."""
    key, full, new, generated, logits = cache_keyword(lm), mask, ids, [], []
    for step in range(steps):
        kwargs = dict(input_ids=new, attention_mask=full, use_cache=True)
        if cache is not None:
            kwargs[key] = cache
        if step and decode == "columns":
            kwargs["position_ids"] = torch.arange(full.shape[1] - 1, full.shape[1]).unsqueeze(0)
        elif (step and decode == "mask") or (not step and prompt_positions):
            kwargs["position_ids"] = reference_positions(full if advance else mask)[:, -new.shape[1]:]
        out = lm(**kwargs)
        cache, new = output_cache(out), out.logits[:, -1:].argmax(-1)
        generated.append(new)
        logits.append(out.logits)
        full = torch.cat([full, full.new_ones(full.shape[0], 1)], -1)
    return torch.cat(generated, -1), logits, cache


@hand_loop
@pytest.mark.parametrize("advance", [True, False], ids=["advancing", "not advancing"])
def test_the_masks_positions_after_a_prompt_given_none_continue_its_cache_by_columns(lm, advance):
    """The prompt given no positions, its cache holds transformers' own (a left-padded row's real tokens at their
    columns); decode steps that pass the mask's positions (the two schemes mixed) are off by the row's pads: vanilla's
    tokens are wrong.  neofix saw the prompt, so it knows which positions the cache holds, and continues them: the
    reference tokens, said once.  (The mask's positions that do not advance were repaired to the mask's before: wrong.)"""
    assert_repaired_to_the_reference(
        lm, lambda ids, mask: mask_positions_loop(lm, ids, mask, advance=advance)[0],
        "the cache holds transformers' own positions",
    )


@hand_loop
def test_no_positions_after_a_prompt_given_the_masks_continue_its_cache_by_the_mask(lm):
    """The prompt given the mask's positions (as generate gives them), its cache holds a left-padded row's real tokens
    at the mask's positions; decode steps given none get transformers' own, each token's column, off by the row's
    pads: vanilla's tokens are wrong.  neofix read the prompt's positions, so it knows which the cache holds, and
    derives the mask's for the steps: the reference tokens, nothing said (no given value was changed)."""
    ids, mask = left_padded_batch(ROWS)
    loop = lambda: mask_positions_loop(lm, ids, mask, prompt_positions=True, decode="none")[0]  # noqa: E731
    expected = reference(lm, ids, mask)
    plain = vanilla(loop)
    assert isinstance(plain, torch.Tensor) and not torch.equal(plain, expected)
    tokens, messages = run(loop)
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    assert messages == []


@hand_loop
def test_the_columns_after_a_prompt_given_the_masks_are_repaired_to_the_masks(lm):
    """The mirror of the test above with positions given: decode steps given each new token's column (``arange``
    after the cache, as transformers makes its own) after a prompt given the mask's.  Either scheme is right for a
    cache built with it, and this cache holds the mask's: neofix repairs the columns to the mask's, said once."""
    assert_repaired_to_the_reference(
        lm, lambda ids, mask: mask_positions_loop(lm, ids, mask, prompt_positions=True, decode="columns")[0],
        "the attention mask puts that real token",
    )


def test_a_forward_without_a_cache_returning_a_tuple_runs_as_vanilla(lm):
    """``return_dict=False`` and ``use_cache=False``: the base model returns the last hidden state and the tuple of
    every layer's, no cache.  The ending of a rotary family's prompt (which marks the cache it returns) took that
    tuple of tensors for a legacy cache and failed on it; now the outputs are vanilla's, bit for bit."""
    ids, mask = left_padded_batch(ROWS)

    def forward():
        with torch.no_grad():
            return lm.base_model(
                input_ids=ids, attention_mask=mask, use_cache=False, output_hidden_states=True, return_dict=False
            )

    patched, plain = patched_and_vanilla(forward)
    assert len(patched) == len(plain) == 2
    assert torch.equal(patched[0], plain[0])
    assert all(torch.equal(mine, theirs) for mine, theirs in zip(patched[1], plain[1], strict=True))


@hand_loop
def test_after_a_right_padded_prompt_given_none_the_masks_positions_are_kept(lm):
    """A prompt given no positions whose padded row is right-padded (its real tokens at the mask's positions, which
    are their columns), decode steps given the mask's positions: vanilla computes the full recompute's logits, and so
    does neofix, bit for bit (the columns, which count the pads, would be wrong there)."""
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    patched, plain = patched_and_vanilla(lambda: mask_positions_loop(lm, ids, mask)[1])
    for mine, theirs in zip(patched, plain, strict=True):
        assert torch.equal(mine, theirs)


@hand_loop
def test_a_cache_used_again_forgets_which_positions_its_last_prompt_was_given(lm):
    """A cache whose prompt was given no positions holds transformers' own, and the mask's are repaired to them after
    it; reset and used again by a prompt given the mask's, it holds the mask's: the same loop then computes what
    vanilla computes, bit for bit."""
    ids, mask = left_padded_batch(ROWS)

    def used_again():
        cache = mask_positions_loop(lm, ids, mask, steps=4)[2]
        if not hasattr(cache, "reset"):
            pytest.skip(f"transformers {TF}: the model's own cache has no reset() (a legacy tuple, or before 4.56)")
        cache.reset()
        if any(cache.get_seq_length(layer) for layer in range(lm.config.num_hidden_layers)):
            pytest.skip(f"transformers {TF}: reset() zeroes the cache's keys but keeps them: it cannot be used again")
        return mask_positions_loop(lm, ids, mask, cache=cache, prompt_positions=True, steps=4)[1]

    with neofix.unpatched():
        plain = run(used_again)[0]
    if not isinstance(plain, list):
        pytest.skip(f"transformers {TF}: a reset cache fails inside transformers, vanilla too ({plain!r:.80})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        patched = used_again()
    for mine, theirs in zip(patched, plain, strict=True):
        assert torch.equal(mine, theirs)


@hand_loop
def test_positions_that_do_not_advance_are_repaired_without_a_host_read(lm):
    """On an accelerator (simulated) the decode steps' repair reads nothing: it is reported once the copy lands."""
    from ._sync import HostReads, simulated_accelerator

    ids, mask = left_padded_batch(ROWS)
    reads = HostReads()
    with simulated_accelerator():
        tokens, messages = run(lambda: frozen_loop(lm, ids, mask, "mask", decode_reads=reads))
        neofix._reports.poll()
    assert torch.equal(tokens, reference(lm, ids, mask))
    assert reads.by_neofix == []


@hand_loop
def test_positions_that_do_not_advance_are_a_position_error_in_strict_mode(lm):
    ids, mask = left_padded_batch(ROWS)
    neofix.configure(mode="strict")
    error, _ = run(lambda: frozen_loop(lm, ids, mask, "mask"))
    assert isinstance(error, neofix.PositionError), error
    assert str(error).startswith("position_ids[0, 0] is 5 at the step after 6 cached tokens, but the attention mask")


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_a_token_id_past_the_vocabulary_is_named(lm, where):
    """vanilla: ``IndexError: index out of range in self``.  neofix names the id; on the prefill before any layer runs
    (a decode step reads no value: the embedding's lookup fails first, and its IndexError is explained)."""
    ids, mask = left_padded_batch(ROWS)
    vocab = lm.config.vocab_size
    if where == "decode" and own_cache_too_small(lm.config.model_type.replace("_text", "")):
        pytest.skip(f"transformers {TF}: the model's own cache holds the prompt only, no hand loop runs (vanilla too)")
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
    # 5.x: IndexError; 4.45: RuntimeError; up to 4.41 (Mistral, Qwen2) or 4.37 (Llama): ValueError naming the sizes
    assert isinstance(vanilla(call), (IndexError, RuntimeError, ValueError))
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


@hand_loop
def test_a_longer_left_padded_mask_is_refused(lm):
    """Two more columns of padding on the left: vanilla reads the first columns (silently wrong logits; with Mistral's
    window of 4 the misread columns lie outside the window, so vanilla happens to be right there; before 4.45 a shape
    error); which columns belong to the cache cannot be told, so neofix refuses it."""
    right = run(_step_with_mask(lm, lambda full: full))[0].logits
    longer = _step_with_mask(lm, lambda full: torch.cat([full.new_zeros(3, 2), full], -1))
    plain = vanilla(longer)
    if isinstance(plain, Exception):  # Llama up to 4.37, Mistral and Qwen2 up to 4.41: the mask helpers' shapes fail
        assert TF_RELEASE < (4, 45) and isinstance(plain, (RuntimeError, ValueError)), plain
    elif getattr(lm.config, "sliding_window", None) is None:
        assert not torch.equal(plain.logits, right)
    error, _ = run(longer)
    assert isinstance(error, neofix.MaskLengthError), error
    assert "A longer mask is ambiguous" in str(error)


@hand_loop
def test_a_longer_all_ones_mask_is_sliced_as_vanilla_does(lm):
    """Sliced to cache plus input, as vanilla does from 4.45 (before, vanilla's shapes fail: neofix slicing it changes
    nothing vanilla completes, and it computes what the exact mask computes)."""
    ids = torch.randint(1, 96, (2, 5), generator=torch.Generator().manual_seed(4))
    key = cache_keyword(lm)

    def step(width=9):
        out = lm(input_ids=ids, use_cache=True)
        return lm(input_ids=ids[:, -1:], attention_mask=torch.ones(2, width, dtype=torch.long), use_cache=True,
                  **{key: output_cache(out)}).logits

    patched, plain = patched_and_vanilla(lambda: run(step)[0])
    assert isinstance(patched, torch.Tensor), patched
    if isinstance(plain, (RuntimeError, ValueError)) and TF_RELEASE < (4, 45):
        plain = vanilla(lambda: step(6))  # the exact mask
    assert torch.equal(patched, plain)


@hand_loop
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
        # (min_new_tokens: no end-of-sequence token ends it early, as 4.30's weights give one at 64)
        generated = lm.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                pad_token_id=0)
    assert generated.shape[1] == 68


@hand_loop
def test_a_legacy_tuple_cache_decodes_on_every_release(family, lm):
    """Tuples: converted by 4.45 itself, rejected from 4.48 (``'tuple' object has no attribute 'get_seq_length'``;
    Qwen2-MoE from 4.54), where neofix wraps them in a DynamicCache and says so once."""
    ids, mask = left_padded_batch(ROWS)
    tokens, messages = run(lambda: decode(lm, ids, mask, STEPS, cache_format="legacy"))
    if getattr(lm.config, "sliding_window", None) is not None and TF_RELEASE >= (4, 56) and windowed(lm):
        # the model's own cache keeps only the window's keys (sliding-window layers): its tuples cannot tell how many
        # tokens came before, so the mask is wider than the cache, or (Gemma's global layers beside them) the layers
        # hold different lengths (vanilla: 'tuple' object has no attribute 'get_seq_length')
        assert isinstance(tokens, (neofix.MaskLengthError, neofix.CacheLengthError)), tokens
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference(lm, ids, mask))
    wrapped = [m for m in messages if "legacy tuple cache" in m]
    assert len(wrapped) == (1 if legacy_tuples_rejected(family) else 0), messages


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


def needs_cache_position(test):
    """A test of a loop passing cache_position (skipped where the forward takes none: vanilla cannot run it)."""
    test.cache_position = True
    return test


@hand_loop
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
    if case != "correct" and reaches_the_model(lm):
        assert wrong_or_raises(vanilla(call), expected)
    tokens, messages = run(call)
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    if mode == "stale" and reaches_the_model(lm):
        said = "neofix: cache_position has 6 entries, but this step feeds 1 new token"
        assert any(m.startswith(said) for m in messages), messages


def reaches_the_model(lm):
    """Phi3ForCausalLM up to 4.47 takes cache_position and does not pass it on (read in the 4.48.3 source): the model,
    which counts from its cache, never sees it, and a wrong one is harmless."""
    return not (lm.config.model_type == "phi3" and TF_RELEASE < (4, 48))


@hand_loop
@needs_cache_position
@pytest.mark.parametrize("mode", ["repair", "strict"])
def test_a_cache_position_that_does_not_advance_is_repaired(lm, mode):
    """cache_position frozen at the prompt's length: 4.45 - 4.57 build the causal mask and the positions from it
    (vanilla: silently wrong tokens, or a shape error).  After a cache of p tokens it must be arange(p, p + q): neofix
    replaces it and says so once (strict: PositionError)."""
    ids, mask = left_padded_batch(ROWS)
    expected = reference(lm, ids, mask)
    call = lambda: loop_with_cache_position(lm, ids, mask, "frozen")  # noqa: E731
    if reaches_the_model(lm):
        assert wrong_or_raises(vanilla(call), expected)
    neofix.configure(mode=mode)
    tokens, messages = run(call)
    if mode == "strict" and reaches_the_model(lm):
        assert isinstance(tokens, neofix.PositionError), tokens
        assert str(tokens).startswith("cache_position is [6] at a step after 7 cached tokens")
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected)
    if reaches_the_model(lm):
        assert [m for m in messages if "cache_position" in m] == [
            "neofix: cache_position is [6] at a step after 7 cached tokens, but this step's tokens are at 7 to 7 of "
            "the cache; used those. Where your code passes it: pass cache_position = torch.arange(cached, cached + new_tokens), "
            "or leave it out (the model counts it). Reported once."
        ]


# -- what vanilla does right stays bit-identical ----------------------------------------------------------------------


def sliding_window_cache(model, length):
    """The release's static cache of ``model``'s sliding-window layers, of ``length`` slots: Gemma's ``HybridCache`` or
    ``SlidingWindowCache`` where they exist (up to 4.58), else ``StaticCache`` (whose layers follow the config)."""
    from transformers import cache_utils

    names = ("HybridCache",) if type(model).__name__.startswith("Gemma") else ()
    cache_class = next(getattr(cache_utils, name) for name in (*names, "SlidingWindowCache", "StaticCache")
                       if hasattr(cache_utils, name))
    parameters = inspect.signature(cache_class.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": length}
    for name, value in (("max_batch_size", 1), ("batch_size", 1), ("dtype", model.dtype), ("device", "cpu")):
        if name in parameters or (name == "max_batch_size" and "kwargs" in parameters):
            kwargs[name] = value
    return cache_class(**kwargs)


@hand_loop
def test_a_loop_given_positions_over_a_sliding_window_cache_past_its_window_runs_as_vanilla(lm):
    """A hand loop over a static cache of sliding-window layers, given the right positions and no ``cache_position``,
    past the window: up to 4.55 such a cache counts its slots only up to the window, which neofix took for its length,
    and it "repaired" the right positions to wrong ones (said; strict mode raised).  Such a count is not a length:
    vanilla's tokens, nothing said."""
    if not windowed(lm) or not isinstance(getattr(lm.config, "sliding_window", None), int):
        pytest.skip(f"{type(lm).__name__}: no sliding-window layers in this tiny config")
    ids = torch.tensor([[21, 22, 23, 24, 25]])

    @torch.no_grad()
    def loop():
        mask, tokens = torch.ones_like(ids), []
        cache = sliding_window_cache(lm, ids.shape[1] + STEPS + 1)
        out = lm(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask), use_cache=True,
                 **{cache_keyword(lm): cache})
        for _ in range(STEPS):
            tokens.append(out.logits[:, -1:].argmax(-1))
            mask = torch.cat([mask, mask.new_ones(1, 1)], -1)
            out = lm(input_ids=tokens[-1], attention_mask=mask, position_ids=reference_positions(mask)[:, -1:],
                     use_cache=True, **{cache_keyword(lm): output_cache(out)})
        return torch.cat(tokens, -1)

    (tokens, said), plain = run(loop), vanilla(loop)
    if isinstance(plain, Exception):  # (4.48 - 4.52: Mistral's SlidingWindowCache fails past its window, vanilla too)
        assert type(tokens) is type(plain) and str(tokens) == str(plain), tokens
        return
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, plain) and said == [], said


@hand_loop
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


@left_padded_generate
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
        assert torch.equal(patched.sequences, reference_greedy(lm, ids, mask, STEPS, eos_token_id=0))


@left_padded_generate
def test_a_head_dim_the_attention_ignores_is_not_read(family):
    """A config carrying a ``head_dim`` other than ``hidden_size // num_attention_heads`` (a checkpoint saved by a
    newer release, a config built with one): on the releases whose attention ignores it (Llama before 4.45, Mistral
    before 4.43, Mixtral before 4.47, Qwen2, Phi, Phi3, Granite and Starcoder2 before 4.48, Qwen2-MoE before 4.53),
    the cache's keys are ``hidden_size // heads`` wide, and neofix refused the first cached step as a cache "built by
    another model".  Everywhere: vanilla's outcome, said nothing."""
    if isinstance(getattr(type(transformers.AutoConfig.for_model(FAMILIES[family].name)), "head_dim", None), property):
        pytest.skip(f"{FAMILIES[family].title}'s config computes head_dim (hidden_size // heads): none carries another")
    try:
        model = tiny_model(family, seed=0, dtype=torch.float32, head_dim=16)  # 4 heads of a width-32 model: 8 each
    except ValueError as error:  # Qwen2-MoE 4.53 - 4.57: its attention refuses to be built with it
        if "must be divisible by num_heads" not in str(error):
            raise
        pytest.skip(f"transformers {TF} builds no {family} model with this head_dim: {error}")
    ids, mask = left_padded_batch(ROWS, seed=3)
    call = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, told), (plain, _) = patched_and_vanilla(lambda: run(call))
    assert told == []
    if isinstance(plain, Exception):  # vanilla's own failure (Qwen2, Phi and Starcoder2 on 4.45 - 4.47, Qwen2-MoE on
        # 4.45 - 4.52, whose rotary embedding reads head_dim and attention does not), left as it is
        assert type(patched) is type(plain) and str(patched) == str(plain)
    else:
        assert torch.equal(patched, plain)
        assert torch.equal(plain, reference_greedy(model, ids, mask, 3, eos_token_id=0))


def test_a_mixture_of_experts_trains_as_vanilla(family):
    """Mixtral, Qwen2-MoE, Qwen3-MoE: a training step over a padded batch (left and right) with the router's logits
    (``output_router_logits``: the load-balancing loss, which the causal LM computes from the mask it is given,
    outside the patched forward) gives vanilla's loss, auxiliary loss, router logits and gradients, bit for bit
    (a rotary family's left padding keeps transformers' positions), and says nothing."""
    if not {"num_local_experts", "num_experts"} & set(FAMILY_CONFIGS[family][2]):  # (Mixtral's name, Qwen3-MoE's)
        pytest.skip(f"{FAMILIES[family].title} has no experts")
    model = tiny_model(family, seed=0, dtype=torch.float32)
    ids = torch.randint(1, 96, (3, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, 5:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)

    def step():
        model.zero_grad()
        with torch.enable_grad():  # (run records warnings under no_grad)
            out = model(input_ids=ids, attention_mask=mask, labels=labels, output_router_logits=True)
            out.loss.backward()
        grads = [parameter.grad.clone() for parameter in model.parameters() if parameter.grad is not None]
        return out.loss.detach(), out.aux_loss.detach(), [logits.detach() for logits in out.router_logits], grads

    model.train()
    try:
        (patched, told), (plain, _) = patched_and_vanilla(lambda: run(step))
    finally:
        model.eval()
    assert told == []
    if isinstance(plain, Exception):  # vanilla's own failure (Qwen2-MoE on 4.55: its load-balancing loss reads a CPU
        # tensor's device index, None), left as it is
        assert type(patched) is type(plain) and str(patched) == str(plain)
        return
    assert isinstance(patched, tuple), patched
    for mine, theirs in zip(patched[:2], plain[:2]):
        assert torch.equal(mine, theirs)
    for mine, theirs in (*zip(patched[2], plain[2]), *zip(patched[3], plain[3])):
        assert torch.equal(mine, theirs)
    assert len(patched[2]) == len(plain[2]) > 0 and len(patched[3]) == len(plain[3]) > 0


def prompt_without_an_early_end(lm, tokens, seed=3):
    """A left-padded batch (of :data:`ROWS`) none of whose rows generates the end-of-sequence token (0) within
    ``tokens`` greedy tokens (a second ``generate`` continuing the first's cache cannot tell a row that ended): the
    first seed from ``seed`` whose prompt does not, for this family's weights."""
    for tried in range(seed, seed + 20):
        ids, mask = left_padded_batch(ROWS, seed=tried)
        if not (reference_greedy(lm, ids, mask, tokens)[:, ids.shape[1]:] == 0).any():
            return ids, mask
    raise AssertionError(f"no prompt of seeds {seed} - {seed + 19} keeps every row from ending within {tokens} tokens")


@left_padded_generate
def test_generate_continues_from_a_returned_cache_as_vanilla(lm):
    ids, mask = prompt_without_an_early_end(lm, 3)

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
    assert torch.equal(patched, reference_greedy(lm, ids, mask, 7, eos_token_id=0))



# -- Gemma2 and Gemma3 on the releases of the HybridCache -------------------------------------------------------------


def test_a_hand_loop_on_the_models_own_hybrid_cache_is_a_clear_error(lm, family):
    """Up to 4.52 the model given no cache builds a static HybridCache as long as the prompt: vanilla's next step fails
    on shapes inside attention; neofix names it before any layer runs (a 2D mask wider than a static cache)."""
    if not own_cache_too_small(family):
        pytest.skip(f"transformers {TF}: the model's own cache grows")
    ids, mask = left_padded_batch([6, 6, 6])
    with torch.no_grad():
        out = lm(input_ids=ids, attention_mask=mask, use_cache=True)
    longer = torch.cat([mask, mask.new_ones(3, 1)], -1)
    step = lambda: lm(input_ids=ids[:, -1:], attention_mask=longer, past_key_values=out.past_key_values)  # noqa: E731
    assert isinstance(vanilla(step), RuntimeError)
    error, ran = layers_ran(lm, step)
    assert not ran
    assert isinstance(error, neofix.CacheLengthError), error
    assert str(error).startswith("attention_mask has 7 columns, but the cache is a static cache of 6 slots")


def test_a_left_padded_batch_on_a_hybrid_cache_within_the_window_runs_as_vanilla(lm, family):
    """Gemma2 up to 4.47, its sliding window as long as the whole sequence (32): the HybridCache reads a left-padded
    batch right there (its sliding layers misread the mask only past the window), so generate and a hand loop's
    prefill into one of no more slots than the window run as vanilla, and give the reference's tokens."""
    if not hybrid_cache_misreads_left_padding(family):
        pytest.skip(f"transformers {TF}: no HybridCache that misreads left padding")
    from transformers import HybridCache

    wide = tiny_model(family, seed=0, dtype=lm.dtype, attn_implementation=lm.config._attn_implementation,
                      sliding_window=32)
    ids, mask = left_padded_batch(ROWS)
    call = lambda: wide.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)  # noqa: E731
    patched, plain = patched_and_vanilla(lambda: run(call)[0])
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, plain)
    assert torch.equal(patched, reference_greedy(wide, ids, mask, STEPS, eos_token_id=0))

    def hand(slots):
        cache = HybridCache(wide.config, batch_size=3, max_cache_len=slots, device="cpu", dtype=wide.dtype)
        return wide(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits

    patched, plain = patched_and_vanilla(lambda: run(lambda: hand(32))[0])
    assert torch.equal(patched, plain)
    refused, _ = run(lambda: hand(33))  # one slot more than the window: a step could pass it
    assert isinstance(refused, neofix.MaskValueError), refused


def test_a_left_padded_batch_on_a_hybrid_cache_that_misreads_it_is_refused(lm, family):
    """Gemma2 up to 4.47: generate of a left-padded batch gives the padded rows wrong tokens from the first cached step
    on (vanilla), so neofix refuses its prefill before any layer runs, in generate and in a hand loop that passes a
    HybridCache; an unpadded batch generates as vanilla does, and as the reference."""
    if not hybrid_cache_misreads_left_padding(family):
        pytest.skip(f"transformers {TF}: no HybridCache that misreads left padding")
    from transformers import HybridCache

    ids, mask = left_padded_batch(ROWS)
    call = lambda: lm.generate(ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False, pad_token_id=0)  # noqa: E731
    expected = reference_greedy(lm, ids, mask, STEPS, eos_token_id=0)
    if lm.dtype == torch.float32:  # float64 happens to survive
        assert not torch.equal(vanilla(call), expected)
    said = "rows 1, 2 are left-padded, and Gemma2's HybridCache on transformers"
    error, ran = layers_ran(lm, call)
    assert not ran
    assert isinstance(error, neofix.MaskValueError) and str(error).startswith(said), error

    def hand():
        cache = HybridCache(lm.config, batch_size=3, max_cache_len=16, device="cpu", dtype=lm.dtype)
        return lm(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)

    error, ran = layers_ran(lm, hand)
    assert not ran and isinstance(error, neofix.MaskValueError) and str(error).startswith(said), error
    # unpadded, the prompt as long as the window or longer: as vanilla, and as the reference (a shorter prompt decoded
    # past the window is wrong in vanilla and not refused: see neofix/_families/gemma2.py)
    for width, steps in [(6, STEPS)]:
        unpadded, ones = left_padded_batch([width] * 3, seed=5)[0], torch.ones(3, width, dtype=torch.long)
        call = lambda: lm.generate(unpadded, attention_mask=ones, max_new_tokens=steps, do_sample=False,  # noqa: E731
                                   pad_token_id=0)
        expected = reference_greedy(lm, unpadded, ones, steps, eos_token_id=0)
        patched, plain = patched_and_vanilla(lambda: run(call)[0])
        assert torch.equal(patched, plain)
        assert torch.equal(patched, expected)
