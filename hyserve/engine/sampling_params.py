"""`SamplingParams`: how one request is decoded. Validated on construction with errors naming the field
and its allowed range (the server maps these `ValueError`s to HTTP 400)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias per request
# Stop strings are searched for in the new text of every step, on the engine's thread: bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
# Temperatures below this sample as greedy (softmax(x / t) is one-hot long before t reaches float32's
# smallest normal, where x / t overflows to inf and the sampled token becomes arbitrary)
GREEDY_BELOW_TEMPERATURE = 1e-5


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
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (no prefix-cache hit)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0  # [-2, 2]; see hyserve/engine/logits_processing.py
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 10]; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
        else:
            object.__setattr__(self, "logit_bias", tuple(tuple(kv) for kv in self.logit_bias or ()))
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
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not isinstance(self.prompt_logprobs, int)
            or not (0 <= self.prompt_logprobs <= MAX_LOGPROBS)
        ):
            raise bad("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}]", self.prompt_logprobs)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "a list of non-empty strings", self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} strings", f"{len(self.stop)} strings")
        if (chars := sum(len(s) for s in self.stop)) > MAX_STOP_CHARS:
            raise bad("stop", f"at most {MAX_STOP_CHARS} characters in all", f"{chars} characters")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("stop_token_ids", "a list of token ids >= 0", self.stop_token_ids)
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not (-2.0 <= v <= 2.0):
                raise bad(name, "in [-2, 2]", v)
        r = self.repetition_penalty
        if isinstance(r, bool) or not isinstance(r, int | float) or not (0.0 < r <= 10.0):
            raise bad("repetition_penalty", "in (0, 10] (1 = off)", r)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries", f"{len(self.logit_bias)} entries")
        for kv in self.logit_bias:
            ok = len(kv) == 2 and isinstance(kv[0], int) and not isinstance(kv[0], bool) and kv[0] >= 0
            if not ok or isinstance(kv[1], bool) or not isinstance(kv[1], int | float) or not (-100 <= kv[1] <= 100):
                raise bad("logit_bias", "token id >= 0 -> bias in [-100, 100]", kv)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def edits_logits(self) -> bool:
        """Penalties or a logit bias: the logits are edited before sampling (logits_processing.py)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))

    @property
    def needs_history(self) -> bool:
        """A penalty that depends on the tokens seen so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
