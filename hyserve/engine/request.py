"""`Request`: one generation request as the engine tracks it, from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    # scheduling_policy "priority": lower is served earlier (vLLM's); 0 is the only value under "fcfs"
    priority: int = 0
    # the scheduler's arrival counter, set once by `Scheduler.add`: breaks priority ties by arrival, and a
    # preempted request keeps it, so it goes back ahead of later arrivals of its priority
    arrival_seq: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)  # index = prompt position
    # cache state (owned by the scheduler / cache manager)
    num_computed: int = 0  # tokens whose KV + Mamba state are in the cache
    block_ids: list[int] = field(default_factory=list)
    live_slot: int | None = None
    init_snapshot_slot: int | None = None  # prefix hit: read the first chunk's state from here (pinned)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    block_hashes: list[int] | None = None  # chain hashes of the full prompt blocks, computed once
    num_published_blocks: int = 0  # leading blocks already in the prefix index
    num_preemptions: int = 0
    # async scheduling: tokens sampled on the device and not yet read by the host (0, 1 or 2 while a
    # step is launched behind the one in flight), and the row of the newest among the launched step's samples
    num_inflight: int = 0
    inflight_row: int = -1
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    aborted: bool = False
    # time.monotonic() at arrival and when a step first scheduled it (a preemption keeps the first)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + outputs, a new list: O(length); the scheduler uses `token_slice` instead."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` without building the whole list (a decode step takes one token of
        a context that may be a million long)."""
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def in_prefill(self) -> bool:
        """Still feeding known tokens (prompt, or prompt + outputs after a preemption)."""
        return self.num_computed < self.num_tokens - 1 or self.num_computed == 0

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
