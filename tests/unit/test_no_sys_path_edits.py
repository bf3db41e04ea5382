"""No file under tests/, benchmarks/ or scripts/ edits sys.path: the repository root is on the path by
configuration (pytest's `pythonpath` in pyproject.toml; `python -m benchmarks.x` from the root), so `tests`,
`benchmarks` and `scripts` import as packages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("tests", "benchmarks", "scripts")
MUTATORS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__delitem__"}


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def sys_path_edits(source: str) -> list[int]:
    """Line numbers of statements that change sys.path (calls of its mutating methods, assignments to it or
    to an item or slice of it, `from sys import path`, site.addsitedir)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr in MUTATORS and _is_sys_path(f.value):
                lines.append(node.lineno)
            elif f.attr == "addsitedir" and isinstance(f.value, ast.Name) and f.value.id == "site":
                lines.append(node.lineno)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for t in targets:
                if _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)):
                    lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            if any(a.name == "path" for a in node.names):
                lines.append(node.lineno)
    return sorted(lines)


def test_the_checker_sees_each_form() -> None:
    src = (
        "import sys, site\n"
        "sys.path.insert(0, 'x')\n"
        "sys.path.append('x')\n"
        "sys.path[:0] = ['x']\n"
        "sys.path += ['x']\n"
        "sys.path = ['x']\n"
        "site.addsitedir('x')\n"
        "from sys import path\n"
        "print(sys.path)\n"
        "'x' in sys.path\n"
    )
    assert sys_path_edits(src) == [2, 3, 4, 5, 6, 7, 8]


def test_no_file_edits_sys_path() -> None:
    bad = []
    for top in CHECKED:
        for f in sorted((ROOT / top).rglob("*.py")):
            for line in sys_path_edits(f.read_text()):
                bad.append(f"{f.relative_to(ROOT)}:{line}")
    assert not bad, "sys.path edited (import by package name instead):\n  " + "\n  ".join(bad)
