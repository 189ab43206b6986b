"""Every place that names the families says what ``neofix.FAMILIES`` says (torch-free: reads files and the registry).

The CLI's texts are built from the registry; the module docstring, README, the docs and the plugin's fixture list the
families in prose and tables, checked here, so that adding a family to the registry fails this test until they say
it too."""

from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

import neofix
import pytest_neofix
from neofix._families import _COUNTS, FAMILIES, count_in_words, titles
from neofix.testing import FAMILY_CONFIGS

ROOT = Path(__file__).resolve().parent.parent


def _table_titles(text: str) -> set[str]:
    """The family titles in the first column of the families table ("| Llama (4.28+), Qwen2 (4.37+) | ...")."""
    found = set()
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| family") and not line.startswith("|---"):
            cell = line.split("|")[1]
            found |= {re.sub(r"\s*\(.*?\)\s*", "", name).strip() for name in re.sub(r"\(.*?\)", "", cell).split(",")}
    return {title for title in found if title}


@pytest.mark.parametrize("path", ["README.md", "docs/families.md"])
def test_the_family_tables_have_a_row_for_every_family(path):
    text = (ROOT / path).read_text()
    table = text[text.index("| family |"):]
    table = table[: table.index("\n\n")]
    assert _table_titles(table) == {family.title for family in FAMILIES.values()}
    assert f"patches all {count_in_words()}," in text


@pytest.mark.parametrize("path", ["README.md", "docs/index.md", "docs/families.md", "docs/plugin.md",
                                  "docs/decodestate.md"])
def test_the_docs_count_the_families(path):
    text = " ".join((ROOT / path).read_text().split())
    assert f" {count_in_words()} " in text, path
    for other in set(_COUNTS.values()) - {count_in_words()}:  # a count left behind when a family was added
        assert f"the {other} families" not in text and f"for {other} decoder families" not in text, (path, other)
        assert f"all {other}," not in text and f"of the {other} " not in text, (path, other)


def test_the_package_description_counts_no_families():
    """setup.cfg's one-line description (the package index's summary) names no count that a new family would leave
    stale: it said "fourteen" while neofix patched eighteen."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    description = config["metadata"]["description"]
    assert "GPT-Neo" in description
    assert not any(f" {word} " in f" {description} " for word in _COUNTS.values()), description


def test_the_module_docstring_and_the_docs_name_every_family():
    for text in (neofix.__doc__, (ROOT / "README.md").read_text(), (ROOT / "docs/index.md").read_text()):
        text = " ".join(text.split())
        assert f"for {count_in_words()} decoder families" in text
        for family in FAMILIES.values():
            assert family.title in text, family.title
    names = ", ".join(f"`{name}`" for name in FAMILIES)
    families = " ".join((ROOT / "docs/families.md").read_text().split())
    assert names + "." in families
    doctor = " ".join((ROOT / "docs/doctor.md").read_text().split())
    assert f"runs the full table on that family's tiny model ({names})" in doctor  # --family NAME


def test_the_plugins_fixture_and_the_tiny_models_cover_every_family():
    doc = " ".join(pytest_neofix.tiny_model.__doc__.split())
    assert "(``neofix.FAMILIES``: " + ", ".join(f'"{name}"' for name in FAMILIES) + ")" in doc
    assert set(FAMILY_CONFIGS) == set(FAMILIES)
    assert tuple(neofix.FAMILIES) == tuple(FAMILIES)


def test_every_family_has_its_scenario_module():
    """tests/test_family_<name>.py for every family but the seven of tests/test_families.py's first releases
    (GPT-BigCode, which arrived later, has one for its own cache layouts)."""
    modern = [name for name in FAMILIES if name not in ("gpt_neo", "gpt2", "gptj", "codegen", "gpt_neox", "opt", "bloom")]
    assert modern == [
        "gpt_bigcode", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3", "phi",
        "phi3", "granite", "smollm3", "gpt_oss", "starcoder2",
        "olmo2", "olmo", "cohere", "falcon",
    ]
    for name in modern:
        assert (ROOT / "tests" / f"test_family_{name}.py").exists(), name
    assert titles().endswith(" and Falcon")
