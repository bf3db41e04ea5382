"""`EngineFront`: the asyncio side of a served engine, whatever runs its loop (a thread of this process,
`AsyncEngine`, or an engine process, `ProcessEngine`).

    asyncio side                          engine loop (engine/engine_loop.py)
    generate() --_submit("add")------>    add_request / abort
                                          step()  (schedule -> run -> update -> emit)
    per-request DeltaCollector <-------   one step's deltas, via call_soon_threadsafe (merged while unread)

A consumer that stops iterating (client disconnected, task cancelled) aborts its request, so its blocks
and state slot are freed at the next step. `healthy` turns False and `fatal` True when the loop stops for
good; `on_fatal(reason)` is then called once, so the server can exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from hyserve.engine.delta_collector import DEFAULT_PENDING_LIMIT_BYTES, DeltaCollector
from hyserve.engine.engine_loop import AddRequest, error_delta
from hyserve.engine.outputs import StreamDelta
from hyserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("hyserve")


def _put_all(items: list[tuple[DeltaCollector, StreamDelta]]) -> None:
    for c, d in items:
        c.put(d)


class EngineFront:
    """Streams by request id and the engine's last published stats. A subclass sets `model_name`,
    `tokenizer`, `max_seq_len` and `max_batch_size`, and implements `_submit`, `validate_request`,
    `capacity_report`, `start`, `shutdown`, `reset_stats` and `close`."""

    model_name: str
    tokenizer: Any
    max_seq_len: int
    max_batch_size: int

    def __init__(self, max_pending_stream_bytes: int = DEFAULT_PENDING_LIMIT_BYTES) -> None:
        """`max_pending_stream_bytes`: the output a stream's reader may leave unread (merged into one delta,
        engine/delta_collector.py) before its request is aborted and counted in `slow_reader_aborts_total`."""
        self.max_pending_stream_bytes = max_pending_stream_bytes
        self.slow_reader_aborts = 0
        # request id -> (the reader's loop, its collector, the number of its "add" in submission order)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaCollector, int]] = {}
        self._adds_sent = 0
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}
        self.healthy = True
        self.dead_reason: str | None = None
        self.fatal = False  # the loop stopped for good: the process should exit non-zero
        self.on_fatal: Callable[[str], None] | None = None  # called once when it does

    # ---- what a subclass provides ------------------------------------------------------------------
    def _submit(self, kind: str, arg: Any) -> None:
        raise NotImplementedError

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Raise RequestRejected for a request that must not enter the engine."""
        raise NotImplementedError

    # ---- API --------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        with self._lock:
            s = dict(self._stats)
        s["healthy"] = 1 if self.healthy else 0
        s["slow_reader_aborts_total"] = self.slow_reader_aborts
        return s

    def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    def open_stream_ids(self) -> list[str]:
        with self._lock:
            return list(self._streams)

    def _abort_open_streams(self, *, wait: bool) -> None:
        """Shutting down: abort every open stream and, with `wait`, give the loop up to a second to send
        their final deltas to the clients."""
        for rid in self.open_stream_ids():
            self.abort(rid)
        for _ in range(50 if wait else 0):
            if not self.open_stream_ids():
                break
            time.sleep(0.02)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas. Raises RequestRejected / ValueError before the first yield. `priority`:
        lower is served earlier under scheduling_policy "priority" (0 only under "fcfs")."""
        if not self.healthy:
            raise RuntimeError(f"the engine is not running: {self.dead_reason}")
        self.validate_request(prompt_token_ids, params, priority)
        loop = asyncio.get_running_loop()
        c = DeltaCollector(request_id, self.max_pending_stream_bytes)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._adds_sent += 1
            self._streams[request_id] = (loop, c, self._adds_sent)
            # submitted under the lock: adds reach the loop in the order they were numbered
            self._submit("add", AddRequest(request_id, list(prompt_token_ids), params, prompt, priority))
        finished = False
        try:
            while True:
                d = await c.get()  # everything since the last read, merged
                if c.overflowed:  # the reader fell too far behind: end it here, and in the engine
                    self.slow_reader_aborts += 1
                    with self._lock:
                        self._streams.pop(request_id, None)
                    self.abort(request_id)
                if d.finished:
                    finished = True
                yield d
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # ---- called from the loop's side --------------------------------------------------------------
    def _emit(self, stats: dict[str, float] | None, deltas: list[StreamDelta]) -> None:
        """The engine loop's output (EngineLoop's `emit`): the stats first, so a client that saw its last
        token sees it counted."""
        if stats is not None:
            with self._lock:
                self._stats = stats
        if deltas:
            self._deliver_all(deltas)

    def _deliver_all(self, deltas: list[StreamDelta]) -> None:
        """Hand one step's deltas to their streams: one wake-up per event loop per step (each
        call_soon_threadsafe writes to the loop's self-pipe), not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[DeltaCollector, StreamDelta]]] = {}
        with self._lock:
            for d in deltas:
                entry = self._streams.get(d.request_id)
                if d.finished:
                    self._streams.pop(d.request_id, None)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], d))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the client's loop is gone
                pass

    def _after_reset(self, reason: str, adds_taken: int) -> None:
        """The loop survived a failure and ended its own requests: end the streams it had taken whose final
        delta was lost with the failed step (neither in the engine nor on their way in)."""
        with self._lock:
            orphans = [rid for rid, (_, _, n) in self._streams.items() if n <= adds_taken]
        self._deliver_all([error_delta(rid, reason) for rid in orphans])

    def _die(self, reason: str) -> None:
        """Stopped for good: unhealthy, `on_fatal` told (once), then every stream ended with an error."""
        if self.fatal:
            return
        self.dead_reason = reason
        self.healthy = False
        self.fatal = True
        if self.on_fatal is not None:
            try:
                self.on_fatal(reason)
            except Exception:
                logger.exception("on_fatal callback failed")
        self._deliver_all([error_delta(rid, f"engine failure: {reason}") for rid in self.open_stream_ids()])


__all__ = ["EngineFront"]
