"""A lean HTTP/1.1 client for one streamed POST over plain `http://`, for the benchmark's hot path.

At 1,024 streams a server emits ~20,000 server-sent events a second, and the client must take each one as
it comes or its own lag shows up as the server's latency (and, through the concurrency limit, as
burstier arrivals). httpx spends ~100 us of interpreter time on every event read (h11's events, anyio's
cancel scopes, line iterators); this client is an asyncio `Protocol` that parses the response as bytes
arrive and hands each event to its sink from `data_received` itself, timestamped there, so an event costs
a bytes search and the sink's JSON parse.

What it speaks: one request per connection (`Connection: close`), a response framed by chunked transfer
encoding, Content-Length or the connection's close, events separated by a blank line (LF or CRLF), `data:`
lines joined as the SSE specification says, `[DONE]` ending the stream. A read that waits longer than the
read timeout, a connection that closes mid-body, a malformed head or chunk size and a connect failure each
end the request with an error; a status other than 200 hands the sink `error_message(status, body)`.
HTTPS and proxies are httpx's (`serves` says which URLs this client takes).
"""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Callable
from typing import Any, Protocol
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
MAX_ERROR_BODY_BYTES = 1 << 20


class EventSink(Protocol):
    """Where a response goes: its status, then each event's data (False: stop reading); or the body of a
    response whose status is not 200; or an error of the connection or the framing."""

    def status(self, code: int) -> None: ...

    def event(self, data: str, now: float) -> bool: ...

    def refused(self, code: int, body: bytes) -> None: ...

    def error(self, message: str) -> None: ...


