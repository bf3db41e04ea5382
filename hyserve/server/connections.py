"""The server's HTTP connections: uvicorn's protocol with a deadline on a request's headers.

uvicorn closes a keep-alive connection that stays idle, but puts no bound on how long a request's headers
may take to arrive: a client that opens connections and sends a header line now and then holds each one for
ever (and with it a place under the connection cap). Here a connection must deliver a request's headers
within `timeout` seconds of opening, or of the previous response: one that sent part of a request by then
is answered 408 and closed, one that sent nothing is closed (as an idle keep-alive connection is). The
body's deadline is the middleware's (middleware.py), counted from the headers.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hyserve.server.errors import error_body
from hyserve.server.middleware import read_timed_out


def _timeout_reply(timeout: float) -> bytes:
    body = json.dumps(
        error_body(read_timed_out(timeout), err_type="invalid_request_error", code="request_timeout")
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


def header_deadline_protocol(timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools or h11, as its `auto` picks) with the headers' deadline."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    base: Any = AutoHTTPProtocol
    reply = _timeout_reply(timeout)

    class HeaderDeadlineProtocol(base):  # type: ignore[misc]
        _header_timer: asyncio.TimerHandle | None = None
        _started = False  # bytes of the next request arrived since the timer was armed

        def _arm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._started = False
            self._header_timer = self.loop.call_later(timeout, self._headers_overdue)

        def _headers_overdue(self) -> None:
            self._header_timer = None
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return  # a request's headers came; its body has its own deadline
            if not self.transport.is_closing():
                if self._started:
                    self.transport.write(reply)
                self.transport.close()

        def data_received(self, data: bytes) -> None:
            self._started = True
            super().data_received(data)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)

    return HeaderDeadlineProtocol
