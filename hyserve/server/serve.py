"""`hyserve serve`: build the engine (printing progress and the capacity report), then run uvicorn.

Start-up order matters for users: the config is validated before anything heavy happens (a typo in
the YAML fails in a second, not after loading weights), the engine loads and warms up *before* the
port opens (so `/health` answering means ready), and the capacity report is on screen before the first
request. Just before the port opens, everything alive is moved out of the garbage collector's reach and the
collector's first threshold is raised (`engine/gc_tuning.py`), so collections no longer stall the engine
loop.

Shutdown on SIGTERM or SIGINT is a graceful drain (Kubernetes' terminationGracePeriod pattern): new API
requests get 503 and `/health` says "draining" (the port stays open so probes see it), in-flight requests
get `shutdown_timeout` seconds to finish; then the rest are aborted (a stream ends with an SSE error event
and `[DONE]`, a non-streaming request gets a 503), uvicorn closes the listener and the connections, the
engine thread stops and the process exits 0. A second signal exits at once (status 130). uvicorn by
default re-raises the captured signal after its own shutdown (so a SIGTERM would end the process with
-15); `_Server.capture_signals` doesn't, because a clean shutdown is a success.

An engine that stopped for good (its loop died, or supervision gave up) stops the server too, and the
process exits 1, so systemd or Kubernetes restarts it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Generator, Sequence
from types import FrameType
from typing import Any

from hyserve import envs
from hyserve.config import EngineConfig
from hyserve.engine.gc_tuning import settle_for_serving
from hyserve.server.logs import StatsLogger, log_line, setup_logging
from hyserve.server.state import engine_in_own_process

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


def _make_server_class() -> type:
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn.Server whose first signal starts a drain (`on_first_signal`) instead of exiting, and
        whose second exits at once."""

        def __init__(
            self,
            config: uvicorn.Config,
            *,
            on_first_signal: Callable[[], None],
            on_started: Callable[[], None],
        ) -> None:
            super().__init__(config)
            self._on_first_signal = on_first_signal
            self._on_started = on_started
            self.signals = 0

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                self._on_started()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            self.signals += 1
            if self.signals == 1:
                # Not in the signal handler itself: draining waits on the requests and the engine thread.
                threading.Thread(target=self._on_first_signal, name="hyserve-drain", daemon=True).start()
                return
            self.should_exit = self.force_exit = True

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


def bind_port(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the model loads, so a port in use fails start-up at
    once (naming it) instead of after minutes of loading; uvicorn serves on it once the engine is ready."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot resolve {host!r} to bind port {port} ({e.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        why = (
            "it is already in use (another server on it? pick another with --port)"
            if e.errno == errno.EADDRINUSE
            else e.strerror or str(e)
        )
        raise ValueError(f"port {port} on {host}: cannot listen there: {why}") from None
    return sock


def engine_stopped_for_good(engine: Any) -> str | None:
    """Why the engine will serve no more (None while it serves or may still recover): its supervision set
    `fatal` (too many failures in the window, or a BaseException); the reason is `dead_reason`."""
    if getattr(engine, "fatal", False):
        return getattr(engine, "dead_reason", None) or "the engine loop stopped"
    return None


def drain(app: Any, engine: Any, timeout: float, out: Callable[[str], None], *, poll: float = 0.05) -> bool:
    """Stop accepting, wait up to `timeout` s for the API requests in flight, abort the rest; True when
    everything finished on its own."""
    metrics = app.state.metrics
    app.state.accepting = False
    n = metrics.inflight
    out(
        f"hyserve: shutting down: draining: no new requests; {n} in flight get up to {timeout:g}s to finish "
        "..."
    )
    deadline = time.monotonic() + timeout
    while metrics.inflight > 0 and time.monotonic() < deadline:
        time.sleep(poll)
    if metrics.inflight == 0:
        out("hyserve: drained: every request finished")
        return True
    out(f"hyserve: drain timeout ({timeout:g}s): aborting the {metrics.inflight} requests still running")
    engine.shutdown(abort_inflight=True)
    end = time.monotonic() + 5.0  # their error events / 503s go out
    while metrics.inflight > 0 and time.monotonic() < end:
        time.sleep(poll)
    return False


def _start_log(
    opts: Any, log: Callable[[str], None] | None, warnings: Sequence[str]
) -> Callable[[str], None]:
    """Where the server's progress goes: `log`, else the loggers `setup_logging` sets up; `warnings` first."""
    if log is None:
        setup_logging(opts.log_level, opts.log_format)
    out = log or log_line
    for w in warnings:
        out(f"hyserve: warning: {w}")
    return out


