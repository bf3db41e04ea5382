"""Benchmarks and the measurement helpers they share (roofline, host results, phase timing). Run each
from the repository root as a module, `python -m benchmarks.bench_model ...`; tests import `benchmarks.x`."""

from __future__ import annotations

import sys
from pathlib import Path


def invocation(python: str | None = None) -> list[str]:
    """The command line of this process for a result file: a benchmark (run as `python -m benchmarks.x`,
    where sys.argv[0] is the module's file) is given by its module name, so the record re-runs as written."""
    exe = python or Path(sys.executable).name
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if (
        script is not None
        and script.suffix == ".py"
        and script.resolve().parent == Path(__file__).resolve().parent
    ):
        return [exe, "-m", f"benchmarks.{script.stem}", *sys.argv[1:]]
    return [exe, *sys.argv]
