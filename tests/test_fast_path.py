"""The decode-step fast path: ``aligned_decode_step`` lets a forward through untouched only where ``align`` would
change nothing.

``GPTNeoModel.forward``'s wrapper skips the general alignment for the hottest call there is, a single-token decode
step that already keeps the contract.  These tests pin both directions: every step the fast path accepts is one
``align`` returns unchanged (same tensors, no repair, no error), and the steps ``generate`` makes on the installed
release do take it (otherwise the overhead budget of benchmarks/bench_decode.py is lost).
"""

from __future__ import annotations

import copy
import gc
import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers

import neofix
from neofix import _errors, _wrappers
from neofix._caches import of_call
from neofix._core import Policy, StepInputs, align
from neofix._families import gpt_neo
from neofix.testing import reference_positions, tiny_gpt_neo

from ._versions import as_cache_object, cache_keyword, legacy, output_cache
from .loops import left_padded_batch


def _plain_forward(ids, kwargs, *rest):
    """``plain_forward`` as the model forward calls it, given ``input_ids`` and the call's other keyword arguments."""
    return _wrappers.plain_forward(ids, ids.shape, kwargs, of_call(kwargs)[1], *rest)


def prefill(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask), use_cache=True)
    return output_cache(out)


def uneven(cache):
    """The cache with layer 1 one token short."""
    layers = tuple((k[..., :-1, :], v[..., :-1, :]) if i == 1 else (k, v) for i, (k, v) in enumerate(legacy(cache)))
    return layers if isinstance(cache, tuple) else as_cache_object(layers)


def as_generate_passes(positions):
    """Positions as transformers' generate passes them: built from the mask by prepare_inputs_for_generation, which
    neofix's wrapper marks as such (decode steps then compare them with nothing)."""
    _wrappers._trust(positions)
    return positions


def step_kwargs(model, variant):
    """A decode step after a left-padded 5-token prompt (2 rows), changed as ``variant`` says; by default the step
    generate makes (positions generate built from the mask)."""
    ids, mask = left_padded_batch([5, 3])
    cache = prefill(model, ids, mask)
    full = torch.cat([mask, mask.new_ones(2, 1)], -1)
    kwargs = {
        "input_ids": torch.tensor([[7], [8]]),
        "attention_mask": full,
        "position_ids": as_generate_passes(reference_positions(full)[:, -1:]),
        cache_keyword(): cache,
        "use_cache": True,
    }
    if variant == "positions of the caller":  # a hand-written loop's: compared with the mask's on the device
        kwargs["position_ids"] = kwargs["position_ids"].clone()
    elif variant == "no mask":
        kwargs["attention_mask"] = None
    elif variant == "no mask, no positions":
        kwargs["attention_mask"] = kwargs["position_ids"] = None
    elif variant == "no positions":
        kwargs["position_ids"] = None
    elif variant == "stale mask":
        kwargs["attention_mask"] = mask
    elif variant == "long mask":
        kwargs["attention_mask"] = torch.cat([full, full[:, :1]], -1)
    elif variant == "full-length positions":
        kwargs["position_ids"] = reference_positions(full)
    elif variant == "one position row for all":
        kwargs["position_ids"] = kwargs["position_ids"][:1]
    elif variant == "two new tokens":
        kwargs["input_ids"] = torch.tensor([[7, 9], [8, 9]])
        kwargs["attention_mask"] = torch.cat([full, full[:, :1]], -1)
        kwargs["position_ids"] = reference_positions(kwargs["attention_mask"])[:, -2:]
    elif variant == "token types":
        kwargs["token_type_ids"] = torch.zeros(2, 1, dtype=torch.long)
    elif variant == "cache_position":
        kwargs["cache_position"] = torch.tensor([5])
    elif variant == "cache_position of 2":
        kwargs["cache_position"] = torch.tensor([4, 5])
    elif variant == "inputs_embeds too":
        kwargs["inputs_embeds"] = torch.zeros(2, 1, model.config.hidden_size, dtype=model.dtype)
    elif variant == "cache of other rows":
        kwargs[cache_keyword()] = prefill(model, ids[:1], mask[:1])
    elif variant == "uneven cache":
        kwargs[cache_keyword()] = uneven(cache)
    elif variant == "no cache":
        kwargs[cache_keyword()] = None
    elif variant == "legacy tuple cache":
        kwargs[cache_keyword()] = legacy(cache)
    elif variant == "1D input_ids":
        kwargs["input_ids"] = torch.tensor([7])
    else:
        assert variant == "well-formed", variant
    return kwargs


FAST = {"well-formed", "no mask", "no mask, no positions", "cache_position"}
SLOW = {
    "positions of the caller",
    "no positions",
    "stale mask",
    "long mask",
    "full-length positions",
    "one position row for all",
    "two new tokens",
    "token types",
    "cache_position of 2",
    "inputs_embeds too",
    "cache of other rows",
    "uneven cache",
    "no cache",
    "1D input_ids",
}


def in_step(model, kwargs):
    """Whether the model forward's fast path takes this call."""
    _, layers, limits = _wrappers._read_model_facts(model.transformer, gpt_neo)
    shape = kwargs["input_ids"].shape
    if len(shape) != 2 or shape[1] != 1:  # the model forward asks only for one new token per row
        return False
    view, unchanged = _wrappers.aligned_decode_step(shape, kwargs, of_call(kwargs)[1], layers, limits, gpt_neo)
    assert view is not None or not unchanged
    return unchanged


def aligned_unchanged(model, kwargs):
    """Whether align() returns every input as given, repairs nothing and raises nothing."""
    view = gpt_neo.read_cache(kwargs.get(cache_keyword()), model.config.num_layers)
    step = StepInputs(
        kwargs["input_ids"],
        kwargs.get("inputs_embeds"),
        kwargs["attention_mask"],
        kwargs["position_ids"],
        kwargs.get("token_type_ids"),
        kwargs.get("cache_position"),
    )
    try:
        aligned = align(step, view, gpt_neo.limits(model.config), Policy(trusted_positions=True))
    except neofix.NeofixError:
        return False
    return (
        aligned is not None
        and not aligned.repairs
        and not aligned.values_checked
        and aligned.attention_mask is kwargs["attention_mask"]
        and aligned.position_ids is kwargs["position_ids"]
        and aligned.cache_position is kwargs.get("cache_position")
    )


@pytest.mark.parametrize("variant", sorted(FAST | SLOW | {"legacy tuple cache"}))
def test_fast_path_only_where_align_changes_nothing(model, variant):
    kwargs = step_kwargs(model, variant)
    fast = in_step(model, kwargs)
    if variant == "legacy tuple cache":  # transformers >= 4.54 rejects tuples: neofix must wrap them first
        assert fast == (not gpt_neo.LEGACY_CACHE_REJECTED)
    else:
        assert fast == (variant in FAST)
    if fast:
        assert aligned_unchanged(model, kwargs)


@pytest.fixture(scope="module")
def model32():
    """float32: on transformers 4.36 - 4.44 neofix builds a float64 model's mask in float32 (the overflow fix), which
    moves logits by rounding; this test compares the fast path alone."""
    return tiny_gpt_neo(seed=0, dtype=torch.float32)


def copied(kwargs):
    """A deep copy of a step's arguments, positions still generate's."""
    kwargs = copy.deepcopy(kwargs)
    if kwargs.get("position_ids") is not None:
        as_generate_passes(kwargs["position_ids"])
    return kwargs


