"""The tracing and compilation paths, patched vs vanilla, on every release that has each.

While a trace or export runs (torch.jit, torch.fx, torch.export, ONNX), neofix stays out of the way: the patched model
traces into exactly the graph vanilla transformers traces, and the traced artifact computes what the eager model
computes.  Under torch.compile neofix's shape logic is traced into the graph (no value read, no graph break), so a
compiled forward computes what the eager patched one does.  Inputs are unpadded: there the eager patched model computes
exactly what vanilla does, so eager, traced-patched and traced-vanilla must all agree.  (On a left-padded batch
without position_ids the eager and compiled patched model derive positions from the mask, a traced or exported one
does not: see README, "Tracing and compilation".)

Models have two layers (one global, one local attention): every kind of layer, at half the tracing time.
"""

from __future__ import annotations

import gc
import io

import pytest
import torch

import neofix  # noqa: F401 - the patch under test
from neofix.testing import reference_positions, tiny_gpt_neo

from ._versions import requires
from .test_never_break import (
    assert_adds_nothing,
    assert_identical,
    assert_ran,
    assert_same,
    both,
    capture,
    fresh,
    token_ids,
)


@pytest.fixture(scope="module")
def lm():
    return tiny_gpt_neo(seed=2, dtype=torch.float32, num_layers=2)


class Plain(torch.nn.Module):
    """``model(input_ids, attention_mask)`` -> its first output (logits, or the last hidden state), without a cache
    or a ModelOutput: what every tracer and exporter accepts."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=False)[0]


def example(seed=0):
    ids = token_ids(2, 6, seed)
    return ids, torch.ones_like(ids)


TRACE_INPUTS = example(0)  # what the tracers see
CHECK_INPUTS = example(1)  # what the traced artifacts are run on: same shapes, other tokens


def eager_on(module, ids, mask):
    with torch.no_grad():
        return module(ids, mask)


def eager(module):
    return eager_on(module, *CHECK_INPUTS)


def module_of(lm, which):
    return Plain(lm if which == "lm" else lm.transformer)


WHICH = pytest.mark.parametrize("which", ["lm", "base"], ids=["GPTNeoForCausalLM", "GPTNeoModel"])


def _reset_dynamo():
    torch._dynamo.reset()


# -- torch.jit.trace ----------------------------------------------------------------------------------------------------


@WHICH
def test_jit_trace(lm, which):
    module = module_of(lm, which)

    def run():
        traced = torch.jit.trace(module, TRACE_INPUTS)
        return traced.code, traced(*CHECK_INPUTS)

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert torch.equal(patched.result[1], eager(module))


def test_traced_graph_keeps_transformers_positions_on_left_padding(lm):
    """While tracing, neofix steps aside entirely: on a left-padded batch without position_ids the traced graph
    computes what vanilla transformers computes (its own positions), not what the eager patched model computes.

    (So ``check_trace``, which reruns the eager model, warns "Output nr 1. of the traced function does not match"
    here under the patch: hence ``check_trace=False``.  Pass position_ids to trace such a batch faithfully.)"""
    module = module_of(lm, "lm")
    ids, mask = example(3)
    mask[1, :2] = 0
    patched, plain = both(lambda: torch.jit.trace(module, (ids, mask), check_trace=False)(ids, mask))
    assert_identical(patched, plain)
    neofix_eager = eager_on(module, ids, mask)
    assert not torch.equal(patched.result, neofix_eager)  # the eager patched model derives positions from the mask
    assert torch.equal(patched.result[0], neofix_eager[0])  # the unpadded row: the same either way


def test_traced_graph_with_position_ids_on_left_padding(lm):
    """The faithful way to trace a left-padded batch: pass position_ids; then trace, eager patched and vanilla agree."""

    class Positioned(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids):
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
                return_dict=False,
            )[0]

    module = Positioned(lm)
    ids, mask = example(3)
    mask[1, :2] = 0
    inputs = (ids, mask, reference_positions(mask))
    patched, plain = both(lambda: torch.jit.trace(module, inputs)(*inputs))  # check_trace on: no mismatch warning
    assert_identical(patched, plain)
    with torch.no_grad():
        assert torch.equal(patched.result, module(*inputs))


# -- torch.compile ------------------------------------------------------------------------------------------------------


@WHICH
def test_dynamo_captures_one_graph_without_breaks(lm, which):
    """torch._dynamo.explain: one graph and no graph break, as vanilla.  (The graph is not vanilla's: under
    torch.compile neofix traces its shape logic into it, positions from the mask included: see
    tests/test_position_values.py for compiled loops.)"""
    module = module_of(lm, which)

    def run():
        _reset_dynamo()
        explained = torch._dynamo.explain(module)(*TRACE_INPUTS)
        return explained.graph_count, explained.graph_break_count

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert patched.result == (1, 0), f"graphs, graph breaks: {patched.result}"


@WHICH
def test_compile_fullgraph(lm, which):
    """Patched, compiled with ``fullgraph=True`` (vanilla compiles to the same single graph: see above)."""
    module = module_of(lm, which)
    _reset_dynamo()
    run = capture(lambda: torch.compile(module, backend="eager", fullgraph=True)(*CHECK_INPUTS))
    assert run.error is None, run.error
    assert torch.equal(run.result, eager(module))


def test_compile_aot_eager(lm):
    """The aot_autograd path (what inductor builds on), forward and backward: about 3 s."""
    module = module_of(lm, "lm")
    _reset_dynamo()
    compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
    logits = compiled(*CHECK_INPUTS)
    logits.square().mean().backward()
    compiled_grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    expected = module(*CHECK_INPUTS)
    expected.square().mean().backward()
    # aot_autograd decomposes some ops: the same values up to float32 rounding
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
    for name, p in module.named_parameters():
        torch.testing.assert_close(compiled_grads[name], p.grad, rtol=1e-4, atol=1e-5)
    module.zero_grad(set_to_none=True)


def test_compile_the_base_model_directly(lm):
    """``torch.compile(model.transformer)``: dynamo traces neofix's GPTNeoModel.forward wrapper itself."""
    base = lm.transformer

    def run():
        _reset_dynamo()
        compiled = torch.compile(base, backend="eager", fullgraph=True)
        return compiled(input_ids=CHECK_INPUTS[0], attention_mask=CHECK_INPUTS[1], use_cache=False).last_hidden_state

    patched, plain = both(run)
    assert_identical(patched, plain)
    with torch.no_grad():
        expected = base(input_ids=CHECK_INPUTS[0], attention_mask=CHECK_INPUTS[1], use_cache=False)
    assert torch.equal(patched.result, expected.last_hidden_state)


