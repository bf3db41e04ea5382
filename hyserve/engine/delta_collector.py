"""One request's undelivered output, merged: how a stream's deltas cross from the engine thread to its reader.

The engine thread hands each step's delta to the request's collector (on the reader's event loop). A reader
that keeps up takes one delta per step, as before; one that falls behind (a slow client, a busy event loop)
finds everything produced since its last read merged into one delta, so it builds one chunk per read instead
of one per token, and what waits for it is one growing delta instead of a queue of them. That backlog is
bounded: past `limit_bytes` the request is ended with an error and its collector says so (`overflowed`), so
the caller aborts it in the engine and counts it.

    engine thread                 event loop of the reader
    step t:   delta(t)  --put-->  pending = delta(t)                 reader busy sending the last chunk
    step t+1: delta(t+1) -put-->  pending = delta(t) + delta(t+1)
                                  get() -> the merged delta            one chunk for both steps
"""

from __future__ import annotations

import asyncio
import dataclasses

from hyserve.engine.outputs import StreamDelta

# pending output per request before a reader that does not keep up is cut off (vLLM-style coalescing keeps
# a reader that is merely slower than the engine far below it)
DEFAULT_PENDING_LIMIT_BYTES = 8 * 2**20
# rough bytes of one token's share of a delta: its id, and a logprob entry with its alternatives
_TOKEN_BYTES = 8
_LOGPROB_BYTES = 32


def delta_bytes(d: StreamDelta) -> int:
    """An estimate of what holding `d` costs: its text, ids and logprob entries (with their alternatives)."""
    n = len(d.text) + _TOKEN_BYTES * len(d.token_ids)
    if d.logprobs:
        n += sum(_LOGPROB_BYTES * (1 + len(lp.top)) for lp in d.logprobs)
    return n


def merge_deltas(a: StreamDelta, b: StreamDelta) -> StreamDelta:
    """`a` then `b` of the same request as one delta: tokens, text and logprobs joined; the counts, the
    finish and the error are `b`'s (they are running totals or come once at the end); prompt logprobs come
    with whichever carried them."""
    logprobs = (
        None if a.logprobs is None and b.logprobs is None else [*(a.logprobs or []), *(b.logprobs or [])]
    )
    return dataclasses.replace(
        b,
        token_ids=[*a.token_ids, *b.token_ids],
        text=a.text + b.text,
        logprobs=logprobs,
        prompt_logprobs=a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
    )


class DeltaCollector:
    """The merged output of one request not yet read. `put` and `get` run on the reader's event loop (the
    engine thread reaches `put` through call_soon_threadsafe)."""

    def __init__(self, request_id: str, limit_bytes: int = DEFAULT_PENDING_LIMIT_BYTES) -> None:
        self.request_id = request_id
        self.limit_bytes = limit_bytes
        self.pending_bytes = 0
        self.overflowed = False
        self._pending: StreamDelta | None = None
        self._ready = asyncio.Event()

    def put(self, d: StreamDelta) -> None:
        if self.overflowed:
            return  # the request was ended already; what the engine still sends is dropped
        self._pending = d if self._pending is None else merge_deltas(self._pending, d)
        self.pending_bytes += delta_bytes(d)
        if self.pending_bytes > self.limit_bytes and not d.finished:
            self.overflowed = True
            self._pending = dataclasses.replace(
                self._pending,
                token_ids=[],
                text="",
                logprobs=None,
                prompt_logprobs=None,
                finished=True,
                finish_reason="error",
                error=(
                    f"the client read this stream too slowly: {self.pending_bytes:,} bytes of output were "
                    f"waiting for it (the limit is {self.limit_bytes:,}); the request was aborted"
                ),
            )
        self._ready.set()

    async def get(self) -> StreamDelta:
        """Everything produced since the last get, merged (waits until there is something)."""
        await self._ready.wait()
        d = self._pending
        assert d is not None  # set together with the event
        self._pending = None
        self.pending_bytes = 0
        self._ready.clear()
        return d


__all__ = ["DEFAULT_PENDING_LIMIT_BYTES", "DeltaCollector", "delta_bytes", "merge_deltas"]
