"""benchmarks/bench_moe.py end to end on the CPU (`--dry-run`: tiny shapes, the Triton interpreter): the
tuning pass and both kernel variants (GEMV at 1 token, GEMM at 8) checked against the float64 reference, the
whole MoE module, and rooflines quoted at the H200's published peaks of benchmarks/roofline.py
(docs/architecture.md, MoE)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.roofline import PUBLISHED_BW, PUBLISHED_FLOPS

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}  # the benchmarks run by module name from tmp_path


def test_dry_run_tunes_checks_and_quotes_the_published_peaks(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    # a subprocess: --dry-run sets TRITON_INTERPRET before triton is first imported
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_moe",
            "--dry-run",
            "--tune",
            "--tune-sizes",
            "1,8",
            "--sizes",
            "1,8",
            "--git-sha",
            "test",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["git_sha"] == "test" and doc["gpu"] == "cpu (interpreter)"
    assert (doc["ceilings"]["read_bw"], doc["ceilings"]["matmul_flops"]) == (PUBLISHED_BW, PUBLISHED_FLOPS)
    assert set(doc["tuned"]) == {"E=8,N=32,K=64"} and set(doc["tuned"]["E=8,N=32,K=64"]) == {"1", "8"}
    experts = doc["experts"]
    assert [(e["layer"].split(" ")[0], e["T"]) for e in experts] == [
        ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", 1),
        ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", 8),
        ("NVIDIA-Nemotron-3-Super-120B-A12B-BF16", 1),
        ("NVIDIA-Nemotron-3-Super-120B-A12B-BF16", 8),
    ]
    assert [e["config"]["variant"] for e in experts] == ["gemv", "gemm", "gemv", "gemm"]
    for e in experts:
        assert e["correct"] and e["rel_err"] < 1e-2 and e["rel_err_loop"] < 1e-2, e
        assert e["fused_eager_ms"] > 0 and e["fused_graph_ms"] > 0 and e["loop_eager_ms"] > 0
        want = max(e["bytes"] / PUBLISHED_BW, e["flops"] / PUBLISHED_FLOPS) * 1e3
        assert e["roofline_ms"] == pytest.approx(want, rel=1e-12)
        assert e["ratio_to_roofline"] == pytest.approx(e["fused_best_ms"] / e["roofline_ms"])
    layers = doc["layers"]
    assert [x["T"] for x in layers] == [1, 8] and all(x["correct"] and x["eager_ms"] > 0 for x in layers)
    table = out.with_suffix(".md").read_text()
    assert table.startswith("ceilings: bytes read 4.80 TB/s, bf16 matmul 989 TFLOP/s")
    assert table.count("| NVIDIA-Nemotron-3-") == 6  # 4 expert rows + 2 module rows


def test_decode_chain_dry_run_checks_both_forms_against_float64(tmp_path: Path) -> None:
    """benchmarks/bench_moe_decode.py on the CPU: the late and EARLY forms of the decode GEMVs, the nested
    down GEMV and the down GEMV split by slot, each checked against the float64 reference (with the shared
    expert) before it is timed, the bytes a layer reads, and the best setting's two GEMVs timed alone."""
    out = tmp_path / "decode.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_moe_decode",
            "--dry-run",
            "--git-sha",
            "test",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert [
        (x["what"], x["up"]["EARLY"], x["down"].get("EARLY", 0), x["down"].get("FLAT", 0)) for x in rows
    ] == [("late", 0, 0, 1), ("early", 1, 1, 1), ("down nested", 1, 0, 0), ("down split", 1, 0, 0)]
    assert all(x["rel_err"] < 1e-2 and x["us_per_layer"] > 0 for x in rows), rows
    # tiny shape: 2 routed + 2 shared chunks of up and down (32 x 64, fp32) and the 8 x 64 fp32 router
    assert doc["bytes_per_layer"] == (2 + 2) * 2 * 32 * 64 * 4 + 8 * 64 * 4
    assert doc["speedup_best_vs_late"] == pytest.approx(
        doc["late_us_per_layer"] / doc["best"]["us_per_layer"]
    )
    assert "| late |" in out.with_suffix(".md").read_text()
    alone = doc["gemvs_alone"]
    assert alone["up_bytes"] == alone["down_bytes"] == (2 + 2) * 32 * 64 * 4
    assert alone["up_us"] > 0 and alone["down_us"] > 0
    assert alone["down_fraction"] == pytest.approx(
        alone["down_bytes"] / (alone["down_us"] * 1e-6) / doc["ceilings"]["read_bw"]
    )


