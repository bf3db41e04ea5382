"""Soak benchmark (docs/architecture.md, "Failure isolation"): many concurrent streams of mixed
prompt / output lengths through a real `hyserve serve` process for a fixed time, with client disconnects,
slow readers and injected faults (`HYSERVE_FAULT_INJECT`) at fixed rates, then `/metrics` must show every
pool free. From two windows of load (`--window`, 60 s) the server's RSS (its engine process included) must
stay within 5% of its first sample after the first window, and from three the last full window's
inter-token p99 within 10% of the second window's.

Request ids are the server's (`cmpl-<uuid hex>`), so faults target a fixed set of 3-hex-digit id prefixes
(`site:cmpl-abc@n`, sites forward / sample / host): each request is targeted with probability
prefixes / 4096, and the client knows which ones from the id of the first chunk, which `echo` makes
arrive before the engine runs the request. A targeted request must end with the in-band engine error
(its error id logged with the injected fault), every other one must finish with exactly `max_tokens`
tokens (`ignore_eos`) or be disconnected by the client as planned; anything else is unexpected, and so
is a pool not free at the end, a 5xx, an unhealthy `/health`, an engine restart or a non-zero server exit.
Exit status 1 if anything unexpected happened.

    python -m benchmarks.bench_soak                      # H200: Nano 9B v2 architecture, 512 streams, 600 s
    python -m benchmarks.bench_soak --model "" --concurrency 4 --duration 5 \
        --serve-args "--max_seq_len 1024 --warmup off"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from array import array
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.procfs import rss_bytes  # noqa: E402
from hyserve.bench.http_client import error_message, sse_data  # noqa: E402
from hyserve.engine.faults import FaultInjector  # noqa: E402

DEFAULT_MODEL = "benchmarks/configs/NVIDIA-Nemotron-Nano-9B-v2"
DEFAULT_SERVE_ARGS = "--max-batch-size 256 --max-num-tokens 8192 --max-seq-len 16384"
FAULT_SITES = ("forward", "sample", "host")  # "engine" restarts the loop and fails everyone by design
FAULT_AFTER = (0, 1, 5)  # output tokens before the fault fires: the first prefill, the first decode, later
ID_PREFIX = "cmpl-"  # the server's completion ids (hyserve/server/serving_completion.py)
PREFIX_HEX = 3  # hex digits of the targeted id prefixes: 4096 of them


@dataclass(frozen=True, kw_only=True)
class SoakConfig:
    concurrency: int = 512
    duration_s: float = 600.0
    min_input: int = 32
    max_input: int = 6000
    min_output: int = 16
    max_output: int = 1024
    fault_every: int = 200  # about 1 in this many requests gets a fault
    disconnect_every: int = 20  # every this-many-th request is planned to disconnect (unless targeted)
    slow_every: int = 25  # every this-many-th other request reads slowly (0: none)
    slow_read_s: float = 0.05  # a slow reader's pause after each event it reads
    window_s: float = (
        60.0  # the RSS and inter-token windows: RSS flat after the first, ITL p99 last vs second
    )
    shared_prefixes: int = 4  # this many shared prompt prefixes (prefix cache, snapshot pins)
    shared_prefix_len: int = 1024
    shared_fraction: float = 0.25  # of prompts start with a shared prefix
    vocab_size: int = 131072
    min_token_id: int = 1000
    seed: int = 0
    read_timeout_s: float = 300.0  # a stream silent for this long counts as an unexpected timeout
    drain_timeout_s: float = 600.0  # after the duration: how long in-flight requests may take to finish
    settle_timeout_s: float = 60.0  # then: how long the engine may take to show running = waiting = 0

    def check(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise SystemExit(f"bench_soak: {msg}")

        need(self.concurrency >= 1, f"--concurrency must be >= 1, got {self.concurrency}")
        need(self.duration_s > 0, f"--duration must be > 0 seconds, got {self.duration_s}")
        need(
            1 <= self.min_input <= self.max_input,
            f"need 1 <= --min-input <= --max-input, got {self.min_input}, {self.max_input}",
        )
        need(
            max(FAULT_AFTER) + 3 <= self.min_output <= self.max_output,
            f"need {max(FAULT_AFTER) + 3} <= --min-output <= --max-output (a targeted request must live "
            f"past its fault's token count {max(FAULT_AFTER)}, with a step of slack for async scheduling), "
            f"got {self.min_output}, {self.max_output}",
        )
        need(2 <= self.fault_every <= 4096, f"--fault-every must be in [2, 4096], got {self.fault_every}")
        need(
            self.disconnect_every >= 0,
            f"--disconnect-every must be >= 0 (0: none), got {self.disconnect_every}",
        )
        need(self.slow_every >= 0, f"--slow-every must be >= 0 (0: none), got {self.slow_every}")
        need(self.slow_read_s >= 0, f"--slow-read must be >= 0 seconds, got {self.slow_read_s}")
        need(self.window_s > 0, f"--window must be > 0 seconds, got {self.window_s}")
        need(
            0 <= self.min_token_id < self.vocab_size,
            f"need 0 <= --min-token-id < --vocab-size, got {self.min_token_id}, {self.vocab_size}",
        )
        need(
            0.0 <= self.shared_fraction <= 1.0,
            f"--shared-fraction must be in [0, 1], got {self.shared_fraction}",
        )
        need(
            self.shared_prefix_len < self.max_input or self.shared_prefixes == 0 or self.shared_fraction == 0,
            f"--shared-prefix-len ({self.shared_prefix_len}) must be below --max-input ({self.max_input})",
        )


# ---- which requests fail where ------------------------------------------------------------------------


def fault_spec(fault_every: int) -> str:
    """`HYSERVE_FAULT_INJECT` for about 1 in `fault_every` requests: round(4096 / fault_every) id prefixes,
    sites and token counts taken in turn."""
    n = max(1, round(16**PREFIX_HEX / fault_every))
    return ",".join(
        f"{FAULT_SITES[i % 3]}:{ID_PREFIX}{i:0{PREFIX_HEX}x}@{FAULT_AFTER[(i // 3) % 3]}" for i in range(n)
    )


def targeted_site(injector: FaultInjector, request_id: str) -> str | None:
    """The site whose fault names this request (the injector's own substring rule), or None."""
    for f in injector.faults:
        if f.match in request_id:
            return f.site
    return None


# ---- the requests -------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Plan:
    index: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    disconnect_after: int | None  # token chunks to read before closing the stream; None: read to the end
    slow: bool = False  # pause slow_read_s after each event (the server merges what waits for it)


def log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


class Planner:
    """Request i's prompt, length, sampling and disconnect point, from the seed and i alone."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        rng = random.Random(cfg.seed)
        self.prefixes = [
            [rng.randrange(cfg.min_token_id, cfg.vocab_size) for _ in range(cfg.shared_prefix_len)]
            for _ in range(cfg.shared_prefixes)
        ]

    def plan(self, i: int) -> Plan:
        c = self.cfg
        rng = random.Random(c.seed * 1_000_003 + i)
        n_in, n_out = log_uniform(rng, c.min_input, c.max_input), log_uniform(rng, c.min_output, c.max_output)
        head: list[int] = []
        if self.prefixes and rng.random() < c.shared_fraction and n_in > c.shared_prefix_len:
            head = self.prefixes[rng.randrange(len(self.prefixes))]
        prompt = head + [rng.randrange(c.min_token_id, c.vocab_size) for _ in range(n_in - len(head))]
        cut = None
        if c.disconnect_every and i % c.disconnect_every == c.disconnect_every - 1:
            cut = rng.randrange(0, n_out)  # 0: right after the echo chunk, before any token
        slow = cut is None and bool(c.slow_every) and i % c.slow_every == c.slow_every // 2
        return Plan(
            index=i,
            prompt=prompt,
            max_tokens=n_out,
            temperature=rng.choice((0.0, 0.8)),
            disconnect_after=cut,
            slow=slow,
        )


# ---- one stream ---------------------------------------------------------------------------------------

COMPLETED, INJECTED, DISCONNECTED, UNEXPECTED = "completed", "injected_failure", "disconnected", "unexpected"


@dataclass(kw_only=True)
class Outcome:
    index: int
    kind: str
    request_id: str | None = None
    site: str | None = None  # the targeted site, for targeted requests
    status: int | None = None
    tokens: int = 0
    error_id: str | None = None
    detail: str = ""
    slow: bool = False  # a slow reader


class GapWindows:
    """Inter-token gaps (seconds between a stream's consecutive token events) by the window of the run they
    end in: window k covers [k * window_s, (k + 1) * window_s) from the start of the load."""

    def __init__(self, t0: float, window_s: float) -> None:
        self.t0, self.window_s = t0, window_s
        self.gaps: dict[int, array[float]] = {}

    def add(self, now: float, gap: float) -> None:
        k = int((now - self.t0) // self.window_s)
        self.gaps.setdefault(k, array("d")).append(gap)

    def p99_ms(self) -> dict[int, float]:
        return {k: _quantile(sorted(v), 0.99) * 1e3 for k, v in sorted(self.gaps.items()) if v}


def _quantile(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def run_one(
    client: httpx.AsyncClient,
    url: str,
    plan: Plan,
    injector: FaultInjector,
    model: str,
    *,
    slow_read_s: float = 0.0,
    gaps: GapWindows | None = None,
) -> Outcome:
    """Send one streamed completion and classify how it ended; never raises for server or network trouble.
    A slow plan pauses `slow_read_s` after each event; the others' inter-token gaps go to `gaps`."""
    body = {
        "model": model,
        "prompt": plan.prompt,
        "max_tokens": plan.max_tokens,
        "temperature": plan.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "echo": True,
    }
    if plan.temperature > 0:
        body.update(top_p=0.95, seed=plan.index)
    out = Outcome(index=plan.index, kind=UNEXPECTED, slow=plan.slow)
    chunks, finish, usage_tokens = -1, None, None  # the echo chunk comes first: token chunks count from 0
    last: float | None = None  # when the previous token event arrived
    try:
        async with client.stream("POST", url, json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.detail = error_message(resp.status_code, await resp.aread())
                return out
            async for data in sse_data(resp):
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    out.detail = f"an SSE event that is not a JSON object: {data[:200]!r}"
                    return out
                if "error" in obj:
                    return _ended_with_error(out, obj["error"], chunks)
                if out.request_id is None and obj.get("id"):
                    out.request_id = str(obj["id"])
                    out.site = targeted_site(injector, out.request_id)
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                if obj.get("choices"):
                    chunks += 1
                    finish = obj["choices"][0].get("finish_reason") or finish
                    if gaps is not None and not plan.slow and chunks >= 1:
                        now = time.monotonic()
                        if last is not None:
                            gaps.add(now, now - last)
                        last = now
                if plan.slow:
                    await asyncio.sleep(slow_read_s)
                if (
                    plan.disconnect_after is not None
                    and out.site is None
                    and chunks >= plan.disconnect_after
                    and finish is None
                ):
                    out.kind, out.tokens = DISCONNECTED, chunks
                    return out  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, ValueError) as e:
        out.detail = f"{type(e).__name__}: {e}".rstrip(": ")
        return out
    out.tokens = usage_tokens if isinstance(usage_tokens, int) else max(chunks, 0)
    if out.site is not None:
        out.detail = f"targeted ({out.site}) but finished ({finish}, {out.tokens} tokens)"
    elif finish == "length" and out.tokens == plan.max_tokens:
        out.kind = COMPLETED
    else:
        out.detail = f"finish_reason {finish!r} with {out.tokens} of {plan.max_tokens} tokens"
    return out


def _ended_with_error(out: Outcome, err: Any, chunks: int) -> Outcome:
    err = err if isinstance(err, dict) else {"message": str(err)}
    out.tokens, out.error_id = max(chunks, 0), err.get("error_id")
    out.status = err.get("status_code", out.status)
    if out.site is not None and err.get("code") == "engine_error":
        out.kind = INJECTED
    else:
        out.detail = f"stream error (code {err.get('code')!r}): {str(err.get('message'))[:300]}"
    return out


# ---- the load -----------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class Monitor:
    health_failures: list[str] = field(default_factory=list)
    peak_running: float = 0.0
    peak_waiting: float = 0.0
    worst_health_ms: float = 0.0
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the load, bytes)


async def monitor(
    client: httpx.AsyncClient,
    root: str,
    mon: Monitor,
    stop: asyncio.Event,
    pid: int | None = None,
    t0: float = 0.0,
) -> None:
    """Every 2 s: /health must answer 200; the peak running / waiting from /metrics; the server's RSS (with
    its engine process) when `pid` is given."""
    while not stop.is_set():
        if pid is not None:
            mon.rss.append((time.monotonic() - t0, rss_bytes(pid)))
        t0 = time.perf_counter()
        try:
            r = await client.get(f"{root}/health", timeout=30.0)
            mon.worst_health_ms = max(mon.worst_health_ms, (time.perf_counter() - t0) * 1e3)
            if r.status_code != 200:
                mon.health_failures.append(f"HTTP {r.status_code}: {r.text[:200]}")
            m = parse_metrics((await client.get(f"{root}/metrics", timeout=30.0)).text)
            mon.peak_running = max(mon.peak_running, m.get("hyserve_num_requests_running", 0.0))
            mon.peak_waiting = max(mon.peak_waiting, m.get("hyserve_num_requests_waiting", 0.0))
        except httpx.HTTPError as e:
            mon.health_failures.append(f"{type(e).__name__}: {e}")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)


