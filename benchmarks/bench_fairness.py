"""A long prompt never stalls everyone else (docs/architecture.md, "Step composition"): the serving benchmark.

For each `max_step_ms` setting given on the command line, a fresh `hyserve serve` (a subprocess, with the
long-prompt report's YAML and that setting) serves

  1. the long prompt alone (token ids on /v1/completions, max_tokens 1): its end-to-end time;
  2. another long prompt of the same length (other ids: no prefix-cache hit) while `--streams` streams decode
     (closed loop: each stream sends its next request as soon as one ends) and a short chat request is sent
     every `--short-interval-s`: the short requests' TTFT, the streams' inter-token latency over the long
     prompt's lifetime, the long prompt's time and its ratio to (1) on the same server.

The long request is sent from a child process, so encoding its 1M-id body never stalls the client's
timing of the streams. A table is printed; the JSON (date, git sha, GPU, exact command, every setting)
goes to benchmarks/results/ after every setting, with a PNG when matplotlib is installed.

    python -m benchmarks.bench_fairness --max-step-ms off,100,150,250        # the H200 run (9B, 1M tokens)
    python -m benchmarks.bench_fairness --model '' --long-len 3000 ...      # CPU smoke (the tiny model)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import datetime as dt
import json
import math
import multiprocessing
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import invocation  # noqa: E402
from hyserve.bench.datasets import ids_to_text, random_ids  # noqa: E402
from hyserve.bench.http_client import (  # noqa: E402
    CHAT,
    COMPLETIONS,
    build_payload,
    first_model_id,
    join_url,
    scrape_counters,
    send_streaming,
    stream_client,
)
from hyserve.bench.metrics import RequestResult, percentile  # noqa: E402
from hyserve.bench.needle import parse_size  # noqa: E402
from hyserve.bench.report import format_table, record, sanitize, stamp  # noqa: E402

NANO_9B = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"
CLOCK = time.monotonic  # CLOCK_MONOTONIC: one time line for this process and the long request's child
# the server log lines worth keeping in the result (capacity plan, warm-up, the calibrated step cost model)
LOG_KEYS = (
    "capacity plan",
    "KV cache",
    "Mamba state",
    "longest single request",
    "warm-up",
    "step cost model",
    "captured",
    "warning",
)


@dataclass(frozen=True, kw_only=True)
class FairnessOptions:
    model: str | None = str(NANO_9B)  # None: the built-in tiny model
    load_format: str | None = None  # None: dummy for a model directory, the default for the tiny model
    device: str = "auto"
    step_ms: tuple[float | None, ...] = (None, 100.0, 150.0, 250.0)  # None: off
    long_len: int = 1_000_000
    streams: int = 8
    stream_input_len: int = 512
    stream_output_len: int = 256
    short_interval_s: float = 1.0
    short_input_len: int = 32  # words of the short chat message
    short_output_len: int = (
        1  # 1: the finish chunk carries the first token, so TTFT is exact for any tokenizer
    )
    lead_in_s: float = 5.0  # the streams decode this long before the long prompt is sent
    max_batch_size: int = 16
    max_num_tokens: int = 16384
    max_seq_len: int = 1_048_576
    kv_cache_dtype: str = "fp8"  # the report's; auto = the model dtype (bf16)
    vocab_size: int | None = None  # None: the model's config.json
    min_token_id: int = 1000
    seed: int = 0
    startup_timeout_s: float = 900.0
    request_timeout_s: float = 3600.0
    time_budget_s: float | None = None  # start no further setting once the next would likely not fit
    serve_args: tuple[str, ...] = ()
    target_ttft_p99_s: float = 1.0
    target_itl_p99_ms: float = 200.0
    target_ratio: float = 1.15
    target_alone_s: float = 100.0


# ---- the server ------------------------------------------------------------------------------------------


def report_yaml(opts: FairnessOptions, max_step_ms: float | None) -> str:
    """The long-prompt report's extra-llm-api-config.yml with this run's sizes and step-time target. Keys
    of TensorRT-LLM's engine internals stay in: hyserve accepts them with one warning."""
    step = "null" if max_step_ms is None else f"{max_step_ms:g}"
    return f"""\
backend: pytorch
enable_chunked_prefill: true
disable_overlap_scheduler: true
enable_attention_dp: false
max_batch_size: {opts.max_batch_size}
max_num_tokens: {opts.max_num_tokens}
max_seq_len: {opts.max_seq_len}
max_step_ms: {step}
trust_remote_code: true
cuda_graph_config:
  enable_padding: true
  max_batch_size: {opts.max_batch_size}
kv_cache_config:
  dtype: {opts.kv_cache_dtype}
  free_gpu_memory_fraction: 0.8
  enable_block_reuse: true
  tokens_per_block: 64
  mamba_ssm_cache_dtype: float16
  mamba_ssm_stochastic_rounding: true
  mamba_ssm_philox_rounds: 5
  mamba_state_config:
    periodic_snapshot_interval: 256
    additional_snapshot_offsets_from_end:
      - 0
moe_config:
  backend: TRTLLM
"""


