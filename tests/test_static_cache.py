"""Static caches: GPT-Neo's local attention layers take their window at each token's position, eager and compiled.

transformers' eager GPT-Neo attention takes a local layer's window out of its causal buffer at the key length
(``bias[:, :, key_length - query_length : key_length]``); with a static cache the key length is the slot count, so
past ``window_size`` slots a local layer looks at the last slots (still empty) and the tokens go wrong without an
error.  neofix takes the rows at the new tokens' slots (``neofix._families.gpt_neo.make_static_window_forward``)
from transformers 4.45 (the first release whose attention layers get the cache object; generate accepts
``cache_implementation="static"`` for GPT-Neo from 4.54).  Every test compares tokens with the full-recompute
reference (and with a dynamic cache), and shows vanilla wrong where the repair matters.

The tiny model has a window of 4 tokens, global and local layers, and a static cache of 16 slots.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch

import neofix
from neofix.testing import reference_greedy, tiny_gpt_neo, tiny_model

from ._versions import DTYPE, TF_RELEASE, cache_keyword, has, output_cache, requires
from ._sync import simulated_accelerator
from .loops import left_padded_batch

SLOTS = 16
STEPS = 9  # a 6-token prompt and 9 new tokens: 15 positions, far past the window of 4

needs_static_loop = requires("attention layers get the whole cache")


def static_cache(model, batch, slots=SLOTS):
    """An empty ``StaticCache`` of ``slots`` slots for ``model`` (every release's constructor)."""
    from transformers.cache_utils import StaticCache

    parameters = inspect.signature(StaticCache.__init__).parameters
    kwargs = {"config": model.config, "max_cache_len": slots}
    rows = next((name for name in ("batch_size", "max_batch_size") if name in parameters), None)
    if rows is None and TF_RELEASE < (4, 56):  # 4.54 - 4.55 take (*args, **kwargs) and pass them on to the layers
        rows = "max_batch_size"
    if rows is not None:  # up to 4.55 the rows and dtype are fixed up front
        kwargs.update({rows: batch, "dtype": model.dtype})
    if "device" in parameters and parameters["device"].default is inspect.Parameter.empty:  # and up to 4.43 the device
        kwargs["device"] = model.device
    return StaticCache(**kwargs)


@torch.no_grad()
def static_loop(forward, model, ids, mask, steps=STEPS, *, cache=None, stale_mask=False, slots=False, wide=None,
                logits=None):
    """Greedy decoding by hand over a static cache: the mask of the tokens so far (or the prompt's, ``stale_mask``),
    no position_ids.  ``slots``: pass ``cache_position`` where the forward takes it (4.45 - 5.0: without it the
    model counts a static cache's tokens by reading its keys, which dynamo cannot trace, vanilla or patched).
    ``wide``: pass the mask as wide as the cache's slots from the first step, the empty slots' columns zeros
    (``"slots"``) or ones (``"ones"``: the causal mask hides them), or allocated up front for the prompt and every new
    token, zeros past the tokens so far (``"allocated"``, narrower than the slots).  ``logits``: a list each step's logits are
    appended to.  Returns the new tokens."""
    cache = static_cache(model, ids.shape[0]) if cache is None else cache
    keyword = cache_keyword(model)
    takes_slots = slots and "cache_position" in inspect.signature(type(model).forward).parameters
    fed, full, new = ids, mask, []
    for _ in range(steps):
        extra = {"cache_position": torch.arange(full.shape[1] - fed.shape[1], full.shape[1])} if takes_slots else {}
        given = mask if stale_mask else full
        if wide is not None:
            width = ids.shape[1] + steps if wide == "allocated" else SLOTS
            empty = (torch.ones if wide == "ones" else torch.zeros)(full.shape[0], width - full.shape[1], dtype=full.dtype)
            given = torch.cat([full, empty], dim=-1)
        out = forward(input_ids=fed, attention_mask=given, use_cache=True, **{keyword: cache}, **extra)
        if logits is not None:
            logits.append(out.logits)
        fed = out.logits[:, -1:].argmax(-1)
        new.append(fed)
        full = torch.cat([full, full.new_ones((full.shape[0], 1))], dim=-1)
    return torch.cat(new, dim=-1)


@torch.no_grad()
def dynamic_loop(model, ids, mask, steps=STEPS):
    keyword = cache_keyword(model)
    fed, full, cache, new = ids, mask, None, []
    for _ in range(steps):
        given = {keyword: cache} if cache is not None else {}
        out = model(input_ids=fed, attention_mask=full, use_cache=True, **given)
        cache = out[keyword] if keyword in out.keys() else out["past_key_values"]
        fed = out.logits[:, -1:].argmax(-1)
        new.append(fed)
        full = torch.cat([full, full.new_ones((full.shape[0], 1))], dim=-1)
    return torch.cat(new, dim=-1)


def reference(model, ids, mask, steps=STEPS):
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1]:]