async def run_load(
    cfg: SoakConfig, root: str, model: str, injector: FaultInjector, pid: int | None = None
) -> tuple[list[Outcome], Monitor, float, bool, GapWindows]:
    """`concurrency` workers send requests back to back until the duration is up, then finish theirs.
    Returns (outcomes, monitor, seconds, whether the in-flight requests finished within drain_timeout_s,
    the inter-token gaps by window)."""
    planner = Planner(cfg)
    outcomes: list[Outcome] = []
    next_index = 0
    t0 = time.monotonic()
    gaps = GapWindows(t0, cfg.window_s)
    deadline = t0 + cfg.duration_s
    timeout = httpx.Timeout(connect=60.0, read=cfg.read_timeout_s, write=60.0, pool=None)
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            nonlocal next_index
            while time.monotonic() < deadline:
                i, next_index = next_index, next_index + 1
                try:
                    o = await run_one(
                        client,
                        f"{root}/v1/completions",
                        planner.plan(i),
                        injector,
                        model,
                        slow_read_s=cfg.slow_read_s,
                        gaps=gaps,
                    )
                except Exception as e:  # a bug here must count, not end a worker silently
                    o = Outcome(index=i, kind=UNEXPECTED, detail=f"client: {type(e).__name__}: {e}")
                outcomes.append(o)

        mon, stop = Monitor(), asyncio.Event()
        mon_task = asyncio.create_task(monitor(client, root, mon, stop, pid, t0))
        tasks = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=cfg.duration_s + cfg.drain_timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        stop.set()
        await mon_task
    return outcomes, mon, time.monotonic() - t0, not pending, gaps


