"""benchmarks/roofline.py: ceilings measured on a device (tiny sizes on the CPU here; the GPU run uses the
defaults), the fields a record quoted against them carries, and bench_kernels' records carrying them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.roofline import (
    PUBLISHED,
    PUBLISHED_BW,
    PUBLISHED_FLOPS,
    Ceilings,
    ceiling_fields,
    load_ceilings,
    measure_ceilings,
)

ROOT = Path(__file__).resolve().parents[2]

SMALL = dict(
    stream_read_bytes=1 << 20,
    copy_bytes=1 << 20,
    gemv_bytes=1 << 18,
    matmul_shapes=((32, 48, 64), (64, 64, 64)),
    reps=3,
)


def test_measure_ceilings_on_the_cpu(tmp_path: Path) -> None:
    c = measure_ceilings("cpu", **SMALL)
    for v in (c.stream_read_bw, c.copy_bw, c.gemv_bw, c.matmul_flops):
        assert math.isfinite(v) and v > 0
    assert c.read_bw == max(c.stream_read_bw, c.gemv_bw) and c.device == "cpu"
    gemvs = {k for k in c.detail if k.startswith("gemv ")}
    assert gemvs == {
        "gemv torch F.linear (weight [N, K])",
        "gemv torch x @ W (weight [K, N])",
    }  # no Triton on a CPU
    assert f"gemv {c.gemv_best}" in gemvs
    assert c.matmul_best in ("bf16 32x48x64", "bf16 64x64x64")
    assert c.detail["stream_read"]["bytes"] == 1 << 20 and c.detail["copy"]["bytes_each_way"] == 1 << 20
    (tmp_path / "c.json").write_text(json.dumps(c.to_dict()))
    assert load_ceilings(tmp_path / "c.json") == c
    (tmp_path / "bench.json").write_text(json.dumps({"records": [], "ceilings": c.to_dict()}))
    assert load_ceilings(tmp_path / "bench.json") == c


C = Ceilings(
    device="gpu",
    stream_read_bw=4.0e12,
    copy_bw=4.2e12,
    gemv_bw=4.1e12,
    gemv_best="g",
    matmul_flops=800e12,
    matmul_best="m",
)


def test_ceiling_fields_rate_time_and_published() -> None:
    f = ceiling_fields("read", C, 3.0e12, lambda p: p.read_bw)
    assert f["ceiling_value"] == 4.1e12 and f["reference_value"] == 4.1e12  # the GEMV beat the streaming read
    assert f["ratio"] == pytest.approx(3.0 / 4.1) and f["ratio_to_published"] == pytest.approx(3.0 / 4.8)
    assert f["published_peak"] == PUBLISHED_BW and "measured" in f["ceiling"]
    # a time: ratio = roofline / measured
    t = ceiling_fields("read", C, 20.0, lambda p: 1e13 / p.read_bw, time_like=True)
    assert t["ratio"] == pytest.approx(1e13 / 4.1e12 / 20.0)
    assert t["ratio_to_published"] == pytest.approx(1e13 / PUBLISHED_BW / 20.0)
    m = ceiling_fields("matmul", C, 400e12, lambda p: p.matmul_flops)
    assert m["ratio"] == pytest.approx(0.5) and m["published_peak"] == PUBLISHED_FLOPS
    both = ceiling_fields("copy+matmul", C, 1.0, lambda p: p.copy_bw / p.matmul_flops)
    assert both["ceiling_value"] == {"copy_bw": 4.2e12, "matmul_flops": 800e12}
    assert both["published_reference_value"] == PUBLISHED.copy_bw / PUBLISHED.matmul_flops
    none = ceiling_fields("copy", None, 1e12, lambda p: p.copy_bw)
    assert none["reference_value"] is None and none["ratio"] is None and none["ceiling"] == "none measured"
    assert none["ratio_to_published"] == pytest.approx(1 / 4.8)


@pytest.mark.slow
def test_bench_kernels_records_carry_the_measured_ceiling(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_kernels",
            "--dry-run",
            "--only",
            "norm",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,  # benchmarks.bench_kernels is found from the repository root
    )
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["ceilings"]["device"] == "cpu" and doc["ceilings"]["copy_bw"] > 0
    assert doc["records"]
    for rec in doc["records"]:
        assert (
            rec["ceiling_value"] == doc["ceilings"]["copy_bw"]
            and rec["reference_value"] == rec["ceiling_value"]
        )
        assert rec["ratio"] == pytest.approx(rec["value"] / rec["ceiling_value"])
        assert rec["ratio_to_published"] == pytest.approx(rec["value"] / PUBLISHED_BW)
    assert "| rms_norm 5 tokens |" in r.stdout  # the table as before