@pytest.mark.parametrize("variant", sorted(FAST))
def test_fast_path_output_is_vanilla_output(model32, variant):
    """Through the fast path, the patched forward computes exactly what vanilla does with the same arguments."""
    model = model32
    parameters = inspect.signature(type(model).forward).parameters.values()
    takes = any(p.name == "cache_position" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    if variant == "cache_position" and not takes:
        pytest.skip(f"GPT-Neo takes no cache_position argument on transformers {transformers.__version__}")
    kwargs = step_kwargs(model, variant)
    with torch.no_grad():
        patched = model(**copied(kwargs)).logits
        with neofix.unpatched():
            plain = model(**copied(kwargs)).logits
    assert torch.equal(patched, plain)


@pytest.mark.parametrize("past", [62, 63, 64])
def test_fast_path_stops_at_the_position_table(past):
    """A step whose position would be ``max_position_embeddings`` leaves the fast path (and raises)."""
    model = tiny_gpt_neo(dtype=torch.float64, max_position_embeddings=64)
    ids = torch.randint(1, 96, (1, past))
    cache = prefill(model, ids, torch.ones_like(ids))
    positions = as_generate_passes(torch.tensor([[past]]))
    kwargs = {"input_ids": torch.tensor([[5]]), "position_ids": positions, cache_keyword(): cache}
    assert in_step(model, kwargs) == (past < 64)
    if past == 64:
        with pytest.raises(neofix.SequenceTooLongError, match="sequence length 65"):
            model(**kwargs)


def test_generate_takes_the_fast_path(model, monkeypatch):
    """Every decode step of greedy generate on a left-padded batch is already aligned on this release."""
    taken = []
    real = _wrappers.aligned_decode_step

    def spy(shape, *args):
        result = real(shape, *args)
        taken.append((shape[1], result[1]))
        return result

    monkeypatch.setattr(_wrappers, "aligned_decode_step", spy)
    ids, mask = left_padded_batch([6, 4])
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0)
    decode_steps = [fast for new, fast in taken if new == 1]
    assert len(decode_steps) == 4 and all(decode_steps), taken


MODEL_POSITIONED = ["bloom", "codegen", "gpt_neox", "gptj", "opt"]  # families that build missing positions themselves


@pytest.mark.parametrize("family", MODEL_POSITIONED)
def test_decode_steps_without_positions_take_the_fast_path_where_the_model_builds_them(family, monkeypatch):
    """A loop's decode steps given a mask over the cached and new tokens and no positions, in a family whose model
    builds missing positions itself (rotary, from the mask, or none at all): already aligned, so they take the fast
    path, and compute vanilla's logits."""
    from neofix._families import FAMILIES
    from neofix.testing import tiny_model

    model = _chunk_model(family) if family in CHUNK_FAMILIES else tiny_model(family)
    assert FAMILIES[family].load_adapter().POSITIONS != "absolute"
    taken = []
    real = _wrappers.aligned_decode_step

    def spy(shape, *args):
        result = real(shape, *args)
        taken.append(result[1])
        return result

    def loop():
        ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=torch.ones(2, 3, dtype=torch.long), use_cache=True)
            logits = [out.logits]
            for step in range(3):
                out = model(
                    input_ids=torch.full((2, 1), 11 + step), attention_mask=torch.ones(2, 4 + step, dtype=torch.long),
                    use_cache=True, **{cache_keyword(model): output_cache(out)},
                )
                logits.append(out.logits)
        return torch.cat(logits, dim=1)

    with monkeypatch.context() as patch:
        patch.setattr(_wrappers, "aligned_decode_step", spy)
        patched = loop()
    assert taken == [True] * 3
    with neofix.unpatched():
        assert torch.equal(patched, loop())


def test_per_model_facts_do_not_keep_models_alive():
    model = tiny_gpt_neo(num_layers=2)
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False, pad_token_id=0)
    key = id(model.transformer)
    assert key in _wrappers._FACTS
    del model
    gc.collect()
    assert key not in _wrappers._FACTS


# -- the prefill path: forwards without a cache read their values in a few operations ---------------------------------

from neofix._core import _values  # noqa: E402
from neofix._errors import MaskValueError, TokenIdError  # noqa: E402

PREFILL_MASKS = {
    "none": None,
    "unpadded": [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]],
    "left-padded": [[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]],
    "right-padded": [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]],
    "both": [[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]],
    "a gap": [[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]],
    "all padding in a row": [[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]],
    "a 2": [[1, 1, 1, 1, 1], [0, 0, 2, 1, 1]],
    "a -1": [[1, 1, 1, 1, 1], [-1, 1, 1, 1, 1]],
}


def read_both_ways(ids, mask, limits, past=0):
    """``read_prefill`` through scalar reads (the CPU path) and through one read (the path accelerators take)."""
    outcomes = []
    for scalars in (True, False):
        _values.READ_SCALARS_ON_CPU = scalars
        try:
            settled = _values.read_prefill(ids, mask, limits, past=past)
            outcomes.append((settled.positions, settled.right_padded, [r.kind for r in settled.repairs]))
        except neofix.NeofixError as exc:
            outcomes.append((type(exc), str(exc)))
        finally:
            _values.READ_SCALARS_ON_CPU = True
    return outcomes


@pytest.mark.parametrize("name", list(PREFILL_MASKS))
@pytest.mark.parametrize("bad_id", [None, 96, -3])
def test_prefill_reads_agree_on_the_cpu_and_accelerator_paths(model, name, bad_id):
    ids = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 5]])
    good = ids.clone()
    if bad_id is not None:
        ids[1, 3] = bad_id
    mask = None if PREFILL_MASKS[name] is None else torch.tensor(PREFILL_MASKS[name])
    limits = gpt_neo.limits(model.config)
    cpu_way, torch_way = read_both_ways(ids, mask, limits)
    if bad_id is not None:
        # the accelerator path reads the ids first; the CPU path leaves them to the embedding, whose IndexError the
        # model forward names (test_token_ids_are_checked_at_both_ends_of_the_vocabulary), and reads the mask alone
        assert torch_way[0] is TokenIdError and f"input_ids[1, 3] is {bad_id}, outside" in torch_way[1]
        torch_way = read_both_ways(good, mask, limits)[1]
    if isinstance(cpu_way[0], type):  # an error: the same class and message either way
        assert cpu_way == torch_way
        assert cpu_way[0] is MaskValueError
        return
    assert name not in ("a 2", "a -1")
    (positions, right, kinds), (other_positions, other_right, other_kinds) = cpu_way, torch_way
    assert right == other_right and kinds == other_kinds
    assert (positions is None) == (other_positions is None)
    if positions is None:  # left to transformers: only where its arange is the mask's for every real token
        assert name in ("none", "unpadded", "right-padded", "all padding in a row")
    else:
        assert torch.equal(positions, other_positions)
        real = mask != 0
        assert torch.equal(positions[real], reference_positions(mask)[real])  # real tokens: the mask's positions
    assert right == ((1,) if name == "right-padded" else (0,) if name == "both" else ())


try:
    from hypothesis import example, given
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover
    given = None


