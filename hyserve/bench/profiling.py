"""Device time per kernel from the torch profiler: the breakdowns the GPU benchmarks print (the SSD
kernels of one scan, every kernel of a replayed decode step)."""

from __future__ import annotations

from collections.abc import Callable

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


__all__ = ["device_kernel_times"]
