"""What the engine hands back: per-token logprobs, streaming deltas, and finished request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]  # the requested top-k alternatives: token id -> logprob


@dataclass
class StreamDelta:
    """New output of one request since its previous delta (the async engine yields these)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    # once, with the first output token: one entry per prompt token (None for the first)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # time.monotonic() when the engine took the request, and when a step first scheduled it (None until
    # then): the request's queue time for /metrics
    arrival_time: float | None = None
    first_scheduled_time: float | None = None


@dataclass
class RequestOutput:
    """A finished request (what `LLM.generate` returns, one per prompt, in prompt order)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    num_cached_tokens: int
    stop_reason: int | str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when SamplingParams.prompt_logprobs is set
