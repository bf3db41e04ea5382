"""Batch waiting (TensorRT-LLM's batch_wait_timeout_iters / batch_wait_max_tokens_ratio): while a batch
decodes and more requests wait than slots are free, admissions wait for finishing requests to free slots,
so new prompts start together in fewer eager steps; never on a lightly loaded scheduler, never beside a
continuing prefill, never past the timeout."""

from __future__ import annotations

import pytest

from hyserve.config import build_engine_config
from hyserve.engine.request import Request
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import Scheduler
from hyserve.engine.scheduler.step_cost import StepCostModel
from tests.engine.test_scheduler_state_machine import fake_step, make

PROMPT = 8


def _sched(iters: int, ratio: float = 0.5, *, batch: int = 8, budget: int = 64) -> Scheduler:
    _, _, sched = make(num_blocks=400, max_batch=batch, budget_tokens=budget, snapshots=4, max_seq_len=4096)
    sched.batch_wait_iters = iters
    sched.batch_wait_tokens = ratio * budget
    return sched


def _req(rid: str, max_tokens: int, n: int = PROMPT) -> Request:
    return Request(rid, [3 + (i * 5 + len(rid)) % 100 for i in range(n)], _params(max_tokens))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _add(sched: Scheduler, reqs: dict[str, Request], *, queued: int) -> None:
    """Add `reqs`, then `queued` more long requests (q0, q1, ...) that queue behind them."""
    reqs.update({f"q{i}": _req(f"q{i}", 100) for i in range(queued)})
    for r in reqs.values():
        sched.add(r)


def _step(sched: Scheduler, reqs: dict[str, Request]) -> list[str]:
    """One step with a fake model (a sampling row emits token 7); returns the requests admitted in it."""
    before = {r.request_id for r in sched.running}
    batch = fake_step(sched, reqs)
    return [s.request_id for s in batch.seqs[batch.num_decodes :] if s.request_id not in before]


def _serve(iters: int) -> tuple[list[list[str]], dict[str, Request]]:
    """48 requests with staggered lengths (one finishes every few steps) through an 8-request batch; the
    admissions of every step."""
    sched = _sched(iters)
    reqs = {f"r{i}": _req(f"r{i}", 6 + (i * 7) % 23) for i in range(48)}
    for r in reqs.values():
        sched.add(r)
    steps = []
    for _ in range(3000):
        if not sched.has_work():
            break
        steps.append(_step(sched, reqs))
    return steps, reqs


def test_admissions_wait_for_a_batch_of_free_slots_and_every_request_finishes() -> None:
    plain, reqs = _serve(iters=0)
    assert all(r.finished for r in reqs.values())
    waited, reqs = _serve(iters=50)
    assert all(r.finished for r in reqs.values())
    # after the first wave: 8 + 7k tokens (decode rows + first chunks) reach 0.5 x 64 at k = 4 free slots,
    # unless the queue holds fewer than that
    later = [a for a in waited[1:] if a]
    assert all(len(a) >= 4 for a in later[:-1]), later
    assert sum(1 for a in waited if a) < sum(1 for a in plain if a) / 2  # far fewer eager steps


def test_no_wait_while_the_queue_fits_the_free_slots() -> None:
    sched = _sched(iters=50)
    reqs = {f"r{i}": _req(f"r{i}", 100) for i in range(3)}
    for r in reqs.values():
        sched.add(r)
    _step(sched, reqs)
    reqs["late"] = _req("late", 100)
    sched.add(reqs["late"])
    assert _step(sched, reqs) == ["late"]  # 3 decoding, one waiting, 5 slots free: admitted at once


def test_waiting_stops_after_the_timeout() -> None:
    sched = _sched(iters=2)
    reqs = {f"r{i}": _req(f"r{i}", 100 if i else 2) for i in range(8)}  # r0 finishes first
    _add(sched, reqs, queued=4)
    admitted = [_step(sched, reqs) for _ in range(6)]
    assert len(admitted[0]) == 8  # the first wave: no decodes yet, nothing to wait for
    # r0 ends at step 2, freeing one slot; admissions wait two steps, then q0 starts
    assert admitted[1:] == [[], [], [], ["q0"], []]


def test_no_wait_beside_a_continuing_prefill() -> None:
    sched = _sched(iters=50)
    reqs = {"long": _req("long", 100, n=400)}
    reqs.update({f"r{i}": _req(f"r{i}", 100 if i else 2) for i in range(1, 7)})
    reqs["r0"] = _req("r0", 1)
    _add(sched, reqs, queued=4)
    steps = [_step(sched, reqs) for _ in range(4)]
    assert reqs["long"].num_computed < 400  # still feeding its prompt in chunks: every step is eager
    assert any("q0" in a for a in steps[1:])  # so the slot r0 freed is taken at once


def test_no_wait_once_the_first_chunks_fill_the_step_time_budget() -> None:
    sched = _sched(iters=50)
    reqs = {f"r{i}": _req(f"r{i}", 100 if i else 1) for i in range(8)}
    _add(sched, reqs, queued=4)
    _step(sched, reqs)  # the first wave; r0 is done
    # 1 ms a token: 7 decode rows and 1 ms of overhead leave 4 ms of the 12 ms target, which one first
    # chunk (4 tokens, an SSD chunk) fills
    sched.cost = StepCostModel(
        overhead_ms=1.0, per_token_ms=1.0, per_context_ms=0.0, per_kv_read_ms=0.0, target_ms=12.0
    )
    assert _step(sched, reqs) == ["q0"]


def test_trtllm_yaml_keys_configure_batch_waiting() -> None:
    cfg = build_engine_config({"batch_wait_timeout_iters": 20, "batch_wait_max_tokens_ratio": 0.5})
    assert (cfg.scheduler.batch_wait_timeout_iters, cfg.scheduler.batch_wait_max_tokens_ratio) == (20, 0.5)


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"batch_wait_timeout_iters": -1}, "batch_wait_timeout_iters: must be >= 0, got -1"),
        ({"batch_wait_timeout_iters": 2.5}, "batch_wait_timeout_iters: expected an integer"),
        ({"batch_wait_max_tokens_ratio": 1.5}, "batch_wait_max_tokens_ratio: must be in [0, 1], got 1.5"),
        ({"batch_wait_max_tokens_ratio": "half"}, "batch_wait_max_tokens_ratio: must be in [0, 1]"),
    ],
)
def test_bad_batch_waiting_settings_are_refused(opts: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_engine_config(opts)


def test_greedy_outputs_do_not_depend_on_batch_waiting() -> None:
    """Through the engine (async scheduling, prefix caching, chunked prefill): 16 prompts with staggered
    lengths through a 3-request batch give the same greedy tokens with batch waiting as without."""
    from tests.engine.test_engine_invariance import make_llm, prompts

    ps = prompts() * 2
    params = [_params(3 + (i * 5) % 11) for i in range(len(ps))]
    outs = []
    for iters in (0, 8):
        llm = make_llm(max_batch_size=3, batch_wait_timeout_iters=iters, batch_wait_max_tokens_ratio=0.9)
        assert llm.engine.scheduler.batch_wait_iters == iters
        outs.append([o.token_ids for o in llm.generate(ps, params)])
        assert (llm.engine.stats()["batch_wait_steps"] > 0) == (iters > 0)  # /metrics: batch_wait_steps
    assert outs[0] == outs[1]
