"""Size limits that keep the structure readable (docs/architecture.md): no function over 100 lines outside
the kernels (a Triton kernel is one function by necessity), and a slim engine loop."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "hyserve"
MAX_FUNCTION_LINES = 100
MAX_ENGINE_LINES = 350


def test_no_function_over_100_lines_outside_kernels():
    long = []
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(PKG / "kernels"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1  # type: ignore[operator]
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(PKG.parent)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over 100 lines: " + "; ".join(long)


def test_engine_module_stays_slim():
    n = len((PKG / "engine" / "engine.py").read_text().splitlines())
    assert n < MAX_ENGINE_LINES, f"hyserve/engine/engine.py has {n} lines (limit {MAX_ENGINE_LINES})"
