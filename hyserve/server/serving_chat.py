"""`POST /v1/chat/completions`: messages rendered with the chat template, n choices, reasoning and
tool-call parsing of each choice, streamed as chunks or answered whole."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.sampling_params import StructuredOutputsParams
from hyserve.server import structured
from hyserve.server.chat import chat_chars, encode_text, render_chat_prompt, system_texts
from hyserve.server.chat_output import ChatOutput, output_maker
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
    ChatChoiceLogprobs,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobToken,
    ChatLogprobTop,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaToolCall,
    ResponseFunctionCall,
    ResponseToolCall,
    UsageInfo,
)
from hyserve.server.reasoning import thinking_enabled
from hyserve.server.state import (
    ERROR_RESPONSES,
    LOGPROB_FLOOR,
    OFF_LOOP_CHARS,
    AppState,
    StreamChunks,
    sse,
    usage_info,
)
from hyserve.server.structured import ForcedToolOutput
from hyserve.server.tool_parser import ParsedToolCall


def chat_logprobs(state: AppState, lps: list[TokenLogprob], top_n: int) -> ChatChoiceLogprobs:
    content = []
    for lp in lps:
        s = state.token_text(lp.token_id)
        tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            ChatLogprobToken(
                token=s,
                logprob=max(lp.logprob, LOGPROB_FLOOR),
                bytes=state.token_bytes(lp.token_id),
                top_logprobs=[
                    ChatLogprobTop(
                        token=state.token_text(t), logprob=max(v, LOGPROB_FLOOR), bytes=state.token_bytes(t)
                    )
                    for t, v in tops
                ],
            )
        )
    return ChatChoiceLogprobs(content=content)


def tool_calls_out(calls: list[ParsedToolCall]) -> list[ResponseToolCall]:
    return [
        ResponseToolCall(id=c.id, function=ResponseFunctionCall(name=c.name, arguments=c.arguments))
        for c in calls
    ]


def _output_constraint(
    req: ChatCompletionRequest, start: str | None, parallel: bool
) -> tuple[tuple[StructuredOutputsParams, str | None] | None, StructuredOutputsParams | None, str]:
    """The request's tool_choice constraint (`structured.tool_choice_spec`), its one output constraint of
    response_format, structured_outputs and tool_choice, and the parameter a grammar error names."""
    forced = structured.tool_choice_spec(req.tools, req.tool_choice, parallel, start)
    spec = structured.one_constraint(
        ("response_format", structured.from_response_format(req.response_format, start)),
        (
            "structured_outputs",
            structured.from_extra(req.structured_outputs, start) if req.structured_outputs else None,
        ),
        ("tool_choice", forced[0] if forced else None),
    )
    grammar_param = (
        "tool_choice"
        if forced
        else "response_format"
        if req.response_format is not None
        else "structured_outputs"
    )
    return forced, spec, grammar_param


async def create_chat_completion(state: AppState, req: ChatCompletionRequest, raw: Request) -> Response:
    engine, opts, tok = state.engine, state.opts, state.tok
    state.check_model(req.model)
    state.check_sampling_fields(req)
    state.check_healthy()
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    tc = req.tool_choice
    think = thinking_enabled(req.chat_template_kwargs, system_texts(req.messages))
    start = structured.start_marker(opts.reasoning_parser, think)
    parallel = req.parallel_tool_calls is not False
    forced, spec, grammar_param = _output_constraint(req, start, parallel)

    def render_and_encode() -> tuple[str, list[int]]:
        text = render_chat_prompt(
            tok,
            req.messages,
            tools=req.tools,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
            documents=req.documents,
        )
        state.check_prompt_chars(len(text), "messages")  # the tools and template count too
        return text, encode_text(tok, text, add_special_tokens=False, param="messages")

    n_chars = chat_chars(req.messages)
    state.check_prompt_chars(n_chars, "messages")
    text, prompt_ids = await state.off_loop(render_and_encode, n_chars >= OFF_LOOP_CHARS)
    top_n = req.top_logprobs or 0
    params = state.sampling_params(
        req,
        len(prompt_ids),
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        top_n if req.logprobs else None,
        logprobs_param="top_logprobs",
        structured_outputs=spec,
    )
    await state.validate_async(prompt_ids, params, "messages", grammar_param, priority=req.priority)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    n = req.n or 1
    jobs = [
        Job(
            request_id if n == 1 else f"{request_id}-{k}",
            prompt_ids,
            choice_params(params, k),
            text,
            priority=req.priority,
        )
        for k in range(n)
    ]
    stagger_choices(jobs, n, state.stagger_min)
    pace_jobs(jobs, state.fanout_window)
    output = output_maker(
        reasoning_parser=opts.reasoning_parser,
        tool_parser=opts.tool_parser,
        think=think,
        tools=req.tools,
        tool_choice=tc,
        parallel=parallel,
        forced=forced,
    )

    model_name = engine.model_name  # the first served name, whichever the request used (as vLLM)
    timers = [RequestTimer(state.metrics, j.params.max_tokens) for j in jobs]
    if req.stream:
        so = req.stream_options
        return SSEResponse(
            chat_stream(
                state,
                request_id,
                jobs,
                model_name,
                [output() for _ in jobs],
                timers,
                top_n,
                include_usage=bool(so and so.include_usage),
                continuous=bool(so and so.continuous_usage_stats),
                with_logprobs=bool(req.logprobs),
            ),
            headers=SSE_HEADERS,
        )
    results = await run_whole(engine, raw, jobs, timers)
    if results is None:
        return Response(status_code=499)
    return await state.off_loop(
        lambda: chat_reply(state, req, request_id, model_name, results, top_n, output),
        state.large_reply(sum(r.num_output_tokens for r in results), top_n),
    )


def chat_reply(
    state: AppState,
    req: ChatCompletionRequest,
    request_id: str,
    model_name: str,
    results: list[Result],
    top_n: int,
    output: Callable[[], ChatOutput | ForcedToolOutput],
) -> JSONResponse:
    choices = []
    for k, res in enumerate(results):
        reasoning, content, calls = output().parse(res.text)
        finish = "tool_calls" if calls and res.finish_reason == "stop" else res.finish_reason
        choices.append(
            ChatCompletionChoice(
                index=k,
                message=ChatResponseMessage(
                    content=content if (content or not (reasoning or calls)) else None,
                    reasoning_content=reasoning or None,
                    tool_calls=tool_calls_out(calls) or None,
                ),
                logprobs=chat_logprobs(state, res.logprobs, top_n) if req.logprobs else None,
                finish_reason=finish,
                stop_reason=res.stop_reason,
            )
        )
    first = results[0]  # the prompt counts once however many choices there are (OpenAI's usage)
    resp = ChatCompletionResponse(
        id=request_id,
        model=model_name,
        choices=choices,
        usage=usage_info(
            first.num_prompt_tokens, sum(r.num_output_tokens for r in results), first.num_cached_tokens
        ),
    )
    body = resp.model_dump(mode="json")
    for c in body["choices"]:  # OpenAI omits tool_calls from a message that has none
        if c["message"]["tool_calls"] is None:
            del c["message"]["tool_calls"]
    return JSONResponse(body)


def _stream_delta(
    n_calls: list[int], k: int, r: str, c: str, calls: list[ParsedToolCall]
) -> ChatDelta | None:
    """Choice k's delta of reasoning, content and new tool calls (numbered on from `n_calls[k]`), or None."""
    tc = None
    if calls:
        tc = [
            DeltaToolCall(
                index=n_calls[k] + j,
                id=call.id,
                type="function",
                function=ResponseFunctionCall(name=call.name, arguments=call.arguments),
            )
            for j, call in enumerate(calls)
        ]
        n_calls[k] += len(calls)
    if not (r or c or tc):
        return None
    return ChatDelta(reasoning_content=r or None, content=c or None, tool_calls=tc)


