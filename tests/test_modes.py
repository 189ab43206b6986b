"""Repair mode repairs and warns once per kind; strict mode raises on anything that would need a repair."""

from __future__ import annotations

import warnings

import pytest
import torch

import neofix
from neofix.testing import reference_greedy

from ._versions import legacy
from .loops import decode, left_padded_batch

REPAIRABLE = {
    # loop options -> (error class in strict mode, words of the message)
    "stale mask": (dict(mask_mode="stale"), neofix.MaskLengthError, "attention_mask has 6 columns"),
    "stale positions": (dict(positions="stale"), neofix.PositionError, "position_ids has 6 columns"),
    "full-length positions": (dict(positions="full"), neofix.PositionError, "position_ids has 7 columns"),
}


def reference(model, ids, mask, steps):
    """The ``steps`` tokens the full-recompute reference generates after the prompt."""
    return reference_greedy(model, ids, mask, steps)[:, ids.shape[1]:]


@pytest.mark.parametrize("case", sorted(REPAIRABLE))
def test_strict_mode_raises_where_repair_mode_repairs(model, case):
    options, error, words = REPAIRABLE[case]
    ids, mask = left_padded_batch([6, 4])
    repaired = decode(model, ids, mask, 3, **options) if case == "full-length positions" else None
    if repaired is None:
        with pytest.warns(neofix.NeofixWarning):
            repaired = decode(model, ids, mask, 3, **options)
    assert torch.equal(repaired, reference(model, ids, mask, 3))
    neofix.configure(mode="strict")
    with pytest.raises(error, match=words) as raised:
        decode(model, ids, mask, 3, **options)
    assert isinstance(raised.value, ValueError)


def test_strict_mode_accepts_well_formed_steps(model, strict):
    ids, mask = left_padded_batch([6, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        assert torch.equal(decode(model, ids, mask, 4, positions="correct"), reference(model, ids, mask, 4))
    # no positions on a left-padded prompt: derived from the mask in strict mode too (no error), and said once
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(decode(model, ids, mask, 4, positions="none"), reference(model, ids, mask, 4))
    said = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    assert len(said) == 1 and "left-padded and no position_ids were given" in said[0]


def test_each_repair_kind_is_reported_once(model):
    ids, mask = left_padded_batch([6, 4])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        decode(model, ids, mask, 4, mask_mode="stale", positions="correct")
        decode(model, ids, mask, 4, mask_mode="stale", positions="correct")
        decode(model, ids, mask, 4, positions="stale")
        decode(model, ids, mask, 4, positions="stale")
    messages = [str(w.message) for w in caught if issubclass(w.category, neofix.NeofixWarning)]
    assert len(messages) == 2, messages
    assert "extended it with ones" in messages[0]
    assert "derived them from the attention mask" in messages[1]


def test_warning_points_at_the_callers_line(model):
    ids, mask = left_padded_batch([6, 4])
    with pytest.warns(neofix.NeofixWarning) as caught:
        decode(model, ids, mask, 2, mask_mode="stale")
    assert caught[0].filename.endswith("loops.py")  # the user's loop, not torch or transformers internals


def test_legacy_tuple_cache_in_strict_mode(model):
    """Where transformers rejects tuple caches (4.54+) neofix wraps them; strict mode says so instead."""
    from neofix._families import gpt_neo

    ids, mask = left_padded_batch([6, 4])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    from ._versions import cache_keyword, output_cache

    cache = legacy(output_cache(out))
    step = dict(input_ids=ids[:, -1:], attention_mask=torch.cat([mask, mask[:, -1:]], -1), use_cache=True)
    neofix.configure(mode="strict")
    if not gpt_neo.ADAPTER.legacy_cache_rejected:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # 4.45 - 4.53 warn about tuples themselves
            model(**step, **{cache_keyword(): cache})
        return
    with pytest.raises(neofix.NeofixError, match="legacy tuple cache"):
        with torch.no_grad():
            model(**step, **{cache_keyword(): cache})


def test_repairs_raise_every_time_where_warnings_are_errors(model):
    """With ``-W error`` (or ``simplefilter("error")``) a repair is an error on every call, not only the first."""
    ids, mask = left_padded_batch([6, 4])
    with warnings.catch_warnings():
        warnings.simplefilter("error", neofix.NeofixWarning)
        for _ in range(2):
            with pytest.raises(neofix.NeofixWarning, match="extended it with ones"):
                decode(model, ids, mask, 3, mask_mode="stale", positions="correct")
    with pytest.warns(neofix.NeofixWarning):  # and once warnings are shown again, it is still reported once
        decode(model, ids, mask, 3, mask_mode="stale", positions="correct")
