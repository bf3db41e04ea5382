"""`POST /v1/responses`: the OpenAI Responses API over the chat path.

`input` (a string, or a list of messages, function calls, their outputs and reasoning items) and
`instructions` become chat messages rendered with the checkpoint's template; the output text goes through
the same reasoning split and tool-call parser as chat (`chat_output.py`) and comes back as output items:

    reasoning      {"type": "reasoning", "content": [{"type": "reasoning_text", "text": ...}], "summary": []}
    message        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": ...}]}
    function_call  {"type": "function_call", "call_id": ..., "name": ..., "arguments": "{...}"}

Streaming sends the API's typed events (`response.created`, `response.in_progress`, per item
`response.output_item.added` ... `.done`, `response.reasoning_text.delta`, `response.output_text.delta`,
`response.function_call_arguments.delta/.done`, then `response.completed` or `response.incomplete`; an
engine failure after the 200 is `response.failed`). A whole reply replays the engine's deltas through the
same `_Builder`, so the two cannot disagree. `text.format` json_schema / json_object and
tool_choice "required" / a named function are structured outputs (`structured.py`). Nothing is stored:
`previous_response_id`, background mode, hosted tools and the other features this server does not have are
a 400 that names them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hyserve.server import structured
from hyserve.server.chat import chat_chars, encode_text, render_chat_prompt, system_texts
from hyserve.server.chat_output import ChatOutput, output_maker
from hyserve.server.errors import bad_request
from hyserve.server.generation import (
    SSE_HEADERS,
    Job,
    SSEResponse,
    abort_unfinished,
    finish_error,
    merged,
    run_whole,
)
from hyserve.server.metrics import RequestTimer
from hyserve.server.protocol import (
    ChatMessage,
    ChatTool,
    FunctionCall,
    FunctionDefinition,
    ResponsesRequest,
    ResponsesResponse,
    ResponsesUsage,
    ToolCall,
    now,
)
from hyserve.server.reasoning import thinking_enabled
from hyserve.server.state import ERROR_RESPONSES, OFF_LOOP_CHARS, AppState
from hyserve.server.structured import ForcedToolOutput
from hyserve.server.tool_parser import ParsedToolCall

_TEXT_PART_TYPES = ("input_text", "output_text", "text")
MAX_INPUT_ITEMS = 4096


# ---- request -> chat messages ------------------------------------------------------------------------------


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise bad_request(f"{where} must be a content part object, got {type(part).__name__}", param=where)
    typ = part.get("type")
    if typ not in _TEXT_PART_TYPES and typ != "refusal":
        raise bad_request(
            f"{where}.type {typ!r} is not supported: this server serves text models and accepts "
            f"{list(_TEXT_PART_TYPES)} parts",
            param=f"{where}.type",
        )
    text = part.get("refusal" if typ == "refusal" else "text")
    if not isinstance(text, str):
        raise bad_request(f"{where}.text must be a string", param=f"{where}.text")
    return text


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_part_text(p, f"{where}[{j}]") for j, p in enumerate(content))
    raise bad_request(f"{where} must be a string or a list of content parts", param=where)


def _str_field(item: dict[str, Any], key: str, where: str) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return v


def input_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """`instructions` + `input` as chat messages (instructions as the system message, as OpenAI treats
    them; function calls join the assistant turn before them; reasoning items go with the next assistant
    message as its reasoning_content)."""
    msgs: list[ChatMessage] = []
    if req.instructions:
        msgs.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        msgs.append(ChatMessage(role="user", content=req.input))
        return msgs
    if not req.input:
        raise bad_request("input must not be empty", param="input")
    if len(req.input) > MAX_INPUT_ITEMS:
        raise bad_request(f"input has {len(req.input)} items, more than {MAX_INPUT_ITEMS}", param="input")
    reasoning: str | None = None
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        typ = item.get("type", "message" if "role" in item else None)
        if typ == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"{where}.role must be one of user, assistant, system, developer; got {role!r}",
                    param=f"{where}.role",
                )
            text = _content_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                msgs.append(ChatMessage(role="assistant", content=text, reasoning_content=reasoning))
                reasoning = None
            else:
                msgs.append(ChatMessage(role=role, content=text))
        elif typ == "function_call":
            call = ToolCall(
                id=_str_field(item, "call_id", where),
                function=FunctionCall(
                    name=_str_field(item, "name", where), arguments=_str_field(item, "arguments", where)
                ),
            )
            last = msgs[-1] if msgs else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                msgs.append(
                    ChatMessage(
                        role="assistant", content=None, tool_calls=[call], reasoning_content=reasoning
                    )
                )
                reasoning = None
        elif typ == "function_call_output":
            msgs.append(
                ChatMessage(
                    role="tool",
                    tool_call_id=_str_field(item, "call_id", where),
                    content=_content_text(item.get("output"), f"{where}.output"),
                )
            )
        elif typ == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = _content_text(parts, f"{where}.content") if parts else None
        else:
            raise bad_request(
                f"{where}.type {typ!r} is not supported; input items may be message, function_call, "
                "function_call_output or reasoning",
                param=f"{where}.type",
            )
    if not any(m.role != "system" for m in msgs):
        raise bad_request("input has no user, assistant or tool message", param="input")
    return msgs


def chat_tools(req: ResponsesRequest) -> list[ChatTool] | None:
    if not req.tools:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise bad_request(
                f"tools[{i}].type {t.type!r} is not supported: this server runs no hosted tools; "
                "only function tools",
                param=f"tools[{i}].type",
            )
        if not t.name:
            raise bad_request(f"tools[{i}].name is required", param=f"tools[{i}].name")
        out.append(
            ChatTool(
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                )
            )
        )
    return out


def check_supported(req: ResponsesRequest) -> None:
    """What the Responses API has and this server does not: a 400 each, naming it."""
    no_state = "responses are not stored here: send the whole conversation in `input`"
    for name, value, why in (
        ("previous_response_id", req.previous_response_id, no_state),
        ("conversation", req.conversation, no_state),
        ("prompt", req.prompt, "stored prompt templates are not supported; send `instructions` and `input`"),
        ("background", req.background or None, "background mode is not supported"),
        ("max_tool_calls", req.max_tool_calls, "max_tool_calls is not supported"),
        (
            "top_logprobs",
            req.top_logprobs,
            "logprobs are not served by /v1/responses; use /v1/chat/completions",
        ),
    ):
        if value is not None:
            raise bad_request(f"{name}: {why}", param=name)
    if req.store:
        raise bad_request(f"store: {no_state} (send store: false)", param="store")
    if req.include:
        raise bad_request(
            f"include {req.include!r} is not supported (no encrypted reasoning, no logprobs here)",
            param="include",
        )
    if req.truncation not in (None, "disabled"):
        raise bad_request(
            f"truncation {req.truncation!r} is not supported; a prompt longer than max_seq_len is a 400",
            param="truncation",
        )
    if req.n not in (None, 1):
        raise bad_request("n is not a Responses API field (one response per request)", param="n")


def _thinking(req: ResponsesRequest, msgs: list[ChatMessage]) -> tuple[bool, dict[str, Any] | None]:
    """Whether the model thinks, and the template kwargs: `reasoning.effort` "none" / "minimal" turns
    Nemotron's thinking off (`enable_thinking: false`) unless chat_template_kwargs says otherwise."""
    kwargs = dict(req.chat_template_kwargs or {})
    effort = req.reasoning.effort if req.reasoning else None
    if effort in ("none", "minimal") and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = False
    return thinking_enabled(kwargs, system_texts(msgs)), (kwargs or None)


