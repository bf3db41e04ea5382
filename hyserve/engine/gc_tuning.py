"""The cyclic garbage collector while an engine serves.

A decode step of 1,024 rows allocates thousands of container objects (scheduled rows, their lists, stream
deltas, the server's per-chunk coroutines), almost all freed by reference counting within a step or two.
At CPython's default first-generation threshold (700 allocations) the collector runs several times a step;
each run promotes whatever is still in flight, so the older generations fill with per-request objects and
full collections follow every few seconds, each walking every tracked object with the interpreter lock held.

Measured with `benchmarks/bench_server_cost.py` (2 CPUs, emulated device, 1,024 streams, 2,048 requests of
1000 in / 300 out, steps with a prefill row holding the host 45 ms as an eager forward does): at the default
thresholds the server process spent 18.8 s in collections over the run (59 full ones, ~200 ms each) and kept
0.902 of `LLM.generate`'s throughput; with a first-generation threshold of 50,000, 0.36 s (10 young-generation
runs, no full one) and 1.028.

So serving raises the first threshold to `SERVING_GEN0_THRESHOLD` (cyclic garbage is still collected, at
most that many young objects late), after moving the start-up heap out of the collector's reach: `hyserve
serve` before the port opens, a tensor-parallel worker rank when rank 0 says ready, `LLM.generate` while its
steps run.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

SERVING_GEN0_THRESHOLD = 50_000


def freeze_startup_heap() -> int:
    """Move every object alive now (torch, the model, tokenizer tables, the warm-up's leftovers: ~300k
    objects before any CUDA library loads) out of the cyclic garbage collector's reach. They live as long
    as the server; left in, every full collection walks them all, which stalled the engine loop, and so
    every stream, for ~200 ms every few hundred steps (`benchmarks/bench_host.py`). Returns the count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def serving_thresholds() -> tuple[int, int, int]:
    """The collector's thresholds for serving: the first raised to SERVING_GEN0_THRESHOLD (never lowered),
    the older generations' as they are."""
    t0, t1, t2 = gc.get_threshold()
    return max(t0, SERVING_GEN0_THRESHOLD), t1, t2


def settle_for_serving() -> int:
    """For a process that serves from now on (`hyserve serve`): freeze the start-up heap and set the serving
    thresholds. Returns the count of objects frozen."""
    n = freeze_startup_heap()
    gc.set_threshold(*serving_thresholds())
    return n


@contextmanager
def serving_gc() -> Iterator[None]:
    """The serving thresholds within, the caller's restored after (`LLM.generate` in someone's program)."""
    before = gc.get_threshold()
    gc.set_threshold(*serving_thresholds())
    try:
        yield
    finally:
        gc.set_threshold(*before)
