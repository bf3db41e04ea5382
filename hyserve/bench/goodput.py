"""Goodput: the rate of requests that meet every service-level objective given (vLLM's --goodput).

    --goodput ttft:500 tpot:50 e2el:3000     (milliseconds; any subset of ttft, tpot, e2el)

A request is good when it succeeded and each of its measured values is at most its objective (a request
with one output token has no TPOT, so it meets a TPOT objective); goodput is good requests / the run's
duration, beside the request throughput.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from hyserve.bench.metrics import RequestResult, tpot_s

GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(items: Iterable[str]) -> dict[str, float]:
    """`["ttft:500", "tpot:50"]` -> {"ttft": 500.0, "tpot": 50.0} (milliseconds).

    Raises ValueError naming the item for an unknown metric, a value that is not a number >= 0 (vLLM
    takes 0 too), an item without ':', or a metric given twice."""
    out: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep:
            raise ValueError(f"{item!r}: expected METRIC:MILLISECONDS, e.g. ttft:500")
        if name not in GOODPUT_METRICS:
            raise ValueError(f"{item!r}: unknown metric {name!r}; use {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number of milliseconds") from None
        if not (ms >= 0 and math.isfinite(ms)):
            raise ValueError(f"{item!r}: the objective must be a number of milliseconds >= 0")
        if name in out:
            raise ValueError(f"{item!r}: {name} is given twice")
        out[name] = ms
    return out


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a request succeeded within every objective in `slos` (milliseconds)."""
    if not r.ok:
        return False
    values = {
        "ttft": r.ttft_s,
        "tpot": tpot_s(r),
        "e2el": r.e2el_s,
    }
    for name, limit_ms in slos.items():
        v = values[name]
        if v is None:
            if name == "ttft":
                return False  # no output at all
            continue
        if v * 1000 > limit_ms:
            return False
    return True


def goodput(results: Sequence[RequestResult], duration_s: float, slos: dict[str, float]) -> dict[str, float]:
    """{"good_requests", "request_goodput"} of one run (requests/s, the run's duration as for the request
    throughput)."""
    good = sum(1 for r in results if meets(r, slos))
    return {"good_requests": good, "request_goodput": good / duration_s if duration_s > 0 else math.nan}
