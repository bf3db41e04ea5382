"""Running a route's engine requests: one `Job` per choice, run to a `Result` (non-streaming) or merged
into one stream of tagged deltas, with the client's disconnect aborting them.

Two failure rules live here:

- a client that goes away has its engine requests aborted at once (streaming: Starlette cancels the
  response task and `SSEResponse` closes the generator; non-streaming: `run_whole` watches the ASGI
  receive channel for `http.disconnect`), so their KV blocks and state slots return to the pool;
- a stream that ends without a final delta counts as an engine failure, never as a silent success.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from hyserve.engine.errors import RequestRejected
from hyserve.engine.outputs import StreamDelta, TokenLogprob
from hyserve.engine.sampling_params import SamplingParams
from hyserve.server.errors import APIError, bad_request, internal_error
from hyserve.server.metrics import RequestTimer

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

logger = logging.getLogger("hyserve.requests")


class RequestLogging:
    """An engine whose generation requests are logged as they start (id, prompt length, sampling) and end
    (finish reason, tokens): vLLM's --enable-log-requests. Everything else is the engine's."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, **kw: Any
    ) -> AsyncIterator[StreamDelta]:
        p = params
        logger.info(
            "request %s: %d prompt tokens, max_tokens=%d, temperature=%g, top_p=%g, top_k=%d, min_p=%g, "
            "seed=%s, stop=%r, logprobs=%s, structured=%s, priority=%s",
            request_id,
            len(prompt_token_ids),
            p.max_tokens,
            p.temperature,
            p.top_p,
            p.top_k,
            p.min_p,
            p.seed,
            list(p.stop),
            p.logprobs,
            p.structured_outputs is not None,
            kw.get("priority", 0),
        )
        last: StreamDelta | None = None
        agen = self._engine.generate(request_id, prompt_token_ids, params, **kw)
        try:
            async for d in agen:
                last = d
                yield d
        finally:
            await agen.aclose()
            if last is not None and last.finished:
                logger.info(
                    "request %s finished: %s, %d output tokens, %d prompt tokens from the prefix cache%s",
                    request_id,
                    last.finish_reason,
                    last.num_output_tokens,
                    last.num_cached_tokens,
                    f" ({last.error})" if last.error else "",
                )
            else:
                logger.info(
                    "request %s ended unfinished (the client went away or it was aborted)", request_id
                )


