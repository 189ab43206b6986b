"""Property-based tests (hypothesis): random decoding setups against the full-recompute reference and the contract.

Three properties, each run for the examples of the active profile (tests/_hypothesis.py: ``ci`` = 200,
derandomized; ``HYPOTHESIS_PROFILE=thorough`` = 5000):

``test_hand_written_loops``
    Random batch (1-4 rows), per-row prompts and left padding, pad id, chunked-prefill split points, number of
    steps, synced / stale / no attention mask, missing / correct / full-length / stale / frozen position ids, native,
    legacy-tuple and Cache-object caches, repair and strict mode, ``check_values`` on and off, and two models (64
    and 7 positions, so that some sequences run past ``max_position_embeddings``).  :func:`contract` says, from the
    step contract in DESIGN.md alone, which forward must raise which ``NeofixError`` and which repairs are warned.
    Every row's tokens before that point must equal the reference (the same prompt alone, decoded by full
    recompute); the error must be exactly the predicted one, at the predicted step, with the cache it was given
    unchanged; the ``NeofixWarning`` s must be exactly the predicted ones.
``test_generate``
    Random left-padded batches through ``generate`` (greedy, EOS honoured), ``max_new_tokens`` sometimes past the
    position table (then generate runs until EOS ends every row, or raises at the step that would pass the table,
    before its compute; a prompt longer than the table is refused before any forward), sometimes a token id outside
    the vocabulary in the prompt.
``test_align_core``
    The pure core with random shapes: batch mismatches of mask / positions / cache, uneven cache layers, empty
    steps, masks and positions of every length.  It raises a ``NeofixError`` exactly when the step has a fault
    (of one of the faults' classes), and otherwise returns a mask covering cache + input and ``q`` positions.

Invalid by the contract (an error is required): a mask longer than cache + input (a stale prompt mask during chunked
prefill), a mask as wide as the step's new tokens after a cache (a 1-token prompt's mask kept: the chunk's own mask
or a stale one cannot be told apart), a sequence past ``max_position_embeddings``, a token id outside the vocabulary,
batch mismatches, uneven cache layers, empty steps; in strict mode also a mask not extended, full-length or stale
position ids, frozen position values (right length, wrong values: repaired on the device in repair mode), and
(transformers >= 4.54) legacy tuple caches.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import pytest
import torch

import neofix
from neofix import _caches, _errors
from neofix._core import CacheView, Limits, Policy, Positions, StepInputs, align
from neofix._families import gpt_neo
from neofix.testing import reference_greedy, reference_positions, tiny_gpt_neo

from ._versions import cache_keyword, has, legacy, output_cache

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import event, example, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VOCAB = 96
MAX_PROMPT = 6  # real tokens per row
MAX_PAD = 2  # extra left padding on top of the longest row
MAX_STEPS = 5  # generated tokens
SHORT_POSITIONS = 7  # max_position_embeddings of the second model: long prompts and many steps pass it
BASES = torch.randint(1, VOCAB, (6, MAX_PROMPT), generator=torch.Generator().manual_seed(1234))
EOS = 0  # neofix.testing.TINY_CONFIG eos_token_id

# the profile (tests/_hypothesis.py) decides examples and seed; the autouse fixture is reset per example by hand
PROPERTY = settings(
    suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def models(model):
    """The shared float64 model (64 positions) and a float64 one with 7 positions, by name."""
    return {"main": model, "short": tiny_gpt_neo(seed=1, dtype=model.dtype, max_position_embeddings=SHORT_POSITIONS)}


class References:
    """Each prompt's reference continuation, computed once: the prompt alone, decoded by full recompute.

    A left-padded row must produce exactly these tokens (DESIGN.md, "The reference").  Prompts come from a fixed pool
    (a prefix of one of ``BASES``), so a whole property needs at most 2 x 6 batched reference runs.
    """

    def __init__(self, models: dict) -> None:
        self.models = models
        self.tokens: dict[tuple[str, int], torch.Tensor] = {}

    def row(self, name: str, base: int, length: int, count: int) -> torch.Tensor:
        """The first ``count`` reference tokens, or fewer where the row ends with EOS before the table does."""
        tokens = self.available(name, base, length)
        ended = bool((tokens == EOS).any())
        assert count <= tokens.shape[0] or ended, "asked for a reference past max_position_embeddings"
        return tokens[:count]

    def available(self, name: str, base: int, length: int) -> torch.Tensor:
        """The prompt's reference tokens, as many as fit the model's position table (at most MAX_STEPS)."""
        key = (name, length)
        if key not in self.tokens:
            model = self.models[name]
            steps = min(MAX_STEPS, model.config.max_position_embeddings - length + 1)
            prompts = BASES[:, :length]
            self.tokens[key] = reference_greedy(model, prompts, None, steps)[:, length:]
        return self.tokens[key][base]


@pytest.fixture(scope="module")
def references(models):
    return References(models)


def prompt_batch(rows: list[tuple[int, int]], width: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for index, (base, length) in enumerate(rows):
        ids[index, width - length :] = BASES[base, :length]
        mask[index, width - length :] = 1
    return ids, mask


def test_pooled_reference_is_the_padded_batch_reference(models, references):
    """The per-prompt references the properties use equal ``reference_greedy`` on the padded batch itself."""
    rows = [(0, 6), (1, 2), (2, 4), (3, 1)]
    ids, mask = prompt_batch(rows, 8, pad_id=7)
    batch = reference_greedy(models["main"], ids, mask, MAX_STEPS)[:, 8:]
    pooled = torch.stack([references.row("main", base, length, MAX_STEPS) for base, length in rows])
    assert torch.equal(batch, pooled)


# -- hand-written loops ----------------------------------------------------------------------------------------------


class LoopCase(NamedTuple):
    model: str
    rows: tuple[tuple[int, int], ...]  # (base, real length) per row
    width: int
    pad_id: int
    chunks: tuple[int, ...]  # prefill split points
    steps: int  # tokens to generate
    mask: str  # synced | stale | none
    positions: str  # none | correct | full | stale | frozen
    cache: str  # native | legacy | object
    mode: str  # repair | strict
    check_values: bool


def choice(values: list) -> Any:
    """One of ``values``, drawn near uniformly (``sampled_from`` leans on the first ones in multi-field draws);
    shrinks towards ``values[0]``."""
    return st.integers(0, 2**20).map(lambda i: values[i % len(values)])


@st.composite
def loop_cases(draw: Any) -> LoopCase:
    batch = draw(st.integers(1, 4))
    if draw(choice([False, False, True])):  # unpadded: every row as long as the batch (then a mask is optional)
        length = draw(st.integers(1, MAX_PROMPT))
        rows = tuple((draw(st.integers(0, len(BASES) - 1)), length) for _ in range(batch))
        width = length
    else:
        rows = tuple((draw(st.integers(0, len(BASES) - 1)), draw(st.integers(1, MAX_PROMPT))) for _ in range(batch))
        width = max(length for _, length in rows) + draw(st.integers(0, MAX_PAD))
    padded = any(length < width for _, length in rows)
    chunks = tuple(sorted(draw(st.sets(st.integers(1, width - 1), max_size=2)))) if width > 1 else ()
    return LoopCase(
        model=draw(choice(["main", "main", "short"])),
        rows=rows,
        width=width,
        pad_id=draw(choice([0, 1, VOCAB - 1])),
        chunks=chunks,
        steps=draw(choice(list(range(1, MAX_STEPS + 1)))),
        mask=draw(choice(["synced", "stale"] if padded else ["synced", "stale", "none"])),
        positions=draw(choice(["none", "correct", "full", "stale", "frozen"])),
        cache=draw(choice(["native", "legacy", "object"] if has("Cache objects") else ["native", "legacy"])),
        mode=draw(choice(["repair", "strict"])),
        check_values=draw(choice([False, True])),
    )


class Expected(NamedTuple):
    error: type | None  # the exact NeofixError class
    at: int | None  # the forward (0-based) that raises it
    warned: frozenset  # repair kinds warned: mask, positions, values, derived, legacy


def feeds(case: LoopCase) -> list[int]:
    """New tokens per forward: the prefill chunks, then one per generated token after the first."""
    bounds = [0, *case.chunks, case.width]
    return [b - a for a, b in zip(bounds, bounds[1:])] + [1] * (case.steps - 1)


def left_padded_within(case: LoopCase, columns: int) -> bool:
    """Whether some row has a pad followed by a real token within the first ``columns`` columns."""
    return any(0 < case.width - length < columns for _, length in case.rows)


def contract(case: LoopCase, max_positions: int) -> Expected:
    """What the step contract (DESIGN.md) requires for this loop, derived from shapes alone."""
    strict, prefills = case.mode == "strict", len(case.chunks) + 1
    legacy_rejected = case.cache == "legacy" and gpt_neo.ADAPTER.legacy_cache_rejected
    warned: set[str] = set()
    past = 0
    for k, new in enumerate(feeds(case)):
        total = past + new

        def error(kind: type) -> Expected:
            return Expected(kind, k, frozenset(warned))

        if past and legacy_rejected:  # the wrapper converts (or refuses) the tuples before aligning the step
            if strict:
                return error(neofix.NeofixError)
            warned.add("legacy")
        if total > max_positions:
            return error(neofix.SequenceTooLongError)
        columns = {"synced": total, "stale": case.width, "none": None}[case.mask]
        prompt_mask = prompt_batch(list(case.rows), case.width, 0)[1]
        if columns is not None and columns > total:
            if not torch.equal(prompt_mask[:, :total], prompt_mask[:, -total:]):  # two readings, two masks
                return error(neofix.MaskLengthError)
        elif columns is not None and columns < total:
            if past and (columns == new or columns > past) and not bool(prompt_mask.all()):
                return error(neofix.MaskLengthError)  # extended on the right or on the left: two masks
            if strict:
                return error(neofix.MaskLengthError)
            warned.add("mask")
        # position ids as the loop passes them: (columns, values right?)
        given = {
            "none": None,
            "correct": (new, True),
            "full": (total, True),
            "stale": (case.width, k == 0 or total == case.width),  # prompt positions: right only for the prompt
            "frozen": (new, k < prefills),  # the prompt's last position, fed again at every decode step
        }[case.positions]
        if given is not None and given[0] != new:
            if strict:
                return error(neofix.PositionError)
            if given[0] != total:  # full length: the last q are taken; any other length: re-derived from the mask
                warned.add("positions")
                given = None
        if given is not None and not given[1]:  # the right shape, wrong values: compared with the mask's
            if strict:
                return error(neofix.PositionError)
            warned.add("values")
        if given is None and past == 0 and case.mask != "none" and left_padded_within(case, new):
            warned.add("derived")  # positions from the mask where transformers' own would count the padding
        past = total
    return Expected(None, None, frozenset(warned))


_WARNING_KINDS = {
    "extended it with ones on the right": "mask",
    "derived them from the attention mask instead": "positions",
    "gave them the positions after the cache instead": "positions",  # a step without a mask
    "used the mask's positions": "values",
    "used positions continuing after the cache": "values",  # a step without a mask
    "left-padded and no position_ids were given": "derived",
    "legacy tuple cache": "legacy",
}


def warning_kinds(caught: list) -> set[str]:
    kinds = set()
    for item in caught:
        if issubclass(item.category, neofix.NeofixWarning):
            message = str(item.message)
            matches = [kind for text, kind in _WARNING_KINDS.items() if text in message]
            assert len(matches) == 1, f"unexpected NeofixWarning: {message}"
            kinds.add(matches[0])
    return kinds


def snapshot(cache: Any) -> Any:
    return [None if k is None else (k.clone(), v.clone()) for k, v in legacy(cache)]


def run_loop(model: Any, case: LoopCase, ids: torch.Tensor, mask: torch.Tensor, watch: int | None) -> Any:
    """Decode as the case says; returns (tokens generated, error or None, forward that raised, cache check)."""
    keyword = cache_keyword()
    sizes = feeds(case)
    prefills = len(case.chunks) + 1
    prompt_positions = reference_positions(mask)
    full_mask, cache, tokens, fed, next_tokens = mask, None, [], 0, None
    for k, new_count in enumerate(sizes):
        new = ids[:, fed : fed + new_count] if k < prefills else next_tokens
        fed += new_count
        if k >= prefills:
            full_mask = torch.cat([full_mask, full_mask.new_ones((full_mask.shape[0], 1))], dim=-1)
        step_mask = full_mask[:, :fed]
        kwargs: dict[str, Any] = {"input_ids": new, "use_cache": True}
        if case.mask == "synced":
            kwargs["attention_mask"] = step_mask
        elif case.mask == "stale":
            kwargs["attention_mask"] = mask
        if case.positions == "correct" or (case.positions == "frozen" and k < prefills):
            kwargs["position_ids"] = reference_positions(step_mask)[:, -new_count:]
        elif case.positions == "full":
            kwargs["position_ids"] = reference_positions(step_mask)
        elif case.positions == "stale":
            kwargs["position_ids"] = prompt_positions
        elif case.positions == "frozen":
            kwargs["position_ids"] = prompt_positions[:, -1:]
        if cache is not None:
            if case.cache == "legacy":
                cache = legacy(cache)
            elif case.cache == "object" and isinstance(cache, tuple):
                cache = _caches.from_legacy(cache, model.config)
            kwargs[keyword] = cache
        before = snapshot(cache) if k == watch and cache is not None else None
        try:
            out = model(**kwargs)
        except neofix.NeofixError as exc:
            unchanged = before is None or _same(before, snapshot(cache))
            return torch.cat(tokens, dim=-1) if tokens else None, exc, k, unchanged
        cache = output_cache(out)
        if k >= prefills - 1:
            next_tokens = out.logits[:, -1:].argmax(-1)
            tokens.append(next_tokens)
    return torch.cat(tokens, dim=-1), None, None, True


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or (torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])))
        for x, y in zip(a, b)
    )


def _loop(*fields: Any) -> LoopCase:
    return LoopCase(*fields)


# every outcome class at least once, whatever the profile draws
@example(case=_loop("short", ((0, 5), (1, 3)), 6, 0, (), 5, "synced", "none", "native", "repair", False))  # too long
@example(case=_loop("main", ((0, 4), (1, 2)), 5, 1, (), 4, "synced", "stale", "legacy", "repair", False))  # re-derived
@example(case=_loop("main", ((2, 3), (3, 6)), 6, 95, (2,), 4, "synced", "frozen", "native", "repair", True))  # values
@example(case=_loop("main", ((2, 3), (3, 6)), 6, 0, (), 4, "synced", "frozen", "object", "strict", True))  # values
@example(case=_loop("main", ((2, 3), (3, 6)), 6, 0, (), 4, "synced", "frozen", "native", "repair", False))  # on device
@example(case=_loop("main", ((4, 4), (5, 1)), 4, 0, (), 4, "stale", "correct", "legacy", "repair", False))  # extended
@example(case=_loop("main", ((4, 4), (5, 1)), 4, 0, (1, 3), 3, "stale", "none", "native", "repair", False))  # longer
@example(case=_loop("main", ((0, 5),), 5, 0, (2,), 3, "synced", "full", "native", "strict", False))  # strict
@example(case=_loop("main", ((0, 3), (1, 3)), 3, 0, (1,), 4, "none", "stale", "native", "repair", True))  # no mask
@example(case=_loop(
    "main", ((0, 6), (1, 2), (2, 4), (3, 1)), 8, 1, (2, 5), 5, "synced", "correct", "object", "strict", True
))
@PROPERTY
@given(case=loop_cases())
def test_hand_written_loops(models, references, case):
    if case.cache == "object" and not has("Cache objects"):  # an explicit example, on transformers < 4.36
        case = case._replace(cache="legacy")
    model = models[case.model]
    expected = contract(case, model.config.max_position_embeddings)
    note(f"expected: {expected}")
    event(f"outcome: {expected.error.__name__ if expected.error else 'reference tokens'}")
    for field in ("model", "mask", "positions", "cache", "mode", "check_values", "steps", "width"):
        event(f"{field}={getattr(case, field)}")
    event(f"batch={len(case.rows)} chunks={len(case.chunks)}")
    for kind in sorted(expected.warned):
        event(f"repaired: {kind}")
    ids, mask = prompt_batch(list(case.rows), case.width, case.pad_id)
    neofix.configure(mode=case.mode, check_values=case.check_values)
    _errors.reset_warnings()
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, error, at, unchanged = run_loop(model, case, ids, mask, expected.at)

    if expected.error is None:
        assert error is None, f"unexpected {type(error).__name__}: {error}"
    else:
        assert type(error) is expected.error and at == expected.at, (
            f"expected {expected.error.__name__} at forward {expected.at}, got {type(error).__name__} at {at}: {error}"
        )
        assert unchanged, "the failed step changed the cache it was given"
    assert warning_kinds(caught) == expected.warned

    # every row's tokens, up to the error, are the reference's
    prefills = len(case.chunks) + 1
    stop = min(x for x in (expected.at, len(feeds(case))) if x is not None)
    compared = max(stop - (prefills - 1), 0)
    if compared:
        want = torch.stack([references.row(case.model, base, length, compared) for base, length in case.rows])
        assert torch.equal(tokens[:, :compared], want)


def test_contract_model_examples():
    """Spot checks of :func:`contract` itself, so that the property's oracle is not wrong in the same way."""
    base = LoopCase("main", ((0, 4), (1, 2)), 4, 0, (), 3, "synced", "none", "native", "repair", False)
    assert contract(base, 64) == Expected(None, None, frozenset({"derived"}))  # row 1 is left-padded
    unpadded = base._replace(rows=((0, 4), (1, 4)))
    assert contract(unpadded, 64) == Expected(None, None, frozenset())
    assert contract(base._replace(mask="stale"), 64) == Expected(None, None, frozenset({"mask", "derived"}))
    assert contract(base._replace(mask="stale", mode="strict"), 64).at == 1
    longer = Expected(neofix.MaskLengthError, 0, frozenset())
    assert contract(base._replace(mask="stale", chunks=(2,)), 64) == longer
    one = base._replace(rows=((0, 1),), width=1)
    # a one-token prompt's mask never extended: as wide as the new token, but all ones, so both readings agree
    assert contract(one._replace(mask="stale"), 64) == Expected(None, None, frozenset({"mask"}))
    unpadded_longer = base._replace(rows=((0, 4), (1, 4)), mask="stale", chunks=(2,))  # all ones: sliced, silently
    assert contract(unpadded_longer, 64) == Expected(None, None, frozenset({"mask"}))
    assert contract(base._replace(positions="stale"), 64).warned == {"positions"}
    assert contract(base._replace(positions="full"), 64).warned == frozenset()
    assert contract(base._replace(positions="frozen"), 64).warned == {"values"}
    assert contract(base._replace(positions="frozen", mode="strict"), 64) == Expected(
        neofix.PositionError, 1, frozenset()
    )
    assert contract(base._replace(steps=5), 7) == Expected(neofix.SequenceTooLongError, 4, frozenset({"derived"}))
    assert contract(one._replace(positions="stale"), 64).warned == {"values"}  # width 1: right length, wrong values
    chunked = base._replace(chunks=(2,))  # row 1's padding ends at column 2: not within the first chunk
    assert contract(chunked, 64).warned == frozenset()


