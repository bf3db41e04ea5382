"""Async scheduling (LLMEngine docstring): a decode step launched before the host has read the previous
step's tokens must give the synchronous engine's outputs, free everything it held, and step aside for
anything the scheduler has to decide (arrivals, aborts, prefills, logprobs, penalties, full pools)."""

from __future__ import annotations

import pytest

from hyserve import SamplingParams
from hyserve.config import build_engine_config
from hyserve.engine.assembly import assemble as assembly
from hyserve.engine.engine import LLMEngine
from tests.engine.test_engine_invariance import make_llm, prompts


def _params() -> list[SamplingParams]:
    """One per prompt of `prompts()`: greedy, seeded sampling, early stops, 1-token and long outputs."""
    return [
        SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=25, temperature=0.7, top_k=20, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.0),  # EOS may end it
        SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
    ]


def _spy_feeds(llm) -> list[int]:
    """Batch sizes of the steps that ran with device-fed tokens (overlapped)."""
    runner = llm.engine.runner
    fed: list[int] = []
    orig = runner.execute

    def execute(batch, feed=None):
        if feed is not None:
            fed.append(len(batch.seqs))
        return orig(batch, feed)

    runner.execute = execute  # type: ignore[method-assign]
    return fed


def _spy_batches(eng: LLMEngine) -> list[tuple[int, int, bool]]:
    """(decode rows, sequences, fed from the device) of every step the runner executes from now on."""
    seen: list[tuple[int, int, bool]] = []
    orig = eng.runner.execute

    def execute(batch, feed=None):
        seen.append((batch.num_decodes, len(batch.seqs), feed is not None))
        return orig(batch, feed)

    eng.runner.execute = execute  # type: ignore[method-assign]
    return seen


def _outs(llm, params=None):
    return [(o.token_ids, o.finish_reason) for o in llm.generate(prompts(), params or _params())]


@pytest.fixture(scope="module")
def sync_outputs():
    return _outs(make_llm(async_scheduling=False))


def test_sync_engine_never_defers() -> None:
    llm = make_llm(async_scheduling=False)
    fed = _spy_feeds(llm)
    _outs(llm)
    assert fed == [] and llm.engine._inflight is None


def test_async_equals_sync(sync_outputs) -> None:
    llm = make_llm(async_scheduling=True)
    fed = _spy_feeds(llm)
    assert _outs(llm) == sync_outputs
    assert fed, "no decode step was overlapped"
    assert llm.stats()["overlapped_steps_total"] == len(fed)
    u = llm.cache_usage()
    assert u["live_slots_used"] == 0 and u["kv_blocks_free"] == u["kv_blocks_total"]


def test_async_equals_sync_on_graph_buffers(monkeypatch) -> None:
    # both on the CPU: seeded sampling draws from a device's own generator, so a CUDA reference differs
    sync_outputs = _outs(make_llm(device="cpu", async_scheduling=False))
    monkeypatch.setattr(
        assembly, "graph_batch_sizes", lambda config, lm, log, most: [1, 2, 4, 8]
    )  # decode graphs' buffers, eager
    llm = make_llm(device="cpu", async_scheduling=True)
    used: list[int] = []
    g = llm.engine.runner.graphs
    assert g is not None
    orig = g.execute
    g.execute = lambda seqs, feed=None, width=1: (
        (used.append(len(seqs)) if feed is not None else None) or orig(seqs, feed, width)
    )  # type: ignore[method-assign]
    assert _outs(llm) == sync_outputs
    assert used, "no graph step was fed from the device"


def test_logprobs_rows_are_deferred_with_their_table() -> None:
    p = [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, seed=1, logprobs=0, ignore_eos=True),
    ] * 3
    p = p[: len(prompts())]

    def run(async_on: bool):
        llm = make_llm(async_scheduling=async_on)
        fed = _spy_feeds(llm)
        outs = llm.generate(prompts(), p)
        return [
            (o.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]) for o in outs
        ], fed

    sync, _ = run(False)
    overlapped, fed = run(True)
    assert fed, "logprob rows kept the step synchronous"
    assert overlapped == sync
    assert all(len(lps) == len(toks) for (toks, lps), q in zip(overlapped, p) if q.logprobs is not None)


