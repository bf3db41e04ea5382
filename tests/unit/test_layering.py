"""The layer table of docs/architecture.md, enforced: imports inside hyserve only point downwards."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hyserve"

# package -> hyserve packages it may import (besides itself)
ALLOWED = {
    "config": set(),
    "envs": set(),
    "compat": {"config"},
    "hub": {"config", "envs"},
    "kernels": set(),
    "cache": {"config"},
    "distributed": {"config", "envs"},
    "model": {"config", "envs", "kernels", "distributed"},
    "engine": {"config", "envs", "hub", "kernels", "cache", "distributed", "model"},
    "server": {"config", "envs", "engine", "model.tokenizer"},
    "bench": {"config", "envs", "engine", "server"},
    "cli": {
        "config",
        "compat",
        "envs",
        "hub",
        "kernels",
        "cache",
        "distributed",
        "model",
        "engine",
        "server",
        "bench",
    },
    "__init__": {"engine"},
}


def layer_of(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def imported(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "hyserve" and node.level == 0:
            names += [f"hyserve.{a.name}" for a in node.names]  # from hyserve import envs
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n.removeprefix("hyserve.") for n in names if n == "hyserve" or n.startswith("hyserve.")]


def test_no_upward_imports() -> None:
    bad = []
    files = sorted(ROOT.rglob("*.py"))
    assert len(files) > 20
    for f in files:
        layer = layer_of(f)
        allowed = ALLOWED[layer]
        for mod in imported(f):
            top = mod.split(".")[0]
            if top == layer:
                continue
            if top in allowed or mod in allowed or any(mod.startswith(a + ".") for a in allowed):
                continue
            bad.append(f"{f.relative_to(ROOT.parent)} imports hyserve.{mod} ({layer} may not import {top})")
    assert not bad, "\n".join(bad)


def test_checker_catches_an_upward_edge(tmp_path: Path) -> None:
    f = ROOT / "cache" / "manager.py"
    assert "engine" not in ALLOWED[layer_of(f)]
    fake = ast.parse("from hyserve.engine.scheduler.scheduler import Scheduler")
    mods = [n.module for n in ast.walk(fake) if isinstance(n, ast.ImportFrom)]
    assert mods == ["hyserve.engine.scheduler.scheduler"]
