"""Serving metrics from per-request timings: the numbers `vllm bench serve` reports, computed the same way.

Definitions (times are measured on the client, per request):

    send ──────► first output chunk ──► chunk ──► chunk ──► ... ──► stream ends
    |◄── TTFT ──►|◄─ ITL ─►|◄─ ITL ─►|
    |◄──────────────────────── E2EL ──────────────────────────────►|

* TTFT: request sent -> first chunk that carries output (text, content, reasoning or tool calls).
* ITL: the gaps between consecutive output chunks (one per chunk, so a server that packs several tokens
  into one chunk shows a longer ITL; TPOT is not affected by that).
* TPOT: (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token.
* E2EL: request sent -> end of the stream.
* per-user output tok/s: (output tokens - 1) / (E2EL - TTFT), the decode speed one user sees.
* Output tokens: the server's `usage.completion_tokens` when it reports usage, else the number of output
  chunks (exact for servers that send one token per chunk).
* Throughputs divide totals over successful requests by the run's wall time (first send -> last end).

Statistics: `std` is the population standard deviation (numpy's default) and percentiles interpolate
linearly between order statistics (numpy's default), so the numbers match `vllm bench serve`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Metric families reported in milliseconds, in table order.
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# Keys whose run-to-run spread is reported when a benchmark runs more than once.
SPREAD_KEYS = (
    "duration_s",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
    "mean_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "p99_tpot_ms",
    "mean_itl_ms",
    "mean_e2el_ms",
    "p99_e2el_ms",
    "mean_per_user_output_tps",
)


@dataclass
class RequestResult:
    """What one benchmark request measured. Times are seconds; `start_s` is relative to the run start."""

    ok: bool
    prompt_len: int  # tokens the client meant to send (approximate for text prompts)
    max_tokens: int
    start_s: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    output_tokens: int = 0
    output_tokens_from_usage: bool = False
    usage_prompt_tokens: int | None = None
    cached_tokens: int | None = None
    status: int | None = None  # HTTP status; None when no response came back
    error: str | None = None
    text: str = ""

    def to_json(self, *, with_itl: bool, with_text: bool) -> dict[str, Any]:
        d: dict[str, Any] = {
            "ok": self.ok,
            "prompt_len": self.prompt_len,
            "max_tokens": self.max_tokens,
            "start_s": self.start_s,
            "ttft_s": self.ttft_s,
            "e2el_s": self.e2el_s,
            "output_tokens": self.output_tokens,
            "output_tokens_from_usage": self.output_tokens_from_usage,
            "usage_prompt_tokens": self.usage_prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "num_chunks": len(self.itl_s) + (self.ttft_s is not None),
            "status": self.status,
            "error": self.error,
        }
        if with_itl:
            d["itl_s"] = list(self.itl_s)
        if with_text:
            d["text"] = self.text
        return d


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100) with linear interpolation (numpy's default method)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def pct_label(p: float) -> str:
    """99.0 -> 'p99', 99.9 -> 'p99.9'."""
    return f"p{p:g}"


def summarize(values: Sequence[float], percentiles: Iterable[float]) -> dict[str, float | None]:
    """mean, median, std (population), min, max, p99 and the requested percentiles; None when empty."""
    ps = sorted({99.0, *map(float, percentiles)})
    keys = ["mean", "median", "std", "min", "max", *(pct_label(p) for p in ps)]
    if not values:
        return dict.fromkeys(keys)
    n = len(values)
    mean = sum(values) / n
    out: dict[str, float | None] = {
        "mean": mean,
        "median": percentile(values, 50),
        "std": math.sqrt(sum((v - mean) ** 2 for v in values) / n),
        "min": min(values),
        "max": max(values),
    }
    for p in ps:
        out[pct_label(p)] = percentile(values, p)
    return out


def tpot_s(r: RequestResult) -> float | None:
    if r.ttft_s is None or r.output_tokens <= 1:
        return None
    return (r.e2el_s - r.ttft_s) / (r.output_tokens - 1)


def per_user_tps(r: RequestResult) -> float | None:
    if r.ttft_s is None or r.output_tokens <= 1 or r.e2el_s <= r.ttft_s:
        return None
    return (r.output_tokens - 1) / (r.e2el_s - r.ttft_s)


def compute_metrics(
    results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float] = (50, 99)
) -> dict[str, Any]:
    """One run's metrics, as a flat dict with vLLM's key names (`mean_ttft_ms`, `p99_e2el_ms`, ...)."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    usage_prompts = [r.usage_prompt_tokens for r in done if r.usage_prompt_tokens is not None]
    cached = [r.cached_tokens for r in done if r.cached_tokens is not None]
    n_in = sum(r.usage_prompt_tokens if r.usage_prompt_tokens is not None else r.prompt_len for r in done)
    n_out = sum(r.output_tokens for r in done)
    from_usage = sum(r.output_tokens_from_usage for r in done)
    dur = duration_s if duration_s > 0 else float("nan")
    m: dict[str, Any] = {
        "completed": len(done),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "prompt_tokens_sent": sum(r.prompt_len for r in done),
        "prompt_tokens_usage": sum(usage_prompts) if usage_prompts else None,
        "cached_tokens": sum(cached) if cached else None,
        "output_tokens_source": "none"
        if not done
        else ("usage" if from_usage == len(done) else "chunks" if from_usage == 0 else "mixed"),
        "request_throughput": len(done) / dur,
        "input_throughput": n_in / dur,
        "output_throughput": n_out / dur,
        "total_token_throughput": (n_in + n_out) / dur,
    }
    series: dict[str, list[float]] = {
        "ttft": [r.ttft_s * 1000 for r in done if r.ttft_s is not None],
        "tpot": [t * 1000 for r in done if (t := tpot_s(r)) is not None],
        "itl": [x * 1000 for r in done for x in r.itl_s],
        "e2el": [r.e2el_s * 1000 for r in done],
    }
    for name in LATENCY_METRICS:
        for stat, v in summarize(series[name], percentiles).items():
            m[f"{stat}_{name}_ms"] = v
    users = [u for r in done if (u := per_user_tps(r)) is not None]
    for stat, v in summarize(users, percentiles).items():
        m[f"{stat}_per_user_output_tps"] = v
    m["errors"] = error_summary(failed)
    return m


