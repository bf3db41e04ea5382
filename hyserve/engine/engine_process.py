"""`ProcessEngine`: the engine loop (engine/engine_loop.py) in a process of its own, with the asyncio
streaming API of `EngineFront` in the server's process.

Every PyTorch op and kernel launch of the engine gives up the interpreter lock; with the loop on a thread
of the server, the event loop then takes the lock for its own work (request parsing, one SSE chunk per
stream per step) and the engine waits for it. In its own process the engine's host work runs beside the
server's on another core.

    server process                                   engine process
    generate() -> validate here (InputProcessor,     reader thread: "add" (its grammar compiled there
      grammars) -> ("add", AddRequest) --pipe-->       first), "abort", "reset", "stop" -> the loop's inbox
    reader thread <--pipe-- ("step", stats, deltas)  main thread: EngineLoop.run(), one message a step
      -> _emit: stats, then the deltas (as AsyncEngine)

Messages are pickled tuples on one duplex pipe. The engine process ignores SIGINT and SIGTERM (the server
drains, then sends "stop") and stops when the pipe closes (the server is gone). If it exits on its own (a
crash, the out-of-memory killer), the server's reader sees the pipe close and the engine is dead: every
stream ends with an error and `on_fatal` is called, so the server exits non-zero.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import operator
import pickle
import signal
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from hyserve.config import EngineConfig
from hyserve.engine.delta_collector import DEFAULT_PENDING_LIMIT_BYTES
from hyserve.engine.engine_front import EngineFront
from hyserve.engine.engine_loop import EngineLoop
from hyserve.engine.gc_tuning import settle_for_serving
from hyserve.engine.input_processor import InputProcessor
from hyserve.engine.lifecycle.startup import start_engine
from hyserve.engine.outputs import StreamDelta
from hyserve.engine.parallel.launch import watch_server
from hyserve.engine.sampling.structured_output import StructuredOutputs
from hyserve.engine.sampling_params import SamplingParams

logger = logging.getLogger("hyserve")
_PICKLE = pickle.HIGHEST_PROTOCOL
# a step's deltas cross the pipe as tuples of their fields: 1,024 of them unpickle in ~0.8 ms so, ~3.7 ms as
# dataclasses (the server's reader holds its interpreter lock meanwhile)
_DELTA_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(StreamDelta)))
START_TIMEOUT_S = 3600.0  # a model load and warm-up that long is stuck


@dataclass(frozen=True)
class EngineInfo:
    """What the engine process tells the server once it is ready."""

    model_name: str
    tokenizer: Any
    max_seq_len: int
    max_batch_size: int
    vocab_size: int
    inputs: InputProcessor
    capacity_report: str
    stats: dict[str, float]


class _Pipe:
    """One end of the pipe: pickled messages, sends serialised by a lock (several threads send)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self._lock = threading.Lock()

    def send(self, msg: tuple[Any, ...]) -> None:
        data = pickle.dumps(msg, protocol=_PICKLE)
        with self._lock:
            self.conn.send_bytes(data)

    def recv(self) -> tuple[Any, ...]:
        return pickle.loads(self.conn.recv_bytes())


class _PipeLogHandler(logging.Handler):
    """The engine process's log records, sent to the server's loggers."""

    def __init__(self, pipe: _Pipe) -> None:
        super().__init__()
        self.pipe = pipe

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.pipe.send(("logrec", record.name, record.levelno, self.format(record)))
        except Exception:  # the server is gone: nothing to tell
            pass


