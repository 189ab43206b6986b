"""One rule, one place: the two value readers agree, and a step that keeps the contract passes untouched.

A step's values are read by one of two readers (``neofix._core._reads``): list scans on the host (CPU tensors) and
torch reductions read once on an accelerator.  The rules judge what they read, so the readers must answer every
question alike: a property over random masks (holes anywhere, rows of pads, other values), given positions and
cache lengths.  And since there is no fast path beside ``align``, the usual decode step must pass through it without
a torch operation of neofix's own, its tensors handed on as given.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

import neofix
from neofix._caches import of_call
from neofix._core import CacheView, Limits, Policy, Positions, StepInputs, align
from neofix._core._reads import Question, read_on_device, read_on_host
from neofix.testing import reference_positions, tiny_gpt_neo

from ._sync import NEOFIX_DIR, asked_by, device_reads
from ._versions import as_cache_object, cache_keyword, legacy, output_cache, requires
from .loops import left_padded_batch

# the profile (tests/_hypothesis.py) decides examples and seed
PROPERTY = settings(suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
LIMITS = Limits(max_positions=64, vocab_size=96, hidden_size=32, heads=4, head_dim=8)


@st.composite
def questions(draw):
    rows = draw(st.integers(1, 3))
    new = draw(st.integers(1, 4))
    past = draw(st.sampled_from([0, 0, 1, 3, None]))
    width = new + (past or 0)
    values = st.sampled_from([0, 1]) if draw(st.booleans()) else st.sampled_from([0, 1, 1, 2, -1])
    mask = None
    if draw(st.integers(0, 4)):  # mostly a mask
        mask = torch.tensor(draw(st.lists(st.lists(values, min_size=width, max_size=width), min_size=rows, max_size=rows)))
        mask = mask.to(draw(st.sampled_from([torch.long, torch.long, torch.bool, torch.float32])))
    positions = None
    if draw(st.booleans()):
        shared = draw(st.booleans())
        drawn = draw(st.lists(st.lists(st.integers(0, 9), min_size=new, max_size=new), min_size=1, max_size=1 if shared else rows))
        positions = torch.tensor(drawn if len(drawn) in (1, rows) else drawn[:1])
    ids = torch.tensor(draw(st.lists(st.lists(st.integers(-1, 96), min_size=new, max_size=new), min_size=rows, max_size=rows)))
    if mask is not None and mask.dtype == torch.bool and (mask.long() > 1).any():
        mask = mask.long()
    scheme = positions is not None and past == 0 and draw(st.booleans())  # a prompt's offset from the mask's
    return Question(ids, None, positions, positions is not None, positions is not None, mask, new, past, None, scheme)


@example(Question(torch.ones(2, 3, dtype=torch.long), None, torch.tensor([[0, 1, 2], [5, 0, 1]]), True, True,
                  torch.tensor([[1, 1, 1], [0, 0, 1]]), 3, 0))  # the second row's positions count its padding
@example(Question(torch.ones(1, 2, dtype=torch.long), None, torch.tensor([[2, 2]]), True, True,
                  torch.tensor([[1, 0, 1, 1]]), 2, 2))  # after a cache, a real token at the wrong position
@example(Question(torch.ones(2, 2, dtype=torch.long), None, torch.tensor([[3, 4], [1, 2]]), True, True,
                  torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]), 2, 3))  # left padding within the cache: right
@example(Question(torch.ones(2, 3, dtype=torch.long), None, torch.tensor([[2, 3, 4], [7, 0, 1]]), True, True,
                  torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]), 3, 2))  # a pad among the new tokens: right
@example(Question(torch.ones(2, 3, dtype=torch.long), None, torch.tensor([[2, 3, 4], [7, 1, 2]]), True, True,
                  torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]), 3, 2))  # counting the pad: wrong
@example(Question(torch.ones(1, 2, dtype=torch.long), None, torch.tensor([[2, 3]]), True, True,
                  torch.tensor([[0, 0, 0, 0]]), 2, 2))  # a row of pads: nothing judged
@example(Question(torch.ones(2, 2, dtype=torch.long), None, torch.tensor([[3, 4]]), True, True,
                  torch.ones(2, 5, dtype=torch.long), 2, 3))  # every token real (the usual mask), positions right
@example(Question(torch.ones(2, 2, dtype=torch.long), None, torch.tensor([[2, 3]]), True, True,
                  torch.ones(2, 5, dtype=torch.long), 2, 3))  # every token real, positions one behind: wrong
@example(Question(torch.ones(2, 2, dtype=torch.long), None, torch.tensor([3, 4]), True, True,
                  torch.tensor([[1, 1, 1, 1, 1], [0, 1, 1, 1, 1]]), 2, 3))  # 1D positions, shared by the rows: wrong
@example(Question(torch.ones(1, 2, dtype=torch.long), None, torch.tensor([3, 4]), True, True,
                  torch.ones(1, 5, dtype=torch.long), 2, 3))  # 1D positions: right
@example(Question(torch.ones(1, 4, dtype=torch.long), None, torch.tensor([[0, 1, 2, 3]]), True, True,
                  torch.tensor([[0, 0, 1, 1]]), 4, 0, None, True))  # a prompt's offset, its row counting its pads
@example(Question(torch.ones(1, 3, dtype=torch.long), None, torch.tensor([[1, 5, 3]]), True, True,
                  torch.ones(1, 3, dtype=torch.long), 3, 0, None, True))  # off by 1, 4, 1: no one offset
@example(Question(torch.ones(3, 4, dtype=torch.long), None, torch.tensor([0, 1, 2, 3]), True, True,
                  torch.tensor([[1, 0, 0, 1], [0, 1, 0, 1], [1, 1, 0, 0]]), 4, 0))  # columns: a gap, a left-padded
# row with a gap (both count their pads), a right-padded row (its columns are the mask's)
@PROPERTY
@given(question=questions())
def test_the_readers_read_alike(question):
    """Every fact both readers read is the same (the host leaves ranges to the embedding lookup, which raises on the
    CPU before anything runs: those are the device reader's alone)."""
    host, device = read_on_host(question), read_on_device(question)
    assert host.binary == device.binary
    if not host.binary:
        return  # a mask of other values is refused, whatever else was read
    assert host._replace(ids=None, types=None, positions=None) == device._replace(ids=None, types=None, positions=None)
    assert host.ids is None and host.positions is None


@pytest.mark.parametrize("read", [read_on_host, read_on_device], ids=["host", "device"])
def test_positions_that_count_the_pads_of_a_gap_are_read_as_counting_them(read):
    """Without a cache, a row whose real tokens sit at their columns counts its pads wherever a pad comes before a
    real token (left padding, a gap, or both), and so does a left-padded row whose real tokens sit at the mask's
    positions plus its leading pads (with a gap, not its columns); a right-padded row, or one at the mask's positions,
    does not."""
    mask = torch.tensor([[1, 0, 0, 1], [0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 1], [1, 0, 1, 1], [0, 1, 0, 1]])
    positions = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 1, 2], [0, 1, 0, 2]])
    question = Question(torch.ones(6, 4, dtype=torch.long), None, positions, True, True, mask, 4, 0)
    assert read(question).counts_pads == (0, 1, 3, 5)


