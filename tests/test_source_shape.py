"""The shape issue 36 set for neofix's own code, kept: no function over 60 lines (signature and docstring included),
and the model forward, the one path every forward takes, at most 40."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import neofix

PACKAGE = Path(neofix.__file__).parent


def _functions() -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE.parent).as_posix(), node


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,operator]


def test_no_function_is_longer_than_60_lines():
    assert sum(1 for _ in _functions()) > 300  # (the package was read)
    longer = [f"{path}:{node.lineno} {node.name}: {_lines(node)}" for path, node in _functions() if _lines(node) > 60]
    assert longer == []


def test_the_model_forward_is_at_most_40_lines():
    wrappers = [node for path, node in _functions() if path == "neofix/_wrappers.py"]
    factory = next(node for node in wrappers if node.name == "make_model_forward")
    forward = next(node for node in factory.body if isinstance(node, ast.FunctionDef) and node.name == "forward")
    assert _lines(forward) <= 40
