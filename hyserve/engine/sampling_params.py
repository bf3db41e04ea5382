"""`SamplingParams`: how one request is decoded. Validated on construction with errors naming the field
and its allowed range (the server maps these `ValueError`s to HTTP 400)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k >= 0 -> chosen token + top-k alternatives
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        self.validate()

    def validate(self) -> None:
        def bad(field_name: str, allowed: str, value: object) -> ValueError:
            return ValueError(f"{field_name} must be {allowed}, got {value!r}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1", self.max_tokens)
        if not isinstance(self.temperature, int | float) or not (0.0 <= self.temperature <= 100.0):
            raise bad("temperature", "in [0, 100]", self.temperature)
        if not isinstance(self.top_p, int | float) or not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", "in (0, 1]", self.top_p)
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 or -1 disables it)", self.top_k)
        if not isinstance(self.min_p, int | float) or not (0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", "an integer", self.seed)
        if self.logprobs is not None and (
            isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
            or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "a list of non-empty strings", self.stop)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", "a list of token ids >= 0", self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