def _rss_span(mon: Monitor) -> str:
    if not mon.rss:
        return "n/a"
    return f"{mon.rss[0][1] / 2**30:.2f} / {mon.rss[-1][1] / 2**30:.2f}"


def steady_checks(cfg: SoakConfig, mon: Monitor, gaps: GapWindows) -> list[tuple[str, bool, str]]:
    """The steady-state bars, where the run is long enough to have them: the RSS after the first window
    stays within 5% of its first sample there (needs two windows of load), and the last full window's
    inter-token p99 is within 10% of the second window's (needs three)."""
    out: list[tuple[str, bool, str]] = []
    w = cfg.window_s
    later = [(t, b) for t, b in mon.rss if w <= t <= cfg.duration_s]
    if cfg.duration_s >= 2 * w and later:
        base, top = later[0][1], max(b for _, b in later)
        growth = top / base - 1 if base else float("inf")
        out.append(
            (
                f"server RSS flat within 5% after the first {w:g}s",
                growth <= 0.05,
                f"{base / 2**30:.2f} -> at most {top / 2**30:.2f} GiB ({growth:+.1%})",
            )
        )
    last = int(cfg.duration_s // w) - 1  # the last window the load fills (the drain after it is not steady)
    p99 = gaps.p99_ms()
    if last >= 2 and 1 in p99 and last in p99:
        ratio = p99[last] / p99[1]
        out.append(
            (
                "last window's inter-token p99 within 10% of the second's",
                ratio <= 1.10,
                f"{p99[1]:.0f} -> {p99[last]:.0f} ms ({ratio:.2f}x)",
            )
        )
    return out


# ---- /metrics and the server log -----------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def settled_metrics(root: str, timeout_s: float) -> dict[str, float]:
    """/metrics once running and waiting are both 0 (aborts of disconnected streams land asynchronously),
    or the last scrape after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while True:
        m = parse_metrics(httpx.get(f"{root}/metrics", timeout=30.0).text)
        idle = m.get("hyserve_num_requests_running") == 0 and m.get("hyserve_num_requests_waiting") == 0
        if idle or time.monotonic() > end:
            return m
        time.sleep(0.2)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def pool_checks(
    before: dict[str, float], after: dict[str, float], counts: Counter[str], by_site: Counter[str]
) -> list[tuple[str, bool, str]]:
    """(check, ok, detail) for the end state: every pool free, failures counted as the client saw them."""
    g = after.get
    fwd_sample = by_site["forward"] + by_site["sample"]
    steps = delta(after, before, "hyserve_step_failures_total")
    checks = [
        ("engine healthy", g("hyserve_healthy") == 1, f"hyserve_healthy {g('hyserve_healthy')}"),
        (
            "no request running",
            g("hyserve_num_requests_running") == 0,
            f"{g('hyserve_num_requests_running')}",
        ),
        (
            "no request waiting",
            g("hyserve_num_requests_waiting") == 0,
            f"{g('hyserve_num_requests_waiting')}",
        ),
        (
            "every KV block free",
            g("hyserve_kv_cache_blocks_free") == g("hyserve_kv_cache_blocks_total"),
            f"{g('hyserve_kv_cache_blocks_free')} free of {g('hyserve_kv_cache_blocks_total')}",
        ),
        (
            "every live state slot free",
            g("hyserve_state_slots_used") == 0,
            f"{g('hyserve_state_slots_used')} used of {g('hyserve_state_slots_total')}",
        ),
        (
            "snapshot slots within the pool",
            (g("hyserve_snapshot_slots_used") or 0) <= (g("hyserve_snapshot_slots_total") or 0),
            f"{g('hyserve_snapshot_slots_used')} hold a cached prefix of {g('hyserve_snapshot_slots_total')}",
        ),
        (
            "no engine restart",
            delta(after, before, "hyserve_engine_restarts_total") == 0,
            f"+{delta(after, before, 'hyserve_engine_restarts_total'):.0f}",
        ),
        (
            "request failures = injected failures",
            delta(after, before, "hyserve_request_failures_total") == counts[INJECTED],
            f"+{delta(after, before, 'hyserve_request_failures_total'):.0f} counted, {counts[INJECTED]} seen",
        ),
        (
            "step failures counted",
            (1 <= steps <= fwd_sample) if fwd_sample else steps == 0,
            f"+{steps:.0f} for {fwd_sample} forward/sample faults",
        ),
    ]
    five = {
        k: v - before.get(k, 0.0)
        for k, v in after.items()
        if k.startswith("hyserve_requests_total{")
        and re.search(r'status="5\d\d"', k)
        and v > before.get(k, 0.0)
    }
    checks.append(("no 5xx status", not five, json.dumps(five) if five else "0"))
    pinned = g("hyserve_snapshot_slots_pinned")
    if pinned is not None:  # exported by newer servers: snapshots an in-flight operation holds
        checks.append(("no snapshot pinned", pinned == 0, f"{pinned}"))
    return checks


def verify_in_log(log_text: str, injected: list[Outcome]) -> list[str]:
    """The injected failures whose error id the server log does not tie to the injected fault of that
    request (an engine error for some other reason would be unexpected)."""
    bad = []
    for o in injected:
        lines = [ln for ln in log_text.splitlines() if o.error_id and f"error id {o.error_id}" in ln]
        if not any("injected fault" in ln and str(o.request_id) in ln for ln in lines):
            bad.append(f"{o.request_id} (error id {o.error_id}): no logged injected fault")
    return bad


# ---- the server ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    cmd: list[str], env: dict[str, str], log_path: Path, root: str, timeout_s: float
) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(
                f"bench_soak: hyserve serve exited with {proc.returncode} before ready; log "
                f"{log_path}:\n{log_path.read_text(errors='replace')[-4000:]}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{root}/health", timeout=2.0).status_code == 200:
                return proc
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"bench_soak: hyserve serve not healthy within {timeout_s:.0f}s; log {log_path}")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> int:
    """SIGTERM (the graceful drain: nothing is in flight by now) and the exit status; killed past timeout."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return -9


# ---- report -------------------------------------------------------------------------------------------


def git_sha() -> str:
    try:
        r = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return r.stdout.strip() + ("+" if dirty else "") if r.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def gpu_name() -> str:
    try:
        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        names = [n.strip() for n in r.stdout.splitlines() if n.strip()]
        return ", ".join(names) if r.returncode == 0 and names else "none (CPU)"
    except (OSError, subprocess.SubprocessError):
        return "none (CPU)"


def table(rows: list[tuple[str, str]]) -> str:
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows)


