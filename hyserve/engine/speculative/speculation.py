"""`Speculation`: the engine's speculative decoding, as configured (`speculative_config`). It drafts for the
scheduler, decides per step whether to speculate, and counts drafts and acceptances for `stats()` and
/metrics.

A step speculates when at most `max_batch` requests run: drafting needs every decoding request's newest
token on the host, so such steps are read as soon as they are sampled (no step in flight behind them), and
above that batch size the verify rows cost more than the accepted tokens save.

A request whose last `MISSES_TO_REST` drafting steps found no draft (an n-gram lookup in text that does not
repeat itself) rests: nothing is drafted for it for `FIRST_REST` steps, then one step probes again; each
fruitless probe doubles the rest, up to `LONGEST_REST`, and a draft ends it. A step in which every running
request rests drafts nothing, so it keeps async scheduling: speculation costs such text only the probes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hyserve.config import SpeculativeConfig
from hyserve.engine.request import Request
from hyserve.engine.scheduler.scheduler import ScheduledBatch
from hyserve.engine.scheduler.verify_rows import scratch_of
from hyserve.engine.speculative.mtp import MTPDrafter
from hyserve.engine.speculative.ngram import NgramProposer
from hyserve.engine.speculative.verify import SampledRun

# stats() keys of the accepted tokens per draft position: this prefix, then the position (0 = first)
ACCEPTED_AT = "spec_decode_num_accepted_tokens_pos_"
# the most running requests a step speculates at when speculative_config.disable_by_batch_size is unset
DEFAULT_SPEC_MAX_BATCH = 16
# drafting steps in a row without a draft after which a request rests; its first and longest rest, in steps
MISSES_TO_REST = 4
FIRST_REST = 8
LONGEST_REST = 64


def spec_max_batch(spec: SpeculativeConfig, max_batch_size: int | None = None) -> int:
    """How many running requests a step may speculate at (0: speculation off)."""
    if not spec.enabled:
        return 0
    most = spec.disable_by_batch_size or DEFAULT_SPEC_MAX_BATCH
    return most if max_batch_size is None else min(most, max_batch_size)


def spec_scratch_slots(spec: SpeculativeConfig, max_batch_size: int | None = None) -> int:
    """State slots a speculative step chains its positions through: (width - 1) per decoding sequence."""
    return spec_max_batch(spec, max_batch_size) * (spec.num_speculative_tokens or 0)


class LaunchedStep(Protocol):
    """A sampled step, as the engine holds it until it is read (engine/pending_step.py)."""

    batch: ScheduledBatch
    tokens: torch.Tensor  # its samples, on the device
    mtp_caught_up: bool


class Drafter(Protocol):
    def propose(self, req: Request, k: int) -> list[int]:
        """Up to k draft tokens for the request's next positions."""
        ...

    def remove(self, request_id: str) -> None:
        """Forget what is kept for a request that ended."""
        ...


