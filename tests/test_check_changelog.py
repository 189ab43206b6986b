""".ci/check_changelog.py: a commit tagged as a release must have a dated CHANGELOG section for its version.

Torch-free; each test makes a tiny git repository with a version file and a changelog, tags it or not, and runs
the script as CI does (tox.ini: pkg).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "check_changelog.py"
HEAD = "# Changelog\n\n## [Unreleased]\n\n"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def checkout(folder: Path, version: str, changelog: str, tag: str | None = None) -> Path:
    (folder / "neofix").mkdir()
    (folder / "neofix" / "_version.py").write_text(f'__version__ = "{version}"\n')
    (folder / "CHANGELOG.md").write_text(changelog)
    git = ["git", "-C", str(folder), "-c", "user.name=ci", "-c", "user.email=ci@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "release"], check=True)
    if tag:
        subprocess.run([*git, "tag", tag], check=True)
    return folder


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


def test_an_untagged_commit_passes(tmp_path):
    done = run(checkout(tmp_path, "0.3.0", HEAD + "- something new\n"))
    assert done.returncode == 0, done
    assert "HEAD has no release tag (v*): version 0.3.0 needs no dated section yet" in done.stdout


def test_a_release_tag_with_its_dated_section_passes(tmp_path):
    done = run(checkout(tmp_path, "0.3.0", HEAD + "## [0.3.0] - 2026-12-05\n\n- new\n", tag="v0.3.0"))
    assert done.returncode == 0, done
    assert "v0.3.0: CHANGELOG.md has '## [0.3.0] - 2026-12-05'" in done.stdout


def test_a_release_tag_without_its_dated_section_fails(tmp_path):
    done = run(checkout(tmp_path, "0.3.0", HEAD + "- new\n\n## [0.2.0] - 2026-11-30\n", tag="v0.3.0"))
    assert done.returncode == 1, done
    assert "CHANGELOG.md has no dated section for 0.3.0" in done.stderr


def test_an_undated_section_does_not_count(tmp_path):
    done = run(checkout(tmp_path, "0.3.0", HEAD + "## [0.3.0]\n\n- new\n", tag="v0.3.0"))
    assert done.returncode == 1, done


def test_a_tag_naming_another_version_fails(tmp_path):
    done = run(checkout(tmp_path, "0.3.0", HEAD + "## [0.3.0] - 2026-12-05\n", tag="v0.3.1"))
    assert done.returncode == 1, done
    assert "tag v0.3.1 names another version than the package's 0.3.0" in done.stderr


def test_other_tags_are_not_releases(tmp_path):
    done = run(checkout(tmp_path, "0.3.0", HEAD, tag="nightly"))
    assert done.returncode == 0, done


def test_outside_a_checkout_there_is_nothing_to_check(tmp_path):
    (tmp_path / "neofix").mkdir()
    (tmp_path / "neofix" / "_version.py").write_text('__version__ = "0.3.0"\n')
    (tmp_path / "CHANGELOG.md").write_text(HEAD)
    done = run(tmp_path)
    assert done.returncode == 0, done
    assert "not a git checkout" in done.stdout


def test_the_tag_can_be_given(tmp_path):
    """``--tag`` checks a tag before it is made (what a release script runs first)."""
    (tmp_path / "neofix").mkdir()
    (tmp_path / "neofix" / "_version.py").write_text('__version__ = "0.3.0"\n')
    (tmp_path / "CHANGELOG.md").write_text(HEAD)
    assert run(tmp_path, "--tag", "v0.3.0").returncode == 1
    assert run(tmp_path, "--tag").returncode == 2


def test_this_checkout(tmp_path):
    """The project's own CHANGELOG: its version, if tagged now, would need its dated section, which it has."""
    root = SCRIPT.parents[1]
    version = {}
    exec((root / "neofix" / "_version.py").read_text(), version)  # noqa: S102 - the project's own file
    done = run(root, "--tag", f"v{version['__version__']}")
    assert done.returncode == 0, done