class _Health:
    """What `parallel.launch.watch_server` reads of a served engine, inside the engine process."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.healthy = True
        self.dead_reason: str | None = None


# ---- the engine process ---------------------------------------------------------------------------------
def serve_engine_process(
    config: EngineConfig, conn: Connection, log_level: int, prepare: Callable[[Any], None] | None = None
) -> None:
    """The engine process's main: start the engine (then `prepare(engine)`, if given), say "ready", run the
    loop until "stop" or the pipe closes; a start-up failure is sent as ("failed", the exception if it
    pickles, its text, the traceback)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipe = _Pipe(conn)
    handler = _PipeLogHandler(pipe)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(log_level)
    try:
        engine = start_engine(config, log=lambda s: pipe.send(("log", s)))
        if prepare is not None:
            prepare(engine)
    except BaseException as e:
        pipe.send(("failed", _picklable(e), f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    sent: list[dict[str, float] | None] = [None]  # the stats the server has

    def emit(stats: dict[str, float] | None, deltas: list[Any]) -> None:
        if deltas or (stats is not None and stats != sent[0]):
            pipe.send(("step", stats, [_DELTA_FIELDS(d) for d in deltas]))
            sent[0] = stats if stats is not None else sent[0]

    def on_die(reason: str) -> None:
        pipe.send(("dead", reason))

    loop = EngineLoop(
        engine,
        config,
        emit=emit,
        on_reset=lambda reason, taken: pipe.send(("reset_after_failure", reason, taken)),
        on_die=on_die,
    )
    health = _Health(engine)

    def rank_lost() -> None:
        on_die(health.dead_reason or "a rank was lost")
        loop.stop()

    watch = watch_server(health, rank_lost, log=lambda s: pipe.send(("log", s)))
    info = EngineInfo(
        model_name=engine.loaded.name,
        tokenizer=engine.tokenizer,
        max_seq_len=engine.max_seq_len,
        max_batch_size=engine.scheduler.max_batch_size,
        vocab_size=engine.model_config.vocab_size,
        inputs=engine.inputs,
        capacity_report=engine.capacity_report(),
        stats=engine.stats(),
    )
    pipe.send(("ready", info))
    threading.Thread(
        target=_read_server, args=(pipe, loop, engine), name="hyserve-engine-inbox", daemon=True
    ).start()
    settle_for_serving()
    try:
        loop.run()
    finally:
        if watch is not None:
            watch.stop()
        engine.runner.close()  # the other ranks exit (nothing for one rank)
        try:
            pipe.send(("stopped",))
        except OSError:
            pass


def _picklable(e: BaseException) -> BaseException | None:
    """`e` if it survives pickling (the server re-raises it as it is), else None."""
    try:
        pickle.loads(pickle.dumps(e, protocol=_PICKLE))
    except Exception:
        return None
    return e


def _read_server(pipe: _Pipe, loop: EngineLoop, engine: Any) -> None:
    """The engine process's reader: the server's messages into the loop's inbox, until "stop" or the pipe
    closes. An "add"'s grammar is compiled here first (the server compiled it to validate the request; this
    process has its own cache), so the loop does not stall on it."""
    while True:
        try:
            msg = pipe.recv()
        except (EOFError, OSError):
            loop.stop()  # the server is gone
            return
        kind = msg[0]
        if kind == "add":
            if msg[1].params.structured_outputs is not None:
                try:
                    engine.structured.validate(msg[1].params)
                except Exception:  # add_request fails it again, with the message, as a race would
                    pass
            loop.submit("add", msg[1])
        elif kind == "abort":
            loop.submit("abort", msg[1])
        elif kind == "reset":
            token = msg[1]
            loop.submit("reset", lambda token=token: pipe.send(("reset_done", token)))
        elif kind == "stop":
            loop.stop()
            return


# ---- the server's side ----------------------------------------------------------------------------------
class ProcessEngine(EngineFront):
    """The `AsyncEngine` interface over an engine in its own (spawned) process. The constructor returns once
    the engine is ready, or raises the exception the engine's start-up raised (a RuntimeError naming it if
    it cannot cross the pipe)."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        log: Callable[[str], None] | None = None,
        max_pending_stream_bytes: int = DEFAULT_PENDING_LIMIT_BYTES,
        prepare: Callable[[Any], None] | None = None,
    ) -> None:
        """`prepare`: called with the `LLMEngine` in the engine process once it started, before it serves
        (a picklable function: tests and benchmarks stand in parts of the engine there)."""
        super().__init__(max_pending_stream_bytes)
        self.config = config
        self._log = log or logger.info
        ctx = mp.get_context("spawn")  # CUDA cannot be forked; the engine process may start rank processes
        mine, theirs = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=serve_engine_process,
            args=(config, theirs, logging.getLogger("hyserve").getEffectiveLevel(), prepare),
            name="hyserve-engine",
        )
        self._proc.start()
        theirs.close()
        # a server that exits without `shutdown` still ends the engine process first: multiprocessing joins
        # its children at exit, and this one would wait for a pipe the exiting process still holds open
        atexit.register(self._at_exit)
        self._pipe = _Pipe(mine)
        self._resets: dict[str, threading.Event] = {}
        self._closing = False
        self._reader: threading.Thread | None = None
        try:
            info = self._wait_ready()
        except BaseException:  # a failed start, or Ctrl-C while the model loads: nothing is left running
            self._kill()
            raise
        self.model_name = info.model_name
        self.tokenizer = info.tokenizer
        self.max_seq_len = info.max_seq_len
        self.max_batch_size = info.max_batch_size
        self._capacity_report = info.capacity_report
        self._inputs = info.inputs
        self._structured = StructuredOutputs(info.tokenizer, info.vocab_size)
        self._stats = dict(info.stats)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _wait_ready(self) -> EngineInfo:
        """The engine's "ready", its start-up log relayed meanwhile (a raise: the caller ends the process)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if not self._pipe.conn.poll(max(0.0, deadline - time.monotonic())):
                raise RuntimeError(f"the engine process was not ready within {START_TIMEOUT_S:.0f}s")
            try:
                msg = self._pipe.recv()
            except (EOFError, OSError):
                self._proc.join(timeout=10)
                raise RuntimeError(
                    f"the engine process exited during start-up (exit code {self._proc.exitcode})"
                ) from None
            if msg[0] == "ready":
                return msg[1]
            if msg[0] == "failed":  # the engine's own exception: a bad setting is the ValueError it names
                self._proc.join(timeout=10)
                logger.debug("engine process start-up failure:\n%s", msg[3])
                if isinstance(msg[1], Exception):
                    raise msg[1]
                raise RuntimeError(f"the engine failed to start: {msg[2]}")
            self._handle_log(msg)

    def _handle_log(self, msg: tuple[Any, ...]) -> None:
        if msg[0] == "log":
            self._log(msg[1])
        elif msg[0] == "logrec":
            logging.getLogger(msg[1]).log(msg[2], "%s", msg[3])

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(
                target=self._read_engine, name="hyserve-engine-reader", daemon=True
            )
            self._reader.start()

    def _read_engine(self) -> None:
        """The engine's messages, in order, until it says "stopped" or its pipe closes."""
        while True:
            try:
                msg = self._pipe.recv()
            except (EOFError, OSError):
                if not self._closing:
                    self._proc.join(timeout=5)
                    self._die(f"the engine process exited (exit code {self._proc.exitcode})")
                return
            kind = msg[0]
            if kind == "step":
                self._emit(msg[1], [StreamDelta(*row) for row in msg[2]])
            elif kind == "reset_after_failure":
                self._after_reset(msg[1], msg[2])
            elif kind == "reset_done":
                done = self._resets.pop(msg[1], None)
                if done is not None:
                    done.set()
            elif kind == "dead":
                self._die(msg[1])
            elif kind == "stopped":
                return
            else:
                self._handle_log(msg)

    def shutdown(self, *, abort_inflight: bool = True) -> None:
        if abort_inflight and self.healthy:
            self._abort_open_streams(wait=True)
        self._closing = True
        self._submit("stop", None)
        if self._reader is not None:
            self._reader.join(timeout=30)
            self._reader = None

    def close(self) -> None:
        """After `shutdown`: wait for the engine process (it closed its ranks) and end it if it lingers."""
        self._closing = True
        self._proc.join(timeout=30)
        self._kill()
        self._pipe.conn.close()
        atexit.unregister(self._at_exit)

    def _at_exit(self) -> None:
        if self._proc.is_alive():
            self._closing = True
            self._submit("stop", None)
            self._proc.join(timeout=10)
            self._kill()

    def _kill(self) -> None:
        """End the engine process now (it ignores SIGTERM: a signal to the whole process group must let the
        server drain first)."""
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)

    # ---- API --------------------------------------------------------------------------------------
    def _submit(self, kind: str, arg: Any) -> None:
        try:
            self._pipe.send((kind, arg))
        except OSError:  # the engine process is gone: the reader ends every stream
            pass

    def capacity_report(self) -> str:
        return self._capacity_report

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """As `LLMEngine.validate_request`, here: the engine's InputProcessor (its limits and capacity plan)
        and a grammar compiler over the same tokenizer."""
        self._inputs.validate(prompt_token_ids, params, priority)
        self._structured.validate(params)

    def reset_stats(self, timeout: float = 60.0) -> None:
        """As `AsyncEngine.reset_stats`, in the engine process. Blocks until done."""
        self.start()  # its answer comes through the reader
        token = uuid.uuid4().hex
        done = self._resets[token] = threading.Event()
        self._submit("reset", token)
        if not done.wait(timeout):
            raise TimeoutError(f"the engine did not reset within {timeout:.0f}s")


__all__ = ["EngineInfo", "ProcessEngine", "serve_engine_process"]
