"""`StepTimeFeedback`: how far the calibrated step cost model is off on the steps it actually sizes, measured
as the engine runs, so the step-time target holds the real step time rather than the model's figure.

The model (`step_cost.py`) is a line fitted to prefill-only steps at start-up. A served step is different: it
runs beside hundreds of decode rows, and its host work (eager launches) overlaps its device work, which a sum
of terms cannot say. On one H100 the 30B-A3B model's calibrated line (38 ms + 27 us a token) said 150 ms for
refill steps of 512 decode rows and ~3,300 prompt tokens that ran in ~89 ms; on another, whose host was
slower, the line (92 ms + 1.7 us a token) said ~95 ms for steps beside 512 decode rows that ran ~125 ms.

So each step that carries prefill chunks records the time the model predicted for it, and when its tokens
are read, the time it took: the interval since the previous step's read, which is what every stream sees
between tokens. With async scheduling the steps overlap and that read comes after the plan; without it, the
host's work between the read and the next plan (appending tokens, emitting them) is part of the interval
too, and timing from the plan alone leaves it out (a fairness run with the report's synchronous YAML, timed
that way, had its streams' inter-token p99 6.5% over the target). Only a step planned while nothing was
running is timed from its plan: the engine may have idled before it.

The ratio measured / predicted of the last WINDOW such steps, at its largest, scales the target:
the scheduler plans steps to HEADROOM x target / scale in the model's units. Taking the largest ratio keeps
the slow tail of steps under the target (the inter-token p99 a fairness target is about) while a systematic
overestimate is given back; one slow step lowers the budget at once and recovers as it leaves the window.
The headroom is there because the target is a most, not a mean: a step slower than every one in the window
(one in WINDOW + 1 of steps with the same spread) would otherwise land just over it.

Only the steps whose prefill took at least MIN_SHARE of the prefill time the budget left (after the fixed
cost and the decode rows) are observed: the steps the budget shapes. A step of a few prompt tokens is
mostly the fixed cost, which the calibration of prefill-only steps gets least right (the slower host above:
its small steps ran 1.34x their figure, its full ones ~1.25x); letting those set the scale held every refill
step to a fraction of the token budget. Ratios outside [MIN_SCALE, MAX_SCALE] are clamped."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

# ratios of the last this many observed steps
WINDOW = 32
# only steps whose prefill chunks took this share of the prefill time budget or more are observed (above)
MIN_SHARE = 0.5
# once steps are measured, they are planned to this share of the target (above)
HEADROOM = 0.95
# the scale stays within these bounds (a model at most 5x too pessimistic or too optimistic)
MIN_SCALE, MAX_SCALE = 0.2, 5.0


class StepTimeFeedback:
    def __init__(self, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self._ratios: deque[float] = deque(maxlen=WINDOW)
        self._last_read: float | None = None
        self.observed = 0  # steps observed so far

    @property
    def scale(self) -> float:
        """Measured / predicted step time, the largest over the window (1.0 before any observation)."""
        return max(self._ratios) if self._ratios else 1.0

    def target_ms(self, target_ms: float) -> float:
        """The target in the model's milliseconds: what the model may predict for a step that should
        really take at most `target_ms` (the model's own figure until a step is measured)."""
        if not self._ratios:
            return target_ms
        return HEADROOM * target_ms / self.scale

    def on_read(
        self,
        planned_at: float | None,
        predicted_ms: float | None,
        prefill_share: float,
        follows: bool = False,
    ) -> None:
        """A step's tokens were read now. `planned_at`: when the step was planned (the clock's seconds);
        `predicted_ms`: the model's figure for it, None for a step the target did not size;
        `prefill_share`: its prefill chunks' predicted ms over the prefill budget the plan had (1 where the
        decode rows left none); `follows`: requests were running when it was planned, so the engine went
        from the previous read straight on to it (it did not idle)."""
        now = self.clock()
        last, self._last_read = self._last_read, now
        if planned_at is None or predicted_ms is None or predicted_ms <= 0 or prefill_share < MIN_SHARE:
            return
        if last is None:
            start = planned_at
        else:
            start = last if follows else max(planned_at, last)
        took_ms = (now - start) * 1e3
        self._ratios.append(min(max(took_ms / predicted_ms, MIN_SCALE), MAX_SCALE))
        self.observed += 1
