"""Request validation before anything enters the engine: token ids within the vocabulary, lengths
within max_seq_len and within what the cache can hold for one request (the capacity plan), prompts
that fit one step when chunked prefill is off, a priority the scheduling policy can honour. Every refusal
names the limit."""

from __future__ import annotations

from hyserve.cache.capacity import CapacityPlan
from hyserve.config import SchedulerConfig
from hyserve.engine.errors import RequestRejected
from hyserve.engine.sampling_params import SamplingParams


class InputProcessor:
    def __init__(
        self, *, vocab_size: int, max_seq_len: int, plan: CapacityPlan, scheduler: SchedulerConfig
    ) -> None:
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.plan = plan
        self.scheduler = scheduler

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """Raise RequestRejected for a request that must not enter the engine."""
        self._check_priority(priority)
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected(
                "the prompt is empty; send at least one token", param="prompt", code="empty_prompt"
            )
        self._check_token_ids(prompt_token_ids)
        vocab = self.vocab_size
        bias_bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bias_bad:
            raise RequestRejected(
                f"logit_bias token ids must be in [0, {vocab - 1}] (the model's vocabulary); got "
                f"{bias_bad[:5]}",
                param="logit_bias",
                code="invalid_token_id",
            )
        total = n + params.max_tokens
        if total > self.max_seq_len:
            raise RequestRejected(
                f"this request needs {total} tokens ({n} prompt + {params.max_tokens} max_tokens), more than "
                f"max_seq_len = {self.max_seq_len}; shorten the prompt or lower max_tokens",
                param="max_tokens" if n < self.max_seq_len else "prompt",
                code="context_length_exceeded",
            )
        fit = self.plan.max_request_tokens
        if total > fit:
            raise RequestRejected(
                f"this request needs {total} tokens ({n} prompt + {params.max_tokens} max_tokens), but the "
                f"KV cache holds at most {fit} tokens for one request even when the engine is empty "
                f"(max_seq_len = {self.max_seq_len}); shorten it or give the cache more memory",
                param="prompt",
                code="request_too_large",
            )
        sc = self.scheduler
        assert sc.max_num_tokens is not None  # sized at assembly
        if not sc.enable_chunked_prefill and n > sc.max_num_tokens:
            raise RequestRejected(
                f"the prompt has {n} tokens, more than max_num_tokens = {sc.max_num_tokens} with chunked "
                "prefill disabled; enable_chunked_prefill or raise max_num_tokens",
                param="prompt",
                code="context_length_exceeded",
            )

    def _check_priority(self, priority: int) -> None:
        """An integer; under "fcfs" only 0, as vLLM: a priority the queue would silently ignore is a mistake
        worth stopping for."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise RequestRejected(
                f"priority must be an integer, got {priority!r}", param="priority", code="invalid_priority"
            )
        if priority != 0 and self.scheduler.scheduling_policy == "fcfs":
            raise RequestRejected(
                f"got priority {priority}, but priority scheduling is not enabled (scheduling_policy is "
                "fcfs); start the engine with --scheduling-policy priority (YAML / LLM option "
                "scheduling_policy: priority) to use it",
                param="priority",
                code="invalid_priority",
            )

    def _check_token_ids(self, ids: list[int]) -> None:
        vocab = self.vocab_size
        # C-speed checks first: this sees every token of million-token prompts, twice per server request
        in_range = set(map(type, ids)) == {int} and (0 <= min(ids) and max(ids) < vocab)
        if in_range:
            return
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise RequestRejected(
                f"prompt token ids must be integers in [0, {vocab - 1}] (the model's vocabulary); got "
                f"{bad[:5]}",
                param="prompt",
                code="invalid_token_id",
            )
