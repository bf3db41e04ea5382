"""A process and its live children as Linux /proc shows them: the benchmarks measure a server together with
its engine process (`hyserve serve` runs the engine in a child process on CUDA)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def child_pids(pid: int) -> list[int]:
    """The live children of `pid` (every thread's)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of `pid` and its live children so far."""
    total = 0.0
    for p in (pid, *child_pids(pid)):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its live children."""
    total = 0
    for p in (pid, *child_pids(pid)):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total
