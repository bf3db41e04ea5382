"""AsyncEngine: the engine thread hands each step's deltas to the event loop in one wake-up."""

from __future__ import annotations

import asyncio

from hyserve import SamplingParams
from hyserve.config import EngineConfig
from hyserve.engine.async_engine import AsyncEngine


def test_one_wakeup_per_event_loop_per_step() -> None:
    eng = AsyncEngine(EngineConfig(warmup="off"), log=lambda s: None)
    eng.start()
    try:

        async def collect(rid: str) -> list[int]:
            toks: list[int] = []
            async for d in eng.generate(
                rid, [1, 5, 9, 13], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
            ):
                toks += d.token_ids
            return toks

        async def main() -> tuple[int, list[list[int]]]:
            loop = asyncio.get_running_loop()
            calls = 0
            real = loop.call_soon_threadsafe

            def counting(cb, *args, **kw):  # type: ignore[no-untyped-def]
                nonlocal calls
                calls += 1
                return real(cb, *args, **kw)

            loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
            outs = await asyncio.gather(*(collect(f"r{i}") for i in range(8)))
            return calls, outs

        calls, outs = asyncio.run(main())
    finally:
        eng.shutdown()
    assert all(len(o) == 6 for o in outs)
    assert outs.count(outs[0]) == 8  # the same greedy prompt: the same tokens in every stream
    # 8 streams x 6 tokens = 48 deltas; one wake-up per step: about 6 steps (a few more if the
    # requests arrived over several steps), never one per delta
    assert calls <= 16, calls
