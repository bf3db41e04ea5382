"""What every route family shares: the server options, and `AppState`, the engine with the checks and
conversions each route applies before anything reaches it.

One `AppState` per app (built by `build_app`); the route modules (`serving_*.py`) take it as their only
link to the engine, so each family reads like a function of (request, state) -> response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from hyserve.engine.errors import RequestRejected
from hyserve.engine.sampling.structured_output import GrammarError
from hyserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from hyserve.model.tokenizer import GENERATION_CONFIG_FILE, check_chat_template
from hyserve.server.body import large_body
from hyserve.server.errors import APIError, bad_request, internal_error
from hyserve.server.generation import RequestLogging, engine_api_error
from hyserve.server.logs import LOG_FORMATS
from hyserve.server.metrics import ServerMetrics
from hyserve.server.protocol import ErrorResponse, PromptTokensDetails, UsageInfo, now
from hyserve.server.reasoning import check_reasoning_parser_name
from hyserve.server.tool_parser import check_tool_parser_name

logger = logging.getLogger("hyserve.server")

# Logprobs of -inf (tokens masked by top-k/top-p) are not valid JSON; clients get this floor instead.
LOGPROB_FLOOR = -9999.0
# choices per request (`n`): each is its own engine request, so n x the prompt's prefill
MAX_CHOICES = 64
# Prompts longer than this (characters) are rendered and tokenized off the event loop.
OFF_LOOP_CHARS = 50_000
# Non-streaming replies with more output tokens than this (each counted once more per top logprob) are
# built and serialised off the event loop: n=64 x 2,000 tokens x 20 top logprobs is a 177 MB reply that
# took ~1 min to build, during which the loop served no one.
OFF_LOOP_REPLY_TOKENS = 20_000
# logit_bias keys: ASCII digits (str.isdigit also takes '²' and '٣'), few enough for int() (4,300 at most)
_INT_KEY = re.compile(r"-?[0-9]{1,19}")

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {
        "model": ErrorResponse,
        "description": "Invalid request (the message names the field and the limit)",
    },
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    500: {"model": ErrorResponse, "description": "The engine failed while running this request"},
    503: {"model": ErrorResponse, "description": "The engine is not running"},
}


# uvicorn's log levels
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# The largest request body accepted (bytes): a 1M-token prompt as JSON token ids of up to 6 digits
# ("123456, ") is 8 MB, as text 4-9 MB (more where JSON escapes non-ASCII): 32 MiB leaves room for that
# and refuses, while it streams in, the 75 MB bodies that used to freeze the server (docs/architecture.md).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0
# Slow clients: a request's headers, then its body, each get this long to arrive (a 408 after; uvicorn sets no
# bound on headers), open connections are capped (503 past it: far above the 1,024 concurrent streams a
# default GPU server runs), and so are the bytes of all bodies being received or served at once (503)
DEFAULT_REQUEST_READ_TIMEOUT_S = 30.0
DEFAULT_MAX_CONNECTIONS = 8192
DEFAULT_MAX_INFLIGHT_BODY_BYTES = 512 * 1024 * 1024
# A request's sequences (prompts x n) run as that many engine requests; 256 prompts x n = 64 (16,384) once
# kept another client's 1-token request waiting 31 s on a CPU server.
DEFAULT_MAX_SEQUENCES_PER_REQUEST = 1024


def _check_str(v: Any, path: str, *, none_ok: bool = False, empty_ok: bool = False) -> str | None:
    if v is None and none_ok:
        return None
    if not isinstance(v, str):
        raise ValueError(f"{path}: expected a string, got {v!r}")
    if not v and not empty_ok:
        raise ValueError(f"{path}: must not be empty")
    return v


def _check_api_key(v: Any) -> str | None:
    key = _check_str(v, "api_key", none_ok=True, empty_ok=True)
    if key is None:
        return None
    if key == "":
        raise ValueError(
            'api_key: the key is empty (an unset variable in --api_key "$KEY"?): give a key, or serve '
            "without authentication explicitly with --no_auth (YAML: api_key: null)"
        )
    if key != key.strip() or any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        raise ValueError(
            "api_key: must not start or end with whitespace nor hold control characters "
            "(clients could never send it in a header)"
        )
    return key


def _chat_template_text(v: Any) -> str | None:
    """--chat-template: a file's text, or the template itself (vLLM takes both), compiled once here."""
    source = _check_str(v, "chat_template", none_ok=True)
    if source is None:
        return None
    if "{{" not in source and "{%" not in source:
        try:
            source = Path(source).expanduser().read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(
                f"chat_template: {v!r} is neither a readable file ({e.strerror or e}) nor a Jinja template"
            ) from None
    try:
        check_chat_template(source)
    except ValueError as e:
        raise ValueError(f"chat_template: {e}") from None
    return source


