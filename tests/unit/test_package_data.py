"""Every data file the package reads at run time (the tuned kernel settings per GPU) is declared as package
data in pyproject.toml, so a non-editable install (a wheel) carries it."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_data_file_under_the_package_is_package_data() -> None:
    decl = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    patterns = [f"{pkg.replace('.', '/')}/{glob}" for pkg, globs in decl.items() for glob in globs]
    data = [
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "hyserve").rglob("*")
        if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts
    ]
    assert data, "no data files found under hyserve/"
    missing = [f for f in data if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]
    assert not missing, f"not declared in [tool.setuptools.package-data]: {missing}"