# -- generate --------------------------------------------------------------------------------------------------------


class GenerateCase(NamedTuple):
    model: str
    rows: tuple[tuple[int, int], ...]
    width: int
    pad_id: int
    max_new: int
    mode: str
    check_values: bool
    bad: tuple[int, int, int] | None  # (row, column, id) put into the prompt


@st.composite
def generate_cases(draw: Any) -> GenerateCase:
    batch = draw(st.integers(1, 4))
    rows = tuple((draw(st.integers(0, len(BASES) - 1)), draw(st.integers(1, MAX_PROMPT))) for _ in range(batch))
    width = max(length for _, length in rows) + draw(st.integers(0, MAX_PAD))
    bad = None
    if draw(st.integers(0, 5)) == 0:
        where = (draw(st.integers(0, batch - 1)), draw(st.integers(0, width - 1)))
        bad = (*where, draw(st.sampled_from([-1, VOCAB, 1000])))
    return GenerateCase(
        model=draw(st.sampled_from(["main", "main", "short"])),
        rows=rows,
        width=width,
        pad_id=draw(st.sampled_from([0, 1, VOCAB - 1])),
        max_new=draw(st.integers(1, MAX_STEPS)),
        mode=draw(st.sampled_from(["repair", "strict"])),
        check_values=draw(st.booleans()),
        bad=bad,
    )


