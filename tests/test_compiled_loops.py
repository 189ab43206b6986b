"""Compiled hand-written loops over a dynamic cache (issue 39): as correct as the eager loop on every release.

``torch.compile(model)``, a left-padded batch, no position_ids, the mask of the tokens so far or the prompt's
(stale): inside dynamo neofix runs its shape logic (mask extension, positions from the mask) into the graph, so the
tokens are the full-recompute reference's, and it breaks no graph vanilla does not break (transformers' own
``warning_once`` breaks the graph on 4.45 - 4.46, where a legacy tuple cache is passed back).  The
default backend (inductor) is slow on the CPU: those run where slow tests run (the oldest and newest release).
tests/test_position_values.py runs ``torch.compile(model)`` loops with the eager backend on every release.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import neofix
from neofix.testing import reference_greedy, tiny_gpt_neo

from .loops import decode, left_padded_batch

STEPS = 6


def compiled_decode(model, ids, mask, backend, mask_mode):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = decode(torch.compile(model, backend=backend), ids, mask, STEPS, mask_mode=mask_mode)
        return got, set(counters["graph_break"])  # why graphs broke (a reason counts once per compilation)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize(
    "backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("mask_mode", ["synced", "stale"])
def test_a_compiled_loop_gives_the_reference_tokens(backend, mask_mode):
    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2)
    ids, mask = left_padded_batch([6, 3, 5])
    expected = reference_greedy(model, ids, mask, STEPS)[:, ids.shape[1]:]
    got, breaks = compiled_decode(model, ids, mask, backend, mask_mode)
    assert torch.equal(got, expected)
    if mask_mode == "synced":  # (vanilla cannot run a stale mask up to 5.0: a shape error)
        with neofix.unpatched():
            plain, vanilla_breaks = compiled_decode(model, ids, mask, backend, mask_mode)
        assert not torch.equal(plain, expected)  # vanilla compiled: the padded rows go wrong
        assert breaks == vanilla_breaks  # neofix adds no reason to break a graph
