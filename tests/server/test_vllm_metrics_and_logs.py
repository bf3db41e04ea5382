"""vLLM's Prometheus series on /metrics (with the model_name label) beside hyserve's, over the real engine;
the server's log (time and level on every line, text or JSON, the periodic stats line); and a busy port
refused before the model loads."""

from __future__ import annotations

import io
import json
import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from hyserve.config import EngineConfig
from hyserve.engine.async_engine import AsyncEngine
from hyserve.server.app import ServerOptions, build_app
from hyserve.server.logs import StatsLogger, log_line, setup_logging
from tests.server_fixtures import REPO_ROOT, ServerProcess, parse_metrics, serve_app_in_thread, wait_until

VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
}


@pytest.fixture(scope="module")
def engine() -> Iterator[AsyncEngine]:
    eng = AsyncEngine(EngineConfig(warmup="off", served_model_name="tiny-m"), log=lambda s: None)
    eng.start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def url(engine: AsyncEngine) -> Iterator[str]:
    with serve_app_in_thread(build_app(engine, ServerOptions())) as u:
        yield u


def types_of(text: str) -> dict[str, str]:
    return dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))


def test_every_vllm_series_is_exported_with_the_model_name(url: str) -> None:
    body = {"model": "tiny-m", "prompt": "Hello there", "max_tokens": 6, "ignore_eos": True}
    for stream in (False, True):
        r = httpx.post(f"{url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200, r.text
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert types_of(text) | VLLM_SERIES == types_of(text), sorted(set(VLLM_SERIES) - set(types_of(text)))
    m = parse_metrics(text)
    label = '{model_name="tiny-m"}'
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert m[name + label] == 0.0
    assert m["vllm:generation_tokens_total" + label] == 12.0
    assert m["vllm:prompt_tokens_total" + label] == m["hyserve_prompt_tokens_total"] > 0
    assert m['vllm:request_success_total{finished_reason="length",model_name="tiny-m"}'] == 2.0
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time"):
        assert m[f"vllm:{name}_seconds_count{label}"] == 2.0, name
    for name in ("request_decode_time", "request_inference_time"):
        assert m[f"vllm:{name}_seconds_count{label}"] == 2.0, name
    # 6 tokens a request: up to 5 gaps each (a delta holding several steps' tokens, read late, shares its gap
    # among them; tokens that came with the first one have no gap of their own to measure)
    itl = m[f"vllm:inter_token_latency_seconds_count{label}"]
    assert 2 <= itl <= 10 and m[f"vllm:time_per_output_token_seconds_count{label}"] == itl
    assert m['vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="tiny-m"}'] == itl
    assert (
        m[f"vllm:inter_token_latency_seconds_sum{label}"]
        <= m[f"vllm:request_decode_time_seconds_sum{label}"] + 1e-6
    )
    assert m[f"vllm:request_generation_tokens_sum{label}"] == 12.0
    assert m[f"vllm:request_prompt_tokens_count{label}"] == 2.0
    assert m["vllm:prefix_cache_queries_total" + label] >= m["vllm:prefix_cache_hits_total" + label] >= 0
    assert m["vllm:num_preemptions_total" + label] == 0.0
    # the phases of a request add up to what the client saw, within the loop's hand-over
    e2e = m[f"vllm:e2e_request_latency_seconds_sum{label}"]
    phases = (
        m[f"vllm:request_queue_time_seconds_sum{label}"]
        + m[f"vllm:request_inference_time_seconds_sum{label}"]
    )
    assert 0 < phases <= e2e + 1e-3
    # hyserve's own series stay
    assert "hyserve_time_to_first_token_seconds_count" in m and "hyserve_num_requests_running" in m


# every token id of the tiny vocabulary in the prompt: a 1-token n-gram lookup always finds a draft
SPEC_BODY = {"model": "tiny-s", "prompt": list(range(1, 320)), "max_tokens": 24, "ignore_eos": True, "n": 2}


def _serve_one(cfg: EngineConfig) -> tuple[list[str], dict[str, float]]:
    """The choices' texts of SPEC_BODY (greedy, n = 2) and the /metrics that follow, from a fresh server."""
    eng = AsyncEngine(cfg, log=lambda s: None)
    eng.start()
    try:
        with serve_app_in_thread(build_app(eng, ServerOptions())) as u:
            r = httpx.post(f"{u}/v1/completions", json={**SPEC_BODY, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            texts = [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]
            return texts, parse_metrics(httpx.get(f"{u}/metrics", timeout=10).text)
    finally:
        eng.shutdown()


def test_speculative_decoding_counters() -> None:
    """With speculative_config set, /metrics counts drafts, draft tokens, accepted tokens and accepted
    tokens per draft position, under hyserve's names and vLLM's; a server without it exports none. Both
    choices of an n = 2 greedy request are the plain server's text."""
    from hyserve.config import build_engine_config

    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}
    texts, m = _serve_one(
        build_engine_config(warmup="off", served_model_name="tiny-s", speculative_config=spec)
    )
    plain_texts, plain = _serve_one(build_engine_config(warmup="off", served_model_name="tiny-s"))
    assert texts == plain_texts and texts[0] == texts[1]
    drafts, tokens = (
        m["hyserve_spec_decode_num_drafts_total"],
        m["hyserve_spec_decode_num_draft_tokens_total"],
    )
    assert 0 < drafts <= tokens <= 2 * drafts
    assert m['vllm:spec_decode_num_draft_tokens_total{model_name="tiny-s"}'] == tokens
    accepted = m["hyserve_spec_decode_num_accepted_tokens_total"]
    per_pos = [m[f'hyserve_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in (0, 1)]
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1]
    assert (
        m['vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-s",position="0"}']
        == per_pos[0]
    )
    assert not any("spec_decode" in k for k in plain)


# ---- the log -------------------------------------------------------------------------------------------


@pytest.fixture
def restore_logging() -> Iterator[None]:
    names = ("hyserve", "uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level) for n in names}
    yield
    for n, (handlers, level) in saved.items():
        logging.getLogger(n).handlers = handlers
        logging.getLogger(n).setLevel(level)


def test_text_log_lines_carry_time_and_level(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("info", "text", stream=out)
    log_line("hyserve: ready: serving\n  a second line")
    log_line("hyserve: warning: accepted for compatibility")
    logging.getLogger("uvicorn.error").info("Started server process")
    logging.getLogger("uvicorn.access").info('127.0.0.1 - "GET /health" 200')
    logging.getLogger("hyserve.requests").debug("not at info")
    lines = out.getvalue().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} "
    assert [re.sub(stamp, "", line) for line in lines] == [
        "INFO hyserve: ready: serving",
        "INFO hyserve:   a second line",
        "WARNING hyserve: accepted for compatibility",
        "INFO uvicorn: Started server process",
        'INFO uvicorn.access: 127.0.0.1 - "GET /health" 200',
    ]
    assert all(re.match(stamp, line) for line in lines)


def test_json_log_lines(restore_logging: None) -> None:
    out = io.StringIO()
    setup_logging("debug", "json", stream=out)
    log_line("hyserve: error: the engine stopped")
    logging.getLogger("hyserve.requests").debug("request r1: 3 prompt tokens")
    a, b = (json.loads(line) for line in out.getvalue().splitlines())
    assert (a["level"], a["logger"], a["message"]) == ("ERROR", "hyserve", "the engine stopped")
    assert (b["level"], b["logger"], b["message"]) == (
        "DEBUG",
        "hyserve.requests",
        "request r1: 3 prompt tokens",
    )
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", a["time"])


def test_stats_line() -> None:
    counters = {
        "num_running": 3,
        "num_waiting": 1,
        "kv_blocks_total": 100,
        "kv_blocks_free": 75,
        "live_slots_total": 8,
        "live_slots_used": 3,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "num_preemptions": 0,
        "prefill_tokens_scheduled_total": 0,
        "prompt_tokens_total": 0,
        "generation_tokens_total": 0,
    }
    lines: list[str] = []
    stats = StatsLogger(lambda: dict(counters), lines.append, interval=10.0)
    assert stats.tick(now=0.0) is None  # the first tick takes the counters
    counters.update(
        prefill_tokens_scheduled_total=2000,
        prompt_tokens_total=2500,
        generation_tokens_total=500,
        prefix_cache_queries=1000,
        prefix_cache_hits=250,
        num_preemptions=2,
    )
    assert stats.tick(now=10.0) == (
        "stats: prompt 200.0 tok/s, generation 50.0 tok/s, running 3, waiting 1, KV cache 25.0%, "
        "state slots 37.5%, prefix cache hit rate 25.0%, preemptions 2"
    )
    counters.update(num_running=0, num_waiting=0, kv_blocks_free=100, live_slots_used=0)
    idle = stats.tick(now=20.0)
    assert idle is not None and idle.startswith("stats: prompt 0.0 tok/s, generation 0.0 tok/s, running 0")
    assert stats.tick(now=30.0) is None and stats.tick(now=40.0) is None  # idle: one line, then quiet
    counters.update(generation_tokens_total=600)
    assert "generation 10.0 tok/s" in (stats.tick(now=50.0) or "")
    assert lines[-1].endswith("preemptions 0") and len(lines) == 3


# ---- the server process ---------------------------------------------------------------------------------


def test_busy_port_fails_before_the_model_loads() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        p = subprocess.run(
            [sys.executable, "-m", "hyserve.cli", "serve", "--port", str(port), "--max-model-len", "512"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"port {port} on 127.0.0.1: cannot listen there: it is already in use" in p.stderr, p.stderr
    assert "loading model" not in p.stdout and "capacity plan" not in p.stdout, p.stdout
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_served_log_json_stats_and_vllm_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real `hyserve serve`: JSON log lines, the stats line (every 0.5 s here), VLLM_API_KEY."""
    monkeypatch.setenv("HYSERVE_LOG_STATS_INTERVAL", "0.5")
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    monkeypatch.delenv("HYSERVE_API_KEY", raising=False)
    server = ServerProcess(args=["--max-model-len", "1024", "--log-format", "json", "--enable-log-requests"])
    server.start()
    try:
        body = {"prompt": "Hi", "max_tokens": 4}
        assert httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 401
        headers = {"Authorization": "Bearer vk"}
        assert (
            httpx.post(f"{server.base_url}/completions", json=body, headers=headers, timeout=60).status_code
            == 200
        )
        assert httpx.get(f"{server.url}/ping", timeout=10).status_code == 200

        def busy_stats_logged() -> bool:
            return any(
                '"stats: prompt' in x and "generation 0.0 tok/s" not in x for x in server.log().splitlines()
            )

        assert wait_until(busy_stats_logged, 20), server.log()
    finally:
        rc = server.stop()
    log = server.log()
    assert rc == 0, log
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert records and all({"time", "level", "logger", "message"} <= set(r) for r in records)
    assert not [line for line in log.splitlines() if line.strip() and not line.startswith("{")], log
    messages = [r["message"] for r in records]
    assert any(m.startswith("ready: serving") for m in messages), messages
    assert any(m.startswith("stats: prompt") and "generation 0.0 tok/s" not in m for m in messages), messages
    assert any(r["logger"] == "uvicorn.access" for r in records)
    assert any(r["logger"] == "hyserve.requests" and "finished: length" in r["message"] for r in records)
