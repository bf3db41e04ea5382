"""The FastAPI app: OpenAI-compatible routes over an `AsyncEngine`.

    POST /v1/chat/completions   POST /v1/completions       (SSE streaming or one JSON body)
    GET  /v1/models             GET  /v1/models/{model}
    POST /tokenize              POST /detokenize
    GET  /health (and HEAD)     GET  /metrics              GET /version

A request goes: validate (pydantic, then our own checks, then `engine.validate_request`, so every
4xx is decided before anything runs) -> `engine.generate` -> deltas -> reasoning / tool-call parsing ->
response. Three failure rules shape the code:

- a request the engine can never serve is a 400 that names the limit (never a crash, never a hang);
- a client that goes away has its engine request aborted at once (streaming: Starlette cancels the
  response task; non-streaming: we watch the ASGI receive channel for `http.disconnect`), so its KV
  blocks and state slot return to the pool;
- a failure after the 200 of a stream is reported in-band: `data: {"error": ...}` then `data: [DONE]`.

`build_app(engine, options)` takes anything with the `AsyncEngine` interface, so the app can be tested
in-process with a fake engine as well as end to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hyserve.engine.errors import RequestRejected
from hyserve.engine.outputs import StreamDelta, TokenLogprob
from hyserve.engine.sampling_params import SamplingParams
from hyserve.server.chat import encode_text, render_chat_prompt, system_texts
from hyserve.server.errors import APIError, bad_request, error_body, install_error_handlers, sse_error_event
from hyserve.server.metrics import CONTENT_TYPE, RequestTimer, ServerMetrics
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
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaToolCall,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseToolCall,
    TokenizeRequest,
    TokenizeResponse,
    UsageInfo,
    VersionResponse,
    now,
)
from hyserve.server.reasoning import ReasoningParser, check_reasoning_parser_name, thinking_enabled
from hyserve.server.tool_parser import ParsedToolCall, ToolCallParser, check_tool_parser_name

logger = logging.getLogger("hyserve.server")

# Routes that need the API key when one is set (health, metrics and version stay open for probes).
_PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
_COUNTED_ROUTES = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health", "/version"}
)
# Logprobs of -inf (tokens masked by top-k/top-p) are not valid JSON; clients get this floor instead.
_LOGPROB_FLOOR = -9999.0

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorResponse, "description": "Invalid request (the message names the field and the limit)"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    500: {"model": ErrorResponse, "description": "The engine failed while running this request"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """Server-side settings (the engine's are in `EngineConfig`)."""

    api_key: str | None = None
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    # Other names clients may put in `model` (e.g. the path/Hub id given on the command line).
    model_aliases: tuple[str, ...] = ()
    # max_tokens when a request leaves it out: the room left in max_seq_len, but at most this.
    default_max_tokens: int = 8192

    def __post_init__(self) -> None:
        object.__setattr__(self, "reasoning_parser", check_reasoning_parser_name(self.reasoning_parser))
        object.__setattr__(self, "tool_parser", check_tool_parser_name(self.tool_parser))
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")


def hyserve_version() -> str:
    try:
        return metadata.version("hyserve")
    except metadata.PackageNotFoundError:  # running from a source tree that isn't installed
        return "0.0.0+unknown"


# ---- ASGI middleware: API key + request counting ----------------------------------------------------------


class _ApiMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which breaks streaming cancellation): checks the bearer
    token before the body is even read, and counts requests per route and status."""

    def __init__(self, app: Any, *, api_key: str | None, metrics: ServerMetrics) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        route = path if path in _COUNTED_ROUTES else ("/v1/models/{model}" if path.startswith("/v1/models/")
                                                       else "other")
        if self.api_key and path.startswith(_PROTECTED_PREFIXES) and scope.get("method") != "OPTIONS":
            if not self._authorized(scope):
                body = json.dumps(
                    error_body("invalid or missing API key: send 'Authorization: Bearer <key>'",
                               err_type="authentication_error", code="invalid_api_key")
                ).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"www-authenticate", b"Bearer")]})
                await send({"type": "http.response.body", "body": body})
                self.metrics.requests.labels(route=route, status="401").inc()
                return
        status = {"code": 500}

        async def send_wrapper(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.requests.labels(route=route, status=str(status["code"])).inc()

    def _authorized(self, scope: dict[str, Any]) -> bool:
        """The key from `Authorization: Bearer KEY` or `x-api-key: KEY`, compared as bytes (the key's UTF-8
        against the header's raw bytes: compare_digest refuses non-ASCII str, and any byte may arrive)."""
        assert self.api_key is not None
        key = self.api_key.encode("utf-8")
        for k, v in scope.get("headers", []):
            name = k.decode("latin-1").lower()
            val = bytes(v).strip()
            if name == "authorization":
                if val[:7].lower() == b"bearer " and hmac.compare_digest(val[7:].strip(), key):
                    return True
            elif name == "x-api-key" and hmac.compare_digest(val, key):
                return True
        return False


# ---- one generation ----------------------------------------------------------------------------------------


@dataclass
class _Result:
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


@dataclass
class _Job:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None
    # choices k > 0 of a long prompt start once choice 0 has its first token (`_stagger_choices`)
    after: asyncio.Event | None = None  # wait for this before entering the engine
    first_token: asyncio.Event | None = None  # set at this job's first delta (or its end)


# choices per request (`n`): each is its own engine request, so n x the prompt's prefill
MAX_CHOICES = 64


def _choice_params(params: SamplingParams, k: int) -> SamplingParams:
    """Choice k of n: a seeded request gives each choice its own seed (seed + k, kept in int64), so the
    choices differ and each stays reproducible; unseeded choices draw independently anyway."""
    if k == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + k + 2**63) % 2**64 - 2**63)


