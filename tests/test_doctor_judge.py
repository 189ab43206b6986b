"""The doctor's judgment rules, cell by cell: what each column of a scenario says (kind and words), what the row
expects, and when it is right; what a failing reference, an error and an over-long message become.

These call the doctor's private judging functions with hand-made outcomes: the rules are the doctor's promise (its
JSON ``kind``, ``text``, ``error_class``, ``message``, ``expected`` and ``right``), whatever the model does.
"""

from __future__ import annotations

import pytest
import torch

import neofix
from neofix._doctor import Cell, Row, _error_cell, _judge, _one_line, _Outcome, _unjudged, shorten_error

TOKENS = torch.tensor([[1, 2, 3]])
OTHER = torch.tensor([[1, 2, 4]])
SHORTER = torch.tensor([[1, 2]])


class _Fake:
    def __init__(self, error=None, strict_error=None, parity=False):
        self.key, self.title = "fake", "fake scenario"
        self.error, self.strict_error, self.parity = error, strict_error, parity

    def expected_error(self, strict):
        return self.strict_error if strict else self.error


CORRECT = Cell("correct", "correct")
WRONG = Cell("wrong_tokens", "wrong tokens, no error")


@pytest.mark.parametrize(
    "scenario, reference, vanilla, cell",
    [
        # valid input: the vanilla tokens against the reference
        (_Fake(), TOKENS, _Outcome(TOKENS, None), CORRECT),
        (_Fake(), TOKENS, _Outcome(OTHER, None), WRONG),
        (_Fake(), TOKENS, _Outcome(SHORTER, None), WRONG),
        (_Fake(parity=True), TOKENS, _Outcome(TOKENS, None), CORRECT),
        # invalid input (neofix must raise) that vanilla takes without a word: with or without the intended tokens
        (_Fake(neofix.MaskLengthError), TOKENS, _Outcome(TOKENS, None),
         Cell("accepted", "accepted, no error (tokens as intended)")),
        (_Fake(neofix.MaskLengthError), TOKENS, _Outcome(OTHER, None),
         Cell("accepted", "accepted, no error (wrong tokens)")),
        (_Fake(neofix.TokenIdError), None, _Outcome(TOKENS, None), Cell("accepted", "accepted, no error")),
        # no reference to compare with (the model extrapolates where another would raise): accepted as well
        (_Fake(), None, _Outcome(TOKENS, None), Cell("accepted", "accepted, no error")),
        # vanilla raised: its error, whatever was expected
        (_Fake(), TOKENS, _Outcome(None, IndexError("index out of range in self\nmore")),
         Cell("error", "IndexError: index out of range in self", "IndexError", "index out of range in self")),
        (_Fake(neofix.TokenIdError), None, _Outcome(None, RuntimeError("boom")),
         Cell("error", "RuntimeError: boom", "RuntimeError", "boom")),
    ],
)
def test_vanilla_column(scenario, reference, vanilla, cell):
    """The vanilla column says what vanilla transformers did: correct, wrong tokens, invalid input accepted (and
    whether its tokens were the intended ones), or its raw error; neofix's outcome does not change it."""
    for with_neofix in (_Outcome(TOKENS, None), _Outcome(None, neofix.TokenIdError("x")), None):
        assert _judge(scenario, reference, vanilla, with_neofix, strict=False).vanilla == cell


@pytest.mark.parametrize(
    "scenario, strict, expected",
    [
        (_Fake(), False, "reference tokens"),
        (_Fake(parity=True), False, "reference tokens, identical to vanilla"),
        (_Fake(neofix.TokenIdError), False, "clear error: TokenIdError"),
        (_Fake(None, neofix.PositionError), True, "clear error: PositionError"),
        (_Fake(None, neofix.PositionError), False, "reference tokens"),
    ],
)
def test_expected_in_words(scenario, strict, expected):
    """What the row expects, as the table's WRONG line and the JSON ``expected`` say it (the mode's expectation)."""
    for with_neofix in (_Outcome(TOKENS, None), None):
        assert _judge(scenario, TOKENS, _Outcome(TOKENS, None), with_neofix, strict).expected == expected


