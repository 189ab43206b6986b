"""Hypothesis profiles for the property tests (tests/test_properties.py).  Imported by tests/conftest.py.

Choose one with ``HYPOTHESIS_PROFILE`` (default ``ci``)::

    python -m pytest tests/test_properties.py                               # ci: 200 examples, derandomized
    HYPOTHESIS_PROFILE=dev python -m pytest tests/test_properties.py        # dev: 25 examples, quick
    HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_properties.py   # thorough: 5000, random, saved failures

``ci`` is reproducible: ``derandomize=True`` draws the same examples on every run and every machine, and no example
database is read or written.  ``thorough`` draws new examples each run and keeps failures in ``.hypothesis/``
(git-ignored) so that the next run replays them first; a failure prints the ``@reproduce_failure`` blob.
Properties run models, so no profile has a deadline.
"""

from __future__ import annotations

import os

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # pragma: no cover - the property tests skip themselves without hypothesis
    settings = None  # type: ignore[assignment]

PROFILE_VARIABLE = "HYPOTHESIS_PROFILE"
DEFAULT_PROFILE = "ci"

if settings is not None:
    _common = dict(
        deadline=None,
        print_blob=True,
        # the autouse neofix-state fixture is function scoped: each property resets neofix per example itself
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    settings.register_profile("ci", max_examples=200, derandomize=True, database=None, **_common)
    settings.register_profile("dev", max_examples=25, derandomize=True, database=None, **_common)
    settings.register_profile("thorough", max_examples=5000, derandomize=False, **_common)
    settings.load_profile(os.environ.get(PROFILE_VARIABLE, DEFAULT_PROFILE))
