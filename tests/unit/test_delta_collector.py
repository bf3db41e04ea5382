"""DeltaCollector: a stream's unread deltas merged into one; a reader that falls too far behind is cut off."""

from __future__ import annotations

import asyncio

from hyserve.engine.delta_collector import DeltaCollector, delta_bytes, merge_deltas
from hyserve.engine.outputs import StreamDelta, TokenLogprob


def delta(
    toks: list[int], text: str, *, lp: bool = False, finished: bool = False, out: int = 0
) -> StreamDelta:
    return StreamDelta(
        request_id="r",
        token_ids=toks,
        text=text,
        logprobs=[TokenLogprob(t, -0.5, {t: -0.5, t + 1: -1.0}) for t in toks] if lp else None,
        finished=finished,
        finish_reason="length" if finished else None,
        num_prompt_tokens=4,
        num_cached_tokens=0,
        num_output_tokens=out,
        stop_reason=None,
    )


def test_merging_joins_tokens_text_and_logprobs_and_keeps_the_later_totals():
    a = delta([5, 6], "ab", lp=True, out=2)
    a.prompt_logprobs = [None, TokenLogprob(3, -0.1, {})]
    b = delta([7], "c", lp=True, finished=True, out=3)
    m = merge_deltas(a, b)
    assert (m.token_ids, m.text, m.num_output_tokens, m.finished) == ([5, 6, 7], "abc", 3, True)
    assert [lp.token_id for lp in m.logprobs or []] == [5, 6, 7]
    assert m.prompt_logprobs == a.prompt_logprobs and m.finish_reason == "length"
    assert merge_deltas(delta([1], "x"), delta([2], "y")).logprobs is None


def test_a_reader_that_falls_behind_gets_one_merged_delta():
    async def run() -> list[StreamDelta]:
        c = DeltaCollector("r")
        for i in range(5):
            c.put(delta([i], str(i), out=i + 1))
        first = await c.get()
        c.put(delta([9], "9", finished=True, out=6))
        return [first, await c.get()]

    first, last = asyncio.run(run())
    assert (first.token_ids, first.text, first.num_output_tokens) == ([0, 1, 2, 3, 4], "01234", 5)
    assert last.token_ids == [9] and last.finished


def test_a_backlog_over_the_limit_ends_the_stream_with_an_error_naming_the_limit():
    big = delta(list(range(40)), "x" * 400, lp=True)
    limit = 3 * delta_bytes(big)

    async def run() -> tuple[DeltaCollector, StreamDelta]:
        c = DeltaCollector("r", limit_bytes=limit)
        for _ in range(4):
            c.put(big)
        c.put(delta([1], "late"))  # dropped: the stream has ended
        return c, await c.get()

    c, d = asyncio.run(run())
    assert c.overflowed and d.finished and d.finish_reason == "error"
    assert d.token_ids == [] and d.text == "" and d.logprobs is None
    assert f"the limit is {limit:,}" in (d.error or "") and "too slowly" in (d.error or "")


def test_a_finishing_delta_is_never_cut_off():
    async def run() -> StreamDelta:
        c = DeltaCollector("r", limit_bytes=10)
        c.put(delta([1, 2, 3], "x" * 50, finished=True, out=3))
        return await c.get()

    d = asyncio.run(run())
    assert d.finish_reason == "length" and d.text == "x" * 50
