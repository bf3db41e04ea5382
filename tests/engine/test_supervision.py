"""Engine supervision (engine/async_engine.py): an exception that escapes `LLMEngine.step()` ends the
in-flight requests with an error, resets the engine's books and serving goes on; the
engine_failure_limit-th such failure within engine_failure_window_s stops the engine for good (`fatal`,
`on_fatal`, unhealthy), so the server can exit non-zero."""

from __future__ import annotations

import asyncio
import time

import pytest

from hyserve import SamplingParams
from hyserve.config import EngineConfig, build_engine_config
from hyserve.engine.async_engine import AsyncEngine
from hyserve.engine.engine_front import EngineFront
from hyserve.engine.faults import FaultInjector

PROMPT = [1, 5, 9, 13, 17, 21]
SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def _engine(**opts) -> AsyncEngine:
    eng = AsyncEngine(EngineConfig(warmup="off").replace(**opts), log=lambda s: None)
    eng.engine.faults = FaultInjector.parse("engine:bad")  # escapes step() once "bad..." is scheduled
    eng.start()
    return eng


async def _collect(
    eng: EngineFront, rid: str, params: SamplingParams
) -> tuple[list[int], str | None, str | None]:
    toks: list[int] = []
    reason = error = None
    async for d in eng.generate(rid, PROMPT, params):
        toks += d.token_ids
        if d.finished:
            reason, error = d.finish_reason, d.error
    return toks, reason, error


async def _after(delay: float, coro):  # type: ignore[no-untyped-def]
    await asyncio.sleep(delay)
    return await coro


def _assert_idle_and_free(eng: AsyncEngine) -> None:
    for _ in range(100):
        s = eng.stats()
        if s["num_running"] == 0 and s["num_waiting"] == 0:
            break
        time.sleep(0.02)
    u = eng.engine.cache_usage()
    assert u["kv_blocks_free"] == u["kv_blocks_total"] and u["live_slots_used"] == 0, u
    eng.engine.cache.check_invariants()


def test_a_host_side_failure_is_survived_and_serving_goes_on() -> None:
    eng = _engine()
    fatal: list[str] = []
    eng.on_fatal = fatal.append
    try:

        async def main():  # type: ignore[no-untyped-def]
            ref = await _collect(eng, "before", SHORT)
            inflight = [asyncio.create_task(_collect(eng, f"long{i}", LONG)) for i in range(3)]
            await asyncio.sleep(0.05)
            bad = await _collect(eng, "bad", SHORT)
            lost = await asyncio.gather(*inflight)
            after = await asyncio.gather(*(_collect(eng, f"after{i}", SHORT) for i in range(2)))
            return ref, bad, lost, after

        ref, bad, lost, after = asyncio.run(main())
        assert bad[1] == "error" and "injected fault" in (bad[2] or "")
        assert all(r == "error" and "engine was reset" in (e or "") for _, r, e in lost)  # in flight: aborted
        assert all(a == (ref[0], "length", None) for a in after)  # served again, the same greedy tokens
        assert eng.healthy and not eng.fatal and not fatal
        s = eng.stats()
        assert s["engine_restarts_total"] == 1 and s["healthy"] == 1
        _assert_idle_and_free(eng)
    finally:
        eng.shutdown()


def test_failures_beyond_the_bound_stop_the_engine() -> None:
    eng = _engine(engine_failure_limit=3)
    fatal: list[str] = []
    eng.on_fatal = fatal.append
    try:

        async def main():  # type: ignore[no-untyped-def]
            res = []
            for i in range(3):
                res.append(await _collect(eng, f"bad{i}", SHORT))
                if i < 2:
                    res.append(await _collect(eng, f"ok{i}", SHORT))
            return res

        res = asyncio.run(main())
        assert [r[1] for r in res] == ["error", "length", "error", "length", "error"]
        assert eng.fatal and not eng.healthy and len(fatal) == 1 and "3 engine failures" in fatal[0]
        assert eng.stats()["engine_restarts_total"] == 2 and eng.stats()["healthy"] == 0
        with pytest.raises(RuntimeError, match="not running"):
            asyncio.run(_collect(eng, "late", SHORT))
    finally:
        eng.shutdown()


def test_failures_outside_the_window_do_not_add_up() -> None:
    eng = _engine(engine_failure_limit=2, engine_failure_window_s=0.3)
    try:
        for i in range(3):
            toks, reason, _ = asyncio.run(_collect(eng, f"bad{i}", SHORT))
            assert reason == "error"
            time.sleep(0.4)
        assert eng.healthy and not eng.fatal and eng.stats()["engine_restarts_total"] == 3
        assert asyncio.run(_collect(eng, "ok", SHORT))[1] == "length"
    finally:
        eng.shutdown()


def test_supervision_settings_are_checked() -> None:
    c = build_engine_config({"engine_failure_limit": 2, "engine_failure_window_s": 5})
    assert (c.engine_failure_limit, c.engine_failure_window_s) == (2, 5.0)
    assert (EngineConfig().engine_failure_limit, EngineConfig().engine_failure_window_s) == (5, 60.0)
    with pytest.raises(ValueError, match="engine_failure_limit: must be >= 1"):
        build_engine_config({"engine_failure_limit": 0})
    with pytest.raises(ValueError, match="engine_failure_window_s: expected a positive number of seconds"):
        build_engine_config({"engine_failure_window_s": -1})