@PROPERTY
@given(question=questions(), strict=st.booleans())
def test_align_gives_the_same_step_through_either_reader(question, strict):
    """``align`` ends with the same positions, repairs and errors whichever reader read the values."""
    if question.mask is None or not question.mask.numel():
        return
    ids = question.input_ids.clamp(0, 95)
    past = question.past if question.past is not None else 0
    view = CacheView(past, ids.shape[0], (past,) * 2, None, None, None, "legacy")
    step = StepInputs(ids, None, question.mask, question.positions)
    outcomes = []
    for on_device in (False, True):
        with device_reads(on_device), warnings.catch_warnings():
            warnings.simplefilter("ignore", neofix.NeofixWarning)
            try:
                aligned = align(step, view, LIMITS, Policy(strict=strict, check_values=True))
            except neofix.NeofixError as exc:
                outcomes.append((type(exc), str(exc)))
                continue
        positions = aligned.position_ids
        outcomes.append((aligned.repair_kinds, aligned.right_padded, None if positions is None else positions.tolist()))
    assert outcomes[0] == outcomes[1]


# -- the usual decode step passes untouched ------------------------------------------------------------------------


#: What reads a tensor's metadata (no kernel runs, nothing is allocated).
METADATA = {"dim", "__get__", "size", "numel", "is_floating_point", "is_complex", "get_device"}


