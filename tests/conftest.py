from __future__ import annotations

import pytest

import neofix
from neofix import _errors
from neofix.testing import tiny_gpt_neo

from ._versions import DTYPE


@pytest.fixture(autouse=True)
def _neofix_state():
    """Every test starts patched, in repair mode, with no warning reported yet, and leaves it that way."""
    previous = neofix.configure(mode="repair", check_values=False)
    _errors.reset_warnings()
    neofix.patch()
    yield
    neofix.configure(**previous)
    neofix.patch()


@pytest.fixture
def vanilla():
    """Run the test body on unpatched transformers (``with neofix.unpatched():``)."""
    with neofix.unpatched():
        yield


@pytest.fixture
def strict():
    neofix.configure(mode="strict")


@pytest.fixture(scope="session")
def model():
    """The tiny float64 GPT-Neo every correctness test decodes with (read-only: do not train it)."""
    return tiny_gpt_neo(seed=0, dtype=DTYPE)


# Hypothesis profiles (HYPOTHESIS_PROFILE=ci | dev | thorough; default ci): see tests/_hypothesis.py
from . import _hypothesis  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """``tests/test_family_<name>.py`` runs only where NEOFIX_TEST_FAMILIES selects the family (tox.ini: what runs
    where); unselected, its tests are skipped with the reason."""
    import os

    chosen = os.environ.get("NEOFIX_TEST_FAMILIES", "all").strip()
    if not chosen or chosen == "all":
        return
    wanted = {name.strip() for name in chosen.split(",")}
    for item in items:
        stem = item.path.stem
        if stem.startswith("test_family_") and stem[len("test_family_"):] not in wanted:
            item.add_marker(
                pytest.mark.skip(reason=f"NEOFIX_TEST_FAMILIES={chosen}: this release tests {stem[12:]} elsewhere")
            )