def test_decode_chain_dry_run_of_the_super_layout_with_fp8_experts(tmp_path: Path) -> None:
    """--shape super --fp8: the latent layout (the router over the wider hidden state, no shared expert in the
    chain) with e4m3 experts, every form checked against float64 of the dequantised experts; the bytes count
    one byte a weight plus the channel scales."""
    out = tmp_path / "decode.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_moe_decode",
            "--dry-run",
            "--shape",
            "super",
            "--fp8",
            "--git-sha",
            "test",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["fp8"] is True and doc["shared_chunks"] == 0 and "skip" not in r.stdout
    assert len(doc["rows"]) == 4 and all(x["rel_err"] < 1e-2 for x in doc["rows"]), doc["rows"]
    # 2 routed experts of 32 x 64 e4m3 and their float32 channel scales: [32] each for up, [64] for down
    up, down = 2 * 32 * 64 + 2 * 32 * 4, 2 * 32 * 64 + 2 * 64 * 4
    assert (doc["gemvs_alone"]["up_bytes"], doc["gemvs_alone"]["down_bytes"]) == (up, down)
    assert doc["bytes_per_layer"] == up + down + 8 * 128 * 4  # the router reads the 128-wide hidden state
    assert "e4m3 experts" in out.with_suffix(".md").read_text()


def test_decode_chain_profile_once_runs_the_tuned_chain_and_exits(tmp_path: Path) -> None:
    """bench_moe_decode.py --profile-once (the process ncu profiles): the chains at the tuned 1-token settings
    run and the script exits before any timing or file."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_moe_decode",
            "--dry-run",
            "--profile-once",
            "--git-sha",
            "test",
            "--out",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "profiling the chain at {'variant': 'gemv'" in r.stdout
    assert not (tmp_path / "x.json").exists()


def test_a_whole_tuning_keeps_the_fp8_entries_it_never_tunes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`bench_moe.py --tune` rewrites a GPU's file with the 16-bit shapes it tuned; the ',w=fp8' entries
    (written by bench_moe_decode.py --fp8 --write, which --tune never measures) stay, a merge keeps both."""
    import benchmarks.bench_moe as bm
    import hyserve.kernels.triton_moe as tm

    gemv = {
        "variant": "gemv",
        "up": dict(BLOCK_N=4, BLOCK_K=128, num_warps=2, num_stages=8),
        "down": dict(BLOCK_N=4, BLOCK_K=128, num_warps=2, num_stages=8, SPLIT=1),
    }
    key, key8, other = tm.shape_key(512, 2688, 1024), tm.shape_key(512, 2688, 1024, fp8=True), "E=8,N=32,K=64"
    monkeypatch.setattr(tm, "CONFIG_DIR", tmp_path)
    try:
        bm.write_tuned({key: {"1": gemv}, key8: {"1": gemv}, other: {"1": gemv}}, "Some GPU", "a")
        path = bm.write_tuned({key: {"1": gemv, "2": gemv}}, "Some GPU", "b")
        assert sorted(json.loads(path.read_text())["configs"]) == sorted(
            [key, key8]
        )  # other: not re-tuned, gone
        path = bm.write_tuned({key8: {"2": gemv}}, "Some GPU", "c", merge=True)
        assert json.loads(path.read_text())["configs"][key8] == {"1": gemv, "2": gemv}
        assert json.loads(path.read_text())["arch"] == ""  # never measured on a named chip
        path = bm.write_tuned({key8: {"2": gemv}}, "Some GPU", "d", merge=True, arch="sm_90x132")
        path = bm.write_tuned({key8: {"4": gemv}}, "Some GPU", "e", merge=True)  # "" keeps the file's chip
        assert json.loads(path.read_text())["arch"] == "sm_90x132"
    finally:
        tm._tuned_table.cache_clear()
        tm._chip_tables.cache_clear()
        tm._bucket_config.cache_clear()
