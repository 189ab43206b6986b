"""Concurrency and isolation: patch/unpatch from many threads, several models in one process, and a patched model's
saved, pickled and state-dict forms identical to an unpatched one's."""

from __future__ import annotations

import importlib
import pickle
import random
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import neofix
from neofix import _lifecycle
from neofix._families import FAMILIES, GPT_NEO
from neofix.testing import reference_greedy, tiny_gpt_neo

from ._versions import cache_keyword, output_cache
from .loops import decode, left_padded_batch, patched_and_vanilla

MISSING = object()


def targets():
    """``(owner, attribute)`` of every patch target the installed transformers has and needs, in every family whose
    modeling module the release has (each loaded here: a family's targets must not be checked only when another test
    happened to load its module first)."""
    from neofix import _compat

    importlib.import_module(GPT_NEO.module)
    found = []
    for family in FAMILIES.values():
        try:
            module = importlib.import_module(family.module)
        except ImportError:  # a family this release lacks
            continue
        for target in family.targets:
            if not target.wrapper or not _compat.in_range(target.since, target.until):
                continue
            owner = getattr(module, target.owner, None) if target.owner else module
            if owner is not None and hasattr(owner, target.attribute):
                found.append((owner, target.attribute))
    return found


def own_attributes():
    """What each target's owner holds itself (``MISSING`` where the attribute is inherited)."""
    return [vars(owner).get(attribute, MISSING) for owner, attribute in targets()]


def is_proxy(value):
    """Whether ``value`` is a wrapper neofix installed (marked by ``neofix._wrappers._mark``: those of
    neofix/_wrappers.py, and a family's own, such as GPT-Neo's static-cache window)."""
    from neofix import _wrappers

    return getattr(value, _wrappers.MARK, False) is True


def assert_consistent():
    """Under the lifecycle lock: is_patched() agrees with the classes, and nothing is wrapped twice."""
    with _lifecycle._lock:
        patched = neofix.is_patched()
        wrapped = [is_proxy(value) for value in own_attributes()]
        assert all(wrapped) if patched else not any(wrapped), (patched, wrapped)
        for value in own_attributes():
            if is_proxy(value):
                assert not is_proxy(value.__wrapped__), "a target is wrapped twice"
        assert sum(len(applied) for applied in _lifecycle._applied.values()) == (len(wrapped) if patched else 0)


def test_patch_unpatch_from_many_threads():
    neofix.unpatch()
    vanilla = own_attributes()
    assert not any(is_proxy(value) for value in vanilla)
    neofix.patch()

    threads, rounds = 8, 20
    start = threading.Barrier(threads)
    errors = []

    def worker(seed):
        chooser = random.Random(seed)
        try:
            start.wait()
            for _ in range(rounds):
                chooser.choice([neofix.patch, neofix.unpatch, neofix.is_patched, assert_consistent])()
        except BaseException as exc:  # noqa: BLE001 - reported below, with the thread's seed
            errors.append((seed, exc))

    pool = [threading.Thread(target=worker, args=(seed,)) for seed in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    assert not errors, errors
    assert_consistent()

    # a final unpatch restores transformers exactly: the very same objects, inherited attributes deleted again
    neofix.unpatch()
    assert not neofix.is_patched()
    assert all(now is before for now, before in zip(own_attributes(), vanilla))

    # a final patch wraps every target exactly once, around the original function
    neofix.patch()
    assert neofix.is_patched()
    assert_consistent()
    for (owner, attribute), now, before in zip(targets(), own_attributes(), vanilla):
        name = f"{getattr(owner, '__name__', owner)}.{attribute}"
        assert is_proxy(now), f"{name} is not wrapped"
        if before is MISSING:  # inherited: the wrapper sits on the subclass, around the base class's function
            before = next(vars(base)[attribute] for base in owner.__mro__[1:] if attribute in vars(base))
        original = before
        assert now.__wrapped__ is original, f"{name} wraps something other than the original"


def test_decoding_while_another_thread_patches():
    """Decoding stays right while another thread patches and unpatches (float32: vanilla 4.36 - 4.44 needs it).

    The interpreter switches threads every 0.1 ms instead of every 5: the decoding thread's Python is cut into finer
    slices between patches (a few hundred patch/unpatch pairs land in each decode), and it no longer waits 5 ms for
    the GIL after each torch operation (which made 5 decodes take 15 s)."""
    model = tiny_gpt_neo(seed=0)
    ids, mask = left_padded_batch([5, 5])  # unpadded and synced: right patched or not
    expected = reference_greedy(model, ids, mask, 3)[:, 5:]
    stop = threading.Event()
    toggles = 0

    def toggler():
        nonlocal toggles
        while not stop.is_set():
            neofix.unpatch()
            neofix.patch()
            toggles += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    thread = threading.Thread(target=toggler)
    thread.start()
    try:
        for _ in range(20):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                assert torch.equal(decode(model, ids, mask, 3), expected)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert toggles > 20, toggles  # the patches ran while the decodes did
    neofix.patch()
    assert_consistent()


# -- several models in one process ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other():
    """A GPT-Neo with another vocabulary, width, depth, window and position table."""
    return tiny_gpt_neo(
        seed=7,
        dtype=torch.float64,
        vocab_size=50,
        hidden_size=24,
        num_heads=3,
        num_layers=3,
        window_size=3,
        max_position_embeddings=24,
        intermediate_size=48,
    )


def stepper(model, ids, mask, steps, mask_mode="stale"):
    """A hand-written loop as a generator: one forward per ``next()``, the generated tokens at the end."""
    keyword = cache_keyword()
    prompt_mask = mask
    # no_grad around each forward, never across a yield: interleaved generators would restore each other's mode
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    tokens = [out.logits[:, -1:].argmax(-1)]
    yield
    for _ in range(steps - 1):
        mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], -1)
        step_mask = mask if mask_mode == "synced" else prompt_mask  # "stale": neofix extends it
        with torch.no_grad():
            out = model(input_ids=tokens[-1], attention_mask=step_mask, use_cache=True, **{keyword: output_cache(out)})
        tokens.append(out.logits[:, -1:].argmax(-1))
        yield
    yield torch.cat(tokens, -1)


