"""Request-level isolation (engine/isolation.py, docs/architecture.md "One step"): a step that raises fails
only the request that makes it fail; every other request of the batch ends with exactly the greedy tokens
of a run without the fault, and every pool is free at the end. Faults come from the deterministic hook
(engine/faults.py, `HYSERVE_FAULT_INJECT`)."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

from hyserve import SamplingParams
from hyserve.engine.engine import LLMEngine
from hyserve.engine.faults import FaultInjector
from tests.engine.test_engine_invariance import make_llm, prompts

G = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
REUSE_KV = {
    "tokens_per_block": 8,
    "enable_block_reuse": True,
    "max_gpu_total_bytes": 64 * 2**20,
    "mamba_state_config": {"periodic_snapshot_interval": 16, "additional_snapshot_offsets_from_end": [0]},
}


def _drive(eng: LLMEngine, spec: str | None = None) -> tuple[dict[str, list[int]], dict[str, str], list[str]]:
    """r0-r3 arrive first, r4-r7 three steps later (their prefill chunks share steps with r0-r3's decodes).
    Returns each request's tokens, the errors, and the requests requeued for recompute by isolation."""
    eng.faults = FaultInjector.parse(spec) if spec else None
    requeued: list[str] = []
    real = eng.scheduler.requeue

    def requeue(req):  # type: ignore[no-untyped-def]
        requeued.append(req.request_id)
        real(req)

    eng.scheduler.requeue = requeue  # type: ignore[method-assign]
    out: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    ps = prompts()
    for it in range(400):
        if it in (0, 3):
            for i in range(4) if it == 0 else range(4, 8):
                eng.add_request(f"r{i}", ps[i], G)
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished and d.finish_reason == "error":
                errors[d.request_id] = d.error or ""
        if it > 3 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    return out, errors, requeued


def _assert_pools_free(eng: LLMEngine) -> None:
    u = eng.cache_usage()
    assert u["kv_blocks_free"] == u["kv_blocks_total"] and u["live_slots_used"] == 0, u
    eng.reset_prefix_cache()
    assert eng.cache_usage()["snapshot_slots_used"] == 0
    eng.cache.check_invariants()


_REFS: dict[tuple, dict[str, list[int]]] = {}


def _reference(**opts) -> dict[str, list[int]]:
    key = tuple(sorted((k, repr(v)) for k, v in opts.items()))
    if key not in _REFS:
        _REFS[key] = _drive(make_llm(**opts).engine)[0]
    return _REFS[key]


CASES = [  # (fault, options): the site, the request, from which output token on
    ("forward:r5", {}),  # r5's first prefill chunk, beside r0-r3's decode rows
    ("forward:r1@3", {}),  # a decode row
    ("sample:r6", {}),  # after the forward: the step was taken in
    ("sample:r2@4", {}),
    ("host:r3@2", {}),  # token append on the host
    ("forward:r0@2", {"max_num_tokens": 40}),  # innocent continuing prefill chunks in the failed step
    ("forward:r6@1", {"kv_cache_config": REUSE_KV}),  # r5-r7 share a prompt prefix: prefix-cache hits
    ("sample:r7", {"kv_cache_config": REUSE_KV, "max_num_tokens": 40}),
]


@pytest.mark.parametrize("async_on", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "spec,opts", CASES, ids=[c[0] + ("+" + "+".join(c[1]) if c[1] else "") for c in CASES]
)
def test_only_the_faulty_request_fails(spec: str, opts: dict, async_on: bool) -> None:
    ref = _reference(**opts)  # a run without the fault (async scheduling does not change greedy tokens)
    eng = make_llm(async_scheduling=async_on, **opts).engine
    out, errors, requeued = _drive(eng, spec)
    bad = spec.split(":")[1].split("@")[0]
    assert set(errors) == {bad}, errors
    assert "injected fault" in errors[bad]
    for rid, toks in ref.items():
        if rid != bad:
            assert out[rid] == toks, rid
    s = eng.stats()
    assert s["request_failures_total"] == 1
    if spec.startswith("host"):  # per request on the host: no step failed, nothing rerun
        assert s["step_failures_total"] == 0 and s["isolation_probes_total"] == 0 and not requeued
    else:
        assert s["step_failures_total"] == 1
        assert 0 < s["isolation_probes_total"] <= math.ceil(math.log2(8)) + 1
        assert requeued and bad not in requeued  # innocent rows were recomputed
    _assert_pools_free(eng)


def test_two_faulty_requests_each_fail_alone() -> None:
    ref = _reference()
    eng = make_llm().engine
    out, errors, _ = _drive(eng, "forward:r2@1,sample:r5")
    assert set(errors) == {"r2", "r5"}
    assert all(out[r] == ref[r] for r in ref if r not in errors)
    assert eng.stats()["request_failures_total"] == 2
    _assert_pools_free(eng)


def test_a_fault_no_single_request_reproduces_fails_its_batch_once() -> None:
    """A failure of the batch as a whole (here: any step of 3 rows or more): no probe pins it on one request,
    so the batch fails, as before isolation, and the engine serves on (no retry loop)."""
    eng = make_llm().engine
    real = eng.runner.execute
    armed = [True]

    def execute(batch, feed=None):  # type: ignore[no-untyped-def]
        if armed[0] and len(batch.seqs) >= 3:
            raise RuntimeError("the batch as a whole fails")
        return real(batch, feed)

    eng.runner.execute = execute  # type: ignore[method-assign]
    for i in range(4):
        eng.add_request(f"r{i}", prompts()[i], G)
    deltas = eng.step()
    armed[0] = False
    assert {d.request_id for d in deltas if d.finish_reason == "error"} == {"r0", "r1", "r2", "r3"}
    s = eng.stats()
    assert s["step_failures_total"] == 1 and s["request_failures_total"] == 4
    assert s["isolation_probes_total"] <= math.ceil(math.log2(4)) + 1
    eng.add_request("after", prompts()[0], G)
    toks: list[int] = []
    while eng.has_unfinished():
        toks += [t for d in eng.step() for t in d.token_ids]
    assert toks == _reference()["r0"]
    _assert_pools_free(eng)


def test_strict_warmup_fails_its_step_without_probes() -> None:
    """A late compilation under strict_warmup is the step's failure, not a request's: the batch fails as a
    whole and nothing is rerun."""
    from tests.unit.test_jit_sentinel import fake_event

    eng = make_llm(warmup="off", strict_warmup=True).engine
    eng.add_request("a", prompts()[0], G)
    eng.add_request("b", prompts()[1], G)
    fake_event(eng.jit, "_ssd_chunk_scan_kernel")  # as if this step compiled a new variant
    failed = {d.request_id for d in eng.step() if d.finish_reason == "error"}
    assert failed == {"a", "b"} and eng.stats()["isolation_probes_total"] == 0
    _assert_pools_free(eng)


def test_prompt_logprobs_survive_a_neighbour_fault() -> None:
    """A prompt-logprobs request beside a failing one: its prompt logprobs and tokens are those of a run
    without the fault (probes record theirs on copies)."""
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    ref = make_llm().generate([prompts()[3]], p)[0]
    eng = make_llm().engine
    eng.faults = FaultInjector.parse("forward:bad")
    eng.add_request("good", prompts()[3], p)
    eng.add_request("bad", prompts()[1], G)
    final, plps, toks = {}, None, []
    while eng.has_unfinished():
        for d in eng.step():
            if d.request_id == "good":
                toks += d.token_ids
                plps = d.prompt_logprobs or plps
            if d.finished:
                final[d.request_id] = d
    assert final["bad"].finish_reason == "error" and final["good"].finish_reason == "length"
    assert toks == ref.token_ids and plps is not None and len(plps) == len(prompts()[3])
    assert [lp.logprob if lp else None for lp in plps] == pytest.approx(
        [lp.logprob if lp else None for lp in ref.prompt_logprobs]
    )
    _assert_pools_free(eng)


@pytest.mark.parametrize(
    "spec,msg",
    [
        ("forwrd:r1", "not site:request-id-substring"),
        ("forward:", "not site:request-id-substring"),
        ("sample", "not site:request-id-substring"),
        ("host:r1@x", "must be an integer"),
    ],
)
def test_bad_fault_spec_is_refused(spec: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        FaultInjector.parse(spec)


def test_fault_spec_parses_and_is_read_from_the_environment() -> None:
    assert FaultInjector.parse("") is None and FaultInjector.parse(" , ") is None
    f = FaultInjector.parse("forward:a, sample:b@3,host:c,engine:d")
    assert f is not None and [(x.site, x.match, x.after) for x in f.faults] == [
        ("forward", "a", 0),
        ("sample", "b", 3),
        ("host", "c", 0),
        ("engine", "d", 0),
    ]
    f.check("sample", "xbx", 2)  # too few outputs yet: no fault
    with pytest.raises(RuntimeError, match="injected fault"):
        f.check("sample", "xbx", 3)
    env = {**os.environ, "HYSERVE_FAULT_INJECT": "host:req-7"}
    r = subprocess.run(
        [sys.executable, "-c", "from hyserve import envs; print(envs.HYSERVE_FAULT_INJECT)"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert r.stdout.strip() == "host:req-7"


@pytest.mark.parametrize("spec", ["forward:r1@3", "sample:r2@4", "host:r3@2", "forward:r5"])
def test_only_the_faulty_request_fails_in_speculative_steps(spec: str) -> None:
    """With drafts verified in the failing step: the probes rerun its rows with their drafts, the culprit
    fails, and every other request gets its plain greedy tokens."""
    from tests.engine.test_speculative import OracleDrafter

    ref = _reference()
    eng = make_llm(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).engine
    assert eng.spec is not None
    eng.spec.drafter = OracleDrafter(
        {tuple(p): ref[f"r{i}"] for i, p in enumerate(prompts()) if f"r{i}" in ref}
    )
    out, errors, _ = _drive(eng, spec)
    bad = spec.split(":")[1].split("@")[0]
    assert set(errors) == {bad}, errors
    assert all(out[r] == ref[r] for r in ref if r != bad)
    assert eng.stats()["spec_decode_num_accepted_tokens"] > 0
    _assert_pools_free(eng)