def model_dir_for_chat(model: str | None, work: Path) -> str | None:
    """The model directory to serve. An architecture directory without a tokenizer (benchmarks/configs) is
    paired with the built-in byte-level tokenizer, so the short requests can use the chat endpoint."""
    if model is None:
        return None
    src = Path(model)
    if not (src / "config.json").is_file():
        raise SystemExit(f"--model {model}: no config.json there (a Hugging Face model directory is needed)")
    if (src / "tokenizer.json").is_file():
        return str(src)
    from hyserve.model.tiny import builtin_model_dir

    dst = work / src.name
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "config.json", dst / "config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_model_dir() / f, dst / f)
    return str(dst)


def model_vocab(model_dir: str | None) -> int:
    from hyserve.model.tiny import builtin_model_dir

    cfg = json.loads(
        (Path(model_dir) if model_dir else builtin_model_dir()).joinpath("config.json").read_text()
    )
    return int(cfg["vocab_size"])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`python -m hyserve.cli serve ...` on a free loopback port, its output in a log file."""

    def __init__(self, cmd: list[str], log_path: Path, port: int) -> None:
        self.cmd, self.log_path, self.port = cmd, log_path, port
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = CLOCK()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        while CLOCK() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hyserve serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    self.ready_s = CLOCK() - t0
                    return
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"hyserve serve was not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-n:])

    def log_excerpt(self) -> list[str]:
        return [ln for ln in self.log_text().splitlines() if any(k in ln for k in LOG_KEYS)][:40]


def serve_command(opts: FairnessOptions, model_dir: str | None, yaml_path: Path, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "hyserve.cli", "serve"]
    if model_dir is not None:
        cmd.append(model_dir)
    load = opts.load_format or ("dummy" if model_dir is not None else None)
    if load:
        cmd += ["--load-format", load]
    cmd += [
        "--config",
        str(yaml_path),
        "--device",
        opts.device,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-log-requests",
        "--shutdown-timeout",
        "5",
        *opts.serve_args,
    ]
    return cmd


# ---- the requests ----------------------------------------------------------------------------------------


def long_ids(n: int, *, seed: int, low: int, vocab: int) -> list[int]:
    return random_ids(random.Random(seed), n, low, vocab)


def _exit_with_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)  # the benchmark was stopped (a timeout): do not keep its output pipe open


def _long_request_child(
    url: str,
    model: str,
    n: int,
    seed: int,
    low: int,
    vocab: int,
    run_start: float,
    timeout_s: float,
    parent: int,
) -> RequestResult:
    """Runs in a child process: build the long prompt and send it, timed on CLOCK (shared with the parent)."""
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    ids = long_ids(n, seed=seed, low=low, vocab=vocab)
    payload = build_payload(COMPLETIONS, model, ids, 1, ignore_eos=True, temperature=0.0)

    async def go() -> RequestResult:
        async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=30.0)) as client:
            return await send_streaming(
                stream_client(url, client, timeout_s),
                url,
                payload,
                kind=COMPLETIONS,
                prompt_len=n,
                run_start=run_start,
                clock=CLOCK,
            )

    return asyncio.run(go())


class LongSender:
    """A one-process pool (spawned once, before any timing) that sends the long request."""

    def __init__(self) -> None:
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        self.pool.submit(math.sqrt, 1.0).result()  # start the child now, not while timing

    async def send(
        self,
        url: str,
        model: str,
        n: int,
        *,
        seed: int,
        low: int,
        vocab: int,
        run_start: float,
        timeout_s: float,
    ) -> RequestResult:
        fut = self.pool.submit(
            _long_request_child, url, model, n, seed, low, vocab, run_start, timeout_s, os.getpid()
        )
        return await asyncio.wrap_future(fut)

    def close(self, *, wait: bool = True) -> None:
        self.pool.shutdown(wait=wait, cancel_futures=True)


def chunk_times(r: RequestResult, run_start: float) -> list[float]:
    """The CLOCK time of each output chunk of a streamed request (from its start, TTFT and ITLs)."""
    if r.ttft_s is None:
        return []
    t = run_start + r.start_s + r.ttft_s
    out = [t]
    for gap in r.itl_s:
        t += gap
        out.append(t)
    return out


def window_gaps_ms(results: Sequence[RequestResult], run_start: float, lo: float, hi: float) -> list[float]:
    """Inter-token gaps (ms) of the streams that end inside [lo, hi]: the ITL the long prompt's steps
    cause."""
    out = []
    for r in results:
        ts = chunk_times(r, run_start)
        out += [(b - a) * 1e3 for a, b in zip(ts, ts[1:]) if lo <= b <= hi]
    return out


def stats(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": sum(values) / len(values),
    }


async def contended(
    client: httpx.AsyncClient,
    sender: LongSender,
    srv: Server,
    model: str,
    opts: FairnessOptions,
    vocab: int,
    seed: int,
) -> dict[str, Any]:
    """Streams decoding, then the long prompt, with a short chat request every interval until it ends."""
    comp_url = join_url(srv.url, "/v1/completions")
    chat_url = join_url(srv.url, "/v1/chat/completions")
    streams = stream_client(comp_url, client, opts.request_timeout_s)  # the measured requests' client
    rng = random.Random(seed)
    stop = asyncio.Event()
    stream_results: list[RequestResult] = []
    short_results: list[RequestResult] = []
    run_start = CLOCK()

    async def stream_slot(k: int) -> None:
        while not stop.is_set():
            ids = random_ids(rng, opts.stream_input_len, opts.min_token_id, vocab)
            payload = build_payload(
                COMPLETIONS, model, ids, opts.stream_output_len, ignore_eos=True, temperature=0.0
            )
            r = await send_streaming(
                streams,
                comp_url,
                payload,
                kind=COMPLETIONS,
                prompt_len=len(ids),
                run_start=run_start,
                clock=CLOCK,
            )
            stream_results.append(r)
            if not r.ok:
                return

    async def one_short(i: int) -> None:
        text = f"request {i}: " + ids_to_text(random_ids(rng, opts.short_input_len, 0, 1 << 20))
        payload = build_payload(CHAT, model, text, opts.short_output_len, ignore_eos=True, temperature=0.0)
        short_results.append(
            await send_streaming(
                streams,
                chat_url,
                payload,
                kind=CHAT,
                prompt_len=opts.short_input_len,
                run_start=run_start,
                clock=CLOCK,
            )
        )

    before = await scrape_counters(client, srv.url, {})
    slots = [asyncio.create_task(stream_slot(k)) for k in range(opts.streams)]
    await asyncio.sleep(opts.lead_in_s)
    long_task = asyncio.create_task(
        sender.send(
            comp_url,
            model,
            opts.long_len,
            seed=seed + 1,
            low=opts.min_token_id,
            vocab=vocab,
            run_start=run_start,
            timeout_s=opts.request_timeout_s,
        )
    )
    long_sent = CLOCK()
    shorts: list[asyncio.Task[None]] = []
    i = 0
    while not long_task.done():  # a short request every interval while the long prompt runs
        shorts.append(asyncio.create_task(one_short(i)))
        i += 1
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(
                asyncio.shield(long_task), timeout=long_sent + i * opts.short_interval_s - CLOCK()
            )
    long_res = long_task.result()
    long_end = run_start + long_res.start_s + long_res.e2el_s
    stop.set()
    await asyncio.gather(*shorts, *slots)
    after = await scrape_counters(client, srv.url, {})
    gaps = window_gaps_ms(stream_results, run_start, long_res.start_s + run_start, long_end)
    all_gaps = [g * 1e3 for r in stream_results for g in r.itl_s]
    ttfts = [r.ttft_s for r in short_results if r.ok and r.ttft_s is not None]
    return {
        "long": long_result_json(long_res),
        "shorts": {
            "sent": len(short_results),
            "ok": sum(r.ok for r in short_results),
            "errors": sorted({r.error for r in short_results if r.error})[:5],
            "ttft_s": stats(ttfts),
            "e2el_s": stats([r.e2el_s for r in short_results if r.ok]),
            "ttft_values_s": ttfts,
        },
        "streams": {
            "requests": len(stream_results),
            "ok": sum(r.ok for r in stream_results),
            "errors": sorted({r.error for r in stream_results if r.error})[:5],
            "output_tokens": sum(r.output_tokens for r in stream_results),
            "itl_ms_during_long": stats(gaps),
            "itl_ms_all": stats(all_gaps),
        },
        "server_counters": counter_delta(before, after),
    }


def long_result_json(r: RequestResult) -> dict[str, Any]:
    return {
        "ok": r.ok,
        "e2el_s": r.e2el_s,
        "prompt_tokens": r.usage_prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "status": r.status,
        "error": r.error,
    }


async def measure(
    srv: Server, sender: LongSender, opts: FairnessOptions, vocab: int, seed: int
) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=opts.streams + 64, max_keepalive_connections=opts.streams + 64)
    async with httpx.AsyncClient(
        limits=limits, timeout=httpx.Timeout(opts.request_timeout_s, connect=30.0)
    ) as client:
        model = await first_model_id(client, srv.url, {})
        # one short request of each kind first: the client's connections and the server's HTTP path are warm
        for kind, prompt, path in (
            (COMPLETIONS, [opts.min_token_id] * 8, "/v1/completions"),
            (CHAT, "hello", "/v1/chat/completions"),
        ):
            r = await send_streaming(
                client,
                join_url(srv.url, path),
                build_payload(kind, model, prompt, 2, ignore_eos=True, temperature=0.0),
                kind=kind,
                prompt_len=8,
                clock=CLOCK,
            )
            if not r.ok:
                raise RuntimeError(f"warm-up request to {path} failed: {r.error}")
        t0 = CLOCK()
        before = await scrape_counters(client, srv.url, {})
        alone = await sender.send(
            join_url(srv.url, "/v1/completions"),
            model,
            opts.long_len,
            seed=seed,
            low=opts.min_token_id,
            vocab=vocab,
            run_start=t0,
            timeout_s=opts.request_timeout_s,
        )
        if not alone.ok:
            raise RuntimeError(f"the long prompt alone failed: {alone.error}")
        after = await scrape_counters(client, srv.url, {})
        busy = await contended(client, sender, srv, model, opts, vocab, seed + 10)
    return {
        "model": model,
        "alone": {**long_result_json(alone), "server_counters": counter_delta(before, after)},
        "contended": busy,
    }


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server's counters over an interval, with the step shape they imply: steps, prefill steps, the mean
    prefill tokens a prefill step carried (the long prompt's chunks, with the short requests' prompts)."""
    d = {k: v - before.get(k, 0.0) for k, v in after.items()}
    if d.get("engine_prefill_steps"):
        d["mean_prefill_tokens_per_prefill_step"] = (
            d.get("prefill_tokens_scheduled", 0.0) / d["engine_prefill_steps"]
        )
    return d


