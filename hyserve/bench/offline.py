"""`hyserve bench offline`: engine throughput through `hyserve.LLM`, no HTTP.

Random token-id prompts (so config-only model directories with `load_format="dummy"` work) and fixed
output lengths (`ignore_eos`). One engine is built, then the same workload shape runs `reps` times back
to back, repetition i with prompts drawn from seed + i (no prefix-cache hits across repetitions), so
run 1 vs run 2 shows what the first run pays for warm-up.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from hyserve.bench.datasets import random_dataset
from hyserve.bench.http_client import BenchError
from hyserve.bench.metrics import rep_ratio, run_to_run_spread, summarize

OFFLINE_SPREAD_KEYS = (
    "elapsed_s",
    "request_throughput",
    "input_throughput",
    "output_throughput",
    "total_token_throughput",
)


@dataclass(frozen=True, kw_only=True)
class OfflineOptions:
    model: str | None = None  # None -> the built-in tiny model
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    config_file: str | None = None
    engine_options: dict[str, Any] = field(default_factory=dict)  # max_batch_size, max_num_tokens, ...
    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0
    num_prompts: int = 256
    reps: int = 1
    seed: int = 0
    temperature: float = 0.0
    token_low: int = 3
    percentiles: tuple[float, ...] = (50.0, 99.0)


def engine_options(opts: OfflineOptions) -> dict[str, Any]:
    """YAML (trtllm-serve's extra-llm-api-config.yml keys) < flags."""
    merged: dict[str, Any] = {}
    if opts.config_file:
        from hyserve.config import SERVER_YAML_KEYS, load_yaml_options

        try:
            merged = dict(load_yaml_options(opts.config_file))
        except ValueError as e:
            raise BenchError(str(e)) from None
        for k in SERVER_YAML_KEYS:
            merged.pop(k, None)
    merged.update({k: v for k, v in opts.engine_options.items() if v is not None})
    return merged


def run_offline_bench(opts: OfflineOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    from hyserve.engine.errors import RequestRejected
    from hyserve.engine.llm import LLM
    from hyserve.engine.sampling_params import SamplingParams

    eo = engine_options(opts)
    t0 = time.perf_counter()
    try:
        llm = LLM(
            opts.model, dtype=opts.dtype, device=opts.device, load_format=opts.load_format, log=log, **eo
        )
    except (ValueError, FileNotFoundError) as e:
        raise BenchError(str(e)) from None
    load_s = time.perf_counter() - t0
    vocab = int(llm.engine.model_config.vocab_size)
    low = min(opts.token_low, vocab - 1)
    reps: list[dict[str, Any]] = []
    for rep in range(opts.reps):
        seed = opts.seed + rep
        data = random_dataset(
            num_prompts=opts.num_prompts,
            input_len=opts.input_len,
            output_len=opts.output_len,
            range_ratio=opts.range_ratio,
            vocab_size=vocab,
            low=low,
            seed=seed,
        )
        prompts = [r.prompt for r in data]
        params = [
            SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=opts.temperature)
            for r in data
        ]
        start = time.perf_counter()
        try:
            outs = llm.generate(prompts, params)
        except RequestRejected as e:
            raise BenchError(f"the engine refused a prompt: {e}") from None
        elapsed = time.perf_counter() - start
        n_in = sum(len(o.prompt_token_ids) for o in outs)
        n_out = sum(len(o.token_ids) for o in outs)
        m: dict[str, Any] = {
            "rep": rep + 1,
            "seed": seed,
            "num_requests": len(outs),
            "elapsed_s": elapsed,
            "total_input_tokens": n_in,
            "total_output_tokens": n_out,
            "request_throughput": len(outs) / elapsed,
            "input_throughput": n_in / elapsed,
            "output_throughput": n_out / elapsed,
            "total_token_throughput": (n_in + n_out) / elapsed,
        }
        for name, key in (("ttft", "time_to_first_token_s"), ("e2el", "e2e_latency_s")):
            for stat, v in summarize([o.metrics[key] * 1000 for o in outs], opts.percentiles).items():
                m[f"{stat}_{name}_ms"] = v
        reps.append(m)
        log(
            f"offline rep {rep + 1}/{opts.reps}: {len(outs)} requests in {elapsed:.2f} s, "
            f"{m['output_throughput']:.1f} output tok/s, {m['total_token_throughput']:.1f} total tok/s"
        )
    cfg = asdict(opts)
    cfg["resolved_engine_options"] = eo
    return {
        "model": opts.model or "hyserve-tiny",
        "load_s": load_s,
        "vocab_size": vocab,
        "config": cfg,
        "reps": reps,
        "spread": run_to_run_spread(reps, OFFLINE_SPREAD_KEYS) if len(reps) > 1 else {},
        "run2_run1_output_throughput_ratio": rep_ratio(reps),
    }
