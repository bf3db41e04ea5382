"""benchmarks/sweep_roofline.py: each sweep point quoted against its decode-step roofline."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import sweep_roofline
from benchmarks.roofline import PUBLISHED_BW, Ceilings, decode_step_ms
from hyserve.model.nemotron_h.config import HybridModelConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_script(monkeypatch, capsys):
    """Runs sweep_roofline.py's main in this process (a fresh interpreter spent ~4 s importing torch) with
    these arguments; returncode / stdout / stderr as running the script would give them. cuda=False: as on
    a machine without a GPU (the ceilings are then not measured)."""

    def run(*args: str, cuda: bool | None = None) -> SimpleNamespace:
        monkeypatch.setattr(sys, "argv", ["sweep_roofline.py", *args])
        if cuda is not None:
            monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        code, message = 0, ""
        try:
            sweep_roofline.main()
        except SystemExit as e:  # SystemExit("message") prints the message and exits 1
            code, message = (e.code, "") if isinstance(e.code, int) else (1, str(e.code))
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err + message)

    return run


def _point(path: Path, *, prompts: int, tpot: float, out_tps: float) -> None:
    run = {
        "completed": prompts,
        "median_itl_ms": tpot,
        "mean_tpot_ms": tpot + 1,
        "output_throughput": out_tps,
        "mean_ttft_ms": 100.0,
    }
    path.write_text(
        json.dumps(
            {
                "gpu": "NVIDIA H200",
                "config": {"dataset": {"num_prompts": prompts}},
                "points": [{"reps": [run]}],
            }
        )
    )


# ceilings as benchmarks/roofline.py --out writes them: the bytes-read ceiling is the faster of the two reads
CEILINGS = Ceilings(
    device="NVIDIA H200",
    stream_read_bw=4.27e12,
    copy_bw=4.28e12,
    gemv_bw=4.20e12,
    gemv_best="torch F.linear (weight [N, K])",
    matmul_flops=794e12,
    matmul_best="bf16 8192x8192x8192",
)
BW = 4.27e12


def test_sweep_roofline_ratios(tmp_path: Path, run_script) -> None:
    cfg = HybridModelConfig.from_dict(
        json.loads((ROOT / "benchmarks/configs/NVIDIA-Nemotron-Nano-9B-v2/config.json").read_text())
    )
    # the roofline step at batch 64 is above the weight-only step (9.30 ms at 264 tokens at 3.79 TB/s)
    assert abs(decode_step_ms(cfg, 64, 264, 3.79e12) - 9.3016) < 1e-3
    _point(tmp_path / "serve_sweep_in1000_out1000_c64.json", prompts=64, tpot=20.0, out_tps=2000.0)
    _point(tmp_path / "serve_sweep_in1000_out1000_c8.json", prompts=2, tpot=10.0, out_tps=150.0)
    (tmp_path / "serve_other.json").write_text("{}")  # not a sweep point: ignored
    (tmp_path / "ceilings.json").write_text(json.dumps(CEILINGS.to_dict()))
    r = run_script(
        "--results", str(tmp_path), "--git-sha", "abc1234", "--ceilings", str(tmp_path / "ceilings.json")
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "serve_sweep_roofline.json").read_text())
    assert res["git_sha"] == "abc1234" and res["gpu"] == "NVIDIA H200"
    assert res["ceilings"]["read_bw"] == BW
    by = {x["name"]: x for x in res["records"]}
    # concurrency 8 with 2 prompts runs a batch of 2, sorted before concurrency 64
    assert list(by)[0].startswith("in 1000 out 1000 concurrency 8:")
    t8 = by["in 1000 out 1000 concurrency 8: median ITL (ms)"]
    assert t8["reference"] == "roofline decode step, batch 2"
    assert abs(t8["reference_value"] - decode_step_ms(cfg, 2, 1500, BW)) < 1e-9
    assert t8["ceiling_value"] == BW and "measured" in t8["ceiling"]
    t64 = by["in 1000 out 1000 concurrency 64: median ITL (ms)"]
    assert abs(t64["ratio"] - decode_step_ms(cfg, 64, 1500, BW) / 20.0) < 1e-9
    assert abs(t64["ratio_to_published"] - decode_step_ms(cfg, 64, 1500, PUBLISHED_BW) / 20.0) < 1e-9
    assert t64["published_peak"] == PUBLISHED_BW == 4.8e12
    o64 = by["in 1000 out 1000 concurrency 64: output throughput (tok/s)"]
    assert abs(o64["ratio"] - 2000.0 / (64 / decode_step_ms(cfg, 64, 1500, BW) * 1e3)) < 1e-9
    assert (
        abs(o64["ratio_to_published"] - 2000.0 / (64 / decode_step_ms(cfg, 64, 1500, PUBLISHED_BW) * 1e3))
        < 1e-9
    )
    assert by["in 1000 out 1000 concurrency 64: mean TTFT (ms)"]["ceiling"] is None  # no roofline there
    assert "| in 1000 out 1000 concurrency 64: median ITL (ms) | 20.00 |" in r.stdout


def test_sweep_roofline_without_ceilings_quotes_the_published_peak(tmp_path: Path, run_script) -> None:
    cfg = HybridModelConfig.from_dict(
        json.loads((ROOT / "benchmarks/configs/NVIDIA-Nemotron-Nano-9B-v2/config.json").read_text())
    )
    _point(tmp_path / "serve_sweep_in1000_out1000_c64.json", prompts=64, tpot=20.0, out_tps=2000.0)
    r = run_script("--results", str(tmp_path), cuda=False)
    assert r.returncode == 0, r.stderr
    assert "published peak only" in r.stderr
    res = json.loads((tmp_path / "serve_sweep_roofline.json").read_text())
    assert res["ceilings"] is None
    t64 = next(x for x in res["records"] if x["name"].endswith("median ITL (ms)"))
    assert t64["reference_value"] is None and t64["ratio"] is None and t64["ceiling"] == "none measured"
    assert abs(t64["ratio_to_published"] - decode_step_ms(cfg, 64, 1500, PUBLISHED_BW) / 20.0) < 1e-9


def test_sweep_roofline_without_results_says_so(tmp_path: Path, run_script) -> None:
    r = run_script("--results", str(tmp_path))
    assert r.returncode != 0 and "no serve_sweep_in*_out*_c*.json under" in r.stderr


def test_sweep_roofline_quotes_an_moe_architecture_against_the_experts_a_batch_touches(
    tmp_path: Path, run_script
) -> None:
    from benchmarks.roofline import active_decode_step_ms

    d = ROOT / "benchmarks/configs/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
    cfg = HybridModelConfig.from_dict(json.loads((d / "config.json").read_text()))
    _point(tmp_path / "serve_sweep_in1000_out1000_c8.json", prompts=8, tpot=5.0, out_tps=1500.0)
    (tmp_path / "ceilings.json").write_text(json.dumps(CEILINGS.to_dict()))
    r = run_script(
        "--results", str(tmp_path), "--ceilings", str(tmp_path / "ceilings.json"), "--model-dir", str(d)
    )
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "serve_sweep_roofline.json").read_text())
    assert res["model"].startswith("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
    t8 = next(x for x in res["records"] if x["name"].endswith("median ITL (ms)"))
    want = active_decode_step_ms(cfg, 8, 1500, BW)
    assert abs(t8["reference_value"] - want) < 1e-9
    assert want < decode_step_ms(cfg, 8, 1500, BW) / 2  # 8 tokens x top-6 touch ~40 of the 128 experts


def test_sweep_roofline_fp8_weights_and_a_published_point(tmp_path: Path, run_script) -> None:
    """--quantization fp8 quotes FP8 weight bytes (a smaller roofline step than bf16's); --published points go
    to the JSON (and the plot); a malformed one is refused naming the form."""
    from benchmarks.roofline import active_decode_step_ms
    from hyserve.model.quant_config import QuantConfig

    d = ROOT / "benchmarks/configs/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
    cfg = HybridModelConfig.from_dict(json.loads((d / "config.json").read_text()))
    fp8 = cfg.with_quant(QuantConfig(method="online", scheme="channel"))
    _point(tmp_path / "serve_sweep_in1000_out1000_c1024.json", prompts=1024, tpot=50.0, out_tps=12000.0)
    (tmp_path / "ceilings.json").write_text(json.dumps(CEILINGS.to_dict()))
    args = ["--results", str(tmp_path), "--ceilings", str(tmp_path / "ceilings.json"), "--model-dir", str(d)]
    r = run_script(*args, "--quantization", "fp8", "--published", "1024:15828:vLLM, H200")
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "serve_sweep_roofline.json").read_text())
    assert res["weights"] == "fp8"
    assert res["published"] == [{"concurrency": 1024, "output_tok_s": 15828.0, "label": "vLLM, H200"}]
    step = next(x for x in res["records"] if x["name"].endswith("median ITL (ms)"))
    want = active_decode_step_ms(fp8, 1024, 1500, BW)
    assert abs(step["reference_value"] - want) < 1e-9 and want < active_decode_step_ms(cfg, 1024, 1500, BW)
    r = run_script(*args, "--published", "lots")
    assert r.returncode == 2 and "is not CONCURRENCY:TOK_S[:LABEL]" in r.stderr
