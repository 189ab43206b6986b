"""The installed distribution says what the code says: its version, and the transformers range it supports."""

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


def requirements() -> list[Requirement]:
    return [Requirement(line) for line in metadata.requires("neofix") or []]


def test_declared_transformers_range_is_the_supported_range():
    declared = [r for r in requirements() if r.name.lower() == "transformers" and r.marker is None]
    assert len(declared) == 1, f"neofix's metadata should require transformers once, it requires: {requirements()}"
    assert declared[0].specifier == SpecifierSet(SUPPORTED_TRANSFORMERS), (
        f"install_requires declares transformers{declared[0].specifier}, "
        f"but neofix._compat.SUPPORTED_TRANSFORMERS is {SUPPORTED_TRANSFORMERS!r}"
    )


def test_metadata_version_is_the_package_version():
    assert metadata.version("neofix") == neofix.__version__


def test_the_tested_neofix_is_the_installed_one():
    """Under tox neofix is installed from its wheel: the tests must import that copy and read its metadata, not
    the checkout's sources or a stale ``neofix.egg-info`` lying in the checkout."""
    site_packages = Path(sysconfig.get_paths()["purelib"]).resolve()
    installed = list(metadata.distributions(name="neofix", path=[str(site_packages)]))
    if not installed:
        pytest.skip(f"neofix is not installed in {site_packages}")
    direct_url = installed[0].read_text("direct_url.json")
    if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"):
        pytest.skip("editable install: the checkout is the installed package")
    assert Path(neofix.__file__).resolve() == site_packages / "neofix" / "__init__.py", (
        f"the tests import neofix from {neofix.__file__}, not from the installed wheel in {site_packages}"
    )
    found = Path(metadata.distribution("neofix").locate_file("")).resolve()
    assert found == site_packages, f"importlib.metadata reads neofix's metadata from {found}, not {site_packages}"
