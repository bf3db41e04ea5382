"""Engine errors that callers are expected to handle."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine refuses before running anything (too long, can never fit the pools).

    The message names the limit and the request's size; the server maps it to HTTP 400."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "request_too_large") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class JitAfterReadyError(RuntimeError):
    """With strict_warmup: a step made Triton compile a kernel variant after the engine reported ready."""
