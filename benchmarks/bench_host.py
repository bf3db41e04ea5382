"""Host work per engine step at large decode batches (CPU; no GPU needed).

The engine's per-step host work (planning the step, building its metadata, reading the previous step's
tokens, detokenising, stop checks, building deltas) runs while the GPU computes the step when async
scheduling overlaps them, so it is free as long as it stays below the GPU's step time. This measures it
with the model replaced by a stub that returns zeros at no cost, on the built-in tiny model (real
tokenizer, real scheduler, sampler and detokenizer), and quotes it against the Nemotron Nano 9B v2
decode-step roofline at the same batch (weights + Mamba states + `--context` KV tokens per sequence on
the H200): a ratio below 1 means the host keeps up with the GPU.

    python -m benchmarks.bench_host                         # batches 64, 256, 1024, GC frozen and default
    python -m benchmarks.bench_host --batches 8 --steps 3   # quick check

Sampling here runs on the CPU over a [batch, vocab] tensor (on a GPU it is device time); greedy rows
keep that share small. Writes benchmarks/results/host_<date>_<sha>.json and .md.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks.host_results import write_host_results  # noqa: E402
from benchmarks.phase_timing import time_phases  # noqa: E402
from benchmarks.roofline import PUBLISHED_BW, decode_step_ms  # noqa: E402
from hyserve import LLM, SamplingParams  # noqa: E402
from hyserve.engine.gc_tuning import settle_for_serving  # noqa: E402
from hyserve.model.nemotron_h.config import HybridModelConfig  # noqa: E402

CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"
PHASES = (
    ("scheduler", "schedule"),
    ("runner", "build_meta"),
    ("engine", "sample_rows"),
    ("scheduler", "update"),
    ("engine", "_read"),
)


def time_batch(batch: int, steps: int, prompt_len: int, *, freeze: bool) -> dict[str, float]:
    """Mean host ms per decode step with `batch` requests decoding, per phase, and the garbage collector's
    pauses during those steps. `freeze`: the start-up heap moved out of the collector's reach and the serving
    thresholds set first, as `hyserve serve` does (`settle_for_serving`)."""
    llm = LLM(
        max_batch_size=batch,
        max_num_tokens=max(2048, batch),
        device="cpu",
        kv_cache_config={"tokens_per_block": 16, "max_gpu_total_bytes": 1024 * 2**20},
    )
    eng = llm.engine
    model = eng.runner.model
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    model.forward = lambda ids, meta, cache: torch.zeros(ids.shape[0], hidden)  # type: ignore[method-assign]
    model.compute_logits = lambda h, out=None: torch.zeros(h.shape[0], vocab)  # type: ignore[method-assign]
    rng = random.Random(0)
    greedy = SamplingParams(max_tokens=steps + 50, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"r{i}", [1] + [rng.randrange(3, 300) for _ in range(prompt_len - 1)], greedy)
    for _ in range(10_000):  # every prompt prefilled (chunks of max_num_tokens), then two decode steps
        eng.step()
        if all(r.output_token_ids for r in eng.requests.values()):
            break
    eng.step()
    eng.step()
    spent = time_phases(eng, PHASES)
    thresholds = gc.get_threshold()
    if freeze:
        settle_for_serving()
    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((time.perf_counter() - started[0]) * 1e3)

    gc.callbacks.append(on_gc)
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        total = (time.perf_counter() - t0) / steps * 1e3
    finally:
        gc.callbacks.remove(on_gc)
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert len(eng.scheduler.running) == batch, "the batch shrank while timing"
    return {
        "step_ms": total,
        "gc_max_pause_ms": max(pauses, default=0.0),
        "gc_ms_per_step": sum(pauses) / steps,
        **{f"{label.split('.')[1]}_ms": sum(v) / steps for label, v in spent.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--context", type=int, default=2000, help="KV tokens per sequence in the roofline step")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--git-sha", default="")
    args = ap.parse_args()
    logging.disable(logging.WARNING)
    cfg = HybridModelConfig.from_dict(json.loads((CFG_DIR / "config.json").read_text()))
    records = []
    head = [
        "| batch | garbage collector | host ms / step | Nano 9B v2 roofline step ms | ratio | longest GC "
        "pause ms | phases (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    print(*head, sep="\n")
    lines = []
    for b in args.batches:
        roof = decode_step_ms(cfg, b, args.context, PUBLISHED_BW)  # a CPU benchmark: the published peak
        for freeze in (True, False):
            r = time_batch(b, args.steps, prompt_len=32, freeze=freeze)
            mode = "start-up heap frozen (as served)" if freeze else "default"
            phases = {
                k.removesuffix("_ms"): round(v, 3)
                for k, v in r.items()
                if k.startswith("_") or k in ("schedule_ms", "build_meta_ms", "update_ms", "sample_rows_ms")
            }
            records.append(
                dict(
                    name=f"host work per decode step, batch {b}, GC {mode}",
                    value=r["step_ms"],
                    unit="ms",
                    reference=f"Nano 9B v2 decode step roofline at the H200's published 4.8 TB/s, "
                    f"{args.context} KV tokens/seq",
                    reference_value=roof,
                    ratio=r["step_ms"] / roof,
                    gc_max_pause_ms=r["gc_max_pause_ms"],
                    gc_ms_per_step=r["gc_ms_per_step"],
                    phases_ms=phases,
                )
            )
            line = (
                f"| {b} | {mode} | {r['step_ms']:.2f} | {roof:.2f} | {r['step_ms'] / roof:.3f} "
                f"| {r['gc_max_pause_ms']:.1f} | {phases} |"
            )
            lines.append(line)
            print(line, flush=True)
    write_host_results(
        "host", args.out, args.git_sha, "none (host timing on the CPU)", records, [*head, *lines]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
