"""`hyserve bench needle`: the needle-in-a-haystack client of the long-prompt crash report, at chosen sizes.

Each request is the report's: a needle sentence in the middle of repeated filler words, one user message
asking for the code, `chat_template_kwargs` (default `{"enable_thinking": false}`), temperature 0,
non-streaming /v1/chat/completions. Sizes are target prompt tokens. The filler length for a size comes
from two /tokenize calls (the prompt with 0 and with N filler words: tokens = a + b * words), or, for a
server without /tokenize, from one token per word. The server's `usage.prompt_tokens` is reported.

Each size is asked at every depth of `depths` (default: the one `position`), one request each, so a
trained checkpoint (scripts/train_needle.py) gives a HIT / MISS grid by size and depth.

Outcomes per size and depth: HTTP status (a 400 for a prompt that is too long is a valid outcome), the error
message, latency, whether the answer contains the needle's code (HIT / MISS; with random weights it
will not: that is reported as a MISS, not an error, since the point there is that the server serves it), and
whether /health still answers afterwards (the report's server died on a 256k prompt).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from hyserve.bench.http_client import (
    auth_headers,
    error_message,
    first_model_id,
    get_json,
    join_url,
    server_root,
)

DEFAULT_NEEDLE = "The secret code is ORANGE-MANGO-42."
DEFAULT_FILLER = "alphabet "
QUESTION = (
    "Find the secret code in the document. Reply with ONLY the code string, nothing else.\n\nDOCUMENT:\n"
)
_FIT_WORDS = 256  # filler words in the second /tokenize call
_APPROX_OVERHEAD = 48  # tokens for the question, needle and chat template when /tokenize is missing


@dataclass(frozen=True, kw_only=True)
class NeedleOptions:
    base_url: str
    model: str | None = None
    api_key: str | None = None
    sizes: tuple[int, ...] = (1000, 8000, 32000)
    needle: str = DEFAULT_NEEDLE
    answer: str | None = None  # what must come back; default: the needle's last word
    filler: str = DEFAULT_FILLER
    position: float = 0.5  # where the needle sits, as a fraction of the filler
    depths: tuple[float, ...] = ()  # several needle depths per size (each a request); empty: (position,)
    max_tokens: int = 64
    temperature: float = 0.0
    chat_template_kwargs: dict[str, Any] | None = field(default_factory=lambda: {"enable_thinking": False})
    timeout_s: float = 1800.0


def parse_size(s: str) -> int:
    """'1k' -> 1000, '1.5k' -> 1500, '1M' -> 1000000, '4096' -> 4096 (decimal multiples, as the report
    counts its 256k / 800k prompts)."""
    t = s.strip().lower().replace("_", "")
    mult = 1
    if t.endswith("k"):
        mult, t = 1000, t[:-1]
    elif t.endswith("m"):
        mult, t = 1_000_000, t[:-1]
    try:
        v = float(t) * mult
    except ValueError:
        raise ValueError(f"not a size: {s!r} (use e.g. 1k, 8k, 256k, 1M or 4096)") from None
    if v != v or v < 1 or v > 1e9:
        raise ValueError(f"size out of range: {s!r}")
    return int(round(v))


def needle_depths(opts: NeedleOptions) -> tuple[float, ...]:
    """The depths each size is asked at; every one a fraction in [0, 1]."""
    depths = opts.depths or (opts.position,)
    bad = [d for d in depths if not 0.0 <= d <= 1.0]
    if bad:
        raise ValueError(f"needle depths must be fractions in [0, 1], got {bad}")
    return depths


def hit_or_miss(row: dict[str, Any]) -> str:
    """HIT: a 200 whose answer contains the code; MISS: a 200 without it; otherwise the HTTP outcome."""
    if row.get("status") != 200:
        return "no answer" if row.get("status") is None else f"HTTP {row['status']}"
    return "HIT" if row.get("needle_found") else "MISS"


def expected_answer(opts: NeedleOptions) -> str:
    return opts.answer or opts.needle.strip().rstrip(".").split()[-1]


def haystack_prompt(n_words: int, *, needle: str, filler: str, position: float) -> str:
    left = int(n_words * position)
    return QUESTION + filler * left + needle + " " + filler * (n_words - left)


def request_body(model: str, prompt: str, opts: NeedleOptions) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": opts.max_tokens,
        "temperature": opts.temperature,
    }
    if opts.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = opts.chat_template_kwargs
    return body


async def _count_tokens(
    client: httpx.AsyncClient,
    root: str,
    model: str,
    prompt: str,
    opts: NeedleOptions,
    headers: dict[str, str],
) -> int | None:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "add_generation_prompt": True,
    }
    if opts.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = opts.chat_template_kwargs
    try:
        r = await client.post(f"{root}/tokenize", json=body, headers=headers, timeout=120)
        if r.status_code != 200:
            return None
        d = r.json()
        if isinstance(d.get("count"), int):
            return int(d["count"])
        return len(d["tokens"]) if isinstance(d.get("tokens"), list) else None
    except (httpx.HTTPError, ValueError, AttributeError, KeyError):
        return None


async def token_model(
    client: httpx.AsyncClient, root: str, model: str, opts: NeedleOptions, headers: dict[str, str]
) -> tuple[float, float, str]:
    """(tokens with no filler, tokens per filler word, method) for this server's tokenizer and template."""

    def p(n: int) -> str:
        return haystack_prompt(n, needle=opts.needle, filler=opts.filler, position=opts.position)

    a = await _count_tokens(client, root, model, p(0), opts, headers)
    b = await _count_tokens(client, root, model, p(_FIT_WORDS), opts, headers) if a is not None else None
    if a is None or b is None or b <= a:
        return float(_APPROX_OVERHEAD), 1.0, "approximate (1 token per filler word)"
    return float(a), (b - a) / _FIT_WORDS, "tokenize"


