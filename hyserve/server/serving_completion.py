"""`POST /v1/completions`: text or token-id prompts (one or a batch), n choices each, `echo` with prompt
logprobs (lm-eval's loglikelihood requests), streamed as chunks or answered whole."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hyserve.engine.outputs import TokenLogprob
from hyserve.server import structured
from hyserve.server.body import TokenIds
from hyserve.server.chat import encode_text
from hyserve.server.errors import bad_request, sse_error_event
from hyserve.server.generation import (
    SSE_HEADERS,
    Job,
    Result,
    SSEResponse,
    abort_unfinished,
    choice_params,
    finish_error,
    merged,
    pace_jobs,
    run_whole,
    stagger_choices,
)
from hyserve.server.metrics import RequestTimer
from hyserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from hyserve.server.state import (
    ERROR_RESPONSES,
    LOGPROB_FLOOR,
    OFF_LOOP_CHARS,
    AppState,
    StreamChunks,
    sse,
    usage_info,
)

# at most this many prompts in one request
MAX_PROMPTS = 256


def prompt_count(req: CompletionRequest) -> int:
    """How many prompts the request holds (before tokenizing any)."""
    p = req.prompt
    if isinstance(p, str | TokenIds) or not p or type(p[0]) is int:
        return 1
    return len(p)


def completion_prompts(state: AppState, req: CompletionRequest) -> list[tuple[list[int], str | None]]:
    """The request's prompts as (token ids, text or None for token-id prompts)."""
    p = req.prompt
    items: list[str | list[int]]
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, TokenIds) or (p and type(p[0]) is int):  # one token-id prompt (validated as ids)
        items = [p]  # type: ignore[list-item]
    else:
        items = list(p)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", param="prompt")
    out: list[tuple[list[int], str | None]] = []
    for i, item in enumerate(items):
        param = "prompt" if len(items) == 1 else f"prompt[{i}]"
        if isinstance(item, str):
            ids = encode_text(state.tok, item, add_special_tokens=req.add_special_tokens, param=param)
            out.append((ids, item))
        else:
            if len(item) > state.engine.max_seq_len:  # before the engine looks at each id
                raise bad_request(
                    f"{param} has {len(item)} tokens, more than max_seq_len = "
                    f"{state.engine.max_seq_len}; shorten the prompt",
                    param=param,
                    code="context_length_exceeded",
                )
            out.append((item if isinstance(item, TokenIds) else list(item), None))
    return out


def delta_offsets(state: AppState, token_ids: list[int], start: int, text: str) -> list[int]:
    """`text_offset` of the tokens of one engine delta whose text is `text`, starting at `start` in the
    choice's text: each token's display text advances the offset, never past the delta's own text (a
    partial UTF-8 character shows as '\\xNN' but adds no text until it completes), so offsets are
    monotonic and point into the text the client has."""
    out = []
    pos = 0
    for t in token_ids:
        out.append(start + min(pos, len(text)))
        pos += len(state.token_text(t))
    return out


def prompt_offsets(state: AppState, ids: list[int], ptext: str) -> list[int]:
    """`text_offset` of the echoed prompt's tokens within `ptext`, the text echoed back. Incremental
    detokenisation gives each token's start in decode(ids); a text prompt's echo is the client's own text,
    without the special tokens the tokenizer added in front (`<s>`), so those starts shift back to 0.
    Clamped into [previous offset, len(ptext)]: monotonic whatever the tokenizer's normalisation did."""
    tok = state.tok
    if tok is None or not ids:
        return [0] * len(ids)
    det = tok.incremental_detokenizer(skip_special_tokens=False)
    starts = []
    for t in ids:
        starts.append(len(det.text))
        det.feed(t)
    det.flush()
    shift = len(det.text) - len(ptext) if det.text.endswith(ptext) else 0
    out, prev = [], 0
    for s0 in starts:
        prev = min(max(prev, s0 - shift), len(ptext))
        out.append(prev)
    return out


