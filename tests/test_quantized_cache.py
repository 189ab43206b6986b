"""transformers' quantized KV caches (``QuantizedCache``, transformers 4.42 and later): what vanilla decodes with one,
neofix decodes the same, and a stale mask over one is repaired where its length can be told.

The quantization here is the identity (:func:`lossless_quantized_cache`): transformers' own bookkeeping of a quantized
cache (the quantized part, the residual of recent tokens in full precision, flushed into the quantized part every
``residual_length`` tokens) with nothing lost, so that the full-recompute reference is the right answer, and without
quanto or HQQ, which CI does not install.  Checked against the real backends by hand (optimum-quanto 0.2.7 and HQQ
0.2.8 on 4.45, 4.53, 4.55, 4.57 and 5.25): the same readings, neofix's tokens equal to vanilla's.

A quantized cache's length, per release: 4.42 - 4.53 count it in ``_seen_tokens`` (every layer but the first answers
one token less: read as the first's); 4.54 - 4.55 tell it nowhere (see :func:`neofix._caches._quantizes`), so neofix
checks a step over one as one over a cache of unknown length; from 4.56 each quantized layer counts its own.
"""

from __future__ import annotations

import warnings

import pytest
import torch

try:
    from transformers import cache_utils
except ImportError:  # transformers before 4.36
    cache_utils = None

import neofix
from neofix.testing import reference_greedy, tiny_model

from ._versions import TF_RELEASE, cache_keyword, output_cache
from .loops import patched_and_vanilla

pytestmark = pytest.mark.skipif(
    not hasattr(cache_utils, "QuantizedCache"), reason="transformers has quantized caches from 4.42"
)

STEPS = 6
#: tokens kept in full precision before they are quantized: 2, so that every few steps flush the residual
RESIDUAL = 2
#: 4.54 - 4.55: a quantized cache's length is told nowhere
LENGTH_UNTOLD = (4, 54) <= TF_RELEASE < (4, 56)


def lossless_quantized_cache():
    """A ``QuantizedCache`` of transformers' own bookkeeping whose quantization is the identity."""
    if hasattr(cache_utils, "QuantizedLayer"):  # 4.56 and later: quantized layers

        class Layer(cache_utils.QuantizedLayer):
            def _quantize(self, tensor, axis):
                return tensor.clone()

            def _dequantize(self, quantized):
                return quantized

        return cache_utils.Cache(layer_class_to_replicate=lambda: Layer(residual_length=RESIDUAL))
    if hasattr(cache_utils, "QuantizedCacheProcessor"):  # 4.54 - 4.55: a processor of a cache of layers

        class Processor(cache_utils.QuantizedCacheProcessor):
            def validate(self):  # (it checks that the backend is installed)
                pass

            def _quantize(self, tensor, axis):
                return tensor.clone()

            def _dequantize(self, quantized):
                return quantized

        return cache_utils.DynamicCache(cache_processor=Processor, residual_length=RESIDUAL)

    class Quantized(cache_utils.QuantizedCache):  # 4.42 - 4.53

        def _quantize(self, tensor, axis):
            return tensor.clone()

        def _dequantize(self, quantized):
            return quantized

    return Quantized(cache_utils.QuantizedCacheConfig(residual_length=RESIDUAL))


@pytest.fixture(scope="module", params=["gpt_neo", "llama"])
def lm(request):
    return tiny_model(request.param, seed=0, dtype=torch.float32)


PROMPTS = {
    "unpadded": (torch.tensor([[5, 9, 13, 17, 21], [40, 3, 8, 2, 30]]), torch.ones(2, 5, dtype=torch.long)),
    "left-padded": (torch.tensor([[0, 0, 5, 9, 13], [40, 3, 8, 2, 30]]), torch.tensor([[0, 0, 1, 1, 1], [1] * 5])),
}


def outcome(call):
    """``call()``'s tokens (a list), or its error (type and message), and neofix's warnings."""
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        try:
            result = call().tolist()
        except Exception as error:  # noqa: BLE001 - vanilla's errors are compared, whatever they are
            result = (type(error).__name__, str(error))
    return result, [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]


