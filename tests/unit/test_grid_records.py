"""benchmarks/grid_records.py: default flags against the best explicit batch x token setting."""

from __future__ import annotations

import json

import pytest

from benchmarks import grid_records


def _result(tok_s: float) -> dict:
    return {"points": [{"reps": [{"output_throughput": tok_s}]}]}


def test_default_flags_against_the_best_setting(tmp_path):
    for setting, tps in (("default", 11000.0), ("512x8192", 10000.0), ("1024x8192", 11500.0)):
        (tmp_path / f"serve_grid_{setting}.json").write_text(json.dumps(_result(tps)))
    (tmp_path / "serve_grid.json").write_text("{}")  # an earlier summary: not a setting
    assert grid_records.main([str(tmp_path), "abc1234"]) == 0
    recs = json.loads((tmp_path / "serve_grid.json").read_text())["records"]
    by = {r["name"]: r for r in recs}
    assert recs[0]["name"] == "grid 30B-A3B fp8 1k/1k c1024, default"
    assert by["grid 30B-A3B fp8 1k/1k c1024, 512x8192"]["ratio"] == 10000 / 11000
    last = by["grid: default flags vs the best setting"]
    assert last["reference"].startswith("best setting (1024x8192)") and last["ratio"] == 11000 / 11500


def test_without_the_default_run_each_setting_stands_alone(tmp_path):
    (tmp_path / "serve_grid_256x16384.json").write_text(json.dumps(_result(9000.0)))
    assert grid_records.main([str(tmp_path), "abc1234"]) == 0
    recs = json.loads((tmp_path / "serve_grid.json").read_text())["records"]
    assert [r["ratio"] for r in recs] == [None]


def test_no_results_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no serve_grid_"):
        grid_records.main([str(tmp_path), "abc1234"])