@pytest.fixture(scope="module")
def model():
    return tiny_gpt_neo(seed=0, dtype=DTYPE)


@pytest.fixture(scope="module")
def batch():
    return left_padded_batch([6, 3, 5])


# -- eager ----------------------------------------------------------------------------------------------------------


@needs_static_loop
def test_a_static_loop_past_the_window_gives_the_reference_tokens(model, batch):
    """A hand loop over a 16-slot static cache, left-padded, no positions: the reference tokens and the dynamic
    cache's; vanilla's local layers look at empty slots and go wrong."""
    ids, mask = batch
    expected = reference(model, ids, mask)
    got = static_loop(model, model, ids, mask)
    assert torch.equal(got, expected)
    assert torch.equal(got, dynamic_loop(model, ids, mask))
    with neofix.unpatched(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plain = static_loop(model, model, ids, mask, cache=static_cache(model, ids.shape[0]))
    assert not torch.equal(plain, expected)


@needs_static_loop
@pytest.mark.parametrize("device", ["cpu", "accelerator"])
@pytest.mark.parametrize("slots", [False, True], ids=["transformers' slots", "cache_position given"])
def test_a_static_loop_with_a_stale_mask_is_repaired(model, batch, slots, device):
    """The prompt's mask at every step (the classic bug) over a static cache: extended as over a dynamic cache.  A
    static cache's length is a tensor; on the CPU the new tokens' slots (``cache_position``, given or the cache's own
    count) are read without waiting, and tell it: extended to the tokens so far, and said.  On an accelerator that
    would be a read: the mask is extended to every slot on the device instead, unread and unsaid (the empty slots'
    columns are hidden by the causal mask).  (Unpatched, transformers pads the short mask with zeros: the new tokens
    are masked out.)"""
    ids, mask = batch
    context = simulated_accelerator() if device == "accelerator" else contextlib.nullcontext()
    with context, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", neofix.NeofixWarning)
        got = static_loop(model, model, ids, mask, stale_mask=True, slots=slots)
    assert torch.equal(got, reference(model, ids, mask))
    said = any("extended it with ones on the right" in str(w.message) for w in caught)
    assert said == (device == "cpu")
    with neofix.unpatched():
        assert not torch.equal(static_loop(model, model, ids, mask, stale_mask=True, slots=slots), got)


@needs_static_loop
@pytest.mark.parametrize("device", ["cpu", "accelerator"])
def test_strict_mode_refuses_a_static_loops_stale_mask(model, batch, strict, device):
    """Strict mode repairs nothing: the stale mask of a static loop is a ``MaskLengthError`` naming the lengths, on an
    accelerator too (strict mode reads the new tokens' slots there, as it may synchronise)."""
    ids, mask = batch
    context = simulated_accelerator() if device == "accelerator" else contextlib.nullcontext()
    with context, pytest.raises(neofix.MaskLengthError, match="attention_mask has 6 columns, but the cache holds 6 "
                                "tokens and this step feeds 1: expected 7"):
        static_loop(model, model, ids, mask, stale_mask=True, slots=True)


@needs_static_loop
@pytest.mark.parametrize("wide", ["slots", "allocated"])
@pytest.mark.parametrize("device", ["cpu", "accelerator"])
@pytest.mark.parametrize("slots", [False, True], ids=["transformers' slots", "cache_position given"])
def test_a_static_loop_whose_mask_is_as_wide_as_the_slots_gives_the_reference_tokens(model, batch, slots, device, wide):
    """A hand loop over a static cache passing, from its first step, a 2D mask as wide as the cache's slots (ones for
    the tokens so far, zeros for the empty slots), left-padded, no positions: transformers reads its columns as
    slots, and so does neofix, taking each new token's position at its slot (on an accelerator on the device,
    unread).  It was refused at the first step (4.57 and later) and, after it, given the positions of the empty
    slots' columns where cache_position was passed: wrong tokens.  The same with a mask allocated up front for every
    token, narrower than the slots."""
    ids, mask = batch
    context = simulated_accelerator() if device == "accelerator" else contextlib.nullcontext()
    with context, warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        got = static_loop(model, model, ids, mask, slots=slots, wide=wide)
    assert torch.equal(got, reference(model, ids, mask))


def assert_every_step_is_vanillas(model, ids, mask, **loop):
    """Five steps of :func:`static_loop` (``loop``: its options), patched and unpatched: every step's logits equal, bit
    for bit."""
    patched, plain = [], []
    static_loop(model, model, ids, mask, 5, logits=patched, **loop)
    with neofix.unpatched():
        static_loop(model, model, ids, mask, 5, logits=plain, **loop)
    for mine, theirs in zip(patched, plain, strict=True):
        assert torch.equal(mine, theirs)


@needs_static_loop
@pytest.mark.parametrize("wide", ["slots", "ones"])
@pytest.mark.parametrize("slots", [False, True], ids=["transformers' slots", "cache_position given"])
def test_a_mask_as_wide_as_the_slots_computes_what_vanilla_computes_where_it_is_right(slots, wide):
    """Unpadded rows, within the window (where vanilla is right), a mask as wide as the slots whose empty slots are
    zeros or ones: every step's logits are vanilla's, bit for bit.  With ones there, neofix took the new token's
    position from the mask's last column (the last slot's: wrong tokens)."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, window_size=SLOTS)
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    assert_every_step_is_vanillas(model, ids, mask, slots=slots, wide=wide)


@needs_static_loop
@pytest.mark.parametrize("wide", ["slots", "allocated"])
@pytest.mark.parametrize("slots", [False, True], ids=["transformers' slots", "cache_position given"])
def test_a_rotary_family_runs_a_mask_as_wide_as_the_slots_as_vanilla(batch, slots, wide):
    """Llama, where left padding without positions is harmless and vanilla decodes a slot-wide mask right from the
    first step: every step's logits are vanilla's, bit for bit (the first step was refused, 4.57 and later)."""
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    ids, mask = batch
    assert_every_step_is_vanillas(model, ids, mask, slots=slots, wide=wide)


@requires("OPT static caches")
@pytest.mark.parametrize("wide", ["slots", "allocated"])
@pytest.mark.parametrize("slots", [False, True], ids=["transformers' slots", "cache_position given"])
def test_opt_runs_a_mask_as_wide_as_the_slots_where_vanilla_fails(batch, slots, wide):
    """OPT derives its positions from every column of the mask it is given, less the cache's tokens, so a mask wider
    than the tokens so far fails inside transformers (``The size of tensor a (6) must match the size of tensor b
    (16)``).  Read by slot, its first columns are the tokens so far: OPT is given those, and derives its own positions
    from them (left-padded rows included): the reference tokens, on the CPU, where the cache's length is read from
    the slots."""
    model = tiny_model("opt", seed=0, dtype=torch.float32)
    ids, mask = batch
    with neofix.unpatched(), pytest.raises(RuntimeError, match="must match the size"):
        static_loop(model, model, ids, mask, slots=slots, wide=wide)
    got = static_loop(model, model, ids, mask, slots=slots, wide=wide)
    assert torch.equal(got, reference(model, ids, mask))


@needs_static_loop
def test_within_the_window_a_static_loop_is_vanillas_bit_for_bit():
    """Where transformers' own window is right (no more slots than the window), the repaired attention computes
    exactly what transformers' does: the logits of every real token at every step are equal, bit for bit (a drift of
    the attention neofix runs for local layers over static caches from transformers' would show here).  A pad's own
    row differs: every key is masked for it, so it attends over whatever the causal buffer's row allows, which is now
    its slot's (as over a dynamic cache) instead of the last slots'."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, window_size=SLOTS)
    ids, mask = left_padded_batch([6, 3])

    def logits():
        cache, keyword, fed, full, seen = static_cache(model, 2), cache_keyword(model), ids, mask, []
        with torch.no_grad():
            for _ in range(5):
                out = model(input_ids=fed, attention_mask=full, position_ids=(full.cumsum(-1) - 1).clamp(min=0)[
                    :, -fed.shape[1]:], **{keyword: cache})
                seen.append(out.logits)
                fed = out.logits[:, -1:].argmax(-1)
                full = torch.cat([full, full.new_ones((2, 1))], dim=-1)
        return seen

    patched = logits()
    with neofix.unpatched():
        plain = logits()
    real = mask.bool()
    assert torch.equal(patched[0][real], plain[0][real])
    for mine, theirs in zip(patched[1:], plain[1:]):
        assert torch.equal(mine, theirs)


@requires("static caches")
@pytest.mark.parametrize("device", ["cpu", "accelerator"])
@pytest.mark.parametrize("beams", [1, 3])
def test_generate_with_a_static_cache_equals_the_dynamic_cache(model, batch, beams, device):
    """``generate(cache_implementation="static")``, greedy and beam search, past the window: the dynamic cache's
    tokens (greedy: the reference's too); vanilla's greedy goes wrong.  On an accelerator too, where each step's mask
    (the tokens so far) is extended to every slot unread."""
    ids, mask = batch
    kwargs = dict(attention_mask=mask, max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False, pad_token_id=0,
                  num_beams=beams)
    context = simulated_accelerator() if device == "accelerator" else contextlib.nullcontext()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dynamic = model.generate(ids, **kwargs)
        with context:
            static = tiny_gpt_neo(seed=0, dtype=DTYPE).generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, dynamic)
    if beams == 1:
        assert torch.equal(static[:, ids.shape[1]:], reference(model, ids, mask))
        with neofix.unpatched(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plain = tiny_gpt_neo(seed=0, dtype=DTYPE).generate(ids, cache_implementation="static", **kwargs)
        assert not torch.equal(plain, dynamic)


def _emulated_flash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' flash-attention-2 path in plain torch (flash-attn needs a GPU): the 2D mask its mask function
    (``flash_attention_mask``) passes, or None; a static cache's keys cut to the mask's width (``_upad_input``: "the
    k/v states may be larger than the mask"); the real keys only; the causal mask aligned at the bottom right."""
    heads = query.shape[1]
    key = key.repeat_interleave(heads // key.shape[1], 1)
    value = value.repeat_interleave(heads // value.shape[1], 1)
    if attention_mask is not None:
        key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]
    real = attention_mask.bool() if attention_mask is not None else torch.ones(key.shape[0], key.shape[2]).bool()
    out = torch.zeros_like(query)
    new = query.shape[2]
    for row in range(query.shape[0]):
        kept = real[row].nonzero().flatten()
        held = kept.numel()
        causal = torch.arange(held)[None, :] <= (held - new + torch.arange(new))[:, None]
        out[row] = torch.nn.functional.scaled_dot_product_attention(
            query[row], key[row][:, kept], value[row][:, kept], attn_mask=causal, scale=scaling
        )
    return out.transpose(1, 2).contiguous(), None


@requires("attention interfaces")
@pytest.mark.parametrize("stale_mask", [False, True], ids=["the mask of the tokens so far", "the prompt's mask"])
def test_a_flash_attention_over_a_static_cache_keeps_its_mask_as_given_on_an_accelerator(stale_mask):
    """Flash attention keeps as many of a static cache's keys as the mask has columns, so a mask widened to every slot
    would have it attend to the empty ones (wrong tokens, nothing raised).  Where the cache's length is not read (an
    accelerator) a mask is left as given there: a hand loop and ``generate(cache_implementation="static")`` run as
    vanilla (the prompt's mask too: left, as in vanilla).  Flash attention emulated in plain torch on the CPU."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("neofix_test_flash", _emulated_flash_attention)
    AttentionMaskInterface.register("neofix_test_flash", flash_attention_mask)
    model = tiny_model("llama", seed=0, dtype=torch.float32)
    model.config._attn_implementation = "neofix_test_flash"
    ids, mask = left_padded_batch([6, 4, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with simulated_accelerator():
            patched = static_loop(model, model, ids, mask, 6, slots=True, stale_mask=stale_mask)
        with neofix.unpatched():
            plain = static_loop(model, model, ids, mask, 6, slots=True, stale_mask=stale_mask)
    assert torch.equal(patched, plain)
    if not stale_mask:
        assert torch.equal(patched, reference_greedy(model, ids, mask, 6)[:, ids.shape[1]:])  # (vanilla is right)
        kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0,
                      cache_implementation="static")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with simulated_accelerator():
                patched = model.generate(ids, **kwargs)
            with neofix.unpatched():
                plain = model.generate(ids, **kwargs)
        assert torch.equal(patched, plain)


# -- where no repair runs: AttentionWindowError --------------------------------------------------------------------


@needs_static_loop
def test_a_cache_whose_slots_are_not_positions_is_refused_before_any_layer_writes(model, batch):
    """A fixed-capacity cache of another class than transformers' static one (here a subclass of it; sliding-window
    caches roll their slots): refused by the first layer, before any layer writes to the cache."""
    ids, mask = batch
    cache = static_cache(model, ids.shape[0])
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):  # 4.56 and later: one object per layer
        kind = type(layers[0])
        other = type("MyStaticLayer", (kind,), {})
        for layer in layers:
            layer.__class__ = other
        named = "MyStaticLayer"
    else:
        cache.__class__ = type("MyStaticCache", (type(cache),), {})
        named = "MyStaticCache"
    with pytest.raises(neofix.AttentionWindowError) as raised, torch.no_grad():
        model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): cache})
    assert f"a static cache of {SLOTS} slots with GPT-Neo's local attention layers (window of 4 tokens)" in str(
        raised.value
    )
    assert f"but not for a {named} cache, whose slots are not the tokens' positions" in str(raised.value)
    keys = [layer.keys for layer in layers] if isinstance(layers, list) else list(cache.key_cache)
    assert all(key is None or not key.any() for key in keys)  # nothing written


@needs_static_loop
def test_an_attention_neofix_does_not_repair_is_refused_up_front(model, batch, monkeypatch):
    """Where the local layers run an attention without the repair (flash-attention-2 on a GPU; here transformers'
    own eager forward put back), a static cache of more slots than the window is refused before any compute."""
    from transformers.models.gpt_neo import modeling_gpt_neo

    cls = modeling_gpt_neo.GPTNeoSelfAttention
    monkeypatch.setattr(cls, "forward", cls.forward.__wrapped__)
    ids, mask = batch
    with pytest.raises(neofix.AttentionWindowError, match="neofix repairs that for a StaticCache with the eager "
                       "attention on transformers 4.45 and later, but not for this model's attention"):
        static_loop(model, model, ids, mask)


# -- compiled -------------------------------------------------------------------------------------------------------


def compiled_static_loop(model, ids, mask, steps, wide=None, stale_mask=False, **options):
    """The static loop through ``torch.compile(model.forward, fullgraph=True, ...)``: (new tokens, frames compiled
    after the first three steps, frames compiled in all).  fullgraph: any graph break is an error."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model.forward, fullgraph=True, **options)
    warmup = static_loop(compiled, model, ids, mask, 3, slots=True, wide=wide, stale_mask=stale_mask)
    settled = counters["stats"]["unique_graphs"]
    cache = static_cache(model, ids.shape[0])
    tokens = static_loop(compiled, model, ids, mask, steps, cache=cache, slots=True, wide=wide, stale_mask=stale_mask)
    del warmup
    return tokens, settled, counters["stats"]["unique_graphs"], dict(counters["graph_break"])


@needs_static_loop
def test_a_compiled_static_loop_gives_the_eager_tokens_in_one_graph_per_shape(batch):
    """``torch.compile(model.forward, fullgraph=True)`` over a static cache, past the window: the eager tokens (the
    reference's), no graph break (fullgraph), and no compilation after the first steps (one graph for the prompt,
    the decode steps' graphs once the mask's width is seen to vary): nothing per step."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2)
    ids, mask = batch
    expected = reference(model, ids, mask)
    tokens, settled, total, breaks = compiled_static_loop(model, ids, mask, STEPS, backend="eager")
    assert breaks == {}
    assert torch.equal(tokens, expected)
    assert total == settled  # a whole second run and six more steps compiled nothing new
    torch._dynamo.reset()


@needs_static_loop
def test_a_compiled_static_loop_whose_mask_is_as_wide_as_the_slots_gives_the_reference_tokens(batch):
    """The same loop passing a mask as wide as the slots (one shape for every decode step): the reference tokens,
    the positions taken at the slots inside the graph, no graph break."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2)
    ids, mask = batch
    tokens, _, _, breaks = compiled_static_loop(model, ids, mask, STEPS, wide="slots", backend="eager")
    assert breaks == {}
    assert torch.equal(tokens, reference(model, ids, mask))
    torch._dynamo.reset()


@needs_static_loop
def test_a_compiled_static_loop_with_a_stale_mask_gives_the_reference_tokens(batch):
    """The same loop passing the prompt's mask at every step (the classic bug): inside the graph the mask is extended
    to every slot (the cache's length is not known there without a read), so the reference tokens, no graph break,
    and one graph for every decode step (the mask's width does not change).  Vanilla's tokens are wrong."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2)
    ids, mask = batch
    tokens, settled, total, breaks = compiled_static_loop(model, ids, mask, STEPS, stale_mask=True, backend="eager")
    assert breaks == {}
    assert torch.equal(tokens, reference(model, ids, mask))
    assert total == settled
    with neofix.unpatched():
        plain = compiled_static_loop(model, ids, mask, STEPS, stale_mask=True, backend="eager")[0]
    assert not torch.equal(plain, tokens)
    torch._dynamo.reset()


@needs_static_loop
@pytest.mark.slow  # inductor on the CPU: a minute or more
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_a_compiled_static_loop_with_inductor(batch, mode):
    """The same with the default backend (inductor), and ``mode="reduce-overhead"`` (CUDA graphs; on the CPU
    inductor runs without them): the reference tokens, no graph break, nothing compiled per step."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2)
    ids, mask = batch
    tokens, settled, total, breaks = compiled_static_loop(model, ids, mask, STEPS, mode=mode)
    assert breaks == {}
    assert torch.equal(tokens, reference(model, ids, mask))
    assert total == settled
    torch._dynamo.reset()


@needs_static_loop
def test_neofix_adds_no_compilation_to_a_static_loop():
    """Within the window (where vanilla is right) neofix compiles exactly as many graphs as vanilla for the same
    static loop, and gives its tokens."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2, window_size=SLOTS)
    ids = torch.randint(1, 96, (2, 6), generator=torch.Generator().manual_seed(1))  # unpadded: vanilla is right
    mask = torch.ones_like(ids)
    patched = compiled_static_loop(model, ids, mask, STEPS, backend="eager")
    with neofix.unpatched():
        plain = compiled_static_loop(model, ids, mask, STEPS, backend="eager")
    assert torch.equal(patched[0], plain[0])
    assert patched[1:] == plain[1:]
    torch._dynamo.reset()


def test_static_caches_are_repaired_on_the_releases_that_have_them():
    """The attention wrapper is installed exactly where a static cache can reach GPT-Neo's attention layers."""
    from transformers.models.gpt_neo import modeling_gpt_neo

    from neofix._families.gpt_neo import WINDOW_MARK

    installed = getattr(modeling_gpt_neo.GPTNeoSelfAttention.forward, WINDOW_MARK, False)
    assert installed is has("attention layers get the whole cache")


# -- the slots neofix counts where the call gives no cache_position (benchmarks/MUTATION.md, 2026-12-06) ------------


@needs_static_loop
def test_a_left_padded_prompt_gets_over_an_empty_static_cache_the_positions_it_gets_over_a_dynamic_one(model, batch):
    """No cache_position given: the prompt's slots are the cache's own count (0 for an empty cache) plus its columns.
    Its real tokens get the mask's positions and its pads transformers' own (their slots: vanilla's positions there),
    exactly as over a dynamic cache (the positions the model looks up, seen at its position table)."""
    ids, mask = batch
    seen = []
    hook = model.transformer.wpe.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", neofix.NeofixWarning)
            model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): static_cache(model, ids.shape[0])})
            model(input_ids=ids, attention_mask=mask, use_cache=True)
            with neofix.unpatched():
                model(input_ids=ids, attention_mask=mask, **{cache_keyword(model): static_cache(model, ids.shape[0])})
    finally:
        hook.remove()
    static, dynamic, vanilla = seen
    assert torch.equal(static, dynamic)
    pads = mask == 0
    assert pads.any() and torch.equal(static[pads], vanilla.expand_as(static)[pads])


