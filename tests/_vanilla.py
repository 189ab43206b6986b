"""What unpatched transformers does with each invalid input, per release: the one table of vanilla expectations.

Tests that show what neofix changes first pin what vanilla transformers does, precisely: the exception class and a
fragment of its message, or :data:`WRONG` (it runs and produces other tokens than the well-formed call), or
:data:`ACCEPTED` (it runs without an error), or :data:`CORRECT` (it runs and gets it right).  Anything else fails
the test, a leaked ``NeofixError`` included.  Warnings are not part of the outcome (transformers' own deprecation
warnings come and go between releases).

Every entry was measured (tiny random GPT-Neo in float32, torch 2.13 CPU, unpatched) on each release of
:data:`MEASURED`: those of the tox matrix, and 4.54.  An entry maps ranges of measured releases (``"4.26-4.30"``,
``"4.36"``) to the outcome; together its ranges cover every measured release once.  A release outside the measured
ones (a patch release in between, or one newer than the newest) uses the outcome of the nearest measured release
(ties go to the older one): when such a release disagrees, measure it and add it here, and to the matrix where it
begins an era of its own.  4.54 is such a release: it begins the era of 4.55 (tuple caches refused by name), which the
tie would send to 4.53; it is measured by hand (the whole suite, this table included, passes on 4.54.1) and not run
in CI.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Union

from ._versions import TF_RELEASE

#: The transformers releases where every entry below was measured: the tox matrix's (tox.ini), and 4.54 (see above).
MEASURED = (
    (4, 26), (4, 30), (4, 36), (4, 40), (4, 45), (4, 48), (4, 53), (4, 54), (4, 55), (4, 57), (5, 0), (5, 10), (5, 25)
)


class Raises(NamedTuple):
    """Vanilla raises exactly ``error`` (not a subclass), with ``fragment`` in its message."""

    error: type
    fragment: str

    def __str__(self) -> str:
        return f"{self.error.__name__} containing {self.fragment!r}"


class Silent(NamedTuple):
    what: str

    def __str__(self) -> str:
        return self.what


#: Vanilla runs the call and returns other tokens than the well-formed call does.
WRONG = Silent("silently wrong tokens")
#: Vanilla runs the call without an error (its output is not judged: the input has no one meaning).
ACCEPTED = Silent("silently accepted")
#: Vanilla runs the call and returns the right tokens.
CORRECT = Silent("correct tokens")

Outcome = Union[Raises, Silent]


def size(a: int, b: int, dim: int) -> Raises:
    """torch's broadcasting RuntimeError."""
    return Raises(RuntimeError, f"The size of tensor a ({a}) must match the size of tensor b ({b}) at non-singleton "
                                f"dimension {dim}")


OUT_OF_RANGE = Raises(IndexError, "index out of range in self")  # an embedding lookup past its table
ALL = "4.26-5.25"
#: 4.26 - 4.30 build the attention mask from a batch size they want above 0 (a prefill's too)
BATCH_SIZE = Raises(ValueError, "batch_size has to be defined and > 0")
UNPACK = Raises(ValueError, "too many values to unpack (expected 2)")  # 4.36's 4D-mask helper
TUPLE_CACHE = Raises(AttributeError, "'tuple' object has no attribute 'get_seq_length'")  # 4.57 on: tuples rejected
TUPLE_CACHE_REFUSED = Raises(ValueError, "should be either a `Cache` object or `None`")  # 4.54 - 4.55: by name
RESHAPE_EMPTY_4 = Raises(RuntimeError, "cannot reshape tensor of 0 elements into shape [-1, 0] because")
RESHAPE_EMPTY_5 = Raises(RuntimeError, "cannot reshape tensor of 0 elements into shape [-1, 0, 32] because")
INDICES_NOT_INTEGER = Raises(
    RuntimeError, "Expected tensor for argument #1 'indices' to have one of the following scalar types: Long, Int"
)