if given is not None:

    @given(
        st.integers(1, 4).flatmap(
            lambda width: st.lists(st.lists(st.integers(0, 1), min_size=width, max_size=width), min_size=1, max_size=4)
        ),
        st.integers(0, 3),
    )
    def test_padded_mask_reads_agree_on_the_cpu_and_accelerator_paths(model, rows, past):
        """Any 0/1 mask, as a prefill or as a chunk after cached tokens: the CPU path's list reads
        (``_row_padding``) settle it as the torch operations accelerators run do."""
        mask = torch.tensor(rows)
        new = mask.shape[1] - past
        if new < 1 or (past and new < 2):
            return
        ids = torch.arange(mask.shape[0] * new).view(mask.shape[0], new) % 90 + 1
        cpu_way, torch_way = read_both_ways(ids, mask, gpt_neo.limits(model.config), past=past)
        assert cpu_way[1:] == torch_way[1:]
        assert (cpu_way[0] is None) == (torch_way[0] is None)
        if cpu_way[0] is not None:
            assert torch.equal(cpu_way[0], torch_way[0])


@pytest.mark.parametrize("past", [0, 3])
@pytest.mark.parametrize("low, high, bad", [(0, 95, None), (-1, 5, -1), (0, 96, 96)])
def test_token_ids_are_checked_at_both_ends_of_the_vocabulary(model, past, low, high, bad):
    """0 and vocab_size - 1 are token ids; -1 and vocab_size are not (a prefill, and a chunk after 3 cached
    tokens): read by the accelerator path, and on the CPU named from the embedding's ``IndexError`` with the same
    message."""
    assert model.config.vocab_size == 96
    ids = torch.tensor([[low, 7], [8, high]])
    mask = torch.ones(2, past + 2, dtype=torch.long)
    cpu_way, accelerator_way = read_both_ways(ids, mask, gpt_neo.limits(model.config), past=past)
    assert cpu_way == (None, (), [])  # the CPU read leaves token ids to the embedding
    cached = {}
    if past:
        cached = {cache_keyword(): prefill(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.ones(2, 3).long())}
    call = lambda: model(input_ids=ids, attention_mask=mask, use_cache=True, **cached)  # noqa: E731
    if bad is None:
        assert accelerator_way == (None, (), [])
        with torch.no_grad():
            assert call().logits.shape == (2, 2, 96)
        return
    assert accelerator_way[0] is TokenIdError and f" is {bad}, outside the vocabulary" in accelerator_way[1]
    with torch.no_grad(), pytest.raises(TokenIdError) as caught:
        call()
    assert str(caught.value) == accelerator_way[1]
    assert isinstance(caught.value.__cause__, IndexError)


@pytest.mark.parametrize("name", ["unpadded", "left-padded", "both", "a gap", "a 2"])
def test_chunk_reads_agree_on_the_cpu_and_accelerator_paths(model, name):
    """A chunk after 3 cached tokens: the mask covers them too; right padding is only said at a prefill."""
    ids = torch.tensor([[7, 8], [9, 10]])
    mask = torch.tensor(PREFILL_MASKS[name])
    cpu_way, torch_way = read_both_ways(ids, mask, gpt_neo.limits(model.config), past=3)
    if isinstance(cpu_way[0], type):
        assert cpu_way == torch_way and cpu_way[0] is MaskValueError
        return
    assert cpu_way[1] == torch_way[1] == ()
    if cpu_way[0] is None:
        assert torch_way[0] is None and name == "unpadded"
    else:
        assert torch.equal(cpu_way[0], torch_way[0])
        real = mask[:, -2:] != 0
        assert torch.equal(cpu_way[0][real], reference_positions(mask)[:, -2:][real])


def test_plain_forwards_take_the_prefill_path(model, monkeypatch):
    """Training, scoring and classification calls are read by read_prefill, and changed only where left-padded; so
    is a chunk after a cache with a mask over both.  Given the mask's positions, read_given reads them."""
    taken = []
    real = _wrappers.plain_forward

    def spy(*args):
        result = real(*args)
        taken.append((result[0] is not None, result[1]))  # (read, tokens the cache held)
        return result

    monkeypatch.setattr(_wrappers, "plain_forward", spy)
    ids, mask = left_padded_batch([5, 5])
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # causal LM
        model(input_ids=ids, attention_mask=mask, labels=ids)  # with a loss
        model(input_ids=ids)  # no mask
        model(input_ids=ids, attention_mask=mask, position_ids=reference_positions(mask))  # the mask's positions
        model(input_ids=ids, attention_mask=mask, token_type_ids=ids)  # token types: the general path
        cache = output_cache(model(input_ids=ids[:, :3], attention_mask=mask[:, :3], use_cache=True))
        model(input_ids=ids[:, 3:], attention_mask=mask, **{cache_keyword(): cache})  # a chunk: mask over both
    assert taken == [(True, 0)] * 4 + [(False, 0), (True, 0), (True, 3)]


@pytest.mark.parametrize(
    "mask, error",
    [
        (torch.ones(3, 5, dtype=torch.long), neofix.BatchMismatchError),  # a row too many
        (torch.ones(2, 1, 5, dtype=torch.long), neofix.MaskLengthError),  # not 2D
    ],
)
def test_chunks_with_a_wrong_mask_are_refused_as_align_refuses_them(model, mask, error):
    """The chunk fast path takes only a 2D mask with one row per input row; anything else is aligned (and refused)
    by the general path, which says what is wrong."""
    ids = torch.arange(1, 11).view(2, 5)
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :3], use_cache=True))
        with pytest.raises(error):
            model(input_ids=ids[:, 3:], attention_mask=mask, **{cache_keyword(): cache})


@pytest.mark.parametrize(
    "row, error",
    [
        ([0, 0, 0, 0, 0], None),  # a row of pads only
        ([0, 0, 2, 1, 1], neofix.MaskValueError),  # a 2 where the real tokens start: not a pad, not a token
        ([0, 0, 2, 0, 1], neofix.MaskValueError),  # a 2 among the pads (of the chunk: the prefill refuses its own)
    ],
    ids=["pads only", "2 then tokens", "2 among pads"],
)
def test_a_chunk_with_a_row_of_pads_or_another_value_gives_the_general_paths_outcome(row, error):
    """A chunk's mask row that is neither real tokens nor pads then real tokens goes to the general reads: a row of
    pads only runs as they run it, and a value neither 0 nor 1 (wherever it sits) is refused in their words."""
    ids, mask = left_padded_batch([5, 3])
    mask = mask.clone()
    mask[1] = torch.tensor(row)
    prefill = {"input_ids": ids[:, :2], "attention_mask": mask[:, :2], "use_cache": True}
    general = assert_same_outcome(_chunk_model("gpt_neo"), prefill, {"input_ids": ids[:, 2:], "attention_mask": mask})
    if error is None:
        assert not any(isinstance(result, tuple) for result in general)  # the chunk and the step ran
    else:
        assert isinstance(general[0], tuple) and issubclass(general[0][0], error)


