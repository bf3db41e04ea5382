"""Start an engine in four steps: construct (load, size, allocate, capture), warm up (every kernel
variant serving can reach compiles now, not mid-traffic), calibrate the step cost model when
`max_step_ms` is set (it times steps, so it follows the warm-up and compiles nothing new), mark ready
(compilations from here on are counted and, with strict_warmup, fail their step).

An engine over several ranks first starts or joins them (`launch.start_ranks`); the other ranks follow
rank 0 through construction and every warm-up step, so each is ready when rank 0 is."""

from __future__ import annotations

import atexit
import logging
from collections.abc import Callable

from hyserve.config import EngineConfig
from hyserve.engine.engine import LLMEngine
from hyserve.engine.lifecycle.calibration import StepCostCalibration
from hyserve.engine.lifecycle.warmup import Warmup
from hyserve.engine.parallel.launch import start_ranks
from hyserve.engine.parallel.parallel_runner import DriverRunner


def start_engine(config: EngineConfig, *, log: Callable[[str], None] | None = None) -> LLMEngine:
    log = log or logging.getLogger("hyserve").info
    ranks = start_ranks(config, log)  # None: one rank, nothing to start
    engine: LLMEngine | None = None
    try:
        engine = LLMEngine(config, log=log)
        runner = engine.runner
        if isinstance(runner, DriverRunner) and ranks is not None:
            runner.lost_rank = ranks.lost
            runner.on_close(lambda told: ranks.close(timeout_s=10.0 if told else 0.0))
            atexit.register(runner.close)  # an LLM never closed still tells its ranks to exit
        if config.warmup == "on" or (config.warmup == "auto" and engine.device.type == "cuda"):
            report = Warmup(engine, log=log).run()
            engine.record_warmup(report)
            log(report.summary())
        engine.use_step_cost(StepCostCalibration(engine, log=log).choose())
        engine.mark_ready()
        if isinstance(runner, DriverRunner):
            runner.mark_ready()
    except BaseException:
        if engine is not None:
            engine.runner.close()  # tells the other ranks to exit when they can still hear it
        if ranks is not None:
            ranks.close(timeout_s=5.0)
        raise
    return engine
