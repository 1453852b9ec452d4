"""House rules the code itself must keep (CONTRIBUTING.md): no library function over 60 lines."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("partitioner", "cost_models", "passes")
MOST_LINES = 60


def _long_functions() -> list[str]:
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MOST_LINES:
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines})")
    return found


def test_no_library_function_is_longer_than_60_lines() -> None:
    assert _long_functions() == []
