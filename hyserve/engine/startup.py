"""Start an engine in three steps: construct (load, size, allocate, capture), warm up (every kernel
variant serving can reach compiles now, not mid-traffic), mark ready (compilations from here on are
counted and, with strict_warmup, fail their step)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from hyserve.config import EngineConfig
from hyserve.engine.engine import LLMEngine
from hyserve.engine.warmup import Warmup


def start_engine(config: EngineConfig, *, log: Callable[[str], None] | None = None) -> LLMEngine:
    log = log or logging.getLogger("hyserve").info
    engine = LLMEngine(config, log=log)
    if config.warmup == "on" or (config.warmup == "auto" and engine.device.type == "cuda"):
        engine.warmup_report = Warmup(engine, log=log).run()
        log(engine.warmup_report.summary())
    engine.mark_ready()
    return engine
