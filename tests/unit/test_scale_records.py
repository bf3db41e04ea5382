"""benchmarks/scale_records.py: the serving-at-scale records from a serve and an offline result."""

from __future__ import annotations

import json

from benchmarks import scale_records


def test_scale_records_quote_the_server_against_vllm_and_the_engine(tmp_path):
    serve = {"points": [{"reps": [{"output_throughput": 12000.0, "median_ttft_ms": 900.0}]}]}
    engine = {"reps": [{"output_throughput": 13000.0}]}
    (tmp_path / "serve_scale_c1024.json").write_text(json.dumps(serve))
    (tmp_path / "serve_scale_engine.json").write_text(json.dumps(engine))
    assert scale_records.main([str(tmp_path), "55.5", "abc1234"]) == 0
    out = json.loads((tmp_path / "serve_scale.json").read_text())
    recs = {r["name"]: r for r in out["records"]}
    assert out["git_sha"] == "abc1234"
    assert abs(recs["serve 30B-A3B fp8 1k/1k c1024"]["ratio"] - 12000 / 15828) < 1e-9
    assert abs(recs["serve / engine, same workload"]["ratio"] - 12000 / 13000) < 1e-9
    assert recs["serve TTFT p50, 1,024 concurrency (ms)"]["value"] == 900.0
    assert recs["time to ready, default sizes (s)"]["ratio"] == 55.5 / 60


def test_without_an_engine_result_the_server_records_stand_alone(tmp_path):
    """`gpu_serve_check.sh scale` with SCALE_ENGINE=0 runs no LLM.generate: the records leave out the
    server / engine ratio and keep the rest."""
    serve = {"points": [{"reps": [{"output_throughput": 7845.0, "median_ttft_ms": 66362.0}]}]}
    (tmp_path / "serve_scale_c1024.json").write_text(json.dumps(serve))
    assert scale_records.main([str(tmp_path), "76.2", "abc1234"]) == 0
    names = [r["name"] for r in json.loads((tmp_path / "serve_scale.json").read_text())["records"]]
    assert names == [
        "serve 30B-A3B fp8 1k/1k c1024",
        "serve TTFT p50, 1,024 concurrency (ms)",
        "time to ready, default sizes (s)",
    ]


def test_goodput_is_quoted_against_the_request_throughput(tmp_path):
    """With `--goodput ttft:2000 tpot:100` the run carries its goodput: the record's ratio is the share of
    requests that met both objectives."""
    rep = {"output_throughput": 12000.0, "median_ttft_ms": 900.0, "request_throughput": 10.0}
    (tmp_path / "serve_scale_c1024.json").write_text(
        json.dumps({"points": [{"reps": [{**rep, "request_goodput": 7.5}]}]})
    )
    assert scale_records.main([str(tmp_path), "40", "abc1234"]) == 0
    recs = {r["name"]: r for r in json.loads((tmp_path / "serve_scale.json").read_text())["records"]}
    good = recs["serve goodput, TTFT <= 2 s and TPOT <= 100 ms (req/s)"]
    assert good["value"] == 7.5 and good["ratio"] == 0.75
