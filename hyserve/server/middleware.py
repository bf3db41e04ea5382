"""The API middleware: the bearer-token check, the request-body limit, the count of API requests in
flight (what a graceful drain waits for) and the per-route request counter, as pure ASGI.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which breaks the cancellation of streaming
responses (a client that goes away must abort its engine request at once); the key is checked before the
body is even read. A body over the limit is a 413 naming the limit: at once when its Content-Length says
so, else as soon as the bytes received pass it (the rest is never read). A body that has not all arrived
`read_timeout` seconds after the request's headers is a 408; a body that would take the bytes of the bodies
of all requests in progress past `max_inflight_body_bytes` is a 503 (retry shortly). The headers' own
timeout is the connection's (connections.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import HTTPException

from hyserve.server.errors import error_body
from hyserve.server.metrics import ServerMetrics

# Routes that need the API key when one is set (health, metrics and version stay open for probes).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_COUNTED_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/version",
    }
)


def body_too_large(limit: int) -> str:
    return (
        f"the request body is larger than the server's limit of {limit} bytes ({limit / 2**20:.0f} MiB; "
        "--max_request_body_bytes)"
    )


class _BodyTooLarge(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(status_code=413, detail=body_too_large(limit))


def read_timed_out(timeout: float) -> str:
    return f"the request did not arrive within {timeout:g} s (--request-read-timeout)"


def bodies_in_flight(limit: int) -> str:
    return (
        f"the server is already receiving {limit} bytes of request bodies ({limit / 2**20:.0f} MiB; "
        "--max-inflight-body-bytes): retry shortly"
    )


class _ReadTimeout(HTTPException):
    def __init__(self, timeout: float) -> None:
        super().__init__(status_code=408, detail=read_timed_out(timeout), headers={"connection": "close"})


class _Busy(HTTPException):
    def __init__(self, limit: int) -> None:
        super().__init__(
            status_code=503,
            detail=bodies_in_flight(limit),
            headers={"connection": "close", "retry-after": "1"},
        )


class _BodyBudget:
    """The bytes of request bodies received and not yet released (their requests still running)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.held = 0


class ApiMiddleware:
    """Checks the bearer token of protected routes, bounds request bodies, counts requests per route and
    status, and keeps `metrics.inflight`, the API requests (protected routes) not finished yet."""

    def __init__(
        self,
        app: Any,
        *,
        api_key: str | None,
        metrics: ServerMetrics,
        max_body_bytes: int | None = None,
        read_timeout: float | None = None,
        max_inflight_body_bytes: int | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout or None  # 0: none
        self.budget = _BodyBudget(max_inflight_body_bytes)

    async def __call__(
        self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Any
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        route = (
            path
            if path in _COUNTED_ROUTES
            else ("/v1/models/{model}" if path.startswith("/v1/models/") else "other")
        )
        if self.api_key and path.startswith(_PROTECTED_PREFIXES) and scope.get("method") != "OPTIONS":
            if not self._authorized(scope):
                await self._send_error(
                    send,
                    401,
                    error_body(
                        "invalid or missing API key: send 'Authorization: Bearer <key>'",
                        err_type="authentication_error",
                        code="invalid_api_key",
                    ),
                    route,
                    (b"www-authenticate", b"Bearer"),
                )
                return
        refusal = self._refuse_declared(scope)
        if refusal is not None:
            code, body = refusal
            retry = ((b"retry-after", b"1"),) if code == 503 else ()
            await self._send_error(send, code, body, route, (b"connection", b"close"), *retry)
            return
        held = [0]  # this request's body bytes counted in the budget
        receive = self._bounded(receive, held)
        status = {"code": 500}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        api = path.startswith(_PROTECTED_PREFIXES)
        self.metrics.inflight += api
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.budget.held -= held[0]
            self.metrics.inflight -= api
            self.metrics.requests.labels(route=route, status=str(status["code"])).inc()

    def _refuse_declared(self, scope: dict[str, Any]) -> tuple[int, dict[str, Any]] | None:
        """(413 or 503, the error body) for a body whose Content-Length is over the limit, or over what the
        bodies in flight leave; None otherwise."""
        declared = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-length"), None)
        if declared is None or not declared.strip().isdigit():
            return None
        n = int(declared)
        limit, budget = self.max_body_bytes, self.budget
        if limit is not None and n > limit:
            return 413, error_body(body_too_large(limit), err_type="invalid_request_error")
        if budget.limit is not None and n > 0 and budget.held + n > budget.limit:
            return 503, error_body(
                bodies_in_flight(budget.limit), err_type="service_unavailable_error", code="server_busy"
            )
        return None

    def _bounded(
        self, receive: Callable[..., Awaitable[Any]], held: list[int]
    ) -> Callable[..., Awaitable[Any]]:
        """`receive` that raises a 413 once the body's bytes pass the limit, a 503 once the bodies in flight
        pass theirs, and a 408 when the body has not all arrived `read_timeout` seconds from now; what it
        received is counted in `held[0]` (and the budget)."""
        limit, budget, timeout = self.max_body_bytes, self.budget, self.read_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        seen = 0
        done = False

        async def bounded() -> Any:
            nonlocal seen, done
            if done or deadline is None:
                message = await receive()
            else:
                try:
                    message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
                except TimeoutError:
                    assert timeout is not None
                    raise _ReadTimeout(timeout) from None
            if message["type"] == "http.request":
                n = len(message.get("body", b""))
                seen += n
                held[0] += n
                budget.held += n
                done = not message.get("more_body", False)
                if limit is not None and seen > limit:
                    raise _BodyTooLarge(limit)
                if budget.limit is not None and budget.held > budget.limit:
                    raise _Busy(budget.limit)
            return message

        return bounded

    async def _send_error(
        self, send: Any, status: int, body: dict[str, Any], route: str, *headers: tuple[bytes, bytes]
    ) -> None:
        """An error answered here, before the app (a JSON error body, `headers` besides its content type)."""
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), *headers],
            }
        )
        await send({"type": "http.response.body", "body": json.dumps(body).encode()})
        self.metrics.requests.labels(route=route, status=str(status)).inc()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        """The key from `Authorization: Bearer KEY` or `x-api-key: KEY`, compared as bytes (the key's UTF-8
        against the header's raw bytes: compare_digest refuses non-ASCII str, and any byte may arrive)."""
        assert self.api_key is not None
        key = self.api_key.encode("utf-8")
        for k, v in scope.get("headers", []):
            name = k.decode("latin-1").lower()
            val = bytes(v).strip()
            if name == "authorization":
                if val[:7].lower() == b"bearer " and hmac.compare_digest(val[7:].strip(), key):
                    return True
            elif name == "x-api-key" and hmac.compare_digest(val, key):
                return True
        return False