def vocab_of(model: str) -> int | None:
    p = (
        ROOT / model / "config.json"
        if model and not Path(model).is_absolute()
        else Path(model) / "config.json"
    )
    if model and p.is_file():
        return int(json.loads(p.read_text())["vocab_size"])
    if not model:
        from hyserve.model.tiny import TINY_VOCAB_SIZE

        return TINY_VOCAB_SIZE
    return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    d = SoakConfig()
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model", default=DEFAULT_MODEL, help="model dir for `hyserve serve` ('' = built-in tiny)"
    )
    ap.add_argument("--load-format", default="dummy", help="'' to leave it to the server")
    ap.add_argument(
        "--serve-args", default=DEFAULT_SERVE_ARGS, help="more `hyserve serve` flags (one string)"
    )
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    ap.add_argument("--min-input", type=int, default=d.min_input)
    ap.add_argument("--max-input", type=int, default=d.max_input)
    ap.add_argument("--min-output", type=int, default=d.min_output)
    ap.add_argument("--max-output", type=int, default=d.max_output)
    ap.add_argument(
        "--fault-every", type=int, default=d.fault_every, help="about 1 in N requests gets a fault"
    )
    ap.add_argument("--disconnect-every", type=int, default=d.disconnect_every, help="0: no disconnects")
    ap.add_argument("--slow-every", type=int, default=d.slow_every, help="0: no slow readers")
    ap.add_argument(
        "--slow-read", type=float, default=d.slow_read_s, help="a slow reader's pause after each event (s)"
    )
    ap.add_argument(
        "--window", type=float, default=d.window_s, help="seconds of the RSS and inter-token windows"
    )
    ap.add_argument("--shared-prefixes", type=int, default=d.shared_prefixes)
    ap.add_argument("--shared-prefix-len", type=int, default=d.shared_prefix_len)
    ap.add_argument("--shared-fraction", type=float, default=d.shared_fraction)
    ap.add_argument("--vocab-size", type=int, default=None, help="default: the model's config.json")
    ap.add_argument("--min-token-id", type=int, default=None, help="default: 1000, or vocab // 10 if smaller")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--read-timeout", type=float, default=d.read_timeout_s)
    ap.add_argument("--drain-timeout", type=float, default=d.drain_timeout_s)
    ap.add_argument("--startup-timeout", type=float, default=1800.0)
    ap.add_argument("--git-sha", default=None, help="default: git rev-parse (for a tree without .git)")
    ap.add_argument(
        "--out", default=None, help="result JSON (default benchmarks/results/soak_<date>_<sha>.json)"
    )
    return ap.parse_args(argv)