class _NeofixTorchCalls(TorchFunctionMode):
    """Records every torch function called from neofix's own files, other than reads of tensors' metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        where, name = asked_by(), getattr(func, "__name__", str(func))
        if where.startswith(NEOFIX_DIR) and name not in METADATA:
            self.calls.append((name, where))
        return func(*args, **(kwargs or {}))


def _decode_call(model, with_positions: bool):
    ids, mask = left_padded_batch([5, 3])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask), use_cache=True)
    call = {
        "input_ids": torch.tensor([[7], [8]]),
        "attention_mask": torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], -1),
        cache_keyword(): output_cache(out),
    }
    if with_positions:
        call["position_ids"] = reference_positions(call["attention_mask"])[:, -1:]
    return call


def test_generates_decode_step_runs_no_torch_operation_of_neofix():
    """The step generate makes (a synced mask, positions generate built from it) passes every rule of ``align`` on
    ints: neofix calls no torch function and hands transformers the very tensors it was given."""
    from neofix import _wrappers

    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    call = _decode_call(model, with_positions=True)
    _wrappers._trust(call["position_ids"])  # as prepare_inputs_for_generation marks generate's own
    handed = {}
    original = type(model.transformer).forward.__wrapped__

    def spy(self, **kwargs):
        handed.update(kwargs)
        return original(self, **kwargs)

    forward = _wrappers.make_model_forward(spy, _gpt_neo_adapter())
    with torch.no_grad(), _NeofixTorchCalls() as calls:
        forward(model.transformer, **call)
    assert calls.calls == [], calls.calls
    assert handed["attention_mask"] is call["attention_mask"] and handed["position_ids"] is call["position_ids"]
    assert handed["input_ids"] is call["input_ids"]


def _gpt_neo_adapter():
    from neofix._families.gpt_neo import ADAPTER

    return ADAPTER


def test_a_hand_loops_decode_step_reads_nothing_off_the_device():
    """A hand loop's decode step without positions gets them derived on the device: torch operations, none of which
    reads a value back (no host-device synchronisation)."""
    from ._sync import HostReads

    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    call = _decode_call(model, with_positions=False)
    with torch.no_grad(), HostReads() as reads:
        model(**call)
    assert reads.by_neofix == []


# -- refusals of a cache that does not fit, on a chunk and on a decode step -------------------------------------------


def _uneven_layers(cache):
    cache.layers[2].keys = cache.layers[2].keys[..., :-1, :]  # layer 2 a token short
    return cache


def _other_heads(cache):
    for layer in cache.layers:
        layer.keys = layer.keys.reshape(2, 8, -1, 4)  # the same numbers as 8 heads of width 4
    return cache


def _more_rows(cache):
    for layer in cache.layers:
        layer.keys = torch.cat([layer.keys, layer.keys[:1]])
    return cache


def _changed(cache, change):
    """``change`` made to any release's cache, through stand-in layer objects."""
    from types import SimpleNamespace

    if hasattr(cache, "layers"):
        return change(cache)
    stand_in = SimpleNamespace(layers=[SimpleNamespace(keys=keys) for keys, _ in legacy(cache)])
    layers = tuple((layer.keys, layer.keys) for layer in change(stand_in).layers)
    return layers if isinstance(cache, tuple) else as_cache_object(layers)


@pytest.mark.parametrize("new", [1, 3])
@pytest.mark.parametrize(
    "change, error, words",
    [
        (_uneven_layers, neofix.CacheLengthError, "cache layer 2 holds 4 tokens, but layer 0 holds 5"),
        (_other_heads, neofix.InputShapeError, "keys of 8 heads of width 4, but this model has 4 heads of width 8"),
        (_more_rows, neofix.BatchMismatchError, "the cache holds 3 rows, but this step feeds 2"),
        (None, neofix.SequenceTooLongError, "this step would reach sequence length 65"),
    ],
)
def test_a_cache_that_does_not_fit_is_refused_by_name(model, change, error, words, new):
    """A layer of another length, another model's keys, other rows, a step past the position table: named before
    the model runs, on a decode step and on a chunk alike (one reading of the cache for both)."""
    past = 5 if change is not None else 65 - new
    ids, mask = left_padded_batch([past + new, past + new - 2])
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :past], attention_mask=mask[:, :past], use_cache=True))
        if change is not None:
            cache = _changed(cache, change)
        with pytest.raises(error, match=words):
            model(input_ids=ids[:, past : past + new], attention_mask=mask[:, : past + new], **{cache_keyword(): cache})


