"""benchmarks/bench_fairness.py (docs/architecture.md, "Step composition"): the CPU smoke run of the H200
benchmark through a real `hyserve serve` of the built-in tiny model (a 3000-token prompt beside two streams
and a short chat request every 0.2 s), the time-budget cut, and the pieces that turn timings into numbers."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import bench_fairness as bf
from hyserve.bench.metrics import RequestResult

ROOT = Path(__file__).resolve().parents[2]


SMOKE = [
    "--model",
    "",
    "--long-len",
    "3000",
    "--max-seq-len",
    "4096",
    "--max-num-tokens",
    "128",
    "--max-batch-size",
    "8",
    "--streams",
    "2",
    "--stream-input-len",
    "32",
    "--stream-output-len",
    "24",
    "--short-interval-s",
    "0.2",
    "--lead-in-s",
    "0.3",
    "--min-token-id",
    "3",
    "--kv-cache-dtype",
    "auto",
    "--git-sha",
    "smoke",
]


def test_smoke_run_through_hyserve_serve(tmp_path: Path) -> None:
    # two settings, a budget that lets only the first start: one server, and the cut is recorded
    argv = [
        *SMOKE,
        "--max-step-ms",
        "100,off",
        "--time-budget-s",
        "1",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "f.json",
    ]
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_fairness", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "short TTFT p50 ms" in r.stdout and "not run: max_step_ms off" in r.stdout
    d = json.loads((tmp_path / "f.json").read_text())
    assert {"date", "git_sha", "gpu", "command", "config", "settings", "records"} <= set(d)
    assert (
        d["git_sha"] == "smoke"
        and d["gpu"] == "cpu"
        and d["command"][1:] == ["-m", "benchmarks.bench_fairness", *argv]
    )
    assert d["not_run"] == ["off"] and d["config"]["step_ms"] == [100.0, None]
    (s,) = d["settings"]
    assert (
        s["max_step_ms"] == 100.0
        and "max_step_ms: 100" in s["yaml"]
        and "mamba_ssm_philox_rounds: 5" in s["yaml"]
    )
    assert s["server_exit"] == 0 and any("capacity plan" in ln for ln in s["server_log"])
    assert s["alone"]["ok"] and s["alone"]["prompt_tokens"] == 3000 and s["alone"]["cached_tokens"] == 0
    c = s["contended"]
    # the second long prompt has other ids: no prefix-cache hit, and the ratio is measured on one server
    assert c["long"]["ok"] and c["long"]["prompt_tokens"] == 3000 and c["long"]["cached_tokens"] == 0
    assert s["ratio"] == pytest.approx(c["long"]["e2el_s"] / s["alone"]["e2el_s"])
    sh, st = c["shorts"], c["streams"]
    assert sh["sent"] >= 1 and sh["ok"] == sh["sent"] and sh["ttft_s"]["n"] == sh["sent"]
    assert 0 < sh["ttft_s"]["p50"] <= sh["ttft_s"]["p99"] <= sh["ttft_s"]["max"]
    assert st["requests"] >= 2 and st["ok"] == st["requests"] and st["output_tokens"] == 24 * st["requests"]
    itl = st["itl_ms_during_long"]
    assert 0 < itl["n"] <= st["itl_ms_all"]["n"] and itl["p99"] <= itl["max"]
    assert c["server_counters"]["jit_compiles_after_ready"] == 0
    # the step shape: the alone prompt's 3000 tokens in chunks of at most max_num_tokens (128), every step
    # carrying prefill; beside it the streams' and shorts' prompts too, and decode-only steps
    a = s["alone"]["server_counters"]
    assert a["prefill_tokens_scheduled"] == 3000 and a["engine_prefill_steps"] >= 3000 / 128
    assert a["mean_prefill_tokens_per_prefill_step"] <= 128
    assert c["server_counters"]["prefill_tokens_scheduled"] >= 3000
    assert c["server_counters"]["engine_steps"] > c["server_counters"]["engine_prefill_steps"]
    assert s["checks"]["all_ok"] is True
    assert {r["name"] for r in d["records"]} >= {
        "max_step_ms 100: long prompt alone",
        "max_step_ms 100: short-request TTFT p99",
    }


def _stream(start: float, ttft: float, gaps: list[float]) -> RequestResult:
    return RequestResult(
        ok=True, prompt_len=1, max_tokens=len(gaps) + 1, start_s=start, ttft_s=ttft, itl_s=gaps
    )


def test_window_gaps_keep_the_gaps_that_end_inside_the_long_prompts_lifetime() -> None:
    # run start at 100: chunks at 101.0, 101.5, 103.5, 104.0
    r = _stream(0.5, 0.5, [0.5, 2.0, 0.5])
    assert bf.chunk_times(r, 100.0) == [101.0, 101.5, 103.5, 104.0]
    assert bf.window_gaps_ms([r], 100.0, 101.2, 103.6) == pytest.approx([500.0, 2000.0])
    assert bf.window_gaps_ms([r], 100.0, 104.5, 110.0) == []
    assert bf.chunk_times(RequestResult(ok=False, prompt_len=1, max_tokens=1), 0.0) == []


def _setting(ms: float | None, alone: float, ttft99: float, itl99: float, ratio: float) -> dict:
    s = {
        "max_step_ms": ms,
        "alone": {"e2el_s": alone},
        "ratio": ratio,
        "contended": {
            "long": {"ok": True, "e2el_s": alone * ratio},
            "shorts": {"sent": 3, "ok": 3, "ttft_s": {"p99": ttft99}},
            "streams": {"requests": 2, "ok": 2, "itl_ms_during_long": {"p99": itl99}},
        },
    }
    s["checks"] = bf.checks(s, bf.FairnessOptions())
    return s


def test_the_suggested_default_meets_every_target_with_the_fastest_long_prompt() -> None:
    off = _setting(None, 90.0, 100.0, 900.0, 1.0)  # today's behaviour: a stalled short request
    a = _setting(100.0, 99.0, 0.4, 150.0, 1.10)
    b = _setting(150.0, 95.0, 0.6, 190.0, 1.12)
    c = _setting(250.0, 92.0, 0.9, 260.0, 1.05)  # streams stall past 200 ms
    assert off["checks"]["short_ttft_p99"] is False and c["checks"]["stream_itl_p99"] is False
    assert bf.pick_default([off, a, b, c]) == 150.0
    assert bf.pick_default([off, c]) is None
    assert bf.pick_default([_setting(None, 90.0, 0.5, 100.0, 1.0), a]) == "off"


def test_bad_settings_are_refused_with_the_value_and_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    assert bf.parse_step_ms("off,100, 150") == (None, 100.0, 150.0)
    for bad, msg in (("fast", "neither 'off' nor a number"), ("0", "must be > 0"), ("100,100", "distinct")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            bf.parse_step_ms(bad)
    ap = bf.build_parser()
    for argv, msg in (
        (["--max-batch-size", "8"], "must be >= 10"),
        (["--long-len", "1048576"], "exceeds --max-seq-len 1048576"),
        (["--short-interval-s", "0"], "--short-interval-s must be > 0"),
    ):
        with pytest.raises(SystemExit):
            bf.options_from(ap.parse_args(argv), ap)
        assert msg in capsys.readouterr().err
    a = ap.parse_args(["--long-len", "1M"])
    assert bf.options_from(a, ap).long_len == 1_000_000


def test_the_yaml_is_the_reports_with_this_runs_sizes() -> None:
    o = bf.FairnessOptions()
    y = bf.report_yaml(o, None)
    assert "max_step_ms: null" in y and "max_seq_len: 1048576" in y and "max_num_tokens: 16384" in y
    assert "dtype: fp8" in y and "periodic_snapshot_interval: 256" in y and "max_batch_size: 16" in y
    assert "max_step_ms: 150" in bf.report_yaml(o, 150.0)


def test_an_architecture_directory_gets_the_byte_tokenizer_for_chat(tmp_path: Path) -> None:
    d = bf.model_dir_for_chat(str(bf.NANO_9B), tmp_path)
    assert d is not None and (Path(d) / "tokenizer.json").is_file()
    assert json.loads((Path(d) / "config.json").read_text())["vocab_size"] == bf.model_vocab(d) == 131072
    assert bf.model_dir_for_chat(None, tmp_path) is None
