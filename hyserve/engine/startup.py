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
from hyserve.engine.calibration import calibrate_step_cost
from hyserve.engine.engine import LLMEngine
from hyserve.engine.launch import start_ranks
from hyserve.engine.parallel_runner import DriverRunner
from hyserve.engine.step_cost import analytic_step_cost
from hyserve.engine.warmup import Warmup


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
            engine.warmup_report = Warmup(engine, log=log).run()
            log(engine.warmup_report.summary())
        calibrate(engine, log)
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


def calibrate(engine: LLMEngine, log: Callable[[str], None]) -> None:
    """Give the scheduler its step cost model, and say what it is: timed on the device where `max_step_ms`
    sets a target (by default on CUDA), counted from the model's FLOPs where it is "auto" and the device
    has no calibration (the CPU), none where it is off."""
    sc = engine.config.scheduler
    target = sc.step_target_ms(engine.device.type)
    if target is not None:
        engine.scheduler.cost = calibrate_step_cost(engine, target)
    if engine.scheduler.cost is None and sc.max_step_ms == "auto":
        assert sc.max_num_tokens is not None  # sized at assembly
        mc = engine.model_config
        engine.scheduler.cost = analytic_step_cost(
            params=mc.num_parameters(),
            attention_flops_per_pair=mc.attention_flops_per_pair,
            max_num_tokens=sc.max_num_tokens,
        )
    if engine.scheduler.cost is not None:
        label = f"max_step_ms {target:g}" if target is not None else "max_step_ms auto"
        log(f"{label}: {engine.scheduler.cost.describe()}")
    elif target is not None:
        log(
            f"max_step_ms {target:g}: no step cost model on {engine.device.type} for this model (it is timed "
            "on CUDA over the attention layers); chunks are sized by the token budget alone"
        )