# ---- one setting, the summary ----------------------------------------------------------------------------


def step_label(ms: float | None) -> str:
    return "off" if ms is None else f"{ms:g}"


def checks(s: dict[str, Any], opts: FairnessOptions) -> dict[str, bool | None]:
    c = s["contended"]
    ttft, itl = c["shorts"]["ttft_s"]["p99"], c["streams"]["itl_ms_during_long"]["p99"]
    ratio = s.get("ratio")
    return {
        "short_ttft_p99": None if ttft is None else ttft <= opts.target_ttft_p99_s,
        "stream_itl_p99": None if itl is None else itl <= opts.target_itl_p99_ms,
        "long_ratio": None if ratio is None else ratio <= opts.target_ratio,
        "long_alone": s["alone"]["e2el_s"] <= opts.target_alone_s,
        "all_ok": (
            c["long"]["ok"]
            and c["shorts"]["ok"] == c["shorts"]["sent"]
            and c["streams"]["ok"] == c["streams"]["requests"]
        ),
    }


def run_setting(
    opts: FairnessOptions,
    ms: float | None,
    model_dir: str | None,
    vocab: int,
    work: Path,
    sender: LongSender,
    seed: int,
) -> dict[str, Any]:
    yaml_text = report_yaml(opts, ms)
    yml = work / f"fairness_{step_label(ms)}.yml"
    yml.write_text(yaml_text)
    port = free_port()
    cmd = serve_command(opts, model_dir, yml, port)
    srv = Server(cmd, work / f"serve_{step_label(ms)}.log", port)
    t0 = CLOCK()
    srv.start(opts.startup_timeout_s)
    try:
        out = asyncio.run(measure(srv, sender, opts, vocab, seed))
    finally:
        rc = srv.stop()
    alone, busy = out["alone"]["e2el_s"], out["contended"]["long"]["e2el_s"]
    s: dict[str, Any] = {
        "max_step_ms": ms,
        "yaml": yaml_text,
        "serve_command": cmd,
        "server_ready_s": srv.ready_s,
        "server_exit": rc,
        "server_log": srv.log_excerpt(),
        **out,
        "ratio": busy / alone if out["contended"]["long"]["ok"] and alone > 0 else None,
        "wall_s": CLOCK() - t0,
    }
    s["checks"] = checks(s, opts)
    return s