def test_a_compiled_forward_reads_nothing_eager_calls_remember(lm):
    """neofix remembers, by weak reference, what some eager prompts built their caches with (a prompt given its mask's
    positions plus an offset marks its cache: tests/test_families.py).  A compiled forward reads none of it: were it
    read, dynamo would guard on it, and a cache marked or freed between two compiled calls (by an eager prompt
    elsewhere, or by the garbage collector, even while dynamo compiles) would compile the forward again, or fail
    the guard check on the frame that built it."""
    from neofix import _wrappers

    graphs = []

    def counting(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    _reset_dynamo()
    compiled = torch.compile(module_of(lm, "lm"), backend=counting)
    ids, mask = CHECK_INPUTS
    with torch.no_grad():
        first = compiled(ids, mask)
        assert len(graphs) == 1
        marked = lm(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask) + 3, use_cache=True)
        assert _wrappers._BUILT, "the eager prompt given offset positions marked its cache"
        assert torch.equal(compiled(ids, mask), first)
        del marked
        gc.collect()
        assert torch.equal(compiled(ids, mask), first)
    assert len(graphs) == 1, f"compiled {len(graphs)} times"
    _reset_dynamo()


@pytest.mark.parametrize("region", ["block", "attention"])
def test_regional_compilation(region):
    """``module.compile()`` on each block, or on each attention module (the module neofix's flash-attention-2 wrapper sits on)."""

    def run():
        _reset_dynamo()
        model = fresh(dtype=torch.float32, num_layers=2)
        for block in model.transformer.h:
            (block if region == "block" else block.attn.attention).compile(backend="eager", fullgraph=True)
        with torch.no_grad():
            return model(input_ids=CHECK_INPUTS[0], attention_mask=CHECK_INPUTS[1]).logits

    patched, plain = both(run)
    assert_identical(patched, plain)
    with torch.no_grad():
        expected = fresh(dtype=torch.float32, num_layers=2)(input_ids=CHECK_INPUTS[0], attention_mask=CHECK_INPUTS[1])
    assert torch.equal(patched.result, expected.logits)