def uvicorn_config(app: Any, host: str, port: int, opts: Any) -> Any:
    """uvicorn's settings for the app: hyserve's logs, the headers' deadline (`request_read_timeout`, a 408;
    connections.py) and the connection cap (`max_connections`: past it, requests get a 503)."""
    import uvicorn

    from hyserve.server.connections import header_deadline_protocol

    timeout = opts.request_read_timeout
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=opts.log_level,
        log_config=None,  # hyserve.server.logs set up hyserve's and uvicorn's loggers
        access_log=opts.access_log,
        lifespan="off",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=5,
        http=header_deadline_protocol(timeout) if timeout else "auto",
        limit_concurrency=opts.max_connections,
    )


def run_server(
    config: EngineConfig,
    server_options: Any,
    *,
    log: Callable[[str], None] | None = None,
    warnings: Sequence[str] = (),
) -> int:
    """Load the engine, serve until a signal (drain, exit 0) or until the engine stops for good (exit 1).

    Without `log`, hyserve's and uvicorn's loggers are set up (`logs.setup_logging`) and the progress goes
    there; `warnings` are logged first."""
    require_server_deps()
    from hyserve.engine.async_engine import AsyncEngine
    from hyserve.engine.engine_process import ProcessEngine
    from hyserve.engine.parallel.launch import watch_server
    from hyserve.server.app import build_app, hyserve_version
    from hyserve.server.http_warmup import warm_http_path

    opts = server_options
    host = opts.host
    out = _start_log(opts, log, warnings)
    sock = bind_port(host, opts.port)
    port = sock.getsockname()[1]
    out(f"hyserve {hyserve_version()}: starting (model: {config.model or 'built-in tiny model'})")
    engine: Any
    if engine_in_own_process(opts.engine_process, config.device):
        engine = ProcessEngine(config, log=out)
    else:
        engine = AsyncEngine(config, log=out)
    engine.start()
    if config.warmup != "off":
        warm_http_path(engine, server_options, log=out)
    app = build_app(engine, server_options)
    app.state.accepting = True
    settle_for_serving()
    server_cls = _make_server_class()
    server: Any = None

    def on_signal() -> None:
        drain(app, engine, opts.shutdown_timeout, out)
        server.should_exit = True

    def on_started() -> None:
        out(
            f"hyserve: ready: serving {engine.model_name!r} on http://{host}:{port} "
            f"(OpenAI API under /v1, metrics at /metrics; Ctrl-C to stop)"
        )

    server = server_cls(
        uvicorn_config(app, host, port, opts), on_first_signal=on_signal, on_started=on_started
    )
    # several ranks: a lost rank marks the engine unhealthy and stops the server (exit status 1)
    watch = watch_server(engine, lambda: setattr(server, "should_exit", True), log=out)
    gave_up: list[str] = []

    def watch_engine() -> None:
        while not server.should_exit:
            reason = engine_stopped_for_good(engine)
            if reason is not None and server.signals == 0:
                gave_up.append(reason)
                out(f"hyserve: the engine stopped for good ({reason}); shutting down")
                app.state.accepting = False
                server.should_exit = True
                return
            time.sleep(0.2)

    threading.Thread(target=watch_engine, name="hyserve-engine-watch", daemon=True).start()
    stats = StatsLogger(
        engine.stats, logging.getLogger("hyserve.stats").info, envs.HYSERVE_LOG_STATS_INTERVAL
    )
    if opts.log_stats:
        stats.start()
    try:
        server.run(sockets=[sock])
    finally:
        stats.stop()
        sock.close()
        if watch is not None:
            watch.stop()
        if server.signals > 1:
            out("hyserve: second signal: exiting at once")
            sys.stdout.flush()
            os._exit(130)
        engine.shutdown(abort_inflight=True)
        engine.close()  # the other ranks (or the engine process) exit
    if watch is not None and watch.reason is not None:
        out(f"hyserve: stopped after losing a rank: {watch.reason}")
        return 1
    if not server.started:
        out(f"hyserve: error: the server could not start on {host}:{port} (see the log above)")
        return 1
    if gave_up:
        out(f"hyserve: stopped: the engine failed for good ({gave_up[0]}); exit status 1")
        return 1
    out("hyserve: stopped")
    sys.stdout.flush()
    return 0
