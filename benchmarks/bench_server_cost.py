"""What the HTTP server costs the engine: output tok/s of `hyserve serve` against `LLM.generate` on the
same workload, with a model that behaves like a GPU (CPU; no GPU needed).

The model's forward and logits are the stubs of `bench_serve_host.py` (ordinary tokens, ~no host cost),
and each step occupies an emulated device for `--step-ms` plus `--token-us` per token it runs: a step's
samples can be read only once every step launched before it and itself has had its time, and the host
waits for that with the interpreter lock released, as it waits for a CUDA event. Host work that overlaps
the emulated device is free, as it is on a GPU; host work that delays a launch shows up as lost
throughput. The defaults (35 ms + 16 us a token) follow Nemotron 3 Nano 30B-A3B FP8 on an H200: a
1,024-row decode step of ~51 ms (its measured graph replay at 1,000-token contexts) and prefill at ~60k
tok/s (its 8k prefill ratio).

Both sides run the same requests: `--concurrency` random-token prompts of `--input-len` tokens, each
generating `--output-len` tokens with ignore_eos. The engine side is `LLM.generate` over all of them at
once; the server side streams /v1/completions from `hyserve bench serve`'s client in another process,
`--concurrency` in flight. Their ratio is the share of the engine's throughput the server keeps.

    python -m benchmarks.bench_server_cost                       # concurrency 1024, 1000 in / 300 out
    python -m benchmarks.bench_server_cost --concurrency 256 --output-len 64   # quick

Writes benchmarks/results/server_cost_<date>_<sha>.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.bench_serve_host import _free_port, _stub_model, _wait_healthy, run_point, stub_engine_options
from benchmarks.host_results import write_host_results
from hyserve.bench.datasets import sample_lengths


@dataclass(frozen=True)
class Device:
    """The emulated device: a step takes `step_ms` plus `token_us` for each token it runs."""

    step_ms: float
    token_us: float
    eager_ms: float = 0.0  # host time of a step that runs the model eagerly (one with a prefill row)
    # kernel launches of that step: each releases the interpreter lock, as Triton's launcher does around
    # cuLaunchKernel (0: the step's host time is one held stretch)
    eager_launches: int = 0

    def step_s(self, tokens: int) -> float:
        return self.step_ms / 1e3 + self.token_us / 1e6 * tokens


def _hold_host(ms: float, launches: int = 0) -> None:
    """Keep the interpreter busy for `ms` (the lock held, as launching an eager forward's kernels does),
    releasing it `launches` times spread over that stretch: a thread that gives up the lock waits to get it
    back while another thread holds it, up to the switch interval (sys.getswitchinterval) each time."""
    pieces = max(1, launches)
    for _ in range(pieces):
        end = time.perf_counter() + ms / 1e3 / pieces
        while time.perf_counter() < end:
            pass
        if launches:
            time.sleep(0)  # releases the lock and takes it back


def emulate_device(model: Any, device: Device) -> None:
    """Stub `model` (bench_serve_host._stub_model) and give every step its time on `device`: a forward
    queues its step behind the ones in flight; reading a step's samples sleeps until the device has
    finished it (time.sleep releases the interpreter lock, as waiting on a CUDA event does)."""
    from hyserve.engine import engine as engine_mod
    from hyserve.engine.pending_step import PendingStep

    _stub_model(model, model.config.vocab_size)
    device_free = [0.0]
    stub_forward = model.forward

    def forward(ids, meta, cache):
        if device.eager_ms and len(meta.cu_seqlens) - 1 > meta.num_decodes:
            _hold_host(device.eager_ms, device.eager_launches)  # a step with a prefill row replays no graph
        device_free[0] = max(time.perf_counter(), device_free[0]) + device.step_s(ids.shape[0])
        return stub_forward(ids, meta, cache)

    model.forward = forward
    done_at: dict[int, float] = {}
    sample_step = engine_mod.sample_step

    def timed_sample_step(*args: Any, **kwargs: Any) -> PendingStep:
        p = sample_step(*args, **kwargs)
        done_at[id(p)] = device_free[0]
        return p

    read = PendingStep.read

    def timed_read(self: PendingStep) -> Any:
        wait = done_at.pop(id(self), 0.0) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return read(self)

    engine_mod.sample_step = timed_sample_step
    PendingStep.read = timed_read  # type: ignore[method-assign]


@dataclass(frozen=True)
class Workload:
    """One point: `prompts` random prompts of `input_len` tokens generating `output_len` each, `concurrency`
    in flight at the server, under the engine options `engine` (stub_engine_options plus overrides)."""

    concurrency: int
    prompts: int
    input_len: int
    output_len: int
    engine: tuple[tuple[str, Any], ...]
    range_ratio: float = 0.0  # lengths drawn from [len * (1 - r), len * (1 + r)], as `hyserve bench`'s

    def options(self) -> dict[str, Any]:
        return dict(self.engine)


def workload(args: argparse.Namespace, concurrency: int) -> Workload:
    batch = args.max_batch_size or concurrency
    longest = math.ceil((args.input_len + args.output_len) * (1 + args.range_ratio))
    opts = stub_engine_options(batch, longest + 64)
    for key in ("batch_wait_timeout_iters", "batch_wait_max_tokens_ratio"):
        if getattr(args, key) is not None:
            opts[key] = getattr(args, key)
    return Workload(
        concurrency=concurrency,
        prompts=args.num_prompts or concurrency,
        input_len=args.input_len,
        output_len=args.output_len,
        engine=tuple(opts.items()),
        range_ratio=args.range_ratio,
    )


def _emulate_engine(device: Device, engine: Any) -> None:
    """`emulate_device` over a started engine's model (in the engine's process when it has its own)."""
    emulate_device(engine.runner.model, device)


def serve_emulated(port: int, work: Workload, device: Device, ready: Any, engine_process: bool) -> None:
    """The server process: `hyserve serve`'s app and uvicorn settings over the built-in tiny model on the
    emulated device, the engine loop in its own process or on a thread of the server's."""
    import uvicorn

    from hyserve.config import build_engine_config
    from hyserve.engine.async_engine import AsyncEngine
    from hyserve.engine.engine_process import ProcessEngine
    from hyserve.engine.gc_tuning import settle_for_serving
    from hyserve.server.app import build_app
    from hyserve.server.serve import uvicorn_config
    from hyserve.server.state import ServerOptions

    logging.disable(logging.WARNING)
    config = build_engine_config(work.options())
    engine: Any
    if engine_process:
        engine = ProcessEngine(config, log=lambda s: None, prepare=functools.partial(_emulate_engine, device))
    else:
        engine = AsyncEngine(config, log=lambda s: None)
        _emulate_engine(device, engine.engine)
    engine.start()
    opts = ServerOptions(port=port, access_log=False, log_level="warning")
    app = build_app(engine, opts)
    app.state.accepting = True
    settle_for_serving()  # as `hyserve serve` does
    cfg = uvicorn_config(app, "127.0.0.1", port, opts)
    ready.set()
    uvicorn.Server(cfg).run()


