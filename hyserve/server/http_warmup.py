"""Warm the HTTP path before the port opens.

The engine's warm-up (hyserve/engine/lifecycle/warmup.py) compiles every kernel variant, but the first request
through the server still paid for Python's first calls in the request path (FastAPI's request parsing
and dependency solving, pydantic serialisers of the response chunks, the SSE generator, the async
engine's hand-off): measured 20-70 ms on the first request's TTFT, on CPU and on the H200. Here a
throwaway app over the same engine serves a few tiny requests in process (plain ASGI calls, no socket,
no extra dependency): streamed and whole completions from token ids and, when the model has a
tokenizer, chat completions. The real app is built afterwards, so its counters start at zero, and the
engine forgets these requests (`AsyncEngine.reset_stats`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from hyserve.server.app import ServerOptions, build_app


async def _call(
    app: Any, method: str, path: str, body: dict[str, Any] | None, headers: list[tuple[bytes, bytes]]
) -> tuple[int, bytes]:
    """One ASGI HTTP request to `app`; returns (status, body). The client stays connected until the
    response ends, as a real client would."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"warmup"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
            *headers,
        ],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
    }
    done = asyncio.Event()
    sent_body = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                done.set()

    try:
        await app(scope, receive, send)
    except Exception:  # Starlette re-raises after it sent the 500 (uvicorn would log it)
        status = status or 500
    done.set()
    return status, b"".join(chunks)


def warm_http_path(
    engine: Any, server_options: ServerOptions | None = None, log: Callable[[str], None] | None = None
) -> float:
    """Serve a few tiny requests through a throwaway app over `engine` (started); returns the seconds
    taken. A failure here is reported and does not stop the server (the real requests will tell)."""
    t0 = time.perf_counter()
    opts = server_options or ServerOptions()
    # the log is the real requests' (--enable-log-requests)
    app = build_app(engine, dataclasses.replace(opts, log_requests=False))
    app.state.accepting = True
    headers = [(b"authorization", f"Bearer {opts.api_key}".encode())] if opts.api_key else []
    bos = 1 if engine.tokenizer is None else (engine.tokenizer.bos_token_id or 1)
    requests: list[tuple[str, dict[str, Any]]] = []
    for stream in (True, False):
        common: dict[str, Any] = {
            "model": engine.model_name,
            "max_tokens": 2,
            "temperature": 0,
            "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {}),
        }
        requests.append(("/v1/completions", {**common, "prompt": [bos, bos + 1], "logprobs": 1}))
        if engine.tokenizer is not None and engine.tokenizer.has_chat_template:
            requests.append(
                ("/v1/chat/completions", {**common, "messages": [{"role": "user", "content": "hi"}]})
            )

    async def run() -> list[str]:
        problems = []
        for path, body in requests:
            status, out = await _call(app, "POST", path, body, headers)
            if status != 200 or b'"error"' in out:
                problems.append(f"{path} (stream={body['stream']}): HTTP {status} {out[:200]!r}")
        for path in ("/health", "/metrics"):
            status, _ = await _call(app, "GET", path, None, headers)
            if status != 200:
                problems.append(f"GET {path}: HTTP {status}")
        return problems

    problems = asyncio.run(run())
    engine.reset_stats()
    seconds = time.perf_counter() - t0
    if log is not None:
        if problems:
            log("hyserve: warning: HTTP warm-up requests failed: " + "; ".join(problems))
        else:
            log(f"hyserve: HTTP path warmed ({len(requests)} requests in {seconds:.2f}s)")
    return seconds