def completion_logprobs(
    state: AppState, lps: list[TokenLogprob], top_n: int, offsets: list[int]
) -> CompletionLogprobs:
    """Generated tokens' logprobs; `offsets[i]` is token i's text_offset."""
    res = CompletionLogprobs()
    for lp, off in zip(lps, offsets):
        s = state.token_text(lp.token_id)
        res.tokens.append(s)
        res.token_logprobs.append(max(lp.logprob, LOGPROB_FLOOR))
        tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
        res.top_logprobs.append(
            {state.token_text(t): max(v, LOGPROB_FLOOR) for t, v in tops} if top_n else None
        )
        res.text_offset.append(off)
    return res


def echo_logprobs(
    state: AppState, prompt_ids: list[int], plps: list[TokenLogprob | None] | None, top_n: int, ptext: str
) -> CompletionLogprobs:
    """The echoed prompt's logprobs: null for the first token (nothing predicts it), as OpenAI."""
    res = CompletionLogprobs()
    for i, (t, off) in enumerate(zip(prompt_ids, prompt_offsets(state, prompt_ids, ptext))):
        s = state.token_text(t)
        lp = plps[i] if plps is not None and i < len(plps) else None
        res.tokens.append(s)
        res.token_logprobs.append(None if lp is None else max(lp.logprob, LOGPROB_FLOOR))
        if lp is None or not top_n:
            res.top_logprobs.append(None)
        else:
            tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
            res.top_logprobs.append({state.token_text(tt): max(v, LOGPROB_FLOOR) for tt, v in tops})
        res.text_offset.append(off)
    return res


def prompt_echo_text(state: AppState, ids: list[int], text: str | None) -> str:
    if text is not None:
        return text
    if state.tok is None:
        return ""
    return state.tok.decode(ids, skip_special_tokens=False)


async def create_completion(state: AppState, req: CompletionRequest, raw: Request) -> Response:
    engine = state.engine
    state.check_model(req.model)
    state.check_sampling_fields(req, prompt_count(req))
    state.check_healthy()
    if req.suffix:
        raise bad_request("suffix is not supported by this server", param="suffix")
    if req.best_of not in (None, 1):
        raise bad_request(f"best_of must be 1, got {req.best_of}", param="best_of")
    prompt_only = req.max_tokens == 0
    if prompt_only and not req.echo:
        raise bad_request(
            "max_tokens must be >= 1 (0 is only allowed with echo: the prompt back, with its "
            "logprobs, and nothing generated)",
            param="max_tokens",
        )
    p0 = req.prompt
    texts = (
        [p0]
        if isinstance(p0, str)
        else []
        if not p0 or type(p0[0]) is int
        else [p for p in p0 if isinstance(p, str)]
    )
    for i, p in enumerate(texts):
        state.check_prompt_chars(len(p), "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]")
    prompts = await state.off_loop(
        lambda: completion_prompts(state, req), sum(len(p) for p in texts) >= OFF_LOOP_CHARS
    )
    spec = structured.from_extra(req.structured_outputs, None) if req.structured_outputs else None
    base = f"cmpl-{uuid.uuid4().hex}"
    n = req.n or 1
    jobs: list[Job] = []  # choice index = prompt index * n + k, as OpenAI orders them
    for i, (ids, text) in enumerate(prompts):
        # echo + logprobs: the prompt tokens' own logprobs too (lm-eval style loglikelihood requests)
        params = state.sampling_params(
            req,
            len(ids),
            1 if prompt_only else req.max_tokens,
            req.logprobs,
            req.logprobs if req.echo else None,
            structured_outputs=spec,
        )
        await state.validate_async(
            ids, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]", priority=req.priority
        )
        for k in range(n):
            rid = base if len(prompts) * n == 1 else f"{base}-{i * n + k}"
            jobs.append(Job(rid, ids, choice_params(params, k), text, priority=req.priority))
    stagger_choices(jobs, n, state.stagger_min)
    pace_jobs(jobs, state.fanout_window)
    model_name = engine.model_name  # the first served name, whichever the request used (as vLLM)
    timers = [RequestTimer(state.metrics, j.params.max_tokens) for j in jobs]
    top_n = req.logprobs or 0
    if req.stream:
        so = req.stream_options
        return SSEResponse(
            completion_stream(
                state,
                base,
                jobs,
                model_name,
                timers,
                req,
                include_usage=bool(so and so.include_usage),
                continuous=bool(so and so.continuous_usage_stats),
            ),
            headers=SSE_HEADERS,
        )
    results = await run_whole(engine, raw, jobs, timers)
    if results is None:
        return Response(status_code=499)
    return await state.off_loop(
        lambda: completion_reply(state, req, base, model_name, jobs, results, top_n, n, prompt_only),
        state.large_reply(sum(r.num_output_tokens for r in results), top_n),
    )


