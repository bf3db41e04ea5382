"""The serving stack's host ceiling: output tokens per second `hyserve serve` sustains when the model costs
nothing (CPU; no GPU needed).

The model's forward and logits are replaced by stubs that cost ~nothing (the logits pick a different ordinary
token each row and step, so detokenising and streaming do real work); everything else is what `hyserve serve`
runs: the HTTP server and its SSE streams, request validation, the async engine thread, the scheduler, block
allocation and prefix-cache hashing of every prompt, the sampler over [batch, vocab] logits, incremental
detokenisation with the real tokenizer, stop checks. A load generator in this process (`hyserve bench serve`'s
client, streaming /v1/completions with token-id prompts) holds `--concurrency` requests in flight.

Whatever rate comes out is the most any GPU could serve through this stack on this host: a GPU run is
host-bound wherever its own rate approaches it. The reference is vLLM's published figure
(Nemotron 3 Nano 30B-A3B, FP8, one H200, 1000 in / 1000 out at concurrency 1024: 15,828 output tok/s):
a ratio under 1 at that concurrency means this host could not serve that figure whatever the GPU does.
The server's and the client's CPU seconds over each run say which side was saturated (each is one process;
the server's engine thread and its event loop share one interpreter).

    python -m benchmarks.bench_serve_host                               # concurrency 64, 256, 1024
    python -m benchmarks.bench_serve_host --concurrency 64 --output-len 32 --prompts-per-stream 1   # quick

Writes benchmarks/results/serve_host_<date>_<sha>.json and .md.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.host_results import write_host_results  # noqa: E402
from benchmarks.procfs import cpu_seconds  # noqa: E402

VLLM_FP8_30B_C1024 = 15828.0  # output tok/s: vLLM's published figure, concurrency 1024


def _stub_model(model, vocab: int) -> None:
    """Forward and logits at ~no cost: hidden states of zeros, and logits that make row r of call c pick
    token 100 + (c + r) % span, span = min(2000, vocab - 100) (ordinary tokens of the built-in tokenizer).

    The logits of n rows live in one buffer per n, kept between calls (a fresh [n, vocab] tensor per step
    would cost the host a large allocation that a GPU's logits never do); only the ones set by the
    previous call are cleared. Greedy sampling without penalties leaves the logits as they are."""
    import torch

    hidden = model.config.hidden_size
    calls = [0]
    span = min(2000, vocab - 100)
    buffers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}

    def forward(ids, meta, cache):
        return torch.zeros(ids.shape[0], hidden)

    def logits(h, out=None):
        n = h.shape[0]
        buf, hot = buffers.get(n) or (torch.zeros(n, vocab), None)
        rows = torch.arange(n)
        if hot is not None:
            buf[rows, hot] = 0.0
        hot = 100 + (calls[0] + rows) % span
        buf[rows, hot] = 1.0
        buffers[n] = (buf, hot)
        calls[0] += 1
        return buf

    model.forward = forward
    model.compute_logits = logits


def stub_engine_options(max_batch_size: int, max_seq_len: int) -> dict[str, Any]:
    """Engine options of the stub-model benchmarks: the built-in tiny model on the CPU, its KV cache sized
    for `max_batch_size` requests of `max_seq_len` tokens (the tiny model keeps 512 bytes a token; twice that
    leaves room for the prefix cache's Mamba snapshots), at least 256 MiB. A fixed large budget would have
    every run zero gigabytes of host memory it never touches."""
    cache_bytes = max(256 * 2**20, max_batch_size * max_seq_len * 1024)
    return {
        "device": "cpu",
        "max_batch_size": max_batch_size,
        "max_num_tokens": 16384,
        "max_seq_len": max_seq_len,
        "warmup": "off",
        "kv_cache_config": {"tokens_per_block": 64, "max_gpu_total_bytes": cache_bytes},
    }


def serve_stub(port: int, max_batch_size: int, max_seq_len: int, ready: mp.Event) -> None:
    """The child process: `hyserve serve`'s app over the built-in tiny model with the stub model."""
    import uvicorn

    from hyserve.config import build_engine_config
    from hyserve.engine.async_engine import AsyncEngine
    from hyserve.engine.gc_tuning import settle_for_serving
    from hyserve.server.app import build_app
    from hyserve.server.state import ServerOptions

    logging.disable(logging.WARNING)
    config = build_engine_config(stub_engine_options(max_batch_size, max_seq_len))
    engine = AsyncEngine(config, log=lambda s: None)
    model = engine.engine.runner.model
    _stub_model(model, model.config.vocab_size)
    engine.start()
    app = build_app(engine, ServerOptions(port=port, access_log=False, log_level="warning"))
    app.state.accepting = True
    settle_for_serving()  # as `hyserve serve` does
    server = uvicorn.Server(
        uvicorn.Config(
            app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off"
        )
    )
    ready.set()
    server.run()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: mp.Process, timeout_s: float = 300.0) -> None:
    import httpx

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if not proc.is_alive():
            raise RuntimeError(f"the stub server exited with code {proc.exitcode}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the stub server did not become healthy in {timeout_s:.0f} s")


def run_point(
    base_url: str,
    pid: int,
    concurrency: int,
    prompts: int,
    input_len: int,
    output_len: int,
    seed: int,
    *,
    range_ratio: float = 0.0,
) -> dict:
    from hyserve.bench.serve import DatasetOptions, ServeBenchOptions, run_serve_bench

    opts = ServeBenchOptions(
        base_url=base_url,
        endpoint="/v1/completions",
        max_concurrency=concurrency,
        ignore_eos=True,
        seed=seed,
        dataset=DatasetOptions(
            num_prompts=prompts, input_len=input_len, output_len=output_len, range_ratio=range_ratio
        ),
    )
    srv0, cli0 = cpu_seconds(pid), resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    out = run_serve_bench(opts, log=lambda s: print("   ", s, flush=True))
    wall = time.perf_counter() - t0
    cli1 = resource.getrusage(resource.RUSAGE_SELF)
    m = out["points"][0]["reps"][0]
    return {
        "concurrency": concurrency,
        "prompts": prompts,
        "completed": m["completed"],
        "failed": m["failed"],
        "output_tok_s": m["output_throughput"],
        "p50_tpot_ms": m["p50_tpot_ms"],
        "p99_tpot_ms": m["p99_tpot_ms"],
        "p99_itl_ms": m["p99_itl_ms"],
        "p50_ttft_ms": m["p50_ttft_ms"],
        "p99_ttft_ms": m["p99_ttft_ms"],
        "duration_s": m["duration_s"],
        "server_cpu_share": (cpu_seconds(pid) - srv0) / wall,
        "client_cpu_share": ((cli1.ru_utime + cli1.ru_stime) - (cli0.ru_utime + cli0.ru_stime)) / wall,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument(
        "--output-len",
        type=int,
        default=200,
        help="tokens a request generates (the published figure uses 1000; 200 keeps a point near a minute)",
    )
    ap.add_argument(
        "--prompts-per-stream", type=int, default=2, help="requests per point: this x concurrency"
    )
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--git-sha", default="")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    biggest = max(args.concurrency)
    port = _free_port()
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(
        target=serve_stub, args=(port, biggest, args.input_len + args.output_len + 64, ready), daemon=True
    )
    proc.start()
    base = f"http://127.0.0.1:{port}"
    rows = []
    try:
        _wait_healthy(base, proc)
        for i, c in enumerate(args.concurrency):
            print(
                f"concurrency {c}: {args.prompts_per_stream * c} requests of {args.input_len} in / "
                f"{args.output_len} out",
                flush=True,
            )
            r = run_point(
                base, proc.pid, c, args.prompts_per_stream * c, args.input_len, args.output_len, seed=i
            )
            rows.append(r)
            print(
                f"    {r['output_tok_s']:.0f} output tok/s, TPOT p50 {r['p50_tpot_ms']:.1f} ms, server CPU "
                f"{r['server_cpu_share']:.2f}, client CPU {r['client_cpu_share']:.2f}",
                flush=True,
            )
    finally:
        proc.terminate()
        proc.join(10)
    head = [
        "| concurrency | requests | output tok/s | / vLLM 30B-A3B FP8 H200 c1024 (15,828) | TPOT p50 / p99 "
        "ms | TTFT p50 / p99 ms | server CPU (cores) | client CPU (cores) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines = [
        f"| {r['concurrency']} | {r['completed']} ok, {r['failed']} failed | {r['output_tok_s']:.0f} "
        f"| {r['output_tok_s'] / VLLM_FP8_30B_C1024:.2f} | {r['p50_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} "
        f"| {r['p50_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['server_cpu_share']:.2f} "
        f"| {r['client_cpu_share']:.2f} |"
        for r in rows
    ]
    print(*head, *lines, sep="\n")
    records = [
        dict(
            name=f"serving stack host ceiling, concurrency {r['concurrency']}, {args.input_len} in / "
            f"{args.output_len} out",
            value=r["output_tok_s"],
            unit="output tok/s",
            reference="vLLM, Nemotron 3 Nano 30B-A3B FP8, one H200, concurrency 1024 (published)",
            reference_value=VLLM_FP8_30B_C1024,
            ratio=r["output_tok_s"] / VLLM_FP8_30B_C1024,
            **r,
        )
        for r in rows
    ]
    write_host_results(
        "serve_host",
        args.out,
        args.git_sha,
        "none (host timing on the CPU, stub model)",
        records,
        [*head, *lines],
    )
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
