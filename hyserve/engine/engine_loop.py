"""`EngineLoop`: the supervised step loop over an `LLMEngine`, on whichever thread runs it (a thread of the
server process, `AsyncEngine`; the main thread of an engine process, `engine_process.py`).

    inbox ("add" / "abort" / "reset")  ->  add_request / abort / reset_after_warmup
    while work: step() -> emit(stats, deltas)

Supervision: a step that raises fails only its culprit inside `LLMEngine.step()` (engine/isolation.py); an
exception that escapes it (scheduler, output processing) ends every in-flight request with an error, resets
the engine's books and serving goes on (`on_reset` then tells the front which streams the failed step may
have left without a final delta). The `engine_failure_limit`-th such failure within
`engine_failure_window_s` seconds (or any BaseException, e.g. a lost rank) stops the loop for good
(`on_die(reason)`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hyserve.config import EngineConfig
from hyserve.engine.engine import LLMEngine
from hyserve.engine.outputs import StreamDelta
from hyserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("hyserve")


@dataclass(frozen=True)
class AddRequest:
    """An "add" of the inbox: the request as `LLMEngine.add_request` takes it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int


def error_delta(request_id: str, error: str, *, num_prompt_tokens: int = 0) -> StreamDelta:
    """A final delta that ends a request with `error`."""
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


class EngineLoop:
    """Runs `engine` until `stop()`: what arrives in the inbox is applied between steps; each step's deltas go
    to `emit` with the stats after it (a client that saw its last token sees it counted); while idle the
    stats go alone (no deltas), and a delta outside a step goes without stats (None).

    `on_reset(reason, adds_taken)`: after a failure outside a step was survived and the engine's own
    requests were ended (their deltas delivered); `adds_taken` counts the "add"s taken from the inbox so far,
    so the front can end the streams whose final delta was lost with the failed step. `on_die(reason)`: the
    loop stopped for good."""

    def __init__(
        self,
        engine: LLMEngine,
        config: EngineConfig,
        *,
        emit: Callable[[dict[str, float] | None, list[StreamDelta]], None],
        on_reset: Callable[[str, int], None],
        on_die: Callable[[str], None],
    ) -> None:
        self.engine = engine
        self.config = config
        self._emit = emit
        self._on_reset = on_reset
        self._on_die = on_die
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.wake = threading.Event()
        self._stop = threading.Event()
        self._failures: deque[float] = deque()  # monotonic times of the failures outside a step
        self.adds_taken = 0

    def submit(self, kind: str, arg: Any) -> None:
        """Queue "add" (an AddRequest), "abort" (a request id) or "reset" (a callable, called once the engine
        was idle and reset) for the loop."""
        self.inbox.put((kind, arg))
        self.wake.set()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def publish_stats(self) -> None:
        self._emit(self.engine.stats(), [])

    def drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.adds_taken += 1
                try:
                    self.engine.add_request(
                        arg.request_id,
                        arg.prompt_token_ids,
                        arg.params,
                        prompt=arg.prompt,
                        priority=arg.priority,
                    )
                except Exception as e:  # validated already; a race (e.g. duplicate id) fails just this one
                    n = len(arg.prompt_token_ids)
                    self._emit(None, [error_delta(arg.request_id, str(e), num_prompt_tokens=n)])
            elif kind == "abort":
                self.engine.abort(arg)
            elif kind == "reset":
                if self.engine.has_unfinished():  # not idle yet: try again after the next step
                    self.inbox.put((kind, arg))
                    return
                self.engine.reset_after_warmup()
                self.publish_stats()
                arg()

    def run(self) -> None:
        """Serve until `stop()` or a failure that ends the loop for good."""
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
                self._on_die(f"{type(e).__name__}: {e}")
                return

    def _serve(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self.drain_inbox()
            if not eng.has_unfinished():
                self.publish_stats()
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            deltas = eng.step()
            self._emit(eng.stats(), deltas)

    def _restart(self, e: Exception) -> bool:
        """After a failure outside a step: end every in-flight request with an error and reset the engine;
        False (the loop stopped for good) at the engine_failure_limit-th failure within the window."""
        reason = f"{type(e).__name__}: {e}"
        now = time.monotonic()
        self._failures.append(now)
        while now - self._failures[0] > self.config.engine_failure_window_s:
            self._failures.popleft()
        if len(self._failures) >= self.config.engine_failure_limit:
            self._on_die(
                f"{reason} ({len(self._failures)} engine failures within "
                f"{self.config.engine_failure_window_s:g}s)"
            )
            return False
        try:
            deltas = self.engine.reset_after_failure(f"engine failure, the engine was reset: {reason}")
        except Exception as e2:
            logger.exception("engine reset failed")
            self._on_die(f"{reason}; then the reset failed: {type(e2).__name__}: {e2}")
            return False
        self._emit(None, deltas)
        self._on_reset(f"engine failure, the engine was reset: {reason}", self.adds_taken)
        self.publish_stats()
        logger.warning(
            "engine reset after a failure (%d within %gs; the limit is %d)",
            len(self._failures),
            self.config.engine_failure_window_s,
            self.config.engine_failure_limit,
        )
        return True


__all__ = ["AddRequest", "EngineLoop", "error_delta"]