def with_eos(tokens: list[torch.Tensor], max_new: int, pad_id: int) -> torch.Tensor:
    """What greedy ``generate`` returns for these reference rows: a row ends after EOS (then pads), and generation
    stops once every row has ended."""
    ends = []
    for row in tokens:
        hits = (row[:max_new] == EOS).nonzero()
        ends.append(int(hits[0]) + 1 if len(hits) else max_new)
    length = max(ends)
    out = torch.full((len(tokens), length), pad_id, dtype=torch.long)
    for index, (row, end) in enumerate(zip(tokens, ends)):
        out[index, :end] = row[:end]
    return out


@example(case=GenerateCase("short", ((0, 5), (1, 2)), 6, 0, 3, "repair", False, None))  # too long
@example(case=GenerateCase("short", ((0, 5), (1, 2)), 8, 0, 3, "repair", False, None))  # the prompt alone
@example(case=GenerateCase("short", ((1, 6),), 6, 0, 3, "repair", False, None))  # EOS before the table's end
@example(case=GenerateCase("main", ((0, 5), (1, 2)), 6, 0, 3, "strict", True, (1, 0, VOCAB)))  # id in a pad column
@example(case=GenerateCase("main", ((0, 6), (1, 2), (2, 4), (3, 1)), 7, 1, 5, "strict", True, None))
@PROPERTY
@given(case=generate_cases())
def test_generate(models, references, case):
    model = models[case.model]
    positions = model.config.max_position_embeddings
    ids, mask = prompt_batch(list(case.rows), case.width, case.pad_id)
    if case.bad is not None:
        ids[case.bad[0], case.bad[1]] = case.bad[2]
    neofix.configure(mode=case.mode, check_values=case.check_values)
    _errors.reset_warnings()
    count = [0]
    hook = model.transformer.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
    try:
        with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = model.generate(
                    ids, attention_mask=mask, max_new_tokens=case.max_new, do_sample=False, pad_token_id=case.pad_id
                )
            except neofix.NeofixError as exc:
                out = exc
    finally:
        hook.remove()

    event(f"outcome: {type(out).__name__}")
    needed = tokens_needed(references, case)
    if case.width > positions:  # the prompt alone does not fit: refused before any forward
        assert isinstance(out, neofix.SequenceTooLongError), out
        assert count[0] == 0, "a forward ran before generate refused the prompt"
        assert f"the {case.width}-token prompt alone is longer than that: shorten it" in str(out)
    elif case.bad is not None:
        assert isinstance(out, neofix.TokenIdError), out
        assert f"input_ids[{case.bad[0]}, {case.bad[1]}] is {case.bad[2]}" in str(out)
        assert count[0] == 1  # the prefill: checked before it computed anything
    elif case.width + needed - 1 > positions:  # the last token generated is never fed back
        # generate runs until the step that would pass the table, and raises there, before its compute
        assert isinstance(out, neofix.SequenceTooLongError), out
        assert count[0] == positions - case.width + 2, "the failing step is the one after the table is full"
        fit = positions - case.width + 1
        assert f"at most {fit} new tokens fit after this prompt" in str(out)
    else:
        assert isinstance(out, torch.Tensor), out
        rows = [references.row(case.model, base, length, case.max_new) for base, length in case.rows]
        assert torch.equal(out[:, case.width :], with_eos(rows, case.max_new, case.pad_id))
        assert warning_kinds(caught) == set(), "generate on well-formed input needed a repair"