def error_summary(failed: Iterable[RequestResult], limit: int = 10) -> list[dict[str, Any]]:
    """The most frequent error messages with their counts."""
    counts = Counter((r.error or "unknown error") for r in failed)
    return [{"error": e, "count": c} for e, c in counts.most_common(limit)]


def run_to_run_spread(
    reps: Sequence[dict[str, Any]], keys: Sequence[str] = SPREAD_KEYS
) -> dict[str, dict[str, Any]]:
    """Per key, over repetitions of the same benchmark: values, mean, min, max, std (population) and
    spread_pct = (max - min) / mean * 100. Keys missing (None) in any repetition are left out."""
    out: dict[str, dict[str, Any]] = {}
    for k in keys:
        vals = [r.get(k) for r in reps]
        if not vals or any(v is None or (isinstance(v, float) and math.isnan(v)) for v in vals):
            continue
        fv = [float(v) for v in vals]  # type: ignore[arg-type]
        mean = sum(fv) / len(fv)
        out[k] = {
            "values": fv,
            "mean": mean,
            "min": min(fv),
            "max": max(fv),
            "std": math.sqrt(sum((v - mean) ** 2 for v in fv) / len(fv)),
            "spread_pct": (max(fv) - min(fv)) / mean * 100 if mean else None,
        }
    return out


def rep_ratio(reps: Sequence[dict[str, Any]], key: str = "output_throughput") -> float | None:
    """run 2 / run 1 for `key` (the warm-up gap: ~1.0 when the first run pays no compile stalls)."""
    if len(reps) < 2:
        return None
    a, b = reps[0].get(key), reps[1].get(key)
    if not a or b is None:
        return None
    return float(b) / float(a)
