"""The codebase stays easy to read: no module over 350 lines, no function over 60 (issue 15)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREES = ("mcp_code_exec", "images/python/agent", "tests", "scripts", "bench")
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60


def python_files() -> list[Path]:
    return sorted(path for tree in TREES if (ROOT / tree).is_dir() for path in (ROOT / tree).rglob("*.py"))


def test_no_module_is_over_350_lines() -> None:
    files = python_files()
    assert len(files) > 50  # the walk found the code
    long = {
        str(path.relative_to(ROOT)): n for path in files if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long: dict[str, int] = {}
    for path in python_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = length
    assert long == {}