def tokens_needed(references: References, case: GenerateCase) -> int:
    """How many tokens greedy generate makes for this batch with an unlimited position table: until every row has
    produced EOS, at most ``max_new`` (a number past the table where a row has not ended within it)."""
    needed = 0
    for base, length in case.rows:
        tokens = references.available(case.model, base, length)[: case.max_new]
        hits = (tokens == EOS).nonzero()
        if len(hits):
            needed = max(needed, int(hits[0]) + 1)
        elif tokens.shape[0] < case.max_new:  # the row's reference ends at the table without EOS: it goes past
            return case.max_new + SHORT_POSITIONS
        else:
            needed = max(needed, case.max_new)
    return needed


# -- the pure core ---------------------------------------------------------------------------------------------------

CORE_LIMITS = Limits(max_positions=10, vocab_size=VOCAB, hidden_size=8)


class CoreCase(NamedTuple):
    batch: int
    new: int
    past: int
    cache_batch: int | None
    layers: tuple[int, ...]
    mask_rows: int | None  # None: no mask
    mask_columns: int
    position_rows: int | None  # None: no positions
    position_columns: int
    strict: bool


@st.composite
def core_cases(draw: Any) -> CoreCase:
    """Each kind of fault in about one step in six, so that about a third of the steps are valid."""
    batch = draw(st.integers(1, 4))
    new = draw(choice([1, 2, 3, 4] * 2 + [0]))
    past = draw(st.integers(0, 8))
    total = past + new
    faulty = lambda: draw(choice([False] * 5 + [True]))  # noqa: E731
    layers: tuple[int, ...] = ()
    if past:
        layers = (past, past, past)
        if faulty():
            layers = (past, draw(st.integers(0, 9)), past)
    return CoreCase(
        batch=batch,
        new=new,
        past=past,
        cache_batch=None if not past else (draw(st.integers(1, 5)) if faulty() else batch),
        layers=layers,
        mask_rows=draw(choice([None, batch, batch, batch])) if not faulty() else draw(st.integers(1, 5)),
        mask_columns=draw(st.integers(1, total + 2)) if faulty() else total,
        position_rows=draw(choice([None, batch, 1])) if not faulty() else draw(st.integers(1, 5)),
        position_columns=draw(choice([new, total, new])) if not faulty() else draw(st.integers(1, 12)),
        strict=draw(choice([False, True])),
    )


