"""The API middleware: the bearer-token check and the per-route request counter, as pure ASGI.

Pure ASGI rather than Starlette's BaseHTTPMiddleware, which breaks the cancellation of streaming
responses (a client that goes away must abort its engine request at once); the key is checked before the
body is even read.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import Any

from hyserve.server.errors import error_body
from hyserve.server.metrics import ServerMetrics

# Routes that need the API key when one is set (health, metrics and version stay open for probes).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_COUNTED_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize", "/health",
     "/version"}
)


class ApiMiddleware:
    """Checks the bearer token of protected routes and counts requests per route and status."""

    def __init__(self, app: Any, *, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        route = path if path in _COUNTED_ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                       else "other")
        if self.api_key and path.startswith(_PROTECTED_PREFIXES) and scope.get("method") != "OPTIONS":
            if not self._authorized(scope):
                body = json.dumps(
                    error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                               err_type="authentication_error", code="invalid_api_key")
                ).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                self.metrics.requests.labels(route=route, status="401").inc()
                return
        status = {"code": 500}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(route=route, status=str(status["code"])).inc()

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
