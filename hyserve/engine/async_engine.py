"""`AsyncEngine`: the engine loop (engine/engine_loop.py) on a background thread of this process, with the
asyncio streaming API of `EngineFront` (engine/engine_front.py) for the server. `ProcessEngine`
(engine/engine_process.py) is the same API over an engine in its own process."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from hyserve.config import EngineConfig
from hyserve.engine.delta_collector import DEFAULT_PENDING_LIMIT_BYTES
from hyserve.engine.engine_front import EngineFront
from hyserve.engine.engine_loop import EngineLoop
from hyserve.engine.lifecycle.startup import start_engine
from hyserve.engine.sampling_params import SamplingParams


class AsyncEngine(EngineFront):
    def __init__(
        self,
        config: EngineConfig,
        *,
        log: Callable[[str], None] | None = None,
        max_pending_stream_bytes: int = DEFAULT_PENDING_LIMIT_BYTES,
    ) -> None:
        super().__init__(max_pending_stream_bytes)
        self.engine = start_engine(config, log=log)
        self.config = config
        self.model_name = self.engine.loaded.name
        self.tokenizer = self.engine.tokenizer
        self.max_seq_len = self.engine.max_seq_len
        self.max_batch_size = self.engine.scheduler.max_batch_size  # as sized at start-up
        self._stats = dict(self.engine.stats())
        self.loop = EngineLoop(
            self.engine,
            config,
            emit=self._emit,
            on_reset=self._after_reset,
            on_die=self._die,
        )
        self._thread: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.loop.run, name="hyserve-engine", daemon=True)
        self._thread.start()

    def shutdown(self, *, abort_inflight: bool = True) -> None:
        if abort_inflight:
            self._abort_open_streams(wait=self._thread is not None)
        self.loop.stop()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def close(self) -> None:
        """After `shutdown`: the other ranks exit (nothing to release on one rank)."""
        self.engine.runner.close()

    # ---- API --------------------------------------------------------------------------------------
    def _submit(self, kind: str, arg: Any) -> None:
        self.loop.submit(kind, arg)

    def capacity_report(self) -> str:
        return self.engine.capacity_report()

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        self.engine.validate_request(prompt_token_ids, params, priority)

    def reset_stats(self, timeout: float = 60.0) -> None:
        """Forget everything served so far (counters, prefix cache, the sampler's stream), on the engine
        thread once it is idle; used after the server's own warm-up requests. Blocks until done."""
        done = threading.Event()
        self.loop.submit("reset", done.set)
        if self._thread is None:
            self.loop.drain_inbox()
        elif not done.wait(timeout):
            raise TimeoutError(f"the engine did not reset within {timeout:.0f}s")


__all__ = ["AsyncEngine"]
