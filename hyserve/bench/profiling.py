"""Device time per kernel from the torch profiler: the breakdowns the GPU benchmarks print (the SSD
kernels of one scan, every kernel of a replayed decode step)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def device_kernel_times(fn: Callable[[], object], reps: int) -> dict[str, tuple[float, int]]:
    """Runs `fn` `reps` times under the profiler (CUDA activity) and returns, per kernel name, its total
    device time in microseconds and its launch count over all reps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, tuple[float, int]] = {}
    for e in prof.key_averages():
        us = float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0) or 0.0)
        if e.count and us > 0:
            out[e.key] = (float(us), int(e.count))
    return out


def graph_replay_ms(graphs: Any, batch: int, reps: int = 10) -> float | None:
    """Wall time of one replay of the decode graph a batch of `batch` runs in (ms; one warm replay, then the
    mean of `reps` back to back), or None without graphs, CUDA or a graph that fits the batch."""
    if graphs is None or not torch.cuda.is_available():
        return None
    size = graphs.size_for(batch)
    if size is None:
        return None
    graphs.replay(size)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        graphs.replay(size)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps * 1e3


__all__ = ["device_kernel_times", "graph_replay_ms"]
