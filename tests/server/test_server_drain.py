"""Graceful drain on SIGTERM (docs/architecture.md, "Shutdown"), through a real `hyserve serve`: a stream in
flight finishes, a request after the signal is refused, exit status 0; a stream still running at
`shutdown_timeout` ends with an in-band error and the process still exits 0."""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from tests.server_fixtures import ServerProcess

pytestmark = pytest.mark.slow  # two real server processes, seconds each


def _stream(
    server: ServerProcess, max_tokens: int, events: list[str], started: threading.Event
) -> threading.Thread:
    body = {"prompt": "Go:", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}

    def reader() -> None:
        with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=reader)
    t.start()
    return t


def _drain_case(max_tokens: int, timeout_s: str) -> tuple[int | None, list[str], int, str]:
    server = ServerProcess(
        args=["--max_seq_len", "1024", "--warmup", "off", "--shutdown_timeout", timeout_s]
    ).start()
    events: list[str] = []
    started = threading.Event()
    try:
        t = _stream(server, max_tokens, events, started)
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        late = httpx.post(f"{server.base_url}/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 503 and "draining" in health.json()["error"]["message"]
        t.join(60)
        rc = server.proc.wait(60)  # type: ignore[union-attr]
    finally:
        server.stop(signal.SIGKILL)
    return rc, events, late.status_code, server.log()


def test_sigterm_lets_the_stream_finish_and_refuses_new_requests() -> None:
    rc, events, late, log = _drain_case(max_tokens=200, timeout_s="30")
    assert rc == 0, log
    assert late == 503
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks[-1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "drained: every request finished" in log


def test_stream_past_the_timeout_ends_with_an_error_and_exit_0() -> None:
    rc, events, late, log = _drain_case(max_tokens=1000, timeout_s="0.5")
    assert rc == 0, log
    assert late == 503
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_aborted"
    assert "drain timeout" in log
