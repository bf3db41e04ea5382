"""The server's log: one setup for hyserve's loggers and uvicorn's, and the periodic stats line.

Every line carries its time and level, as text

    2025-06-01 12:00:00.123 INFO hyserve: ready: serving 'm' on http://127.0.0.1:8000 ...
    2025-06-01 12:00:01.456 INFO uvicorn.access: 127.0.0.1:50000 - "POST /v1/completions HTTP/1.1" 200

or, with `log_format="json"`, as one JSON object a line (`time`, `level`, `logger`, `message`). uvicorn is
started with `log_config=None`, so it keeps this setup instead of installing its own handlers.

`StatsLogger` writes a line every `interval` seconds while serving (vLLM's `--disable-log-stats` turns it
off): prompt and generation throughput over the interval, running and waiting requests, KV block and Mamba
state slot usage, the prefix-cache hit rate over the interval and the preemptions in it. An idle server
writes one such line, then none until something happens.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
TRACE = 5  # uvicorn's "trace" level
_LEVELS = {"critical": 50, "error": 40, "warning": 30, "info": 20, "debug": 10, "trace": TRACE}
# the loggers this setup writes for; the uvicorn.* ones propagate into "uvicorn"
_ROOTS = ("hyserve", "uvicorn")
_PROPAGATING = ("uvicorn.error", "uvicorn.access", "uvicorn.asgi")

logger = logging.getLogger("hyserve")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": f"{self.formatTime(record, DATE_FORMAT)}.{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


class _UvicornName(logging.Filter):
    """uvicorn logs its ordinary messages as "uvicorn.error"; shown as "uvicorn", they don't read as
    errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":
            record.name = "uvicorn"
        return True


def setup_logging(level: str = "info", fmt: str = "text", stream: TextIO | None = None) -> logging.Handler:
    """Send hyserve's and uvicorn's records through one handler on `stream` (stdout) at `level`."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log_format: {fmt!r} is not one of {list(LOG_FORMATS)}")
    logging.addLevelName(TRACE, "TRACE")
    handler = logging.StreamHandler(stream or sys.stdout)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT, DATE_FORMAT))
    handler.addFilter(_UvicornName())
    lvl = _LEVELS.get(level.lower(), logging.INFO)
    for name in _ROOTS:  # they still propagate: a root handler (an embedding program's) sees them too
        lg = logging.getLogger(name)
        lg.handlers = [handler]
        lg.setLevel(lvl)
    for name in _PROPAGATING:  # at the level of "uvicorn" (uvicorn.Config sets it again from log_level)
        lg = logging.getLogger(name)
        lg.handlers = []
        lg.propagate = True
        lg.setLevel(logging.NOTSET)
    return handler


def log_line(message: str) -> None:
    """A start-up / shutdown message as log records ("hyserve: warning: ..." at WARNING, "hyserve:
    error: ..." at ERROR, others at INFO), without its "hyserve: " prefix (the logger name says it); a
    message of several lines (the capacity report) is a record a line, so each has its time and level."""
    text = message.removeprefix("hyserve: ")
    level = logging.INFO
    for word, lvl in (("warning: ", logging.WARNING), ("error: ", logging.ERROR)):
        if text.startswith(word):
            text, level = text.removeprefix(word), lvl
    for line in text.splitlines() or [""]:
        logger.log(level, line)


def _rate(now: float, then: float, dt: float) -> float:
    return max(now - then, 0.0) / dt if dt > 0 else 0.0


class StatsLogger:
    """The periodic stats line, from `engine.stats()`; `tick()` writes one (a thread calls it every
    `interval` seconds: `start()` / `stop()`)."""

    def __init__(
        self, stats: Callable[[], dict[str, Any]], log: Callable[[str], None], interval: float = 10.0
    ) -> None:
        self._stats, self._log, self.interval = stats, log, interval
        self._last: tuple[float, dict[str, Any]] | None = None
        self._idle_logged = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def line(s: dict[str, Any], before: dict[str, Any], dt: float) -> str:
        """The stats line for counters `s`, `dt` seconds after `before`."""

        def rate(key: str) -> float:
            return _rate(float(s.get(key, 0)), float(before.get(key, 0)), dt)

        def delta(key: str) -> float:
            return float(s.get(key, 0)) - float(before.get(key, 0))

        # prompt tokens computed (prefix-cache hits are not), else the prompt tokens that arrived
        prompt = (
            "prefill_tokens_scheduled_total"
            if "prefill_tokens_scheduled_total" in s
            else "prompt_tokens_total"
        )
        kv_total, kv_free = s.get("kv_blocks_total") or 0, s.get("kv_blocks_free") or 0
        slots, used = s.get("live_slots_total") or 0, s.get("live_slots_used") or 0
        queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
        return (
            f"stats: prompt {rate(prompt):.1f} tok/s, "
            f"generation {rate('generation_tokens_total'):.1f} tok/s, "
            f"running {int(s.get('num_running', 0))}, waiting {int(s.get('num_waiting', 0))}, "
            f"KV cache {100.0 * (1 - kv_free / kv_total) if kv_total else 0.0:.1f}%, "
            f"state slots {100.0 * used / slots if slots else 0.0:.1f}%, "
            f"prefix cache hit rate {100.0 * hits / queries if queries > 0 else 0.0:.1f}%, "
            f"preemptions {int(delta('num_preemptions'))}"
        )

    def tick(self, now: float | None = None) -> str | None:
        """Write the line for the time since the last tick (the first tick only takes the counters);
        returns it, or None when nothing was written."""
        now = time.monotonic() if now is None else now
        try:
            s = self._stats()
        except Exception:
            logger.exception("engine.stats() failed for the stats line")
            return None
        last, self._last = self._last, (now, s)
        if last is None:
            return None
        then, before = last
        busy = any(
            float(s.get(k, 0)) != float(before.get(k, 0))
            for k in ("prompt_tokens_total", "generation_tokens_total", "num_preemptions")
        ) or bool(s.get("num_running") or s.get("num_waiting"))
        if not busy and self._idle_logged:
            return None
        self._idle_logged = not busy
        text = self.line(s, before, now - then)
        self._log(text)
        return text

    def start(self) -> None:
        self.tick()

        def run() -> None:
            while not self._stop.wait(self.interval):
                self.tick()

        self._thread = threading.Thread(target=run, name="hyserve-stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