def _stagger_choices(jobs: list[_Job], n: int, min_prompt: int) -> None:
    """With the prefix cache on, let choices 1..n-1 of each prompt of at least `min_prompt` tokens enter
    the engine only after choice 0 has produced its first token: its prompt blocks and Mamba snapshots
    are published by then, so the others prefill only what the cache cannot serve instead of the whole
    prompt n times. Jobs are prompt-major (choice k of prompt i at i * n + k)."""
    if n <= 1:
        return
    for lead in range(0, len(jobs), n):
        if len(jobs[lead].prompt_ids) < min_prompt:
            continue
        ev = asyncio.Event()
        jobs[lead].first_token = ev
        for j in jobs[lead + 1 : lead + n]:
            j.after = ev


class _ClientGone(Exception):
    """The client disconnected before a non-streaming response was ready."""


async def _wait_for_disconnect(raw: Request) -> None:
    # FastAPI has read the whole body already, so the next ASGI message can only be the disconnect.
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _finish_error(finish_reason: str | None, error: str | None) -> APIError | None:
    """The API error for a request the engine ended abnormally, if it did."""
    if finish_reason == "error":
        return APIError(f"the engine failed while running this request: {error or 'unknown error'}",
                        status_code=500, code="engine_error")
    if finish_reason == "abort":
        return APIError("the request was aborted (the server is shutting down or the engine stopped it)",
                        status_code=503, code="request_aborted")
    return None


def _usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def _sse(obj: Any) -> str:
    return f"data: {obj}\n\n"


# Prompts longer than this (characters) are rendered and tokenized off the event loop.
_OFF_LOOP_CHARS = 50_000
# Non-streaming replies with more output tokens than this (each counted once more per top logprob) are
# built and serialised off the event loop: n=64 x 2,000 tokens x 20 top logprobs is a 177 MB reply that
# took ~1 min to build, during which the loop served no one.
_OFF_LOOP_REPLY_TOKENS = 20_000
# Template text per chat message, counted with the contents (so a request of many tiny messages renders
# off the loop too).
_CHARS_PER_MESSAGE = 16
_INT_KEY = re.compile(r"-?[0-9]+")  # logit_bias keys: ASCII digits (str.isdigit also takes '²' and '٣')


def _chat_chars(req: ChatCompletionRequest | TokenizeRequest) -> int:
    n = _CHARS_PER_MESSAGE * len(req.messages or [])
    for m in req.messages or []:
        if isinstance(m.content, str):
            n += len(m.content)
        elif m.content:
            n += sum(len(p.text or "") for p in m.content)
    return n


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _SSEResponse(StreamingResponse):
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


