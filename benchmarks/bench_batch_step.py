"""Where a large decode step's time goes: Nemotron 3 Nano 30B-A3B (or any config) at batch 256 / 512 / 1,024,
per weight format and Mamba state dtype, against the step's bytes roofline measured in the same run.

For each (weights, state dtype) pair one engine is built with `max_batch_size` = the largest batch, filled
with that many requests of `--prompt-len` random tokens, and decoded for a while. Then, per batch size:

- the engine's own decode step (wall time of `LLMEngine.step()` over decode-only steps, largest batch only);
- the decode graph of that size replayed alone (device time of the step);
- the same step run eagerly without programmatic dependent launch under the torch profiler: device time
  per kernel, grouped by what it does (MoE experts, Mamba state update, attention, dense GEMMs, ...),
  so each group can be set against the bytes it must move.

The roofline of a step: the weights it reads (every expert the batch touches under uniform routing, the
rest whole), each sequence's Mamba state read and written, and the K/V of its context, at the read
ceiling measured first in the same run.

    python3 -m benchmarks.bench_batch_step --git-sha SHA        # 30B-A3B: fp8 and bf16 x float32 and float16
    python3 -m benchmarks.bench_batch_step --weights fp8 --states float16 --batches 1024

Writes benchmarks/results/batch_step_<date>_<sha>.json (date, git sha, GPU, exact command) and a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import invocation
from benchmarks.roofline import active_weight_bytes, batch_experts, measure_ceilings
from hyserve import LLM, SamplingParams
from hyserve.bench.profiling import device_kernel_times
from hyserve.bench.report import record, records_markdown, sanitize, stamp
from hyserve.engine.assembly.assemble import rank_cache_bytes
from hyserve.kernels.launch_util import pdl_enabled, set_pdl
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.quant_config import QuantConfig

ROOT = Path(__file__).resolve().parents[1]
CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"

# kernel name fragments -> the part of the step they belong to (first match wins)
GROUPS = (
    (
        "moe",
        ("moe", "expert", "grouped", "route", "topk", "_combine", "_up_gemm", "_down_gemm", "align_scatter"),
    ),
    ("state update", ("ssm_update", "state_update", "selective")),
    ("conv1d", ("conv1d", "conv_")),
    ("attention", ("attn", "attention", "flash", "paged")),
    ("norms", ("rmsnorm", "norm")),
    ("dense GEMM / GEMV", ("gemv", "gemm", "linear", "sm90_xmma", "cutlass", "nvjet", "matmul")),
)


def group_of(kernel: str) -> str:
    k = kernel.lower()
    for name, keys in GROUPS:
        if any(key in k for key in keys):
            return name
    return "other"


def step_bytes(
    cfg: HybridModelConfig, batch: int, context: float, kv_tok: int, state: int
) -> dict[str, float]:
    """Bytes one decode step of `batch` sequences must move, by part."""
    return {
        "weights": active_weight_bytes(cfg, batch_experts(cfg, batch)),
        "state": 2.0 * batch * state,
        "kv": batch * context * kv_tok,
    }


def kernel_table(fn, reps: int) -> list[tuple[float, float, str]]:
    """(us per step, launches per step, kernel) of `fn`, most expensive first."""
    rows = [(us / reps, n / reps, name) for name, (us, n) in device_kernel_times(fn, reps).items()]
    return sorted(rows, reverse=True)


def run_pair(a: argparse.Namespace, weights: str, state: str, bw: float, out: dict[str, Any]) -> None:
    raw = json.loads((Path(a.model_dir) / "config.json").read_text())
    cfg = HybridModelConfig.from_dict(raw)
    if weights == "fp8":
        cfg = cfg.with_quant(QuantConfig(method="online", scheme="channel"))
    bmax = max(a.batches)
    t0 = time.monotonic()
    llm = LLM(
        model=str(a.model_dir),
        load_format="dummy",
        quantization="fp8" if weights == "fp8" else None,
        max_batch_size=bmax,
        max_num_tokens=a.max_num_tokens,
        max_seq_len=a.prompt_len + a.decode_steps + 256,
        kv_cache_config={"mamba_ssm_cache_dtype": state, "free_gpu_memory_fraction": 0.92},
    )
    ready_s = time.monotonic() - t0
    eng = llm.engine
    kv_tok, state_bytes = rank_cache_bytes(eng.loaded.model)
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=a.decode_steps, temperature=0, ignore_eos=True)
    for i in range(bmax):
        eng.add_request(f"r{i}", [rng.randrange(100, cfg.vocab_size) for _ in range(a.prompt_len)], sp)
    t = time.monotonic()
    while any(r.num_computed < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    torch.cuda.synchronize()
    prefill_s = time.monotonic() - t
    for _ in range(4):  # settle into decode-only steps
        eng.step()
    torch.cuda.synchronize()
    # requests that were prefilled early may have finished during the long prefill: time steps() while the
    # whole batch decodes (max_tokens covers the prefill's steps), and count the rows each step carried
    t, rows = time.perf_counter(), []
    for _ in range(a.timed_steps):
        rows.append(sum(len(d.token_ids) for d in eng.step()))
    torch.cuda.synchronize()
    engine_ms = (time.perf_counter() - t) / a.timed_steps * 1e3
    if min(rows) < bmax:
        raise RuntimeError(f"timed steps carried {min(rows)} rows, not {bmax}: raise --decode-steps")
    tag = f"30B-A3B {weights} weights, {state} state" if "30B" in str(a.model_dir) else f"{weights}, {state}"
    recs, tables = out["records"], out["kernels"]
    context = a.prompt_len + a.decode_steps / 2
    graphs = eng.runner.graphs
    if graphs is None:
        raise RuntimeError("no decode graphs were captured")
    for b in sorted(a.batches):
        parts = step_bytes(cfg, b, context, kv_tok, state_bytes)
        roof_ms = sum(parts.values()) / bw * 1e3
        size = graphs.size_for(b)
        if size is None:
            continue

        def replay(n: int = size, g: Any = graphs) -> None:
            g.replay(n)

        replay()
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(a.reps):
            replay()
        ev1.record()
        torch.cuda.synchronize()
        replay_ms = ev0.elapsed_time(ev1) / a.reps
        recs.append(
            record(
                f"{tag}: decode step batch {b}, graph replay (ms)",
                replay_ms,
                "ms",
                "bytes roofline at the measured read ceiling",
                roof_ms,
            )
        )
        if b == bmax:
            recs.append(
                record(
                    f"{tag}: decode step batch {b}, engine step() (ms)",
                    engine_ms,
                    "ms",
                    "graph replay alone, same run",
                    replay_ms,
                )
            )
        pdl = pdl_enabled()
        set_pdl(False)
        try:
            eager = graphs._eager_fn(size)
            eager()
            rows = kernel_table(eager, 3)
        finally:
            set_pdl(pdl)
        by_group: dict[str, float] = {}
        for us, _, name in rows:
            by_group[group_of(name)] = by_group.get(group_of(name), 0.0) + us
        tables.append(
            {
                "config": tag,
                "batch": b,
                "replay_ms": replay_ms,
                "roofline_ms": roof_ms,
                "roofline_parts_ms": {k: v / bw * 1e3 for k, v in parts.items()},
                "groups_us": by_group,
                "kernels": [{"us": us, "launches": n, "name": k} for us, n, k in rows[:40]],
            }
        )
        print(
            f"\n{tag}, batch {b}: replay {replay_ms:.2f} ms, roofline {roof_ms:.2f} ms ("
            + ", ".join(f"{k} {v / bw * 1e3:.2f}" for k, v in parts.items())
            + ")"
        )
        total = sum(by_group.values())
        for g, us in sorted(by_group.items(), key=lambda x: -x[1]):
            print(f"  {g:<20} {us / 1e3:8.2f} ms  {us / total:6.1%}")
        for us, n, name in rows[: a.top]:
            print(f"    {us:9.1f} us {n:5.0f}x  {name[:100]}")
    out["engines"].append(
        {
            "config": tag,
            "ready_s": ready_s,
            "prefill_s": prefill_s,
            "prefill_tokens": bmax * a.prompt_len,
            "engine_step_ms": engine_ms,
            "capacity": eng.plan.to_dict(),
        }
    )
    print(
        f"{tag}: ready in {ready_s:.1f}s, {bmax} x {a.prompt_len} prefill in {prefill_s:.1f}s; engine step "
        f"{engine_ms:.2f} ms at batch {bmax}"
    )
    llm.close()
    del eng, llm, graphs
    gc.collect()
    torch.cuda.empty_cache()


def run_pair_in_child(argv: list[str], weights: str, state: str, out: dict[str, Any]) -> None:
    """One (weights, state) pair in a child process of this script; its records, kernel tables and engine
    figures join `out`."""
    with tempfile.TemporaryDirectory() as tmp:
        keep = [x for i, x in enumerate(argv) if not _is_choice(argv, i)]
        cmd = [sys.executable, "-m", "benchmarks.bench_batch_step", *keep]
        cmd += ["--weights", weights, "--states", state, "--result-dir", tmp]
        subprocess.run(cmd, check=True, timeout=1800)
        (child,) = Path(tmp).glob("batch_step_*.json")
        got = json.loads(child.read_text())
    for key in ("records", "kernels", "engines", "failures"):
        out.setdefault(key, []).extend(got.get(key, []))


def _is_choice(argv: list[str], i: int) -> bool:
    """Whether argv[i] is a --weights / --states / --result-dir flag or its value (the child gets its own)."""
    flags = ("--weights", "--states", "--result-dir")
    return argv[i].split("=")[0] in flags or (i > 0 and argv[i - 1] in flags)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=CFG_DIR)
    ap.add_argument("--batches", default="256,512,1024")
    ap.add_argument("--weights", default="fp8,bf16", help="comma-separated of fp8, bf16")
    ap.add_argument("--states", default="float32,float16", help="Mamba SSM state dtypes, comma-separated")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument(
        "--decode-steps",
        type=int,
        default=512,
        help="max_tokens of each request (> the prefill's steps)",
    )
    ap.add_argument("--timed-steps", type=int, default=12)
    ap.add_argument("--max-num-tokens", type=int, default=16384)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--git-sha", default="")
    ap.add_argument("--result-dir", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    a.batches = [int(x) for x in a.batches.split(",")]
    out: dict[str, Any] = {
        **stamp("batch_step", invocation(sys.executable), a.git_sha or None),
        "records": [],
        "kernels": [],
        "engines": [],
    }
    c = measure_ceilings("cuda")
    print(c.summary())
    out["ceilings"] = c.to_dict()
    pairs = [(w, s) for w in a.weights.split(",") for s in a.states.split(",")]
    for w, s in pairs:
        try:
            if len(pairs) == 1:
                run_pair(a, w, s, c.read_bw, out)
            else:  # each engine in its own process: one engine's memory is not all returned on close
                run_pair_in_child(argv if argv is not None else sys.argv[1:], w, s, out)
        except Exception as e:  # noqa: BLE001 - one configuration failing must not lose the others
            print(f"{w} weights, {s} state failed: {type(e).__name__}: {e}")
            out.setdefault("failures", []).append(f"{w}/{s}: {type(e).__name__}: {e}")
            gc.collect()
            torch.cuda.empty_cache()
        path = Path(a.result_dir) / f"batch_step_{dt.date.today()}_{out['git_sha']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sanitize(out), indent=1))
    print(records_markdown(out["records"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
