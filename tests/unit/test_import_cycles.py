"""No import cycles among hyserve's modules (beside test_layering.py, which keeps imports pointing downwards).

Only imports that run when a module is imported count: module-level statements, also inside module-level
`if` / `try` / `with` blocks and class bodies. Imports inside functions do not (they run later, when the
cycle is no longer half-initialised). Imports under `if TYPE_CHECKING:` do not run, but a type-level cycle
still ties two modules together, so a second check counts them too. An import names the module it loads:
`import a.b`, `from a.b import c` (a.b.c when that is a module, else a.b), relative imports resolved.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

PKG_ROOT = Path(__file__).resolve().parents[2] / "hyserve"


def module_names(pkg_root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory."""
    names = {}
    for f in sorted(pkg_root.rglob("*.py")):
        parts = (pkg_root.name, *f.relative_to(pkg_root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = f
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_time_imports(body: list[ast.stmt], typing_too: bool = False):
    """The import statements in `body` that run when the module is imported (`typing_too`: and those under
    `if TYPE_CHECKING:`)."""
    for node in body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if typing_too or not _is_type_checking(node.test):
                yield from _import_time_imports(node.body, typing_too)
            yield from _import_time_imports(node.orelse, typing_too)
        elif isinstance(node, ast.Try | ast.TryStar):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _import_time_imports(block, typing_too)
        elif isinstance(node, ast.With | ast.AsyncWith | ast.For | ast.AsyncFor | ast.While):
            yield from _import_time_imports(node.body, typing_too)
            yield from _import_time_imports(getattr(node, "orelse", []), typing_too)
        elif isinstance(node, ast.ClassDef):
            yield from _import_time_imports(node.body, typing_too)
        # FunctionDef / AsyncFunctionDef / Lambda bodies run later: not import-time edges


def import_edges(modules: dict[str, Path], typing_too: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module inside the package: line of the first such import}."""
    top = next(iter(modules)).split(".")[0]
    edges: dict[str, dict[str, int]] = {m: {} for m in modules}
    for mod, path in modules.items():
        is_pkg = path.name == "__init__.py"
        for node in _import_time_imports(ast.parse(path.read_text(), str(path)).body, typing_too):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package, one level up per extra dot
                    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    pkg = pkg[: len(pkg) - (node.level - 1)]
                    base = ".".join(pkg + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for t in targets:
                # `import a.b.c` of a name that is not a module file: its longest module prefix
                while t and t not in modules and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in modules and t.split(".")[0] == top and t != mod:
                    edges[mod].setdefault(t, node.lineno)
    return edges


def strongly_connected(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (each one holds a cycle), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the package has a few hundred modules at most, so recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_cycle(edges: dict[str, dict[str, int]], start: str, within: set[str]) -> list[str]:
    """A shortest import path start -> ... -> start inside one component (breadth-first)."""
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(edges[v]):
            if w not in within:
                continue
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w not in prev:
                prev[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle inside {sorted(within)}")


def cycles_in(pkg_root: Path, typing_too: bool = False) -> tuple[list[list[str]], str]:
    """(the components holding cycles, a report of each: a shortest cycle through its first module, then
    every import edge inside it with the file and line of the import)."""
    modules = module_names(pkg_root)
    edges = import_edges(modules, typing_too)
    comps = strongly_connected(edges)
    lines = []
    for comp in comps:
        lines.append(
            f"cycle among {len(comp)} modules: " + " -> ".join(shortest_cycle(edges, comp[0], set(comp)))
        )
        for m in comp:
            for t, line in sorted(edges[m].items()):
                if t in comp:
                    lines.append(f"    {modules[m].relative_to(pkg_root.parent)}:{line} imports {t}")
    return comps, "\n".join(lines)


def test_no_import_cycles() -> None:
    assert len(module_names(PKG_ROOT)) > 20
    comps, report = cycles_in(PKG_ROOT)
    assert not comps, "import cycles inside hyserve/ (module-level imports):\n" + report


def test_no_import_cycles_counting_type_checking_imports() -> None:
    """No type-level cycle either: a helper that drives the engine (warm-up, calibration, isolation) takes
    a Protocol or sits above the engine, never imports it from below under TYPE_CHECKING."""
    comps, report = cycles_in(PKG_ROOT, typing_too=True)
    assert not comps, "import cycles inside hyserve/ (TYPE_CHECKING imports counted):\n" + report


def _write(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "pkg"
    for name, text in files.items():
        f = pkg / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return pkg


def test_checker_finds_cycles_and_reports_each(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": "import pkg.sub.c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import thing\n",  # relative, two levels: pkg.a
        "d.py": "try:\n    from pkg.e import x\nexcept ImportError:\n    x = None\n",
        "e.py": "class K:\n    from pkg import d\n",  # a class body runs at import time
    })  # fmt: skip
    comps, report = cycles_in(pkg)
    assert comps == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.d", "pkg.e"]]
    assert "cycle among 3 modules: pkg.a -> pkg.b -> pkg.sub.c -> pkg.a" in report
    assert "pkg/sub/c.py:1 imports pkg.a" in report and "pkg/e.py:2 imports pkg.d" in report


def test_checker_ignores_type_checking_and_function_imports(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg import b\n",
        "b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                 "def f():\n    from pkg.a import g\n    return g\n"),
        "c.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.d\nelse:\n    import os\n",
        "d.py": "import pkg.c\n",
    })  # fmt: skip
    comps, report = cycles_in(pkg)
    assert comps == [] and report == ""
    edges = import_edges(module_names(pkg))
    assert edges["pkg.a"] == {"pkg.b": 1} and edges["pkg.b"] == {} and edges["pkg.d"] == {"pkg.c": 1}
    typed, _ = cycles_in(pkg, typing_too=True)  # the type-level cycles: a <-> b and c <-> d
    assert typed == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
