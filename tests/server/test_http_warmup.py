"""The server's HTTP warm-up: a throwaway app serves a few tiny requests in process before the port
opens, then the engine forgets them (counters, prefix cache) and the real app's metrics start at zero."""

from __future__ import annotations

import httpx
import pytest

from hyserve.config import EngineConfig
from hyserve.engine.async_engine import AsyncEngine
from hyserve.server.app import ServerOptions, build_app
from hyserve.server.http_warmup import warm_http_path
from tests.server_fixtures import parse_metrics, serve_app_in_thread


@pytest.fixture(scope="module")
def engine():
    eng = AsyncEngine(EngineConfig(warmup="off"), log=lambda s: None)
    eng.start()
    yield eng
    eng.shutdown()


def test_warmup_requests_succeed_and_leave_no_trace(engine: AsyncEngine) -> None:
    logs: list[str] = []
    seconds = warm_http_path(engine, ServerOptions(), log=logs.append)
    assert seconds > 0
    assert len(logs) == 1 and logs[0].startswith("hyserve: HTTP path warmed (4 requests"), (
        logs
    )  # tokenizer: chat too
    s = engine.stats()
    assert s["prompt_tokens_total"] == 0 and s["generation_tokens_total"] == 0
    assert s["requests_finished_total"] == 0 and s["prefix_cache_queries"] == 0
    assert s["num_running"] == 0 and s["num_waiting"] == 0
    with serve_app_in_thread(build_app(engine)) as u:
        m = parse_metrics(httpx.get(f"{u}/metrics").text)
        assert m.get("hyserve_prompt_tokens_total", 0.0) == 0.0
        assert not any(k.startswith('hyserve_requests_total{route="/v1/') for k in m), m
        r = httpx.post(
            f"{u}/v1/completions", json={"prompt": [1, 5, 9], "max_tokens": 3, "temperature": 0}, timeout=30
        )
        assert r.status_code == 200, r.text
        assert engine.stats()["prompt_tokens_total"] == 3


def test_warmup_with_api_key(engine: AsyncEngine) -> None:
    logs: list[str] = []
    warm_http_path(engine, ServerOptions(api_key="sekret"), log=logs.append)
    assert logs[0].startswith("hyserve: HTTP path warmed"), logs


def test_warmup_failure_is_reported_not_raised(engine: AsyncEngine) -> None:
    """An engine that fails every request: the failures are logged (HTTP 500 and in-band stream errors);
    the server still starts."""
    logs: list[str] = []

    class Failing:
        def __getattr__(self, name):
            return getattr(engine, name)

        async def generate(self, *a, **k):
            raise RuntimeError("injected")
            yield  # an async generator, as AsyncEngine.generate

    warm_http_path(Failing(), ServerOptions(), log=logs.append)
    assert logs and logs[0].startswith("hyserve: warning: HTTP warm-up requests failed:"), logs
    assert "HTTP 500" in logs[0] and "stream=True" in logs[0], logs


def test_no_chat_requests_without_a_chat_template(engine: AsyncEngine, monkeypatch) -> None:
    monkeypatch.setattr(engine.tokenizer, "_templates", {})
    assert not engine.tokenizer.has_chat_template
    logs: list[str] = []
    warm_http_path(engine, ServerOptions(), log=logs.append)
    assert logs == [logs[0]] and logs[0].startswith("hyserve: HTTP path warmed (2 requests"), logs
