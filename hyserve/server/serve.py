"""`hyserve serve`: build the engine (printing progress and the capacity report), then run uvicorn.

Start-up order matters for users: the config is validated before anything heavy happens (a typo in
the YAML fails in a second, not after loading weights), the engine loads and warms up *before* the
port opens (so `/health` answering means ready), and the capacity report is on screen before the first
request. Just before the port opens, everything alive is moved out of the garbage collector's reach
(`freeze_startup_heap`), so a full collection no longer stalls the engine loop for ~250 ms.

Shutdown on SIGINT/SIGTERM: stop accepting (uvicorn closes the listening socket, new requests on open
connections get 503), abort every in-flight request (streams get an SSE error event and `[DONE]`,
non-streaming requests a 503), wait for the connections to finish, stop the engine thread, exit 0.
uvicorn by default re-raises the captured signal after its own shutdown (so a SIGTERM would end the
process with -15); `_Server.capture_signals` doesn't, because a clean shutdown is a success.
"""

from __future__ import annotations

import contextlib
import gc
import signal
import sys
import threading
from collections.abc import Callable, Generator
from types import FrameType
from typing import Any

from hyserve.config import EngineConfig

_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def require_server_deps() -> None:
    """Fail loudly with an install hint when the server extras are missing."""
    missing = []
    for mod in ("fastapi", "uvicorn", "pydantic", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        raise SystemExit(
            f"hyserve serve needs {', '.join(missing)}: install them with  pip install 'hyserve[server]'"
        )


def freeze_startup_heap() -> int:
    """Move every object alive now (torch, the model, tokenizer tables, the warm-up's leftovers: ~300k
    objects before any CUDA library loads) out of the cyclic garbage collector's reach. They live as long
    as the server; left in, every full collection walks them all, which stalled the engine loop, and so
    every stream, for ~200 ms every few hundred steps (`benchmarks/bench_host.py`). Returns the count."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _make_server_class() -> type:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn.Server that aborts in-flight requests on the first signal and exits cleanly."""

        def __init__(self, config: uvicorn.Config, *, on_first_signal: Callable[[], None],
                     on_started: Callable[[], None]) -> None:
            super().__init__(config)
            self._on_first_signal = on_first_signal
            self._on_started = on_started
            self._signalled = False

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                self._on_started()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            if not self._signalled:
                self._signalled = True
                # Not in the signal handler itself: aborting waits for the engine thread.
                threading.Thread(target=self._on_first_signal, name="hyserve-shutdown", daemon=True).start()

        @contextlib.contextmanager
        def capture_signals(self) -> Generator[None, None, None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            original = {sig: signal.signal(sig, self.handle_exit) for sig in _HANDLED_SIGNALS}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return _Server


def run_server(
    config: EngineConfig,
    server_options: Any,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    access_log: bool = True,
    log: Callable[[str], None] | None = None,
) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, shut down; returns the exit code (0)."""
    require_server_deps()
    import uvicorn

    from hyserve.engine.async_engine import AsyncEngine
    from hyserve.engine.launch import watch_server
    from hyserve.server.app import build_app, hyserve_version
    from hyserve.server.http_warmup import warm_http_path

    out = log or (lambda s: print(s, flush=True))
    out(f"hyserve {hyserve_version()}: starting (model: {config.model or 'built-in tiny model'})")
    engine = AsyncEngine(config, log=out)
    engine.start()
    if config.warmup != "off":
        warm_http_path(engine, server_options, log=out)
    app = build_app(engine, server_options)
    app.state.accepting = True
    freeze_startup_heap()

    def on_signal() -> None:
        out("hyserve: shutting down: no new requests, aborting in-flight requests ...")
        app.state.accepting = False
        engine.shutdown(abort_inflight=True)

    def on_started() -> None:
        out(f"hyserve: ready: serving {engine.model_name!r} on http://{host}:{port} "
            f"(OpenAI API under /v1, metrics at /metrics; Ctrl-C to stop)")

    server_cls = _make_server_class()
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="off",
        timeout_graceful_shutdown=10, timeout_keep_alive=5,
    )
    server = server_cls(uv_config, on_first_signal=on_signal, on_started=on_started)
    # several ranks: a lost rank marks the engine unhealthy and stops the server (exit status 1)
    watch = watch_server(engine, lambda: setattr(server, "should_exit", True), log=out)
    try:
        server.run()
    finally:
        if watch is not None:
            watch.stop()
        engine.shutdown(abort_inflight=True)
        engine.engine.runner.close()  # the other ranks exit (nothing for one rank)
    if watch is not None and watch.reason is not None:
        out(f"hyserve: stopped after losing a rank: {watch.reason}")
        return 1
    if not server.started:
        out(f"hyserve: error: the server could not start on {host}:{port} (see the log above)")
        return 1
    out("hyserve: stopped")
    sys.stdout.flush()
    return 0