@pytest.mark.parametrize("scalars", [True, False], ids=["cpu", "accelerator"])
@pytest.mark.parametrize(
    "change, error",
    [
        ("float ids", neofix.TokenIdError),
        ("int32 ids", None),
        ("bool mask", None),
        ("float mask", None),
        ("3D mask", neofix.MaskLengthError),  # as wide as the cached and new tokens in its second dimension
    ],
)
def test_chunks_of_other_dtypes_give_the_general_paths_outcome(monkeypatch, change, error, scalars):
    """A chunk whose ids are not long, or whose mask is not a long 2D one, is left to the general path (whose reads
    take them), on the CPU and on the path accelerators take: the model gives the general path's outcome."""
    monkeypatch.setattr(_values, "READ_SCALARS_ON_CPU", scalars)
    ids, mask = left_padded_batch([5, 3])
    chunk = {
        "float ids": {"input_ids": ids[:, 2:].float(), "attention_mask": mask},
        "int32 ids": {"input_ids": ids[:, 2:].int(), "attention_mask": mask},
        "bool mask": {"input_ids": ids[:, 2:], "attention_mask": mask.bool()},
        "float mask": {"input_ids": ids[:, 2:], "attention_mask": mask.float()},
        "3D mask": {"input_ids": ids[:, 2:], "attention_mask": mask[:, :, None]},
    }[change]
    prefill = {"input_ids": ids[:, :2], "attention_mask": mask[:, :2], "use_cache": True}
    general = assert_same_outcome(_chunk_model("gpt_neo"), prefill, chunk)
    if error is None:
        assert not any(isinstance(result, tuple) for result in general)  # the chunk and the step ran
    else:
        assert isinstance(general[0], tuple) and issubclass(general[0][0], error)


def test_positions_of_masks_wider_than_any_before_are_the_masks(monkeypatch):
    """The counts left-padded positions are cut from grow with the widest mask read (from none, here, to a mask of
    300 columns, then 700): each prefill's and chunk's positions are the mask's, and a chunk's a tensor of its own."""
    import types

    monkeypatch.setattr(_values, "_COUNTING", ([], *_values._COUNTING[1:]))  # as at import: nothing read yet
    limits = Limits(max_positions=2048, vocab_size=96, hidden_size=32, heads=4, head_dim=8)
    family = types.SimpleNamespace(POSITIONS="absolute", LEGACY_CACHE_REJECTED=False, read_cache=_caches.read)
    for width in (5, 300, 700):
        mask = torch.ones(3, width, dtype=torch.long)
        mask[1, : width // 3] = 0
        mask[2, : width - 1] = 0
        ids = torch.ones_like(mask)
        want = reference_positions(mask)
        assert torch.equal(_values.read_prefill(ids, mask, limits).positions, want)
        for past in (1, width // 2, width - 2):
            keys = torch.zeros(3, 4, past, 8)
            cache = tuple((keys, keys) for _ in range(4))  # read whole
            kwargs = {"attention_mask": mask, "past_key_values": cache}
            settled, read, view = _plain_forward(ids[:, past:], kwargs, 4, limits, family)
            assert read == past and settled.positions.is_contiguous() and view.length == past  # the tuple, read whole
            assert torch.equal(settled.positions, want[:, past:]), (width, past)


CHUNK_FAMILIES = ["gpt_neo", "gptj", "opt", "bloom"]  # absolute, rotary, positions from the mask, no positions
_CHUNK_MODELS: dict = {}


def _chunk_model(family):
    from neofix.testing import tiny_model

    if family not in _CHUNK_MODELS:
        _CHUNK_MODELS[family] = tiny_model(family)
    return _CHUNK_MODELS[family]


if given is not None:

    @pytest.mark.parametrize("family", CHUNK_FAMILIES)
    @given(
        st.lists(st.lists(st.integers(0, 1), min_size=7, max_size=7), min_size=1, max_size=3),
        st.integers(1, 5),
        st.sampled_from(["none", "transformers", "mask"]),
    )
    @example([[1] * 7, [1] * 7], 3, "mask")  # an unpadded chunk: transformers' own positions, nothing said
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 3, "mask")  # left padding within the cached columns
    @example([[1] * 7, [0, 0, 0, 0, 0, 1, 1]], 3, "mask")  # left padding into the chunk
    def test_fast_forwards_compute_what_the_general_path_computes(family, rows, past, uncached):
        """Whatever mask a prefill or a chunk after ``past`` cached tokens comes with, the fast path
        (:func:`plain_forward`) gives the logits, warnings and trace record the general path (``align``) gives."""
        model = _chunk_model(family)
        mask = torch.tensor(rows)
        ids = (torch.arange(mask.numel()).view(mask.shape) * 7) % 90 + 1
        prefill = {"input_ids": ids[:, :past], "attention_mask": mask[:, :past], "use_cache": True}
        if uncached == "none":
            chunk = {"input_ids": ids, "attention_mask": mask}  # no cache: the whole row at once
        else:
            chunk = {"input_ids": ids[:, past:], "attention_mask": mask}
        outcomes = []
        for fast in (True, False):
            neofix.configure(uncached_positions="transformers" if uncached == "transformers" else "mask")
            _errors.reset_warnings()
            with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if not fast:
                    patch.setattr(_wrappers, "plain_forward", lambda *args: (None, 0, None))
                with torch.no_grad(), neofix.trace(model) as steps:
                    if uncached != "none":
                        cache = output_cache(model(**prefill))
                        chunk[cache_keyword()] = cache
                    logits = model(**chunk).logits
            outcomes.append((logits, [str(w.message) for w in caught], list(steps)))
        neofix.configure(uncached_positions="mask")
        (fast_logits, fast_warnings, fast_steps), (logits, warned, steps) = outcomes
        torch.testing.assert_close(fast_logits, logits, rtol=0, atol=0, equal_nan=True)  # all-pad rows: NaN
        assert fast_warnings == warned and fast_steps == steps


GIVEN_FAMILIES = ["gpt_neo", "gpt2", "opt"]  # positions looked up in a table (2), derived from the mask (OPT)
GIVEN_KINDS = ["mask", "arange", "any", "one off", "outside", "negative"]


def given_positions(mask, past, kind, shared, values, cell, limit):
    """Positions of the new columns of ``mask`` after ``past`` cached tokens, as a caller might pass them: the
    mask's, ``arange`` (counting the padding), any values in the table, the mask's with one ``cell`` off by one,
    outside the table (``limit``) or negative; one row for every row (``shared``) or one per row."""
    rows, width = mask.shape
    new = width - past
    if kind == "mask":
        positions = reference_positions(mask)[:, past:]
    elif kind == "arange":
        positions = torch.arange(past, width).expand(rows, new)
    elif kind == "any":
        positions = torch.tensor(values[: rows * new]).view(rows, new) % limit
    else:
        positions = reference_positions(mask)[:, past:].clone()
        row, column = cell[0] % rows, cell[1] % new
        positions[row, column] = {"one off": positions[row, column] + 1, "outside": limit, "negative": -1}[kind]
    return positions[:1] if shared else positions


def run_outcome(model, prefill, chunk, fast):
    """Logits (or the error), warnings and trace records of ``chunk`` (after ``prefill``, where it is given) and of
    one decode step after it, by the fast path or by the general path (``align``)."""
    _errors.reset_warnings()
    results = []
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if not fast:
            patch.setattr(_wrappers, "plain_forward", lambda *args: (None, 0, None))
        with torch.no_grad(), neofix.trace(model) as steps:
            if prefill is not None:
                chunk[cache_keyword()] = output_cache(model(**prefill))
            mask = chunk["attention_mask"]
            step = {"input_ids": torch.full((mask.shape[0], 1), 3), "attention_mask": F.pad(mask, (0, 1), value=1)}
            for call in (chunk, step):  # the step: does it say what the chunk's mask says (right padding)?
                try:
                    out = model(**call, use_cache=True)
                except Exception as exc:  # noqa: BLE001 - the outcome compared: which error, in which words
                    results.append((type(exc), str(exc)))
                    break
                results.append(out.logits)
                step[cache_keyword()] = output_cache(out)
    return results, [str(w.message) for w in caught], list(steps)


def assert_same_outcome(model, prefill, chunk):
    """``chunk`` (after ``prefill``) and a decode step after it give, by the fast path and by the general path, the
    same logits or the same error in the same words, the same warnings, and (where every call ran) the same trace
    records.  Returns the general path's results (logits, or ``(error class, words)`` last)."""
    (fast, fast_warned, fast_steps), (general, warned, steps) = (
        run_outcome(model, prefill, dict(chunk), on) for on in (True, False)
    )
    assert fast_warned == warned and len(fast) == len(general)
    for one, other in zip(fast, general):
        if isinstance(other, tuple):  # refused: the same error, in the same words
            assert isinstance(one, tuple) and one == other
            return general
        torch.testing.assert_close(one, other, rtol=0, atol=0, equal_nan=True)  # all-pad rows: NaN
    assert fast_steps == steps
    return general


if given is not None:

    @pytest.mark.parametrize("family", GIVEN_FAMILIES)
    @given(
        st.lists(st.lists(st.integers(0, 1), min_size=7, max_size=7), min_size=1, max_size=3),
        st.integers(0, 5),
        st.sampled_from(GIVEN_KINDS),
        st.booleans(),
        st.lists(st.integers(0, 200), min_size=21, max_size=21),
        st.tuples(st.integers(0, 2), st.integers(0, 6)),
        st.booleans(),
        st.sampled_from([None] * 6 + [2]),
    )
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 0, "mask", False, [0] * 21, (0, 0), False, None)  # generate's prefill
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 0, "arange", True, [0] * 21, (0, 0), False, None)  # counts the padding
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 3, "mask", False, [0] * 21, (0, 0), False, None)  # a chunk
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 3, "one off", False, [0] * 21, (1, 2), False, None)  # a chunk, one wrong
    @example([[1] * 7, [1] * 7], 0, "outside", True, [0] * 21, (0, 4), False, None)  # unpadded, outside the table
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 0, "negative", False, [0] * 21, (1, 0), True, None)  # at a pad, strict
    @example([[1] * 7, [1, 1, 1, 1, 1, 0, 0]], 0, "mask", False, [0] * 21, (0, 0), False, None)  # right-padded
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 0, "mask", False, [0] * 21, (1, 4), False, 2)  # a mask value of 2
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 0, "any", False, [0] * 21, (1, 0), False, 2)  # a 2 among pads
    @example([[1] * 7, [1] * 7], 3, "one off", False, [0] * 21, (1, 2), False, None)  # unpadded chunk, one wrong
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 3, "mask", True, [0] * 21, (0, 0), False, None)  # one row for two
    @example([[1] * 7, [1] * 7], 3, "mask", True, [0] * 21, (0, 0), False, None)  # one row for two, unpadded
    @example([[1] * 7, [0, 0, 0, 0, 1, 1, 1]], 2, "one off", False, [0] * 21, (1, 2), False, None)  # a chunk whose
    # row 1 begins inside it, off at that row's first real token
    @example([[1] * 7, [1, 1, 1, 1, 1, 0, 0]], 3, "any", False, [3, 4, 5, 6, 1, 2, 3, 4] + [0] * 13, (0, 0), False,
             None)  # a right-padded chunk, given the positions a row with 2 pads then 5 real tokens would take
    @example([[1] * 7, [0, 0, 1, 1, 1, 1, 1]], 3, "any", False, [3, 4, 5, 6, 1, 2, 3, 4] + [0] * 13, (1, 0), False, 2)
    # a chunk with a 2 among a row's pads, given the positions 2 pads would give
    def test_given_positions_compute_on_the_fast_path_what_the_general_path_computes(
        family, rows, past, kind, shared, values, cell, strict, odd
    ):
        """Whatever mask, and whatever positions a caller passes with a prefill or a chunk after ``past`` cached
        tokens, the fast path (:func:`plain_forward`, :func:`read_given`) gives the logits, or the error, the
        warnings and the trace records the general path (``align``) gives, and so does a decode step after it: it
        passes on only positions ``align`` passes on unchanged.  ``odd``: a mask value neither 0 nor 1 at ``cell``."""
        model = _chunk_model(family)
        mask = torch.tensor(rows)
        if odd is not None:
            mask[cell[0] % mask.shape[0], cell[1]] = odd
        if past and mask.shape[1] - past < 2:
            return
        ids = (torch.arange(mask.numel()).view(mask.shape) * 7) % 90 + 1
        limit = model.config.max_position_embeddings
        positions = given_positions(mask, past, kind, shared, values, cell, limit)
        prefill = None
        chunk = {"input_ids": ids[:, past:], "attention_mask": mask, "position_ids": positions}
        if past:
            prefill = {"input_ids": ids[:, :past], "attention_mask": mask[:, :past].clamp(max=1), "use_cache": True}
        neofix.configure(mode="strict" if strict else "repair")
        try:
            assert_same_outcome(model, prefill, chunk)
        finally:
            neofix.configure(mode="repair")