def core_faults(case: CoreCase) -> set[type]:
    """The error classes the contract requires for this step (any one of them may be raised)."""
    total = case.past + case.new
    faults = set()
    if case.new == 0:
        faults.add(neofix.InputShapeError)
    if case.cache_batch is not None and case.cache_batch != case.batch:
        faults.add(neofix.BatchMismatchError)
    if any(held != case.past for held in case.layers):
        faults.add(neofix.CacheLengthError)
    if total > CORE_LIMITS.max_positions:
        faults.add(neofix.SequenceTooLongError)
    if case.mask_rows is not None:
        # the mask holds a pad (test_align_core puts one at [0, 0]), so two readings of a mask of another width differ
        padded = bool(case.mask_columns) and case.position_rows != 1
        if case.mask_rows != case.batch:
            faults.add(neofix.BatchMismatchError)
        if (case.mask_columns > total and padded) or (case.strict and case.mask_columns < total):
            faults.add(neofix.MaskLengthError)
        ambiguous = case.mask_columns in (case.new, *range(case.past + 1, total))  # the new tokens' own, or part
        if case.past and case.mask_columns < total and ambiguous and padded:
            faults.add(neofix.MaskLengthError)  # extended on the left or on the right: two different masks
    if case.position_rows is not None:
        if case.position_rows not in (1, case.batch):
            faults.add(neofix.BatchMismatchError)
        if case.position_columns != case.new and case.strict:
            faults.add(neofix.PositionError)
    return faults


