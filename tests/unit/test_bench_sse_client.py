"""The benchmark's lean streaming client (hyserve/bench/sse_client.py) against scripted HTTP responses,
each also read through httpx: both must add up to the same result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import httpx
import pytest

from hyserve.bench.http_client import COMPLETIONS, build_payload, send_streaming, stream_client
from hyserve.bench.metrics import RequestResult
from hyserve.bench.sse_client import LeanClient, serves


def _event(obj: Any) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


EVENTS = [
    _event({"choices": [{"text": "a"}]}),
    _event({"choices": [{"text": ""}]}),
    _event({"choices": [{"text": "b", "finish_reason": "length"}]}),
    _event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 3}}),
    _event("[DONE]"),
]


def _chunked(parts: Sequence[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


def _head(status: int = 200, **fields: str) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in fields.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class _Server:
    """Answers every connection with `pieces`, written one at a time with a short pause between them,
    then closes (or stalls, for the timeout case). Keeps the requests it read."""

    def __init__(self, pieces: Sequence[bytes], stall: bool = False) -> None:
        self.pieces, self.stall = pieces, stall
        self.requests: list[tuple[bytes, bytes]] = []

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await r.readuntil(b"\r\n\r\n")
        n = next(
            int(v)
            for k, _, v in (ln.partition(b":") for ln in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
        self.requests.append((head, await r.readexactly(n)))
        for p in self.pieces:
            w.write(p)
            await w.drain()
            await asyncio.sleep(0.001)
        if self.stall:
            await asyncio.sleep(5)
        w.close()


async def _both(
    pieces: Sequence[bytes], stall: bool = False, timeout: float = 10.0
) -> tuple[RequestResult, ...]:
    srv = _Server(pieces, stall)
    server = await asyncio.start_server(srv.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1/completions"
    payload = build_payload(COMPLETIONS, "m", [1, 2, 3], 3, ignore_eos=True, temperature=0.0)
    out = []
    async with server, httpx.AsyncClient(timeout=httpx.Timeout(timeout)) as http:
        for client in (LeanClient(timeout), http):
            out.append(
                await send_streaming(
                    client,
                    url,
                    payload,
                    kind=COMPLETIONS,
                    prompt_len=3,
                    headers={"Authorization": "Bearer k"},
                )
            )
    head, body = srv.requests[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n") and b"Authorization: Bearer k" in head
    assert json.loads(body) == payload
    return tuple(out)


def _same(a: RequestResult, b: RequestResult) -> None:
    keys = ("ok", "status", "text", "output_tokens", "output_tokens_from_usage", "usage_prompt_tokens")
    assert {k: getattr(a, k) for k in keys} == {k: getattr(b, k) for k in keys}
    assert len(a.itl_s) == len(b.itl_s) and (a.ttft_s is None) == (b.ttft_s is None)


@pytest.mark.parametrize(
    "name,pieces",
    [
        ("one event a chunk", [_head(transfer_encoding="chunked"), _chunked(EVENTS)]),
        # every byte its own read: heads, chunk sizes, CRLFs and events all split at every boundary
        ("byte by byte", [bytes([c]) for c in _head(transfer_encoding="chunked") + _chunked(EVENTS)]),
        # CRLF events, several in one chunk, one split across chunks
        (
            "crlf events across chunks",
            [
                _head(transfer_encoding="chunked"),
                _chunked(
                    [
                        e.replace(b"\n", b"\r\n")
                        for e in (EVENTS[0] + EVENTS[1][:7], EVENTS[1][7:] + EVENTS[2])
                    ]
                )[:-5],
                _chunked([e.replace(b"\n", b"\r\n") for e in EVENTS[3:]]),
            ],
        ),
        ("content-length", [_head(content_length=str(len(b"".join(EVENTS)))), b"".join(EVENTS)]),
        ("close-delimited", [_head(), *EVENTS]),
    ],
)
def test_lean_client_reads_what_httpx_reads(name: str, pieces: list[bytes]) -> None:
    lean, ref = asyncio.run(_both(pieces))
    assert lean.ok, (name, lean.error)
    _same(lean, ref)
    assert lean.text == "ab" and lean.output_tokens == 3 and lean.ttft_s is not None and lean.ttft_s > 0


def test_lean_client_reports_an_error_status_with_the_servers_message() -> None:
    body = json.dumps({"error": {"message": "max_tokens is too large: 99 > 8"}}).encode()
    lean, ref = asyncio.run(_both([_head(400, content_length=str(len(body))), body]))
    assert not lean.ok and lean.status == 400
    assert lean.error == ref.error == "HTTP 400: max_tokens is too large: 99 > 8"


def test_lean_client_ends_at_an_in_band_error() -> None:
    pieces = [
        _head(transfer_encoding="chunked"),
        _chunked([EVENTS[0], _event({"error": {"message": "boom"}})]),
    ]
    lean, ref = asyncio.run(_both(pieces))
    assert not lean.ok and lean.error == ref.error == "stream error: boom"


@pytest.mark.parametrize(
    "pieces,stall",
    [
        # the connection closes in the middle of a chunk
        ([_head(transfer_encoding="chunked"), _chunked(EVENTS)[:40]], False),
        # a body shorter than its Content-Length
        ([_head(content_length="5000"), EVENTS[0]], False),
        # a chunk size that is not hexadecimal
        ([_head(transfer_encoding="chunked"), b"zz\r\n" + EVENTS[0]], False),
    ],
)
def test_lean_client_fails_a_broken_response(pieces: list[bytes], stall: bool) -> None:
    lean, ref = asyncio.run(_both(pieces, stall))
    assert not lean.ok and not ref.ok
    assert lean.error is not None and lean.error.startswith("RemoteProtocolError")


def test_lean_client_times_out_a_stalled_stream() -> None:
    lean, ref = asyncio.run(_both([_head(transfer_encoding="chunked"), _chunked(EVENTS[:1])[:-5]], True, 0.3))
    assert (lean.ok, lean.error) == (False, "ReadTimeout")
    assert not ref.ok and ref.error is not None and "Timeout" in ref.error
    assert lean.e2el_s is not None and 0.25 < lean.e2el_s < 3.0


def test_lean_client_reports_a_refused_connection() -> None:
    async def go() -> RequestResult:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        payload = build_payload(COMPLETIONS, "m", [1], 1, ignore_eos=True, temperature=0.0)
        url = f"http://127.0.0.1:{port}/v1/completions"
        return await send_streaming(LeanClient(5.0), url, payload, kind=COMPLETIONS, prompt_len=1)

    r = asyncio.run(go())
    assert not r.ok and r.error is not None and r.error.startswith("ConnectError")


def test_streams_go_lean_only_over_plain_http_without_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(var, raising=False)
    http = httpx.AsyncClient()
    assert serves("http://127.0.0.1:8000/v1/completions")
    assert isinstance(stream_client("http://localhost:8000/v1/completions", http, 60.0), LeanClient)
    assert not serves("https://api.example.com/v1/completions")
    assert not serves("http://user:secret@gpu-box:8000/v1/completions")
    assert serves("http://[::1]:8000/v1/completions")
    assert stream_client("https://api.example.com/v1/completions", http, 60.0) is http
    monkeypatch.setenv("http_proxy", "http://proxy.internal:3128")
    assert not serves("http://gpu-box:8000/v1/completions")
    monkeypatch.setenv("no_proxy", "gpu-box")
    assert serves("http://gpu-box:8000/v1/completions")
