"""benchmarks/procfs.py: a process's children, and its CPU time and resident memory with theirs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.procfs import child_pids, cpu_seconds, rss_bytes


def test_a_child_is_found_and_counted_with_its_parent() -> None:
    me = os.getpid()
    alone_rss = rss_bytes(me)
    child = subprocess.Popen([sys.executable, "-c", "import time; x = b'x' * (64 << 20); time.sleep(30)"])
    try:
        for _ in range(100):
            if child.pid in child_pids(me) and rss_bytes(me) > alone_rss + (48 << 20):
                break
            time.sleep(0.05)
        assert child.pid in child_pids(me)
        assert rss_bytes(me) > alone_rss + (48 << 20)  # its 64 MiB buffer is counted with the parent's
        assert cpu_seconds(me) > 0
    finally:
        child.kill()
        child.wait()
    assert child.pid not in child_pids(me)
