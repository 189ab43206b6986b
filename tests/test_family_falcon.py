"""Falcon (transformers 4.33 and later, patched from 4.36): the modern decoders' scenarios (:mod:`tests._modern_family`)
on its tiny random model of the usual kind (rotary positions, multi-query attention, no position table), and what the
ALiBi kind (``alibi=True``: Falcon-RW) adds, where positions are ignored by the model and so left alone, as BLOOM's.

Every correctness check compares with the full-recompute reference token for token (float64, sharpened)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("falcon", "4.33")


@pytest.fixture(scope="module")
def family():
    return "falcon"


# -- what the model's config decides: ALiBi or rotary, and its cache's heads ------------------------------------------

import sys  # noqa: E402

import torch  # noqa: E402

from neofix._core import Positions  # noqa: E402
from neofix._doctor._scenarios import Context  # noqa: E402
from neofix._families import FAMILIES  # noqa: E402
from neofix.testing import reference_greedy, tiny_model  # noqa: E402

from ._modern_family import float64_mask_overflows, run, vanilla  # noqa: E402
from ._versions import TF_RELEASE, output_cache  # noqa: E402
from .loops import decode, left_padded_batch, left_padded_chunk_after_a_cache, patched_and_vanilla  # noqa: E402

#: The configs measured (the adapter's docstring): the tiny model's (multi-query, Falcon-7B's layout), multi-head,
#: the new decoder architecture with 2 key-value groups (Falcon-40B's), and ALiBi (Falcon-RW's, multi-head).
KINDS = {
    "mqa": {},
    "mha": dict(multi_query=False),
    "new": dict(new_decoder_architecture=True, num_kv_heads=2),
    "alibi": dict(alibi=True, multi_query=False),
    "alibi-mqa": dict(alibi=True),
    "serial-biased": dict(parallel_attn=False, bias=True),  # (attention then MLP, biased projections: nothing read)
}
ALIBI = dict(alibi=True, multi_query=False)


def adapter_module():
    return sys.modules[FAMILIES["falcon"].adapter]


def model_of(overrides, attention="sdpa"):
    """float64 where vanilla runs it (from 4.45: before, its mask helpers overflow; neofix's float64 path is tested
    by tests/test_families.py), else float32."""
    dtype = torch.float32 if float64_mask_overflows("falcon") else torch.float64
    return tiny_model("falcon", seed=0, dtype=dtype, attn_implementation=attention, **overrides)


def said_nothing(messages):
    return messages == []


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_config_reads_as_its_kind_and_its_cache_as_written(kind):
    """The model forward reads an ALiBi model as one that takes no positions and a rotary one as rotary (``positions_of``,
    through ``for_model``), the doctor alike; the cache's key-value heads are those the model writes (one with
    multi-query attention; the new decoder architecture's every query head up to 5.24, its groups from 5.25), so a
    left-padded hand loop decodes the reference's tokens without a word."""
    from neofix._families._contract import for_model

    model = model_of(KINDS[kind])
    adapter = FAMILIES["falcon"].load_adapter()
    expected = Positions.NONE if model.config.alibi else Positions.ROTARY
    assert for_model(adapter, model.config).positions is expected
    assert Context(model, adapter).positions_kind == expected.value
    ids, mask = left_padded_batch([6, 3, 5], seed=3)
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))
    keys = cache[0][0] if isinstance(cache, tuple) else cache.layers[0].keys if hasattr(cache, "layers") else cache.key_cache[0]
    limits = adapter.limits(model.config)
    assert (keys.shape[1], keys.shape[-1]) == (limits.heads, limits.head_dim)
    tokens, messages = run(lambda: decode(model, ids, mask, 5))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference_greedy(model, ids, mask, 5)[:, ids.shape[1]:])
    assert said_nothing(messages), messages


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_alibi_left_padded_generate_gives_the_reference_as_vanilla(attention):
    """generate over a left-padded batch of the ALiBi kind: the reference's tokens, vanilla's bit for bit."""
    model = model_of(ALIBI, attention)
    ids, mask = left_padded_batch([6, 3, 5], seed=3)
    call = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, told), (plain, _) = patched_and_vanilla(lambda: run(call))
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, reference_greedy(model, ids, mask, 6, eos_token_id=0))
    assert torch.equal(patched, plain) and said_nothing(told), told