def test_not_patched_row():
    """No neofix column (the patch could not be installed): the whole row, never right."""
    row = _judge(_Fake(parity=True), TOKENS, _Outcome(OTHER, None), None, strict=False)
    assert row == Row("fake", "fake scenario", WRONG, Cell("not_patched", "not patched"),
                      "reference tokens, identical to vanilla", False)
    assert type(row.right) is bool


@pytest.mark.parametrize(
    "scenario, vanilla, fixed, cell, right",
    [
        (_Fake(), _Outcome(TOKENS, None), _Outcome(TOKENS, None), CORRECT, True),
        (_Fake(), _Outcome(OTHER, None), _Outcome(TOKENS, None), Cell("repaired", "repaired"), True),
        (_Fake(), _Outcome(None, RuntimeError("x")), _Outcome(TOKENS, None), Cell("repaired", "repaired"), True),
        (_Fake(), _Outcome(TOKENS, None), _Outcome(OTHER, None), WRONG, False),
        (_Fake(), _Outcome(OTHER, None), _Outcome(SHORTER, None), WRONG, False),
        # generate parity: the reference and vanilla's tokens both
        (_Fake(parity=True), _Outcome(TOKENS, None), _Outcome(TOKENS, None), CORRECT, True),
        (_Fake(parity=True), _Outcome(OTHER, None), _Outcome(TOKENS, None),
         Cell("wrong_tokens", "differs from vanilla"), False),
        (_Fake(parity=True), _Outcome(None, RuntimeError("x")), _Outcome(TOKENS, None),
         Cell("wrong_tokens", "differs from vanilla"), False),
        (_Fake(parity=True), _Outcome(OTHER, None), _Outcome(OTHER, None), WRONG, False),
        # an error was expected
        (_Fake(neofix.MaskLengthError), _Outcome(TOKENS, None), _Outcome(TOKENS, None),
         Cell("accepted", "accepted, no error (tokens as intended)"), False),
        (_Fake(neofix.MaskLengthError), _Outcome(TOKENS, None), _Outcome(OTHER, None),
         Cell("accepted", "accepted, no error (wrong tokens)"), False),
        (_Fake(neofix.MaskLengthError), _Outcome(TOKENS, None), _Outcome(None, neofix.MaskLengthError("too long")),
         Cell("clear_error", "clear error: MaskLengthError", "MaskLengthError", "too long"), True),
    ],
)
def test_neofix_column(scenario, vanilla, fixed, cell, right):
    """The neofix column: correct (vanilla was too), repaired (vanilla was not), wrong tokens (or, for generate,
    tokens that differ from vanilla's), accepted invalid input, or its error; right only when it gave what the
    row expects."""
    row = _judge(scenario, TOKENS, vanilla, fixed, strict=False)
    assert (row.neofix, row.right) == (cell, right)


def test_error_cells():
    """A NeofixError is a clear error; any other exception is the raw error, shortened for the table; both carry
    the class name and the message's whole first line (not cut: the JSON is for bug reports)."""
    first = "position_ids has 6 columns " + "x" * 300
    assert _error_cell(neofix.PositionError(f"{first}\nsecond line")) == Cell(
        "clear_error", "clear error: PositionError", "PositionError", first
    )
    raw = "index 2 is out of bounds for dimension 0 with size 2 " + "y" * 300
    assert _error_cell(IndexError(f"\n  {raw}  \nsecond line")) == Cell(
        "error", shorten_error(IndexError(raw)), "IndexError", raw
    )
    assert shorten_error(IndexError(raw)) == "IndexError: index 2 is out of bounds for dimension 0 with size..."


def test_a_failing_reference_is_unjudged():
    """The full-recompute reference raised: both columns say so (the error cut to 52 characters, its first line to
    200 in the JSON), the row expects a reference, and it is not right."""
    message = "the reference broke " + "z" * 19  # "RuntimeError: " and this: 53 characters, one too many
    row = _unjudged(_FakeScenario(), RuntimeError(f"{message}\ntraceback"))
    cell = Cell("no_reference", "no reference: RuntimeError: the reference broke zzzzzzzzzzzzzzz...", "RuntimeError",
                message)
    assert len(cell.text) == len("no reference: ") + 52
    assert row == Row("probe", "a probe", cell, cell, "a full-recompute reference", False)
    assert type(row.right) is bool
    fits = "the reference broke " + "z" * 18
    assert _unjudged(_FakeScenario(), RuntimeError(fits)).vanilla.text == f"no reference: RuntimeError: {fits}"


