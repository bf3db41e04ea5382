"""`hyserve bench serve`: load an OpenAI-compatible server with synthetic requests and measure it.

One *run* sends every prompt of the dataset (arrivals: all at once, or a Poisson process at
`request_rate`), at most `max_concurrency` in flight. A benchmark is a list of *points* (one per
concurrency of a sweep, or one), each repeated `reps` times back to back against the same server.
Repetition i draws its prompts with seed + i, so no repetition is served from prefix-cache entries that
an earlier one left behind; what differs between run 1 and run 2 is then the server's own warm-up
(compiles, allocator growth), which is what `run2/run1` is there to show.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from hyserve.bench.datasets import SampleRequest, as_text, random_dataset, shared_prefix_dataset
from hyserve.bench.http_client import (
    CHAT,
    BenchError,
    auth_headers,
    build_payload,
    endpoint_kind,
    first_model_id,
    get_json,
    join_url,
    scrape_counters,
    send_streaming,
)
from hyserve.bench.metrics import RequestResult, compute_metrics, rep_ratio, run_to_run_spread


@dataclass(frozen=True, kw_only=True)
class DatasetOptions:
    name: str = "random"  # random | shared-prefix
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # random: one prefix shared by all prompts
    shared_prefix_len: int = 512  # shared-prefix: length of each prefix
    num_prefixes: int = 4  # shared-prefix: how many distinct prefixes
    vocab_size: int = 320
    token_low: int = 3


@dataclass(frozen=True, kw_only=True)
class ServeBenchOptions:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    dataset: DatasetOptions = field(default_factory=DatasetOptions)
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    seed: int = 0
    ignore_eos: bool = False
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)
    reps: int = 1
    sweep_concurrency: tuple[int, ...] | None = None
    percentiles: tuple[float, ...] = (50.0, 99.0)
    request_timeout_s: float = 6 * 3600.0
    save_detailed: bool = False


def build_requests(d: DatasetOptions, *, seed: int, text: bool) -> list[SampleRequest]:
    if d.name == "random":
        reqs = random_dataset(
            num_prompts=d.num_prompts,
            input_len=d.input_len,
            output_len=d.output_len,
            range_ratio=d.range_ratio,
            prefix_len=d.prefix_len,
            vocab_size=d.vocab_size,
            low=d.token_low,
            seed=seed,
        )
    elif d.name == "shared-prefix":
        reqs = shared_prefix_dataset(
            num_prompts=d.num_prompts,
            num_prefixes=d.num_prefixes,
            prefix_len=d.shared_prefix_len,
            input_len=d.input_len,
            output_len=d.output_len,
            range_ratio=d.range_ratio,
            vocab_size=d.vocab_size,
            low=d.token_low,
            seed=seed,
        )
    else:
        raise BenchError(f"unknown dataset {d.name!r}")
    return as_text(reqs) if text else reqs


def arrival_offsets(n: int, request_rate: float, seed: int) -> list[float]:
    """Send times in seconds from the run start: all 0 for an infinite rate, else a Poisson process
    (exponential gaps with mean 1/rate), the first request at 0."""
    if request_rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(request_rate)
        out.append(t)
    return out


async def run_once(
    client: httpx.AsyncClient,
    url: str,
    kind: str,
    model: str,
    requests: Sequence[SampleRequest],
    *,
    opts: ServeBenchOptions,
    max_concurrency: int | None,
    seed: int,
    headers: dict[str, str],
) -> tuple[list[RequestResult], float]:
    """Send every request; returns per-request results (in dataset order) and the run's wall time."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    offsets = arrival_offsets(len(requests), opts.request_rate, seed)
    start = time.perf_counter()

    async def one(i: int, r: SampleRequest) -> RequestResult:
        delay = offsets[i] - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        payload = build_payload(
            kind,
            model,
            r.prompt,
            r.output_len,
            ignore_eos=opts.ignore_eos,
            temperature=opts.temperature,
            extra_body=opts.extra_body,
        )
        if sem is None:
            return await send_streaming(
                client, url, payload, kind=kind, prompt_len=r.prompt_len, headers=headers, run_start=start
            )
        async with sem:
            return await send_streaming(
                client, url, payload, kind=kind, prompt_len=r.prompt_len, headers=headers, run_start=start
            )

    results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    return list(results), time.perf_counter() - start


def _points(opts: ServeBenchOptions) -> list[int | None]:
    return list(opts.sweep_concurrency) if opts.sweep_concurrency else [opts.max_concurrency]


async def _run(opts: ServeBenchOptions, log: Callable[[str], None]) -> dict[str, Any]:
    kind = endpoint_kind(opts.endpoint)
    url = join_url(opts.base_url, opts.endpoint)
    headers = auth_headers(opts.api_key)
    biggest = max((c for c in _points(opts) if c), default=None)
    limits = httpx.Limits(max_connections=biggest, max_keepalive_connections=biggest)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if opts.model is None:
            model = await first_model_id(client, opts.base_url, headers)
        else:
            model = opts.model
            await get_json(client, join_url(opts.base_url, "/v1/models"), headers=headers)  # reachable?
        points: list[dict[str, Any]] = []
        for conc in _points(opts):
            reps: list[dict[str, Any]] = []
            for rep in range(opts.reps):
                seed = opts.seed + rep
                requests = build_requests(opts.dataset, seed=seed, text=kind == CHAT)
                before = await scrape_counters(client, opts.base_url, headers)
                results, duration = await run_once(
                    client,
                    url,
                    kind,
                    model,
                    requests,
                    opts=opts,
                    max_concurrency=conc,
                    seed=seed,
                    headers=headers,
                )
                after = await scrape_counters(client, opts.base_url, headers)
                m = compute_metrics(results, duration, opts.percentiles)
                m["rep"] = rep + 1
                m["seed"] = seed
                # the server's own counters over the run (hyserve: preemptions, prefix hits, late JIT)
                m["server_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
                m["requests"] = [
                    r.to_json(with_itl=opts.save_detailed, with_text=opts.save_detailed) for r in results
                ]
                reps.append(m)
                sc = m["server_counters"]
                extra = "".join(
                    f", {k} {sc[k]:.0f}"
                    for k in ("num_preemptions", "jit_compiles_after_ready", "cuda_alloc_retries")
                    if k in sc
                )
                log(
                    f"concurrency {conc or 'unlimited'}, rep {rep + 1}/{opts.reps}: {m['completed']} ok, "
                    f"{m['failed']} failed in {duration:.2f} s, {m['output_throughput']:.1f} output "
                    f"tok/s{extra}"
                )
            points.append(
                {
                    "max_concurrency": conc,
                    "reps": reps,
                    "spread": run_to_run_spread(reps) if len(reps) > 1 else {},
                    "run2_run1_output_throughput_ratio": rep_ratio(reps),
                }
            )
    return {"model": model, "endpoint": opts.endpoint, "api_url": url, "points": points}


def run_serve_bench(opts: ServeBenchOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns {'model', 'endpoint', 'api_url', 'config', 'points': [...]}."""
    out = asyncio.run(_run(opts, log))
    cfg = asdict(opts)
    cfg["request_rate"] = "inf" if opts.request_rate == float("inf") else opts.request_rate
    cfg.pop("api_key", None)
    out["config"] = cfg
    return out