def _each_layer(cache, change):
    for layer in cache.layers:
        layer.keys = change(layer.keys)
    return cache


USUAL_CACHE_STATES = {
    "prefilled": lambda cache: cache,
    "a chunk longer": lambda cache: _each_layer(cache, lambda keys: torch.cat([keys, keys[..., :3, :]], -2)),
    "cut short alike": lambda cache: _each_layer(cache, lambda keys: keys[..., :2, :]),
    "keys of no elements": lambda cache: _each_layer(cache, lambda keys: keys[..., :0]),
    "layer 1's keys of no elements": lambda cache: setattr(cache.layers[1], "keys", cache.layers[1].keys[..., :0])
    or cache,
    "layer 2 a token short": _uneven_layers,
    "another model's heads": _other_heads,
    "rows added": _more_rows,
    "reset": lambda cache: cache.reset() or cache,  # (4.57 - 5.10 zero the keys, 5.24 drops them)
    "layer 1 of a subclass": lambda cache: setattr(
        cache.layers[1], "__class__", type("Subclass", (type(cache.layers[1]),), {})
    ) or cache,
}


@requires("cache layer objects")
@pytest.mark.parametrize("state", USUAL_CACHE_STATES)
def test_the_usual_cache_is_read_as_each_layer_tells_its_length(model, state):
    """The usual growing cache's layers are read from their keys' shapes where every one has keys of one shape
    (``_caches._held_alike``), any other cache by asking each layer: the two readings agree with every layer's own
    ``get_seq_length()`` on the installed release, in whatever state the cache is."""
    from neofix import _caches

    ids, mask = left_padded_batch([5, 3])
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids, attention_mask=mask, use_cache=True))
    cache = USUAL_CACHE_STATES[state](cache)
    layers = len(model.transformer.h)
    asked = tuple(layer.get_seq_length() for layer in cache.layers)
    view = _caches.read(cache, layers)
    assert (view.length, view.layer_lengths) == (asked[0], asked)
    keys = cache.layers[0].keys
    if view.length:
        assert (view.batch, view.heads, view.head_dim) == (keys.shape[0], keys.shape[1], keys.shape[3])
    alike = _caches._held_alike(cache.layers, layers)
    if state in ("prefilled", "a chunk longer", "cut short alike", "another model's heads", "rows added"):
        assert alike == keys.shape and alike[-2] == asked[0]  # read from the shapes: the usual cache's reading is used
    elif not (state == "reset" and isinstance(keys, torch.Tensor)):
        assert alike is None  # (4.57 - 5.10's reset keeps zeroed keys of the old length, and their count)


@pytest.mark.parametrize("step", ["decode step", "stale mask", "checked values", "caller's positions", "chunk"])
def test_a_forward_reads_its_cache_once(monkeypatch, step):
    """Whatever the step, the cache's view (its length, rows and layers) is read exactly once per forward, and the
    outputs are those of the full recompute."""
    from neofix import _caches

    model = tiny_gpt_neo(seed=0, dtype=torch.float32)  # (vanilla 4.36 - 4.44 cannot run a float64 model: the reference)
    ids, mask = left_padded_batch([7, 5])
    past = 5
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :past], attention_mask=mask[:, :past], use_cache=True))
    width = past + (2 if step == "chunk" else 1)
    call = {"attention_mask": mask[:, :width], cache_keyword(): cache, "input_ids": ids[:, past:width]}
    if step == "stale mask":
        call["attention_mask"] = mask[:, :past]  # extended by neofix (a warned repair)
    elif step == "checked values":
        neofix.configure(check_values=True)
    elif step == "caller's positions":
        call["position_ids"] = reference_positions(mask[:, :width])[:, past:]
    reads = []
    for name in ("_read_layers", "_read_legacy", "_read_key_cache"):
        real = getattr(_caches, name)
        monkeypatch.setattr(_caches, name, lambda *args, real=real: reads.append(args) or real(*args))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = model(**call).logits
    assert len(reads) == 1
    full = mask[:, :width]
    with neofix.unpatched(), torch.no_grad():
        expected = model(input_ids=ids[:, :width], attention_mask=full, position_ids=reference_positions(full)).logits
    torch.testing.assert_close(logits, expected[:, -logits.shape[1] :], rtol=1e-4, atol=1e-4)