@example(case=CoreCase(2, 3, 8, 2, (8, 8, 8), 2, 11, None, 0, False))  # too long
@example(case=CoreCase(2, 1, 5, 2, (5, 5, 4), 2, 6, 2, 1, False))  # uneven cache layers
@example(case=CoreCase(2, 1, 5, 2, (5, 5, 5), None, 0, 2, 3, False))  # stale positions, no mask: arange
@PROPERTY
@given(case=core_cases())
def test_align_core(case):
    total = case.past + case.new
    ids = torch.randint(0, VOCAB, (case.batch, case.new), generator=torch.Generator().manual_seed(case.batch))
    mask = None
    if case.mask_rows is not None:
        mask = torch.ones((case.mask_rows, case.mask_columns), dtype=torch.long)
        if case.mask_columns and case.position_rows != 1:
            mask[0, 0] = 0  # a left pad in row 0 (not where one row of positions is given for all rows)
    positions = None
    if case.position_rows is not None:
        # positions of the right values (this property is about shapes): the mask's, or without one the cache's next
        if mask is not None and case.mask_columns <= total:
            extended = torch.cat([mask, mask.new_ones((mask.shape[0], total - case.mask_columns))], -1)
            truth = reference_positions(extended)[:1].expand(case.position_rows, -1)
        else:
            truth = torch.arange(total).repeat(case.position_rows, 1)
        columns = case.position_columns
        positions = truth[:, -columns:] if columns <= total else torch.arange(columns).repeat(case.position_rows, 1)
        if case.position_rows == case.batch and mask is not None and case.mask_columns <= total:
            positions = reference_positions(extended)[:, -columns:] if columns <= total else positions
    faults = core_faults(case)
    view = CacheView(case.past, case.cache_batch, case.layers or None, None, None, None, "legacy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", neofix.NeofixWarning)
        try:
            aligned = align(StepInputs(ids, None, mask, positions), view, CORE_LIMITS, Policy(strict=case.strict))
        except neofix.NeofixError as exc:
            event(f"outcome: {type(exc).__name__}")
            assert type(exc) in faults, f"{type(exc).__name__} ({exc}) raised, the contract says {faults or 'valid'}"
            return
    event(f"outcome: aligned{' (repaired)' if aligned.repairs else ''}")
    assert not faults, f"no error, but the contract requires one of {faults}"
    assert aligned.batch == case.batch and aligned.new_tokens == case.new
    if mask is not None:
        assert tuple(aligned.attention_mask.shape) == (case.batch, total)
        assert torch.equal(aligned.attention_mask[:, : min(case.mask_columns, total)], mask[:, :total])
        expected = reference_positions(aligned.attention_mask)[:, -case.new :]
        if positions is None or case.position_columns not in (case.new, total):  # derived from the mask
            if aligned.position_ids is None:  # left to transformers: only where its arange is the mask's already
                assert torch.equal(expected, torch.arange(case.past, total).expand_as(expected))
            else:
                assert torch.equal(aligned.position_ids, expected)
    elif positions is not None and case.position_columns not in (case.new, total):  # no mask: all tokens real
        assert torch.equal(aligned.position_ids, torch.arange(case.past, total)[None])
    if positions is not None and case.position_columns in (case.new, total):
        assert torch.equal(aligned.position_ids, positions[:, -case.new :].expand_as(aligned.position_ids))
    if aligned.position_ids is not None:
        assert aligned.position_ids.shape[-1] == case.new


