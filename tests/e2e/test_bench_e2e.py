"""`hyserve bench serve / offline / needle` end to end: a real `hyserve serve` of the built-in tiny model,
the offline bench on the tiny model, and the error paths a user meets first (server not running)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hyserve.bench import cli
from tests.server_fixtures import ServerProcess, free_port

RECORD_KEYS = {"name", "value", "unit", "reference", "reference_value", "ratio"}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    s = ServerProcess(args=["--disable-log-requests"]).start()
    yield s
    rc = s.stop()
    assert rc == 0, s.log()


def _load(path: Path) -> dict[str, Any]:
    d = json.loads(path.read_text())
    assert {"kind", "date", "git_sha", "gpu", "command", "config", "records"} <= set(d)
    assert d["records"] and all(set(r) == RECORD_KEYS for r in d["records"])
    return d


def test_bench_serve_sweep_with_reps(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "serve",
        "--base-url",
        server.url,
        "--num-prompts",
        "6",
        "--random-input-len",
        "24",
        "--random-output-len",
        "5",
        "--ignore-eos",
        "--reps",
        "2",
        "--sweep-concurrency",
        "1,3",
        "--metric-percentiles",
        "50,90",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "serve.json",
        "--git-sha",
        "deadbeef",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    for row in (
        "Successful requests",
        "Output token throughput (tok/s)",
        "P90 TTFT (ms)",
        "Mean TPOT (ms)",
        "P99 ITL (ms)",
        "Median E2EL (ms)",
        "per-user output (tok/s)",
        "Prompt tokens seen (usage)",
        "run2/run1 output throughput",
        "throughput vs concurrency",
    ):
        assert row in out
    d = _load(tmp_path / "serve.json")
    assert d["kind"] == "serve" and d["git_sha"] == "deadbeef" and d["command"] == ["hyserve", "bench", *argv]
    assert d["model"] == "hyserve-tiny" and d["config"]["dataset"]["num_prompts"] == 6
    assert [p["max_concurrency"] for p in d["points"]] == [1, 3]
    for p in d["points"]:
        assert len(p["reps"]) == 2 and p["run2_run1_output_throughput_ratio"] > 0
        assert "output_throughput" in p["spread"]
        for m in p["reps"]:
            assert (m["completed"], m["failed"]) == (6, 0)
            assert m["total_output_tokens"] == 30  # ignore_eos: exactly max_tokens each
            assert m["prompt_tokens_usage"] == m["prompt_tokens_sent"] == 6 * 24
            assert m["output_tokens_source"] == "usage" and m["cached_tokens"] == 0
            assert m["mean_ttft_ms"] > 0 and m["p90_ttft_ms"] is not None and m["mean_tpot_ms"] > 0
            assert len(m["requests"]) == 6
            # the server's own counters over the run, scraped from /metrics before and after
            sc = m["server_counters"]
            assert sc["generation_tokens"] == 30 and sc["num_preemptions"] == 0
            assert sc["jit_compiles_after_ready"] == 0
    assert d["points"][0]["reps"][0]["seed"] == 0 and d["points"][0]["reps"][1]["seed"] == 1
    assert server.idle()


def test_bench_serve_chat_shared_prefix_hits_the_prefix_cache(
    server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "serve",
        "--base-url",
        server.url + "/v1",
        "--endpoint",
        "/v1/chat/completions",
        "--dataset-name",
        "shared-prefix",
        "--shared-prefix-len",
        "160",
        "--num-prefixes",
        "1",
        "--num-prompts",
        "3",
        "--random-input-len",
        "4",
        "--random-output-len",
        "3",
        "--ignore-eos",
        "--max-concurrency",
        "1",
        "--chat-template-kwargs",
        '{"enable_thinking": false}',
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("Cached prompt tokens (usage)"))
    assert int(row.split()[-1].replace(",", "")) > 0  # requests 2 and 3 reuse request 1's prefix


def _generated(server: ServerProcess) -> float:
    import httpx

    from hyserve.bench.http_client import parse_counters

    return parse_counters(httpx.get(f"{server.url}/metrics", timeout=10).text)["generation_tokens"]


def test_bench_serve_sharegpt_with_vllm_traffic_options(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ShareGPT prompts at a bursty request rate, after warm-ups that are not counted, with goodput
    objectives and vLLM's percentile flags."""
    from hyserve.model.tiny import make_tiny

    turns = [
        ("tell me about the weather in spring please", "it is mild and often rainy in spring"),
        ("what should I cook for dinner tonight", "a warm soup with fresh bread would be nice"),
        ("name three colours of the rainbow for me", "red orange and yellow are three of them"),
    ]
    sg = tmp_path / "sg.json"
    conversations = [[{"from": "human", "value": q}, {"from": "gpt", "value": a}] for q, a in turns]
    sg.write_text(json.dumps([{"id": str(i), "conversations": c} for i, c in enumerate(conversations)]))
    tokenizer = make_tiny(tmp_path / "tiny")  # the served tiny model's tokenizer
    argv = ["serve", "--base-url", server.url, "--dataset-name", "sharegpt", "--dataset-path", str(sg)]
    argv += [
        "--tokenizer",
        str(tokenizer),
        "--sharegpt-output-len",
        "3",
        "--num-prompts",
        "5",
        "--ignore-eos",
    ]
    argv += ["--request-rate", "40", "--burstiness", "0.5", "--num-warmups", "2", "--goodput", "ttft:60000"]
    argv += ["e2el:60000", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,90,99"]
    argv += ["--save-result", "--result-dir", str(tmp_path), "--result-filename", "sg-result.json"]
    before = _generated(server)
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert _generated(server) - before == (5 + 2) * 3  # the server saw the warm-ups too
    for row in (
        "Request goodput (req/s)",
        "P90 TTFT (ms)",
        "P99 E2EL (ms)",
        "dataset sharegpt",
        "burstiness 0.5",
    ):
        assert row in out
    assert "TPOT (ms)" not in out and "ITL (ms)" not in out
    d = _load(tmp_path / "sg-result.json")
    assert (d["request_rate"], d["burstiness"], d["num_prompts"]) == (40.0, 0.5, 5)
    (m,) = d["points"][0]["reps"]
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (5, 0, 15)  # warm-ups not counted
    assert m["server_counters"]["generation_tokens"] == 15
    assert m["good_requests"] == 5 and m["request_goodput"] == pytest.approx(5 / m["duration_s"])
    assert m["p90_ttft_ms"] is not None and m["p90_e2el_ms"] >= m["p50_e2el_ms"]
    assert m["prompt_tokens_usage"] == m["prompt_tokens_sent"]  # lengths counted as the server counts them
    assert any(r["name"] == "unlimited concurrency, rep 1: request goodput" for r in d["records"])
    assert server.idle()


def test_bench_offline_tiny(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "offline",
        "--num-prompts",
        "4",
        "--input-len",
        "16",
        "--output-len",
        "4",
        "--reps",
        "2",
        "--max-batch-size",
        "4",
        "--max-num-tokens",
        "256",
        "--max-seq-len",
        "512",
        "--device",
        "cpu",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "offline.json",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "Output tok/s" in out and "Requests/s" in out and "run2/run1 output throughput" in out
    d = _load(tmp_path / "offline.json")
    assert d["kind"] == "offline" and d["config"]["resolved_engine_options"] == {
        "max_batch_size": 4,
        "max_num_tokens": 256,
        "max_seq_len": 512,
    }
    assert len(d["reps"]) == 2
    for m in d["reps"]:
        assert (m["num_requests"], m["total_input_tokens"], m["total_output_tokens"]) == (4, 64, 16)
        assert m["output_throughput"] > 0 and m["total_token_throughput"] > m["output_throughput"]
    assert any(
        r["name"] == "offline rep 2: output throughput" and r["reference"] == "offline rep 1"
        for r in d["records"]
    )


def test_bench_offline_refused_prompt_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "offline",
        "--num-prompts",
        "1",
        "--input-len",
        "100",
        "--output-len",
        "50",
        "--max-seq-len",
        "64",
        "--device",
        "cpu",
    ]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "hyserve bench offline: error: the engine refused a prompt" in err and "64" in err


def test_bench_needle_small_sizes(
    server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "needle",
        "--port",
        str(server.port),
        "--sizes",
        "200,400,6k",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "needle.json",
    ]
    assert cli.main(argv) == 0  # the 400 for the 6k prompt is a served outcome
    out = capsys.readouterr().out
    assert "needle found" in out and "max_seq_len" in out
    d = _load(tmp_path / "needle.json")
    assert d["kind"] == "needle" and d["token_count_method"] == "tokenize"
    small, mid, big = d["results"]
    for r in (small, mid):
        assert r["status"] == 200 and r["error"] is None
        assert abs(r["prompt_tokens"] - r["target_tokens"]) <= d["tokens_per_filler_word"]
        assert r["needle_found"] is False  # random weights; reported, not an error
        assert r["healthy_after"] is True and r["latency_s"] > 0
    assert big["status"] == 400 and "max_seq_len" in big["error"] and big["healthy_after"] is True
    assert d["config"]["chat_template_kwargs"] == {"enable_thinking": False}
    assert server.idle()


def test_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    for sub in ("serve", "needle"):
        assert (
            cli.main(
                [sub, "--base-url", url, "--num-prompts", "1"] if sub == "serve" else [sub, "--base-url", url]
            )
            == 1
        )
        err = capsys.readouterr().err
        assert f"hyserve bench {sub}: error: cannot reach the server at {url}/v1/models" in err
        assert "Traceback" not in err


def test_hyserve_cli_registers_bench(capsys: pytest.CaptureFixture[str]) -> None:
    """Through hyserve's own entry point: `hyserve bench serve` against nothing exits 1 with one line."""
    from hyserve.cli import main

    url = f"http://127.0.0.1:{free_port()}"
    assert main(["bench", "serve", "--base-url", url, "--model", "m"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hyserve bench serve: error: cannot reach the server")
    assert main(["bench"]) == 2  # no subcommand: help, usage status