def words_for(target: int, base: float, per_word: float) -> int:
    return max(0, round((target - base) / per_word))


async def _health(client: httpx.AsyncClient, root: str, headers: dict[str, str]) -> bool | None:
    """True/False: /health answered 200 / the server is gone or unhealthy; None: no /health route."""
    try:
        r = await client.get(f"{root}/health", headers=headers, timeout=30)
    except httpx.HTTPError:
        return False
    if r.status_code == 404:
        return None
    return r.status_code == 200


async def _one(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    answer: str,
    timeout_s: float,
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "status": None,
        "error": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "content": None,
        "needle_found": False,
    }
    t0 = time.perf_counter()
    try:
        r = await client.post(url, json=body, headers=headers, timeout=httpx.Timeout(timeout_s, connect=30))
        row["status"] = r.status_code
        if r.status_code != 200:
            row["error"] = error_message(r.status_code, r.content)
        else:
            d = r.json()
            msg = (d.get("choices") or [{}])[0].get("message") or {}
            content = msg.get("content") or ""
            reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
            usage = d.get("usage") or {}
            row.update(
                prompt_tokens=usage.get("prompt_tokens"),
                completion_tokens=usage.get("completion_tokens"),
                content=content[:500],
                needle_found=answer in content or answer in reasoning,
            )
    except httpx.HTTPError as e:
        row["error"] = f"{type(e).__name__}: {e}".rstrip(": ")
    except ValueError as e:  # a 200 whose body is not JSON
        row["error"] = f"bad response body: {e}"
    row["latency_s"] = time.perf_counter() - t0
    return row


async def _run(opts: NeedleOptions, log: Callable[[str], None]) -> dict[str, Any]:
    needle_depths(opts)  # bad depths fail before any request
    headers = auth_headers(opts.api_key)
    root = server_root(opts.base_url)
    url = join_url(opts.base_url, "/v1/chat/completions")
    answer = expected_answer(opts)
    async with httpx.AsyncClient() as client:
        if opts.model is None:
            model = await first_model_id(client, opts.base_url, headers)
        else:
            model = opts.model
            await get_json(client, join_url(opts.base_url, "/v1/models"), headers=headers)  # reachable?
        base, per_word, method = await token_model(client, root, model, opts, headers)
        rows = []
        for target in opts.sizes:
            n_words = words_for(target, base, per_word)
            for depth in needle_depths(opts):
                prompt = haystack_prompt(n_words, needle=opts.needle, filler=opts.filler, position=depth)
                row: dict[str, Any] = {
                    "target_tokens": target,
                    "depth": depth,
                    "filler_words": n_words,
                    "estimated_prompt_tokens": round(base + per_word * n_words),
                }
                row.update(
                    await _one(
                        client, url, request_body(model, prompt, opts), headers, answer, opts.timeout_s
                    )
                )
                row["healthy_after"] = await _health(client, root, headers)
                row["outcome"] = hit_or_miss(row)
                rows.append(row)
                what = (
                    f"prompt_tokens={row['prompt_tokens']} {row['outcome']}"
                    if row["status"] == 200
                    else f"{row['error']}"
                )
                log(
                    f"needle {target:,} tokens at depth {depth:g}: status {row['status']} in "
                    f"{row['latency_s']:.1f} s, {what}, healthy after: {row['healthy_after']}"
                )
    return {
        "model": model,
        "api_url": url,
        "answer": answer,
        "token_count_method": method,
        "tokens_without_filler": base,
        "tokens_per_filler_word": per_word,
        "results": rows,
    }


def run_needle_bench(opts: NeedleOptions, log: Callable[[str], None] = print) -> dict[str, Any]:
    out = asyncio.run(_run(opts, log))
    cfg = asdict(opts)
    cfg.pop("api_key", None)
    out["config"] = cfg
    return out


def served_cleanly(row: dict[str, Any]) -> bool:
    """The server answered (any status below 500, a 400 for too long included) and is still healthy."""
    st = row.get("status")
    return st is not None and st < 500 and row.get("healthy_after") is not False