def engine_point(work: Workload, device: Device, seed: int) -> dict:
    """`LLM.generate` over the workload's prompts at once on the emulated device."""
    import random

    from hyserve.engine.llm import LLM
    from hyserve.engine.sampling_params import SamplingParams

    llm = LLM(**work.options())
    model = llm.engine.runner.model
    emulate_device(model, device)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    ins = sample_lengths(rng, work.input_len, work.range_ratio, work.prompts)
    outs_len = sample_lengths(rng, work.output_len, work.range_ratio, work.prompts)
    prompts = [[rng.randrange(10, vocab) for _ in range(n)] for n in ins]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in outs_len]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"output_tok_s": tokens / wall, "duration_s": wall, "output_tokens": tokens}


def server_point(work: Workload, device: Device, seed: int, engine_process: bool = True) -> dict:
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    port = _free_port()
    proc = ctx.Process(target=serve_emulated, args=(port, work, device, ready, engine_process))
    proc.start()
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(base, proc)
        return run_point(
            base,
            proc.pid,
            work.concurrency,
            work.prompts,
            work.input_len,
            work.output_len,
            seed,
            range_ratio=work.range_ratio,
        )
    finally:
        proc.terminate()
        proc.join(10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1024])
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=300)
    ap.add_argument("--step-ms", type=float, default=35.0, help="emulated device time of every step")
    ap.add_argument("--token-us", type=float, default=16.0, help="emulated device time of each token")
    ap.add_argument(
        "--eager-ms",
        type=float,
        default=0.0,
        help="host time (interpreter held) of a step with a prefill row",
    )
    ap.add_argument(
        "--eager-launches",
        type=int,
        default=0,
        help="kernel launches of such a step, each releasing the interpreter lock (0: one held stretch)",
    )
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per point (default: concurrency)")
    ap.add_argument("--max-batch-size", type=int, default=None, help="engine batch (default: concurrency)")
    ap.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary by +- this share")
    ap.add_argument("--batch-wait-timeout-iters", type=int, default=None)
    ap.add_argument("--batch-wait-max-tokens-ratio", type=float, default=None)
    ap.add_argument(
        "--engine-process",
        choices=("on", "off"),
        default="on",
        help="the server's engine loop in its own process (on, the default on CUDA) or on a thread (off)",
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--git-sha", default="")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    device = Device(args.step_ms, args.token_us, args.eager_ms, args.eager_launches)
    rows = []
    for i, c in enumerate(args.concurrency):
        work = workload(args, c)
        eng = engine_point(work, device, seed=i)
        print(f"concurrency {c}: LLM.generate {eng['output_tok_s']:.0f} output tok/s", flush=True)
        srv = server_point(work, device, seed=i, engine_process=args.engine_process == "on")
        ratio = srv["output_tok_s"] / eng["output_tok_s"]
        print(
            f"    hyserve serve {srv['output_tok_s']:.0f} output tok/s: {ratio:.3f} of the engine", flush=True
        )
        rows.append({"concurrency": c, "engine": eng, "server": srv, "ratio": ratio})
    head = [
        "| concurrency | LLM.generate tok/s | hyserve serve tok/s | server / engine | TPOT p50 / p99 ms "
        "| server CPU (cores) |",
        "|---|---|---|---|---|---|",
    ]
    lines = [
        f"| {r['concurrency']} | {r['engine']['output_tok_s']:.0f} | {r['server']['output_tok_s']:.0f} "
        f"| {r['ratio']:.3f} | {r['server']['p50_tpot_ms']:.1f} / {r['server']['p99_tpot_ms']:.1f} "
        f"| {r['server']['server_cpu_share']:.2f} |"
        for r in rows
    ]
    print(*head, *lines, sep="\n")
    setting = "".join(
        f", {k.replace('_', ' ')} {v:g}"
        for k, v in (
            ("eager_ms", args.eager_ms),
            ("eager_launches", args.eager_launches),
            ("range_ratio", args.range_ratio),
            ("num_prompts", args.num_prompts),
            ("max_batch_size", args.max_batch_size),
            ("batch_wait_timeout_iters", args.batch_wait_timeout_iters),
            ("batch_wait_max_tokens_ratio", args.batch_wait_max_tokens_ratio),
            ("engine thread in the server", args.engine_process == "off"),
        )
        if v
    )
    records = [
        dict(
            name=f"server / engine, concurrency {r['concurrency']}, {args.input_len} in / {args.output_len} "
            f"out, emulated steps of {args.step_ms:g} ms + {args.token_us:g} us a token{setting}",
            value=r["ratio"],
            unit="hyserve serve tok/s / LLM.generate tok/s",
            **r,
        )
        for r in rows
    ]
    out = None if args.out is None else Path(args.out)
    write_host_results(
        "server_cost",
        out,
        args.git_sha,
        "none (CPU, stub model on an emulated device)",
        records,
        [*head, *lines],
    )
    return 0 if all(r["server"]["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
