"""When each benchmark request is sent: the arrival processes of `vllm bench serve`.

    request rate inf            every request at t = 0
    request rate R              each request waits a gap drawn from a gamma distribution of mean 1/R and
                                shape `burstiness` (1: exponential gaps, a Poisson process; below 1 burstier,
                                above 1 more even; inf: every gap exactly 1/R); the send times are the running
                                sums of the gaps, scaled so the last request goes at n / R (the run sends at
                                exactly R requests/s whatever the seed, as vLLM does)
    ramp-up start -> end        request i's gap is drawn at the rate
                                    linear       start + (end - start) * i / (n - 1)
                                    exponential  start * (end / start) ** (i / (n - 1))
                                with the same burstiness and no rescaling; a rate of 0 (a linear ramp-up
                                from 0, first request) sends at once

The first request also waits its gap, as in vLLM. Everything comes from one `random.Random(seed)`.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

RAMP_UP_STRATEGIES = ("linear", "exponential")


@dataclass(frozen=True, kw_only=True)
class RampUp:
    """A request rate that moves from `start_rps` to `end_rps` over the run (requests/s)."""

    strategy: str
    start_rps: float
    end_rps: float

    def __post_init__(self) -> None:
        if self.strategy not in RAMP_UP_STRATEGIES:
            raise ValueError(f"ramp-up strategy {self.strategy!r}: use one of {list(RAMP_UP_STRATEGIES)}")
        for name, v in (("start", self.start_rps), ("end", self.end_rps)):
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"ramp-up {name} rate must be a finite number >= 0 requests/s, got {v}")
        if self.end_rps <= 0:
            raise ValueError(f"ramp-up end rate must be > 0 requests/s, got {self.end_rps}")
        if self.start_rps > self.end_rps:
            raise ValueError(
                f"ramp-up start rate ({self.start_rps:g}) must be at most its end rate ({self.end_rps:g})"
            )
        if self.strategy == "exponential" and self.start_rps <= 0:
            raise ValueError("an exponential ramp-up needs a start rate > 0 requests/s (it multiplies it)")

    def rate(self, i: int, n: int) -> float:
        """The request rate when request i of n is sent."""
        progress = i / max(n - 1, 1)
        if self.strategy == "linear":
            return self.start_rps + (self.end_rps - self.start_rps) * progress
        return self.start_rps * (self.end_rps / self.start_rps) ** progress


def check_burstiness(burstiness: float) -> float:
    if not burstiness > 0:  # also refuses nan
        raise ValueError(f"burstiness must be a number > 0 (or inf), got {burstiness}")
    return burstiness


def _gap(rng: random.Random, rate: float, burstiness: float) -> float:
    """One inter-arrival gap at `rate`: gamma of shape k and scale 1/(rate k), so mean 1/rate and coefficient
    of variation 1/sqrt(k)."""
    if rate == math.inf or rate <= 0:
        return 0.0
    if burstiness == math.inf:
        return 1.0 / rate
    return rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def arrival_offsets(
    n: int, request_rate: float, seed: int, *, burstiness: float = 1.0, ramp_up: RampUp | None = None
) -> list[float]:
    """Send times in seconds from the run start for `n` requests (see the module docstring)."""
    check_burstiness(burstiness)
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 requests/s or inf, got {request_rate}")
    if n <= 0:
        return []
    if ramp_up is None and request_rate == math.inf:
        return [0.0] * n
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += _gap(rng, ramp_up.rate(i, n) if ramp_up is not None else request_rate, burstiness)
        out.append(t)
    if ramp_up is None and out[-1] > 0:
        scale = (n / request_rate) / out[-1]
        out = [x * scale for x in out]
    return out
