"""One streamed OpenAI-style request, timed per chunk, with httpx (any OpenAI-compatible server).

The request asks for `stream_options.include_usage` so the server's own token counts come back in the last
chunk; a server that ignores it still works (output tokens are then counted as output chunks). A stream
that fails after its 200 (an in-band `data: {"error": ...}` event) counts as a failed request.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx

from hyserve.bench.metrics import RequestResult
from hyserve.bench.sse_client import LeanClient, serves

COMPLETIONS = "completions"
CHAT = "chat"


class BenchError(RuntimeError):
    """A problem the user can fix (unreachable server, unknown model, bad file); one line, nonzero exit."""


def endpoint_kind(endpoint: str) -> str:
    e = endpoint.rstrip("/")
    if e.endswith("/chat/completions"):
        return CHAT
    if e.endswith("/completions"):
        return COMPLETIONS
    raise BenchError(f"--endpoint must end in /completions or /chat/completions, got {endpoint!r}")


def join_url(base_url: str, path: str) -> str:
    """base + path, without doubling a `/v1` that the user put on the base URL (as the openai client
    wants)."""
    base = base_url.rstrip("/")
    if not path.startswith("/"):
        path = "/" + path
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[3:]
    return base + path


def server_root(base_url: str) -> str:
    """The URL without a trailing `/v1` (vLLM's /tokenize and /health live at the root)."""
    base = base_url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def build_payload(
    kind: str,
    model: str,
    prompt: list[int] | str,
    max_tokens: int,
    *,
    ignore_eos: bool,
    temperature: float,
    stream: bool = True,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": temperature}
    if kind == CHAT:
        if not isinstance(prompt, str):
            raise BenchError("chat endpoints take text prompts")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


def error_message(status: int, body: bytes) -> str:
    """'HTTP 400: <the server's message>' (OpenAI, FastAPI and plain-text error bodies)."""
    text = body.decode(errors="replace").strip()
    msg = text
    try:
        d = json.loads(text)
        if isinstance(d, dict):
            err = d.get("error", d)
            if isinstance(err, dict):
                msg = str(err.get("message") or err.get("detail") or err)
            elif "message" in d:
                msg = str(d["message"])
            elif "detail" in d:
                msg = str(d["detail"])
            else:
                msg = str(err)
    except ValueError:
        pass
    return f"HTTP {status}: {' '.join(msg.split())[:400]}"


def _chunk_output(kind: str, choice: dict[str, Any]) -> str | None:
    """The output a chunk's first choice carries ('' if it carries tool calls only), None if nothing."""
    if kind == CHAT:
        delta = choice.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            v = delta.get(key)
            if v:
                return str(v)
        return "" if delta.get("tool_calls") else None
    # A completion chunk is one engine step's output even when its text is empty (a token that
    # detokenizes to nothing yet, or a server without a tokenizer streaming token-id prompts): count
    # it, as vLLM's benchmark does. Only a chunk that just closes the stream carries no token.
    t = choice.get("text")
    if not isinstance(t, str) or (not t and choice.get("finish_reason") and choice.get("logprobs") is None):
        return None
    return t


async def sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """The `data:` payloads of a streamed response's server-sent events, up to `[DONE]`."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield data


class _Tally:
    """One streamed response's events added up into its RequestResult (an EventSink of sse_client)."""

    def __init__(self, kind: str, res: RequestResult, st: float) -> None:
        self.kind, self.res, self.st = kind, res, st
        self.last = st
        self.n_chunks = 0
        self.parts: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.finish_seen_at: float | None = None

    def status(self, code: int) -> None:
        self.res.status = code

    def refused(self, code: int, body: bytes) -> None:
        self.res.error = error_message(code, body)  # the status came first, through status()

    def error(self, message: str) -> None:
        self.res.error = message

    def event(self, data: str, now: float) -> bool:
        """One event's data; False ends the stream (an in-band error or a malformed event)."""
        res = self.res
        try:
            obj = json.loads(data)
        except ValueError:
            res.error = f"bad SSE event: {data[:200]!r}"
            return False
        if not isinstance(obj, dict):
            return True
        if "error" in obj:
            err = obj["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            res.error = f"stream error: {' '.join(str(msg).split())[:400]}"
            return False
        if obj.get("usage"):
            self.usage = obj["usage"]
        choices = obj.get("choices") or []
        if not choices or not isinstance(choices[0], dict):
            return True
        out = _chunk_output(self.kind, choices[0])
        if out is not None:
            if self.n_chunks == 0:
                res.ttft_s = now - self.st
            else:
                res.itl_s.append(now - self.last)
            self.last = now
            self.n_chunks += 1
            self.parts.append(out)
        if choices[0].get("finish_reason") and self.finish_seen_at is None:
            self.finish_seen_at = now
        return True

    def result(self, end: float) -> RequestResult:
        res, usage = self.res, self.usage
        res.e2el_s = end - self.st
        res.text = "".join(self.parts)
        if usage:
            if isinstance(usage.get("completion_tokens"), int):
                res.output_tokens = usage["completion_tokens"]
                res.output_tokens_from_usage = True
            if isinstance(usage.get("prompt_tokens"), int):
                res.usage_prompt_tokens = usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                res.cached_tokens = details["cached_tokens"]
        if not res.output_tokens_from_usage:
            res.output_tokens = self.n_chunks
        if res.error is None and res.status == 200:
            if res.ttft_s is None and self.finish_seen_at is not None:
                # finished without a visible output chunk (e.g. bytes held back by the detokenizer)
                res.ttft_s = self.finish_seen_at - self.st
            if res.ttft_s is None:
                res.error = "the stream ended without any output chunk"
            else:
                res.ok = True
        return res


async def send_streaming(
    client: httpx.AsyncClient | LeanClient,
    url: str,
    payload: dict[str, Any],
    *,
    kind: str,
    prompt_len: int,
    headers: dict[str, str] | None = None,
    run_start: float = 0.0,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestResult:
    """POST one streaming request and time it; never raises for server or network failures. `client`:
    httpx, or the lean client of sse_client (plain http; the benchmark's streams)."""
    res = RequestResult(ok=False, prompt_len=prompt_len, max_tokens=int(payload.get("max_tokens") or 0))
    st = clock()
    res.start_s = st - run_start if run_start else 0.0
    tally = _Tally(kind, res, st)
    if isinstance(client, LeanClient):
        await client.post_sse(url, payload, headers or {}, tally, clock)
        return tally.result(clock())
    try:
        async with client.stream("POST", url, json=payload, headers=headers or {}) as resp:
            tally.status(resp.status_code)
            if resp.status_code != 200:
                tally.refused(resp.status_code, await resp.aread())
                return tally.result(clock())
            async for data in sse_data(resp):
                if not tally.event(data, clock()):
                    break
    except httpx.HTTPError as e:
        tally.error(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    return tally.result(clock())


def stream_client(url: str, http: httpx.AsyncClient, read_timeout_s: float) -> httpx.AsyncClient | LeanClient:
    """The client for a benchmark's streams to `url`: the lean one where it serves (plain http, no
    proxy), else `http`."""
    return LeanClient(read_timeout_s) if serves(url) else http


async def get_json(
    client: httpx.AsyncClient, url: str, *, headers: dict[str, str] | None = None, timeout: float = 30.0
) -> tuple[int, Any]:
    """(status, parsed JSON or None). Raises BenchError when the server cannot be reached at all."""
    try:
        r = await client.get(url, headers=headers or {}, timeout=timeout)
    except httpx.HTTPError as e:
        detail = f"{type(e).__name__}: {e}".rstrip(": ")
        raise BenchError(
            f"cannot reach the server at {url} ({detail}); is it running? "
            "(set --base-url, or --host and --port)"
        ) from None
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, None


async def first_model_id(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    """The first id of GET /v1/models (the model to use when --model is not given)."""
    url = join_url(base_url, "/v1/models")
    status, body = await get_json(client, url, headers=headers)
    if status != 200 or not isinstance(body, dict) or not body.get("data"):
        raise BenchError(f"GET {url} answered HTTP {status} without a model list; pass --model")
    return str(body["data"][0]["id"])


# hyserve's engine counters worth reporting per run (other servers simply do not export them)
SERVER_COUNTERS = (
    "num_preemptions",
    "prefix_cache_hits",
    "prefix_cache_queries",
    "jit_compiles_after_ready",
    "generation_tokens",
    "cuda_alloc_retries",
    "engine_steps",
    "engine_prefill_steps",
    "prefill_tokens_scheduled",
)


def parse_counters(text: str) -> dict[str, float]:
    """`hyserve_<name>[_total] value` lines of a Prometheus exposition, for the names in SERVER_COUNTERS."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("hyserve_"):
            continue
        name, _, value = line.partition(" ")
        name = name.removeprefix("hyserve_").removesuffix("_total")
        if name in SERVER_COUNTERS:
            try:
                out[name] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return out


async def scrape_counters(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str]
) -> dict[str, float]:
    """The server's engine counters from GET /metrics; empty when it has none (any server but hyserve)."""
    try:
        resp = await client.get(server_root(base_url) + "/metrics", headers=headers, timeout=10.0)
    except httpx.HTTPError:
        return {}
    return parse_counters(resp.text) if resp.status_code == 200 else {}
