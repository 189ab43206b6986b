"""Compiled hand-written loops over a dynamic cache (issue 39): as correct as the eager loop on every release.

``torch.compile(model.forward, fullgraph=True)`` (any graph break is an error), a left-padded batch, no
position_ids, the mask of the tokens so far or the prompt's (stale): inside dynamo neofix runs its shape logic
(mask extension, positions from the mask) into the graph, so the tokens are the full-recompute reference's.  The
default backend (inductor) is slow on the CPU: those run where slow tests run (the oldest and newest release).
tests/test_position_values.py runs ``torch.compile(model)`` loops with the eager backend on every release.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from neofix.testing import reference_greedy, tiny_gpt_neo

from .loops import decode, left_padded_batch

STEPS = 6


@pytest.mark.parametrize(
    "backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("mask_mode", ["synced", "stale"])
def test_a_fullgraph_compiled_loop_gives_the_reference_tokens(backend, mask_mode):
    from torch._dynamo.utils import counters

    model = tiny_gpt_neo(seed=0, dtype=torch.float32, num_layers=2)
    ids, mask = left_padded_batch([6, 3, 5])
    expected = reference_greedy(model, ids, mask, STEPS)[:, ids.shape[1]:]
    torch._dynamo.reset()
    counters.clear()
    try:
        fast = torch.compile(model, backend=backend, fullgraph=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = decode(fast, ids, mask, STEPS, mask_mode=mask_mode)
        assert dict(counters["graph_break"]) == {}
        assert torch.equal(got, expected)
    finally:
        torch._dynamo.reset()