class _ChatChunks(StreamChunks):
    """The chunks of one chat stream; per-token chunks (text only: no role, tool calls, logprobs, finish or
    running usage) are formatted directly."""

    object_name = "chat.completion.chunk"

    def chunk(
        self,
        k: int,
        delta: ChatDelta,
        *,
        logprobs: ChatChoiceLogprobs | None = None,
        finish: str | None = None,
        stop_reason: int | str | None = None,
    ) -> str:
        if (
            logprobs is None
            and finish is None
            and stop_reason is None
            and not self.continuous
            and delta.role is None
            and delta.tool_calls is None
        ):
            fields = {
                key: val
                for key, val in (("content", delta.content), ("reasoning_content", delta.reasoning_content))
                if val is not None
            }
            return sse(
                f'{self.token_head}{k}, "delta": {json.dumps(fields)}, "logprobs": null, '
                f'"finish_reason": null, "stop_reason": null}}]{self.token_tail}'
            )
        c = ChatCompletionChunk(
            id=self.request_id,
            created=self.created,
            model=self.model_name,
            choices=[
                ChatStreamChoice(
                    index=k, delta=delta, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason
                )
            ],
            usage=self.usage() if self.continuous else None,
        )
        d = c.model_dump(mode="json")
        d["choices"][0]["delta"] = {
            key: val for key, val in d["choices"][0]["delta"].items() if val is not None
        }
        if not (self.include_usage or self.continuous):
            d.pop("usage")
        return sse(json.dumps(d))