@dataclass
class Result:
    """Everything one engine request produced (non-streaming)."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # (tokens, characters of text) of each delta that carried tokens, in order (completions' text_offset)
    delta_spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    # choices k > 0 of a long prompt start once choice 0 has its first token (`stagger_choices`)
    after: asyncio.Event | None = None  # wait for this before entering the engine
    first_token: asyncio.Event | None = None  # set at this job's first delta (or its end)
    priority: int = 0  # the request body's `priority` (every choice of it)
    # the request's sequences in the engine at once (`pace_jobs`): held while this job's engine request runs
    gate: asyncio.Semaphore | None = None


def choice_params(params: SamplingParams, k: int) -> SamplingParams:
    """Choice k of n: a seeded request gives each choice its own seed (seed + k, kept in int64), so the
    choices differ and each stays reproducible; unseeded choices draw independently anyway."""
    if k == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + k + 2**63) % 2**64 - 2**63)


def stagger_choices(jobs: list[Job], n: int, min_prompt: int | None) -> None:
    """With the prefix cache on (`min_prompt` not None), let choices 1..n-1 of each prompt of at least
    `min_prompt` tokens enter the engine only after choice 0 has produced its first token: its prompt
    blocks and Mamba snapshots are published by then, so the others prefill only what the cache cannot
    serve instead of the whole prompt n times. Jobs are prompt-major (choice k of prompt i at i * n + k)."""
    if n <= 1 or min_prompt is None:
        return
    for lead in range(0, len(jobs), n):
        if len(jobs[lead].prompt_ids) < min_prompt:
            continue
        ev = asyncio.Event()
        jobs[lead].first_token = ev
        for j in jobs[lead + 1 : lead + n]:
            j.after = ev


def pace_jobs(jobs: list[Job], window: int | None) -> None:
    """Let at most `window` of one request's jobs be in the engine at once, the next entering as one
    finishes: a request of many sequences (prompts x n) then never fills the batch and the waiting queue
    ahead of another client's request, which enters beside it at once (FCFS admission would otherwise run
    all 16,384 sequences of 256 prompts x n = 64 first)."""
    if window is not None and len(jobs) > window:
        gate = asyncio.Semaphore(window)
        for j in jobs:
            j.gate = gate


def _gate(job: Job) -> contextlib.AbstractAsyncContextManager[Any]:
    return job.gate if job.gate is not None else contextlib.nullcontext()


def finish_error(finish_reason: str | None, error: str | None) -> APIError | None:
    """The API error for a request the engine ended abnormally, if it did."""
    if finish_reason == "error":
        return internal_error(
            "the engine failed while running this request", error or "unknown error", code="engine_error"
        )
    if finish_reason == "abort":
        return APIError(
            "the request was aborted (the server is shutting down or the engine stopped it)",
            status_code=503,
            code="request_aborted",
        )
    return None


def engine_api_error(engine: Any, e: BaseException) -> APIError | None:
    """The API error of an exception an engine request raised: a rejection is a 400 naming the field, a
    RuntimeError while the engine is down a 503; None for anything else."""
    if isinstance(e, RequestRejected):
        return bad_request(str(e), param=e.param, code=e.code)
    if isinstance(e, RuntimeError) and not engine.healthy:
        return APIError(str(e), status_code=503, code="engine_unavailable")
    return None


class ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def _wait_for_disconnect(raw: Request) -> None:
    # FastAPI has read the whole body already, so the next ASGI message can only be the disconnect.
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its generator, at once.

    When the client disconnects, Starlette cancels the sending task; a generator suspended at a
    `yield` would otherwise only be closed when garbage-collected, and its `finally` (which aborts the
    engine request and frees its cache) would run late."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()


async def consume(engine: Any, job: Job, timer: RequestTimer | None) -> Result:
    """Run one engine request to the end (non-streaming)."""
    res = Result(num_prompt_tokens=len(job.prompt_ids))
    if job.after is not None:
        await job.after.wait()
    async with _gate(job):
        await _consume(engine, job, timer, res)
    if res.finish_reason is None:  # the stream ended without a final delta: treat as an engine failure
        res.finish_reason, res.error = "error", "the engine ended the request without a result"
    return res


async def _consume(engine: Any, job: Job, timer: RequestTimer | None, res: Result) -> None:
    agen = engine.generate(job.request_id, job.prompt_ids, job.params, priority=job.priority)
    try:
        async for d in agen:
            if job.first_token is not None:
                job.first_token.set()
            res.token_ids.extend(d.token_ids)
            if d.token_ids:
                res.delta_spans.append((len(d.token_ids), len(d.text)))
            res.text += d.text
            if d.logprobs:
                res.logprobs.extend(d.logprobs)
            if d.token_ids and timer is not None:
                timer.token(d)
            res.num_cached_tokens = d.num_cached_tokens
            res.num_output_tokens = d.num_output_tokens
            if d.prompt_logprobs is not None:
                res.prompt_logprobs = d.prompt_logprobs
            if d.num_prompt_tokens:
                res.num_prompt_tokens = d.num_prompt_tokens
            if d.finished:
                res.finish_reason = d.finish_reason
                res.stop_reason = d.stop_reason
                res.error = d.error
    finally:
        if job.first_token is not None:  # the followers must not wait for a leader that failed
            job.first_token.set()
        await agen.aclose()


def abort_all(engine: Any, jobs: list[Job]) -> None:
    for j in jobs:
        with contextlib.suppress(Exception):
            engine.abort(j.request_id)


async def run_all(engine: Any, raw: Request, jobs: list[Job], timers: list[RequestTimer]) -> list[Result]:
    """Run jobs concurrently; abort them all if the client disconnects first (raises `ClientGone`)."""
    work: asyncio.Future[Any] = asyncio.ensure_future(
        asyncio.gather(*(consume(engine, j, t) for j, t in zip(jobs, timers)))
    )
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work.cancel()
        raise
    finally:
        watcher.cancel()
    if work in done:
        try:
            return work.result()
        except Exception as e:
            # gather() leaves the other requests running: stop them before answering.
            abort_all(engine, jobs)
            err = engine_api_error(engine, e)
            if err is not None:
                raise err from None
            raise
    work.cancel()
    with contextlib.suppress(BaseException):
        await work
    abort_all(engine, jobs)
    raise ClientGone


async def run_whole(
    engine: Any, raw: Request, jobs: list[Job], timers: list[RequestTimer]
) -> list[Result] | None:
    """A non-streaming request's jobs run by `run_all`, each choice's timer closed: the results, or None when
    the client went away first (the route answers 499, each choice ends as an abort); raises the API error
    of the first choice the engine ended abnormally."""
    try:
        results = await run_all(engine, raw, jobs, timers)
    except ClientGone:
        for t, j in zip(timers, jobs):
            t.finish(finish_reason="abort", prompt_tokens=len(j.prompt_ids), output_tokens=0)
        return None
    for res, timer in zip(results, timers):
        timer.finish(
            finish_reason=res.finish_reason,
            prompt_tokens=res.num_prompt_tokens,
            output_tokens=res.num_output_tokens,
        )
        err = finish_error(res.finish_reason, res.error)
        if err is not None:
            raise err
    return results


async def merged(engine: Any, jobs: list[Job]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Deltas of several engine requests as they come, tagged with the job's index."""
    if len(jobs) == 1:
        job = jobs[0]
        agen = engine.generate(job.request_id, job.prompt_ids, job.params, priority=job.priority)
        try:
            async for d in agen:
                yield 0, d
        finally:
            await agen.aclose()
        return
    # each choice hands over one item at a time and waits until it is taken, so what the reader has not read
    # stays merged in the engine's per-request collector (bounded there), not queued here
    ready: asyncio.Queue[int] = asyncio.Queue()  # choices with an item in their slot, each at most once
    slots: list[StreamDelta | BaseException | None] = [None] * len(jobs)  # None in a ready slot: its end
    taken = [asyncio.Event() for _ in jobs]

    async def hand_over(i: int, item: StreamDelta | BaseException | None) -> None:
        slots[i] = item
        ready.put_nowait(i)
        await taken[i].wait()
        taken[i].clear()

    async def pump(i: int, job: Job) -> None:
        try:
            if job.after is not None:
                await job.after.wait()
            async with _gate(job):
                agen = engine.generate(job.request_id, job.prompt_ids, job.params, priority=job.priority)
                async for d in agen:
                    if job.first_token is not None:
                        job.first_token.set()
                    await hand_over(i, d)
            await hand_over(i, None)
        except Exception as e:
            await hand_over(i, e)
        finally:
            if job.first_token is not None:
                job.first_token.set()

    tasks = [asyncio.ensure_future(pump(i, j)) for i, j in enumerate(jobs)]
    try:
        remaining = len(jobs)
        while remaining:
            i = await ready.get()
            item, slots[i] = slots[i], None
            taken[i].set()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


def abort_unfinished(engine: Any, jobs: list[Job], finished: set[int]) -> None:
    for i, j in enumerate(jobs):
        if i not in finished:
            with contextlib.suppress(Exception):
                engine.abort(j.request_id)
