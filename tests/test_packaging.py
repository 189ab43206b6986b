"""The installed distribution says what the code says: its name, its version, and the transformers range it supports.

The distribution is ``transformers-neofix`` (``neofix`` on the package index is an unrelated project); the import
name, the console script and the pytest plugin are ``neofix``.
"""

from __future__ import annotations

import json
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import neofix
from neofix._compat import SUPPORTED_TRANSFORMERS


DISTRIBUTION = "transformers-neofix"


def requirements() -> list[Requirement]:
    return [Requirement(line) for line in metadata.requires(DISTRIBUTION) or []]


def test_the_import_name_neofix_belongs_to_the_distribution_transformers_neofix():
    assert metadata.distribution(DISTRIBUTION).metadata["Name"] == DISTRIBUTION
    owners = metadata.packages_distributions()
    assert set(owners.get("neofix", ())) == {DISTRIBUTION}, f"the import name neofix comes from {owners.get('neofix')}"
    assert set(owners.get("pytest_neofix", ())) == {DISTRIBUTION}, owners.get("pytest_neofix")
    with pytest.raises(metadata.PackageNotFoundError):  # the unrelated project's name
        metadata.distribution("neofix")


def test_entry_points_keep_the_name_neofix():
    points = metadata.distribution(DISTRIBUTION).entry_points
    assert {(e.group, e.name, e.value) for e in points} == {
        ("console_scripts", "neofix", "neofix._cli:main"),
        ("pytest11", "neofix", "pytest_neofix"),
    }


def test_declared_transformers_range_is_the_supported_range():
    declared = [r for r in requirements() if r.name.lower() == "transformers" and r.marker is None]
    assert len(declared) == 1, f"neofix's metadata should require transformers once, it requires: {requirements()}"
    assert declared[0].specifier == SpecifierSet(SUPPORTED_TRANSFORMERS), (
        f"install_requires declares transformers{declared[0].specifier}, "
        f"but neofix._compat.SUPPORTED_TRANSFORMERS is {SUPPORTED_TRANSFORMERS!r}"
    )


def test_metadata_version_is_the_package_version():
    assert metadata.version(DISTRIBUTION) == neofix.__version__


def test_the_tested_neofix_is_the_installed_one():
    """Under tox neofix is installed from its wheel: the tests must import that copy and read its metadata, not
    the checkout's sources or a stale ``neofix.egg-info`` lying in the checkout."""
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    installed = list(metadata.distributions(name=DISTRIBUTION, path=[str(site_packages)]))
    if not installed:
        pytest.skip(f"{DISTRIBUTION} is not installed in {site_packages}")
    direct_url = installed[0].read_text("direct_url.json")
    if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"):
        pytest.skip("editable install: the checkout is the installed package")
    assert Path(neofix.__file__).resolve() == site_packages / "neofix" / "__init__.py", (
        f"the tests import neofix from {neofix.__file__}, not from the installed wheel in {site_packages}"
    )
    found = Path(metadata.distribution(DISTRIBUTION).locate_file("")).resolve()
    assert found == site_packages, f"importlib.metadata reads neofix's metadata from {found}, not {site_packages}"


def test_the_changelog_tells_this_version():
    """Keep a Changelog: Unreleased first, then one dated section per released version, newest first.  The package's
    version is either the newest dated one, or the next release, whose notes are under Unreleased until it is cut."""
    import re

    from packaging.version import Version

    text = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?$", text, re.M)
    assert sections[0] == ("Unreleased", ""), sections[:2]
    released = [Version(version) for version, date in sections[1:]]
    assert all(date for _, date in sections[1:]) and released == sorted(released, reverse=True), sections
    if Version(neofix.__version__) != released[0]:
        assert Version(neofix.__version__) > released[0], (neofix.__version__, released[0])
        unreleased = text.split("## [Unreleased]", 1)[1].split("\n## [", 1)[0]
        assert "\n- " in unreleased, "the next version's notes belong under Unreleased"