def table(settings: Sequence[dict[str, Any]]) -> str:
    rows = []
    for s in settings:
        c = s["contended"]
        t, i = c["shorts"]["ttft_s"], c["streams"]["itl_ms_during_long"]
        rows.append(
            [
                step_label(s["max_step_ms"]),
                s["alone"]["e2el_s"],
                c["long"]["e2el_s"],
                s["ratio"],
                None if t["p50"] is None else t["p50"] * 1e3,
                None if t["p99"] is None else t["p99"] * 1e3,
                f"{c['shorts']['ok']}/{c['shorts']['sent']}",
                i["p50"],
                i["p99"],
                i["max"],
                int(c["server_counters"].get("num_preemptions", 0)),
                _steps(s["alone"].get("server_counters", {})),
                _steps(c["server_counters"]),
                "yes" if all(v is not False for v in s["checks"].values()) else "no",
            ]
        )
    return format_table(
        [
            "max_step_ms",
            "alone s",
            "beside s",
            "ratio",
            "short TTFT p50 ms",
            "p99 ms",
            "shorts ok",
            "stream ITL p50 ms",
            "p99 ms",
            "max ms",
            "preempt",
            "prefill steps x tokens alone",
            "beside",
            "targets met",
        ],
        rows,
    )


def _steps(counters: dict[str, float]) -> str:
    """'prefill steps x mean prefill tokens' of an interval ('-' where the server reports no steps)."""
    n = counters.get("engine_prefill_steps")
    if not n:
        return "-"
    return f"{int(n)} x {counters.get('mean_prefill_tokens_per_prefill_step', 0.0):,.0f}"