def hand_loop(model, ids, mask, *, stale_mask=False):
    """Greedy decoding by hand over a quantized cache, the mask extended at every step (or the prompt's:
    ``stale_mask``) and positions from the mask; the new tokens."""
    cache, tokens, step_mask = lossless_quantized_cache(), ids, mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
    generated = []
    for _ in range(STEPS):
        out = model(**kwargs, **{cache_keyword(model): cache}, use_cache=True)
        cache = output_cache(out)
        tokens = out.logits[:, -1:].argmax(-1)
        generated.append(tokens)
        step_mask = torch.cat([step_mask, step_mask.new_ones((2, 1))], -1)
        kwargs = {
            "input_ids": tokens,
            "attention_mask": mask if stale_mask else step_mask,
            "position_ids": positions[:, -1:] + len(generated),
        }
    return torch.cat(generated, -1)


def reference(model, ids, mask):
    return reference_greedy(model, ids, mask, STEPS)[:, ids.shape[1]:].tolist()


def generated(model, ids, mask):
    """``generate`` over a quantized cache; the new tokens."""
    return model.generate(
        ids, attention_mask=mask, past_key_values=lossless_quantized_cache(), max_new_tokens=STEPS, do_sample=False,
        pad_token_id=0, eos_token_id=None,
    )[:, ids.shape[1]:]


@pytest.mark.parametrize("decode", [generated, hand_loop], ids=["generate", "hand loop"])
@pytest.mark.parametrize("padding", PROMPTS)
def test_decoding_over_a_quantized_cache_is_vanilla(lm, padding, decode):
    """``generate(past_key_values=QuantizedCache)`` and a well-formed hand loop over one: neofix gives vanilla's tokens
    (the reference's, where vanilla runs: 4.55 fails on a left-padded Llama, with neofix too) and says nothing.  4.42 -
    4.53 refused the first cached step (``CacheLengthError``: the layers' counts differ by one), 4.54 - 4.55 read the
    cache as empty (a size error, a ``MaskLengthError``, or a ``cache_position`` "repaired" to wrong tokens)."""
    ids, mask = PROMPTS[padding]
    (patched, told), (plain, _) = patched_and_vanilla(lambda: outcome(lambda: decode(lm, ids, mask)))
    assert told == []
    assert patched == plain
    if isinstance(plain, list):
        assert plain == reference(lm, ids, mask)


@pytest.mark.parametrize("padding", PROMPTS)
def test_a_stale_mask_over_a_quantized_cache_is_extended_where_its_length_is_told(lm, padding):
    """The classic bug over a quantized cache: the reference's tokens, said once, where the cache tells its length.
    On 4.54 - 4.55, where it does not, the mask is left as given (its width taken for the cache's, as with any cache
    of unknown length), and the loop fails or decodes as in vanilla."""
    ids, mask = PROMPTS[padding]
    loop = lambda: hand_loop(lm, ids, mask, stale_mask=True)  # noqa: E731
    (patched, told), (plain, _) = patched_and_vanilla(lambda: outcome(loop))
    if LENGTH_UNTOLD:
        assert patched == plain
    else:
        assert patched == reference(lm, ids, mask)
        assert len(told) == 1 and "attention_mask" in told[0]


def test_generate_continuing_a_quantized_cache_is_vanilla(lm):
    """``generate`` given a quantized cache that already holds a prompt and its decoded tokens (flushed into the
    quantized part), and the whole sequence plus three new tokens: neofix gives vanilla's outcome and says nothing.
    (On 4.54 - 4.55 the cache's count overstates what it holds, and generate slices the new tokens by it, in vanilla
    too: the outcome is vanilla's, not the reference's.)"""
    ids, mask = PROMPTS["unpadded"]

    def continued():
        cache = lossless_quantized_cache()
        with torch.no_grad():
            out = lm(input_ids=ids, attention_mask=mask, **{cache_keyword(lm): cache}, use_cache=True)
            cache, sequence = output_cache(out), ids
            for _ in range(3):
                sequence = torch.cat([sequence, out.logits[:, -1:].argmax(-1)], -1)
                out = lm(input_ids=sequence[:, -1:], attention_mask=torch.ones_like(sequence),
                         **{cache_keyword(lm): cache}, use_cache=True)
                cache = output_cache(out)
            sequence = torch.cat([sequence, torch.tensor([[7, 8, 9], [10, 11, 12]])], -1)
        return lm.generate(sequence, attention_mask=torch.ones_like(sequence), past_key_values=cache,
                           max_new_tokens=STEPS, do_sample=False, pad_token_id=0, eos_token_id=None)

    (patched, told), (plain, _) = patched_and_vanilla(lambda: outcome(continued))
    assert told == []
    assert patched == plain
