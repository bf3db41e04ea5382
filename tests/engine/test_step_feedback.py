"""The step-time target corrected by measured step times (engine/scheduler/step_feedback.py): a calibrated
model that overestimates its steps gives the time back to prefill, one that underestimates them takes it,
and neither the analytic model nor the outputs change."""

from __future__ import annotations

import pytest

from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.step_cost import StepCostModel, analytic_step_cost
from hyserve.engine.scheduler.step_feedback import HEADROOM, MAX_SCALE, MIN_SCALE, WINDOW, StepTimeFeedback
from tests.engine.test_engine_invariance import GREEDY, make_llm, prompts
from tests.engine.test_scheduler_state_machine import _run
from tests.engine.test_step_composition import _req, _sched


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _feedback() -> tuple[StepTimeFeedback, Clock]:
    clock = Clock()
    return StepTimeFeedback(clock=clock), clock


def test_scale_is_the_largest_measured_over_predicted_ratio_of_the_window() -> None:
    fb, clock = _feedback()
    assert fb.scale == 1.0 and fb.target_ms(150.0) == 150.0  # nothing measured: the model as calibrated
    clock.t = 100.09  # planned at 100.0, read 90 ms later; predicted 150 ms
    fb.on_read(100.0, 150.0, 1.0)
    assert fb.scale == pytest.approx(0.6) and fb.target_ms(150.0) == pytest.approx(HEADROOM * 250.0)
    clock.t += 0.120  # a slower step (planned before the previous read: the interval between reads counts)
    fb.on_read(100.05, 150.0, 1.0)
    assert fb.scale == pytest.approx(0.8)
    for _ in range(WINDOW):  # the slow step leaves the window after WINDOW faster ones
        clock.t += 0.075
        fb.on_read(clock.t - 0.2, 150.0, 0.8)
    assert fb.scale == pytest.approx(0.5) and fb.observed == WINDOW + 2


def test_a_step_planned_after_the_previous_read_is_timed_from_its_plan() -> None:
    fb, clock = _feedback()
    fb.on_read(None, None, 0.0)  # a read with nothing to measure still marks the time
    clock.t = 130.0  # idle 30 s, then a step planned at 129.9 and read at 130.0: 100 ms, not 30 s
    fb.on_read(129.9, 200.0, 1.0)
    assert fb.scale == pytest.approx(0.5)


def test_a_step_that_follows_a_read_counts_the_host_time_since_that_read() -> None:
    """Without async scheduling the host appends and emits a step's tokens before it plans the next one:
    streams wait for that too, so a step planned while requests ran is timed from the previous read."""
    fb, clock = _feedback()
    fb.on_read(None, None, 0.0)  # read at 100.0
    clock.t = 100.12  # planned at 100.02 after 20 ms of host work, read 100 ms later; predicted 100 ms
    fb.on_read(100.02, 100.0, 1.0, follows=True)
    assert fb.scale == pytest.approx(1.2)
    clock.t = 100.34  # the same step planned when nothing ran: timed from its plan
    fb.on_read(100.24, 100.0, 1.0, follows=False)
    assert list(fb._ratios) == pytest.approx([1.2, 1.0])


def test_the_scheduler_marks_steps_planned_while_requests_run() -> None:
    sched = _sched(budget=64, blocks=100, cost=CAL)
    sched.add(_req("a", 100))
    first, _ = sched.schedule()
    assert not first.follows  # nothing ran before it: the engine may have idled
    _run(sched, first)
    second, _ = sched.schedule()
    assert second.follows


def test_small_steps_and_wild_ratios_do_not_move_the_target() -> None:
    fb, clock = _feedback()
    clock.t = 101.0
    fb.on_read(100.0, 70.0, 0.3)  # its chunks took 0.3 of the prefill budget: the budget did not shape it
    assert fb.scale == 1.0 and fb.observed == 0
    clock.t = 200.0
    fb.on_read(199.0, 100.0, 1.0)  # 1 s for a 100 ms prediction: clamped
    assert fb.scale == MAX_SCALE
    fb2, clock2 = _feedback()
    clock2.t = 100.001
    fb2.on_read(100.0, 150.0, 1.0)
    assert fb2.scale == MIN_SCALE


CAL = StepCostModel(overhead_ms=1.0, per_token_ms=0.1, per_context_ms=0.0, per_kv_read_ms=0.0, target_ms=9.0)


def _chunk_sizes(cost: StepCostModel, ratio: float) -> tuple[int, int, float]:
    """A long prompt prefilled under `cost`: its first chunk, and its chunk after 8 steps that each took
    `ratio` x their predicted time; and the scheduler's scale then."""
    sched = _sched(budget=512, blocks=1000, cost=cost)
    clock = Clock()
    sched.feedback.clock = clock
    sched.add(_req("long", 3000))
    sizes = []
    for _ in range(9):
        batch, _ = sched.schedule()
        assert batch.planned_at == clock.t
        sizes.append(batch.num_prefill_tokens)
        if batch.predicted_ms is not None:
            clock.t += ratio * batch.predicted_ms / 1e3
        sched.on_read(batch)
        _run(sched, batch)
    return sizes[0], sizes[-1], sched.feedback.scale


