"""``import neofix`` waits for GPT-Neo's modeling module and hands it to wrapt's post-import hook.

Torch-free: the import runs against a stand-in ``transformers`` package (GPT-Neo's module path and nothing else),
and the hook's target, ``neofix._lifecycle._on_import``, is replaced by a recorder, so these tests check the
Python-version-sensitive part (a ``sys.meta_path`` finder handing over to wrapt's) without torch or transformers.
.ci/check_pythons.py runs this file on every Python that setup.cfg claims (pytest --noconftest);
tests/test_lifecycle.py tests the patch the hook applies, with the real transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("wrapt")  # a dependency of neofix: installed wherever neofix is

GPT_NEO_MODULE = "transformers.models.gpt_neo.modeling_gpt_neo"

# the stand-in transformers, put first on sys.path of the child
FAKE_TRANSFORMERS = {
    "transformers/__init__.py": '__version__ = "5.24.0"\n',
    "transformers/models/__init__.py": "",
    "transformers/models/gpt_neo/__init__.py": "",
    "transformers/models/gpt_neo/modeling_gpt_neo.py": "class GPTNeoModel:\n    pass\n",
}

RECORD_HOOK = """
import json, sys
import neofix
from neofix import _lifecycle

calls = []
_lifecycle._on_import = lambda module: calls.append([module.__name__, hasattr(module, "GPTNeoModel")])

def report(**extra):
    heavy = sorted(m for m in ("torch", "wrapt") if m in sys.modules)
    print(json.dumps({"calls": calls, "loaded": heavy, **extra}))
"""


def run_child(tmp_path, code: str, **env: str) -> dict:
    for name, source in FAKE_TRANSFORMERS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source, encoding="utf-8")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NEOFIX_") and k != "PYTHONPATH"}
    environ.update(PYTHONPATH=str(tmp_path), **env)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RECORD_HOOK) + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=environ,
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_neofix_registers_a_watcher_and_loads_nothing_heavy(tmp_path):
    found = run_child(
        tmp_path,
        """
        watchers = [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("neofix")]
        report(watchers=watchers, transformers="transformers" in sys.modules)
        """,
    )
    assert found["calls"] == [] and found["loaded"] == [] and found["transformers"] is False, found
    assert len(found["watchers"]) == 1, f"neofix should put one finder on sys.meta_path: {found['watchers']}"


def test_the_hook_fires_once_when_gpt_neo_loads_after_neofix(tmp_path):
    found = run_child(
        tmp_path,
        f"""
        import transformers, transformers.models  # not GPT-Neo's module: nothing happens yet
        before = [list(calls), "wrapt" in sys.modules]
        import {GPT_NEO_MODULE}
        import {GPT_NEO_MODULE}  # a second import is a no-op
        report(before=before)
        """,
    )
    # the hook receives the finished module; wrapt is imported only when GPT-Neo's module is looked up
    assert found == {"calls": [[GPT_NEO_MODULE, True]], "loaded": ["wrapt"], "before": [[], False]}


def test_neofix_disable_registers_nothing(tmp_path):
    found = run_child(
        tmp_path,
        f"""
        import {GPT_NEO_MODULE}
        report(watchers=[type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("neofix")])
        """,
        NEOFIX_DISABLE="1",
    )
    assert found == {"calls": [], "loaded": [], "watchers": []}