class _ChatOutput:
    """Reasoning split, then tool-call parsing of the content part, for one chat choice."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None, parallel: bool) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.parallel = parallel
        self.calls: list[ParsedToolCall] = []

    def _keep(self, calls: list[ParsedToolCall]) -> list[ParsedToolCall]:
        if not self.parallel:
            calls = calls[: max(0, 1 - len(self.calls))]
        self.calls.extend(calls)
        return calls

    def feed(self, text: str) -> tuple[str, str, list[ParsedToolCall]]:
        r, c = self.reasoning.feed(text) if self.reasoning else ("", text)
        calls: list[ParsedToolCall] = []
        if self.tools and c:
            c, calls = self.tools.feed(c)
        return r, c, self._keep(calls)

    def finish(self) -> tuple[str, str, list[ParsedToolCall]]:
        r, c = self.reasoning.finish() if self.reasoning else ("", "")
        calls: list[ParsedToolCall] = []
        if self.tools:
            c2, calls = self.tools.feed(c) if c else ("", [])
            c3, calls3 = self.tools.finish()
            c, calls = c2 + c3, calls + calls3
        return r, c, self._keep(calls)


# ---- the app -------------------------------------------------------------------------------------------------


def build_app(engine: Any, server_options: ServerOptions | None = None) -> FastAPI:
    """The OpenAI-compatible app over `engine` (an `AsyncEngine`, already started)."""
    opts = server_options or ServerOptions()
    metrics = ServerMetrics(engine.stats)
    app = FastAPI(
        title="hyserve",
        version=hyserve_version(),
        description="OpenAI-compatible server for hybrid Mamba2 + attention models (NemotronH).",
    )
    app.state.engine = engine
    app.state.options = opts
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(_ApiMiddleware, api_key=opts.api_key, metrics=metrics)
    tok = engine.tokenizer
    served_names = {engine.model_name, *(a for a in opts.model_aliases if a)}
    # n > 1: a prompt this long has its other choices wait for choice 0's first token and hit the prefix
    # cache (None: the engine has no prefix cache, every choice prefills on its own)
    cache_cfg = getattr(getattr(engine, "config", None), "cache", None)
    stagger_min: int | None = None
    if cache_cfg is not None and cache_cfg.enable_block_reuse:
        interval = cache_cfg.mamba_state_config.periodic_snapshot_interval or 0
        stagger_min = max(2 * cache_cfg.tokens_per_block, interval)
    token_text_cache: dict[int, str] = {}

    if opts.tool_parser is None:
        logger.info("no --tool_parser: requests with `tools` get the model's raw output as content")

    # -- helpers (closures over the engine) --

    def check_model(name: str | None) -> None:
        if name is None or name == "" or name in served_names:
            return
        raise APIError(
            f"the model {name!r} does not exist; this server serves {engine.model_name!r}",
            status_code=404, param="model", code="model_not_found",
        )

    def check_unsupported(req: ChatCompletionRequest | CompletionRequest) -> None:
        if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
            raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", param="n")
        for key in req.logit_bias or {}:
            if not _INT_KEY.fullmatch(key.strip()):
                raise bad_request(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                                  param="logit_bias")

    def token_text(tid: int) -> str:
        s = token_text_cache.get(tid)
        if s is None:
            if tok is None:
                s = f"token_id:{tid}"
            else:
                try:
                    s = tok.token_text(tid)
                except Exception:
                    s = tok.decode([tid], skip_special_tokens=False)
            if len(token_text_cache) < 1_000_000:
                token_text_cache[tid] = s
        return s

    def sampling_params(
        req: ChatCompletionRequest | CompletionRequest, n_prompt: int, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        if max_tokens is None:
            room = engine.max_seq_len - n_prompt
            max_tokens = max(1, min(room, opts.default_max_tokens))
        stop: tuple[str, ...] = ()
        if isinstance(req.stop, str):
            stop = (req.stop,) if req.stop else ()
        elif req.stop:
            stop = tuple(req.stop)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=0 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=req.seed,
                stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()},
                prompt_logprobs=prompt_logprobs,
            )
        except ValueError as e:
            msg = str(e)
            param = msg.split(" ", 1)[0] if msg else None
            if param == "logprobs" and isinstance(req, ChatCompletionRequest):
                param = "top_logprobs"
            raise bad_request(msg, param=param) from None

    def validate(prompt_ids: list[int], params: SamplingParams, prompt_param: str) -> None:
        try:
            engine.validate_request(prompt_ids, params)
        except RequestRejected as e:
            param = getattr(e, "param", None)
            if param == "prompt":
                param = prompt_param
            raise bad_request(str(e), param=param, code=getattr(e, "code", None)) from None
        except ValueError as e:
            raise bad_request(str(e), param=prompt_param) from None

    def check_prompt_chars(n_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a prompt that no tokenization fits in max_seq_len: c characters need
        at least c / (the tokenizer's longest token) tokens (halved again for normalisers that shrink text).
        Tokenizing 10M characters takes seconds that a hopeless request should not cost."""
        if tok is None:
            return
        longest = tok.max_token_chars
        if n_chars > 2 * longest * engine.max_seq_len:
            raise bad_request(
                f"{param} has {n_chars} characters, far more than max_seq_len = {engine.max_seq_len} tokens can "
                f"hold (this tokenizer's longest token has {longest} characters)",
                param=param, code="context_length_exceeded",
            )

    async def off_loop(fn: Callable[[], Any], large: bool) -> Any:
        """Run `fn` on a worker thread when its work is large (rendering + tokenising a long prompt: an
        800k-token document takes seconds; building a large reply), so the event loop keeps streaming to
        everyone else; small work runs in place."""
        return await asyncio.to_thread(fn) if large else fn()

    def large_reply(results: list[_Result], top_n: int) -> bool:
        return sum(r.num_output_tokens for r in results) * (1 + top_n) > _OFF_LOOP_REPLY_TOKENS

    def check_healthy() -> None:
        if not getattr(app.state, "accepting", True):
            raise APIError("the server is shutting down", status_code=503, code="shutting_down")
        if not engine.healthy:
            raise APIError("the engine is not running (see /health and the server log)", status_code=503,
                           code="engine_unavailable")

    async def consume(job: _Job, timer: RequestTimer | None) -> _Result:
        """Run one engine request to the end (non-streaming)."""
        res = _Result(num_prompt_tokens=len(job.prompt_ids))
        if job.after is not None:
            await job.after.wait()
        agen = engine.generate(job.request_id, job.prompt_ids, job.params)
        try:
            async for d in agen:
                if job.first_token is not None:
                    job.first_token.set()
                res.token_ids.extend(d.token_ids)
                res.text += d.text
                if d.logprobs:
                    res.logprobs.extend(d.logprobs)
                if d.token_ids and timer is not None:
                    timer.token()
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
        if res.finish_reason is None:  # the stream ended without a final delta: treat as an engine failure
            res.finish_reason, res.error = "error", "the engine ended the request without a result"
        return res

    async def run_all(raw: Request, jobs: list[_Job], timers: list[RequestTimer]) -> list[_Result]:
        """Run jobs concurrently; abort them all if the client disconnects first."""
        work: asyncio.Future[Any] = asyncio.ensure_future(
            asyncio.gather(*(consume(j, t) for j, t in zip(jobs, timers)))
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
                for j in jobs:
                    with contextlib.suppress(Exception):
                        engine.abort(j.request_id)
                if isinstance(e, RequestRejected):
                    raise bad_request(str(e), param=e.param, code=e.code) from None
                if isinstance(e, RuntimeError) and not engine.healthy:
                    raise APIError(str(e), status_code=503, code="engine_unavailable") from None
                raise
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        for j in jobs:
            with contextlib.suppress(Exception):
                engine.abort(j.request_id)
        raise _ClientGone

    async def merged(jobs: list[_Job]) -> AsyncIterator[tuple[int, StreamDelta]]:
        """Deltas of several engine requests as they come, tagged with the job's index."""
        if len(jobs) == 1:
            agen = engine.generate(jobs[0].request_id, jobs[0].prompt_ids, jobs[0].params)
            try:
                async for d in agen:
                    yield 0, d
            finally:
                await agen.aclose()
            return
        q: asyncio.Queue[tuple[int, StreamDelta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, job: _Job) -> None:
            try:
                if job.after is not None:
                    await job.after.wait()
                async for d in engine.generate(job.request_id, job.prompt_ids, job.params):
                    if job.first_token is not None:
                        job.first_token.set()
                    q.put_nowait((i, d))
                q.put_nowait((i, None))
            except Exception as e:
                q.put_nowait((i, e))
            finally:
                if job.first_token is not None:
                    job.first_token.set()

        tasks = [asyncio.ensure_future(pump(i, j)) for i, j in enumerate(jobs)]
        try:
            remaining = len(jobs)
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def abort_unfinished(jobs: list[_Job], finished: set[int]) -> None:
        for i, j in enumerate(jobs):
            if i not in finished:
                with contextlib.suppress(Exception):
                    engine.abort(j.request_id)

    def stream_failure(e: BaseException) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, RequestRejected):
            return bad_request(str(e), param=getattr(e, "param", None), code=getattr(e, "code", None))
        if isinstance(e, RuntimeError) and not engine.healthy:
            return APIError(str(e), status_code=503, code="engine_unavailable")
        logger.exception("stream failed", exc_info=e)
        return APIError(f"internal server error: {type(e).__name__}: {e}", status_code=500)

    # -- chat --

    def chat_logprobs(lps: list[TokenLogprob], top_n: int) -> ChatChoiceLogprobs:
        content = []
        for lp in lps:
            s = token_text(lp.token_id)
            tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
            content.append(
                ChatLogprobToken(
                    token=s, logprob=max(lp.logprob, _LOGPROB_FLOOR), bytes=list(s.encode("utf-8")),
                    top_logprobs=[
                        ChatLogprobTop(token=token_text(t), logprob=max(v, _LOGPROB_FLOOR),
                                       bytes=list(token_text(t).encode("utf-8")))
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

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        check_unsupported(req)
        check_healthy()
        if req.response_format is not None and req.response_format.type != "text":
            raise bad_request(
                f"response_format type {req.response_format.type!r} is not supported (no guided decoding); "
                "use 'text'", param="response_format.type",
            )
        if req.top_logprobs and not req.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        tc = req.tool_choice
        if tc is not None and tc not in ("none", "auto"):
            raise bad_request(
                "tool_choice 'required' or a named function is not supported (no guided decoding); use 'auto'",
                param="tool_choice",
            )
        parse_tools = bool(req.tools) and tc != "none" and opts.tool_parser is not None
        def render_and_encode() -> tuple[str, list[int]]:
            text = render_chat_prompt(
                tok, req.messages, tools=req.tools, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, chat_template_kwargs=req.chat_template_kwargs,
            )
            return text, encode_text(tok, text, add_special_tokens=False, param="messages")

        n_chars = _chat_chars(req)
        check_prompt_chars(n_chars, "messages")
        text, prompt_ids = await off_loop(render_and_encode, n_chars >= _OFF_LOOP_CHARS)
        top_n = req.top_logprobs or 0
        params = sampling_params(
            req, len(prompt_ids),
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
            top_n if req.logprobs else None,
        )
        validate(prompt_ids, params, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        n = req.n or 1
        jobs = [_Job(request_id if n == 1 else f"{request_id}-{k}", prompt_ids, _choice_params(params, k), text)
                for k in range(n)]
        if stagger_min is not None:
            _stagger_choices(jobs, n, stagger_min)
        think = thinking_enabled(req.chat_template_kwargs, system_texts(req.messages))
        tools_dump = [t.model_dump() for t in req.tools] if req.tools else None

        def output() -> _ChatOutput:
            return _ChatOutput(
                ReasoningParser(enabled=think) if opts.reasoning_parser else None,
                ToolCallParser(tools_dump) if parse_tools else None,
                req.parallel_tool_calls is not False,
            )

        model_name = req.model or engine.model_name
        timers = [RequestTimer(metrics) for _ in jobs]
        if req.stream:
            so = req.stream_options
            return _SSEResponse(
                chat_stream(request_id, jobs, model_name, [output() for _ in jobs], timers, top_n,
                            include_usage=bool(so and so.include_usage),
                            continuous=bool(so and so.continuous_usage_stats),
                            with_logprobs=bool(req.logprobs)),
                headers=_SSE_HEADERS,
            )
        try:
            results = await run_all(raw, jobs, timers)
        except _ClientGone:
            for t in timers:
                t.finish(finish_reason="abort", prompt_tokens=len(prompt_ids), output_tokens=0)
            return Response(status_code=499)
        for res, timer in zip(results, timers):
            timer.finish(finish_reason=res.finish_reason, prompt_tokens=res.num_prompt_tokens,
                         output_tokens=res.num_output_tokens)
            err = _finish_error(res.finish_reason, res.error)
            if err is not None:
                raise err
        return await off_loop(lambda: chat_reply(req, request_id, model_name, results, top_n, output),
                              large_reply(results, top_n))

    def chat_reply(req: ChatCompletionRequest, request_id: str, model_name: str, results: list[_Result],
                   top_n: int, output: Callable[[], _ChatOutput]) -> JSONResponse:
        choices = []
        for k, res in enumerate(results):
            out = output()
            r1, c1, calls1 = out.feed(res.text)
            r2, c2, calls2 = out.finish()
            reasoning, content, calls = r1 + r2, c1 + c2, calls1 + calls2
            if calls:
                content = content.strip()
            finish = "tool_calls" if calls and res.finish_reason == "stop" else res.finish_reason
            choices.append(
                ChatCompletionChoice(
                    index=k,
                    message=ChatResponseMessage(
                        content=content if (content or not (reasoning or calls)) else None,
                        reasoning_content=reasoning or None,
                        tool_calls=tool_calls_out(calls),
                    ),
                    logprobs=chat_logprobs(res.logprobs, top_n) if req.logprobs else None,
                    finish_reason=finish,
                    stop_reason=res.stop_reason,
                )
            )
        first = results[0]  # the prompt counts once however many choices there are (OpenAI's usage)
        resp = ChatCompletionResponse(
            id=request_id,
            model=model_name,
            choices=choices,
            usage=_usage(first.num_prompt_tokens, sum(r.num_output_tokens for r in results),
                         first.num_cached_tokens),
        )
        return JSONResponse(resp.model_dump(mode="json"))

    async def chat_stream(
        request_id: str, jobs: list[_Job], model_name: str, outs: list[_ChatOutput], timers: list[RequestTimer],
        top_n: int, *, include_usage: bool, continuous: bool, with_logprobs: bool,
    ) -> AsyncIterator[str]:
        """One SSE stream for the n choices of a chat request (choice k = job k), interleaved as they come."""
        created = now()
        n_jobs = len(jobs)
        n_prompt = len(jobs[0].prompt_ids)
        n_out = [0] * n_jobs
        n_cached = 0
        finished: set[int] = set()
        finish_reasons: dict[int, str | None] = {}
        n_calls = [0] * n_jobs

        def usage() -> UsageInfo:
            return _usage(n_prompt, sum(n_out), n_cached)

        # per-token chunks (text only: no role, tool calls, logprobs, finish or running usage) are formatted
        # directly, as in completion_stream
        token_head = json.dumps({"id": request_id, "object": "chat.completion.chunk", "created": created,
                                 "model": model_name})[:-1] + ', "choices": [{"index": '
        token_tail = ', "usage": null}' if include_usage else "}"

        def chunk(k: int, delta: ChatDelta, *, logprobs: ChatChoiceLogprobs | None = None,
                  finish: str | None = None, stop_reason: int | str | None = None) -> str:
            if (logprobs is None and finish is None and stop_reason is None and not continuous
                    and delta.role is None and delta.tool_calls is None):
                fields = {key: val for key, val in (("content", delta.content),
                                                    ("reasoning_content", delta.reasoning_content))
                          if val is not None}
                return _sse(f'{token_head}{k}, "delta": {json.dumps(fields)}, "logprobs": null, '
                            f'"finish_reason": null, "stop_reason": null}}]{token_tail}')
            c = ChatCompletionChunk(
                id=request_id, created=created, model=model_name,
                choices=[ChatStreamChoice(index=k, delta=delta, logprobs=logprobs, finish_reason=finish,
                                          stop_reason=stop_reason)],
                usage=usage() if continuous else None,
            )
            d = c.model_dump(mode="json")
            d["choices"][0]["delta"] = {key: val for key, val in d["choices"][0]["delta"].items() if val is not None}
            if not (include_usage or continuous):
                d.pop("usage")
            return _sse(json.dumps(d))

        def delta_for(k: int, r: str, c: str, calls: list[ParsedToolCall]) -> ChatDelta | None:
            tc = None
            if calls:
                tc = [
                    DeltaToolCall(index=n_calls[k] + j, id=call.id, type="function",
                                  function=ResponseFunctionCall(name=call.name, arguments=call.arguments))
                    for j, call in enumerate(calls)
                ]
                n_calls[k] += len(calls)
            if not (r or c or tc):
                return None
            return ChatDelta(reasoning_content=r or None, content=c or None, tool_calls=tc)

        try:
            for k in range(n_jobs):
                yield chunk(k, ChatDelta(role="assistant", content=""))
            async for k, d in merged(jobs):
                if d.token_ids:
                    timers[k].token()
                n_out[k] = d.num_output_tokens
                if k == 0:
                    n_cached = d.num_cached_tokens
                    n_prompt = d.num_prompt_tokens or n_prompt
                out = outs[k]
                r, c, calls = out.feed(d.text) if d.text else ("", "", [])
                lp = chat_logprobs(d.logprobs, top_n) if (with_logprobs and d.logprobs) else None
                if d.finished:
                    finished.add(k)
                    finish_reasons[k] = d.finish_reason
                    err = _finish_error(d.finish_reason, d.error)
                    if err is not None:
                        yield sse_error_event(err)
                        break
                    r2, c2, calls2 = out.finish()
                    r, c, calls = r + r2, c + c2, calls + calls2
                delta = delta_for(k, r, c, calls)
                if delta is not None or lp is not None:
                    yield chunk(k, delta or ChatDelta(), logprobs=lp)
                if d.finished:
                    reason = "tool_calls" if (out.calls and d.finish_reason == "stop") else d.finish_reason
                    yield chunk(k, ChatDelta(), finish=reason, stop_reason=d.stop_reason)
            else:
                if include_usage:
                    yield _sse(json.dumps({
                        "id": request_id, "object": "chat.completion.chunk", "created": created,
                        "model": model_name, "choices": [], "usage": usage().model_dump(mode="json"),
                    }))
            yield _sse("[DONE]")
        except Exception as e:
            yield sse_error_event(stream_failure(e))
            yield _sse("[DONE]")
        finally:
            abort_unfinished(jobs, finished)
            for k, t in enumerate(timers):
                t.finish(finish_reason=finish_reasons.get(k) or "abort", prompt_tokens=n_prompt,
                         output_tokens=n_out[k])

    # -- completions --

    def completion_prompts(req: CompletionRequest) -> list[tuple[list[int], str | None]]:
        p = req.prompt
        items: list[str | list[int]]
        if isinstance(p, str):
            items = [p]
        elif p and all(isinstance(x, int) for x in p):
            items = [list(p)]  # type: ignore[arg-type]
        else:
            items = list(p)  # type: ignore[arg-type]
        if not items:
            raise bad_request("prompt must not be empty", param="prompt")
        if len(items) > 256:
            raise bad_request(f"at most 256 prompts per request, got {len(items)}", param="prompt")
        out: list[tuple[list[int], str | None]] = []
        for i, item in enumerate(items):
            param = "prompt" if len(items) == 1 else f"prompt[{i}]"
            if isinstance(item, str):
                ids = encode_text(tok, item, add_special_tokens=req.add_special_tokens, param=param)
                out.append((ids, item))
            else:
                out.append((list(item), None))
        return out

    def completion_logprobs(lps: list[TokenLogprob], top_n: int, offset0: int) -> CompletionLogprobs:
        res = CompletionLogprobs()
        off = offset0
        for lp in lps:
            s = token_text(lp.token_id)
            res.tokens.append(s)
            res.token_logprobs.append(max(lp.logprob, _LOGPROB_FLOOR))
            tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
            res.top_logprobs.append({token_text(t): max(v, _LOGPROB_FLOOR) for t, v in tops} if top_n else None)
            res.text_offset.append(off)
            off += len(s)
        return res

    def echo_logprobs(prompt_ids: list[int], plps: list[TokenLogprob | None] | None, top_n: int
                      ) -> CompletionLogprobs:
        """The echoed prompt's logprobs: null for the first token (nothing predicts it), as OpenAI."""
        res = CompletionLogprobs()
        off = 0
        for i, t in enumerate(prompt_ids):
            s = token_text(t)
            lp = plps[i] if plps is not None and i < len(plps) else None
            res.tokens.append(s)
            res.token_logprobs.append(None if lp is None else max(lp.logprob, _LOGPROB_FLOOR))
            if lp is None or not top_n:
                res.top_logprobs.append(None)
            else:
                tops = sorted(lp.top.items(), key=lambda kv: -kv[1])[:top_n]
                res.top_logprobs.append({token_text(tt): max(v, _LOGPROB_FLOOR) for tt, v in tops})
            res.text_offset.append(off)
            off += len(s)
        return res

    def prompt_echo_text(ids: list[int], text: str | None) -> str:
        if text is not None:
            return text
        if tok is None:
            return ""
        return tok.decode(ids, skip_special_tokens=False)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        check_model(req.model)
        check_unsupported(req)
        check_healthy()
        if req.suffix:
            raise bad_request("suffix is not supported by this server", param="suffix")
        if req.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {req.best_of}", param="best_of")
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise bad_request("max_tokens must be >= 1 (0 is only allowed with echo: the prompt back, with its "
                              "logprobs, and nothing generated)", param="max_tokens")
        texts = [req.prompt] if isinstance(req.prompt, str) else [p for p in req.prompt if isinstance(p, str)]
        for i, p in enumerate(texts):
            check_prompt_chars(len(p), "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]")
        prompts = await off_loop(lambda: completion_prompts(req), sum(len(p) for p in texts) >= _OFF_LOOP_CHARS)
        base = f"cmpl-{uuid.uuid4().hex}"
        n = req.n or 1
        jobs: list[_Job] = []  # choice index = prompt index * n + k, as OpenAI orders them
        for i, (ids, text) in enumerate(prompts):
            # echo + logprobs: the prompt tokens' own logprobs too (lm-eval style loglikelihood requests)
            params = sampling_params(req, len(ids), 1 if prompt_only else req.max_tokens, req.logprobs,
                                     req.logprobs if req.echo else None)
            validate(ids, params, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            for k in range(n):
                rid = base if len(prompts) * n == 1 else f"{base}-{i * n + k}"
                jobs.append(_Job(rid, ids, _choice_params(params, k), text))
        if stagger_min is not None:
            _stagger_choices(jobs, n, stagger_min)
        model_name = req.model or engine.model_name
        timers = [RequestTimer(metrics) for _ in jobs]
        top_n = req.logprobs or 0
        if req.stream:
            so = req.stream_options
            return _SSEResponse(
                completion_stream(base, jobs, model_name, timers, req,
                                  include_usage=bool(so and so.include_usage),
                                  continuous=bool(so and so.continuous_usage_stats)),
                headers=_SSE_HEADERS,
            )
        try:
            results = await run_all(raw, jobs, timers)
        except _ClientGone:
            for t, j in zip(timers, jobs):
                t.finish(finish_reason="abort", prompt_tokens=len(j.prompt_ids), output_tokens=0)
            return Response(status_code=499)
        for res, timer in zip(results, timers):
            timer.finish(finish_reason=res.finish_reason, prompt_tokens=res.num_prompt_tokens,
                         output_tokens=res.num_output_tokens)
            err = _finish_error(res.finish_reason, res.error)
            if err is not None:
                raise err
        return await off_loop(lambda: completion_reply(req, base, model_name, jobs, results, top_n, n, prompt_only),
                              large_reply(results, top_n))

    def completion_reply(req: CompletionRequest, base: str, model_name: str, jobs: list[_Job],
                         results: list[_Result], top_n: int, n: int, prompt_only: bool) -> JSONResponse:
        choices = []
        for i, (job, res) in enumerate(zip(jobs, results)):
            if prompt_only:  # the one token the engine generated is not part of the answer
                res.text, res.logprobs, res.num_output_tokens, res.finish_reason = "", [], 0, "length"
                res.stop_reason = None
            text = res.text
            lp = None
            if req.echo:
                ptext = prompt_echo_text(job.prompt_ids, job.prompt_text)
                text = ptext + text
                if req.logprobs is not None:
                    lp = echo_logprobs(job.prompt_ids, res.prompt_logprobs, top_n)
                    gen = completion_logprobs(res.logprobs, top_n, len(ptext))
                    lp.tokens += gen.tokens
                    lp.token_logprobs += gen.token_logprobs
                    lp.top_logprobs += gen.top_logprobs
                    lp.text_offset += gen.text_offset
            elif req.logprobs is not None:
                lp = completion_logprobs(res.logprobs, top_n, 0)
            choices.append(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=res.finish_reason,
                                            stop_reason=res.stop_reason))
        firsts = results[::n]  # the prompt counts once however many choices it has (OpenAI's usage)
        usage = _usage(
            sum(r.num_prompt_tokens for r in firsts),
            sum(r.num_output_tokens for r in results),
            sum(r.num_cached_tokens for r in firsts),
        )
        resp = CompletionResponse(id=base, model=model_name, choices=choices, usage=usage)
        return JSONResponse(resp.model_dump(mode="json"))

    async def completion_stream(
        base: str, jobs: list[_Job], model_name: str, timers: list[RequestTimer], req: CompletionRequest, *,
        include_usage: bool, continuous: bool,
    ) -> AsyncIterator[str]:
        created = now()
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
            return _usage(sum(n_prompt[::per_prompt]), sum(n_out), sum(n_cached[::per_prompt]))

        # the per-token chunk (no logprobs, not the last, no usage) is formatted directly: the pydantic
        # model + dump costs several microseconds per token per stream on the event loop
        token_head = json.dumps({"id": base, "object": "text_completion", "created": created, "model": model_name})
        token_head = token_head[:-1] + ', "choices": [{"index": '
        token_tail = ', "usage": null}' if include_usage else "}"

        def chunk(i: int, text: str, lp: CompletionLogprobs | None, finish: str | None = None,
                  stop_reason: int | str | None = None) -> str:
            if lp is None and finish is None and stop_reason is None and not continuous:
                return _sse(f'{token_head}{i}, "text": {json.dumps(text)}, "logprobs": null, '
                            f'"finish_reason": null, "stop_reason": null}}]{token_tail}')
            c = CompletionChunk(
                id=base, created=created, model=model_name,
                choices=[CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=finish,
                                          stop_reason=stop_reason)],
                usage=usage() if continuous else None,
            )
            d = c.model_dump(mode="json")
            if not (include_usage or continuous):
                d.pop("usage")
            return _sse(json.dumps(d))

        try:
            # echoed prompts go first; with logprobs, each waits for its request's first delta, which
            # carries the prompt logprobs
            echo_pending = set(range(len(jobs))) if req.echo else set()
            if req.echo and req.logprobs is None:
                for i, j in enumerate(jobs):
                    ptext = prompt_echo_text(j.prompt_ids, j.prompt_text)
                    offsets[i] = len(ptext)
                    yield chunk(i, ptext, None)
                echo_pending.clear()
            async for i, d in merged(jobs):
                if i in echo_pending:
                    echo_pending.discard(i)
                    ptext = prompt_echo_text(jobs[i].prompt_ids, jobs[i].prompt_text)
                    offsets[i] = len(ptext)
                    yield chunk(i, ptext, echo_logprobs(jobs[i].prompt_ids, d.prompt_logprobs, top_n))
                if d.token_ids:
                    timers[i].token()
                n_out[i], n_cached[i] = d.num_output_tokens, d.num_cached_tokens
                n_prompt[i] = d.num_prompt_tokens or n_prompt[i]
                if d.finished:
                    finished.add(i)
                    reasons[i] = d.finish_reason
                    err = _finish_error(d.finish_reason, d.error)
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
                    lp = completion_logprobs(d.logprobs, top_n, offsets[i])
                offsets[i] += len(d.text)
                # one chunk per engine step that produced tokens, even when they decode to no text yet (a
                # partial UTF-8 sequence, or token ids without a tokenizer), as vLLM streams: clients time
                # tokens by chunks
                if d.text or d.token_ids or lp is not None or d.finished:
                    yield chunk(i, d.text, lp, d.finish_reason if d.finished else None,
                                d.stop_reason if d.finished else None)
            else:
                if include_usage:
                    yield _sse(json.dumps({
                        "id": base, "object": "text_completion", "created": created, "model": model_name,
                        "choices": [], "usage": usage().model_dump(mode="json"),
                    }))
            yield _sse("[DONE]")
        except Exception as e:
            yield sse_error_event(stream_failure(e))
            yield _sse("[DONE]")
        finally:
            abort_unfinished(jobs, finished)
            for i, t in enumerate(timers):
                t.finish(finish_reason=reasons.get(i) or "abort", prompt_tokens=n_prompt[i], output_tokens=n_out[i])

    # -- models, tokenizer, health, metrics, version --

    def model_card() -> ModelCard:
        root = getattr(getattr(engine, "config", None), "model", None)
        return ModelCard(id=engine.model_name, root=root, max_model_len=engine.max_seq_len)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def list_models() -> ModelList:
        return ModelList(data=[model_card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def get_model(model_id: str) -> ModelCard:
        check_model(model_id or "\0")
        return model_card()

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERROR_RESPONSES)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of `prompt` (text) or `messages` (chat)", param="prompt")
        if req.messages is not None and not req.messages:
            raise bad_request("messages must not be empty", param="messages")

        def render_and_encode() -> list[int]:
            if req.messages is not None:
                text = render_chat_prompt(tok, req.messages, tools=req.tools,
                                          add_generation_prompt=req.add_generation_prompt,
                                          chat_template_kwargs=req.chat_template_kwargs)
                return encode_text(tok, text, add_special_tokens=False, param="messages")
            return encode_text(tok, req.prompt or "", add_special_tokens=req.add_special_tokens)

        n_chars = _chat_chars(req) if req.messages is not None else len(req.prompt or "")
        check_prompt_chars(n_chars, "messages" if req.messages is not None else "prompt")
        ids = await off_loop(render_and_encode, n_chars >= _OFF_LOOP_CHARS)
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_seq_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERROR_RESPONSES)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        check_model(req.model)
        if tok is None:
            raise bad_request("this model has no tokenizer, so token ids cannot be turned into text",
                              param="tokens")
        vocab = getattr(tok, "vocab_size", None)
        if isinstance(vocab, int):
            bad = [t for t in req.tokens if t >= vocab]
            if bad:
                raise bad_request(f"token ids must be < the vocabulary size {vocab}; got {bad[:5]}",
                                  param="tokens")
        try:
            text = tok.decode(req.tokens)
        except Exception as e:
            raise bad_request(f"cannot decode these token ids: {e}", param="tokens") from None
        return DetokenizeResponse(prompt=text)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    @app.head("/health", include_in_schema=False)  # load-balancer probes that send HEAD
    async def health() -> JSONResponse:
        if not getattr(app.state, "accepting", True):
            return JSONResponse(error_body("the server is shutting down", err_type="service_unavailable_error",
                                           code="shutting_down"), status_code=503)
        if engine.healthy:
            return JSONResponse({"status": "ok"})
        reason = getattr(engine, "dead_reason", None) or "unknown"
        return JSONResponse(error_body(f"the engine is not running: {reason}", err_type="service_unavailable_error",
                                       code="engine_unavailable"), status_code=503)

    @app.get("/metrics", response_class=Response)
    async def metrics_route() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=hyserve_version())

    return app