async def chat_stream(
    state: AppState,
    request_id: str,
    jobs: list[Job],
    model_name: str,
    outs: list[ChatOutput | ForcedToolOutput],
    timers: list[RequestTimer],
    top_n: int,
    *,
    include_usage: bool,
    continuous: bool,
    with_logprobs: bool,
) -> AsyncIterator[str]:
    """One SSE stream for the n choices of a chat request (choice k = job k), interleaved as they come."""
    engine = state.engine
    n_jobs = len(jobs)
    n_prompt = len(jobs[0].prompt_ids)
    n_out = [0] * n_jobs
    n_cached = 0
    finished: set[int] = set()
    finish_reasons: dict[int, str | None] = {}
    n_calls = [0] * n_jobs

    def usage() -> UsageInfo:
        return usage_info(n_prompt, sum(n_out), n_cached)

    chunks = _ChatChunks(
        request_id, model_name, include_usage=include_usage, continuous=continuous, usage=usage
    )
    chunk = chunks.chunk

    try:
        for k in range(n_jobs):
            yield chunk(k, ChatDelta(role="assistant", content=""))
        async for k, d in merged(engine, jobs):
            if d.token_ids:
                timers[k].token(d)
            n_out[k] = d.num_output_tokens
            if k == 0:
                n_cached = d.num_cached_tokens
                n_prompt = d.num_prompt_tokens or n_prompt
            out = outs[k]
            r, c, calls = out.feed(d.text) if d.text else ("", "", [])
            lp = chat_logprobs(state, d.logprobs, top_n) if (with_logprobs and d.logprobs) else None
            if d.finished:
                finished.add(k)
                finish_reasons[k] = d.finish_reason
                err = finish_error(d.finish_reason, d.error)
                if err is not None:
                    yield sse_error_event(err)
                    break
                r2, c2, calls2 = out.finish()
                r, c, calls = r + r2, c + c2, calls + calls2
            delta = _stream_delta(n_calls, k, r, c, calls)
            if delta is not None or lp is not None:
                yield chunk(k, delta or ChatDelta(), logprobs=lp)
            if d.finished:
                reason = "tool_calls" if (out.calls and d.finish_reason == "stop") else d.finish_reason
                yield chunk(k, ChatDelta(), finish=reason, stop_reason=d.stop_reason)
        else:
            if include_usage:
                yield chunks.usage_chunk()
        yield sse("[DONE]")
    except Exception as e:
        yield sse_error_event(state.stream_failure(e))
        yield sse("[DONE]")
    finally:
        abort_unfinished(engine, jobs, finished)
        for k, t in enumerate(timers):
            t.finish(
                finish_reason=finish_reasons.get(k) or "abort", prompt_tokens=n_prompt, output_tokens=n_out[k]
            )


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(state, req, raw)
