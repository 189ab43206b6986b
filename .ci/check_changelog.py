"""Before a release: the package's version has a dated CHANGELOG section (tox.ini: pkg).

Usage: python .ci/check_changelog.py [SOURCE_DIR] [--tag TAG]

When HEAD carries a release tag (``v*``, e.g. ``v0.3.0``; or the one given with ``--tag``), the tag must name the
package's version (``neofix/_version.py``, read without importing neofix) and CHANGELOG.md must hold its dated
section, ``## [0.3.0] - YYYY-MM-DD``.  Any other commit passes with one line saying so: between releases the next
version's notes live under ``## [Unreleased]`` (tests/test_packaging.py checks that layout on every run).
Outside a git checkout (an sdist), and without git, there is no tag to read: it passes, saying so.
Exit status: 0 ok, 1 a release tag without its dated section (or naming another version), 2 usage.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

SECTION = re.compile(r"^## \[(?P<version>[^\]]+)\] - (?P<date>\d{4}-\d{2}-\d{2})\s*$", re.M)
VERSION = re.compile(r"""^__version__\s*=\s*["']([^"']+)["']""", re.M)


def package_version(source: Path) -> str:
    found = VERSION.search((source / "neofix" / "_version.py").read_text(encoding="utf-8"))
    if found is None:
        raise SystemExit("check_changelog: ERROR: no __version__ = '...' in neofix/_version.py")
    return found.group(1)


def release_tags(source: Path) -> list[str] | None:
    """The ``v*`` tags on HEAD, or None when they cannot be read (no git, not a checkout)."""
    git = shutil.which("git")
    if git is None:
        return None
    done = subprocess.run(
        [git, "-C", str(source), "tag", "--points-at", "HEAD", "--list", "v*"], capture_output=True, text=True
    )
    if done.returncode:
        return None
    return sorted(tag for tag in done.stdout.split() if re.fullmatch(r"v\d[\w.+-]*", tag))


def check(source: Path, tags: list[str] | None) -> int:
    version = package_version(source)
    if tags is None:
        print(f"check_changelog: {source} is not a git checkout (or git is missing): no release tag to check")
        return 0
    if not tags:
        print(f"check_changelog: HEAD has no release tag (v*): version {version} needs no dated section yet")
        return 0
    failures = [f"tag {tag} names another version than the package's {version}" for tag in tags
                if tag != f"v{version}"]
    changelog = (source / "CHANGELOG.md").read_text(encoding="utf-8")
    dated = {match["version"]: match["date"] for match in SECTION.finditer(changelog)}
    if version not in dated:
        failures.append(
            f"CHANGELOG.md has no dated section for {version}: rename '## [Unreleased]' to "
            f"'## [{version}] - YYYY-MM-DD' (and start a new empty Unreleased above it) before tagging"
        )
    for failure in failures:
        print(f"check_changelog: ERROR: {failure}", file=sys.stderr)
    if failures:
        return 1
    print(f"check_changelog: {', '.join(tags)}: CHANGELOG.md has '## [{version}] - {dated[version]}'")
    return 0


def main(argv: list[str]) -> int:
    args, tags = list(argv), None
    if "--tag" in args:
        at = args.index("--tag")
        if at + 1 >= len(args):
            print(__doc__.strip().splitlines()[2], file=sys.stderr)
            return 2
        tags = [args[at + 1]]
        del args[at : at + 2]
    if len(args) > 1 or any(a.startswith("-") for a in args):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    source = Path(args[0] if args else Path(__file__).resolve().parents[1])
    return check(source, tags if tags is not None else release_tags(source))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