def test_penalty_rows_are_deferred_with_the_in_flight_token_counted() -> None:
    # the tiny random model never repeats a token by itself: a bias makes token 7 repeat until its
    # frequency penalty (which must count the in-flight copy) outweighs the bias
    ps = [
        SamplingParams(
            max_tokens=14, temperature=0.0, frequency_penalty=1.0, logit_bias={7: 6.0}, ignore_eos=True
        ),
        SamplingParams(
            max_tokens=14, temperature=0.0, frequency_penalty=0.7, logit_bias={7: 4.0}, ignore_eos=True
        ),
        SamplingParams(max_tokens=14, temperature=0.0, repetition_penalty=3.0, ignore_eos=True),
        SamplingParams(max_tokens=14, temperature=0.0, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(
            max_tokens=14,
            temperature=0.7,
            seed=2,
            frequency_penalty=1.3,
            ignore_eos=True,
            logit_bias={7: 8.0},
        ),
    ]
    ps = (ps * 2)[: len(prompts())]
    llm = make_llm()
    fed = _spy_feeds(llm)
    sync = [(o.token_ids, o.finish_reason) for o in make_llm(async_scheduling=False).generate(prompts(), ps)]
    assert _outs(llm, ps) == sync
    assert fed, "penalty rows kept the steps synchronous"
    assert 2 < sync[0][0].count(7) < 14, "the frequency penalty never moved the choice"


def _engine(**kw) -> LLMEngine:
    return make_llm(**kw).engine


def _run_to_end(eng: LLMEngine, out: dict[str, list[int]], reasons: dict[str, str]) -> None:
    for _ in range(500):
        if not eng.has_unfinished():
            return
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                reasons[d.request_id] = d.finish_reason or ""
    raise AssertionError("engine did not finish")


def _step_until_inflight(eng: LLMEngine, out: dict[str, list[int]]) -> None:
    for _ in range(50):
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
        if eng._inflight is not None:
            return
    raise AssertionError("no step was left in flight")


def test_abort_while_a_step_is_in_flight() -> None:
    eng = _engine()
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eng.add_request("a", prompts()[0], greedy)
    eng.add_request("b", prompts()[1], greedy)
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    _step_until_inflight(eng, out)
    eng.abort("a")
    _run_to_end(eng, out, reasons)
    assert reasons == {"a": "abort", "b": "length"}
    assert len(out["b"]) == 20 and len(out["a"]) < 20
    alone = make_llm(async_scheduling=False).generate([prompts()[1]], greedy)[0].token_ids
    assert out["b"] == alone
    u = eng.cache_usage()
    assert u["live_slots_used"] == 0 and u["kv_blocks_free"] == u["kv_blocks_total"]


def test_arrival_while_a_step_is_in_flight_is_admitted() -> None:
    greedy = SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True)
    runs = []
    for async_on in (True, False):
        eng = _engine(async_scheduling=async_on)
        eng.add_request("a", prompts()[2], greedy)
        out: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        for _ in range(4):  # prefill, then decodes (in flight with async scheduling)
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        assert (eng._inflight is not None) == async_on
        eng.add_request("b", prompts()[3], greedy)
        fed = _spy_batches(eng)
        for d in eng.step():  # async: the overlapped step admits "b" next to a's device-fed decode
            out.setdefault(d.request_id, []).extend(d.token_ids)
        assert eng.requests["b"].num_computed > 0, "the new request waited behind the overlapped decode"
        if async_on:
            assert fed == [(1, 2, True)], fed
        _run_to_end(eng, out, reasons)
        assert reasons == {"a": "length", "b": "length"}
        runs.append(out)
    assert runs[0] == runs[1]


