"""Step composition under long prompts (docs/architecture.md, "Step composition"): decodes first, then
the first chunks of new arrivals, then continuing prefills sharing what is left; the step cost model's
chunk sizing; and greedy outputs that do not depend on any of it."""

from __future__ import annotations

import math

import pytest

from hyserve.engine.request import Request
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import Scheduler
from hyserve.engine.scheduler.step_cost import StepCostModel, fit_step_cost
from tests.engine.test_engine_invariance import GREEDY, make_llm, prompts
from tests.engine.test_scheduler_state_machine import _run, make

LONG = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def _sched(*, budget: int = 64, max_batch: int = 6, blocks: int = 400, **kw) -> Scheduler:
    _, _, sched = make(
        num_blocks=blocks, max_batch=max_batch, budget_tokens=budget, snapshots=4, max_seq_len=4096
    )
    for k, v in kw.items():
        setattr(sched, k, v)
    return sched


def _req(rid: str, n: int, params: SamplingParams = LONG) -> Request:
    return Request(rid, [1 + (i * 7 + len(rid)) % 200 for i in range(n)], params)


def _chunks(batch) -> dict[str, int]:
    return {s.request_id: len(s.token_ids) for s in batch.seqs}


def test_a_short_arrival_is_admitted_next_step_beside_a_long_prefill() -> None:
    sched = _sched()
    sched.add(_req("long", 1000))
    first, _ = sched.schedule()
    assert _chunks(first) == {"long": 64}  # alone, it takes the whole budget
    _run(sched, first)
    sched.add(_req("short", 9))
    second, _ = sched.schedule()
    got = _chunks(second)
    assert got["short"] == 9 and got["long"] == 64 - 9  # the arrival whole, the long prompt the rest
    assert second.seqs[0].request_id == "long"  # batch order: continuing chunks, then admissions


