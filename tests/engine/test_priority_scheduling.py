"""scheduling_policy "priority" (vLLM's `--scheduling-policy priority`): requests carry a `priority`, lower is
served first, ties by arrival. The waiting queue and the running list follow (priority, arrival); admission
stays strictly in order; preemption picks the running request with the largest key; a preempted request keeps
its key. Under the default "fcfs" a non-zero priority is refused (ValueError, HTTP 400). Outputs never depend
on any of it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, run_state_machine_as_test

from hyserve.cli import build_parser, engine_options_from_args
from hyserve.config import build_engine_config
from hyserve.engine.async_engine import AsyncEngine
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import Scheduler, priority_key
from hyserve.model.tokenizer import TINY_CHAT_TEMPLATE, Tokenizer, build_tiny_tokenizer
from hyserve.server.app import ServerOptions, build_app
from tests.engine.test_engine_invariance import GREEDY, make_llm, prompts
from tests.engine.test_scheduler_state_machine import CHUNK, EngineMachine, _run, drain, make
from tests.server_fixtures import FakeEngine, serve_app_in_thread

DECODE = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
NOT_ENABLED = "priority scheduling is not enabled"


# ---- the scheduler ---------------------------------------------------------------------------------------


def _sched(policy: str = "priority", *, blocks: int = 400, max_batch: int = 6, budget: int = 64) -> Scheduler:
    _, cache, _ = make(
        num_blocks=blocks, max_batch=max_batch, budget_tokens=budget, snapshots=4, max_seq_len=4096
    )
    return Scheduler(
        cache,
        max_batch_size=max_batch,
        max_num_tokens=budget,
        enable_chunked_prefill=True,
        chunk_size=CHUNK,
        max_seq_len=1 << 30,
        scheduling_policy=policy,
    )


def _req(rid: str, priority: int = 0, n: int = 4, params: SamplingParams = DECODE) -> Request:
    return Request(rid, [1 + (i * 7 + len(rid)) % 50 for i in range(n)], params, priority=priority)


def _ids(reqs: Any) -> list[str]:
    return [r.request_id for r in reqs]


def test_admission_follows_priority_then_arrival() -> None:
    sched = _sched()
    for rid, prio in (("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", 0)):
        sched.add(_req(rid, prio))
    assert _ids(sched.waiting) == ["e", "b", "d", "c", "a"]  # equal priorities (b, d) by arrival
    batch, _ = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["e", "b", "d", "c", "a"]
    assert _ids(sched.running) == ["e", "b", "d", "c", "a"]


def test_only_the_best_keys_are_admitted_when_the_batch_is_full() -> None:
    sched = _sched(max_batch=2)
    for rid, prio in (("a", 3), ("b", 1), ("c", 2), ("d", 0)):
        sched.add(_req(rid, prio))
    sched.schedule()
    assert _ids(sched.running) == ["d", "b"] and _ids(sched.waiting) == ["c", "a"]


def test_fcfs_ignores_priority_in_the_scheduler() -> None:
    """The engine refuses non-zero priorities under fcfs; the fcfs scheduler itself keeps arrival order."""
    sched = _sched("fcfs")
    for rid, prio in (("a", 3), ("b", 1), ("c", 0)):
        sched.add(_req(rid, prio))
    sched.schedule()
    assert _ids(sched.running) == ["a", "b", "c"]


def test_a_high_priority_arrival_is_admitted_before_earlier_low_priority_waiting_requests() -> None:
    sched = _sched(max_batch=2)
    for rid in ("r1", "r2"):
        sched.add(_req(rid, 0))
    _run(sched, sched.schedule()[0])  # the batch is full
    sched.add(_req("low1", 5))
    sched.add(_req("low2", 5))
    _run(sched, sched.schedule()[0])
    sched.add(_req("high", 1))  # arrives last
    assert _ids(sched.waiting) == ["high", "low1", "low2"]
    sched.finish(sched.running[0], "length")
    batch, _ = sched.schedule()
    assert "high" in [s.request_id for s in batch.seqs] and "high" in _ids(sched.running)
    assert _ids(sched.waiting) == ["low1", "low2"]
    assert _ids(sched.running) == ["r2", "high"]  # the running list in key order too


def test_a_large_high_priority_request_is_not_overtaken_by_small_low_priority_ones() -> None:
    """Admission stays strictly in order: the best waiting request that cannot start (too few free blocks)
    stops admission, so smaller low-priority requests behind it do not take the blocks it waits for."""
    sched = _sched(blocks=12, max_batch=4)
    n_blocks = sched.cache.blocks.num_blocks
    hog = _req("hog", 0, n=(n_blocks - 3) * 4)  # leaves 3 free blocks
    sched.add(hog)
    while hog.in_prefill:
        _run(sched, sched.schedule()[0])
    sched.add(_req("big", 1, n=6 * 4))  # needs 6 blocks
    sched.add(_req("small", 2, n=4))  # would fit in 1
    batch, _ = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["hog"]
    assert _ids(sched.waiting) == ["big", "small"]
    _run(sched, batch)
    sched.finish(sched.waiting[0], "abort")  # without "big" in front, "small" fits at once
    batch, _ = sched.schedule()
    assert [s.request_id for s in batch.seqs] == ["hog", "small"]


def _fill_and_decode(policy: str) -> tuple[Scheduler, list[str]]:
    """Three requests that fill a 12-block pool as they decode (a: priority 1, b: 5, c: 3, in that arrival
    order); returns the scheduler and the ids preempted in the first step that preempts."""
    sched = _sched(policy, blocks=12, max_batch=3)
    prios = {"a": 1, "b": 5, "c": 3} if policy == "priority" else {"a": 0, "b": 0, "c": 0}
    for rid, prio in prios.items():
        sched.add(_req(rid, prio, n=12))
    for _ in range(40):
        batch, _ = sched.schedule()
        if batch.preempted:
            return sched, batch.preempted
        _run(sched, batch)
    raise AssertionError("no preemption")


def test_preemption_picks_the_lowest_priority_running_request() -> None:
    sched, preempted = _fill_and_decode("priority")
    assert preempted == ["b"]  # the largest priority value, not the youngest (c)
    (b,) = [r for r in sched.waiting if r.request_id == "b"]
    assert b.status is RequestStatus.WAITING and b.priority == 5 and b.num_computed == 0
    _, fcfs_preempted = _fill_and_decode("fcfs")
    assert fcfs_preempted == ["c"]  # fcfs: the youngest


def test_victim_never_sorts_before_the_request_needing_blocks() -> None:
    sched = _sched()
    for rid, prio in (("a", 1), ("b", 5), ("c", 3), ("d", 3)):
        sched.add(_req(rid, prio))
    sched.schedule()
    a, c, d, b = sched.running
    assert _ids(sched.running) == ["a", "c", "d", "b"]
    assert sched._victim(set(), a) is b  # the largest key
    assert sched._victim({"b"}, a) is d  # not scheduled this step; then the later arrival of priority 3
    assert sched._victim(set(), c) is b
    assert sched._victim({"b", "d"}, c) is None  # "a" sorts before c: c yields itself instead
    assert sched._victim(set(), b) is None  # nobody sorts after the lowest priority


def test_a_requeued_request_keeps_its_priority_and_arrival() -> None:
    sched = _sched(max_batch=2)
    sched.add(_req("a", 2))
    sched.add(_req("b", 2))
    sched.schedule()
    for rid, prio in (("c", 2), ("d", 3), ("e", 1)):
        sched.add(_req(rid, prio))
    assert _ids(sched.waiting) == ["e", "c", "d"]
    a, b = sched.running
    key_b = priority_key(b)
    sched.requeue(b)
    assert _ids(sched.waiting) == ["e", "b", "c", "d"]  # ahead of c, a later arrival of its priority
    assert priority_key(b) == key_b
    sched.requeue(a)
    assert _ids(sched.waiting) == ["e", "a", "b", "c", "d"]


def test_priority_scheduler_drains_under_pressure() -> None:
    """Mixed priorities in a pool that cannot hold them all: everything finishes and every block returns."""
    sched = _sched(blocks=10, max_batch=4, budget=8)
    reqs = {}
    for i in range(8):
        r = _req(f"r{i}", priority=(i * 5) % 3, n=10, params=SamplingParams(max_tokens=20, ignore_eos=True))
        reqs[r.request_id] = r
        sched.add(r)

    def in_key_order(s) -> None:
        assert [priority_key(r) for r in s.running] == sorted(priority_key(r) for r in s.running)

    drain(sched, reqs, 3000, in_key_order)
    assert sched.stats.num_preemptions > 0
    sched.cache.reset_prefix_cache()
    assert sched.cache.blocks.num_free() == sched.cache.blocks.num_blocks


class PriorityMachine(EngineMachine):
    """The scheduler state machine (arrivals, cancellations, finishes, memory pressure) under "priority", with
    random priorities: the bookkeeping stays consistent, both queues stay in key order, and everything
    drains."""

    @initialize(
        num_blocks=st.integers(6, 24),
        max_batch=st.integers(1, 6),
        budget=st.integers(6, 24),
        seed=st.integers(0, 2**16),
    )
    def setup(self, num_blocks: int, max_batch: int, budget: int, seed: int) -> None:
        super().setup(num_blocks, max_batch, budget, seed)
        self.sched.by_priority = True  # before any request: as if built with scheduling_policy="priority"

    def _arrive(self, plen: int, max_tokens: int, shared: int) -> None:
        prompt = [self.rng.randrange(50) for _ in range(plen)]
        if shared >= 0:
            prompt = self.prefixes[shared][: self.rng.randrange(1, 13)] + prompt
        if len(prompt) + max_tokens > self.fit:
            return
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=self.rng.randrange(-2, 3))
        self.requests[rid] = req
        self.sched.add(req)

    @invariant()
    def in_key_order(self) -> None:
        if hasattr(self, "sched"):
            for queue in (list(self.sched.waiting), self.sched.running):
                assert [priority_key(r) for r in queue] == sorted(priority_key(r) for r in queue)


def test_priority_machine_keeps_bookkeeping_consistent_and_drains() -> None:
    EngineMachine.preemptions_seen = 0  # teardown adds each example's count here
    run_state_machine_as_test(
        PriorityMachine,
        # derandomized: the same examples every run, so the preemption check below cannot flake
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert EngineMachine.preemptions_seen > 0


# ---- the engine and LLM ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = make_llm()
    return [llm.generate([p], GREEDY)[0].token_ids for p in prompts()]


PREEMPTING_KV = {  # as test_engine_invariance's preemption test: one long request fits, not all at once
    "tokens_per_block": 8,
    "enable_block_reuse": False,
    "max_tokens": 112,
    "max_gpu_total_bytes": 64 * 2**20,
    "mamba_state_config": {"periodic_snapshot_interval": None},
}


@pytest.mark.parametrize("async_on", [False, True])
@pytest.mark.parametrize(
    "opts",
    [
        dict(),
        dict(max_batch_size=2, max_num_tokens=40),
        dict(kv_cache_config=PREEMPTING_KV, max_seq_len=112),
    ],
)
def test_greedy_outputs_do_not_depend_on_priorities(
    reference: list[list[int]], opts: dict, async_on: bool
) -> None:
    llm = make_llm(scheduling_policy="priority", async_scheduling=async_on, **opts)
    prios = [(i * 7) % 4 - 1 for i in range(len(prompts()))]  # -1..2, mixed against arrival order
    outs = llm.generate(prompts(), GREEDY, priority=prios)
    assert [o.token_ids for o in outs] == reference
    if "kv_cache_config" in opts:
        assert llm.stats()["num_preemptions"] > 0
    u = llm.cache_usage()
    assert u["kv_blocks_free"] == u["kv_blocks_total"] and u["live_slots_used"] == 0


@pytest.mark.parametrize("policy, order", [("priority", ["b", "c", "a"]), ("fcfs", ["a", "b", "c"])])
def test_the_engine_serves_in_priority_order(policy: str, order: list[str]) -> None:
    eng = make_llm(max_batch_size=1, scheduling_policy=policy).engine
    prios = {"a": 2, "b": 0, "c": 1} if policy == "priority" else {"a": 0, "b": 0, "c": 0}
    for rid, prio in prios.items():
        eng.add_request(
            rid, prompts()[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), priority=prio
        )
    finished = []
    while eng.has_unfinished():
        finished += [d.request_id for d in eng.step() if d.finished]
    assert finished == order


@pytest.fixture(scope="module")
def fcfs_llm():
    return make_llm()


def test_fcfs_refuses_a_nonzero_priority(fcfs_llm) -> None:
    p = prompts()[:2]
    with pytest.raises(ValueError, match=r"priority scheduling is not enabled.*--scheduling-policy priority"):
        fcfs_llm.generate(p, GREEDY, priority=[0, 3])
    with pytest.raises(ValueError, match=NOT_ENABLED):
        fcfs_llm.engine.add_request("x", p[0], GREEDY, priority=-1)
    assert not fcfs_llm.engine.has_unfinished()  # refused before anything ran
    # zeros are fcfs's own priority: accepted, with the same tokens as without
    assert [o.token_ids for o in fcfs_llm.generate(p, GREEDY, priority=[0, 0])] == [
        o.token_ids for o in fcfs_llm.generate(p, GREEDY)
    ]


def test_priority_list_must_match_the_prompts(fcfs_llm) -> None:
    with pytest.raises(ValueError, match="got 2 prompts but 1 priorities"):
        fcfs_llm.generate(prompts()[:2], GREEDY, priority=[0])


@pytest.mark.parametrize("bad", ["1", 1.5, True, None])
def test_a_priority_that_is_not_an_integer_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="priority must be an integer"):
        make_llm(scheduling_policy="priority").engine.validate_request(prompts()[0], GREEDY, bad)


# ---- configuration ---------------------------------------------------------------------------------------


def test_scheduling_policy_option() -> None:
    assert build_engine_config({}).scheduler.scheduling_policy == "fcfs"
    assert build_engine_config({"scheduling_policy": "PRIORITY"}).scheduler.scheduling_policy == "priority"
    for bad in ("lifo", 1, None):
        with pytest.raises(ValueError, match=r"^scheduling_policy: .* is not one of \['fcfs', 'priority'\]"):
            build_engine_config({"scheduling_policy": bad})


@pytest.mark.parametrize("flag", ["--scheduling-policy", "--scheduling_policy"])
def test_scheduling_policy_flag(flag: str) -> None:
    args = build_parser().parse_args(["serve", flag, "priority"])
    opts, _, _ = engine_options_from_args(args)
    assert build_engine_config(opts).scheduler.scheduling_policy == "priority"
    args = build_parser().parse_args(["serve"])
    assert "scheduling_policy" not in engine_options_from_args(args)[0]  # the YAML's, else the default
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, "lifo"])


# ---- the server ------------------------------------------------------------------------------------------

SMALL_CACHE = {"max_gpu_total_bytes": 64 * 2**20}
BODIES = {
    "/v1/completions": {"prompt": [1, 5, 9], "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "temperature": 0,
    },
    "/v1/responses": {"input": "hi", "max_output_tokens": 2, "temperature": 0},
}


def _server(policy: str) -> Iterator[str]:
    config = build_engine_config(
        {"warmup": "off", "scheduling_policy": policy, "kv_cache_config": SMALL_CACHE}
    )
    engine = AsyncEngine(config, log=lambda s: None)
    engine.start()
    try:
        with serve_app_in_thread(build_app(engine, ServerOptions())) as url:
            yield url
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def fcfs_url() -> Iterator[str]:
    yield from _server("fcfs")


@pytest.fixture(scope="module")
def priority_url() -> Iterator[str]:
    yield from _server("priority")


def _post(url: str, route: str, **extra: Any) -> httpx.Response:
    return httpx.post(f"{url}{route}", json={**BODIES[route], **extra}, timeout=60)


@pytest.mark.parametrize("route", list(BODIES))
def test_server_under_fcfs_answers_400_for_a_nonzero_priority(fcfs_url: str, route: str) -> None:
    r = _post(fcfs_url, route, priority=1)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "priority" and NOT_ENABLED in err["message"]
    assert "--scheduling-policy priority" in err["message"]
    for ok in ({"priority": 0}, {}):
        assert _post(fcfs_url, route, **ok).status_code == 200


@pytest.mark.parametrize("route", list(BODIES))
def test_server_under_priority_serves_any_integer_priority(priority_url: str, route: str) -> None:
    for prio in (-5, 0, 7):
        r = _post(priority_url, route, priority=prio)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("bad", ["high", 1.5, True, None, "2", [1]])
@pytest.mark.parametrize("route", list(BODIES))
def test_a_priority_that_is_not_an_integer_is_a_400(priority_url: str, route: str, bad: Any) -> None:
    r = _post(priority_url, route, priority=bad)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "priority", r.text


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[FakeEngine, str]]:
    tok = Tokenizer(
        build_tiny_tokenizer(),
        config={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"},
        chat_template=TINY_CHAT_TEMPLATE,
    )
    engine = FakeEngine(tokenizer=tok, max_seq_len=1024)
    with serve_app_in_thread(build_app(engine, ServerOptions())) as url:
        yield engine, url


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", list(BODIES))
def test_the_body_priority_reaches_every_choice(
    fake: tuple[FakeEngine, str], route: str, stream: bool
) -> None:
    engine, url = fake
    engine.priorities.clear()
    n = {} if route == "/v1/responses" else {"n": 2}
    r = _post(url, route, priority=-3, stream=stream, **n)
    assert r.status_code == 200, r.text
    assert list(engine.priorities.values()) == [-3] * (n.get("n", 1)), engine.priorities