def test_positions_generate_passes_take_the_fast_path(model, monkeypatch):
    """A prefill and a chunk given the mask's positions, the way transformers' generate and a careful loop pass them,
    are read by :func:`read_given` and passed on as they are by :func:`plain_forward`; positions that count a row's
    padding on a prefill, or are off at a real token of a chunk, go to the general path, which repairs them."""
    taken = []
    real = _wrappers.plain_forward

    def spy(*args):
        result = real(*args)
        kwargs = args[2]
        if kwargs.get("position_ids") is not None:  # (the forwards that build the caches pass none)
            settled = result[0]  # passed on as they are: settled to them, or to no change at all
            if settled is None:
                taken.append(None)
            else:
                kept = settled.positions is None or settled.positions is kwargs["position_ids"]
                taken.append(kept and not settled.right_padded and not settled.repairs)
        return result

    monkeypatch.setattr(_wrappers, "plain_forward", spy)
    ids, mask = left_padded_batch([5, 3])
    positions = reference_positions(mask)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model(input_ids=ids, attention_mask=mask, position_ids=positions)  # generate's prefill
        model(input_ids=ids, attention_mask=mask, position_ids=torch.arange(5)[None])  # counts the padding
        cache = output_cache(model(input_ids=ids[:, :3], attention_mask=mask[:, :3], use_cache=True))
        model(input_ids=ids[:, 3:], attention_mask=mask, position_ids=positions[:, 3:], **{cache_keyword(): cache})
        cache = output_cache(model(input_ids=ids[:, :3], attention_mask=mask[:, :3], use_cache=True))
        model(input_ids=ids[:, 3:], attention_mask=mask, position_ids=positions[:, 3:] + 1, **{cache_keyword(): cache})
        cache = output_cache(model(input_ids=ids[:, :1], attention_mask=mask[:, :1], use_cache=True))
        model(input_ids=ids[:, 1:], attention_mask=mask, position_ids=positions[:, 1:], **{cache_keyword(): cache})
        full = torch.ones_like(mask)  # every token real: one row of positions serves every row
        cache = output_cache(model(input_ids=ids[:, :3], attention_mask=full[:, :3], use_cache=True))
        model(input_ids=ids[:, 3:], attention_mask=full, position_ids=torch.arange(3, 5)[None], **{cache_keyword(): cache})
    assert taken == [True, None, True, None, True, True]  # the fifth: row 1's real tokens begin inside the chunk