def pick_default(settings: Sequence[dict[str, Any]]) -> float | str | None:
    """The setting that meets every target with the fastest long prompt alone ("off" is a valid answer)."""
    ok = [
        s
        for s in settings
        if all(v is not False for v in s["checks"].values()) and None not in s["checks"].values()
    ]
    if not ok:
        return None
    best = min(ok, key=lambda s: s["alone"]["e2el_s"])
    return "off" if best["max_step_ms"] is None else best["max_step_ms"]


def records(settings: Sequence[dict[str, Any]], opts: FairnessOptions) -> list[dict[str, Any]]:
    out = []
    for s in settings:
        lab = f"max_step_ms {step_label(s['max_step_ms'])}"
        c = s["contended"]
        t99 = c["shorts"]["ttft_s"]["p99"]
        out += [
            record(f"{lab}: long prompt alone", s["alone"]["e2el_s"], "s", "target", opts.target_alone_s),
            record(
                f"{lab}: long prompt beside the streams",
                c["long"]["e2el_s"],
                "s",
                "alone, same server",
                s["alone"]["e2el_s"],
            ),
            record(
                f"{lab}: short-request TTFT p99",
                None if t99 is None else t99 * 1e3,
                "ms",
                "target",
                opts.target_ttft_p99_s * 1e3,
            ),
            record(
                f"{lab}: stream ITL p99 during the long prompt",
                c["streams"]["itl_ms_during_long"]["p99"],
                "ms",
                "target",
                opts.target_itl_p99_ms,
            ),
        ]
    return out


