"""The predicted time of a step from its shape, so the scheduler can size prefill chunks to a target step
time: a late chunk of a long prompt pays attention over its whole context, so at a fixed token count it
costs many times an early one (docs/architecture.md, "Step composition").

    step_ms = overhead                                        (launches, weights read once, LM head)
            + per_token   x new tokens                        (linear layers, scan)
            + per_context x sum over prefill rows n (start + (n + 1) / 2)   (causal attention FLOPs)
            + per_kv_read x sum over decode rows context                    (decode attention reads KV)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class StepCostModel:
    overhead_ms: float
    per_token_ms: float
    per_context_ms: float  # per new prefill token per context token
    per_kv_read_ms: float  # per decode row per context token
    target_ms: float  # chunks are sized so a step stays under this
    host_floor_ms: float = (
        0.0  # the smallest prefill step's time: the host's share, which overlaps the device's
    )
    # "calibrated": timed on this device at start-up; "analytic": counted in GFLOPs from the model's shape
    # (its "ms" are milliseconds at 1 TFLOP/s), for devices without a calibration
    source: str = "calibrated"

    def chunk_ms(self, start: int, n: int) -> float:
        """A prefill chunk of n tokens after `start` cached ones."""
        return n * self.per_token_ms + self.per_context_ms * n * (start + (n + 1) / 2)

    def decode_ms(self, context: int) -> float:
        return self.per_token_ms + self.per_kv_read_ms * context

    def max_chunk(self, start: int, ms: float) -> int:
        """The most tokens a chunk after `start` may take within `ms` (0 when nothing fits). Solves
        a n^2 + b n <= ms with a = per_context / 2, b = per_token + per_context (start + 1/2)."""
        if ms <= 0:
            return 0
        a = self.per_context_ms / 2
        b = self.per_token_ms + self.per_context_ms * (start + 0.5)
        if a <= 0:
            return int(ms / b) if b > 0 else 1 << 62
        n = int((-b + math.sqrt(b * b + 4 * a * ms)) / (2 * a))
        while n > 0 and self.chunk_ms(start, n) > ms:  # float rounding at the edge
            n -= 1
        return n

    def describe(self) -> str:
        if self.source == "analytic":
            return (
                "step cost model (analytic, from the model's FLOPs): a step may do the work of one "
                f"{self.max_chunk(0, self.target_ms)}-token chunk from an empty cache (a chunk at 0 / 32k / "
                f"128k tokens of context: {self.max_chunk(0, self.target_ms)} / "
                f"{self.max_chunk(32768, self.target_ms)} / {self.max_chunk(131072, self.target_ms)} tokens)"
            )
        floor = f" (host floor {self.host_floor_ms:.1f} ms a step)" if self.host_floor_ms else ""
        return (
            f"step cost model{floor}: {self.overhead_ms:.2f} ms per step + {self.per_token_ms * 1e3:.3f} us "
            f"per token + {self.per_context_ms * 1e9:.3f} ps per (token x context) in prefill attention + "
            f"{self.per_kv_read_ms * 1e9:.3f} ps per context token of a decode row; chunks sized for steps "
            f"under {self.target_ms:.0f} ms (a chunk at 0 / 128k / 1M tokens of context: "
            f"{self.max_chunk(0, self.target_ms - self.overhead_ms)} / "
            f"{self.max_chunk(131072, self.target_ms - self.overhead_ms)} / "
            f"{self.max_chunk(1 << 20, self.target_ms - self.overhead_ms)} tokens)"
        )


def analytic_step_cost(*, params: int, attention_flops_per_pair: int, max_num_tokens: int) -> StepCostModel:
    """A cost model counted rather than timed, for a device without a calibration (the CPU): a new token
    costs 2 FLOPs per parameter, a (query, context) pair of attention `attention_flops_per_pair`, and a step
    may cost what one `max_num_tokens` chunk from an empty cache costs. So the first chunk of any prompt is
    as before, and a long prompt's later chunks shrink as their context grows instead of taking ever longer
    steps that everyone else waits behind. Units: GFLOPs (milliseconds at 1 TFLOP/s)."""
    per_token = 2 * params / 1e9
    per_context = attention_flops_per_pair / 1e9
    free = StepCostModel(
        overhead_ms=0.0,
        per_token_ms=per_token,
        per_context_ms=per_context,
        per_kv_read_ms=per_context,
        target_ms=0.0,
        source="analytic",
    )
    # (a hair over, so float rounding never cuts the full first chunk by a token)
    return dataclasses.replace(free, target_ms=free.chunk_ms(0, max_num_tokens) * (1 + 1e-9))


# a calibration step at most this many times the host floor is taken as host-bound (its time says little of
# the device's per-token cost)
HOST_BOUND = 1.5


def fit_step_cost(
    *,
    short: tuple[int, float],
    long: tuple[int, float],
    attention: tuple[int, int, float],
    kv_read_ms: float,
    target_ms: float,
    floor: tuple[int, float] | None = None,
) -> StepCostModel:
    """Calibrate from timings of this device: prefill steps of `short` = (n, ms) and `long` = (n, ms) tokens
    from an empty cache, and `attention` = (queries, context, ms) of the model's attention (all layers) for
    queries at the end of a context. `kv_read_ms`: a decode row's cost per context token. `floor`: the
    smallest prefill step (n, ms), whose time is mostly the host's.

    A step's host work (Python, launches) overlaps its device work, so the step takes about the larger of
    the two, not their sum. Where `short` runs well above the floor (device-bound), the line through `short`
    and `long` is the device's cost and its intercept the device's fixed cost per step; the floor is only
    reported. Otherwise (or without a floor) the line runs through `short` and `long` as given, its intercept
    carrying the host's time: larger than the device's, so chunks come out smaller than the target allows,
    never larger. (The H200 calibration through the 128-token step gave a 38 ms intercept, and steps planned
    for 150 ms ran 82 ms at the median and 118 ms at p99.)"""
    q, ctx, attn_ms = attention
    per_context = max(attn_ms, 0.0) / (q * ctx)
    (n1, t1), (n2, t2) = short, long
    host = 0.0
    if floor is not None:
        host = floor[1]
        if t1 <= HOST_BOUND * host:  # short is host-bound: fit through the floor instead, as before
            (n1, t1) = floor
    # the attention inside those steps, from the measured rate: what is left is linear in n
    r1 = t1 - per_context * n1 * (n1 + 1) / 2
    r2 = t2 - per_context * n2 * (n2 + 1) / 2
    per_token = max((r2 - r1) / (n2 - n1), 0.0) if n2 != n1 else 0.0
    overhead = max(r1 - per_token * n1, 0.0)
    return StepCostModel(
        overhead_ms=overhead,
        per_token_ms=per_token,
        per_context_ms=per_context,
        per_kv_read_ms=max(kv_read_ms, 0.0),
        target_ms=target_ms,
        host_floor_ms=host,
    )
