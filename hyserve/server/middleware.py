"""The API middleware: the bearer-token check, the request-body limit, the count of API requests in
flight (what a graceful drain waits for) and the per-route request counter, as pure ASGI.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which breaks the cancellation of streaming
responses (a client that goes away must abort its engine request at once); the key is checked before the
body is even read. A body over the limit is a 413 naming the limit: at once when its Content-Length says
so, else as soon as the bytes received pass it (the rest is never read).
"""

from __future__ import annotations

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


class ApiMiddleware:
    """Checks the bearer token of protected routes, bounds request bodies, counts requests per route and
    status, and keeps `metrics.inflight`, the API requests (protected routes) not finished yet."""

    def __init__(
        self, app: Any, *, api_key: str | None, metrics: ServerMetrics, max_body_bytes: int | None = None
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

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
        limit = self.max_body_bytes
        if limit is not None:
            declared = next((v for k, v in scope.get("headers", []) if k.lower() == b"content-length"), None)
            if declared is not None and declared.strip().isdigit() and int(declared) > limit:
                await self._send_error(
                    send,
                    413,
                    error_body(body_too_large(limit), err_type="invalid_request_error"),
                    route,
                    (b"connection", b"close"),
                )
                return
            receive = self._bounded(receive, limit)
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
            self.metrics.inflight -= api
            self.metrics.requests.labels(route=route, status=str(status["code"])).inc()

    @staticmethod
    def _bounded(receive: Callable[..., Awaitable[Any]], limit: int) -> Callable[..., Awaitable[Any]]:
        """`receive` that raises a 413 once the body's bytes pass `limit`."""
        seen = 0

        async def bounded() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(limit)
            return message

        return bounded

    async def _send_error(
        self, send: Any, status: int, body: dict[str, Any], route: str, header: tuple[bytes, bytes]
    ) -> None:
        """An error answered here, before the app (a JSON error body, `header` besides its content type)."""
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), header],
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