class _FakeScenario:
    key, title = "probe", "a probe"


def test_messages_are_cut_at_200_characters():
    """A message's first line, as usage errors and the JSON of a failed reference quote it: whole up to 200
    characters, longer ones cut to 200 ending in '...'."""
    assert _one_line(ValueError("m" * 200)) == "m" * 200
    assert _one_line(ValueError("m" * 201)) == "m" * 197 + "..."
    assert _unjudged(_FakeScenario(), ValueError("m" * 200)).vanilla.message == "m" * 200
    assert _unjudged(_FakeScenario(), ValueError("m" * 201)).vanilla.message == "m" * 197 + "..."
    assert _one_line(ValueError("\n\n  first  \nsecond")) == "first"
    assert _one_line(ValueError("")) == ""


def test_shortened_errors_fit_the_cell():
    """``shorten_error``: whole when it fits the limit (66 by default), else cut, without trailing spaces, to end
    in '...' within it."""
    exact = ValueError("v" * (66 - len("ValueError: ")))
    assert shorten_error(exact) == f"ValueError: {exact}"
    # the cut falls after a space: it is dropped, the text ends "word..."
    spaced = ValueError("w" * 50 + " " + "tail" * 10)  # "ValueError: " (12) + 50: the space is the 63rd, the last kept
    assert shorten_error(spaced) == "ValueError: " + "w" * 50 + "..."


@pytest.mark.parametrize(
    "scenario, vanilla, fixed, right, text",
    [
        (_Fake(), _Outcome(OTHER, None), _Outcome(TOKENS, None), True, "repaired"),
        (_Fake(), _Outcome(TOKENS, None), _Outcome(TOKENS, None), True, "correct"),
        (_Fake(), _Outcome(OTHER, None), _Outcome(OTHER, None), False, "wrong tokens, no error"),
        (_Fake(), _Outcome(OTHER, None), _Outcome(None, neofix.MaskLengthError("x")), False, "clear error: MaskLengthError"),
        (_Fake(neofix.TokenIdError), _Outcome(None, IndexError("index out of range in self")),
         _Outcome(None, neofix.TokenIdError("x")), True, "clear error: TokenIdError"),
        (_Fake(neofix.TokenIdError), _Outcome(None, IndexError("i")), _Outcome(None, neofix.PositionError("x")),
         False, "clear error: PositionError"),
        (_Fake(neofix.TokenIdError), _Outcome(None, IndexError("i")), _Outcome(None, IndexError("index out")),
         False, "IndexError: index out"),
        (_Fake(neofix.TokenIdError), _Outcome(TOKENS, None), _Outcome(TOKENS, None), False,
         "accepted, no error (tokens as intended)"),
        (_Fake(parity=True), _Outcome(OTHER, None), _Outcome(TOKENS, None), False, "differs from vanilla"),
        (_Fake(parity=True), _Outcome(TOKENS, None), _Outcome(TOKENS, None), True, "correct"),
    ],
)
def test_verdicts(scenario, vanilla, fixed, right, text):
    row = _judge(scenario, TOKENS, vanilla, fixed, strict=False)
    assert row.right is right
    assert row.neofix.text == text


def test_strict_verdicts_use_the_strict_expectation():
    scenario = _Fake(error=None, strict_error=neofix.MaskLengthError)
    wrong = _Outcome(OTHER, None)
    assert _judge(scenario, TOKENS, wrong, _Outcome(None, neofix.MaskLengthError("x")), strict=True).right
    assert not _judge(scenario, TOKENS, wrong, _Outcome(TOKENS, None), strict=True).right
    assert not _judge(scenario, TOKENS, wrong, _Outcome(None, neofix.MaskLengthError("x")), strict=False).right
