"""`SamplingParams`: how one request is decoded. Validated on construction with errors naming the field
and its allowed range (the server maps these `ValueError`s to HTTP 400)."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries of logit_bias per request
# Stop strings are searched for in the new text of every step, on the engine's thread: bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 4096  # all of a request's stop strings together
# Temperatures below this sample as greedy (softmax(x / t) is one-hot long before t reaches float32's
# smallest normal, where x / t overflows to inf and the sampled token becomes arbitrary)
GREEDY_BELOW_TEMPERATURE = 1e-5


MAX_GRAMMAR_CHARS = 200_000  # a json schema, regex or grammar; all choices together


@dataclass(frozen=True, kw_only=True)
class StructuredOutputsParams:
    """One constraint on the output (hyserve/engine/sampling/structured_output.py): a JSON schema (`json`, a
    dict or its JSON text), any JSON object (`json_object`), a regular expression, one of `choice`, or an EBNF
    `grammar`. `start_after`: the constraint starts once this string has been generated (the end of the
    thinking section, "</think>", when a reasoning parser is on)."""

    json: str | dict | None = None  # a dict is stored as its JSON text
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    start_after: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            set_.append("json_object")
        if len(set_) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                f"got {set_ or 'none'}"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(
                f"structured_outputs.json must be a JSON schema (an object), got {type(self.json).__name__}"
            )
        if isinstance(self.json, dict):  # kept as text: the params stay hashable, and it is the cache key
            object.__setattr__(self, "json", _json.dumps(self.json, sort_keys=True))
        for k in ("regex", "grammar", "start_after"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k} must be a non-empty string, got {v!r}")
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        size = len(self.json) if isinstance(self.json, str) else 0
        size += len(self.regex or "") + len(self.grammar or "") + sum(len(c) for c in self.choice or ())
        if size > MAX_GRAMMAR_CHARS:
            raise ValueError(
                f"structured_outputs: at most {MAX_GRAMMAR_CHARS} characters of constraint, got {size}"
            )


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
    prompt_logprobs: int | None = (
        None  # the same for every prompt token after the first (no prefix-cache hit)
    )
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0  # [-2, 2]; see hyserve/engine/sampling/logits_processing.py
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 10]; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]); a dict is accepted
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding (structured_output.py)
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
            isinstance(self.logprobs, bool)
            or not isinstance(self.logprobs, int)
            or not (0 <= self.logprobs <= MAX_LOGPROBS)
        ):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool)
            or not isinstance(self.prompt_logprobs, int)
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
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)
        for kv in self.logit_bias:
            ok = len(kv) == 2 and isinstance(kv[0], int) and not isinstance(kv[0], bool) and kv[0] >= 0
            if (
                not ok
                or isinstance(kv[1], bool)
                or not isinstance(kv[1], int | float)
                or not (-100 <= kv[1] <= 100)
            ):
                raise bad("logit_bias", "token id >= 0 -> bias in [-100, 100]", kv)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @property
    def edits_logits(self) -> bool:
        """Penalties or a logit bias: the logits are edited before sampling (logits_processing.py)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )

    @property
    def needs_history(self) -> bool:
        """A penalty that depends on the tokens seen so far."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