# ---- output items and events -------------------------------------------------------------------------------


def _rid(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Builder:
    """Output items of one response, built incrementally from (reasoning, content, calls) pieces; each
    change is also returned as the stream's events (`type` + fields, sequence numbers added by the caller)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the reasoning or message item text is still flowing into
        # a message's trailing whitespace, held until more text follows: dropped before a function call (the
        # tool parser's framing), sent at the end
        self._held = ""

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        idx = len(self.items) - 1
        part = item["content"][0]
        item["status"] = status
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        done: dict[str, Any] = {
            "type": f"response.{kind}.done",
            "item_id": item["id"],
            "output_index": idx,
            "content_index": 0,
            "text": part["text"],
        }
        if kind == "output_text":
            done["logprobs"] = []
        return [
            done,
            {
                "type": "response.content_part.done",
                "item_id": item["id"],
                "output_index": idx,
                "content_index": 0,
                "part": dict(part),
            },
            {"type": "response.output_item.done", "output_index": idx, "item": _copy(item)},
        ]

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            item: dict[str, Any]
            if kind == "reasoning":
                item = {
                    "type": "reasoning",
                    "id": _rid("rs"),
                    "summary": [],
                    "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}],
                }
            else:
                item = {
                    "type": "message",
                    "id": _rid("msg"),
                    "role": "assistant",
                    "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
                }
            self.items.append(item)
            self._open = item
            added = _copy(item)
            added["content"] = []
            idx = len(self.items) - 1
            events += [
                {"type": "response.output_item.added", "output_index": idx, "item": added},
                {
                    "type": "response.content_part.added",
                    "item_id": item["id"],
                    "output_index": idx,
                    "content_index": 0,
                    "part": dict(item["content"][0]),
                },
            ]
        item = self._open
        assert item is not None
        item["content"][0]["text"] += text
        delta: dict[str, Any] = {
            "type": f"response.{'reasoning_text' if kind == 'reasoning' else 'output_text'}.delta",
            "item_id": item["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
            "delta": text,
        }
        if kind == "message":
            delta["logprobs"] = []
        return [*events, delta]

    def _call(self, call: ParsedToolCall) -> list[dict[str, Any]]:
        events = self._close()
        item = {
            "type": "function_call",
            "id": _rid("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        self.items.append(item)
        idx = len(self.items) - 1
        return [
            *events,
            {
                "type": "response.output_item.added",
                "output_index": idx,
                "item": {**item, "arguments": "", "status": "in_progress"},
            },
            {
                "type": "response.function_call_arguments.delta",
                "item_id": item["id"],
                "output_index": idx,
                "delta": call.arguments,
            },
            {
                "type": "response.function_call_arguments.done",
                "item_id": item["id"],
                "output_index": idx,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "response.output_item.done", "output_index": idx, "item": _copy(item)},
        ]

    def feed(self, reasoning: str, content: str, calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if reasoning:
            events += self._text("reasoning", reasoning)
        if content:
            text = self._held + content
            body = text.rstrip()
            self._held = text[len(body) :]
            if body:
                events += self._text("message", body)
        if calls:
            self._held = ""
        for c in calls:
            events += self._call(c)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._held and self._open is not None and self._open["type"] == "message":
            events += self._text("message", self._held)
        self._held = ""
        return events + self._close("completed" if status == "completed" else "incomplete")


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(item))


class _Run:
    """One response: its parser, builder and counters, shared by the streaming and whole paths."""

    def __init__(
        self,
        state: AppState,
        req: ResponsesRequest,
        response_id: str,
        model_name: str,
        out: ChatOutput | ForcedToolOutput,
        think: bool,
        tools: list[ChatTool] | None,
        n_prompt: int,
    ) -> None:
        self.state, self.req, self.id, self.model_name = state, req, response_id, model_name
        self.out = out
        self.think = think
        self.tools = tools
        self.builder = _Builder()
        self.created = now()
        self.n_prompt = n_prompt
        self.n_cached = 0
        self.n_out = 0
        self.reasoning_tokens = 0
        self.finish_reason: str | None = None

    def feed_delta(self, text: str, n_tokens: int) -> list[dict[str, Any]]:
        in_reasoning = self.out.reasoning is not None and self.think and not self.out.reasoning.saw_end
        r, c, calls = self.out.feed(text) if text else ("", "", [])
        if in_reasoning:  # tokens up to and including the one that closes the thinking section
            self.reasoning_tokens += n_tokens
        return self.builder.feed(r, c, calls)

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        self.finish_reason = finish_reason
        r, c, calls = self.out.finish()
        events = self.builder.feed(r, c, calls)
        return events + self.builder.finish(self.status)

    @property
    def status(self) -> str:
        if self.finish_reason is None:
            return "in_progress"
        return "incomplete" if self.finish_reason == "length" else "completed"

    def response(self, status: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        req = self.req
        status = status or self.status
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        tools = [{"type": "function", **t.function.model_dump(exclude_none=True)} for t in self.tools or []]
        tc = (
            req.tool_choice
            if isinstance(req.tool_choice, str) or req.tool_choice is None
            else (req.tool_choice.model_dump())
        )
        body = ResponsesResponse(
            id=self.id,
            created_at=self.created,
            status=status,
            model=self.model_name,
            output=self.builder.items if status != "in_progress" else [],
            usage=None
            if status == "in_progress"
            else ResponsesUsage(
                input_tokens=self.n_prompt,
                input_tokens_details={"cached_tokens": self.n_cached},
                output_tokens=self.n_out,
                output_tokens_details={"reasoning_tokens": self.reasoning_tokens},
                total_tokens=self.n_prompt + self.n_out,
            ),
            error=error,
            incomplete_details=incomplete,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=tc or "auto",
            tools=tools,
            text=_text_format(req),
            reasoning=req.reasoning.model_dump() if req.reasoning else None,
            metadata=req.metadata,
        )
        return body.model_dump(mode="json")


def _text_format(req: ResponsesRequest) -> dict[str, Any]:
    fmt = req.text.format if req.text else None
    if fmt is None:
        return {"format": {"type": "text"}}
    return {"format": fmt.model_dump(by_alias=True, exclude_none=True)}


def _event(seq: list[int], ev: dict[str, Any]) -> str:
    ev["sequence_number"] = seq[0]
    seq[0] += 1
    return f"event: {ev['type']}\ndata: {json.dumps(ev)}\n\n"


# ---- the route ---------------------------------------------------------------------------------------------


async def create_response(state: AppState, req: ResponsesRequest, raw: Request) -> Response:
    engine, opts, tok = state.engine, state.opts, state.tok
    state.check_model(req.model)
    state.check_sampling_fields(req)
    state.check_healthy()
    check_supported(req)
    msgs = input_messages(req)
    tools = chat_tools(req)
    think, template_kwargs = _thinking(req, msgs)
    start = structured.start_marker(opts.reasoning_parser, think)
    parallel = req.parallel_tool_calls is not False
    forced = structured.tool_choice_spec(tools, req.tool_choice, parallel, start)
    fmt = req.text.format if req.text else None
    spec = structured.one_constraint(
        ("text.format", structured.from_format(fmt.type, fmt.schema_, "text.format", start) if fmt else None),
        (
            "structured_outputs",
            structured.from_extra(req.structured_outputs, start) if req.structured_outputs else None,
        ),
        ("tool_choice", forced[0] if forced else None),
    )
    grammar_param = "tool_choice" if forced else "text.format" if fmt is not None else "structured_outputs"

    def render_and_encode() -> tuple[str, list[int]]:
        text = render_chat_prompt(
            tok, msgs, tools=tools, add_generation_prompt=True, chat_template_kwargs=template_kwargs
        )
        state.check_prompt_chars(len(text), "input")  # the tools and template count too
        return text, encode_text(tok, text, add_special_tokens=False, param="input")

    n_chars = chat_chars(msgs)
    state.check_prompt_chars(n_chars, "input")
    text, prompt_ids = await state.off_loop(render_and_encode, n_chars >= OFF_LOOP_CHARS)
    params = state.sampling_params(req, len(prompt_ids), req.max_output_tokens, None, structured_outputs=spec)
    await state.validate_async(prompt_ids, params, "input", grammar_param, priority=req.priority)
    response_id = _rid("resp")
    job = Job(response_id, prompt_ids, params, text, priority=req.priority)
    out = output_maker(
        reasoning_parser=opts.reasoning_parser,
        tool_parser=opts.tool_parser,
        think=think,
        tools=tools,
        tool_choice=req.tool_choice,
        parallel=parallel,
        forced=forced,
    )()
    run = _Run(state, req, response_id, engine.model_name, out, think, tools, len(prompt_ids))
    timer = RequestTimer(state.metrics, job.params.max_tokens)
    if req.stream:
        return SSEResponse(_stream(run, job, timer), headers=SSE_HEADERS)
    results = await run_whole(engine, raw, [job], [timer])
    if results is None:
        return Response(status_code=499)
    (res,) = results
    run.n_prompt, run.n_cached, run.n_out = (
        res.num_prompt_tokens,
        res.num_cached_tokens,
        res.num_output_tokens,
    )
    pos = 0
    for n_tok, n_chars_delta in res.delta_spans:  # the deltas as a stream would have fed them
        run.feed_delta(res.text[pos : pos + n_chars_delta], n_tok)
        pos += n_chars_delta
    if pos < len(res.text):
        run.feed_delta(res.text[pos:], 0)
    run.finish(res.finish_reason)
    return JSONResponse(run.response())


async def _stream(run: _Run, job: Job, timer: RequestTimer) -> AsyncIterator[str]:
    engine = run.state.engine
    seq = [0]
    finished: set[int] = set()
    try:
        yield _event(seq, {"type": "response.created", "response": run.response("in_progress")})
        yield _event(seq, {"type": "response.in_progress", "response": run.response("in_progress")})
        async for _, d in merged(engine, [job]):
            if d.token_ids:
                timer.token(d)
            run.n_out, run.n_cached = d.num_output_tokens, d.num_cached_tokens
            run.n_prompt = d.num_prompt_tokens or run.n_prompt
            events = run.feed_delta(d.text, len(d.token_ids))
            if d.finished:
                finished.add(0)
                err = finish_error(d.finish_reason, d.error)
                if err is not None:
                    run.finish_reason = d.finish_reason
                    yield _event(
                        seq,
                        {
                            "type": "response.failed",
                            "response": run.response(
                                "failed", {"code": err.code or "server_error", "message": err.message}
                            ),
                        },
                    )
                    return
                events += run.finish(d.finish_reason)
            for ev in events:
                yield _event(seq, ev)
        final = run.response()
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield _event(seq, {"type": kind, "response": final})
    except Exception as e:
        err = run.state.stream_failure(e)
        yield _event(
            seq,
            {
                "type": "response.failed",
                "response": run.response(
                    "failed", {"code": err.code or "server_error", "message": err.message}
                ),
            },
        )
    finally:
        abort_unfinished(engine, [job], finished)
        timer.finish(
            finish_reason=run.finish_reason or "abort", prompt_tokens=run.n_prompt, output_tokens=run.n_out
        )


def add_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/v1/responses", response_model=ResponsesResponse, responses=ERROR_RESPONSES)
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        return await create_response(state, req, raw)