@needs_static_loop
def test_a_static_loop_fed_inputs_embeds_is_repaired_as_one_fed_input_ids(model, batch):
    """A hand loop over a static cache feeding ``inputs_embeds`` (no input_ids, no cache_position) with the prompt's
    mask at every step: the slots are counted from the embeddings' shape as from the ids', the cache's length told,
    the stale mask extended: the reference tokens, as the same loop feeding input_ids."""
    ids, mask = batch
    embed = model.get_input_embeddings()

    def loop(embeds):
        cache, keyword, fed, new = static_cache(model, ids.shape[0]), cache_keyword(model), ids, []
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", neofix.NeofixWarning)
            for _ in range(5):
                inputs = {"inputs_embeds": embed(fed)} if embeds else {"input_ids": fed}
                out = model(**inputs, attention_mask=mask, use_cache=True, **{keyword: cache})
                fed = out.logits[:, -1:].argmax(-1)
                new.append(fed)
        return torch.cat(new, dim=-1)

    expected = reference(model, ids, mask, 5)
    assert torch.equal(loop(False), expected)
    assert torch.equal(loop(True), expected)


@needs_static_loop
@pytest.mark.parametrize("inputs", ["1D input_ids", "neither input_ids nor inputs_embeds"])
def test_a_static_cache_without_cache_position_changes_no_error_of_a_malformed_call(model, inputs):
    """Counting a static cache's slots needs the new tokens' count: a call whose inputs have no such dimension (1D
    input_ids, neofix's InputShapeError) or no inputs at all (transformers' own error) fails as over a dynamic
    cache."""
    given = {"input_ids": torch.randint(1, 96, (5,))} if inputs.startswith("1D") else {}

    def error(**cache):
        with torch.no_grad(), pytest.raises(Exception) as raised:
            model(attention_mask=torch.ones(1, 5, dtype=torch.long), use_cache=True, **given, **cache)
        return type(raised.value), str(raised.value)

    dynamic = error()
    assert error(**{cache_keyword(model): static_cache(model, 1)}) == dynamic
    if not given:
        with neofix.unpatched():
            assert error() == dynamic  # transformers' own