@pytest.mark.parametrize(
    "shape, error",
    [
        ("three rows", neofix.BatchMismatchError),
        ("one dimension", None),
        ("float", neofix.PositionError),
        ("int32", None),
        ("cached and new", None),  # as long as the cached and new tokens: the new tokens' are taken
        ("a column more", None),  # another length: derived from the mask instead
        ("three dimensions", neofix.PositionError),
        ("no dimension", neofix.PositionError),
    ],
)
@pytest.mark.parametrize("past", [0, 2])
def test_given_positions_of_another_shape_or_dtype_are_aligned_as_the_general_path_aligns_them(shape, error, past):
    """Positions other than long ``(1 or batch, new tokens)`` are left to the general path, which aligns them or
    says what is wrong: the fast path gives its outcome."""
    model = _chunk_model("gpt_neo")
    ids, mask = left_padded_batch([5, 3])
    positions = reference_positions(mask)
    new = positions[:, past:]
    given = {
        "three rows": torch.cat([new, new[:1]]),
        "one dimension": new[0],
        "float": new.double(),
        "int32": new.int(),
        "cached and new": positions,
        "a column more": F.pad(new, (0, 1)),
        "three dimensions": new[:, :, None],
        "no dimension": new[0, 0],
    }[shape]
    chunk = {"input_ids": ids[:, past:], "attention_mask": mask, "position_ids": given}
    prefill = {"input_ids": ids[:, :past], "attention_mask": mask[:, :past], "use_cache": True} if past else None
    general = assert_same_outcome(model, prefill, chunk)
    if error is None:
        assert not any(isinstance(result, tuple) for result in general)  # the forward and the step ran
    else:
        assert isinstance(general[0], tuple) and issubclass(general[0][0], error)


def test_one_dimensional_positions_as_many_as_the_rows_are_aligned_as_the_general_path_aligns_them():
    """1D positions with as many entries as the batch has rows (2 new tokens, 2 rows), on a chunk inside which a
    padded row's real tokens begin: read as a list of ints rather than of rows, they are left to the general path,
    whose outcome the fast path gives."""
    model = _chunk_model("gpt_neo")
    ids, mask = left_padded_batch([1, 5])  # row 0's one real token: the chunk's last
    positions = reference_positions(mask)
    prefill = {"input_ids": ids[:, :3], "attention_mask": mask[:, :3], "use_cache": True}
    chunk = {"input_ids": ids[:, 3:], "attention_mask": mask, "position_ids": positions[1, 3:]}
    general = assert_same_outcome(model, prefill, chunk)
    assert not any(isinstance(result, tuple) for result in general)  # the forward and the step ran


def test_given_positions_of_a_batch_of_no_rows_are_passed_on_as_the_general_path_passes_them():
    """A prefill of no rows, with a mask and positions of no rows: nothing to read or compare (the general path
    reads nothing either), and the model gives the general path's outcome."""
    ids = torch.ones(0, 5, dtype=torch.long)
    positions = torch.ones(0, 5, dtype=torch.long)
    assert _values.read_given(ids, positions, torch.ones_like(ids)).positions is positions
    chunk = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": positions}
    assert_same_outcome(_chunk_model("gpt_neo"), None, chunk)


def test_the_range_of_given_positions_is_left_to_the_embedding(model, monkeypatch):
    """GPT-Neo looks positions up in its table, where on the CPU one outside it fails before anything else runs, and
    the forward names it: so the CPU path reads no position where every row is real tokens (a prefill takes any
    positions then), and reads a left-padded row's only to tell whether they count its padding."""
    reads = []
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self, real=torch.Tensor.tolist: reads.append(self) or real(self))
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    positions = torch.tensor([[0, 1, 2], [3, 4, 64]])
    for mask, read in ((torch.ones_like(ids), [(2, 3)]), (torch.tensor([[1, 1, 1], [0, 1, 1]]), [(2, 3), (2, 3)])):
        reads.clear()
        assert _values.read_given(ids, positions, mask).positions is positions
        assert [tensor.shape for tensor in reads] == read  # the mask, then (left-padded) the positions
        with pytest.raises(neofix.PositionError, match=r"position_ids\[1, 2\] is 64, outside the position table"):
            model(input_ids=ids, attention_mask=mask, position_ids=positions)


def test_given_positions_of_a_family_without_the_lookup_take_the_general_path():
    """A family whose given positions are compared with the mask but not looked up in a table of max_positions
    (none such yet: OPT's has no limit in columns) would need their range read: the general path reads it."""
    from neofix._families import opt

    model = _chunk_model("opt")
    _, layers, limits = _wrappers._read_model_facts(model.model.decoder, opt)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.tensor([[0, 1, 2]])}
    assert _plain_forward(ids, kwargs, layers, limits, opt)[0] is not None
    ranged = limits._replace(max_positions=64)
    assert _plain_forward(ids, kwargs, layers, ranged, opt) == (None, 0, None)
    assert _plain_forward(ids, kwargs, layers, ranged, gpt_neo)[0] is not None


# -- a chunk's cache read from its keys' shapes (transformers 4.56 and later) ---------------------------------------

from neofix import _caches  # noqa: E402
from neofix._core import Limits  # noqa: E402
from neofix._core._align import check_cache  # noqa: E402

from ._versions import has, requires  # noqa: E402

def _tiny_limits(max_positions):
    """The tiny GPT-Neo's limits (4 layers of 4 heads of width 8), with a position table of ``max_positions``."""
    return Limits(max_positions=max_positions, vocab_size=96, hidden_size=32, heads=4, head_dim=8)


def _cache_layer(kind, shape):
    """A cache layer as transformers builds it, its keys of ``shape`` (rows, heads, tokens, width) unless ``kind``
    says otherwise: ``dynamic`` (written once), ``sliding`` (a sliding window of 4 tokens, which keeps the last 3 of
    its keys yet counts every token), ``empty`` (nothing written yet), ``reset`` (written, then ``reset()``),
    ``shorter`` (a token fewer), ``other heads`` (twice the heads of half the width), ``three dims`` (no width)."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    rows, heads, tokens, width = shape
    if kind == "shorter":
        tokens = max(tokens - 1, 0)
    if kind == "other heads":
        heads, width = heads * 2, width // 2
    layer = DynamicSlidingWindowLayer(sliding_window=4) if kind == "sliding" else DynamicLayer()
    if kind != "empty":
        keys = torch.zeros(rows, heads, tokens) if kind == "three dims" else torch.zeros(rows, heads, tokens, width)
        layer.update(keys, keys.clone())
    if kind == "reset":
        layer.reset()
    return layer


class _ReadWhole(Exception):
    """Raised by :func:`_reading_whole`'s reader: ``plain_forward`` read the cache whole."""


def _reading_whole(adapter):
    """``adapter`` whose ``read_cache`` raises :class:`_ReadWhole`: a chunk's cache read from its keys' shapes alone
    gets past it."""
    import types

    def read_cache(cache, layers):
        raise _ReadWhole

    facts = {name: getattr(adapter, name) for name in dir(adapter) if name.isupper()}
    return types.SimpleNamespace(**facts, read_cache=read_cache)


def _chunk_after(cache, batch, new, past):
    """``plain_forward``'s arguments for a chunk of ``new`` tokens over ``batch`` rows after ``past`` cached ones."""
    ids = torch.zeros(batch, new, dtype=torch.long)
    return ids, {"attention_mask": torch.ones(batch, past + new, dtype=torch.long), cache_keyword(): cache}