#: case -> {range of measured releases: outcome}.  Case names are those of tests/test_errors.py's CASES, plus the
#: hand-written loops named below.
VANILLA: dict[str, dict[str, Outcome]] = {
    # token ids and positions outside their tables
    "id >= vocab, prefill": {ALL: OUT_OF_RANGE},
    "id < 0, prefill without mask": {ALL: OUT_OF_RANGE},
    "id >= vocab, chunked prefill": {ALL: OUT_OF_RANGE},
    "id >= vocab, decode step (translated IndexError)": {ALL: OUT_OF_RANGE},
    "id < 0, decode step, Cache object": {ALL: OUT_OF_RANGE},
    "id = vocab, decode step, check_values=True": {ALL: OUT_OF_RANGE},
    "token_type_ids >= vocab": {ALL: OUT_OF_RANGE},
    "id >= vocab, generate": {ALL: OUT_OF_RANGE},
    "position >= max_position_embeddings, prefill": {ALL: OUT_OF_RANGE},
    "position < 0 of a masked token, decode step (translated IndexError)": {ALL: OUT_OF_RANGE},
    # batch mismatches
    "mask batch 3 != input batch 2, prefill": {
        "4.26-4.30": Raises(RuntimeError, "shape '[2, -1]' is invalid for input of size 15"),
        "4.36-5.0": size(2, 3, 0),
        "5.10-5.25": ACCEPTED,  # uses the mask's first rows
    },
    "mask batch 1 != input batch 2, decode step": {
        "4.26-4.30": size(6, 3, 3),
        "4.36-5.0": ACCEPTED,  # broadcasts the one row
        "5.10-5.25": Raises(IndexError, "index 1 is out of bounds for dimension 0 with size 1"),
    },
    "4D mask batch 3 != input batch 2": {
        "4.26-4.30": size(6, 9, 3),
        "4.36": UNPACK,
        "4.40": Raises(ValueError, "Incorrect 4D attention_mask shape: (3, 1, 1, 6); expected: (2, 1, 1, 6)"),
        "4.45-5.25": size(2, 3, 0),
    },
    "position_ids batch 3 != input batch 2": {ALL: size(2, 3, 0)},
    "cache batch 3 != input batch 2": {
        ALL: Raises(RuntimeError, "Sizes of tensors must match except in dimension 2. Expected size 3 but got size 2"),
    },
    # masks longer than cache + input, wrong 3D / 4D masks
    "mask longer than cache + input, decode step": {"4.26-4.40": size(6, 9, 3), "4.45-5.25": ACCEPTED},
    "mask longer than input, prefill": {"4.26-4.30": size(5, 7, 3), "4.36-4.40": size(7, 5, 3), "4.45-5.25": ACCEPTED},
    "prompt mask kept during chunked prefill": {
        "4.26-4.30": size(6, 9, 3),
        "4.36-4.40": size(9, 6, 3),
        "4.45-5.25": ACCEPTED,
    },
    "4D mask with the wrong key length": {
        "4.26-4.30": size(6, 7, 3),
        "4.36": UNPACK,
        "4.40": Raises(ValueError, "Incorrect 4D attention_mask shape: (2, 1, 1, 7); expected: (2, 1, 1, 6)"),
        "4.45-5.0": ACCEPTED,
        "5.10-5.25": size(6, 7, 3),
    },
    "3D mask with the wrong key length": {
        "4.26-4.30": size(6, 4, 3),
        "4.36": UNPACK,
        "4.40": ACCEPTED,
        "4.45-5.0": Raises(RuntimeError, "expand(torch.FloatTensor{[2, 2, 1, 1, 4]}, size=[2, 1, 1, 4])"),
        "5.10-5.25": Raises(IndexError, "index 1 is out of bounds for dimension 1 with size 1"),
    },
    "4D mask with the wrong query length": {
        "4.26-4.30": size(5, 20, 3),
        "4.36": UNPACK,
        "4.40": Raises(ValueError, "Incorrect 4D attention_mask shape: (2, 1, 4, 5); expected: (2, 1, 5, 5)"),
        "4.45-5.25": size(5, 4, 2),
    },
    # cache layers of different lengths
    "cache layer 2 shorter, legacy tuples": {
        "4.26-4.40": size(5, 6, 3),
        "4.45-4.53": ACCEPTED,
        "4.54-4.55": TUPLE_CACHE_REFUSED,
        "4.57-5.25": TUPLE_CACHE,
    },
    "cache layer 3 shorter, Cache object": {
        "4.26-4.40": size(5, 6, 3),
        "4.45-5.0": ACCEPTED,
        "5.10-5.25": size(5, 6, 3),
    },
    "cache layer 0 shorter": {ALL: size(6, 5, 3)},
    "cache with fewer layers than the model": {
        "4.26-4.53": ACCEPTED,
        "4.54-4.55": TUPLE_CACHE_REFUSED,
        "4.57-5.25": TUPLE_CACHE,
    },
    # empty steps, wrong embedding widths
    "empty step with a cache": {"4.26-4.40": RESHAPE_EMPTY_4, "4.45-5.25": RESHAPE_EMPTY_5},
    "empty prefill": {
        "4.26-4.30": RESHAPE_EMPTY_4,
        "4.36-4.40": Raises(IndexError, "index is out of bounds for dimension with size 0"),
        "4.45-5.25": RESHAPE_EMPTY_5,
    },
    "inputs_embeds of the wrong width": {ALL: size(31, 32, 2)},
    # sequences past max_position_embeddings
    "prefill longer than max_position_embeddings": {ALL: OUT_OF_RANGE},
    "decode step past max_position_embeddings": {ALL: OUT_OF_RANGE},
    "chunk crossing max_position_embeddings": {ALL: OUT_OF_RANGE},
    # what strict mode refuses and repair mode repairs
    "strict: mask not extended": {"4.26-5.0": size(6, 5, 3), "5.10-5.25": WRONG},
    "strict: full-length position_ids": {"4.26-4.30": size(2, 12, 0), "4.36-5.25": size(11, 6, 3)},
    "strict: stale prompt position_ids": {"4.26-4.30": size(2, 10, 0), "4.36-5.25": size(10, 6, 3)},
    "strict: a decode step's position disagrees with the mask": {ALL: WRONG},
    "strict: arange positions over a left-padded prefill": {ALL: WRONG},
    "strict: decoding from a right-padded prompt": {ALL: ACCEPTED},
    # values of the wrong kind, masks that do not say which tokens are real, caches of other models
    "float position_ids": {ALL: INDICES_NOT_INTEGER},
    "float input_ids": {ALL: INDICES_NOT_INTEGER},
    # 4.45 on read the mask as "nonzero = real" (right for 2, inverted for an additive mask); before, 2 is garbage
    "mask values other than 0 and 1": {"4.26-4.40": WRONG, "4.45-5.25": CORRECT},
    "additive mask (0 and -inf) passed as the padding mask": {ALL: ACCEPTED},
    "the chunk's own mask after a cache": {
        "4.26-4.30": size(6, 2, 3),
        "4.36-4.40": size(2, 6, 3),
        "4.45-5.0": size(6, 2, 3),
        "5.10-5.25": ACCEPTED,
    },
    "mask covering some of the new tokens": {
        "4.26-4.30": size(7, 5, 3),
        "4.36-4.40": size(5, 7, 3),
        "4.45-5.0": size(7, 5, 3),
        "5.10-5.25": ACCEPTED,
    },
    "cache of a model with other heads": {
        ALL: Raises(RuntimeError, "Sizes of tensors must match except in dimension 2. Expected size 2 but got size 4")
    },
    "generate with a prompt of 0 tokens": {
        "4.26-4.40": Raises(IndexError, "index -1 is out of bounds for dimension 1 with size 0"),
        "4.45": RESHAPE_EMPTY_5,
        "4.48-5.0": Raises(IndexError, "index -1 is out of bounds for dimension 0 with size 0"),
        "5.10-5.25": RESHAPE_EMPTY_5,
    },
    # hand-written loops (tests/test_state.py): left-padded [6, 3, 5], the prompt's mask passed at every step
    "loop keeping the prompt mask": {"4.26-5.0": size(7, 6, 3), "5.10-5.25": WRONG},
    # generate(full sequence, cache of a prefix) (tests/test_generate.py): up to 4.35 only the last token is fed
    "generate continuing a cache, 1 uncached token": {ALL: CORRECT},
    "generate continuing a cache, 3 uncached tokens": {"4.26-4.30": size(4, 6, 3), "4.36-5.25": CORRECT},
    # a batch of no rows (tests/test_never_break.py), on both read paths; CORRECT: the logits of no rows
    "ids of no rows": {ALL: CORRECT},
    "ids and mask of no rows": {"4.26-4.30": BATCH_SIZE, "4.36-5.25": CORRECT},
    "ids, mask and positions of no rows": {"4.26-4.30": BATCH_SIZE, "4.36-5.25": CORRECT},
    # with the chunk's positions or without: 5.10 on count 0 tokens for a cache layer of no rows (its keys' numel()),
    # build the chunk's mask for its 2 new tokens alone, and add it to the scores of the 3 cached and 2 new keys
    "a chunk of no rows after a prefill of no rows": {
        "4.26-4.30": BATCH_SIZE,
        "4.36-5.0": CORRECT,
        "5.10-5.25": size(5, 2, 3),
    },
}