def test_an_overestimating_model_gives_the_time_back_to_prefill() -> None:
    first, later, scale = _chunk_sizes(CAL, 0.5)
    assert first == 80  # (9 - 1) ms / 0.1 ms a token, as calibrated
    # steps took half: planned to HEADROOM x 9 / 0.5 = 17.1 ms, 16.1 ms of tokens, 160 on an SSD chunk
    # boundary
    assert scale == pytest.approx(0.5) and later == 160


def test_an_underestimating_model_takes_the_time_from_prefill() -> None:
    first, later, scale = _chunk_sizes(CAL, 2.0)
    # (HEADROOM x 9 / 2 - 1) ms: 32 tokens
    assert first == 80 and scale == pytest.approx(2.0) and later == 32


def test_steps_of_a_few_prompt_tokens_do_not_set_the_scale() -> None:
    """A step whose chunks took a small share of the prefill time the plan had is mostly the fixed cost,
    which the calibration of prefill-only steps gets least right. On an H100 whose host was slow such steps
    ran 1.34x their figure; letting them set the scale held the refill steps of 1,000-token prompts to a
    fraction of the token budget. Here short arrivals run 3x their figure unobserved, and the long prompt
    after them starts at the calibrated chunk; its own slow step is observed."""
    sched = _sched(budget=512, max_batch=16, blocks=1000, cost=CAL)
    clock = Clock()
    sched.feedback.clock = clock
    for i in range(6):
        sched.add(_req(f"short{i}", 4))
        batch, _ = sched.schedule()
        assert batch.predicted_ms is not None and batch.prefill_share < 0.06  # 0.4 ms of the ~8 left
        clock.t += 3 * batch.predicted_ms / 1e3
        sched.on_read(batch)
        _run(sched, batch)
    assert sched.feedback.observed == 0 and sched.feedback.scale == 1.0
    sched.add(_req("long", 3000))
    batch, _ = sched.schedule()
    # (9 - 1 - 6 decode rows x 0.1) ms: 74 tokens, 72 on an SSD chunk boundary, as calibrated
    assert batch.num_prefill_tokens == 72 and batch.prefill_share > 0.9
    clock.t += 2 * batch.predicted_ms / 1e3
    sched.on_read(batch)
    assert sched.feedback.observed == 1 and sched.feedback.scale == pytest.approx(2.0)


def test_the_analytic_model_is_not_corrected() -> None:
    """The CPU's model counts GFLOPs, not milliseconds: measured times say nothing of its error."""
    analytic = analytic_step_cost(params=10_000_000, attention_flops_per_pair=0, max_num_tokens=80)
    first, later, scale = _chunk_sizes(analytic, 0.5)
    assert scale == 1.0 and later == first == 80


def test_the_engine_times_the_steps_a_calibrated_target_sizes() -> None:
    """Through LLM.generate: every step with prefill chunks carries its predicted time and is observed when
    read; the scale is exported (step_time_scale, on /metrics); greedy outputs stay the same."""
    ref = make_llm(max_num_tokens=64).generate(prompts(), GREEDY)
    llm = make_llm(max_num_tokens=64)
    llm.engine.scheduler.cost = StepCostModel(
        overhead_ms=0.5, per_token_ms=0.05, per_context_ms=2e-3, per_kv_read_ms=1e-4, target_ms=4.0
    )
    outs = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    fb = llm.engine.scheduler.feedback
    assert fb.observed > 0
    assert llm.stats()["step_time_scale"] == fb.scale != 1.0


def _serve(feedback: bool) -> tuple[float, float]:
    """48 requests of 400 prompt tokens and 8 output tokens through 16 slots, a step-time target the
    calibrated model sizes chunks to, and steps shaped as on a GPU: a fixed 20 ms (the decode rows' weight
    and state reads) plus 0.03 ms a prompt token, and at least 30 ms of host launches for a step with
    prefill, where the model's line through prefill-only steps says 10 ms + 0.1 ms a token. Returns the
    simulated seconds to finish them all and the most prompt tokens a step carried."""
    cost = StepCostModel(
        overhead_ms=10.0, per_token_ms=0.1, per_context_ms=0.0, per_kv_read_ms=0.0, target_ms=40.0
    )
    sched = _sched(budget=512, max_batch=16, blocks=4000, cost=cost)
    clock = Clock()
    sched.feedback.clock = clock
    reqs = [_req(f"r{i}", 400, SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(48)]
    for r in reqs:
        sched.add(r)
    start, prefill = clock.t, []
    while sched.has_work():
        batch, _ = sched.schedule()
        if batch.num_prefill_tokens:
            prefill.append(batch.num_prefill_tokens)
        n = batch.num_prefill_tokens
        clock.t += (max(30.0, 20.0 + 0.03 * n) if n else 20.0) / 1e3
        if feedback:
            sched.on_read(batch)
        _run(sched, batch)
        for r in [r for r in sched.running if len(r.output_token_ids) >= 8]:
            sched.finish(r, "length")
    return clock.t - start, max(prefill)


def test_a_refill_under_an_overestimating_model_runs_in_fewer_fuller_steps() -> None:
    """What the correction is for: a server refilling its batch with new prompts, whose steps run faster
    than the calibrated model says, prefills more of them a step and so finishes the same work sooner."""
    took, most = _serve(feedback=True)
    took_off, most_off = _serve(feedback=False)
    assert most > 400 and most_off <= 320  # 408 against 300 prompt tokens a step
    assert took < 0.95 * took_off  # 0.79 against 0.86 simulated seconds
