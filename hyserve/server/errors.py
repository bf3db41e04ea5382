"""OpenAI-shaped error bodies and the exception handlers that produce them.

Every error the server returns, whatever raised it (our own checks, pydantic validation, Starlette's
404/405, an engine failure), has the body the `openai` client parses into `APIStatusError`:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

Clients switching from vLLM / trtllm-serve / the OpenAI API rely on that shape to show the message, so
the message names the limit and the request's value rather than just "bad request".

A 500 never carries internal exception text: `internal_error` logs the detail under a fresh error id
and the client gets a generic message with that id (also in `error.error_id`), to quote in a report.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("hyserve.server")

# HTTP status -> OpenAI error `type` (the OpenAI API's own names where it has one).
_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    """An error with an HTTP status that the handlers turn into an OpenAI error body."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        error_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.err_type = err_type or _TYPES.get(status_code, "invalid_request_error")
        self.error_id = error_id

    def body(self) -> dict[str, Any]:
        body = error_body(self.message, err_type=self.err_type, param=self.param, code=self.code)
        if self.error_id is not None:
            body["error"]["error_id"] = self.error_id
        return body

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status_code == 401 else None
        return JSONResponse(self.body(), status_code=self.status_code, headers=headers)


def error_body(
    message: str,
    *,
    err_type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def internal_error(what: str, detail: str | BaseException, *, code: str | None = None) -> APIError:
    """A 500 for the client: `what` happened (a generic phrase, e.g. "the engine failed while running this
    request"), with a fresh error id; `detail` (an exception, with its traceback, or the engine's error
    text) goes to the server log under that id, never into the body."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    if isinstance(detail, BaseException):
        logger.error("error id %s: %s", error_id, what, exc_info=detail)
    else:
        logger.error("error id %s: %s: %s", error_id, what, detail)
    return APIError(
        f"{what} (error id {error_id}: the server log has the detail)",
        status_code=500,
        code=code,
        error_id=error_id,
    )


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status_code=400, param=param, code=code)


def sse_error_event(err: APIError) -> str:
    """The SSE event a stream sends when it fails after the 200 status went out (then `[DONE]`)."""
    payload = err.body()
    payload["error"]["status_code"] = err.status_code
    return f"data: {json.dumps(payload)}\n\n"


def _loc_to_param(loc: tuple[Any, ...] | list[Any]) -> str | None:
    """('body', 'messages', 0, 'content') -> 'messages[0].content' (the field path, as OpenAI writes it)."""
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    # pydantic adds the union member's type name to the location ("str", "list[int]"...): drop those.
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool", "list", "dict")):
            continue
        elif isinstance(p, str) and p.startswith(("function-", "tagged-union", "literal[")):
            continue
        else:
            out += f".{p}" if out else str(p)
    return out or None


def validation_error_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line from pydantic's error list, and the first failing field's path."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    parts: list[str] = []
    first_param: str | None = None
    seen: set[str] = set()
    for e in errors[:6]:
        param = _loc_to_param(e.get("loc", ()))
        if e.get("type") == "json_invalid":
            ctx = e.get("ctx") or {}
            msg = f"request body is not valid JSON: {ctx.get('error', 'parse error')}"
            return msg, None
        if e.get("type") == "missing" and param is None:
            return "request body is required (a JSON object)", None
        if first_param is None:
            first_param = param
        line = f"{param}: {e.get('msg')}" if param else str(e.get("msg"))
        if line not in seen:
            seen.add(line)
            parts.append(line)
    more = len(errors) - 6
    msg = "; ".join(parts) + (f" (and {more} more errors)" if more > 0 else "")
    return msg, first_param


def install_error_handlers(app: FastAPI) -> None:
    """Route every error path through `error_body` so clients always get the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # vLLM answers pydantic errors with 400 (OpenAI does too), not FastAPI's default 422.
        msg, param = validation_error_message(exc)
        return APIError(msg, status_code=400, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        resp = APIError(detail, status_code=exc.status_code).response()
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error("internal server error", exc).response()
