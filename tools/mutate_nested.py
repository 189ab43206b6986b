"""Mutation testing of the functions nested in ``neofix/_wrappers.py``'s factories: the wrappers' own bodies.

mutmut 3.8.1 does not mutate nested functions, so the model forward's ``forward`` and the other wrappers' inner
functions get no mutants from it.  This plants mutmut's kinds of fault there, one at a time, in a copy of the package,
and runs the tests against each (README, "Development: mutation testing").  Not a CI step: it takes an hour.

    python tools/mutate_nested.py list
    python tools/mutate_nested.py run [--worker W --workers N] [--only 3,17] [--python PY] [TEST ARGS...]

Operators: comparison flips (== !=, < <=, > >=, is / is not, in / not in), and <-> or, ``not x`` -> ``x``, an int
``n`` -> ``n + 1``, True <-> False, ``return X`` -> ``return None``.  A mutant is killed when the tests fail
(pytest's exit status 1); the copy is made from the checkout this file sits in, and the tests are run once on it
unmutated first (the run stops if they do not pass).
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WRAPPERS = os.path.join(ROOT, "neofix", "_wrappers.py")
DEFAULT_TESTS = [
    "tests/test_contract_regressions.py", "tests/test_wrappers.py", "tests/test_errors.py",
    "tests/test_position_values.py", "tests/test_generate_limits.py", "tests/test_trace.py",
    "tests/test_given_inputs.py", "tests/test_loops.py", "tests/test_modes.py", "tests/test_state.py",
    "tests/test_never_break.py",
    "--deselect=tests/test_position_values.py::test_a_compiled_loop_is_as_correct_as_an_eager_one",
]


FLIP = {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt,
        ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}


def nested_functions(tree):
    for top in tree.body:
        if isinstance(top, ast.FunctionDef):
            for node in ast.walk(top):
                if node is not top and isinstance(node, ast.FunctionDef):
                    yield top.name, node


def sites(tree):
    """(path-to-node, kind) for every mutation site, in a stable order."""
    out = []
    for factory, fn in nested_functions(tree):
        for node in ast.walk(fn):
            if getattr(node, "_skip", False):
                continue
            if isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    if type(op) in FLIP:
                        out.append((node, ("cmp", i), f"{factory}.{fn.name} L{node.lineno} {type(op).__name__}->{FLIP[type(op)].__name__}"))
            elif isinstance(node, ast.BoolOp):
                out.append((node, ("bool",), f"{factory}.{fn.name} L{node.lineno} {type(node.op).__name__} flipped"))
            elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
                out.append((node, ("not",), f"{factory}.{fn.name} L{node.lineno} not removed"))
            elif isinstance(node, ast.Constant) and type(node.value) is int:
                out.append((node, ("int",), f"{factory}.{fn.name} L{node.lineno} {node.value}->{node.value + 1}"))
            elif isinstance(node, ast.Constant) and type(node.value) is bool:
                out.append((node, ("boolconst",), f"{factory}.{fn.name} L{node.lineno} {node.value}->{not node.value}"))
            elif isinstance(node, ast.Return) and node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
                out.append((node, ("return",), f"{factory}.{fn.name} L{node.lineno} return -> return None"))
    return out


def mutated(source, index):
    tree = ast.parse(source)
    node, kind, what = sites(tree)[index]
    parent_map = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
    if kind[0] == "cmp":
        node.ops[kind[1]] = FLIP[type(node.ops[kind[1]])]()
    elif kind[0] == "bool":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind[0] == "not":
        replace(parent_map, node, node.operand)
    elif kind[0] == "int":
        node.value = node.value + 1
    elif kind[0] == "boolconst":
        node.value = not node.value
    elif kind[0] == "return":
        node.value = ast.Constant(None)
    ast.fix_missing_locations(tree)
    return ast.unparse(tree), what


def replace(parent_map, old, new):
    parent = parent_map[old]
    for field, value in ast.iter_fields(parent):
        if value is old:
            setattr(parent, field, new)
            return
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item is old:
                    value[i] = new
                    return
    raise RuntimeError("parent not found")


#: What the tests read from the checkout: copied, with the mutated module, into a temporary folder.
COPIED = ("neofix", "tests", "setup.cfg", "pytest_neofix.py", "README.md", "docs")


def copy_checkout() -> str:
    """A temporary copy of :data:`COPIED` from this checkout (remove it with ``shutil.rmtree``)."""
    copy = tempfile.mkdtemp(prefix="neofix-mutant-")
    for name in COPIED:
        (shutil.copytree if os.path.isdir(os.path.join(ROOT, name)) else shutil.copy)(
            os.path.join(ROOT, name), os.path.join(copy, name)
        )
    return copy


def run_tests(copy: str, python: str, tests: list[str]) -> subprocess.CompletedProcess:
    """``pytest -x`` with ``python``, importing neofix from ``copy`` (its exit status: 1 kills a mutant)."""
    env = {**os.environ, "PYTHONPATH": copy, "HYPOTHESIS_PROFILE": "dev", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not slow", *tests]
    return subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)


def verdict(status: int) -> str:
    return {0: "SURVIVED", 1: "killed  "}.get(status, f"ERROR({status})")


def first_failure(result: subprocess.CompletedProcess) -> str:
    return next((line for line in result.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["list", "run"])
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--python", default=sys.executable, help="the interpreter of the environment to test in")
    parser.add_argument("--only", default="", help="comma-separated mutant numbers (from `list`) to run, e.g. 90,91")
    options, tests = parser.parse_known_args()
    source = open(WRAPPERS).read()
    found = sites(ast.parse(source))
    if options.command == "list":
        for index, (_, _, what) in enumerate(found):
            print(index, what)
        return 0
    copy = copy_checkout()
    tests = tests or DEFAULT_TESTS
    # the unmutated copy first: tests that fail or cannot run (a path that is gone, say) would count every mutant
    baseline = run_tests(copy, options.python, tests)
    if baseline.returncode != 0:
        print(baseline.stdout[-3000:], baseline.stderr[-3000:], sep="\n", file=sys.stderr)
        status = baseline.returncode
        print(f"the tests fail on the unmutated copy (exit status {status}): fix them first", file=sys.stderr)
        shutil.rmtree(copy)
        return 2
    killed = survived = 0
    only = {int(number) for number in options.only.split(",") if number.strip()}
    for index in range(len(found)):
        if (only and index not in only) or index % options.workers != options.worker:
            continue
        mutant, what = mutated(source, index)
        with open(os.path.join(copy, "neofix", "_wrappers.py"), "w") as out:
            out.write(mutant)
        result = run_tests(copy, options.python, tests)
        killed += result.returncode == 1
        survived += result.returncode == 0
        print(verdict(result.returncode), index, what, first_failure(result)[:110], flush=True)
    print(f"{killed} killed, {survived} survived", flush=True)
    shutil.rmtree(copy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
