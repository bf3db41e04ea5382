"""`hyserve bench serve`: load an OpenAI-compatible server with synthetic requests and measure it.

One *run* sends every prompt of the dataset (arrivals: all at once, or at `request_rate` with gaps of
gamma shape `burstiness`, or a ramp-up from one rate to another: hyserve/bench/arrivals.py), at most
`max_concurrency` in flight. A benchmark is a list of *points* (one per
concurrency of a sweep, or one), each repeated `reps` times back to back against the same server.
Repetition i draws its prompts with seed + i, so no repetition is served from prefix-cache entries that
an earlier one left behind; what differs between run 1 and run 2 is then the server's own warm-up
(compiles, allocator growth), which is what `run2/run1` is there to show.

`num_warmups` requests go before the first run and are not measured; a progress bar (tqdm, on stderr)
counts each run's finished requests; with `goodput` objectives each run also reports the rate of requests
that met them all (hyserve/bench/goodput.py). The result keeps vLLM's key names for the same figures
(`request_goodput`, `p90_ttft_ms`, top-level `request_rate`, `burstiness`, `ramp_up_*`, ...).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx
from tqdm import tqdm

from hyserve.bench.arrivals import RampUp, arrival_offsets
from hyserve.bench.datasets import SampleRequest, as_text, random_dataset, shared_prefix_dataset
from hyserve.bench.goodput import goodput
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
    stream_client,
)
from hyserve.bench.metrics import (
    LATENCY_METRICS,
    RequestResult,
    compute_metrics,
    rep_ratio,
    run_to_run_spread,
)
from hyserve.bench.sharegpt import sharegpt_dataset, tokenizer_counter, word_count
from hyserve.bench.sse_client import LeanClient


@dataclass(frozen=True, kw_only=True)
class DatasetOptions:
    name: str = "random"  # random | shared-prefix | sharegpt
    num_prompts: int = 1000
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 0  # random: one prefix shared by all prompts
    shared_prefix_len: int = 512  # shared-prefix: length of each prefix
    num_prefixes: int = 4  # shared-prefix: how many distinct prefixes
    vocab_size: int = 320
    token_low: int = 3
    path: str | None = None  # sharegpt: the local JSON file
    sharegpt_output_len: int | None = None  # sharegpt: max_tokens of every request (None: the reply's length)
    tokenizer: str | None = None  # sharegpt: counts lengths with this tokenizer.json (None: words)


@dataclass(frozen=True, kw_only=True)
class ServeBenchOptions:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str | None = None
    api_key: str | None = None
    dataset: DatasetOptions = field(default_factory=DatasetOptions)
    max_concurrency: int | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0  # gamma shape of the arrival gaps (1: Poisson)
    ramp_up: RampUp | None = None  # a request rate that moves over the run, in place of request_rate
    num_warmups: int = 0  # unmeasured requests sent before the first run
    goodput: dict[str, float] = field(default_factory=dict)  # SLOs in ms: ttft, tpot, e2el
    percentile_metrics: tuple[str, ...] = LATENCY_METRICS  # the latencies whose percentiles are reported
    progress: bool = False  # a progress bar per run on stderr (the CLI: on unless --disable-tqdm)
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
    elif d.name == "sharegpt":
        if d.path is None:
            raise BenchError("--dataset-name sharegpt needs --dataset-path FILE (ShareGPT's JSON)")
        try:
            count = tokenizer_counter(d.tokenizer) if d.tokenizer else word_count
            reqs = sharegpt_dataset(
                d.path, num_prompts=d.num_prompts, seed=seed, output_len=d.sharegpt_output_len, count=count
            )
        except ValueError as e:
            raise BenchError(str(e)) from None
    else:
        raise BenchError(f"unknown dataset {d.name!r}")
    return as_text(reqs) if text else reqs


async def run_once(
    client: httpx.AsyncClient | LeanClient,
    url: str,
    kind: str,
    model: str,
    requests: Sequence[SampleRequest],
    *,
    opts: ServeBenchOptions,
    max_concurrency: int | None,
    seed: int,
    headers: dict[str, str],
    desc: str = "requests",
) -> tuple[list[RequestResult], float]:
    """Send every request; returns per-request results (in dataset order) and the run's wall time. `desc`
    labels the progress bar."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    offsets = arrival_offsets(
        len(requests), opts.request_rate, seed, burstiness=opts.burstiness, ramp_up=opts.ramp_up
    )
    bar = tqdm(
        total=len(requests), desc=desc, disable=not opts.progress, file=sys.stderr, unit="req", leave=False
    )
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
            res = await send_streaming(
                client, url, payload, kind=kind, prompt_len=r.prompt_len, headers=headers, run_start=start
            )
        else:
            async with sem:
                res = await send_streaming(
                    client, url, payload, kind=kind, prompt_len=r.prompt_len, headers=headers, run_start=start
                )
        bar.update(1)
        return res

    try:
        results = await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
    finally:
        bar.close()
    return list(results), time.perf_counter() - start


def _points(opts: ServeBenchOptions) -> list[int | None]:
    return list(opts.sweep_concurrency) if opts.sweep_concurrency else [opts.max_concurrency]


@dataclass(frozen=True)
class _Target:
    """Where and how one benchmark sends its requests."""

    client: httpx.AsyncClient  # models, metrics
    streams: httpx.AsyncClient | LeanClient  # the measured requests (http_client.stream_client)
    url: str
    kind: str
    model: str
    headers: dict[str, str]


