"""Serving at high concurrency, simulated on the CPU: hyserve's own scheduler (`engine/scheduler`) plans every
step of a closed-loop benchmark, vLLM's `--max-concurrency C --num-prompts N` with random prompts and
`ignore_eos`, while a device model stands in for the GPU. It shows what the scheduling policy does to TTFT,
inter-token latency and throughput at 1,024 streams (the arrival bursts and their echoes) without a GPU.

The device model is a measured step line: a step takes `overhead_ms` plus `decode_row_us` for each decode row
plus `prefill_token_us` for each prompt token. The scheduler gets what the engine's start-up calibration
gives it: a line fitted to prefill-only steps (`--calibrated-overhead-ms`, `prefill_token_us` per token,
decode rows at that per-token cost), corrected by measured step times through the scheduler's own
StepTimeFeedback, as in the engine. Host time is taken as hidden behind the device (async scheduling), and
a finished request's successor arrives when its last token is read.

Presets (`--device`), from measured figures of Nemotron 3 Nano 30B-A3B with FP8 weights:
  h100-30b-fp8  piecewise mixed steps 19.1 ms + 15.4 us a token (the calibration at start-up), a 512-row
                decode graph 37.2 ms (docs/performance.md, 2026-12-08)
  h200-30b-fp8  the same prefill line, a 1,024-row decode step 50.9 ms (the batch-step table, 2026-12-06)

    python -m benchmarks.sim_serving                                   # 1,024 streams, 5,120 prompts, 1k/1k
    python -m benchmarks.sim_serving --max-step-ms off 150            # compare settings in one run
    python -m benchmarks.sim_serving --decode-ms 1024:38 --prefill-token-us 10   # what-if: a faster step

Writes benchmarks/results/sim_serving_<date>_<sha>.json and .md. These are simulated figures, not GPU
measurements: they rank scheduling settings; the GPU benchmarks (`gpu_serve_check.sh scale`) measure them.
"""

from __future__ import annotations

import argparse
import itertools
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.host_results import write_host_results
from hyserve.bench.metrics import percentile
from hyserve.cache.capacity import CapacityInputs, plan_capacity
from hyserve.cache.manager import HybridCacheManager
from hyserve.engine.request import Request
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import Scheduler
from hyserve.engine.scheduler.step_cost import StepCostModel


@dataclass(frozen=True)
class DeviceModel:
    """A step's device time: overhead + decode rows + prompt tokens (host time hidden behind it)."""

    overhead_ms: float
    decode_row_us: float
    prefill_token_us: float
    calibrated_overhead_ms: float  # the start-up calibration's intercept (the scheduler's model)

    def step_ms(self, decodes: int, prefill_tokens: int) -> float:
        return (
            self.overhead_ms + (self.decode_row_us * decodes + self.prefill_token_us * prefill_tokens) / 1e3
        )

    def calibration(self, target_ms: float) -> StepCostModel:
        """What the engine's warm-up fits: prefill-only steps, so decode rows at the per-token cost."""
        return StepCostModel(
            overhead_ms=self.calibrated_overhead_ms,
            per_token_ms=self.prefill_token_us / 1e3,
            per_context_ms=0.0,
            per_kv_read_ms=0.0,
            target_ms=target_ms,
        )


DEVICES = {
    "h100-30b-fp8": DeviceModel(19.1, (37.2 - 19.1) * 1e3 / 512, 15.4, 19.1),
    "h200-30b-fp8": DeviceModel(19.1, (50.9 - 19.1) * 1e3 / 1024, 15.4, 19.1),
}


@dataclass(frozen=True)
class Workload:
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Setting:
    max_batch_size: int
    max_num_tokens: int
    max_step_ms: float | None  # None: no step-time target
    chunk_size: int = 128
    tokens_per_block: int = 64
    max_num_partial_prefills: int = 4

    def label(self) -> str:
        ms = "off" if self.max_step_ms is None else f"{self.max_step_ms:g}"
        return f"batch {self.max_batch_size}, tokens {self.max_num_tokens}, max_step_ms {ms}"


