"""benchmarks/bench_host.py (host work per engine step, model stubbed) and the server's start-up heap
freeze it measures."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from hyserve.engine.gc_tuning import freeze_startup_heap

ROOT = Path(__file__).resolve().parents[2]


def test_freeze_startup_heap_takes_live_objects_out_of_collections() -> None:
    tracked = len(gc.get_objects())
    try:
        n = freeze_startup_heap()
        assert n == gc.get_freeze_count() > 1000  # torch alone brings tens of thousands
        assert len(gc.get_objects()) < tracked - 1000  # the collector no longer walks them
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_bench_host_writes_records(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_host",
            "--batches",
            "4",
            "--steps",
            "3",
            "--out",
            str(out),
            "--git-sha",
            "test",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert {"date", "git_sha", "gpu", "command", "records"} <= set(doc)
    names = [rec["name"] for rec in doc["records"]]
    assert names == [
        "host work per decode step, batch 4, GC start-up heap frozen (as served)",
        "host work per decode step, batch 4, GC default",
    ]
    for rec in doc["records"]:
        assert rec["unit"] == "ms" and rec["value"] > 0 and rec["reference_value"] > 0
        assert abs(rec["ratio"] - rec["value"] / rec["reference_value"]) < 1e-9
        assert set(rec["phases_ms"]) == {"schedule", "build_meta", "update", "sample_rows", "_read"}
    assert out.with_suffix(".md").read_text().count("\n") == 4


def test_bench_serve_host_serves_every_request_through_the_stub_model(tmp_path: Path) -> None:
    """benchmarks/bench_serve_host.py: `hyserve serve`'s app over the stub model in a child process, loaded
    by the bench client; every request completes with its full output, and the record quotes the rate
    against the published vLLM figure with both processes' CPU shares."""
    out = tmp_path / "sh.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_serve_host",
            "--concurrency",
            "8",
            "--input-len",
            "40",
            "--output-len",
            "6",
            "--prompts-per-stream",
            "2",
            "--out",
            str(out),
            "--git-sha",
            "test",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    (rec,) = doc["records"]
    assert rec["completed"] == 16 and rec["failed"] == 0 and rec["output_tok_s"] > 0
    assert rec["reference_value"] == 15828.0 and abs(rec["ratio"] - rec["value"] / 15828.0) < 1e-9
    assert 0 < rec["server_cpu_share"] and 0 < rec["client_cpu_share"]


@pytest.mark.slow
def test_bench_server_cost_compares_serve_with_the_engine(tmp_path: Path) -> None:
    """benchmarks/bench_server_cost.py: the same requests through LLM.generate and through `hyserve serve`
    (a child process) on the emulated device; every request completes, the record is their ratio, and
    each side took at least the device time of its steps (one prefill step, then one per further token)."""
    out = tmp_path / "sc.json"
    cmd = [sys.executable, "-m", "benchmarks.bench_server_cost", "--concurrency", "4", "--input-len", "30"]
    cmd += [
        "--output-len",
        "4",
        "--step-ms",
        "50",
        "--token-us",
        "100",
        "--out",
        str(out),
        "--git-sha",
        "test",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["server"]["completed"] == 4 and rec["server"]["failed"] == 0
    assert rec["engine"]["output_tokens"] == 16
    assert abs(rec["value"] - rec["server"]["output_tok_s"] / rec["engine"]["output_tok_s"]) < 1e-9
    floor_s = (0.050 + 120 * 100e-6) + 3 * (0.050 + 4 * 100e-6)
    assert rec["engine"]["duration_s"] >= floor_s and rec["server"]["duration_s"] >= floor_s


def test_bench_server_cost_engine_side_holds_the_host_for_eager_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """bench_server_cost's engine side with more prompts than the batch (--num-prompts, --max-batch-size) and
    an eager step's host time (--eager-ms): every request completes, and the run took at least the host time
    of the steps that prefilled (6 prompts through 2 slots: 3 at least)."""
    import argparse

    from benchmarks import bench_server_cost as bsc
    from hyserve.engine import engine as engine_mod
    from hyserve.engine.pending_step import PendingStep

    # the emulated device replaces these two for the process: put them back after the test
    monkeypatch.setattr(engine_mod, "sample_step", engine_mod.sample_step)
    monkeypatch.setattr(PendingStep, "read", PendingStep.read)
    ns = argparse.Namespace(
        max_batch_size=2,
        num_prompts=6,
        input_len=20,
        output_len=3,
        batch_wait_timeout_iters=4,
        batch_wait_max_tokens_ratio=0.5,
        range_ratio=0.0,
    )
    work = bsc.workload(ns, concurrency=2)
    assert work.options()["batch_wait_timeout_iters"] == 4 and work.prompts == 6
    got = bsc.engine_point(work, bsc.Device(step_ms=1.0, token_us=0.0, eager_ms=30.0), seed=0)
    assert got["output_tokens"] == 18
    assert got["duration_s"] >= 3 * 0.030


def test_emulated_launches_give_up_the_interpreter_lock() -> None:
    """bench_server_cost's --eager-launches: an eager step's host stretch releases the lock at each launch,
    so another thread runs inside it; held in one stretch, the other thread waits for the switch interval."""
    import threading
    import time

    from benchmarks.bench_server_cost import _hold_host

    def progress(launches: int) -> int:
        ticks = [0]
        stop = threading.Event()

        def spin() -> None:
            while not stop.is_set():
                ticks[0] += 1
                time.sleep(0)

        t = threading.Thread(target=spin)
        t.start()
        time.sleep(0.01)
        before = ticks[0]
        _hold_host(40.0, launches)
        during = ticks[0] - before
        stop.set()
        t.join()
        return during

    assert progress(400) > 4 * max(1, progress(0))