def test_stop_token_in_flight_drops_the_extra_row() -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free_run = make_llm(async_scheduling=False).generate([prompts()[4]], greedy)[0].token_ids
    stop_at = free_run[5]
    first = free_run.index(stop_at)
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_at])
    for async_on in (False, True):
        llm = make_llm(async_scheduling=async_on)
        o = llm.generate([prompts()[4]], p)[0]
        assert o.finish_reason == "stop" and o.token_ids == free_run[: first + 1]
        u = llm.cache_usage()
        assert u["live_slots_used"] == 0 and u["kv_blocks_free"] == u["kv_blocks_total"]


def test_full_kv_pool_falls_back_to_the_scheduler() -> None:
    # the pool of test_engine_invariance's preemption case: decode must preempt, which only the
    # scheduler does; the overlapped path steps aside
    kv = {
        "tokens_per_block": 8,
        "enable_block_reuse": False,
        "max_tokens": 112,
        "max_gpu_total_bytes": 64 * 2**20,
    }
    kv["mamba_state_config"] = {"periodic_snapshot_interval": None}
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sync = [
        o.token_ids
        for o in make_llm(kv_cache_config=kv, max_seq_len=112, async_scheduling=False).generate(prompts(), p)
    ]
    llm = make_llm(kv_cache_config=kv, max_seq_len=112)
    assert [o.token_ids for o in llm.generate(prompts(), p)] == sync
    assert llm.stats()["num_preemptions"] > 0


def test_async_scheduling_option() -> None:
    assert build_engine_config({}).async_scheduling is True
    assert build_engine_config({"async_scheduling": False}).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling"):
        build_engine_config({"async_scheduling": "sometimes"})


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed,small_pool,reuse",
    [(0, False, False), (1, False, False), (10, True, False), (13, True, False), (3, False, True)],
)
def test_random_traffic_matches_requests_run_alone(seed: int, small_pool: bool, reuse: bool) -> None:
    """Arrivals between steps, aborts, early stops, (small pool) preemptions and (reuse) prefix-cache
    publishing and snapshots around in-flight steps: every request that was not aborted gets the tokens
    it gets alone on a synchronous engine, and the pools end empty."""
    import random

    rng = random.Random(seed)
    kv = {
        "tokens_per_block": 8,
        "enable_block_reuse": reuse,
        "max_gpu_total_bytes": 64 * 2**20,
        "mamba_state_config": {"periodic_snapshot_interval": 16 if reuse else None},
    }
    extra = {}
    if small_pool:
        kv["max_tokens"] = 112
        extra["max_seq_len"] = 112
    eng = _engine(kv_cache_config=kv, **extra)
    alone = make_llm(kv_cache_config=dict(kv), async_scheduling=False, **extra)
    pool = prompts()
    jobs: dict[str, tuple[list[int], SamplingParams]] = {}
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    aborted: set[str] = set()
    n = 0
    for _ in range(400):
        if n < 14 and rng.random() < 0.35:
            prompt = pool[rng.randrange(len(pool))]
            kind = rng.random()
            if kind < 0.5:
                p = SamplingParams(max_tokens=rng.randint(1, 20), temperature=0.0, ignore_eos=True)
            elif kind < 0.8:
                p = SamplingParams(
                    max_tokens=rng.randint(1, 20), temperature=0.8, seed=rng.randint(0, 99), ignore_eos=True
                )
            else:
                p = SamplingParams(
                    max_tokens=20,
                    temperature=0.0,
                    ignore_eos=True,
                    stop_token_ids=[rng.randrange(3, 300) for _ in range(8)],
                )
            rid = f"r{n}"
            n += 1
            jobs[rid] = (prompt, p)
            eng.add_request(rid, prompt, p)
        live = [r for r in jobs if r not in reasons and r not in aborted]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            aborted.add(victim)
            eng.abort(victim)
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                reasons[d.request_id] = d.finish_reason or ""
        if n >= 14 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished() and set(reasons) == set(jobs)
    assert eng.stats()["overlapped_steps_total"] > 0
    if small_pool:
        assert eng.stats()["num_preemptions"] > 0
    if reuse:
        assert eng.stats()["prefix_cache_hits"] > 0
    for rid, (prompt, p) in jobs.items():
        if rid in aborted and reasons[rid] == "abort":
            continue
        ref = alone.generate([prompt], p)[0]
        assert (out.get(rid, []), reasons[rid]) == (ref.token_ids, ref.finish_reason), rid
    u = eng.cache_usage()
    assert u["live_slots_used"] == 0
    if reuse:
        eng.reset_prefix_cache()
        u = eng.cache_usage()
        assert u["snapshot_slots_used"] == 0
    assert u["kv_blocks_free"] == u["kv_blocks_total"]


