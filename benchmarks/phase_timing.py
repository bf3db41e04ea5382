"""Host time of an engine's step phases: wraps the named methods of an `LLMEngine` and its parts with timers
(bench_host.py and bench_step_sync.py measure with it)."""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable


def time_phases(eng, phases: Iterable[tuple[str, str]]) -> dict[str, list[float]]:  # noqa: ANN001 - LLMEngine
    """Replace each (owner, method) of `phases` (owner "engine", "runner" or "scheduler") by a timed call on
    `eng` and return the milliseconds of every call from then on, keyed "owner.method"."""
    owners = {"engine": eng, "runner": eng.runner, "scheduler": eng.scheduler}
    times: dict[str, list[float]] = collections.defaultdict(list)
    for owner, name in phases:
        real = getattr(owners[owner], name)

        def timed(*a, _real=real, _label=f"{owner}.{name}", **kw):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return _real(*a, **kw)
            finally:
                times[_label].append((time.perf_counter() - t) * 1e3)

        setattr(owners[owner], name, timed)
    return times
