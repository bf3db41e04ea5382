"""`StepCostCalibration`: the scheduler's step cost model, chosen at start-up. Where `max_step_ms` sets a
target on CUDA it is timed on the device before ready: three prefill steps from an empty cache (the
smallest, for the host's floor; a quarter of the largest and the largest, for the per-step and per-token
terms) and the model's attention at a long context, as a prefill chunk and as decode rows (the context
terms). Runs after the warm-up, so it compiles nothing new. Where it is "auto" and the device has no
calibration (the CPU) the model is counted from the model's FLOPs; where it is off there is none."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import torch

from hyserve.engine.engine import LLMEngine
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.step_cost import StepCostModel, analytic_step_cost, fit_step_cost
from hyserve.kernels import ops

logger = logging.getLogger(__name__)
_ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
_MAX_CONTEXT = 131072  # the attention timing's context (or what the KV pool holds)


class StepCostCalibration:
    """Drives one engine through the timed prompts (each a fresh one: no prefix hit) and fits the model."""

    def __init__(self, engine: LLMEngine, *, log: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self._log = log or logger.info
        self._prompts = 0  # timed prompts sent so far (their request ids)
        self._gen = torch.Generator().manual_seed(0)

    def choose(self) -> StepCostModel | None:
        """The model the scheduler sizes chunks by, said in the log: timed where `max_step_ms` sets a
        target and the device can be timed, counted from FLOPs where it is "auto" and cannot, None where it
        is off."""
        e = self.engine
        sc = e.config.scheduler
        target = sc.step_target_ms(e.device.type)
        cost = self.timed(target) if target is not None else None
        if cost is None and sc.max_step_ms == "auto":
            assert sc.max_num_tokens is not None  # sized at assembly
            mc = e.model_config
            cost = analytic_step_cost(
                params=mc.num_parameters(),
                attention_flops_per_pair=mc.attention_flops_per_pair,
                max_num_tokens=sc.max_num_tokens,
            )
        if cost is not None:
            label = f"max_step_ms {target:g}" if target is not None else "max_step_ms auto"
            self._log(f"{label}: {cost.describe()}")
        elif target is not None:
            self._log(
                f"max_step_ms {target:g}: no step cost model on {e.device.type} for this model (it is timed "
                "on CUDA over the attention layers); chunks are sized by the token budget alone"
            )
        return cost

    def timed(self, target_ms: float) -> StepCostModel | None:
        """The model timed on the device, or None where there is nothing to time against (CPU, no attention
        layers)."""
        e = self.engine
        if e.device.type != "cuda" or not e.cache_tensors.k:
            return None
        floor_n, short_n, long_n = self.sizes()
        floor = (floor_n, self._time_prefill(floor_n))
        short = (short_n, self._time_prefill(short_n)) if short_n > floor_n else floor
        long = (long_n, self._time_prefill(long_n)) if long_n > short_n else short
        attn, kv_read = self._time_attention()
        e.reset_after_warmup()
        return fit_step_cost(
            short=short, long=long, attention=attn, kv_read_ms=kv_read, target_ms=target_ms, floor=floor
        )

    def sizes(self) -> tuple[int, int, int]:
        """The prompt lengths timed: the smallest step (one SSD chunk: the host's floor), and two device-bound
        ones for the per-token slope (a quarter of the largest and the largest, `max_num_tokens` or what one
        request may hold), so the host's time in small steps, which overlaps the device's in large ones, stays
        out of it. The two are whole SSD chunks, blocks and snapshot intervals: a snapshot boundary inside a
        prompt that is not an SSD chunk boundary cuts its prefill into two steps (the scheduler's
        `_plan_chunk`), and a timing of two steps is not one step's."""
        e = self.engine
        chunk = e.model_config.chunk_size
        unit = math.lcm(chunk, e.cache.tokens_per_block, e.cache.snapshot_interval or 1)
        long_n = _aligned(min(e.scheduler.max_num_tokens, e.plan.max_request_tokens - 2), unit)
        floor_n = min(chunk, long_n)
        return floor_n, max(_aligned(long_n // 4, unit), floor_n), long_n

    def _time_prefill(self, n: int) -> float:
        e = self.engine
        vocab = e.model_config.vocab_size
        sent = self._prompts
        steps = e.counters["prefill_steps_total"]

        def run() -> None:
            self._prompts += 1
            ids = torch.randint(min(3, vocab - 1), vocab, (n,), generator=self._gen).tolist()
            e.add_request(f"calibrate-{n}-{self._prompts}", ids, _ONE)
            while e.has_unfinished():
                e.step()

        ms = _median_ms(run, reps=3)
        per_run = (e.counters["prefill_steps_total"] - steps) / (self._prompts - sent)
        if per_run != 1:
            logger.warning(
                "step cost calibration: a %d-token prompt took %.1f prefill steps, not one; the model's "
                "per-token terms are less certain",
                n,
                per_run,
            )
        return ms

    def _time_attention(self) -> tuple[tuple[int, int, float], float]:
        """((queries, context, ms) of a prefill chunk's attention over all attention layers, ms per decode row
        per context token), timed on the KV pool's own tensors."""
        engine = self.engine
        tensors = engine.cache_tensors
        k = next(iter(tensors.k.values()))
        v = next(iter(tensors.v.values()))
        layers = len(tensors.k)
        bs = tensors.tokens_per_block
        head_dim = k.shape[-1]
        heads = max(
            1, engine.model_config.num_attention_heads // engine.config.parallel.tp_size
        )  # this rank's
        ctx = min(_MAX_CONTEXT, (k.shape[0] - 1) * bs) // bs * bs
        q_n = min(512, ctx // 2)
        dev = engine.device
        dtype = engine.loaded.dtype
        table = torch.arange(ctx // bs, dtype=torch.int32, device=dev)[None]
        scales = {}
        if k.dtype.itemsize == 1:  # a float8 pool reads through its scales
            one = torch.ones((), dtype=torch.float32, device=dev)
            scales = {"k_scale": one, "v_scale": one}
        attend = ops.paged_attention.get(True)
        q = torch.randn(q_n, heads, head_dim, device=dev, dtype=dtype)
        prefill_ms = (
            _median_ms(lambda: attend(q, k, v, table, [ctx], [0, q_n], head_dim**-0.5, **scales)) * layers
        )
        rows = 8
        qd = torch.randn(rows, heads, head_dim, device=dev, dtype=dtype)
        lens = torch.full((rows,), ctx, dtype=torch.int32, device=dev)
        cu = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        tables = table.expand(rows, -1).contiguous()
        decode_ms = _median_ms(lambda: attend(qd, k, v, tables, lens, cu, head_dim**-0.5, **scales)) * layers
        return (q_n, ctx, prefill_ms), decode_ms / (rows * ctx)


def _aligned(n: int, unit: int) -> int:
    """n down to a multiple of unit (n itself when smaller than one unit)."""
    return n // unit * unit if n >= unit else n


def _median_ms(fn: Callable[[], object], reps: int = 5) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return sorted(times)[len(times) // 2]