@PROPERTY
@given(case=core_cases(), kind=st.sampled_from([Positions.ROTARY, Positions.MASK, Positions.NONE]))
def test_families_that_make_their_own_positions_get_none(case, kind):
    """Families whose missing positions are the model's own (rotary, OPT's mask-derived, ALiBi's none): align never
    makes positions for a step given none, and refuses exactly what it refuses for absolute positions."""
    ids = torch.randint(0, VOCAB, (case.batch, case.new), generator=torch.Generator().manual_seed(case.batch))
    mask = None
    if case.mask_rows is not None:
        mask = torch.ones((case.mask_rows, case.mask_columns), dtype=torch.long)
        if case.mask_columns:
            mask[0, 0] = 0  # a left pad in row 0
    view = CacheView(case.past, case.cache_batch, case.layers or None, None, None, None, "legacy")
    outcomes = []
    for positions in (kind, Positions.ABSOLUTE):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", neofix.NeofixWarning)
            try:
                policy = Policy(strict=case.strict, positions=positions)
                outcomes.append(align(StepInputs(ids, None, mask, None), view, CORE_LIMITS, policy))
            except neofix.NeofixError as exc:
                outcomes.append(type(exc))
    own, absolute = outcomes
    event(f"outcome: {own if isinstance(own, type) else 'aligned'}")
    if isinstance(own, type) or isinstance(absolute, type):
        assert own == absolute
    elif own is not None:
        assert own.position_ids is None