# -- torch.export ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "strict", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["non-strict", "strict"]
)
@WHICH
def test_torch_export(lm, which, strict):
    module = module_of(lm, which)

    def run():
        _reset_dynamo()
        program = torch.export.export(module, TRACE_INPUTS, strict=strict)
        return program.graph_module.code, program.module()(*CHECK_INPUTS)

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert torch.equal(patched.result[1], eager(module))


# -- ONNX export -----------------------------------------------------------------------------------------------------


def without_provenance(model_bytes):
    """The ONNX model with its provenance (Python stack traces, doc strings) removed: what the graph computes.

    The dynamo exporter records, for every node, the Python frames that produced it; with neofix patched those
    include neofix's wrapper, which changes the bytes but not the graph.
    """
    import onnx

    def strip(message):
        for field, value in message.ListFields():
            if field.name in ("metadata_props", "doc_string"):
                message.ClearField(field.name)
            elif field.type == field.TYPE_MESSAGE:
                repeated = getattr(field, "is_repeated", None)
                if repeated is None:  # older protobuf
                    repeated = field.label == field.LABEL_REPEATED
                for item in value if repeated else [value]:
                    strip(item)

    model = onnx.load_from_string(model_bytes)
    strip(model)
    return model.SerializeToString(deterministic=True)


def run_onnx(model_bytes, ids, mask):
    import onnxruntime

    session = onnxruntime.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    names = [graph_input.name for graph_input in session.get_inputs()]
    feeds = {name: value.numpy() for name, value in zip(names, (ids, mask))}
    return torch.from_numpy(session.run(None, feeds)[0])


@requires("onnx")
@requires("onnxruntime")
def test_onnx_export_torchscript_exporter(lm):
    """``torch.onnx.export(..., dynamo=False)``: the TorchScript-based exporter (torch.jit.trace underneath)."""
    module = module_of(lm, "lm")

    def run():
        buffer = io.BytesIO()
        torch.onnx.export(module, TRACE_INPUTS, buffer, dynamo=False, input_names=["input_ids", "attention_mask"])
        return buffer.getvalue()

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert patched.result == plain.result  # byte for byte
    torch.testing.assert_close(run_onnx(patched.result, *CHECK_INPUTS), eager(module), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@requires("onnxscript")
@requires("onnxruntime")
def test_onnx_export_dynamo_exporter(lm):
    """``torch.onnx.export(..., dynamo=True)`` (torch.export underneath, then onnxscript): slow, ~15 s."""
    module = module_of(lm, "lm")

    def run():
        _reset_dynamo()
        program = torch.onnx.export(module, TRACE_INPUTS, dynamo=True, verbose=False)
        return program.model_proto.SerializeToString()

    patched, plain = both(run)
    assert_ran(patched, plain)
    assert without_provenance(patched.result) == without_provenance(plain.result)  # the same graph, byte for byte
    assert_adds_nothing(patched, plain)
    torch.testing.assert_close(run_onnx(patched.result, *CHECK_INPUTS), eager(module), rtol=1e-4, atol=1e-4)


def test_patched_eager_equals_vanilla_eager_on_these_inputs(lm):
    """The premise of this file: on unpadded inputs the eager patched model computes exactly what vanilla does."""
    for which in ("lm", "base"):
        module = module_of(lm, which)
        patched, plain = both(lambda: eager(module))
        assert_identical(patched, plain)
        assert_same(patched.result, plain.result)


# -- transformers' torch.fx tracer (last: on transformers 4.30 - 4.45 its tracer leaves dynamo unable to compile
# anything in the same process afterwards, vanilla too; tests/test_tracing_fx_families.py runs after this file) ------------------------------------------------------------------------------------


@requires("transformers fx tracer")
@pytest.mark.parametrize("head", ["GPTNeoForCausalLM", "GPTNeoModel", "GPTNeoForSequenceClassification"])
def test_hf_fx_symbolic_trace(head):
    import transformers
    from transformers.utils.fx import symbolic_trace

    model = fresh(head, dtype=torch.float32, num_layers=2)

    def run():
        traced = symbolic_trace(model, input_names=["input_ids", "attention_mask"])
        ids, mask = CHECK_INPUTS
        return traced.code, traced(input_ids=ids, attention_mask=mask)

    patched, plain = both(run)
    assert_identical(patched, plain)
    assert isinstance(model, transformers.PreTrainedModel)
    with torch.no_grad():
        expected = model(input_ids=CHECK_INPUTS[0], attention_mask=CHECK_INPUTS[1])
    key = next(iter(expected.keys()))
    assert torch.equal(patched.result[1][key], expected[key])