def test_a_long_prefill_progresses_every_step_under_a_stream_of_arrivals() -> None:
    sched = _sched(budget=32, max_batch=32)
    sched.add(_req("long", 600))
    done = 0
    for i in range(30):
        for j in range(3):  # arrivals that would fill the budget on their own
            sched.add(_req(f"s{i}-{j}", 12, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        batch, _ = sched.schedule()
        got = _chunks(batch)
        if done < 600:  # at least a token (a chunk cut at a snapshot boundary may be short), ...
            assert got.get("long", 0) >= 1, f"step {i}: {got}"
            done += got.get("long", 0)
        _run(sched, batch)
        for r in [r for r in sched.running if r.output_token_ids and r.request_id != "long"]:
            sched.finish(r, "length")
    assert done >= 30 * sched.chunk_size // 2  # ... and about the reserve of one SSD chunk a step


def test_continuing_long_prefills_share_the_budget() -> None:
    """Two long prompts part-way split the budget; a third does not start (no slot held, no first chunk)
    until one of them finishes, since max_num_partial_prefills (2) prompts are already part-way."""
    sched = _sched(budget=60, max_num_partial_prefills=2)
    for rid in ("a", "b", "c"):
        sched.add(_req(rid, 500))
    _run(sched, sched.schedule()[0])  # a starts with the whole budget
    got = _chunks(sched.schedule()[0])
    assert set(got) == {"a", "b"} and got["b"] <= sched.long_prefill_token_threshold
    _run(sched, sched.schedule()[0])
    batch = sched.schedule()[0]
    assert _chunks(batch) == {"a": 30, "b": 30}  # nobody waits that could start: the two split the budget
    _run(sched, batch)
    steps = 0
    while {r.request_id for r in sched.waiting} == {"c"}:
        _run(sched, sched.schedule()[0])
        steps += 1
        assert steps < 40
    assert min(sched.running, key=lambda r: r.num_computed).request_id == "c"
    assert any(r.num_computed >= 500 for r in sched.running if r.request_id in ("a", "b"))


def test_an_arrival_beside_a_continuing_prefill_is_capped() -> None:
    sched = _sched(budget=64, long_prefill_token_threshold=16)
    sched.add(_req("first", 400))
    _run(sched, sched.schedule()[0])
    sched.add(_req("second", 400))
    got = _chunks(sched.schedule()[0])
    assert got == {"first": 64 - 16, "second": 16}


COST = StepCostModel(
    overhead_ms=1.0, per_token_ms=0.01, per_context_ms=1e-4, per_kv_read_ms=1e-6, target_ms=9.0
)


def test_max_chunk_is_the_largest_that_fits() -> None:
    for start in (0, 10, 1000, 100_000):
        for ms in (0.5, 3.0, 40.0):
            n = COST.max_chunk(start, ms)
            assert COST.chunk_ms(start, n) <= ms < COST.chunk_ms(start, n + 1)
    assert COST.max_chunk(5, 0.0) == 0
    flat = StepCostModel(overhead_ms=0, per_token_ms=0.5, per_context_ms=0, per_kv_read_ms=0, target_ms=1)
    assert flat.max_chunk(123, 10.0) == 20


def test_fit_recovers_the_model_it_was_timed_from() -> None:
    true = StepCostModel(
        overhead_ms=3.0, per_token_ms=0.004, per_context_ms=2e-8, per_kv_read_ms=5e-9, target_ms=100
    )

    def step(n: int) -> float:
        return true.overhead_ms + true.chunk_ms(0, n)

    got = fit_step_cost(
        short=(128, step(128)),
        long=(8192, step(8192)),
        attention=(512, 131072, true.per_context_ms * 512 * 131072),
        kv_read_ms=5e-9,
        target_ms=100,
    )
    for f in ("overhead_ms", "per_token_ms", "per_context_ms", "per_kv_read_ms"):
        assert math.isclose(getattr(got, f), getattr(true, f), rel_tol=1e-9), f


def test_fit_keeps_the_host_floor_out_of_a_device_bound_step() -> None:
    """A step takes the larger of its host and device times: with a 38 ms host floor (the H200 calibration's
    128-token step) and device-bound 4096- and 16384-token steps, the fit is the device's line (its fixed
    cost, not the host's) and reports the floor; a host-bound `short` falls back to the floor's line."""
    true = StepCostModel(
        overhead_ms=6.0, per_token_ms=0.027, per_context_ms=2.6e-10, per_kv_read_ms=3.5e-9, target_ms=150
    )
    host = 38.0

    def step(n: int) -> float:
        return max(host, true.overhead_ms + true.chunk_ms(0, n))

    attention = (512, 131072, true.per_context_ms * 512 * 131072)
    got = fit_step_cost(
        floor=(128, step(128)),
        short=(4096, step(4096)),
        long=(16384, step(16384)),
        attention=attention,
        kv_read_ms=3.5e-9,
        target_ms=150,
    )
    for f in ("overhead_ms", "per_token_ms", "per_context_ms"):
        assert math.isclose(getattr(got, f), getattr(true, f), rel_tol=1e-9), f
    assert got.host_floor_ms == host and "host floor 38.0 ms" in got.describe()
    # the old fit through the 128-token step: the host's 38 ms as a per-step cost (and a shallower slope), so
    # its chunks fill only ~130 of the 150 ms (4,564 tokens against 5,333 here)
    old = fit_step_cost(
        short=(128, step(128)),
        long=(16384, step(16384)),
        attention=attention,
        kv_read_ms=3.5e-9,
        target_ms=150,
    )
    assert old.overhead_ms > 30 and old.host_floor_ms == 0
    new_n, old_n = got.max_chunk(0, 150 - got.overhead_ms), old.max_chunk(0, 150 - old.overhead_ms)
    assert new_n > 1.15 * old_n
    assert math.isclose(step(new_n), 150, rel_tol=1e-3) and step(old_n) < 135
    # short host-bound too (a fast model): the line through the floor and long, as without a floor
    slow_host = 200.0
    t = {n: max(slow_host, true.overhead_ms + true.chunk_ms(0, n)) for n in (128, 4096, 16384)}
    fell_back = fit_step_cost(
        floor=(128, t[128]),
        short=(4096, t[4096]),
        long=(16384, t[16384]),
        attention=attention,
        kv_read_ms=3.5e-9,
        target_ms=150,
    )
    plain = fit_step_cost(
        short=(128, t[128]), long=(16384, t[16384]), attention=attention, kv_read_ms=3.5e-9, target_ms=150
    )
    assert (
        math.isclose(fell_back.per_token_ms, plain.per_token_ms)
        and fell_back.overhead_ms == plain.overhead_ms
    )


def test_cost_model_chunks_shrink_as_context_grows_and_respect_budget_and_snapshots() -> None:
    sched = _sched(budget=256, blocks=1000, cost=COST)
    req = _req("long", 3000)
    sched.add(req)
    sizes, starts = [], []
    while req.num_computed < 3000:
        batch, _ = sched.schedule()
        (seq,) = batch.seqs
        assert len(seq.token_ids) <= 256
        assert (
            COST.overhead_ms + COST.chunk_ms(seq.start_pos, len(seq.token_ids)) <= COST.target_ms
            or len(seq.token_ids) <= sched.chunk_size
        )
        # every snapshot boundary the chunk covers is taken, at its position
        assert [seq.start_pos + k for k, _ in seq.snapshots] == [p for p in seq.snapshot_positions]
        sizes.append(len(seq.token_ids))
        starts.append(seq.start_pos)
        _run(sched, batch)
    assert sizes[0] > sizes[-2] >= sched.chunk_size  # shrinking with context, never below one SSD chunk
    assert all(a >= b for a, b in zip(sizes[:-1], sizes[1:-1]))
    assert all(s % sched.chunk_size == 0 for s in starts)  # timed cuts keep chunks aligned


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = make_llm()
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts()]


@pytest.mark.parametrize(
    "opts",
    [
        dict(max_num_tokens=40, max_num_partial_prefills=1),
        dict(max_num_tokens=40, max_num_partial_prefills=3, long_prefill_token_threshold=8),
        dict(max_num_tokens=64, max_num_partial_prefills=8, long_prefill_token_threshold=5),
    ],
)
def test_greedy_outputs_do_not_depend_on_step_composition(reference, opts) -> None:
    outs = make_llm(**opts).generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_greedy_outputs_do_not_depend_on_the_cost_model(reference) -> None:
    llm = make_llm(max_num_tokens=64)
    llm.engine.scheduler.cost = StepCostModel(
        overhead_ms=0.5, per_token_ms=0.05, per_context_ms=2e-3, per_kv_read_ms=1e-4, target_ms=4.0
    )
    outs = llm.generate(prompts(), GREEDY)
    assert [o.token_ids for o in outs] == reference


def test_start_up_gives_the_scheduler_the_calibrated_model(monkeypatch) -> None:
    """max_step_ms at start-up reaches the scheduler: the calibration's model is the one chunks are sized by
    (on the CPU calibration has nothing to time and says so; here it is replaced by a fixed model)."""
    from hyserve.engine.lifecycle.calibration import StepCostCalibration

    model = StepCostModel(
        overhead_ms=0.5, per_token_ms=0.05, per_context_ms=2e-3, per_kv_read_ms=1e-4, target_ms=7.0
    )
    seen: list[float] = []

    def fake(self: StepCostCalibration, target_ms: float) -> StepCostModel:
        seen.append(target_ms)
        return model

    monkeypatch.setattr(StepCostCalibration, "timed", fake)
    assert make_llm(max_num_tokens=64, max_step_ms=7.0).engine.scheduler.cost is model and seen == [7.0]
    off = make_llm(max_num_tokens=64, max_step_ms="off").engine.scheduler.cost
    assert off is None and seen == [7.0]  # off: not calibrated
    auto = make_llm(max_num_tokens=64).engine.scheduler.cost  # auto on the CPU: counted, not timed
    assert auto is not None and auto.source == "analytic" and seen == [7.0]


def test_max_step_ms_on_the_cpu_says_there_is_no_model(caplog) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = make_llm(max_num_tokens=64, max_step_ms=7.0)
    assert llm.engine.scheduler.cost is None
    assert any("max_step_ms 7: no step cost model on cpu" in r.getMessage() for r in caplog.records), (
        caplog.text
    )


def test_the_engine_counts_steps_and_the_prefill_tokens_they_carry() -> None:
    """`steps_total`, `prefill_steps_total` and `prefill_tokens_scheduled_total` (exported on /metrics): a
    prompt of 150 tokens at 40 tokens a step is 4 prefill steps of 150 tokens in all, then decode-only steps
    for the rest of its output (the token budget alone: no step-time target)."""
    llm = make_llm(max_num_tokens=40, max_step_ms="off")
    before = llm.stats()
    out = llm.generate(
        [[1] + list(range(5, 154))], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    )
    assert len(out[0].token_ids) == 6
    d = {
        k: llm.stats()[k] - before[k]
        for k in ("steps_total", "prefill_steps_total", "prefill_tokens_scheduled_total")
    }
    assert d["prefill_tokens_scheduled_total"] == 150 and d["prefill_steps_total"] == 4
    assert d["steps_total"] == 4 + 5  # the last prefill chunk samples the first token; 5 decode steps


@pytest.mark.parametrize("max_num_tokens", [254, 250, 256, 100])
def test_calibration_prompts_each_run_in_one_prefill_step(max_num_tokens: int) -> None:
    """The step cost calibration times prompts of `calibration_sizes`: each must be one prefill step, which a
    snapshot boundary off an SSD chunk boundary would break (block reuse on, 12-token blocks, snapshots
    every 24 tokens and at the prompt's end, 8-token SSD chunks: 254 -> 252 would be cut at 240 + 12)."""
    from hyserve.engine.lifecycle.calibration import StepCostCalibration

    llm = make_llm(
        max_num_tokens=max_num_tokens,
        kv_cache_config={
            "tokens_per_block": 12,
            "enable_block_reuse": True,
            "max_gpu_total_bytes": 64 * 2**20,
            "mamba_state_config": {
                "periodic_snapshot_interval": 24,
                "additional_snapshot_offsets_from_end": [0],
            },
        },
    )
    eng = llm.engine
    sizes = StepCostCalibration(eng).sizes()
    floor_n, short_n, long_n = sizes
    assert floor_n == eng.model_config.chunk_size <= short_n <= long_n <= max_num_tokens
    assert long_n % 24 == 0 and (short_n == floor_n or short_n % 24 == 0)
    for i, n in enumerate(sizes):
        before = eng.counters["prefill_steps_total"]
        eng.add_request(
            f"cal-{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        )
        while eng.has_unfinished():
            eng.step()
        assert eng.counters["prefill_steps_total"] - before == 1, (n, sizes)


def _burst(n: int, plen: int, cost: StepCostModel) -> tuple[Scheduler, list]:
    """n distinct prompts of plen tokens arriving at once into n slots; returns the scheduler and the
    steps until every prompt is prefilled (each step as {request: chunk tokens}, predicted ms)."""
    sched = _sched(budget=512, max_batch=n, blocks=4000, cost=cost)
    for i in range(n):
        sched.add(Request(f"b{i}", [1 + (i * 131 + j * 17) % 199 for j in range(plen)], LONG))
    steps = []
    while any(r.num_computed < r.num_prompt_tokens for r in [*sched.waiting, *sched.running]):
        batch, _ = sched.schedule()
        steps.append((_chunks(batch), batch.predicted_ms))
        _run(sched, batch)
        assert len(steps) < 200
    return sched, steps


def test_a_burst_of_arrivals_starts_what_the_step_time_allows_not_one_chunk_each() -> None:
    """Many prompts arriving at once under a step-time target: a step admits the first chunks the target
    leaves time for, and one more at most; it does not give every waiting prompt one SSD chunk, which ran
    steps at 3x the target and left dozens of prompts started, each holding a slot and waiting for a share
    of a later step. Arrivals claim at most ARRIVAL_MS_SHARE of the prefill time while prompts already
    started continue, so those finish first."""
    cost = StepCostModel(
        overhead_ms=1.0, per_token_ms=0.1, per_context_ms=0.0, per_kv_read_ms=0.0, target_ms=9.0
    )
    _, steps = _burst(48, 100, cost)
    first, ms = steps[0]
    assert len(first) <= 2 and ms is not None and ms <= 9.0 + 0.4  # (9 - 1) ms of tokens, then one SSD chunk
    worst = max(ms for _, ms in steps if ms is not None)
    assert worst <= 9.0 + 0.4 + 48 * 0.1  # the target, one SSD chunk past it, the decode rows' tokens
    for chunks, _ in steps:  # never more than a few prompts in flight beside the decodes
        assert sum(1 for n in chunks.values() if n > 1) <= 4, chunks


def test_a_short_arrival_starts_beside_a_prefill_whose_smallest_chunk_overruns_the_target() -> None:
    """Deep in a long prompt one SSD chunk alone costs more than the step-time target leaves for prefill. A
    short request arriving then still starts next step: the time its first chunk was set aside is its own,
    whatever the continuing chunk overran."""
    cost = StepCostModel(
        overhead_ms=1.0, per_token_ms=0.1, per_context_ms=6e-4, per_kv_read_ms=0.0, target_ms=9.0
    )
    sched = _sched(budget=512, blocks=4000, cost=cost)
    sched.add(_req("long", 4000))
    long = None
    for _ in range(3000):
        _run(sched, sched.schedule()[0])
        long = sched.running[0]
        if cost.chunk_ms(long.num_computed, sched.chunk_size) > 9.0 - 1.0:
            break
    assert long is not None and long.num_computed < 4000
    sched.add(_req("short", 6, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
    got = _chunks(sched.schedule()[0])
    assert got.get("short") == 6 and got["long"] >= 1, got