def test_reused_id_does_not_get_the_dropped_row() -> None:
    """A request that stops on the in-flight token leaves its extra row in the next step; a new request
    under the same id, added before that step is read, must not receive it."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    free_run = make_llm(async_scheduling=False).generate([prompts()[4]], greedy)[0].token_ids
    stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=[free_run[6]])
    eng = _engine()
    eng.add_request("x", prompts()[4], stop)
    finished_with_row_in_flight = False
    for _ in range(50):
        ds = eng.step()
        if any(d.request_id == "x" and d.finished for d in ds):
            finished_with_row_in_flight = eng._inflight is not None and any(
                s.request_id == "x" for s in eng._inflight.batch.seqs
            )
            break
    assert finished_with_row_in_flight, "the stop did not land on an in-flight token"
    eng.add_request("x", prompts()[0], greedy)  # the id is free again
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    _run_to_end(eng, out, reasons)
    alone = make_llm(async_scheduling=False).generate([prompts()[0]], greedy)[0].token_ids
    assert out["x"] == alone and reasons["x"] == "length"


def test_stop_string_completing_on_the_in_flight_token() -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    text = make_llm(async_scheduling=False).generate([prompts()[3]], greedy)[0].text
    assert len(text) > 12, text
    stop = text[6:10]
    p = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    outs = [make_llm(async_scheduling=a).generate([prompts()[3]], p)[0] for a in (False, True)]
    assert [(o.text, o.token_ids, o.finish_reason) for o in outs[1:]] == [
        (outs[0].text, outs[0].token_ids, outs[0].finish_reason)
    ]
    assert outs[1].finish_reason == "stop" and stop not in outs[1].text


def test_a_full_batch_keeps_overlapping_while_requests_queue() -> None:
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    sync = [o.token_ids for o in make_llm(max_batch_size=2, async_scheduling=False).generate(prompts(), p)]
    llm = make_llm(max_batch_size=2)
    eng = llm.engine
    queued_while_fed: list[int] = []
    orig = eng.runner.execute

    def execute(batch, feed=None):
        if feed is not None:
            queued_while_fed.append(len(eng.scheduler.waiting))
        return orig(batch, feed)

    eng.runner.execute = execute  # type: ignore[method-assign]
    assert [o.token_ids for o in llm.generate(prompts(), p)] == sync
    assert any(q > 0 for q in queued_while_fed), "no overlapped step while requests were queued"


def test_mixed_steps_overlap_with_chunked_prompts_and_prompt_logprobs() -> None:
    """Steps that admit a request or feed the next chunk of a long prompt are overlapped too (decode rows
    fed on the device, prefill rows from the host): outputs, prompt logprobs and logprobs equal the
    synchronous engine's, and some overlapped steps carried chunk continuations."""
    import random

    rng = random.Random(7)
    long_prompt = [1] + [rng.randrange(3, 300) for _ in range(700)]  # 3 chunks of max_num_tokens 256
    reqs = [
        (prompts()[0], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
        (long_prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)),
        (
            prompts()[4],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=1),
        ),
        (long_prompt[:400], SamplingParams(max_tokens=5, temperature=0.8, seed=4, ignore_eos=True)),
    ]

    def run(async_on: bool):
        eng = _engine(async_scheduling=async_on)
        seen = _spy_batches(eng)
        out: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        eng.add_request("r0", *reqs[0])
        for _ in range(3):
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        for i, (prompt, p) in enumerate(reqs[1:], start=1):  # arrivals while r0 decodes
            eng.add_request(f"r{i}", prompt, p)
            for d in eng.step():
                out.setdefault(d.request_id, []).extend(d.token_ids)
        _run_to_end(eng, out, reasons)
        r2 = eng.requests.get("r2")
        assert r2 is None or r2.finished
        u = eng.cache_usage()
        assert u["live_slots_used"] == 0 and u["kv_blocks_free"] == u["kv_blocks_total"]
        return out, reasons, seen

    sync_out, sync_reasons, _ = run(False)
    out, reasons, seen = run(True)
    assert (out, reasons) == (sync_out, sync_reasons)
    fed_mixed = [b for b in seen if b[2] and b[1] > b[0]]
    assert fed_mixed, f"no overlapped step carried a prefill: {seen}"
    # the 701-token prompt needs 3 chunks: at least one continuation ran in an overlapped step
    assert sum(1 for b in fed_mixed if b[0] > 0) >= 2, seen