def _release(text: str) -> tuple[int, int]:
    major, minor = text.split(".")
    return int(major), int(minor)


def _span(key: str) -> tuple[tuple[int, int], tuple[int, int]]:
    first, _, last = key.partition("-")
    return _release(first), _release(last or first)


def nearest_measured(release: tuple[int, int]) -> tuple[int, int]:
    """The measured release nearest to ``release`` (by major, then minor version; a tie goes to the older one)."""

    def rank(measured: tuple[int, int]) -> tuple[int, tuple[int, int]]:
        return abs((measured[0] - release[0]) * 1000 + measured[1] - release[1]), measured

    return min(MEASURED, key=rank)


def expected(case: str, release: tuple[int, int] = TF_RELEASE) -> Outcome:
    """What vanilla transformers ``release`` (default: the installed one) does on ``case``."""
    at = nearest_measured(release)
    for key, outcome in VANILLA[case].items():
        first, last = _span(key)
        if first <= at <= last:
            return outcome
    raise AssertionError(f"tests/_vanilla.py: {case!r} has no outcome for transformers {at[0]}.{at[1]}")


def table_problems() -> list[str]:
    """Entries whose ranges do not cover every measured release exactly once, in order."""
    problems = []
    for case, outcomes in VANILLA.items():
        covered = []
        for key in outcomes:
            first, last = _span(key)
            if first not in MEASURED or last not in MEASURED or last < first:
                problems.append(f"{case!r}: {key!r} does not span measured releases")
                continue
            covered += [release for release in MEASURED if first <= release <= last]
        if covered != list(MEASURED):
            problems.append(f"{case!r}: its ranges cover {covered}, not each of {list(MEASURED)} once, in order")
    return problems