def test_of_call_names_the_cache_keyword():
    assert of_call({"cache": 1}) == ("cache", 1)
    assert of_call({"past_key_values": 2}) == ("past_key_values", 2)


# -- the cheap pass decides as align does ----------------------------------------------------------------------------


def _outcome(run):
    """What ``run`` ends with: ``("error", type, message)`` or its result."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        try:
            return run()
        except neofix.NeofixError as exc:
            return ("error", type(exc), str(exc))


def _aligned_as(aligned):
    positions = aligned.position_ids
    return (
        aligned.attention_mask, None if positions is None else positions.tolist(), aligned.repair_kinds,
        aligned.report is not None, aligned.right_padded,
    )


@PROPERTY
@given(question=questions(), strict=st.booleans(), check=st.booleans(), trusted=st.booleans(),
       kind=st.sampled_from(list(Positions)), on_device=st.booleans())
def test_the_cheap_pass_decides_as_align_does(question, strict, check, trusted, kind, on_device):
    """``keeps_every_rule`` (the usual step's pass, from the same rule functions) never decides otherwise than
    ``align``: where it keeps a step, align returns that very step with nothing repaired, reported or marked; where it
    raises, align raises the same error; and the values it read, handed to align, give align's own outcome."""
    from neofix._core import keeps_every_rule

    ids = question.input_ids.clamp(0, 95) if draw_valid_ids(question) else question.input_ids
    past = question.past
    view = CacheView(past, ids.shape[0], None if past is None else (past,) * 2, None, None, None, "legacy")
    step = StepInputs(ids, None, question.mask, question.positions)
    policy = Policy(strict=strict, check_values=check, trusted_positions=trusted, positions=kind)
    with device_reads(on_device):
        kept = _outcome(lambda: keeps_every_rule(step, view, LIMITS, kind, trusted, check, strict))
        alone = _outcome(lambda: align(step, view, LIMITS, policy))
        if kept[0] == "error":
            assert alone == kept
            return
        kept, facts = kept
        if kept:
            mask, positions, repairs, reported, marked = _aligned_as(alone)
            assert mask is step.attention_mask and repairs == () and not reported and marked == ()
            assert positions == (None if step.position_ids is None else step.position_ids.tolist())
        with_facts = _outcome(lambda: align(step, view, LIMITS, policy, facts))
    if alone[0] == "error":
        assert with_facts == alone
    else:
        assert _aligned_as(with_facts)[1:] == _aligned_as(alone)[1:]


def draw_valid_ids(question):
    """Mostly ids inside the vocabulary; sometimes the drawn ones (-1 or 96: refused on the device, left to the
    embedding on the host)."""
    return int(question.input_ids.sum()) % 4 != 0


def test_a_left_padded_prompt_reads_its_values_once(monkeypatch):
    """A forward that the cheap pass reads and finds to change (left padding: positions derived) hands the facts on:
    the values are read once, and the positions are the reference's."""
    from neofix._core import _reads

    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    ids, mask = left_padded_batch([6, 4])
    reads = []
    real = _reads.read_on_host
    monkeypatch.setattr(_reads, "read_on_host", lambda question: reads.append(question) or real(question))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        logits = model(input_ids=ids, attention_mask=mask).logits
    assert len(reads) == 1
    with neofix.unpatched(), torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask)).logits
    real_tokens = mask.bool()
    torch.testing.assert_close(logits[real_tokens], expected[real_tokens], rtol=1e-4, atol=1e-4)


# -- the model's limits: remembered per config, read afresh before a refusal ---------------------------------------


def test_limits_are_read_afresh_after_the_vocabulary_is_resized():
    """``resize_token_embeddings`` between two forwards (it assigns ``config.vocab_size``): a token id of the grown
    vocabulary runs, and after shrinking, an id past the new end is refused naming the new size (not the size the
    model had when it first ran)."""
    model = tiny_gpt_neo(seed=0, dtype=torch.float32)
    size = model.config.vocab_size
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        model(input_ids=ids)
        model.resize_token_embeddings(size + 8)
        assert model(input_ids=torch.tensor([[1, size + 7]])).logits.shape[-1] == size + 8
        model.resize_token_embeddings(size - 8)
        with pytest.raises(neofix.TokenIdError, match=f"config.vocab_size is {size - 8},"):
            model(input_ids=torch.tensor([[1, size - 3]]))