def test_the_usual_layer_is_dynamic_layer_from_transformers_4_56_and_for_the_common_layout_only():
    usual = _caches.usual_layer(_caches.read)
    assert (usual is not None) == has("cache layer objects")
    assert _caches.usual_layer(lambda cache, layers: None) is None  # a family reading caches its own way (BLOOM)
    if usual is not None:
        from transformers.cache_utils import DynamicCache, DynamicLayer

        assert usual is DynamicLayer
        reader = _reading_whole(gpt_neo)
        ids, kwargs = _chunk_after(DynamicCache(), 2, 3, 5)  # no layers: nothing to tell, read whole
        with pytest.raises(_ReadWhole):
            _plain_forward(ids, kwargs, 4, _tiny_limits(64), reader, usual)
        keys = torch.zeros(2, 4, 5, 8)
        ids, kwargs = _chunk_after(tuple((keys, keys) for _ in range(4)), 2, 3, 5)  # a legacy cache: never its shapes
        reader.LEGACY_CACHE_REJECTED = False
        with pytest.raises(_ReadWhole):
            _plain_forward(ids, kwargs, 4, _tiny_limits(64), reader, usual)
    # one new token after a cache: a decode step's (aligned_decode_step reads its cache), no chunk: nothing read here
    keys = torch.zeros(2, 4, 5, 8)
    caches = [tuple((keys, keys) for _ in range(4))]
    if usual is not None:
        caches.append(DynamicCache())
        caches[-1].layers = [_cache_layer("dynamic", (2, 4, 5, 8)) for _ in range(4)]
    for cache in caches:
        ids, kwargs = _chunk_after(cache, 2, 1, 5)
        reader = _reading_whole(gpt_neo)
        reader.LEGACY_CACHE_REJECTED = False
        assert _plain_forward(ids, kwargs, 4, _tiny_limits(64), reader, usual) == (None, 0, None)


