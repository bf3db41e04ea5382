"""AsyncEngine: the engine thread hands each step's deltas to the event loop in one wake-up."""

from __future__ import annotations

import asyncio
import time

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


def test_a_slow_reader_gets_merged_deltas_and_one_too_slow_is_aborted_and_counted() -> None:
    """A reader that pauses finds the steps it missed merged into one delta (same tokens as a reader that
    keeps up); one whose unread output passes max_pending_stream_bytes is ended with an error, its request
    aborted in the engine and counted, while another request is served."""
    eng = AsyncEngine(EngineConfig(warmup="off"), log=lambda s: None, max_pending_stream_bytes=400)
    eng.start()
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    try:

        async def read(rid: str, pause: float, params: SamplingParams) -> list:
            out = []
            async for d in eng.generate(rid, [1, 5, 9, 13], params):
                out.append(d)
                if d.finish_reason is None:  # nothing to wait for after the last delta
                    await asyncio.sleep(pause)
            return out

        async def main() -> tuple[list, list, list, list]:
            fast = await read("fast", 0.0, greedy)
            slow = await read("slow", 0.05, greedy)
            long = SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True, logprobs=5)
            cut, other = await asyncio.gather(read("cut", 2.0, long), read("other", 0.0, greedy))
            deadline = time.monotonic() + 10  # the abort reaching the engine
            while eng.engine.has_unfinished() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return fast, slow, cut, other

        fast, slow, cut, other = asyncio.run(main())
    finally:
        eng.shutdown()
    toks = [t for d in fast for t in d.token_ids]
    assert len(toks) == 24 and [t for d in slow for t in d.token_ids] == toks
    assert len(slow) < len(fast)  # some steps arrived merged
    assert "".join(d.text for d in slow) == "".join(d.text for d in fast)
    assert cut[-1].finish_reason == "error" and "too slowly" in (cut[-1].error or "")
    assert sum(len(d.token_ids) for d in cut) < 3000
    assert [t for d in other for t in d.token_ids] == toks
    assert eng.stats()["slow_reader_aborts_total"] == 1
    assert not eng.engine.has_unfinished()  # the cut request's blocks and slot went back