@pytest.mark.parametrize("positions", ["stale", "frozen", "arange", "offset"])
def test_alibi_positions_the_model_ignores_are_left_alone(positions):
    """A hand loop of the ALiBi kind given stale, frozen, pad-counting or offset positions: the model never reads
    them, so it decodes the reference's tokens as vanilla does, and neofix neither refuses nor repairs them (the rotary
    kind refuses stale ones and repairs frozen ones: see the scenarios above)."""
    model = model_of(ALIBI)
    ids, mask = left_padded_batch([6, 3, 5], seed=3)
    expected = reference_greedy(model, ids, mask, 5)[:, ids.shape[1]:]
    (tokens, messages), (plain, _) = patched_and_vanilla(lambda: run(lambda: decode(model, ids, mask, 5, positions=positions)))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, expected) and torch.equal(plain, expected)
    assert said_nothing(messages), messages


def test_alibi_stale_mask_is_extended():
    """The ALiBi kind given the prompt's mask at every step: vanilla fails on the shapes (every release measured);
    neofix extends it with ones and says so once: the reference's tokens."""
    model = model_of(ALIBI)
    ids, mask = left_padded_batch([6, 3, 5], seed=3)
    plain = vanilla(lambda: decode(model, ids, mask, 5, mask_mode="stale"))
    assert isinstance(plain, RuntimeError), plain
    tokens, messages = run(lambda: decode(model, ids, mask, 5, mask_mode="stale"))
    assert isinstance(tokens, torch.Tensor), tokens
    assert torch.equal(tokens, reference_greedy(model, ids, mask, 5)[:, ids.shape[1]:])
    assert len(messages) == 1 and "extended it with ones on the right" in messages[0], messages


@pytest.mark.parametrize("kind", ["alibi", "mqa"])
def test_a_left_padded_chunk_after_a_cache_gives_the_whole_forwards_logits(kind):
    """Three tokens after a cache of six, rows left-padded by four and five (sdpa, the default): every real token's
    logits are those of one forward over the whole sequence, for either kind.  On 4.36 - 4.38 transformers unmasks the
    rows of such a chunk as if it started the sequence (ALiBi: ``AttentionMaskConverter._unmask_unattended``; rotary:
    the sdpa mask helper): vanilla fails (``IndexError``); neofix builds that mask right."""
    model = tiny_model("falcon", seed=0, dtype=torch.float32, **KINDS[kind])
    whole, patched, plain = left_padded_chunk_after_a_cache(model)
    assert isinstance(patched, torch.Tensor), patched
    torch.testing.assert_close(patched, whole, rtol=1e-4, atol=1e-4)
    buggy = (4, 36) <= TF_RELEASE < (4, 39)
    assert isinstance(plain, IndexError) == buggy, plain


def test_the_alibi_kind_is_its_own_adapter_once():
    """``for_model`` makes the ALiBi kind's adapter once (the same object every call) and gives the rotary kind the
    family's own; every other fact is the family's."""
    from neofix._families._contract import for_model

    adapter = FAMILIES["falcon"].load_adapter()
    alibi, rotary = model_of(ALIBI).config, model_of({}).config
    assert for_model(adapter, rotary) is adapter
    made = for_model(adapter, alibi)
    assert made is for_model(adapter, alibi) and made.positions is Positions.NONE
    assert made.limits is adapter.limits and made.legacy_cache_rejected == adapter.legacy_cache_rejected


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_float64_alibi_model_generates_the_reference(attention):
    """The ALiBi kind in float64: on 4.36 - 4.44 vanilla cannot run it (the mask helpers overflow: "value cannot be
    converted to type float without overflow"); neofix builds that mask in float32 (ALiBi's path reads it as
    booleans, eager adds it to float64 scores), and generate gives the reference's tokens.  Elsewhere: vanilla's."""
    model = tiny_model("falcon", seed=0, dtype=torch.float64, attn_implementation=attention, **ALIBI)
    ids, mask = left_padded_batch([6, 3, 5], seed=3)
    call = lambda: model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)  # noqa: E731
    (patched, told), (plain, _) = patched_and_vanilla(lambda: run(call))
    assert isinstance(patched, torch.Tensor), patched
    assert torch.equal(patched, reference_greedy(model, ids, mask, 6, eos_token_id=0)) and said_nothing(told), told
    if float64_mask_overflows("falcon"):
        assert isinstance(plain, RuntimeError) and "overflow" in str(plain), plain
    else:
        assert torch.equal(patched, plain)