def res_offsets(state: AppState, res: Result) -> list[int]:
    """The generated tokens' text_offset in `res.text`, delta by delta as a stream gives them."""
    out: list[int] = []
    i = start = 0
    for n_tok, n_chars in res.delta_spans:
        out += delta_offsets(state, res.token_ids[i : i + n_tok], start, res.text[start : start + n_chars])
        i += n_tok
        start += n_chars
    return out


def completion_reply(
    state: AppState,
    req: CompletionRequest,
    base: str,
    model_name: str,
    jobs: list[Job],
    results: list[Result],
    top_n: int,
    n: int,
    prompt_only: bool,
) -> JSONResponse:
    choices = []
    for i, (job, res) in enumerate(zip(jobs, results)):
        if prompt_only:  # the one token the engine generated is not part of the answer
            res.text, res.logprobs, res.num_output_tokens, res.finish_reason = "", [], 0, "length"
            res.stop_reason = None
        text = res.text
        lp = None
        if req.echo:
            ptext = prompt_echo_text(state, job.prompt_ids, job.prompt_text)
            text = ptext + text
            if req.logprobs is not None:
                lp = echo_logprobs(state, job.prompt_ids, res.prompt_logprobs, top_n, ptext)
                gen = completion_logprobs(
                    state, res.logprobs, top_n, [len(ptext) + o for o in res_offsets(state, res)]
                )
                lp.tokens += gen.tokens
                lp.token_logprobs += gen.token_logprobs
                lp.top_logprobs += gen.top_logprobs
                lp.text_offset += gen.text_offset
        elif req.logprobs is not None:
            lp = completion_logprobs(state, res.logprobs, top_n, res_offsets(state, res))
        choices.append(
            CompletionChoice(
                index=i, text=text, logprobs=lp, finish_reason=res.finish_reason, stop_reason=res.stop_reason
            )
        )
    firsts = results[::n]  # the prompt counts once however many choices it has (OpenAI's usage)
    usage = usage_info(
        sum(r.num_prompt_tokens for r in firsts),
        sum(r.num_output_tokens for r in results),
        sum(r.num_cached_tokens for r in firsts),
    )
    resp = CompletionResponse(id=base, model=model_name, choices=choices, usage=usage)
    return JSONResponse(resp.model_dump(mode="json"))


class _CompletionChunks(StreamChunks):
    """The chunks of one completions stream; the per-token chunk (no logprobs, not the last, no usage) is
    formatted directly."""

    object_name = "text_completion"

    def chunk(
        self,
        i: int,
        text: str,
        lp: CompletionLogprobs | None,
        finish: str | None = None,
        stop_reason: int | str | None = None,
    ) -> str:
        if lp is None and finish is None and stop_reason is None and not self.continuous:
            return sse(
                f'{self.token_head}{i}, "text": {json.dumps(text)}, "logprobs": null, '
                f'"finish_reason": null, "stop_reason": null}}]{self.token_tail}'
            )
        c = CompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=[
                CompletionChoice(
                    index=i, text=text, logprobs=lp, finish_reason=finish, stop_reason=stop_reason
                )
            ],
            usage=self.usage() if self.continuous else None,
        )
        d = c.model_dump(mode="json")
        if not (self.include_usage or self.continuous):
            d.pop("usage")
        return sse(json.dumps(d))