# generation_config.json keys -> the request field each gives a default for, and the values that are
# transformers' own defaults rather than the model's recommendation (left out, as vLLM's --generation-config
# auto leaves them)
_GENERATION_DEFAULTS = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "max_new_tokens": ("max_tokens", None),
}


def sampling_defaults(generation_config: dict[str, Any]) -> dict[str, float | int]:
    """The request defaults a generation_config.json recommends (request field -> value)."""
    out: dict[str, float | int] = {}
    for key, (name, hf_default) in _GENERATION_DEFAULTS.items():
        v = generation_config.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and v != hf_default:
            out[name] = v
    return out


def read_generation_config(where: str) -> dict[str, Any]:
    """--generation-config DIR: its generation_config.json (or the file itself), read at start-up."""
    p = Path(where).expanduser()
    if p.is_dir():
        p = p / GENERATION_CONFIG_FILE
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(
            f"generation_config: {where!r} is not 'auto', 'vllm' nor a directory with a readable "
            f"{GENERATION_CONFIG_FILE} ({e.strerror or e})"
        ) from None
    except ValueError as e:
        raise ValueError(f"generation_config: {p} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {p} holds no JSON object")
    return data


def _str_list(v: Any, path: str) -> tuple[str, ...]:
    """A list of strings, from YAML (a list, or one string) or a flag (a JSON list, as vLLM's
    --allowed-origins '["https://a.example"]', or comma-separated)."""
    if isinstance(v, str):
        text = v.strip()
        if text.startswith("["):
            try:
                v = json.loads(text)
            except ValueError as e:
                raise ValueError(f"{path}: {text!r} is not a JSON list of strings ({e})") from None
        else:
            v = [p.strip() for p in text.split(",") if p.strip()]
    if not isinstance(v, list | tuple) or not all(isinstance(x, str) and x for x in v):
        raise ValueError(f"{path}: expected a list of non-empty strings, got {v!r}")
    return tuple(v)


