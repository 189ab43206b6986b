"""Run one mutmut mutant in a fresh interpreter, on any transformers release: for the mutants mutmut cannot judge.

mutmut 3.8.1 runs every mutant in a process forked from one that has imported ``neofix`` and run the tests once, and
its tests in one environment.  So it reports as surviving a mutant of code that runs at import (a factory such as
``llama.rotary_limits``, called when its family's module is imported) or whose result is memoised before the fork
(``_contract.for_model``), and a mutant that only another transformers release reaches (legacy tuple caches before
4.54, GPT-BigCode's fused cache up to 4.53).  This takes the mutated function from mutmut's copy (``mutants/``), puts
it in place of the original in a temporary copy of this checkout, and runs the tests given with the interpreter given
(``../shared/tools/tfenv 4.45.2`` prints one for that release)::

    python tools/run_mutant.py --python "$(../shared/tools/tfenv 4.45.2)" \\
        neofix._caches.x__read_legacy__mutmut_19 -- tests/test_errors.py tests/test_state.py

It prints one line, ``NAME killed|SURVIVED|ERROR(status) first failed test``, and exits 0 (1 where the tests could
not run on the mutant: see the output printed).  ``--mutants`` names mutmut's copy (default ``mutants``).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import sys

from mutate_nested import ROOT, copy_checkout, first_failure, run_tests, verdict  # (this script's folder)


def mutated_source(name: str, mutants: str) -> tuple[str, str]:
    """``(path, source)``: the module of mutant ``name`` (``package.module.x_function__mutmut_N``, or
    ``package.module.xǁClassǁmethod__mutmut_N``) with that one function replaced by its mutant."""
    module, mangled = name.rsplit(".", 1)
    inner = mangled[1:].rsplit("__mutmut_", 1)[0]  # "_function" or "ǁClassǁmethod"
    owner, function = inner.split("ǁ")[1:] if "ǁ" in inner else (None, inner[1:])
    path = module.replace(".", os.sep) + ".py"
    with open(os.path.join(mutants, path)) as file:
        mutant_source = file.read()
    mutant = next(n for n in ast.walk(ast.parse(mutant_source)) if isinstance(n, ast.FunctionDef) and n.name == mangled)
    body = "".join(mutant_source.splitlines(keepends=True)[mutant.lineno - 1 : mutant.end_lineno])
    body = body.replace(f"def {mangled}(", f"def {function}(", 1)
    with open(os.path.join(ROOT, path)) as file:
        source = file.read()
    scope = ast.parse(source).body
    if owner is not None:
        scope = next(n for n in scope if isinstance(n, ast.ClassDef) and n.name == owner).body
    original = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == function)
    lines = source.splitlines(keepends=True)
    return path, "".join(lines[: original.lineno - 1]) + body + "".join(lines[original.end_lineno :])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="the mutant, as `mutmut results` names it")
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the environment to test in")
    parser.add_argument("--mutants", default=os.path.join(ROOT, "mutants"), help="mutmut's copy of the tree")
    options, tests = parser.parse_known_args()
    tests = [test for test in tests if test != "--"]
    path, source = mutated_source(options.name, options.mutants)
    copy = copy_checkout()
    try:
        with open(os.path.join(copy, path), "w") as file:
            file.write(source)
        done = run_tests(copy, options.python, tests)
    finally:
        shutil.rmtree(copy)
    print(options.name, verdict(done.returncode).strip(), first_failure(done)[:160], flush=True)
    if done.returncode not in (0, 1):
        print(done.stdout[-2000:], done.stderr[-2000:], sep="\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