def test_mixed_overlapped_outputs_carry_prompt_logprobs() -> None:
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=1, logprobs=2)
    q = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)

    def run(async_on: bool):
        llm = make_llm(async_scheduling=async_on)
        eng = llm.engine
        seen = _spy_batches(eng)
        eng.add_request("long", prompts()[3], q)
        for _ in range(3):
            eng.step()
        eng.add_request("lp", prompts()[5], p)
        finals = {}
        for _ in range(100):
            for d in eng.step():
                if d.request_id == "lp":
                    finals.setdefault("tokens", []).extend(d.token_ids)
                    if d.prompt_logprobs is not None:
                        finals["prompt"] = [
                            (lp.token_id, round(lp.logprob, 5)) if lp else None for lp in d.prompt_logprobs
                        ]
                    if d.logprobs:
                        finals.setdefault("lps", []).extend(
                            (lp.token_id, round(lp.logprob, 5)) for lp in d.logprobs
                        )
            if not eng.has_unfinished():
                break
        return finals, seen

    sync, _ = run(False)
    overlapped, seen = run(True)
    assert sync.get("prompt") and len(sync["prompt"]) == len(prompts()[5])
    assert overlapped == sync
    assert any(b[2] and b[1] > b[0] for b in seen), "the prompt-logprobs request was not admitted overlapped"


@pytest.mark.parametrize("seed", [136, 213])
def test_dropped_overlapped_plan_pins_no_snapshot(seed: int) -> None:
    """Small token budgets cut prompts at snapshot boundaries; when one continuation of an overlapped plan
    cannot get its blocks the plan is dropped, and the chunks planned before it must not keep snapshot
    slots (pinned for good, their prefix keys pointing at states nobody wrote: a later hit on the
    same prefix would start from garbage)."""
    import random

    rng = random.Random(seed)
    budget, pool, interval = rng.randint(17, 70), rng.choice([96, 128, 160, 200]), rng.choice([8, 16, 32])
    kv = {
        "tokens_per_block": 8,
        "enable_block_reuse": True,
        "max_gpu_total_bytes": 64 * 2**20,
        "max_tokens": pool,
        "mamba_state_config": {
            "periodic_snapshot_interval": interval,
            "additional_snapshot_offsets_from_end": rng.choice([[0], [0, 5], []]),
        },
    }
    opts = dict(
        max_num_tokens=budget, max_seq_len=pool, max_batch_size=rng.choice([3, 4, 8]), kv_cache_config=kv
    )
    jobs = []
    for _ in range(rng.randint(3, 6)):
        n = rng.randint(5, pool - 30)
        p = SamplingParams(max_tokens=rng.randint(1, min(30, pool - n)), temperature=0.0, ignore_eos=True)
        arrival = rng.randint(0, 8)
        jobs.append((arrival, [1] + [rng.randrange(3, 300) for _ in range(n - 1)], p))
    llm = make_llm(**opts)
    eng = llm.engine
    for it in range(400):
        for i, (t, prompt, p) in enumerate(jobs):
            if t == it:
                eng.add_request(f"r{i}", prompt, p)
        eng.step()
        if it > 8 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    # every prompt again, alone: prefix-cache hits must give the tokens of an engine without reuse
    cold = make_llm(
        async_scheduling=False, **{**opts, "kv_cache_config": {**kv, "enable_block_reuse": False}}
    )
    g = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    for _, prompt, _ in jobs:
        assert llm.generate([prompt], g)[0].token_ids == cold.generate([prompt], g)[0].token_ids
    eng.reset_prefix_cache()
    assert eng.cache_usage()["snapshot_slots_used"] == 0


