"""benchmarks/sweep_roofline.py: each sweep point quoted against its decode-step roofline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.roofline import decode_step_ms  # noqa: E402
from hyserve.model.config import HybridModelConfig  # noqa: E402


def _point(path: Path, *, prompts: int, tpot: float, out_tps: float) -> None:
    run = {"completed": prompts, "median_itl_ms": tpot, "mean_tpot_ms": tpot + 1, "output_throughput": out_tps,
           "mean_ttft_ms": 100.0}
    path.write_text(json.dumps({"gpu": "NVIDIA H200", "config": {"dataset": {"num_prompts": prompts}},
                                "points": [{"reps": [run]}]}))


def test_sweep_roofline_ratios(tmp_path: Path) -> None:
    cfg = HybridModelConfig.from_dict(
        json.loads((ROOT / "benchmarks/configs/NVIDIA-Nemotron-Nano-9B-v2/config.json").read_text()))
    # the roofline step at batch 64 is above the weight-only step (9.30 ms at 264 tokens in bench_model)
    assert abs(decode_step_ms(cfg, 64, 264) - 9.3016) < 1e-3
    _point(tmp_path / "serve_sweep_in1000_out1000_c64.json", prompts=64, tpot=20.0, out_tps=2000.0)
    _point(tmp_path / "serve_sweep_in1000_out1000_c8.json", prompts=2, tpot=10.0, out_tps=150.0)
    (tmp_path / "serve_other.json").write_text("{}")  # not a sweep point: ignored
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/sweep_roofline.py"), "--results", str(tmp_path),
                        "--git-sha", "abc1234"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "serve_sweep_roofline.json").read_text())
    assert res["git_sha"] == "abc1234" and res["gpu"] == "NVIDIA H200"
    by = {x["name"]: x for x in res["records"]}
    # concurrency 8 with 2 prompts runs a batch of 2, sorted before concurrency 64
    assert list(by)[0].startswith("in 1000 out 1000 concurrency 8:")
    t8 = by["in 1000 out 1000 concurrency 8: median ITL (ms)"]
    assert t8["reference"] == "roofline decode step, batch 2"
    assert abs(t8["reference_value"] - decode_step_ms(cfg, 2, 1500)) < 1e-9
    t64 = by["in 1000 out 1000 concurrency 64: median ITL (ms)"]
    assert abs(t64["ratio"] - decode_step_ms(cfg, 64, 1500) / 20.0) < 1e-9
    o64 = by["in 1000 out 1000 concurrency 64: output throughput (tok/s)"]
    assert abs(o64["ratio"] - 2000.0 / (64 / decode_step_ms(cfg, 64, 1500) * 1e3)) < 1e-9
    assert "| in 1000 out 1000 concurrency 64: median ITL (ms) | 20.00 |" in r.stdout


def test_sweep_roofline_without_results_says_so(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/sweep_roofline.py"), "--results", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no serve_sweep_in*_out*_c*.json under" in r.stderr