async def completion_stream(
    state: AppState,
    base: str,
    jobs: list[Job],
    model_name: str,
    timers: list[RequestTimer],
    req: CompletionRequest,
    *,
    include_usage: bool,
    continuous: bool,
) -> AsyncIterator[str]:
    engine = state.engine
    top_n = req.logprobs or 0
    prompt_only = req.max_tokens == 0
    n_prompt = [len(j.prompt_ids) for j in jobs]
    n_out = [0] * len(jobs)
    n_cached = [0] * len(jobs)
    offsets = [0] * len(jobs)
    finished: set[int] = set()
    reasons: dict[int, str | None] = {}

    per_prompt = req.n or 1

    def usage() -> UsageInfo:  # a prompt counts once however many choices it has
        return usage_info(sum(n_prompt[::per_prompt]), sum(n_out), sum(n_cached[::per_prompt]))

    chunks = _CompletionChunks(
        base, model_name, include_usage=include_usage, continuous=continuous, usage=usage
    )
    chunk = chunks.chunk

    try:
        # echoed prompts go first; with logprobs, each waits for its request's first delta, which
        # carries the prompt logprobs
        echo_pending = set(range(len(jobs))) if req.echo else set()
        if req.echo and req.logprobs is None:
            for i, j in enumerate(jobs):
                ptext = prompt_echo_text(state, j.prompt_ids, j.prompt_text)
                offsets[i] = len(ptext)
                yield chunk(i, ptext, None)
            echo_pending.clear()
        async for i, d in merged(engine, jobs):
            if i in echo_pending:
                echo_pending.discard(i)
                ptext = prompt_echo_text(state, jobs[i].prompt_ids, jobs[i].prompt_text)
                offsets[i] = len(ptext)
                yield chunk(
                    i, ptext, echo_logprobs(state, jobs[i].prompt_ids, d.prompt_logprobs, top_n, ptext)
                )
            if d.token_ids:
                timers[i].token(d)
            n_out[i], n_cached[i] = d.num_output_tokens, d.num_cached_tokens
            n_prompt[i] = d.num_prompt_tokens or n_prompt[i]
            if d.finished:
                finished.add(i)
                reasons[i] = d.finish_reason
                err = finish_error(d.finish_reason, d.error)
                if err is not None:
                    yield sse_error_event(err)
                    break
            if prompt_only:  # echo with max_tokens 0: the generated token is not part of the answer
                n_out[i] = 0
                if d.finished:
                    reasons[i] = "length"
                    yield chunk(i, "", None, "length", None)
                continue
            lp = None
            if req.logprobs is not None and d.logprobs:
                lp = completion_logprobs(
                    state, d.logprobs, top_n, delta_offsets(state, d.token_ids, offsets[i], d.text)
                )
            offsets[i] += len(d.text)
            # one chunk per engine step that produced tokens, even when they decode to no text yet (a
            # partial UTF-8 sequence, or token ids without a tokenizer), as vLLM streams: clients time
            # tokens by chunks
            if d.text or d.token_ids or lp is not None or d.finished:
                yield chunk(
                    i,
                    d.text,
                    lp,
                    d.finish_reason if d.finished else None,
                    d.stop_reason if d.finished else None,
                )
        else:
            if include_usage:
                yield chunks.usage_chunk()
        yield sse("[DONE]")
    except Exception as e:
        yield sse_error_event(state.stream_failure(e))
        yield sse("[DONE]")
    finally:
        abort_unfinished(engine, jobs, finished)
        for i, t in enumerate(timers):
            t.finish(
                finish_reason=reasons.get(i) or "abort", prompt_tokens=n_prompt[i], output_tokens=n_out[i]
            )


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await create_completion(state, req, raw)
