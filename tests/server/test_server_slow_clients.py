"""Slow and greedy clients, through the app over a fake engine on uvicorn as `hyserve serve` configures it
(serve.uvicorn_config): headers or a body that do not arrive within `request_read_timeout` are a 408, the
connection cap answers 503, and so does a body that would take the bytes of the bodies in flight past
`max_inflight_body_bytes`; ordinary requests, slow answers and keep-alive are untouched."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from hyserve.server.app import ServerOptions, build_app
from hyserve.server.serve import uvicorn_config
from tests.server.test_server_app import tiny_tokenizer
from tests.server.test_server_http import _server_options
from tests.server_fixtures import FakeEngine, free_port, wait_until

JSON = {"content-type": "application/json"}


class SlowEngine(FakeEngine):
    """Answers after `delay` seconds."""

    delay: float = 0.0

    async def generate(self, *args: Any, **kw: Any) -> AsyncIterator[Any]:
        await asyncio.sleep(self.delay)
        async for d in super().generate(*args, **kw):
            yield d


@contextlib.contextmanager
def serve(engine: FakeEngine | None = None, **opts: Any) -> Iterator[tuple[str, int]]:
    import uvicorn

    options = ServerOptions(log_level="warning", **opts)
    app = build_app(engine or FakeEngine(tokenizer=tiny_tokenizer(), max_seq_len=1024), options)
    port = free_port()
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, options))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        assert wait_until(lambda: server.started, 20)
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        t.join(timeout=20)


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    out = b""
    with contextlib.suppress(OSError):
        while True:
            data = sock.recv(65536)
            if not data:
                break
            out += data
    return out


def test_headers_that_do_not_arrive_in_time_are_a_408() -> None:
    with serve(request_read_timeout=0.5) as (_, port):
        for partial in (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n", b"P", b""):
            sock = socket.create_connection(("127.0.0.1", port))
            t0 = time.monotonic()
            sock.sendall(partial)
            reply = _read_all(sock, 10)  # until the server closes the connection
            took = time.monotonic() - t0
            sock.close()
            assert 0.4 < took < 3, took
            if not partial:  # nothing sent: closed without a word, as an idle keep-alive connection
                assert reply == b""
                continue
            assert reply.startswith(b"HTTP/1.1 408"), reply
            err = json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]
            assert err["code"] == "request_timeout" and "--request-read-timeout" in err["message"]


def test_a_body_that_does_not_arrive_in_time_is_a_408() -> None:
    with serve(request_read_timeout=0.5) as (_, port):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b'content-length: 100\r\n\r\n{"prompt": '
        )
        t0 = time.monotonic()
        reply = _read_all(sock, 10)
        sock.close()
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - t0 < 3
        assert b"--request-read-timeout" in reply


def test_ordinary_and_slow_answers_and_keep_alive_are_untouched() -> None:
    eng = SlowEngine(tokenizer=tiny_tokenizer(), max_seq_len=1024)
    eng.delay = 0.8  # the answer takes twice the read timeout
    with serve(eng, request_read_timeout=0.4) as (url, _), httpx.Client(timeout=30) as c:
        for pause in (0.2, 0.6):  # a keep-alive connection idle between requests, or closed once idle
            r = c.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200, r.text
            time.sleep(pause)
        assert c.get(f"{url}/health").status_code == 200


def test_connections_past_the_cap_are_answered_503() -> None:
    with serve(max_connections=4) as (url, port):
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            time.sleep(0.2)
            r = httpx.get(f"{url}/health", timeout=10)
            assert r.status_code == 503, r.text
        finally:
            for s in idle:
                s.close()
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, 10)


def test_bodies_in_flight_past_the_cap_are_a_503() -> None:
    limit = 64 * 1024
    with serve(max_request_body_bytes=limit, max_inflight_body_bytes=100 * 1024) as (url, port):
        body = json.dumps({"prompt": "hi", "max_tokens": 1, "pad": "a" * 59_000}).encode()
        slow = socket.create_connection(("127.0.0.1", port))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
        ).encode()
        slow.sendall(head + body[:50_000])  # held: 50,000 bytes in flight
        time.sleep(0.3)
        r = httpx.post(f"{url}/v1/completions", content=body, headers=JSON, timeout=30)
        assert r.status_code == 503 and "--max-inflight-body-bytes" in r.text, r.text
        assert r.headers["retry-after"] == "1"
        slow.sendall(body[50_000:])  # the held request completes and releases its bytes
        assert _read_all(slow, 10).startswith(b"HTTP/1.1 200")
        slow.close()
        r = httpx.post(f"{url}/v1/completions", content=body, headers=JSON, timeout=30)
        assert r.status_code == 200, r.text


def test_slow_client_options() -> None:
    default = _server_options()
    assert (default.request_read_timeout, default.max_connections, default.max_inflight_body_bytes) == (
        30.0,
        8192,
        512 * 2**20,
    )
    opts = _server_options(
        "--request-read-timeout", "5", "--max-connections", "100", "--max-inflight-body-bytes", str(2**30)
    )
    assert (opts.request_read_timeout, opts.max_connections, opts.max_inflight_body_bytes) == (
        5.0,
        100,
        2**30,
    )
    with pytest.raises(ValueError, match="max_inflight_body_bytes"):
        _server_options("--max-inflight-body-bytes", "1024")  # below one largest body


def test_the_server_runs_on_uvloop_and_httptools_where_installed() -> None:
    """The server extra installs both; uvicorn's "auto" then picks them (the headers' deadline protocol
    too): a streamed event costs the event loop less than on asyncio's own loop and h11."""
    pytest.importorskip("uvloop")
    pytest.importorskip("httptools")
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    for timeout in (30.0, 0.0):  # with the headers' deadline and without
        options = ServerOptions(log_level="warning", request_read_timeout=timeout)
        app = build_app(FakeEngine(tokenizer=tiny_tokenizer(), max_seq_len=1024), options)
        cfg = uvicorn_config(app, "127.0.0.1", free_port(), options)
        cfg.load()
        assert issubclass(cfg.http_protocol_class, HttpToolsProtocol)
        factory = cfg.get_loop_factory()
        assert factory is not None
        loop = factory()
        try:
            assert type(loop).__module__.startswith("uvloop")
        finally:
            loop.close()