@needs_static_loop
def test_a_chunk_after_a_static_caches_prompt_gets_the_positions_it_gets_after_a_dynamic_cache():
    """After a left-padded prompt, a chunk of 3 tokens (no cache_position: its slots the cache's count plus 0, 1, 2),
    its mask of every token so far: the positions the model looks up are those the same chunk gets after a dynamic
    cache (each real token's count of real tokens before it)."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, window_size=SLOTS)
    ids, mask = left_padded_batch([6, 3, 5])
    chunk = torch.randint(1, 96, (3, 3), generator=torch.Generator().manual_seed(3))
    full = torch.cat([mask, torch.ones_like(chunk)], dim=-1)
    seen = []
    hook = model.transformer.wpe.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", neofix.NeofixWarning)
            for cache in (static_cache(model, 3), None):
                given = {cache_keyword(model): cache} if cache is not None else {}
                out = model(input_ids=ids, attention_mask=mask, use_cache=True, **given)
                model(input_ids=chunk, attention_mask=full, use_cache=True,
                      **{cache_keyword(model): cache if cache is not None else output_cache(out)})
    finally:
        hook.remove()
    static, dynamic = seen[1], seen[3]
    assert torch.equal(static, dynamic)
    assert torch.equal(dynamic, full.cumsum(-1)[:, -3:] - 1)


@needs_static_loop
def test_a_static_loop_of_a_one_layer_model_is_repaired():
    """A model of one attention layer (the cache's count read from its only layer), the prompt's mask at every step
    over a static cache: the stale mask extended, the reference tokens."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=1, attention_types=[[["global"], 1]])
    ids, mask = left_padded_batch([6, 3, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        got = static_loop(model, model, ids, mask, 5, stale_mask=True)
    assert torch.equal(got, reference(model, ids, mask, 5))


@needs_static_loop
def test_a_static_loop_over_sliding_window_layers_is_repaired():
    """Mistral (a window of 4): on 5.x its static cache's layers are sliding-window ones, whose count of tokens is a
    Python int; the prompt's mask at every step, no cache_position: the slots counted from that int tell the cache's
    length, the stale mask is extended: the reference tokens (within the window)."""
    model = tiny_model("mistral", seed=0, dtype=torch.float32)
    ids, mask = left_padded_batch([3, 2], seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        got = static_loop(model, model, ids, mask, 2, stale_mask=True)
    assert torch.equal(got, reference(model, ids, mask, 2))


def test_no_slots_are_counted_for_a_call_whose_cache_does_not_count_them():
    """``static_slots`` of a call without a cache (Llama 4.38 - 4.40 keeps its static cache on the attention layers,
    the forward given none) or with one that has no count: ``None`` (the step is then read as given), not an error."""
    from neofix._caches import static_slots

    assert static_slots(None, 2, "cpu") is None
    assert static_slots(object(), 2, "cpu") is None
    assert static_slots(type("Layers", (), {"layers": []})(), 2, "cpu") is None