class Speculation:
    def __init__(self, spec: SpeculativeConfig, max_batch: int, drafter: Drafter) -> None:
        assert spec.num_speculative_tokens is not None
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.max_batch = max_batch
        self.drafter = drafter
        self.num_drafts = 0  # sequences that carried a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k  # drafts whose token at position i was accepted
        self._step = 0  # steps asked about (step_mode)
        self._misses: dict[str, int] = {}  # request id -> drafting steps in a row without a draft
        # request id -> (the step up to which nothing is drafted for it, its next rest's length)
        self._rest: dict[str, tuple[int, int]] = {}

    @classmethod
    def build(cls, spec: SpeculativeConfig, max_batch_size: int, runner: Any) -> Speculation | None:
        """The engine's speculation over `runner` (the model runner: MTP drafts from its kept hidden states),
        or None when off."""
        if not spec.enabled:
            return None
        assert spec.num_speculative_tokens is not None
        drafter: Drafter
        if spec.method == "mtp":
            runner.keep_step_hidden = True  # on every rank: each runs the MTP passes (runner.mtp_draft)
            drafter = MTPDrafter(spec.num_speculative_tokens)
        else:
            lo, hi = spec.lookup_range()
            drafter = NgramProposer(lo, hi)
        return cls(spec, spec_max_batch(spec, max_batch_size), drafter)

    def propose(self, req: Request, k: int) -> list[int]:
        """The scheduler's drafter: up to k tokens, none while the request rests."""
        rid = req.request_id
        if self.resting(rid):
            return []
        draft = self.drafter.propose(req, k)
        if draft:
            self._misses.pop(rid, None)
            self._rest.pop(rid, None)
            return draft
        misses = self._misses.get(rid, 0) + 1
        if rid in self._rest or misses >= MISSES_TO_REST:  # a fruitless probe, or the misses' limit
            length = self._rest.get(rid, (0, FIRST_REST))[1]
            self._rest[rid] = (self._step + length, min(2 * length, LONGEST_REST))
            misses = 0
        self._misses[rid] = misses
        return draft

    def resting(self, request_id: str) -> bool:
        return self._rest.get(request_id, (0, 0))[0] >= self._step

    def describe(self) -> str:
        lo, hi = self.spec.lookup_range()
        how = f"n-grams of {lo}-{hi} tokens" if self.spec.method == "ngram" else "the checkpoint's MTP block"
        return (
            f"speculative decoding: {self.spec.method}, up to {self.k} draft tokens a step ({how}), while at "
            f"most {self.max_batch} requests run"
        )

    def step_mode(self, running: list[Request]) -> tuple[bool, bool]:
        """(whether the next step drafts, whether it is read as soon as it is sampled): drafting needs every
        decoding request's newest token on the host. A step drafts while at most `max_batch` requests run and
        one of them does not rest."""
        self._step += 1
        draft = 0 < len(running) <= self.max_batch and not all(self.resting(r.request_id) for r in running)
        return draft, draft

    def on_launch(
        self,
        batch: ScheduledBatch,
        sampled: LaunchedStep | None,
        requests: dict[str, Request],
        runner: Any,
        drafting: bool,
    ) -> None:
        """A step was launched and sampled (`sampled`: None when no row samples). MTP: a step that drafts
        nothing has the block's catch-up pass run now, from its samples on the device, so it is read when
        the next step has been launched; a drafting step's passes run when it is read."""
        if not isinstance(self.drafter, MTPDrafter):
            return
        if not drafting:
            samples = sampled.tokens if sampled is not None else None
            self.drafter.catch_up_launched(batch, samples, requests, runner)
            if sampled is not None:
                sampled.mtp_caught_up = True
        elif sampled is None:  # nothing to read: its chunks' positions now
            self.drafter.after_step(batch, [], requests, runner)

    def on_read(
        self, step: LaunchedStep, runs: list[SampledRun], requests: dict[str, Request], runner: Any
    ) -> None:
        """A step was read: a speculative step's accepted drafts (their Mamba state, `settle`), then, unless
        they ran at launch, the MTP block's passes over its positions and the next drafts."""
        batch = step.batch
        if batch.spec_width > 1:
            copies = self.settle(batch, runs, requests, runner.spec_scratch)
            if copies:
                runner.copy_states(copies)
        if isinstance(self.drafter, MTPDrafter) and not step.mtp_caught_up:
            self.drafter.after_step(batch, runs, requests, runner)

    def record(self, run: SampledRun) -> None:
        if not run.draft_len:
            return
        self.num_drafts += 1
        self.num_draft_tokens += run.draft_len
        self.num_accepted_tokens += run.accepted
        for i in range(run.accepted):
            self.accepted_per_position[i] += 1

    def settle(
        self, batch: ScheduledBatch, runs: list[SampledRun], requests: dict[str, Request], scratch: list[int]
    ) -> list[tuple[int, int]]:
        """A speculative step was read (`runs` in batch order, decoding sequences first): each running
        request's accepted draft tokens count as computed, and the state copies (live slot, scratch slot)
        that make its live Mamba state the one after its last accepted token. None is needed when the whole
        width was accepted: the last position wrote the live slot."""
        q, copies = batch.spec_width, []
        for i, run in enumerate(runs[: batch.num_decodes]):
            self.record(run)
            req = run.req
            if req is None or req.finished or requests.get(req.request_id) is not req:
                continue
            req.num_computed += run.accepted
            if run.accepted < q - 1 and req.live_slot is not None:
                copies.append((req.live_slot, scratch_of(scratch, i, q)[run.accepted]))
        return copies

    def forget(self, request_id: str) -> None:
        """A request ended: drop what the drafter keeps for it."""
        self.drafter.remove(request_id)
        self._misses.pop(request_id, None)
        self._rest.pop(request_id, None)

    def counters(self) -> dict[str, float]:
        """Drafts, draft tokens and accepted tokens so far, and per draft position (`..._pos_<i>`) how many
        drafts had their token there accepted."""
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            **{f"{ACCEPTED_AT}{i}": n for i, n in enumerate(self.accepted_per_position)},
        }

    def reset_counters(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.k