def write_png(settings: Sequence[dict[str, Any]], path: Path, opts: FairnessOptions) -> Path | None:
    from hyserve.bench.plots import matplotlib_available

    if not matplotlib_available() or not settings:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [step_label(s["max_step_ms"]) for s in settings]
    panels = [
        (
            "short-request TTFT p99 (ms)",
            [(s["contended"]["shorts"]["ttft_s"]["p99"] or 0) * 1e3 for s in settings],
            opts.target_ttft_p99_s * 1e3,
        ),
        (
            "stream ITL p99 during the long prompt (ms)",
            [s["contended"]["streams"]["itl_ms_during_long"]["p99"] or 0 for s in settings],
            opts.target_itl_p99_ms,
        ),
        ("long prompt beside / alone", [s["ratio"] or 0 for s in settings], opts.target_ratio),
        ("long prompt alone (s)", [s["alone"]["e2el_s"] for s in settings], opts.target_alone_s),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6))
    for ax, (title, vals, target) in zip(axes, panels):
        ax.bar(labels, vals, color="tab:blue")
        ax.axhline(target, color="tab:red", linestyle="--", label="target")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("max_step_ms")
    axes[0].legend(fontsize=8)
    fig.suptitle(
        f"a {opts.long_len:,}-token prompt beside {opts.streams} streams and a short request every "
        f"{opts.short_interval_s:g} s",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---- the command line ------------------------------------------------------------------------------------


def parse_step_ms(text: str) -> tuple[float | None, ...]:
    out: list[float | None] = []
    for part in text.split(","):
        p = part.strip().lower()
        if p in ("off", "none", "null"):
            out.append(None)
            continue
        try:
            v = float(p)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--max-step-ms: {part!r} is neither 'off' nor a number of ms"
            ) from None
        if not 0 < v < float("inf"):
            raise argparse.ArgumentTypeError(f"--max-step-ms: {part!r} must be > 0 ms (or 'off')")
        out.append(v)
    if not out or len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"--max-step-ms: give distinct settings, got {text!r}")
    return tuple(out)