def config_from(a: argparse.Namespace) -> SoakConfig:
    vocab = a.vocab_size or vocab_of(a.model)
    if vocab is None:
        raise SystemExit(
            f"bench_soak: no config.json under {a.model!r} to read vocab_size from; pass --vocab-size"
        )
    min_id = a.min_token_id if a.min_token_id is not None else min(1000, vocab // 10)
    cfg = SoakConfig(
        concurrency=a.concurrency,
        duration_s=a.duration,
        min_input=a.min_input,
        max_input=a.max_input,
        min_output=a.min_output,
        max_output=a.max_output,
        fault_every=a.fault_every,
        disconnect_every=a.disconnect_every,
        slow_every=a.slow_every,
        slow_read_s=a.slow_read,
        window_s=a.window,
        shared_prefixes=a.shared_prefixes,
        shared_prefix_len=a.shared_prefix_len,
        shared_fraction=a.shared_fraction,
        vocab_size=vocab,
        min_token_id=min_id,
        seed=a.seed,
        read_timeout_s=a.read_timeout,
        drain_timeout_s=a.drain_timeout,
    )
    cfg.check()
    return cfg


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    cfg = config_from(a)
    sha = a.git_sha or git_sha()
    stamp = datetime.datetime.now(datetime.UTC)
    out = Path(a.out) if a.out else ROOT / "benchmarks" / "results" / f"soak_{stamp:%Y-%m-%d}_{sha}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    log_path = out.with_suffix(".log")
    spec = fault_spec(cfg.fault_every)
    injector = FaultInjector.parse(spec)
    assert injector is not None
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "hyserve.cli",
        "serve",
        *([a.model] if a.model else []),
        *(["--load-format", a.load_format] if a.load_format else []),
        *shlex.split(a.serve_args),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, "HYSERVE_FAULT_INJECT": spec, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    print(
        f"bench_soak: starting {shlex.join(cmd)} (log {log_path}); faults on {len(injector.faults)} of "
        f"{16**PREFIX_HEX} id prefixes",
        flush=True,
    )
    t_start = time.monotonic()
    proc = start_server(cmd, env, log_path, root, a.startup_timeout)
    ready_s = time.monotonic() - t_start
    try:
        model = httpx.get(f"{root}/v1/models", timeout=30.0).json()["data"][0]["id"]
        before = parse_metrics(httpx.get(f"{root}/metrics", timeout=30.0).text)
        print(
            f"bench_soak: ready in {ready_s:.1f}s; {cfg.concurrency} streams for {cfg.duration_s:.0f}s",
            flush=True,
        )
        outcomes, mon, load_s, drained, gaps = asyncio.run(run_load(cfg, root, model, injector, proc.pid))
        after = settled_metrics(root, cfg.settle_timeout_s)
    finally:
        exit_code = stop_server(proc)
    log_text = log_path.read_text(errors="replace")
    a.command = shlex.join(["python", "-m", "benchmarks.bench_soak", *argv])
    return report(
        a,
        cfg,
        sha,
        stamp,
        out,
        log_path,
        spec,
        cmd,
        ready_s,
        outcomes,
        mon,
        load_s,
        drained,
        before,
        after,
        exit_code,
        log_text,
        gaps,
    )


def report(
    a: argparse.Namespace,
    cfg: SoakConfig,
    sha: str,
    stamp: datetime.datetime,
    out: Path,
    log_path: Path,
    spec: str,
    cmd: list[str],
    ready_s: float,
    outcomes: list[Outcome],
    mon: Monitor,
    load_s: float,
    drained: bool,
    before: dict[str, float],
    after: dict[str, float],
    exit_code: int,
    log_text: str,
    gaps: GapWindows | None = None,
) -> int:
    counts = Counter(o.kind for o in outcomes)
    injected = [o for o in outcomes if o.kind == INJECTED]
    by_site = Counter(o.site for o in injected if o.site)
    targeted = sum(1 for o in outcomes if o.site)
    unexpected = [o for o in outcomes if o.kind == UNEXPECTED]
    five_xx = sum(1 for o in unexpected if (o.status or 0) >= 500)
    unlogged = verify_in_log(log_text, injected)
    checks = pool_checks(before, after, counts, by_site)
    checks += [
        ("0 unexpected request outcomes", not unexpected, f"{len(unexpected)}"),
        ("0 5xx beyond the injected ones", five_xx == 0, f"{five_xx}"),
        ("every injected failure logged as injected", not unlogged, f"{len(unlogged)} not"),
        ("every fault was injected", targeted > 0, f"{targeted} targeted requests"),
        ("/health 200 throughout", not mon.health_failures, f"{len(mon.health_failures)} failures"),
        ("in-flight requests finished after the duration", drained, f"within {cfg.drain_timeout_s:.0f}s"),
        ("server exit 0 on SIGTERM", exit_code == 0, f"{exit_code}"),
    ]
    checks += steady_checks(cfg, mon, gaps or GapWindows(0.0, cfg.window_s))
    ok = all(c[1] for c in checks)
    tokens = sum(o.tokens for o in outcomes)
    rows = [
        (
            "requests",
            f"{len(outcomes)} in {load_s:.1f}s ({len(outcomes) / load_s:.1f}/s), {tokens} tokens "
            f"streamed ({tokens / load_s:.0f} tok/s)",
        ),
        ("completed", f"{counts[COMPLETED]}"),
        (
            "injected failures (expected)",
            f"{counts[INJECTED]} ({', '.join(f'{k} {v}' for k, v in sorted(by_site.items()))})",
        ),
        ("disconnects", f"{counts[DISCONNECTED]}"),
        ("slow readers", f"{sum(1 for o in outcomes if o.slow)} (a pause of {cfg.slow_read_s:g}s per event)"),
        (
            "inter-token p99 by window (ms)",
            ", ".join(f"{v:.0f}" for v in (gaps.p99_ms().values() if gaps else [])) or "n/a",
        ),
        ("server RSS (GiB, first / last sample)", _rss_span(mon)),
        ("unexpected errors", f"{len(unexpected)} ({five_xx} with 5xx)"),
        ("peak running / waiting", f"{mon.peak_running:.0f} / {mon.peak_waiting:.0f}"),
        ("worst /health", f"{mon.worst_health_ms:.0f} ms"),
        (
            "JIT compilations after ready (not a check)",
            f"+{delta(after, before, 'hyserve_jit_compiles_after_ready_total'):.0f}",
        ),
    ]
    rows += [(f"[{'ok' if c[1] else 'FAIL'}] {c[0]}", c[2]) for c in checks]
    print(table(rows))
    for o in unexpected[:20]:
        print(f"  unexpected: request {o.index} id {o.request_id} status {o.status}: {o.detail}")
    for line in unlogged[:10]:
        print(f"  unlogged: {line}")
    result = {
        "benchmark": "soak",
        "date": stamp.isoformat(timespec="seconds"),
        "git_sha": sha,
        "gpu": gpu_name(),
        "command": a.command,
        "server_command": shlex.join(cmd),
        "fault_inject": spec,
        "server_log": str(log_path),
        "config": asdict(cfg),
        "ready_s": round(ready_s, 1),
        "load_s": round(load_s, 1),
        "requests": len(outcomes),
        "tokens": tokens,
        "counts": {k: counts[k] for k in (COMPLETED, INJECTED, DISCONNECTED, UNEXPECTED)},
        "injected_by_site": dict(by_site),
        "targeted": targeted,
        "unexpected_5xx": five_xx,
        "unexpected_examples": [asdict(o) for o in unexpected[:50]],
        "unlogged_injected": unlogged[:50],
        "health_failures": mon.health_failures[:50],
        "peak_running": mon.peak_running,
        "peak_waiting": mon.peak_waiting,
        "worst_health_ms": round(mon.worst_health_ms, 1),
        "rss_bytes": mon.rss,
        "itl_p99_ms_by_window": {} if gaps is None else gaps.p99_ms(),
        "checks": [{"check": c[0], "ok": c[1], "detail": c[2]} for c in checks],
        "metrics_before": {
            k: v for k, v in before.items() if k.startswith("hyserve_") and "_bucket" not in k
        },
        "metrics_after": {k: v for k, v in after.items() if k.startswith("hyserve_") and "_bucket" not in k},
        "server_exit": exit_code,
        "ok": ok,
    }
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"bench_soak: {'OK' if ok else 'FAILED'}; wrote {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