@dataclass
class Timeline:
    """Per request: arrival and token times (simulated seconds)."""

    arrival: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)


def build_scheduler(setting: Setting, work: Workload, cost: StepCostModel | None) -> Scheduler:
    """The engine's scheduler over a cache that holds every stream's prompt and output (KV is not the limit
    this simulation studies)."""
    seq = work.input_len + work.output_len
    blocks = setting.max_batch_size * (-(-seq // setting.tokens_per_block) + 1)
    inp = CapacityInputs(
        budget_bytes=blocks * setting.tokens_per_block + setting.max_batch_size * 2 + 64,
        kv_bytes_per_token=1,
        state_bytes_per_slot=1,
        max_batch_size=setting.max_batch_size,
        max_seq_len=seq,
        max_num_tokens=setting.max_num_tokens,
        tokens_per_block=setting.tokens_per_block,
        enable_block_reuse=True,
        periodic_snapshot_interval=256,
        num_snapshot_offsets=1,
        avg_seq_len=seq,
        num_pad_slots=0,
    )
    cache = HybridCacheManager(
        plan_capacity(inp),
        has_mamba=True,
        enable_block_reuse=True,
        snapshot_interval=256,
        snapshot_offsets_from_end=(0,),
    )
    sched = Scheduler(
        cache,
        max_batch_size=setting.max_batch_size,
        max_num_tokens=setting.max_num_tokens,
        enable_chunked_prefill=True,
        chunk_size=setting.chunk_size,
        max_seq_len=seq,
        max_num_partial_prefills=setting.max_num_partial_prefills,
    )
    sched.cost = cost
    return sched


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def simulate(setting: Setting, work: Workload, device: DeviceModel) -> tuple[Timeline, list[float], float]:
    """Run the closed loop to the end. Returns the timeline, every step's device ms, and the total time."""
    cost = None if setting.max_step_ms is None else device.calibration(setting.max_step_ms)
    sched = build_scheduler(setting, work, cost)
    clock = Clock()
    sched.feedback.clock = clock
    rng = random.Random(0)
    params = SamplingParams(max_tokens=work.output_len, ignore_eos=True)
    line = Timeline()
    sent = 0

    def send() -> None:
        nonlocal sent
        rid = f"r{sent}"
        # random tokens, as vLLM's random dataset: no prompt shares a block with another
        sched.add(Request(rid, [rng.randrange(1, 100_000) for _ in range(work.input_len)], params))
        line.arrival[rid], line.tokens[rid] = clock.t, []
        sent += 1

    for _ in range(min(work.concurrency, work.num_prompts)):
        send()
    steps: list[float] = []
    while sched.has_work():
        batch, _ = sched.schedule()
        ms = device.step_ms(batch.num_decodes, batch.num_prefill_tokens)
        clock.t += ms / 1e3
        steps.append(ms)
        sched.on_read(batch)
        running = {r.request_id: r for r in sched.running}
        sched.update(batch, running)
        for seq in batch.seqs:
            if seq.sample:
                req = running[seq.request_id]
                req.output_token_ids.append(7)
                line.tokens[req.request_id].append(clock.t)
                if len(req.output_token_ids) >= work.output_len:
                    sched.finish(req, "length")
                    if sent < work.num_prompts:
                        send()
    return line, steps, clock.t


def _pct(values: list[float], p: float) -> float:
    """The percentile, 0 where there is nothing to rank (one-token outputs have no inter-token gaps)."""
    return round(percentile(values, p), 2) if values else 0.0


def summarize(
    setting: Setting, work: Workload, device_name: str, run: tuple[Timeline, list[float], float]
) -> dict:
    line, steps, total = run
    ttft = [(line.tokens[r][0] - a) * 1e3 for r, a in line.arrival.items()]
    itl = [(b - a) * 1e3 for ts in line.tokens.values() for a, b in itertools.pairwise(ts)]
    tpot = [(ts[-1] - ts[0]) * 1e3 / (len(ts) - 1) for ts in line.tokens.values() if len(ts) > 1]
    out_tokens = sum(len(ts) for ts in line.tokens.values())
    return dict(
        name=f"sim {device_name} c{work.concurrency} n{work.num_prompts} {work.input_len}/{work.output_len}",
        setting=setting.label(),
        output_tok_s=round(out_tokens / total, 1),
        ttft_ms_p50=_pct(ttft, 50),
        ttft_ms_p99=_pct(ttft, 99),
        tpot_ms_p50=_pct(tpot, 50),
        itl_ms_p50=_pct(itl, 50),
        itl_ms_p99=_pct(itl, 99),
        steps=len(steps),
        step_ms_max=round(max(steps), 1),
        simulated_s=round(total, 2),
    )


def what_if(device: DeviceModel, decode_ms: str | None, prefill_token_us: float | None) -> DeviceModel:
    """The preset with a decode step of `decode_ms` ("ROWS:MS") and prompt tokens at `prefill_token_us`."""
    if decode_ms is not None:
        rows, ms = decode_ms.split(":")
        device = replace(device, decode_row_us=(float(ms) - device.overhead_ms) * 1e3 / int(rows))
    if prefill_token_us is not None:
        device = replace(device, prefill_token_us=prefill_token_us)
    return device


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=sorted(DEVICES), default="h200-30b-fp8")
    ap.add_argument("--concurrency", type=int, default=1024)
    ap.add_argument("--num-prompts", type=int, default=5120)
    ap.add_argument("--input-len", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=1000)
    ap.add_argument("--max-batch-size", type=int, nargs="+", default=[1024])
    ap.add_argument("--max-num-tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--max-step-ms", nargs="+", default=["150"], help="milliseconds, or off")
    ap.add_argument(
        "--decode-ms", default=None, metavar="ROWS:MS", help="what-if: a ROWS-row decode step takes MS"
    )
    ap.add_argument("--prefill-token-us", type=float, default=None, help="what-if: prompt token cost (us)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sha", default="")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    work = Workload(args.concurrency, args.num_prompts, args.input_len, args.output_len)
    device = what_if(DEVICES[args.device], args.decode_ms, args.prefill_token_us)
    records = []
    for batch, tokens, ms in itertools.product(args.max_batch_size, args.max_num_tokens, args.max_step_ms):
        setting = Setting(batch, tokens, None if ms == "off" else float(ms))
        rec = summarize(setting, work, args.device, simulate(setting, work, device))
        records.append(rec)
        print(
            f"{rec['setting']}: {rec['output_tok_s']:.0f} tok/s, TTFT p50 {rec['ttft_ms_p50']:.0f} ms "
            f"p99 {rec['ttft_ms_p99']:.0f} ms, TPOT p50 {rec['tpot_ms_p50']:.1f} ms, ITL p99 "
            f"{rec['itl_ms_p99']:.1f} ms, {rec['steps']} steps",
            flush=True,
        )
    table = [
        f"# Simulated serving ({args.device}, {work.concurrency} streams, {work.num_prompts} prompts, "
        f"{work.input_len} in / {work.output_len} out)",
        "",
        "| setting | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | ITL p50 / p99 ms | steps |",
        "| --- | --- | --- | --- | --- | --- |",
    ] + [
        f"| {r['setting']} | {r['output_tok_s']:.0f} | {r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | "
        f"{r['tpot_ms_p50']:.1f} | {r['itl_ms_p50']:.1f} / {r['itl_ms_p99']:.1f} | {r['steps']} |"
        for r in records
    ]
    print("\n".join(table))
    if not args.no_write:
        note = f"none: simulated device {args.device} ({device})"
        write_host_results("sim_serving", args.out, args.sha, note, records, table)


if __name__ == "__main__":
    main()
