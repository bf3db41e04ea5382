"""`AsyncEngine`: the engine loop on a background thread, with an asyncio streaming API for the server.

    asyncio side                          engine thread
    generate() --submit--> inbox  ----->  add_request / abort
                                          step()  (schedule -> run -> update -> emit)
    per-request DeltaCollector <-------   deltas, via loop.call_soon_threadsafe (merged while unread)

A consumer that stops iterating (client disconnected, task cancelled) aborts its request, so its blocks
and state slot are freed at the next step.

Supervision: a step that raises fails only its culprit inside `LLMEngine.step()` (engine/isolation.py); an
exception that escapes it (scheduler, output processing) ends every in-flight request with an error, resets
the engine's books and serving goes on. The `engine_failure_limit`-th such failure within
`engine_failure_window_s` seconds (or any BaseException, e.g. a lost rank) stops the loop for good:
`healthy` turns False, `fatal` True and `on_fatal(reason)` is called, so the server exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from hyserve.config import EngineConfig
from hyserve.engine.delta_collector import DEFAULT_PENDING_LIMIT_BYTES, DeltaCollector
from hyserve.engine.lifecycle.startup import start_engine
from hyserve.engine.outputs import StreamDelta
from hyserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("hyserve")


def _error_delta(request_id: str, error: str, *, num_prompt_tokens: int = 0) -> StreamDelta:
    return StreamDelta(
        request_id=request_id,
        token_ids=[],
        text="",
        logprobs=None,
        finished=True,
        finish_reason="error",
        num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=0,
        num_output_tokens=0,
        error=error,
    )


def _put_all(items: list[tuple[DeltaCollector, StreamDelta]]) -> None:
    for c, d in items:
        c.put(d)


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        log: Callable[[str], None] | None = None,
        max_pending_stream_bytes: int = DEFAULT_PENDING_LIMIT_BYTES,
    ) -> None:
        """`max_pending_stream_bytes`: the output a stream's reader may leave unread (merged into one delta,
        engine/delta_collector.py) before its request is aborted and counted in `slow_reader_aborts_total`."""
        self.max_pending_stream_bytes = max_pending_stream_bytes
        self.slow_reader_aborts = 0
        self.engine = start_engine(config, log=log)
        self.config = config
        self.model_name = self.engine.loaded.name
        self.tokenizer = self.engine.tokenizer
        self.max_seq_len = self.engine.max_seq_len
        self.max_batch_size: int = self.engine.scheduler.max_batch_size  # as sized at start-up
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, DeltaCollector]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stats: dict[str, float] = dict(self.engine.stats())
        self.healthy = True
        self.dead_reason: str | None = None
        self.fatal = False  # the loop stopped for good: the process should exit non-zero
        self.on_fatal: Callable[[str], None] | None = None  # called once, on the engine thread, when it does
        self._failures: deque[float] = deque()  # monotonic times of the failures outside a step
        self._adding: set[str] = set()  # streams whose "add" the engine thread has not taken yet

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hyserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, *, abort_inflight: bool = True) -> None:
        if abort_inflight:
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self.abort(rid)
            # let the loop process the aborts so clients get their final delta
            self._wake.set()
            if self._thread is not None:
                for _ in range(50):
                    with self._lock:
                        if not self._streams:
                            break
                    self._stop.wait(0.02)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    # ---- API --------------------------------------------------------------------------------------
    def capacity_report(self) -> str:
        return self.engine.capacity_report()

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        self.engine.validate_request(prompt_token_ids, params, priority)

    def stats(self) -> dict[str, float]:
        with self._lock:
            s = dict(self._stats)
        s["healthy"] = 1 if self.healthy else 0
        s["slow_reader_aborts_total"] = self.slow_reader_aborts
        return s

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def reset_stats(self, timeout: float = 60.0) -> None:
        """Forget everything served so far (counters, prefix cache, the sampler's stream), on the engine
        thread once it is idle; used after the server's own warm-up requests. Blocks until done."""
        done = threading.Event()
        self._inbox.put(("reset", done))
        self._wake.set()
        if self._thread is None:
            self._drain_inbox()
        elif not done.wait(timeout):
            raise TimeoutError(f"the engine did not reset within {timeout:.0f}s")

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
        self.engine.validate_request(prompt_token_ids, params, priority)
        loop = asyncio.get_running_loop()
        c = DeltaCollector(request_id, self.max_pending_stream_bytes)
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = (loop, c)
            self._adding.add(request_id)
        self._inbox.put(("add", (request_id, list(prompt_token_ids), params, prompt, priority)))
        self._wake.set()
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

    # ---- engine thread ----------------------------------------------------------------------------
    def _deliver(self, d: StreamDelta) -> None:
        self._deliver_all([d])

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

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                rid, ids, params, prompt, priority = arg
                with self._lock:
                    self._adding.discard(rid)
                try:
                    self.engine.add_request(rid, ids, params, prompt=prompt, priority=priority)
                except Exception as e:  # validated already; a race (e.g. duplicate id) fails just this one
                    self._deliver(_error_delta(rid, str(e), num_prompt_tokens=len(ids)))
            elif kind == "abort":
                self.engine.abort(arg)
            elif kind == "reset":
                if self.engine.has_unfinished():  # not idle yet: try again after the next step
                    self._inbox.put((kind, arg))
                    return
                self.engine.reset_after_warmup()
                self._publish_stats()
                arg.set()

    def _run(self) -> None:
        while True:
            try:
                self._serve()
                return
            except Exception as e:  # escaped the step's guards: reset and serve on, up to the bound
                logger.exception("engine loop failed")
                if not self._restart(e):
                    return
            except BaseException as e:  # a lost rank (RankLost), an interpreter exit: the loop cannot go on
                logger.exception("engine loop died")
                self._die(f"{type(e).__name__}: {e}")
                return

    def _serve(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._drain_inbox()
            if not eng.has_unfinished():
                self._publish_stats()
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            deltas = eng.step()
            self._publish_stats()  # before the deltas: a client that saw its last token sees it counted
            self._deliver_all(deltas)

    def _restart(self, e: Exception) -> bool:
        """After a failure outside a step: end every in-flight request with an error and reset the engine;
        False (the loop stopped for good) at the engine_failure_limit-th failure within the window."""
        reason = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        self._failures.append(now)
        while now - self._failures[0] > self.config.engine_failure_window_s:
            self._failures.popleft()
        if len(self._failures) >= self.config.engine_failure_limit:
            self._die(
                f"{reason} ({len(self._failures)} engine failures within "
                f"{self.config.engine_failure_window_s:g}s)"
            )
            return False
        try:
            deltas = self.engine.reset_after_failure(f"engine failure, the engine was reset: {reason}")
        except Exception as e2:
            logger.exception("engine reset failed")
            self._die(f"{reason}; then the reset failed: {type(e2).__name__}: {e2}")
            return False
        self._deliver_all(deltas)
        # a stream whose final delta was lost with the failed step: neither in the engine nor on its way in
        with self._lock:
            orphans = [rid for rid in self._streams if rid not in self._adding]
        self._deliver_all(
            [_error_delta(rid, f"engine failure, the engine was reset: {reason}") for rid in orphans]
        )
        self._publish_stats()
        logger.warning(
            "engine reset after a failure (%d within %gs; the limit is %d)",
            len(self._failures),
            self.config.engine_failure_window_s,
            self.config.engine_failure_limit,
        )
        return True

    def _die(self, reason: str) -> None:
        """Stop for good: unhealthy, `on_fatal` told, then every stream ended with an error."""
        self.dead_reason = reason
        self.healthy = False
        self.fatal = True
        if self.on_fatal is not None:
            try:
                self.on_fatal(reason)
            except Exception:
                logger.exception("on_fatal callback failed")
        with self._lock:
            ids = list(self._streams)
        self._deliver_all([_error_delta(rid, f"engine failure: {reason}") for rid in ids])

    def _publish_stats(self) -> None:
        s = self.engine.stats()
        with self._lock:
            self._stats = s