def test_sampling_failure_in_a_mixed_overlapped_step_fails_only_its_requests() -> None:
    """The step was taken in by the scheduler (its snapshot pins released) before sampling failed: the
    batch's requests end with an error, the engine keeps serving, and nothing stays pinned."""
    kv = {
        "tokens_per_block": 8,
        "enable_block_reuse": True,
        "max_gpu_total_bytes": 64 * 2**20,
        "mamba_state_config": {"periodic_snapshot_interval": 16, "additional_snapshot_offsets_from_end": [0]},
    }
    eng = _engine(kv_cache_config=kv)
    g = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eng.add_request("a", prompts()[0], g)
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    eng.add_request("b", prompts()[4], g)  # admitted in the overlapped step, with snapshot writes
    real = eng.sampler.sample_tokens

    def boom(*a, **k):
        raise RuntimeError("sampler failure")

    eng.sampler.sample_tokens = boom  # type: ignore[method-assign]
    deltas = eng.step()
    eng.sampler.sample_tokens = real  # type: ignore[method-assign]
    failed = {d.request_id for d in deltas if d.finished and d.finish_reason == "error"}
    assert failed == {"a", "b"}
    assert eng.stats()["step_failures_total"] == 1
    eng.add_request("c", prompts()[2], g)
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    _run_to_end(eng, out, reasons)
    assert reasons == {"c": "length"}
    assert out["c"] == make_llm(async_scheduling=False).generate([prompts()[2]], g)[0].token_ids
    eng.reset_prefix_cache()
    u = eng.cache_usage()
    assert (
        u["snapshot_slots_used"] == 0
        and u["live_slots_used"] == 0
        and u["kv_blocks_free"] == u["kv_blocks_total"]
    )


@pytest.mark.parametrize("async_on", [False, True])
def test_sampling_failure_in_a_normal_step_fails_only_its_batch(async_on: bool) -> None:
    """Sampling (or prompt logprobs) failing after the model ran, in a step the scheduler planned: the
    batch's requests end with an error and the engine keeps serving (it used to raise out of step(),
    which ends the serving loop for every request)."""
    eng = _engine(async_scheduling=async_on)
    g = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng.add_request("a", prompts()[1], g)
    target = "sample_tokens"  # both settings sample through it (one step loop)
    real = getattr(eng.sampler, target)

    def boom(*a, **k):
        raise RuntimeError("sampler failure")

    setattr(eng.sampler, target, boom)
    deltas = eng.step()  # a's prefill step
    setattr(eng.sampler, target, real)
    assert [(d.request_id, d.finish_reason) for d in deltas if d.finished] == [("a", "error")]
    eng.add_request("b", prompts()[2], g)
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    _run_to_end(eng, out, reasons)
    assert reasons == {"b": "length"}
    assert out["b"] == make_llm(async_scheduling=False).generate([prompts()[2]], g)[0].token_ids
    u = eng.cache_usage()
    assert u["live_slots_used"] == 0 and u["kv_blocks_free"] == u["kv_blocks_total"]
