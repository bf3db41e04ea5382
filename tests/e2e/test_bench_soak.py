"""benchmarks/bench_soak.py (docs/architecture.md, "Failure isolation"): its fault targeting,
request plans and end-state checks, and a CPU smoke run through `hyserve serve` on the built-in tiny model
with faults and disconnects (the same code the H200 run takes, smaller)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from benchmarks import bench_soak as soak
from hyserve.engine.faults import FaultInjector, InjectedFault

ROOT = Path(__file__).resolve().parents[2]


def test_fault_spec_targets_its_share_of_ids_as_the_engine_does() -> None:
    spec = soak.fault_spec(200)
    inj = FaultInjector.parse(spec)
    assert inj is not None and len(inj.faults) == 20  # round(4096 / 200)
    assert {f.site for f in inj.faults} == set(soak.FAULT_SITES)
    assert {f.after for f in inj.faults} == set(soak.FAULT_AFTER)
    hit = 0
    for p in range(4096):
        rid = f"cmpl-{p:03x}" + "7" * 29
        site = soak.targeted_site(inj, rid)
        hit += site is not None
        for s in soak.FAULT_SITES:  # the engine's own check raises exactly where the bench expects it
            if site == s:
                with pytest.raises(InjectedFault):
                    inj.check(s, rid, max(soak.FAULT_AFTER))
            else:
                inj.check(s, rid, max(soak.FAULT_AFTER))
    assert hit == 20


def test_plans_are_deterministic_and_within_the_options() -> None:
    cfg = soak.SoakConfig(
        min_input=10,
        max_input=500,
        min_output=8,
        max_output=64,
        disconnect_every=4,
        shared_prefixes=2,
        shared_prefix_len=50,
        shared_fraction=0.5,
        vocab_size=320,
        min_token_id=10,
    )
    a, b = soak.Planner(cfg), soak.Planner(cfg)
    plans = [a.plan(i) for i in range(400)]
    assert plans == [b.plan(i) for i in range(400)]
    assert all(10 <= len(p.prompt) <= 500 and 8 <= p.max_tokens <= 64 for p in plans)
    assert all(10 <= t < 320 for p in plans for t in p.prompt)
    cuts = [p for p in plans if p.disconnect_after is not None]
    assert [p.index for p in cuts] == list(range(3, 400, 4))
    assert all(0 <= p.disconnect_after < p.max_tokens for p in cuts)
    longer = [p for p in plans if len(p.prompt) > 50]
    shared = sum(p.prompt[:50] in a.prefixes for p in longer)
    assert 0.3 < shared / len(longer) < 0.7  # shared_fraction of the prompts longer than the prefix
    assert {p.temperature for p in plans} == {0.0, 0.8}


def _metrics(**kw: float) -> dict[str, float]:
    m = {
        "hyserve_healthy": 1.0,
        "hyserve_num_requests_running": 0.0,
        "hyserve_num_requests_waiting": 0.0,
        "hyserve_kv_cache_blocks_free": 100.0,
        "hyserve_kv_cache_blocks_total": 100.0,
        "hyserve_state_slots_used": 0.0,
        "hyserve_state_slots_total": 8.0,
        "hyserve_snapshot_slots_used": 3.0,
        "hyserve_snapshot_slots_total": 16.0,
        "hyserve_engine_restarts_total": 0.0,
        "hyserve_request_failures_total": 2.0,
        "hyserve_step_failures_total": 1.0,
        'hyserve_requests_total{route="/v1/completions",status="200"}': 50.0,
    }
    m.update(kw)
    return m


def _failed(checks: list[tuple[str, bool, str]]) -> set[str]:
    return {name for name, ok, _ in checks if not ok}


def test_end_state_checks_pass_on_free_pools_and_name_each_problem() -> None:
    counts, sites = Counter({soak.INJECTED: 2}), Counter({"forward": 1, "host": 1})
    assert _failed(soak.pool_checks({}, _metrics(), counts, sites)) == set()
    bad = _metrics(
        hyserve_kv_cache_blocks_free=99.0,
        hyserve_state_slots_used=1.0,
        hyserve_request_failures_total=3.0,
        hyserve_engine_restarts_total=1.0,
        hyserve_snapshot_slots_pinned=1.0,
        hyserve_num_requests_running=1.0,
        **{'hyserve_requests_total{route="/v1/completions",status="500"}': 1.0},
    )
    assert _failed(soak.pool_checks({}, bad, counts, sites)) == {
        "every KV block free",
        "every live state slot free",
        "request failures = injected failures",
        "no engine restart",
        "no snapshot pinned",
        "no request running",
        "no 5xx status",
    }
    # step failures: at least one when a forward / sample fault fired, never more than those faults
    assert _failed(soak.pool_checks({}, _metrics(hyserve_step_failures_total=0.0), counts, sites)) == {
        "step failures counted"
    }
    assert _failed(soak.pool_checks({}, _metrics(hyserve_step_failures_total=2.0), counts, sites)) == {
        "step failures counted"
    }
    # counters are taken relative to the scrape before the load
    before = {"hyserve_request_failures_total": 5.0, "hyserve_step_failures_total": 4.0}
    after = _metrics(hyserve_request_failures_total=7.0, hyserve_step_failures_total=5.0)
    assert _failed(soak.pool_checks(before, after, counts, sites)) == set()


def test_an_injected_failure_must_be_logged_as_the_injected_fault() -> None:
    o = soak.Outcome(index=0, kind=soak.INJECTED, request_id="cmpl-00abc", site="forward", error_id="err-1")
    log = (
        "ERROR error id err-1: the engine failed while running this request: internal error while running "
        "this request: InjectedFault: injected fault (forward:cmpl-00@0) for request 'cmpl-00abc'\n"
    )
    assert soak.verify_in_log(log, [o]) == []
    other = log.replace("InjectedFault: injected fault (forward:cmpl-00@0)", "RuntimeError: CUDA error")
    assert len(soak.verify_in_log(other, [o])) == 1
    assert len(soak.verify_in_log(log.replace("err-1", "err-2"), [o])) == 1


def test_bad_options_are_refused_and_the_h200_defaults_are_valid() -> None:
    cfg = soak.config_from(soak.parse_args([]))
    assert (cfg.concurrency, cfg.duration_s, cfg.vocab_size, cfg.min_token_id) == (512, 600.0, 131072, 1000)
    with pytest.raises(SystemExit, match="--min-output"):
        soak.config_from(soak.parse_args(["--min-output", "4"]))
    with pytest.raises(SystemExit, match="--fault-every"):
        soak.config_from(soak.parse_args(["--fault-every", "1"]))


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_soak_smoke_on_the_tiny_model(tmp_path: Path, engine_process: str) -> None:
    """The soak through the engine on a thread of the server, and in its own process (the default on CUDA:
    the faults' environment, the injected failures' log lines and the pools all cross to it)."""
    out = tmp_path / "soak.json"
    rc = soak.main(
        [
            "--model",
            "",
            "--concurrency",
            "4",
            "--duration",
            "5",
            "--min-input",
            "8",
            "--max-input",
            "300",
            "--min-output",
            "8",
            "--max-output",
            "40",
            "--fault-every",
            "4",
            "--disconnect-every",
            "5",
            "--shared-prefix-len",
            "64",
            "--slow-every",
            "3",
            "--slow-read",
            "0.01",
            "--serve-args",
            f"--max_seq_len 1024 --warmup off --engine-process {engine_process}",
            "--out",
            str(out),
        ]
    )
    r = json.loads(out.read_text())
    assert rc == 0 and r["ok"], [c for c in r["checks"] if not c["ok"]]
    c = r["counts"]
    assert c["unexpected"] == 0 and c["completed"] > 10 and c["disconnected"] > 0
    assert set(r["injected_by_site"]) == set(soak.FAULT_SITES)  # ~1 in 4 of ~100 requests: each site fires
    assert c["injected_failure"] == r["targeted"]
    assert (
        r["metrics_after"]["hyserve_kv_cache_blocks_free"]
        == r["metrics_after"]["hyserve_kv_cache_blocks_total"]
    )
    assert r["command"].startswith("python -m benchmarks.bench_soak --model ''")
    assert r["rss_bytes"] and all(b > 50 * 2**20 for _, b in r["rss_bytes"])  # the server's, sampled
    assert r["itl_p99_ms_by_window"]  # 5 s of load: one window, too short for the steady-state bars
    assert not any("RSS flat" in c["check"] or "inter-token" in c["check"] for c in r["checks"])
    assert out.with_suffix(".log").exists()


def test_steady_state_bars_hold_flat_memory_and_latency_and_name_each_drift() -> None:
    cfg = soak.SoakConfig(duration_s=300.0, window_s=60.0)
    flat = soak.Monitor(rss=[(t, 2**30 + (2**20 if t > 100 else 0)) for t in range(0, 300, 2)])
    gaps = soak.GapWindows(0.0, 60.0)
    for k in range(5):
        for i in range(200):
            gaps.add(k * 60 + 1 + i * 0.2, 0.05 + (0.001 if k == 4 else 0.0))
    checks = {c[0]: c for c in soak.steady_checks(cfg, flat, gaps)}
    assert len(checks) == 2 and all(c[1] for c in checks.values()), checks
    growing = soak.Monitor(rss=[(t, 2**30 + t * 2**21) for t in range(0, 300, 2)])  # +2 MiB a second
    slower = soak.GapWindows(0.0, 60.0)
    for k in range(5):
        for i in range(200):
            slower.add(k * 60 + 1 + i * 0.2, 0.05 * (1.5 if k == 4 else 1.0))
    bad = soak.steady_checks(cfg, growing, slower)
    assert [c[1] for c in bad] == [False, False]
    assert "+" in bad[0][2] and "1.50x" in bad[1][2]
    short = soak.SoakConfig(duration_s=100.0, window_s=60.0)  # under two windows: no bar to hold
    assert soak.steady_checks(short, growing, slower) == []
