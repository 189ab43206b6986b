"""Every Python block in README.md and in the documentation site's pages (docs/*.md) runs on its own, in a fresh
interpreter, as a reader who copies one block would.

First lines that change how a block is run:
  ``# downloads ORG/NAME from the Hub ...``   skipped (the suite runs offline); a test checks that exactly the
                                              blocks loading a model from the Hub say so
  ``# transformers SPECIFIER: ...``           run only on those releases (e.g. ``>= 5.24``)
  ``# test_NAME.py``                          a test file of the reader's project: run under pytest, with neofix's
                                              pytest plugin
Where a page shows a block's output (a plain fence right after it), the block must print exactly that (its
stdout), or, for a block shown raising, end its traceback with that line.  The outputs were recorded on one
transformers release (``OUTPUTS_RECORDED_ON``, with the CPU torch of .ci/constraints.txt) and are compared there;
other releases build other random weights (4.x) or name the cache keyword differently, so there a block must run,
and a block shown raising may only raise that error.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # the documentation site's pages (mkdocs.yml)
README_MAX_LINES = 300  # issue 37: read in minutes; the rest lives on the site
OUTPUTS_RECORDED_ON = "5.25.0"  # transformers; the pages' outputs were run and pasted on this release
DOWNLOAD = re.compile(r"# downloads (\S+) from the Hub\b")
RELEASES = re.compile(r"# transformers ([<>=!~][^:]*):")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


class Block(NamedTuple):
    page: str  # relative to the repository root
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    output: str | None  # the plain block right after it, if any

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0]


def read_blocks(text: str, page: str = "README.md") -> list[Block]:
    fences, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, language, start = match.group(1), match.group(2), i
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            i += 1
        body = textwrap.dedent("\n".join(lines[start + 1 : i])) + "\n"
        fences.append((start + 1, i + 1, language, body, indent))
        i += 1
    blocks = []
    for index, (start, end, language, body, _) in enumerate(fences):
        if language != "python":
            continue
        output = None
        if index + 1 < len(fences):
            next_start, _, next_language, next_body, _ = fences[index + 1]
            between = lines[end : next_start - 1]
            if next_language == "" and not any(line.strip() for line in between):
                output = next_body
        blocks.append(Block(page, start, language, body, output))
    return blocks


BLOCKS = [
    block
    for page in PAGES
    for block in read_blocks(page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix())
]


def block_id(block: Block) -> str:
    return f"{block.page}:{block.line}"


def transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEOFIX_", "PYTEST_"))}
    env["HF_HUB_OFFLINE"] = "1"  # nothing may come from the Hub
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_pages_have_python_blocks():
    assert len([b for b in BLOCKS if b.page == "README.md"]) >= 2, [block_id(b) for b in BLOCKS]
    assert len(BLOCKS) >= 12, [block_id(b) for b in BLOCKS]
    assert len(PAGES) >= 10, PAGES


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move the details to a page of docs/"


def test_every_page_is_in_the_sites_navigation():
    """mkdocs.yml's nav lists every page of docs/ (mkdocs would build a page left out, but nobody would find it)."""
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8").split("\nnav:", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r":\s*(\S+\.md)\s*$", nav, re.M))
    assert listed == {page.name for page in PAGES if page != README}, listed


def test_exactly_the_blocks_that_load_a_hub_model_say_they_download():
    for block in BLOCKS:
        marker = DOWNLOAD.match(block.first_line)
        hub_names = re.findall(r"from_pretrained\(\s*[\"']([\w.-]+/[\w.-]+)[\"']", block.code)
        if marker:
            assert hub_names == [marker.group(1)], f"{block_id(block)} says it downloads {marker.group(1)}"
        else:
            assert not hub_names, f"{block_id(block)} loads {hub_names} from the Hub: say so in its first line"
        assert not DOWNLOAD.search(block.code.split("\n", 1)[1]), f"{block_id(block)}: the marker goes first"


def test_release_markers_are_specifiers():
    for block in BLOCKS:
        if block.first_line.startswith("# transformers "):
            marker = RELEASES.match(block.first_line)
            assert marker, f"{block_id(block)}: write '# transformers SPECIFIER: why', e.g. '# transformers >= 5.24: '"
            SpecifierSet(marker.group(1).replace(" ", ""))  # raises InvalidSpecifier on a typo


@pytest.mark.slow  # a fresh interpreter per block: torch and transformers are imported once each
@pytest.mark.parametrize("block", BLOCKS, ids=block_id)
def test_block_runs_on_its_own(block: Block, tmp_path):
    if DOWNLOAD.match(block.first_line):
        pytest.skip(f"{block_id(block)} downloads a model from the Hub")
    releases = RELEASES.match(block.first_line)
    if releases and Version(transformers_version()) not in SpecifierSet(releases.group(1).replace(" ", "")):
        pytest.skip(f"{block_id(block)} is for transformers {releases.group(1)}, not {transformers_version()}")
    test_file = re.fullmatch(r"# (test_\w+\.py)", block.first_line)
    if test_file:  # a test file of the user's project: run it the way the user would
        (tmp_path / test_file.group(1)).write_text(block.code, encoding="utf-8")
        done = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file.group(1)], tmp_path)
        assert done.returncode == 0, f"{block_id(block)} fails under pytest:\n{done.stdout}{done.stderr}"
        return
    (tmp_path / "block.py").write_text(block.code, encoding="utf-8")
    done = run([sys.executable, "block.py"], tmp_path)
    raises = re.match(r"([\w.]+(?:Error|Exception)): ", block.output or "")
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    if not raises:
        assert done.returncode == 0, f"{block_id(block)} fails on its own:\n{done.stderr}"
    elif done.returncode:
        assert last.startswith(f"{raises.group(1)}: "), f"{block_id(block)} should raise {raises.group(1)}:\n{last}"
    if block.output is None or transformers_version() != OUTPUTS_RECORDED_ON:
        return
    if raises:
        assert done.returncode != 0 and last == block.output.strip(), (
            f"{block_id(block)} should raise, ending its traceback with the page's line:\n{done.stderr}"
        )
    else:
        assert done.stdout == block.output, (
            f"{block_id(block)} prints something else than the page shows:\n{done.stdout}"
        )