def run(generator):
    result = None
    for result in generator:
        pass
    return result


def test_two_models_interleaved(model, other):
    steps = 8
    a_ids, a_mask = left_padded_batch([6, 2, 4], vocab=96, seed=1)
    b_ids, b_mask = left_padded_batch([3, 5], vocab=50, seed=2)
    want_a = reference_greedy(model, a_ids, a_mask, steps)[:, a_ids.shape[1]:]
    want_b = reference_greedy(other, b_ids, b_mask, steps)[:, b_ids.shape[1]:]
    a, b = stepper(model, a_ids, a_mask, steps), stepper(other, b_ids, b_mask, steps, "synced")
    got_a = got_b = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        for _ in range(steps + 1):  # one forward of each, in turn
            got_a, got_b = next(a), next(b)
    assert torch.equal(got_a, want_a)
    assert torch.equal(got_b, want_b)
    assert torch.is_grad_enabled()


def test_each_model_is_checked_against_its_own_config(model, other):
    """Id 60 is fine for the first model and out of range for the second; position 30 the other way round."""
    with torch.no_grad():
        model(input_ids=torch.tensor([[60, 1]]))
        with pytest.raises(neofix.TokenIdError, match=r"is 60, outside the vocabulary: config.vocab_size is 50"):
            other(input_ids=torch.tensor([[60, 1]]))
        model(input_ids=torch.ones(1, 30, dtype=torch.long))
        with pytest.raises(neofix.SequenceTooLongError, match=r"max_position_embeddings is 24"):
            other(input_ids=torch.ones(1, 30, dtype=torch.long))


def test_two_models_in_two_threads(model, other):
    steps = 8
    jobs = {
        "a": (model, *left_padded_batch([6, 2, 4], vocab=96, seed=1)),
        "b": (other, *left_padded_batch([3, 5], vocab=50, seed=2)),
    }
    want = {name: reference_greedy(m, ids, mask, steps)[:, ids.shape[1]:] for name, (m, ids, mask) in jobs.items()}
    got: dict[str, list] = {name: [] for name in jobs}
    start = threading.Barrier(len(jobs))
    errors = []

    def worker(name):
        m, ids, mask = jobs[name]
        try:
            start.wait()
            for _ in range(3):
                got[name].append(run(stepper(m, ids, mask, steps, "stale" if name == "a" else "synced")))
        except BaseException as exc:  # noqa: BLE001
            errors.append((name, exc))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        pool = [threading.Thread(target=worker, args=(name,)) for name in jobs]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    assert not errors, errors
    for name in jobs:
        assert len(got[name]) == 3 and all(torch.equal(tokens, want[name]) for tokens in got[name]), name


# -- a patched model is the same model --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def used():
    """A float32 tiny GPT-Neo that has already decoded (patched), so that any state a forward leaves is there."""
    model = tiny_gpt_neo(seed=11)
    ids, mask = left_padded_batch([5, 3])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        decode(model, ids, mask, 3, mask_mode="stale")
    return model


def test_state_dict_unchanged(used):
    patched, vanilla = patched_and_vanilla(used.state_dict)
    assert list(patched) == list(vanilla)
    for name in patched:
        assert patched[name].dtype == vanilla[name].dtype and torch.equal(patched[name], vanilla[name]), name


def test_save_pretrained_unchanged(used, tmp_path):
    folders = iter(["patched", "vanilla"])

    def save():
        path = tmp_path / next(folders)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            used.save_pretrained(path)
        return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(Path(path).rglob("*")) if p.is_file()}

    patched, vanilla = patched_and_vanilla(save)
    assert patched.keys() == vanilla.keys() and patched, sorted(patched)
    for name in patched:
        assert patched[name] == vanilla[name], f"{name} differs"

    # and from_pretrained loads it the same, patched or not (same seed: 4.26 - 4.30 re-initialise an untied lm_head)
    from transformers import GPTNeoForCausalLM

    def load():
        with torch.random.fork_rng(), warnings.catch_warnings():
            torch.manual_seed(0)
            warnings.simplefilter("ignore")
            return GPTNeoForCausalLM.from_pretrained(tmp_path / "patched").state_dict()

    patched, vanilla = patched_and_vanilla(load)
    assert patched.keys() == vanilla.keys()
    assert all(torch.equal(patched[name], vanilla[name]) for name in patched)


def test_pickle_unchanged(used):
    patched, vanilla = patched_and_vanilla(lambda: pickle.dumps(used))
    assert patched == vanilla
    clone = pickle.loads(patched)
    ids, mask = left_padded_batch([5, 3])
    assert torch.equal(decode(clone, ids, mask, 4), reference_greedy(used, ids, mask, 4)[:, 5:])