async def warm_up(t: _Target, opts: ServeBenchOptions, log: Callable[[str], None]) -> None:
    """`num_warmups` copies of one request, sent at once (at most the first point's max_concurrency in
    flight) and not measured, as vLLM's --num-warmups. The request is the first of the dataset drawn with
    seed - 1, which no measured run uses, so the warm-up leaves no prefix-cache entry a measured request
    could hit."""
    n = opts.num_warmups
    if n <= 0:
        return
    first = build_requests(opts.dataset, seed=opts.seed - 1, text=t.kind == CHAT)[0]
    warm = replace(opts, request_rate=float("inf"), ramp_up=None, burstiness=1.0)
    results, took = await run_once(
        t.streams,
        t.url,
        t.kind,
        t.model,
        [first] * n,
        opts=warm,
        max_concurrency=_points(opts)[0],
        seed=opts.seed - 1,
        headers=t.headers,
        desc="warm-up",
    )
    failed = sum(1 for r in results if not r.ok)
    log(f"warm-up: {n} requests ({failed} failed) in {took:.2f} s, not measured")


async def _one_rep(
    t: _Target, opts: ServeBenchOptions, conc: int | None, rep: int, log: Callable[[str], None]
) -> dict[str, Any]:
    """One run of the dataset at concurrency `conc`: its metrics, the server's counters, its requests."""
    seed = opts.seed + rep
    requests = build_requests(opts.dataset, seed=seed, text=t.kind == CHAT)
    before = await scrape_counters(t.client, opts.base_url, t.headers)
    results, duration = await run_once(
        t.streams,
        t.url,
        t.kind,
        t.model,
        requests,
        opts=opts,
        max_concurrency=conc,
        seed=seed,
        headers=t.headers,
        desc=f"concurrency {conc or 'unlimited'}, rep {rep + 1}",
    )
    after = await scrape_counters(t.client, opts.base_url, t.headers)
    m = compute_metrics(results, duration, opts.percentiles)
    # vLLM's key: requests within every --goodput objective per second, None without objectives
    m.update(goodput(results, duration, opts.goodput) if opts.goodput else {"request_goodput": None})
    m["rep"] = rep + 1
    m["seed"] = seed
    # the server's own counters over the run (hyserve: preemptions, prefix hits, late JIT)
    m["server_counters"] = {k: after[k] - before.get(k, 0.0) for k in after}
    m["requests"] = [r.to_json(with_itl=opts.save_detailed, with_text=opts.save_detailed) for r in results]
    sc = m["server_counters"]
    extra = "".join(
        f", {k} {sc[k]:.0f}"
        for k in ("num_preemptions", "jit_compiles_after_ready", "cuda_alloc_retries")
        if k in sc
    )
    if opts.goodput:
        extra += f", goodput {m['request_goodput']:.2f} req/s"
    log(
        f"concurrency {conc or 'unlimited'}, rep {rep + 1}/{opts.reps}: {m['completed']} ok, "
        f"{m['failed']} failed in {duration:.2f} s, {m['output_throughput']:.1f} output tok/s{extra}"
    )
    return m


async def _run(opts: ServeBenchOptions, log: Callable[[str], None]) -> dict[str, Any]:
    kind = endpoint_kind(opts.endpoint)
    url = join_url(opts.base_url, opts.endpoint)
    headers = auth_headers(opts.api_key)
    biggest = max((c for c in _points(opts) if c), default=None)
    limits = httpx.Limits(max_connections=biggest, max_keepalive_connections=biggest)
    timeout = httpx.Timeout(opts.request_timeout_s, connect=30.0)
    build_requests(
        opts.dataset, seed=opts.seed, text=kind == CHAT
    )  # a dataset problem shows before any request
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if opts.model is None:
            model = await first_model_id(client, opts.base_url, headers)
        else:
            model = opts.model
            await get_json(client, join_url(opts.base_url, "/v1/models"), headers=headers)  # reachable?
        t = _Target(client, stream_client(url, client, opts.request_timeout_s), url, kind, model, headers)
        await warm_up(t, opts, log)
        points: list[dict[str, Any]] = []
        for conc in _points(opts):
            reps = [await _one_rep(t, opts, conc, rep, log) for rep in range(opts.reps)]
            points.append(
                {
                    "max_concurrency": conc,
                    "reps": reps,
                    "spread": run_to_run_spread(reps) if len(reps) > 1 else {},
                    "run2_run1_output_throughput_ratio": rep_ratio(reps),
                }
            )
    return {"model": model, "endpoint": opts.endpoint, "api_url": url, "points": points}


def traffic_keys(opts: ServeBenchOptions) -> dict[str, Any]:
    """The traffic settings under `vllm bench serve`'s top-level result keys."""
    out: dict[str, Any] = {
        "num_prompts": opts.dataset.num_prompts,
        "request_rate": "inf" if opts.request_rate == float("inf") else opts.request_rate,
        "burstiness": "inf" if opts.burstiness == float("inf") else opts.burstiness,
        "max_concurrency": opts.max_concurrency,
    }
    if opts.ramp_up is not None:
        out["ramp_up_strategy"] = opts.ramp_up.strategy
        out["ramp_up_start_rps"] = opts.ramp_up.start_rps
        out["ramp_up_end_rps"] = opts.ramp_up.end_rps
    return out


def run_serve_bench(opts: ServeBenchOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark; returns {'model', 'endpoint', 'api_url', 'config', 'points': [...]}."""
    out = asyncio.run(_run(opts, log))
    cfg = asdict(opts)
    cfg["request_rate"] = "inf" if opts.request_rate == float("inf") else opts.request_rate
    cfg["burstiness"] = "inf" if opts.burstiness == float("inf") else opts.burstiness
    cfg.pop("api_key", None)
    out["config"] = cfg
    out.update(traffic_keys(opts))
    return out