def _check_seconds(v: Any, path: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0.0 <= float(v) < float("inf"):
        raise ValueError(f"{path}: expected a number of seconds >= 0, got {v!r}")
    return float(v)


ENGINE_PROCESS_MODES = ("auto", "on", "off")


def engine_in_own_process(mode: str, device: str) -> bool:
    """Whether `hyserve serve` runs the engine loop in its own process: `mode` "on" / "off", or "auto": when
    the engine runs on CUDA (`device` as the config names it; "auto" is CUDA when one is available)."""
    if mode != "auto":
        return mode == "on"
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device == "cuda"


@dataclass(frozen=True, kw_only=True)
class ServerOptions:
    """Server-side settings (the engine's are in `EngineConfig`), each checked at construction with its
    YAML key in the message, so a bad one stops `hyserve serve` before the model loads."""

    host: str = "127.0.0.1"
    port: int = 8000
    # None: no authentication (an empty key is refused: see _check_api_key)
    api_key: str | None = None
    reasoning_parser: str | None = None
    tool_parser: str | None = None
    # Other names clients may put in `model` (e.g. the path/Hub id given on the command line).
    model_aliases: tuple[str, ...] = ()
    # --served-model-name's names: /v1/models lists each (the engine's model_name, the first, reported)
    served_model_names: tuple[str, ...] = ()
    # max_tokens when a request leaves it out: the room left in max_seq_len, but at most this.
    default_max_tokens: int = 8192
    log_level: str = "info"
    access_log: bool = True
    # a longer body is a 413, refused as it streams in
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # SIGTERM: in-flight requests get this long to finish before they are aborted (then exit 0)
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
    # the chat template in place of the checkpoint's (a file or the template; stored as its text)
    chat_template: str | None = None
    # default sampling of requests that leave it out: "auto" (the model's generation_config.json), "vllm"
    # (none), or a directory with a generation_config.json
    generation_config: str = "auto"
    # most logprobs / top_logprobs a request may ask for (-1: MAX_LOGPROBS)
    max_logprobs: int = MAX_LOGPROBS
    # vLLM's --enable-auto-tool-choice: accepted with a tool parser (which parses tool calls either way)
    enable_auto_tool_choice: bool = False
    log_requests: bool = False  # a log line as each generation request starts and ends
    log_stats: bool = True  # the stats line every HYSERVE_LOG_STATS_INTERVAL seconds
    log_format: str = "text"  # "text" or "json" lines
    # CORS, as vLLM's --allowed-origins / --allowed-methods / --allowed-headers / --allow-credentials; no
    # origin: no CORS headers at all (browsers keep other origins' pages out)
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # the most sequences (prompts x n) one request may ask for; more is a 400
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    # seconds a request's headers may take (from the connection's start or its previous response) and then its
    # body (from the headers); later is a 408 (0: no deadline)
    request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT_S
    # open connections (and requests in progress) past which a request is answered 503
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    # the bytes of the bodies of all requests in progress; a body that would pass it is a 503
    max_inflight_body_bytes: int = DEFAULT_MAX_INFLIGHT_BODY_BYTES
    # where the engine loop runs (ENGINE_PROCESS_MODES): "on" its own process (engine/engine_process.py),
    # "off" a thread of the server's, "auto" its own process when it runs on CUDA
    engine_process: str = "auto"

    def __post_init__(self) -> None:
        from hyserve.config import Int, boolean

        put = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 (frozen dataclass)
        _check_str(self.host, "host")
        Int(lo=0, hi=65535)(self.port, "port")
        put("api_key", _check_api_key(self.api_key))
        for name, check in (
            ("reasoning_parser", check_reasoning_parser_name),
            ("tool_parser", check_tool_parser_name),
        ):
            put(name, check(_check_str(getattr(self, name), name, none_ok=True, empty_ok=True)))
        for name in ("model_aliases", "served_model_names"):
            names = getattr(self, name)
            if not isinstance(names, tuple) or not all(isinstance(a, str) for a in names):
                raise ValueError(f"{name}: expected a tuple of strings, got {names!r}")
        Int(lo=1)(self.default_max_tokens, "default_max_tokens")
        level = _check_str(self.log_level, "log_level")
        if level is None or level.lower() not in LOG_LEVELS:
            raise ValueError(f"log_level: {self.log_level!r} is not one of {list(LOG_LEVELS)}")
        put("log_level", level.lower())
        boolean(self.access_log, "access_log")
        Int(lo=1024, hint="bytes")(self.max_request_body_bytes, "max_request_body_bytes")
        put("shutdown_timeout", _check_seconds(self.shutdown_timeout, "shutdown_timeout"))
        self._check_compat_options(put)

    def _check_compat_options(self, put: Callable[[str, Any], None]) -> None:
        """The options vLLM users bring: chat template, generation config, logprobs, tools, logs."""
        from hyserve.config import Int, boolean

        put("chat_template", _chat_template_text(self.chat_template))
        gen = _check_str(self.generation_config, "generation_config")
        if gen not in ("auto", "vllm"):
            read_generation_config(str(gen))
        Int(lo=-1, hi=MAX_LOGPROBS, hint=f"{MAX_LOGPROBS} is the most the engine returns")(
            self.max_logprobs, "max_logprobs"
        )
        put("max_logprobs", MAX_LOGPROBS if self.max_logprobs == -1 else self.max_logprobs)
        for name in ("enable_auto_tool_choice", "log_requests", "log_stats"):
            boolean(getattr(self, name), name)
        if self.enable_auto_tool_choice and self.tool_parser is None:
            raise ValueError(
                "enable_auto_tool_choice: needs a tool parser to read the model's tool calls: add "
                "--tool-call-parser qwen3_coder (or tool_parser in the YAML)"
            )
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format: {self.log_format!r} is not one of {list(LOG_FORMATS)}")
        self._check_http_options(put)

    def _check_http_options(self, put: Callable[[str, Any], None]) -> None:
        """CORS, the per-request fan-out, slow clients and the bytes in flight."""
        from hyserve.config import Int, boolean

        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            put(name, _str_list(getattr(self, name), name))
        boolean(self.allow_credentials, "allow_credentials")
        Int(lo=1)(self.max_sequences_per_request, "max_sequences_per_request")
        put("request_read_timeout", _check_seconds(self.request_read_timeout, "request_read_timeout"))
        Int(lo=1)(self.max_connections, "max_connections")
        if self.engine_process not in ENGINE_PROCESS_MODES:
            raise ValueError(
                f"engine_process: {self.engine_process!r} is not one of {list(ENGINE_PROCESS_MODES)}"
            )
        Int(lo=self.max_request_body_bytes, hint="bytes")(
            self.max_inflight_body_bytes, "max_inflight_body_bytes"
        )


def hyserve_version() -> str:
    try:
        return metadata.version("hyserve")
    except metadata.PackageNotFoundError:  # running from a source tree that isn't installed
        return "0.0.0+unknown"


def usage_info(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


def sse(obj: Any) -> str:
    return f"data: {obj}\n\n"


class StreamChunks:
    """What every chunk of one SSE stream shares (id, object, created, model) and its closing usage chunk.
    Per-token chunks are formatted straight from `token_head` / `token_tail`: the pydantic model + dump costs
    several microseconds per token per stream on the event loop. `usage`: the request's usage so far."""

    object_name = ""

    def __init__(
        self,
        request_id: str,
        model_name: str,
        *,
        include_usage: bool,
        continuous: bool,
        usage: Callable[[], UsageInfo],
    ) -> None:
        self.request_id, self.model_name, self.created = request_id, model_name, now()
        self.include_usage, self.continuous, self.usage = include_usage, continuous, usage
        ids = {"id": request_id, "object": self.object_name, "created": self.created, "model": model_name}
        self.token_head = json.dumps(ids)[:-1] + ', "choices": [{"index": '
        self.token_tail = ', "usage": null}' if include_usage else "}"

    def usage_chunk(self) -> str:
        """The last chunk of a stream that asked for usage: no choices, the usage of the whole request."""
        return sse(
            json.dumps(
                {
                    "id": self.request_id,
                    "object": self.object_name,
                    "created": self.created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self.usage().model_dump(mode="json"),
                }
            )
        )


class AppState:
    """The engine of one app and the request checks shared by its routes."""

    def __init__(self, engine: Any, opts: ServerOptions, metrics: ServerMetrics, app_state: Any) -> None:
        self.engine = RequestLogging(engine) if opts.log_requests else engine
        self.opts = opts
        self.metrics = metrics
        self._app_state = app_state  # Starlette's app.state: `accepting` is set there by serve.py
        self.tok = engine.tokenizer
        if opts.chat_template is not None and self.tok is not None:
            self.tok = self.tok.with_chat_template(opts.chat_template)
        elif opts.chat_template is not None:
            logger.warning("--chat-template is unused: this model has no tokenizer (token-id prompts only)")
        self.defaults = self._sampling_defaults()
        # /v1/models: the reported name first, then the other --served-model-name names
        self.listed_names = tuple(dict.fromkeys((engine.model_name, *opts.served_model_names)))
        self.served_names = {*self.listed_names, *(a for a in opts.model_aliases if a)}
        # n > 1: a prompt this long has its other choices wait for choice 0's first token and hit the prefix
        # cache (None: the engine has no prefix cache, every choice prefills on its own)
        cache_cfg = getattr(getattr(engine, "config", None), "cache", None)
        self.stagger_min: int | None = None
        if cache_cfg is not None and cache_cfg.enable_block_reuse:
            interval = cache_cfg.mamba_state_config.periodic_snapshot_interval or 0
            self.stagger_min = max(2 * cache_cfg.tokens_per_block, interval)
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        # one request's sequences in the engine at once: 7/8 of the batch, so another client's request always
        # finds a place in it (generation.pace_jobs)
        batch = getattr(engine, "max_batch_size", None)
        self.fanout_window: int | None = None if batch is None else max(1, batch - max(1, batch // 8))

    def _sampling_defaults(self) -> dict[str, float | int]:
        """What requests that leave out temperature, top_p, top_k, min_p, repetition_penalty or max_tokens
        get (--generation-config), logged once."""
        mode = self.opts.generation_config
        if mode == "vllm":
            return {}
        if mode == "auto":
            gen = getattr(self.engine.tokenizer, "generation_config", None) or {}
        else:
            gen = read_generation_config(mode)
        defaults = sampling_defaults(gen)
        if defaults:
            fields = ", ".join(f"{k}={v}" for k, v in defaults.items())
            logger.info(
                "requests that leave them out get the sampling defaults of %s: %s (--generation-config vllm "
                "turns them off)",
                "the model's generation_config.json" if mode == "auto" else mode,
                fields,
            )
        return defaults

    # -- checks --

    @property
    def accepting(self) -> bool:
        return getattr(self._app_state, "accepting", True)

    def check_model(self, name: str | None) -> None:
        if name is None or name == "" or name in self.served_names:
            return
        raise APIError(
            f"the model {name!r} does not exist; this server serves {self.engine.model_name!r}",
            status_code=404,
            param="model",
            code="model_not_found",
        )

    def check_sampling_fields(self, req: Any, prompts: int = 1) -> None:
        """`n`, the request's sequences (`prompts` x n) and `logit_bias` keys (the checks pydantic cannot
        make)."""
        if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
            raise bad_request(f"n must be between 1 and {MAX_CHOICES}, got {req.n}", param="n")
        n = req.n or 1
        limit = self.opts.max_sequences_per_request
        if prompts * n > limit:
            what = f"{prompts} prompts x n = {n}" if prompts > 1 else f"n = {n}"
            raise bad_request(
                f"this request asks for {prompts * n} sequences ({what}), more than this server's limit of "
                f"{limit} per request (--max-sequences-per-request): split it into several requests",
                param="n" if prompts == 1 else "prompt",
                code="too_many_sequences",
            )
        for key in req.logit_bias or {}:
            if not _INT_KEY.fullmatch(key.strip()):
                raise bad_request(
                    f"logit_bias keys must be token ids (integers as strings), got {key[:40]!r}",
                    param="logit_bias",
                )

    def check_healthy(self) -> None:
        if not self.accepting:
            raise APIError("the server is shutting down", status_code=503, code="shutting_down")
        if not self.engine.healthy:
            raise APIError(
                "the engine is not running (see /health and the server log)",
                status_code=503,
                code="engine_unavailable",
            )

    def check_prompt_chars(self, n_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a prompt that no tokenization fits in max_seq_len: c characters need
        at least c / (the tokenizer's longest token) tokens (halved again for normalisers that shrink text).
        Tokenizing 10M characters takes seconds that a hopeless request should not cost."""
        if self.tok is None:
            return
        longest = self.tok.max_token_chars
        if n_chars > 2 * longest * self.engine.max_seq_len:
            raise bad_request(
                f"{param} has {n_chars} characters, far more than max_seq_len = {self.engine.max_seq_len} "
                f"tokens can hold (this tokenizer's longest token has {longest} characters)",
                param=param,
                code="context_length_exceeded",
            )

    async def validate_async(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_param: str,
        grammar_param: str = "structured_outputs",
        priority: int = 0,
    ) -> None:
        """`validate`, on a worker thread when the request has a structured-outputs constraint: the engine's
        validation compiles its grammar (cached after), which can take a while for a large schema."""
        if params.structured_outputs is None:
            self.validate(prompt_ids, params, prompt_param, grammar_param, priority)
        else:
            await asyncio.to_thread(self.validate, prompt_ids, params, prompt_param, grammar_param, priority)

    def validate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        prompt_param: str,
        grammar_param: str = "structured_outputs",
        priority: int = 0,
    ) -> None:
        """The engine's checks of one request (`priority` too: a 400 under fcfs unless 0), as 400s."""
        try:
            self.engine.validate_request(prompt_ids, params, priority)
        except GrammarError as e:
            raise bad_request(f"{grammar_param}: {e}", param=grammar_param) from None
        except RequestRejected as e:
            param = getattr(e, "param", None)
            if param == "prompt":
                param = prompt_param
            raise bad_request(str(e), param=param, code=getattr(e, "code", None)) from None
        except ValueError as e:
            raise bad_request(str(e), param=prompt_param) from None

    # -- conversions --

    def token_text(self, tid: int) -> str:
        s = self._token_text.get(tid)
        if s is None:
            if self.tok is None:
                s = f"token_id:{tid}"
            else:
                try:
                    s = self.tok.token_text(tid)
                except Exception:
                    s = self.tok.decode([tid], skip_special_tokens=False)
            if len(self._token_text) < 1_000_000:
                self._token_text[tid] = s
        return s

    def token_bytes(self, tid: int) -> list[int]:
        """The token's own bytes (chat logprobs' `bytes`): a byte token of a partial UTF-8 character is
        [0xF5], not the UTF-8 of its '\\xf5' display text."""
        b = self._token_bytes.get(tid)
        if b is None:
            raw: bytes | None = None
            if self.tok is not None:
                try:
                    raw = self.tok.token_bytes(tid)
                except Exception:
                    raw = None
            b = list(raw if raw is not None else self.token_text(tid).encode("utf-8"))
            if len(self._token_bytes) < 1_000_000:
                self._token_bytes[tid] = b
        return b

    def sampling_params(
        self,
        req: Any,
        n_prompt: int,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        *,
        logprobs_param: str = "logprobs",
        **extra: Any,
    ) -> SamplingParams:
        """The request's sampling fields (`_SamplingFields` of protocol.py) as `SamplingParams`; a value
        SamplingParams refuses is a 400 naming the field (`logprobs_param`: the request's name for it)."""
        if max_tokens is None:
            room = self.engine.max_seq_len - n_prompt
            cap = min(self.opts.default_max_tokens, int(self.defaults.get("max_tokens", 2**62)))
            max_tokens = max(1, min(room, cap))
        for asked, name in ((logprobs, logprobs_param), (prompt_logprobs, "prompt_logprobs")):
            if asked is not None and asked > self.opts.max_logprobs:
                raise bad_request(
                    f"{name}: {asked} is more than this server's limit of {self.opts.max_logprobs} "
                    "(--max-logprobs)",
                    param=name,
                )
        d = self.defaults
        stop: tuple[str, ...] = ()
        if isinstance(req.stop, str):
            stop = (req.stop,) if req.stop else ()
        elif req.stop:
            stop = tuple(req.stop)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=d.get("temperature", 1.0) if req.temperature is None else req.temperature,
                top_p=d.get("top_p", 1.0) if req.top_p is None else req.top_p,
                top_k=int(d.get("top_k", 0)) if req.top_k is None else req.top_k,
                min_p=d.get("min_p", 0.0) if req.min_p is None else req.min_p,
                seed=req.seed,
                stop=stop,
                stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=req.include_stop_str_in_output,
                skip_special_tokens=req.skip_special_tokens,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=(
                    d.get("repetition_penalty", 1.0)
                    if req.repetition_penalty is None
                    else req.repetition_penalty
                ),
                logit_bias=tuple(sorted((int(k), v) for k, v in (req.logit_bias or {}).items())),
                prompt_logprobs=prompt_logprobs,
                **extra,
            )
        except ValueError as e:
            msg = str(e)
            param = msg.split(" ", 1)[0] if msg else None
            if param == "logprobs":
                param = logprobs_param
            raise bad_request(msg, param=param) from None

    # -- off the event loop --

    @staticmethod
    async def off_loop(fn: Callable[[], Any], large: bool) -> Any:
        """Run `fn` on a worker thread when its work is large (rendering + tokenising a long prompt: an
        800k-token document takes seconds; building a large reply), or when the request's body was large
        (its tools or template variables may be), so the event loop keeps streaming to everyone else; small
        work runs in place."""
        return await asyncio.to_thread(fn) if large or large_body() else fn()

    @staticmethod
    def large_reply(num_output_tokens: int, top_n: int) -> bool:
        return num_output_tokens * (1 + top_n) > OFF_LOOP_REPLY_TOKENS

    # -- failures --

    def stream_failure(self, e: BaseException) -> APIError:
        """The in-band error of a stream that failed after its 200."""
        if isinstance(e, APIError):
            return e
        err = engine_api_error(self.engine, e)
        return err if err is not None else internal_error("internal server error while streaming", e)