if given is not None:
    _LAYER_KINDS = ["dynamic", "sliding", "empty", "reset", "shorter", "other heads", "three dims"]

    @requires("cache layer objects")
    @given(
        st.tuples(st.sampled_from([2, 1, 3, 0]), st.sampled_from([4, 8]), st.integers(0, 7), st.sampled_from([8, 4])),
        st.one_of(  # the usual cache (4 or 5 layers), a sliding window's, or any layers
            st.lists(st.just("dynamic"), min_size=4, max_size=5),
            st.lists(st.sampled_from(["sliding", "three dims"]), min_size=4, max_size=4).map(lambda kinds: kinds[:1] * 4),
            st.lists(st.sampled_from(_LAYER_KINDS), max_size=5),
        ),
        st.sampled_from([2, 1, 0]),
        st.integers(2, 4),
        st.sampled_from([None, 8, 9, 64]),
    )
    @example((2, 4, 5, 8), ["dynamic"] * 4, 2, 3, 64)  # the usual cache
    @example((1, 4, 5, 8), ["dynamic"] * 5, 1, 3, None)  # more layers than the model's, no position table
    @example((2, 4, 5, 8), ["dynamic"] * 4, 2, 3, 8)  # 5 + 3 tokens: the whole table
    @example((2, 4, 5, 8), ["dynamic"] * 4, 2, 4, 8)  # 5 + 4: one past it
    @example((2, 4, 5, 8), ["dynamic"] * 3, 2, 3, 64)  # a layer short
    @example((2, 4, 5, 8), ["dynamic", "dynamic", "shorter", "dynamic"], 2, 3, 64)
    @example((2, 4, 5, 8), ["sliding"] * 4, 2, 3, 64)  # keeps 3 keys, counts 5 tokens
    @example((2, 8, 5, 8), ["dynamic"] * 4, 2, 3, 64)  # other heads, of the model's width
    @example((2, 4, 5, 4), ["dynamic"] * 4, 2, 3, 64)  # the model's heads, of another width
    @example((3, 4, 5, 8), ["dynamic"] * 4, 2, 3, 64)  # other rows
    @example((2, 4, 5, 8), ["three dims"] * 4, 2, 3, 64)
    def test_a_chunk_takes_the_usual_cache_from_its_keys_shapes_and_only_what_reading_it_whole_accepts(
        shape, kinds, batch, new, max_positions
    ):
        """For a chunk of ``new`` tokens over ``batch`` rows of the tiny GPT-Neo (4 layers): ``plain_forward`` takes
        the cache's length from the keys' shapes, without reading it whole, exactly when every one of the first 4
        layers is a DynamicLayer holding keys (transformers' own ``get_seq_length`` says so), all of one shape of
        ``batch`` rows, 4 heads, width 8 and at least one token, and that many tokens plus ``new`` fit the position
        table; and what it takes is what :func:`_caches.read` then :func:`check_cache` find (any other cache is read
        whole, which says what is wrong)."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        cache = DynamicCache()
        cache.layers = [_cache_layer(kind, shape) for kind in kinds]
        limits = _tiny_limits(max_positions)
        ids, kwargs = _chunk_after(cache, batch, new, shape[2])
        try:
            settled, past, view = _plain_forward(
                ids, kwargs, 4, limits, _reading_whole(gpt_neo), _caches.usual_layer(_caches.read)
            )
        except _ReadWhole:
            past = 0
        else:  # taken from the shapes: no view read
            assert settled is not None and past == shape[2] and view is None

        first = cache.layers[:4]
        holding = [type(layer) is DynamicLayer and layer.get_seq_length() > 0 for layer in first]
        shapes = {tuple(layer.keys.shape) for layer, held in zip(first, holding) if held}
        usual = len(first) == 4 and all(holding) and len(shapes) == 1
        length = next(iter(shapes))[2] if usual else None
        usual = usual and next(iter(shapes)) == (batch, 4, length, 8)
        usual = usual and (max_positions is None or length + new <= max_positions)
        assert past == (length if usual else 0)
        if past:
            view = _caches.read(cache, 4)
            assert view.length == past and check_cache(view, batch, new, limits) == past + new


@requires("cache layer objects")
@pytest.mark.parametrize("new", [3, 5])  # a chunk that fits the table of 64 positions, and one that reaches it exactly
def test_a_chunk_on_the_usual_cache_reads_the_keys_shapes_only(model, monkeypatch, new):
    """A left-padded chunk after a growing cache takes the keys' shapes (the cache is not read whole, which asks each
    layer its ``get_seq_length``), and gives the tokens of the full recompute and, bit for bit, the logits of vanilla's
    chunk given the mask's positions (the same arithmetic: GPT-Neo computes attention scores in float32 even in a
    float64 model, so a chunk and the full recompute agree only to about 1e-4 on some CPUs)."""
    ids, mask = left_padded_batch([64, 61])  # 64 positions: the whole table
    past = 64 - 5
    chunk = dict(input_ids=ids[:, past : past + new], attention_mask=mask[:, : past + new])
    positions = reference_positions(mask[:, : past + new])
    with torch.no_grad():
        prompt = dict(input_ids=ids[:, :past], attention_mask=mask[:, :past], use_cache=True)
        expected = model(input_ids=ids[:, : past + new], attention_mask=mask[:, : past + new],
                         position_ids=positions).logits[:, past:]
        with neofix.unpatched():
            cache = output_cache(model(**prompt, position_ids=positions[:, :past]))
            vanilla = model(**chunk, position_ids=positions[:, past:], **{cache_keyword(): cache}).logits
        cache = output_cache(model(**prompt))

        def unread(*args, **kwargs):
            raise AssertionError("the cache was read whole")

        monkeypatch.setattr(_caches, "_read_layers", unread)
        logits = model(**chunk, **{cache_keyword(): cache}).logits
    torch.testing.assert_close(logits, vanilla, rtol=0, atol=0)
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))
    torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)


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


@pytest.mark.parametrize(
    "change, error, words",
    [
        (_uneven_layers, neofix.CacheLengthError, "cache layer 2 holds 4 tokens, but layer 0 holds 5"),
        (_other_heads, neofix.InputShapeError, "keys of 8 heads of width 4, but this model has 4 heads of width 8"),
        (_more_rows, neofix.BatchMismatchError, "the cache holds 3 rows, but this step feeds 2"),
        (None, neofix.SequenceTooLongError, "this step would reach sequence length 65"),
    ],
)
def test_a_chunk_on_a_cache_that_does_not_fit_is_refused_by_name(model, change, error, words):
    """What the chunk's fast reading of the cache declines (a layer of another length, another model's keys, other
    rows, a chunk past the position table) reaches the reading that names it, on every release."""
    ids, mask = left_padded_batch([8, 6])
    past, new = (5, 3) if change is not None else (60, 5)
    if change is None:
        ids, mask = left_padded_batch([65, 63])
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :past], attention_mask=mask[:, :past], use_cache=True))
        if change is not None:
            cache = change(cache) if has("cache layer objects") else _legacy_changed(cache, change)
        with pytest.raises(error, match=words):
            model(input_ids=ids[:, past : past + new], attention_mask=mask[:, : past + new], **{cache_keyword(): cache})


def _legacy_changed(cache, change):
    """``change`` made to a cache of a release before 4.56 (key lists, or tuples), through stand-in layer objects."""
    from types import SimpleNamespace

    stand_in = SimpleNamespace(layers=[SimpleNamespace(keys=keys) for keys, _ in legacy(cache)])
    layers = tuple((layer.keys, layer.keys) for layer in change(stand_in).layers)
    return layers if isinstance(cache, tuple) else as_cache_object(layers)


@pytest.mark.parametrize(
    "rows, searched",
    [
        ([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], False),  # unpadded
        ([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]], False),  # left-padded
        ([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], True),  # right-padded
        ([[0, 1, 1, 1, 1], [0, 0, 0, 0, 0]], True),  # a row of pads only
        ([[0, 1, 0, 1, 1], [1, 1, 1, 1, 1]], True),  # a gap
    ],
)
@pytest.mark.parametrize("past", [0, 2])
def test_usual_masks_are_read_in_one_pass_without_the_row_by_row_search(model, monkeypatch, rows, searched, past):
    """On the CPU a mask whose every row is real tokens, or pads then real tokens, is settled by one pass over its
    rows; any other mask is searched row by row (``_row_padding``), and both give what that search gives."""
    calls = []
    search = _values._row_padding

    def spy(*args):
        calls.append(args)
        return search(*args)

    monkeypatch.setattr(_values, "_row_padding", spy)
    mask = torch.tensor(rows)
    ids = torch.arange(1, 1 + mask.numel()).view(mask.shape)[:, past:] % 90 + 1
    settled = _values.read_prefill(ids, mask, gpt_neo.limits(model.config), past=past)
    assert bool(calls) == searched
    monkeypatch.setattr(_values, "READ_SCALARS_ON_CPU", False)  # the torch operations of accelerators: no search
    expected = _values.read_prefill(ids, mask, gpt_neo.limits(model.config), past=past)
    assert settled.right_padded == expected.right_padded and [r.kind for r in settled.repairs] == [
        r.kind for r in expected.repairs
    ]
    assert (settled.positions is None) == (expected.positions is None)
    if settled.positions is not None:
        assert torch.equal(settled.positions, expected.positions)


@pytest.mark.parametrize("with_mask", [True, False])
def test_a_decode_step_on_a_cache_of_fewer_heads_of_the_same_width_is_refused(model, with_mask):
    """The usual decode step (the fast path) on a cache holding 2 of the model's 4 heads, each of the model's width
    8: refused by name before the model runs, as a cache of other heads and another width is
    (``tests/test_families.py``)."""
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    cache = prefill(model, ids, torch.ones_like(ids))
    halved = tuple((keys[:, :2], values[:, :2]) for keys, values in legacy(cache))
    step = {"input_ids": torch.tensor([[9], [10]]), cache_keyword(): halved if isinstance(cache, tuple) else as_cache_object(halved)}
    if with_mask:
        step["attention_mask"] = torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad(), pytest.raises(neofix.InputShapeError) as caught:
        model(**step)
    assert str(caught.value).startswith("the cache holds keys of 2 heads of width 8, but this model has 4 heads of width 8")


# -- a step's cache is read once ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "step",
    ["stale mask", "checked values", "caller's positions", "chunk of a float mask", "left-padded chunk"],
)
def test_a_forward_reads_its_cache_at_most_once(monkeypatch, step):
    """Whichever path a forward takes (the decode step's fast check, the plain forward's read, the general
    alignment, or one after another), the cache's view (its length, rows and layers) is read at most once: a decode
    step that misses the fast path (a stale mask, repaired; values checked; the caller's positions) and a chunk the
    plain read hands on (a float mask) once; a left-padded chunk on the usual growing cache never (its keys'
    shapes alone), on other caches once.  The outputs are those of the full recompute.  (A prefill has no cache:
    the count could not fail there.)"""
    from neofix import _caches

    model = tiny_gpt_neo(seed=0, dtype=torch.float32)  # (vanilla 4.36 - 4.44 cannot run a float64 model: the reference)
    ids, mask = left_padded_batch([7, 5])
    past = 5
    with torch.no_grad():
        cache = output_cache(model(input_ids=ids[:, :past], attention_mask=mask[:, :past], use_cache=True))
    call = {"attention_mask": mask[:, : past + 1], cache_keyword(): cache, "input_ids": ids[:, past : past + 1]}
    width = past + 1
    if step == "stale mask":
        call["attention_mask"] = mask[:, :past]  # extended by neofix (a warned repair)
    elif step == "checked values":
        neofix.configure(check_values=True)
    elif step == "caller's positions":
        call["position_ids"] = reference_positions(mask[:, :width])[:, past:]
    elif step == "chunk of a float mask":
        width = past + 2
        call["attention_mask"], call["input_ids"] = mask[:, :width].float(), ids[:, past:width]  # (the general path)
    else:
        assert step == "left-padded chunk"
        width = past + 2
        call["attention_mask"], call["input_ids"] = mask[:, :width], ids[:, past:width]
    reads = []
    for name in ("_read_layers", "_read_legacy", "_read_key_cache"):
        real = getattr(_caches, name)
        monkeypatch.setattr(_caches, name, lambda *args, real=real: reads.append(args) or real(*args))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logits = model(**call).logits
    chunk_of_shapes = step == "left-padded chunk" and _caches.usual_layer(gpt_neo.read_cache) is not None
    assert len(reads) == (0 if chunk_of_shapes else 1)
    full = mask[:, :width]
    with neofix.unpatched(), torch.no_grad():
        expected = model(input_ids=ids[:, :width], attention_mask=full, position_ids=reference_positions(full)).logits
    torch.testing.assert_close(logits, expected[:, -logits.shape[1] :], rtol=1e-4, atol=1e-4)
