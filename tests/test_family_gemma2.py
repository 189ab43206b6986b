"""Gemma2 (transformers 4.42 and later): the modern decoders' scenarios (:mod:`tests._modern_family`) on a tiny random
Gemma2 (``neofix.testing.FAMILY_CONFIGS["gemma2"]``)."""

from __future__ import annotations

import pytest

from ._modern_family import *  # noqa: F401,F403 - the scenarios, collected here for this family
from ._modern_family import skip_unless_available

skip_unless_available("gemma2", "4.42")


@pytest.fixture(scope="module")
def family():
    return "gemma2"


# -- a growing cache past the sliding window (up to 4.52) --------------------------------------------------------------


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_growing_cache_past_the_window_is_refused_where_transformers_reads_it_wrong(name):
    """A hand loop passing a ``DynamicCache`` from its first step (window 4, a 3-token prompt): up to 4.52 the
    sliding-window layers read it wrong once it would hold more than the window (4.45 - 4.47: wrong tokens and no
    error; 4.48 - 4.52: a size ``RuntimeError`` inside attention), so the step whose cached plus new tokens pass the
    window is an ``AttentionWindowError`` before it runs; from 4.53 every step runs and gives the reference tokens."""
    import inspect

    import torch
    import transformers
    from transformers import DynamicCache

    import neofix
    from neofix._compat import release
    from neofix.testing import reference_greedy, tiny_model

    if not hasattr(transformers, FAMILY_CLASSES[name]):
        pytest.skip(f"transformers {transformers.__version__} has no {FAMILY_CLASSES[name]}")
    model = tiny_model(name, dtype=torch.float64, attn_implementation="eager")
    keyword = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    ids = torch.tensor([[11, 12, 13]])

    @torch.no_grad()
    def loop():
        cache, fed, tokens = DynamicCache(), ids, []
        for _ in range(4):  # the cache holds 3, 4, 5, 6: the second step (4 + 1 tokens) passes the window of 4
            total = ids.shape[1] + len(tokens)
            out = model(input_ids=fed, attention_mask=torch.ones(1, total, dtype=torch.long), use_cache=True,
                        **{keyword: cache})
            fed = out.logits[:, -1:].argmax(-1)
            tokens.append(int(fed))
        return tokens

    expected = reference_greedy(model, ids, None, 4)[0, 3:].tolist()
    if release() >= (4, 53):
        assert loop() == expected
        return
    with neofix.unpatched():
        try:
            plain = loop()
        except RuntimeError:
            plain = None
    assert plain != expected  # vanilla: wrong tokens (4.45 - 4.47) or a size error (4.48 - 4.52)
    with pytest.raises(neofix.AttentionWindowError) as raised:
        loop()
    assert str(raised.value) == (
        "this step attends over 5 tokens (the cache holds 4), past the sliding window of 4 (config.sliding_window), "
        f"and on transformers {transformers.__version__} the sliding-window layers read a DynamicCache that holds "
        f"more than the window wrong ({'wrong tokens, without an error' if release() < (4, 48) else 'a size error inside attention'}; "
        "right from 4.53). Decode with generate(), or pass a HybridCache with room for the whole sequence "
        "(max_cache_len) from the first step, or upgrade transformers to 4.53 or later"
    )


FAMILY_CLASSES = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