def size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    d = FairnessOptions()
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        default=d.model,
        help="model directory (default: the Nano 9B v2 architecture with "
        "random weights); '' for the built-in tiny model",
    )
    ap.add_argument("--load-format", default=None, help="default: dummy for a model directory")
    ap.add_argument("--device", default=d.device, choices=("auto", "cpu", "cuda"))
    ap.add_argument(
        "--max-step-ms",
        type=parse_step_ms,
        default=d.step_ms,
        help="comma-separated settings, 'off' or ms (default off,100,150,250); a server each",
    )
    ap.add_argument("--long-len", type=size, default=d.long_len, help="the long prompt's tokens (default 1M)")
    ap.add_argument("--streams", type=int, default=d.streams)
    ap.add_argument("--stream-input-len", type=size, default=d.stream_input_len)
    ap.add_argument(
        "--stream-output-len",
        type=size,
        default=d.stream_output_len,
        help="tokens per stream request; a stream sends its next request when one ends",
    )
    ap.add_argument("--short-interval-s", type=float, default=d.short_interval_s)
    ap.add_argument(
        "--short-input-len", type=int, default=d.short_input_len, help="words of the short message"
    )
    ap.add_argument("--short-output-len", type=int, default=d.short_output_len)
    ap.add_argument("--lead-in-s", type=float, default=d.lead_in_s)
    ap.add_argument(
        "--max-batch-size",
        type=int,
        default=d.max_batch_size,
        help="the report's YAML has 8; 8 streams + the long prompt + a short request need 10",
    )
    ap.add_argument("--max-num-tokens", type=size, default=d.max_num_tokens)
    ap.add_argument("--max-seq-len", type=size, default=d.max_seq_len)
    ap.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, help="fp8 (the report's) or auto (bf16)")
    ap.add_argument("--vocab-size", type=int, default=None, help="token ids of the prompts: [min, vocab)")
    ap.add_argument("--min-token-id", type=int, default=d.min_token_id)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--startup-timeout-s", type=float, default=d.startup_timeout_s)
    ap.add_argument("--request-timeout-s", type=float, default=d.request_timeout_s)
    ap.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="start no further setting when the last one's wall time would not fit what is left",
    )
    ap.add_argument("--serve-args", default="", help="more `hyserve serve` flags, one string")
    ap.add_argument("--result-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--result-filename", default=None, help="default fairness_<date>_<sha>_<settings>.json")
    ap.add_argument("--git-sha", default=None)
    return ap


def options_from(a: argparse.Namespace, ap: argparse.ArgumentParser) -> FairnessOptions:
    opts = FairnessOptions(
        model=a.model or None,
        load_format=a.load_format,
        device=a.device,
        step_ms=a.max_step_ms,
        long_len=a.long_len,
        streams=a.streams,
        stream_input_len=a.stream_input_len,
        stream_output_len=a.stream_output_len,
        short_interval_s=a.short_interval_s,
        short_input_len=a.short_input_len,
        short_output_len=a.short_output_len,
        lead_in_s=a.lead_in_s,
        max_batch_size=a.max_batch_size,
        max_num_tokens=a.max_num_tokens,
        max_seq_len=a.max_seq_len,
        kv_cache_dtype=a.kv_cache_dtype,
        vocab_size=a.vocab_size,
        min_token_id=a.min_token_id,
        seed=a.seed,
        startup_timeout_s=a.startup_timeout_s,
        request_timeout_s=a.request_timeout_s,
        time_budget_s=a.time_budget_s,
        serve_args=tuple(shlex.split(a.serve_args)),
    )
    if opts.streams < 1 or opts.short_output_len < 1 or opts.short_input_len < 1:
        ap.error("--streams, --short-output-len and --short-input-len must be >= 1")
    if opts.short_interval_s <= 0 or opts.lead_in_s < 0:
        ap.error("--short-interval-s must be > 0 and --lead-in-s >= 0")
    if opts.max_batch_size < opts.streams + 2:
        ap.error(
            f"--max-batch-size {opts.max_batch_size} cannot run {opts.streams} streams, the long prompt and "
            f"a short request at once: it must be >= {opts.streams + 2}"
        )
    if opts.long_len + 1 > opts.max_seq_len:
        ap.error(f"--long-len {opts.long_len} + 1 output token exceeds --max-seq-len {opts.max_seq_len}")
    if opts.stream_input_len + opts.stream_output_len > opts.max_seq_len:
        ap.error(f"--stream-input-len + --stream-output-len exceed --max-seq-len {opts.max_seq_len}")
    return opts