def assert_vanilla(case: str, run: Callable[[], Any], wrong: Callable[[Any], bool] | None = None) -> None:
    """Run ``run()`` on unpatched transformers and assert the outcome the table records for ``case``.

    ``wrong(result)`` says whether a run that returned ``result`` produced other tokens than the well-formed call
    (needed where the table says :data:`WRONG` or :data:`CORRECT`).
    """
    import neofix

    assert not neofix.is_patched(), "assert_vanilla runs on unpatched transformers (the `vanilla` fixture)"
    outcome = expected(case)
    where = f"vanilla transformers {'.'.join(map(str, TF_RELEASE))} on {case!r}: expected {outcome}"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers' own deprecation warnings are not the outcome
            result = run()
    except Exception as exc:  # noqa: BLE001 - the exception is what is compared
        assert isinstance(outcome, Raises), f"{where}, got {type(exc).__name__}: {exc}"
        assert type(exc) is outcome.error and outcome.fragment in str(exc), f"{where}, got {type(exc).__name__}: {exc}"
        return
    assert isinstance(outcome, Silent), f"{where}, but it ran"
    if outcome in (WRONG, CORRECT):
        assert wrong is not None, f"{case!r}: the test must say how to tell wrong tokens"
        got = "the well-formed call's tokens" if outcome is WRONG else "other tokens than the well-formed call"
        assert wrong(result) == (outcome is WRONG), f"{where}, but it returned {got}"