def serves(url: str) -> bool:
    """Whether this client takes `url`: plain http without credentials in it, and no proxy configured for
    it (the standard library's proxy settings, which httpx honours too)."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.username is not None:
        return False  # https, or credentials in the URL (httpx sends them as basic auth)
    proxies = urllib.request.getproxies()
    if not (proxies.get("http") or proxies.get("all")):
        return True
    return bool(urllib.request.proxy_bypass(parts.hostname))


class _Stream(asyncio.Protocol):
    """One response: head, then the body in its framing, then events."""

    def __init__(self, sink: EventSink, clock: Callable[[], float], done: asyncio.Future[None]) -> None:
        self.sink, self.clock, self.done = sink, clock, done
        self.loop = done.get_loop()
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()  # unparsed response bytes
        self.sse = bytearray()  # body bytes not yet split into events
        self.head = True
        self.code = 0
        self.chunked = False
        self.left: int | None = None  # Content-Length bytes still to come (None: not length-framed)
        self.chunk_left = 0  # bytes of the current chunk still to come
        self.chunk_crlf = False  # the CRLF after a chunk's data is due
        self.err_body = bytearray()
        self.last_read = 0.0  # the loop's time of the latest read (the read-timeout watchdog's mark)
        self.timer: asyncio.TimerHandle | None = None  # the watchdog's next check

    # ---- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        now = self.clock()
        self.last_read = self.loop.time()
        self.buf += data
        try:
            if self.head and not self._read_head():
                return
            self._read_body(now)
        except ValueError as e:
            self._fail(f"RemoteProtocolError: {e}")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if not self.head and not self.chunked and self.left is None:  # close-delimited: the end
            self._end()
        else:
            why = f": {exc}" if exc else ""
            self._fail(
                f"RemoteProtocolError: peer closed connection without sending complete message body{why}"
            )

    # ---- parsing --------------------------------------------------------------------------------
    def _read_head(self) -> bool:
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buf) > MAX_HEAD_BYTES:
                raise ValueError(f"response head longer than {MAX_HEAD_BYTES} bytes")
            return False
        lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        status = lines[0].split(" ", 2)
        if len(status) < 2 or not status[0].startswith("HTTP/1.") or not status[1].isdigit():
            raise ValueError(f"bad status line {lines[0][:100]!r}")
        self.code = int(status[1])
        fields: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise ValueError(f"bad header line {line[:100]!r}")
            fields[name.strip().lower()] = value.strip()
        if "chunked" in fields.get("transfer-encoding", "").lower():
            self.chunked = True
        elif "content-length" in fields:
            self.left = int(fields["content-length"])
        self.head = False
        self.sink.status(self.code)
        return True

    def _read_body(self, now: float) -> None:
        buf = self.buf
        if not self.chunked:
            take = len(buf) if self.left is None else min(self.left, len(buf))
            self._feed(bytes(buf[:take]), now)
            del buf[:take]
            if self.left is not None:
                self.left -= take
                if self.left == 0:
                    self._end()
            return
        while buf and not self.done.done():
            if self.chunk_crlf:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise ValueError("chunk data not followed by CRLF")
                del buf[:2]
                self.chunk_crlf = False
            elif self.chunk_left:
                take = min(self.chunk_left, len(buf))
                self._feed(bytes(buf[:take]), now)
                del buf[:take]
                self.chunk_left -= take
                self.chunk_crlf = self.chunk_left == 0
            else:
                eol = buf.find(b"\r\n")
                if eol < 0:
                    if len(buf) > 1024:
                        raise ValueError("chunk size line longer than 1024 bytes")
                    return
                size = int(bytes(buf[:eol]).split(b";", 1)[0].strip() or b"x", 16)
                del buf[: eol + 2]
                if size == 0:  # the last chunk (trailers, if any, are not read)
                    self._end()
                    return
                self.chunk_left = size

    def _feed(self, data: bytes, now: float) -> None:
        """Body bytes: kept whole for an error status, else split into events."""
        if self.code != 200:
            room = MAX_ERROR_BODY_BYTES - len(self.err_body)
            self.err_body += data[: max(0, room)]
            return
        sse = self.sse
        sse += data
        if b"\r" in sse:
            self.sse = sse = bytearray(sse.replace(b"\r\n", b"\n"))
        while not self.done.done():
            cut = sse.find(b"\n\n")
            if cut < 0:
                return
            event = bytes(sse[:cut])
            del sse[: cut + 2]
            self._event(event, now)

    def _event(self, event: bytes, now: float) -> None:
        data = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
        if not data:  # a comment or a field other than data
            return
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            self._end()
        elif not self.sink.event(payload.decode(errors="replace"), now):
            self._end()

    # ---- the end --------------------------------------------------------------------------------
    def _end(self) -> None:
        if self.done.done():
            return
        if self.code != 200:
            self.sink.refused(self.code, bytes(self.err_body))
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.close()

    def _fail(self, message: str) -> None:
        if self.done.done():
            return
        self.sink.error(message)
        self.done.set_result(None)
        if self.transport is not None:
            self.transport.abort()


class LeanClient:
    """Streams POSTs to plain-http servers (see the module docstring); one connection per request.
    `read_timeout_s`: the longest wait for the next bytes of a response, as httpx's read timeout."""

    def __init__(self, read_timeout_s: float, connect_timeout_s: float = 30.0) -> None:
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = connect_timeout_s

    async def post_sse(
        self,
        url: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        sink: EventSink,
        clock: Callable[[], float],
    ) -> None:
        parts = urlsplit(url)
        host, port = parts.hostname or "", parts.port or 80
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        body = json.dumps(payload, separators=(",", ":")).encode()
        fields = {
            "Host": parts.netloc,
            "User-Agent": "hyserve-bench",
            "Accept": "text/event-stream",
            "Content-Type": "application/json",
            "Content-Length": str(len(body)),
            "Connection": "close",
            **headers,
        }
        head = f"POST {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        proto = _Stream(sink, clock, done)
        try:
            transport, _ = await asyncio.wait_for(
                loop.create_connection(lambda: proto, host, port), self.connect_timeout_s
            )
        except OSError as e:  # TimeoutError (wait_for's) is one too
            kind = "ConnectTimeout" if isinstance(e, TimeoutError) else "ConnectError"
            sink.error(f"{kind}: {e}" if str(e) else kind)
            return
        proto.last_read = loop.time()
        transport.write(head.encode("latin-1") + body)
        proto.timer = loop.call_later(self.read_timeout_s, self._watch, proto)
        try:
            await asyncio.shield(done)
        except asyncio.CancelledError:
            transport.abort()
            raise
        finally:
            if proto.timer is not None:
                proto.timer.cancel()

    def _watch(self, proto: _Stream) -> None:
        """The read timeout: re-armed for the time left since the latest read, or the request fails."""
        if proto.done.done():
            return
        idle = proto.loop.time() - proto.last_read
        if idle >= self.read_timeout_s:
            proto._fail("ReadTimeout")
            return
        proto.timer = proto.loop.call_later(self.read_timeout_s - idle, self._watch, proto)