def write_result(
    path: Path,
    head: dict[str, Any],
    opts: FairnessOptions,
    settings: list[dict[str, Any]],
    skipped: list[str],
) -> None:
    result = {
        **head,
        "config": asdict(opts),
        "settings": settings,
        "not_run": skipped,
        "suggested_max_step_ms": pick_default(settings),
        "records": records(settings, opts),
    }
    path.write_text(json.dumps(sanitize(result), indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    opts = options_from(a, ap)
    head = stamp(
        "fairness",
        invocation() if argv is None else ["python", "-m", "benchmarks.bench_fairness", *argv],
        a.git_sha,
    )
    steps = "-".join(step_label(m) for m in opts.step_ms)
    name = a.result_filename or f"fairness_{dt.date.today().isoformat()}_{head['git_sha']}_{steps}.json"
    out_path = Path(a.result_dir) / name
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # a SIGTERM (e.g. from `timeout`) unwinds through the finally blocks: the server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = CLOCK()
    settings: list[dict[str, Any]] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="hyserve-fairness-") as tmp:
        work = Path(tmp)
        model_dir = model_dir_for_chat(opts.model, work)
        vocab = opts.vocab_size or model_vocab(model_dir)
        if not 0 <= opts.min_token_id < vocab:
            ap.error(f"--min-token-id {opts.min_token_id} must be in [0, vocab size {vocab})")
        sender = LongSender()
        done = False
        try:
            for k, ms in enumerate(opts.step_ms):
                left = None if opts.time_budget_s is None else opts.time_budget_s - (CLOCK() - t_start)
                if left is not None and settings and settings[-1]["wall_s"] > left:
                    skipped = [step_label(m) for m in opts.step_ms[k:]]
                    print(
                        f"time budget: {left:.0f} s left, the last setting took "
                        f"{settings[-1]['wall_s']:.0f} s; not run: max_step_ms {', '.join(skipped)}",
                        flush=True,
                    )
                    break
                print(f"== max_step_ms {step_label(ms)}: server start", flush=True)
                s = run_setting(opts, ms, model_dir, vocab, work, sender, opts.seed + 100 * k)
                settings.append(s)
                c = s["contended"]
                print(
                    f"   ready in {s['server_ready_s']:.1f} s; alone {s['alone']['e2el_s']:.2f} s; beside "
                    f"the streams {c['long']['e2el_s']:.2f} s; short TTFT p99 "
                    f"{(c['shorts']['ttft_s']['p99'] or float('nan')) * 1e3:.0f} ms over "
                    f"{c['shorts']['sent']}; stream ITL p99 "
                    f"{c['streams']['itl_ms_during_long']['p99'] or float('nan'):.1f} ms",
                    flush=True,
                )
                for ln in s["server_log"]:
                    if "step cost model" in ln:
                        print(f"   {ln.strip()}", flush=True)
                write_result(
                    out_path, head, opts, settings, skipped
                )  # after every setting: a cut run keeps it
            done = True
        finally:
            sender.close(wait=done)
    write_result(out_path, head, opts, settings, skipped)
    print()
    print(table(settings))
    default = pick_default(settings)
    print(f"\nsuggested max_step_ms: {default if default is not None else 'none met every target'}")
    print(f"wrote {out_path}")
    png = write_png(settings, out_path.with_suffix(".png"), opts)
    if png is not None:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
