"""`LLMEngine.stats()`: the engine's gauges and counters in one flat mapping (`llm.stats()`, /metrics)."""

from __future__ import annotations

from hyserve.cache.manager import HybridCacheManager
from hyserve.engine.isolation import FailureIsolation
from hyserve.engine.runner.alloc_retries import AllocRetries
from hyserve.engine.runner.jit_sentinel import JitSentinel
from hyserve.engine.scheduler.scheduler import Scheduler
from hyserve.engine.speculative.speculation import Speculation


def engine_stats(
    scheduler: Scheduler,
    cache: HybridCacheManager,
    jit: JitSentinel,
    counters: dict[str, int],
    isolation: FailureIsolation,
    spec: Speculation | None,
    alloc_retries: AllocRetries,
) -> dict[str, float]:
    s = scheduler.stats
    return {
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.waiting),
        **cache.usage(),
        "prefix_cache_queries": cache.prefix_queries,
        "prefix_cache_hits": cache.prefix_hits,
        "tokens_scheduled_last_step": s.tokens_scheduled,
        "num_preemptions": s.num_preemptions,
        "batch_wait_steps": s.batch_wait_steps,
        "step_time_scale": scheduler.feedback.scale,
        "jit_compiles_after_ready": jit.compiles_after_ready,
        **counters,
        **isolation.counters(),
        **(spec.counters() if spec is not None else {}),
        **(
            {"cuda_alloc_retries": alloc_retries.since_reset()} if alloc_retries.device.type == "cuda" else {}
        ),
    }
