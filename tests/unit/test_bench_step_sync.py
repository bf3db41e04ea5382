"""benchmarks/bench_step_sync.py (a large decode step's host phases and host-device syncs) on the CPU, and its
recorder of torch's synchronisation warnings."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import benchmarks.bench_step_sync as bss

ROOT = Path(__file__).resolve().parents[2]


def _sync_here() -> None:
    warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)


def test_sync_recorder_counts_warnings_by_call_site(monkeypatch) -> None:
    passed_on: list[str] = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, *a, **kw: passed_on.append(str(message)))
    with bss.SyncRecorder() as rec:
        for _ in range(3):
            _sync_here()
        _sync_here()
        warnings.warn("an unrelated warning", UserWarning, stacklevel=1)
    assert passed_on == ["an unrelated warning"]  # handed to the previous handler, not counted
    assert sum(rec.sites.values()) == 4
    sites = sorted(rec.sites.items(), key=lambda kv: -kv[1])
    assert sites[0][1] == 3 and sites[1][1] == 1  # the loop's call and the single call are two sites
    assert all("_sync_here" in site for site, _ in sites)
    assert set(rec.messages.values()) == {"called a synchronizing CUDA operation"}


def test_bench_step_sync_writes_phases_and_syncs(tmp_path: Path, capsys) -> None:
    assert (
        bss.main(
            [
                "--model-dir",
                "",
                "--batch",
                "4",
                "--steps",
                "3",
                "--git-sha",
                "test",
                "--result-dir",
                str(tmp_path),
            ]
        )
        == 0
    )
    [path] = tmp_path.glob("step_sync_*_test.json")
    doc = json.loads(path.read_text())
    assert {"date", "git_sha", "gpu", "command"} <= set(doc)
    assert doc["batch"] == 4 and doc["decode_steps"] >= 3 and doc["step_ms"] > 0
    assert doc["graph_replay_ms"] is None  # no decode graphs on the CPU
    assert {"scheduler.schedule", "runner.execute", "scheduler.update", "engine._read"} == set(
        doc["phases_ms"]
    )
    assert doc["syncs"] == []  # nothing on the CPU synchronises with a device
    assert "synchronising calls: 0" in capsys.readouterr().out


def test_bench_step_sync_times_steps_that_prefill_new_prompts(tmp_path: Path, capsys) -> None:
    """--mixed-prompts: per count, the steps that prefill that many new prompts beside the decode batch,
    timed, and every request still finishes."""
    argv = ["--model-dir", "", "--batch", "4", "--steps", "2", "--mixed-prompts", "1", "3"]
    argv += ["--mixed-len", "40", "--mixed-reps", "2", "--git-sha", "test", "--result-dir", str(tmp_path)]
    assert bss.main(argv) == 0
    [path] = tmp_path.glob("step_sync_*_test.json")
    mixed = json.loads(path.read_text())["mixed"]
    assert [(m["prompts"], m["prompt_len"], m["reps"]) for m in mixed] == [(1, 40, 2), (3, 40, 2)]
    assert all(m["step_ms"] >= m["execute_ms"] > 0 for m in mixed)
    assert "step with 3 new prompt(s) of 40 tokens" in capsys.readouterr().out


def test_breakdown_times_each_layer_kind_of_a_mixed_step(tmp_path: Path, capsys) -> None:
    """--breakdown: per count, the host time inside each layer kind's modules, every layer called once (the
    device's kernels only on CUDA)."""
    argv = ["--model-dir", "", "--batch", "4", "--steps", "2", "--mixed-prompts", "2", "--breakdown"]
    argv += ["--mixed-len", "40", "--mixed-reps", "1", "--git-sha", "test", "--result-dir", str(tmp_path)]
    assert bss.main(argv) == 0
    [path] = tmp_path.glob("step_sync_*_test.json")
    [b] = json.loads(path.read_text())["mixed_breakdown"]
    layers = b["layer_host_ms"]
    assert b["prompts"] == 2 and {"Mamba2Mixer", "Attention"} <= set(layers)
    assert layers["Mamba2Mixer"]["calls"] == 3 and layers["Attention"]["calls"] == 2  # the tiny model's
    assert 0 < sum(v["ms"] for v in layers.values()) <= b["step_host_ms"]
    assert "breakdown, 2 new prompt(s)" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--batch", "0"], ["--steps", "0"], ["--prompt-len", "0"]])
def test_bench_step_sync_refuses_empty_workloads(bad, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        bss.main(["--model-dir", "", *bad, "--result-dir", str(tmp_path)])
    assert e.value.code == 2
