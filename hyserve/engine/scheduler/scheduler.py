"""Continuous-batching scheduler with chunked prefill, hybrid prefix caching and recompute preemption.

Each step, under a budget of `max_num_tokens` tokens and `max_batch_size` running requests:

  1. decodes: every running request past its prefill gets one token (admission order);
  2. the first chunks of the waiting requests that can start are set aside (a short prompt whole, a long
     one at most long_prefill_token_threshold tokens when continuing prefills share the step);
  3. prefill continuations: up to max_num_partial_prefills running requests still feeding known tokens
     share what is left equally (one alone takes it all; at least one SSD chunk, so none starves);
  4. admissions: waiting requests, strictly in queue order, get a prefix-cache lookup, a live state slot and
     their first chunk, while budget, slots and blocks last. Once max_num_partial_prefills prompts are
     part-way, a request starts only if its whole prompt fits the step, so started prompts never wait
     unserved while holding a slot.

The queue order is the scheduling policy's (`scheduling_policy`, as vLLM's): "fcfs" arrival order; "priority"
each request's (priority, arrival) key, lower first. Under "priority" the running list is kept in that order
too, so decodes, continuing prefills and preemption (below) all favour the better key: "younger" then means
"sorts later", and the request with the best key running is never preempted, as the oldest under "fcfs".

With a step cost model (`step_cost.py`, calibrated at warm-up) every chunk also fits a share of the
step-time target after the decodes' cost, so a long prompt's chunks shrink as its context grows. Beside
continuing prefills, arrivals set aside at most ARRIVAL_MS_SHARE of that time; once it is spent, no more
requests start (with nothing else prefilling, one first chunk still does, so arrivals never starve).

Async scheduling lives here too: a step may be planned while the previous one is in flight. A request
whose newest token was sampled on the device and not yet read (`Request.num_inflight`) gets a decode row
fed from that step's samples (`ScheduledSeq.feed_row`), unless that token ends it for certain
(max_tokens, max_seq_len); a request that stops on it (EOS, stop string) computes one extra row, which the
engine drops. So the engine has one loop whatever the setting.

A request that needs a block when none is free preempts the youngest running request not yet scheduled
this step (its blocks and slot are freed and it goes back to the front of the queue, to be recomputed;
under "priority" back into the queue at its key, which it keeps); if there is none younger, it yields
itself. The oldest request never yields, and admission guarantees that any single request fits an empty
pool, so a request alone always progresses: no deadlock.

Where a prefill chunk may end is the cache's rule (`cache/alignment.py`): it ends early at a snapshot
boundary the SSD scan cannot produce mid-chunk, and a chunk cut for time ends on an SSD chunk boundary.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from hyserve.cache.alignment import ssd_aligned_length
from hyserve.cache.manager import HybridCacheManager, PrefixHit, chain_hashes
from hyserve.config import SCHEDULING_POLICIES, Choice
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.step_cost import StepCostModel
from hyserve.engine.scheduler.step_feedback import StepTimeFeedback

# batch waiting stops once the admissible first chunks would take this share of the step-time budget
BATCH_WAIT_MS_SHARE = 0.9
# with continuing prefills in the step, arrivals' first chunks claim at most this share of the step-time
# budget left for prefill (beyond one SSD chunk), so prompts already started finish rather than crawl
ARRIVAL_MS_SHARE = 0.5


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # new tokens fed this step
    start_pos: int  # tokens already in the cache before this step
    block_ids: list[int]  # the request's block table (covers start_pos + len(token_ids))
    state_src: int | None  # slot to read the initial Mamba state from; None = start from zeros
    state_dst: int  # the request's live slot
    sample: bool  # this step produces the request's next token
    snapshots: list[tuple[int, int]]  # (tokens into this step's new tokens, snapshot slot)
    params: SamplingParams
    num_output_tokens: int  # outputs so far (seeded sampling keys on it)
    snapshot_positions: list[int] = field(default_factory=list)  # absolute prompt positions to snapshot
    snapshot_keys: list[int] = field(default_factory=list)  # prefix-cache keys of `snapshots`
    # decode rows only: the input token is row `feed_row` of the previous step's device samples (async
    # scheduling; `token_ids` then holds a placeholder), None when the host knows it
    feed_row: int | None = None
    # decode rows of a speculative step: the draft tokens fed after the input token (`token_ids` ends with
    # them), to be verified in this step
    draft: list[int] = field(default_factory=list)


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]  # decodes first, then prefills
    num_decodes: int
    preempted: list[str] = field(default_factory=list)
    # rows per decoding sequence: 1, or in a speculative step 1 + its longest draft (shorter drafts padded)
    spec_width: int = 1
    # when the step was planned (StepTimeFeedback's clock) and, for a step whose prefill chunks the
    # calibrated step-time target sized, the model's figure for it in ms (else None) and its chunks' share
    # of the prefill time the plan had
    planned_at: float | None = None
    predicted_ms: float | None = None
    prefill_share: float = 0.0
    # requests were running when it was planned (the engine came to it from the previous step's read)
    follows: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        """Tokens of the prefill chunks (decode rows' drafts are not prefill)."""
        return sum(len(s.token_ids) for s in self.seqs[self.num_decodes :])

    @property
    def empty(self) -> bool:
        return not self.seqs


def standalone_prefill(
    prompts: list[list[int]],
    *,
    tokens_per_block: int,
    request_id: str,
    slots: list[int],
    params: SamplingParams,
    snapshots: list[list[tuple[int, int]]] | None = None,
) -> ScheduledBatch:
    """Whole prompts as one prefill step outside the cache manager, for start-up's runs on scratch caches (the
    activation profile, the fp8 KV calibration): prompt i from a fresh state into state slot slots[i], over
    the next ceil(len / tokens_per_block) blocks counting from block 0, writing snapshots[i] (none by
    default)."""
    seqs, next_block = [], 0
    for i, ids in enumerate(prompts):
        nb = -(-len(ids) // tokens_per_block)
        seqs.append(
            ScheduledSeq(
                request_id=f"{request_id}-{i}",
                token_ids=ids,
                start_pos=0,
                block_ids=list(range(next_block, next_block + nb)),
                state_src=None,
                state_dst=slots[i],
                sample=True,
                snapshots=snapshots[i] if snapshots else [],
                params=params,
                num_output_tokens=0,
            )
        )
        next_block += nb
    return ScheduledBatch(seqs=seqs, num_decodes=0)


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    tokens_scheduled: int = 0
    batch_wait_steps: int = 0  # steps whose admissions batch waiting held back


def priority_key(req: Request) -> tuple[int, int]:
    """A request's place under scheduling_policy "priority": lower priority value first, then arrival."""
    return req.priority, req.arrival_seq


class Scheduler:
    def __init__(
        self,
        cache: HybridCacheManager,
        *,
        max_batch_size: int,
        max_num_tokens: int,
        enable_chunked_prefill: bool,
        chunk_size: int,
        max_seq_len: int,
        max_num_partial_prefills: int = 4,
        long_prefill_token_threshold: int | None = None,
        cost: StepCostModel | None = None,
        scheduling_policy: str = "fcfs",
        batch_wait_timeout_iters: int = 0,
        batch_wait_max_tokens_ratio: float = 0.0,
    ) -> None:
        self.cache = cache
        # "priority": the waiting queue and the running list are kept sorted by `priority_key`
        self.by_priority = Choice(SCHEDULING_POLICIES)(scheduling_policy, "scheduling_policy") == "priority"
        self.max_seq_len = max_seq_len
        # step composition (docs/architecture.md): how many continuing prefills share a step, the most a
        # long prompt's chunk takes when others share it, and the step-time target (None: tokens only)
        self.max_num_partial_prefills = max_num_partial_prefills
        self.long_prefill_token_threshold = long_prefill_token_threshold or max(
            chunk_size, max_num_tokens // max_num_partial_prefills
        )
        self.cost = cost
        # a calibrated model's error on the steps it sizes, measured as they run (step_feedback.py)
        self.feedback = StepTimeFeedback()
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.chunked = enable_chunked_prefill
        self.chunk_size = chunk_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order (under "priority": key order)
        self.stats = SchedulerStats()
        self._pending_aborts: set[str] = set()
        self._arrivals = itertools.count()  # Request.arrival_seq
        # batch waiting (`_hold_admissions`): the most steps in a row admissions wait, the share of the
        # token budget they wait for, and the steps waited so far
        self.batch_wait_iters = batch_wait_timeout_iters
        self.batch_wait_tokens = batch_wait_max_tokens_ratio * max_num_tokens
        self._held_iters = 0
        # speculative decoding: (request, most tokens) -> draft tokens for its next positions; None: off
        self.drafter: Callable[[Request, int], list[int]] | None = None
        self.num_spec_tokens = 0

    # ---- queue management -------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        req.arrival_seq = next(self._arrivals)
        self._place(self.waiting, req, self.waiting.append)

    def abort(self, request_id: str) -> None:
        """Takes effect at the start of the next `schedule()`."""
        self._pending_aborts.add(request_id)

    def reset(self, cache: HybridCacheManager) -> None:
        """Forget every request and take fresh pool bookkeeping (the engine's reset after a failure outside a
        step, engine/isolation.py)."""
        self.cache = cache
        self.waiting.clear()
        self.running.clear()
        self._pending_aborts.clear()

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._pending_aborts)

    def _apply_aborts(self) -> list[Request]:
        if not self._pending_aborts:
            return []
        ids = self._pending_aborts
        self._pending_aborts = set()
        done = []
        for req in [r for r in self.running if r.request_id in ids] + [
            r for r in self.waiting if r.request_id in ids
        ]:
            req.aborted = True
            self.finish(req, "abort")
            done.append(req)
        return done

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Release everything the request holds; publish its prompt blocks to the prefix cache."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._release(req, publish=True)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason

    def _hashes(self, req: Request) -> list[int]:
        if req.block_hashes is None:
            req.block_hashes = chain_hashes(req.prompt_token_ids, self.cache.tokens_per_block)
        return req.block_hashes

    def _publish(self, req: Request) -> None:
        """Put the request's newly computed full prompt blocks in the prefix index (each block once)."""
        full = min(req.num_computed, req.num_prompt_tokens) // self.cache.tokens_per_block
        if full > req.num_published_blocks:
            self.cache.register_blocks(req.block_ids, self._hashes(req), req.num_published_blocks, full)
            req.num_published_blocks = full

    def _release(self, req: Request, *, publish: bool) -> None:
        if publish and req.block_ids:
            self._publish(req)
        self.cache.free_blocks(req.block_ids)
        req.num_published_blocks = 0
        if req.live_slot is not None:
            self.cache.free_live_slot(req.live_slot)
            req.live_slot = None
        if req.init_snapshot_slot is not None:
            self.cache.release_snapshot(req.init_snapshot_slot)
            req.init_snapshot_slot = None

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.requeue(req)
        self.stats.num_preemptions += 1
        batch.preempted.append(req.request_id)

    def requeue(self, req: Request) -> None:
        """Free what a running request holds and queue it first, to be recomputed from its prompt and outputs
        so far: a preemption, or an innocent row of a failed step (engine/isolation.py)."""
        self.running.remove(req)
        self._release(req, publish=True)
        req.num_computed = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        # under "priority" its key is unchanged: ahead of every later arrival of its priority
        self._place(self.waiting, req, self.waiting.appendleft)

    def _victim(self, scheduled: set[str], me: Request) -> Request | None:
        """The youngest running request not scheduled this step, and younger than `me`. Under "priority" the
        running list is in key order, so this is the largest (priority, arrival) after `me`'s."""
        for r in reversed(self.running):
            if r is me:
                return None  # nobody younger than me is left
            if r.request_id not in scheduled:
                return r
        return None

    def _grow_or_preempt(
        self, req: Request, num_tokens: int, scheduled: set[str], batch: ScheduledBatch
    ) -> bool:
        """Cover `num_tokens` tokens for a running request, preempting younger ones if needed. False:
        the request itself was preempted."""
        while not self.cache.grow(req.block_ids, num_tokens):
            victim = self._victim(scheduled, req)
            if victim is None:
                self._preempt(req, batch)
                return False
            self._preempt(victim, batch)
        return True

    # ---- the step ---------------------------------------------------------------------------------
    def schedule(self, *, draft: bool = False) -> tuple[ScheduledBatch, list[Request]]:
        """Plan one step. Returns the batch and the requests aborted since the last step. `draft`: decoding
        requests whose tokens are all on the host carry draft tokens to verify (speculative decoding)."""
        aborted = self._apply_aborts()
        batch = ScheduledBatch(
            seqs=[], num_decodes=0, planned_at=self.feedback.clock(), follows=bool(self.running)
        )
        budget = self.max_num_tokens
        scheduled: set[str] = set()
        prefills: list[ScheduledSeq] = []

        # 1. decodes
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING or self._feeds_chunk(req) or self._ends_in_flight(req):
                continue
            drafted = self._draft(req, budget) if draft else []
            if not self._grow_or_preempt(req, req.num_computed + 1 + len(drafted), scheduled, batch):
                continue
            row = self._decode_row(req)
            if drafted:
                row.token_ids = row.token_ids + drafted
                row.draft = drafted
                batch.spec_width = max(batch.spec_width, 1 + len(drafted))
            batch.seqs.append(row)
            scheduled.add(req.request_id)
            budget -= len(row.token_ids)
        batch.num_decodes = len(batch.seqs)

        # 2. continuing prefills share what the arrivals' first chunks leave; 3. admissions
        conts = [
            r
            for r in self.running
            if r.status is RequestStatus.RUNNING and r.request_id not in scheduled and self._feeds_chunk(r)
        ]
        decodes_ms = self._decodes_ms(batch)
        ms = prefill_ms_left = self._ms_after_decodes(decodes_ms)
        claim_tokens, claim_ms = self._arrival_claim(budget, ms, len(conts))
        prefills = self._continue(
            conts, budget - claim_tokens, None if ms is None else ms - claim_ms, scheduled, batch
        )
        budget -= sum(len(p.token_ids) for p in prefills)
        if ms is not None:
            ms -= sum(self._chunk_ms(p) for p in prefills)
        if not self._hold_admissions(batch.num_decodes, claim_tokens, bool(prefills), claim_ms, ms):
            # the arrivals' set-aside time is theirs, even where a continuing chunk of one SSD chunk overran
            ms = None if ms is None else max(ms, claim_ms)
            prefills += self.admit(budget, ms=ms, capped=bool(conts), partials=len(conts))

        batch.seqs.extend(prefills)
        if prefills and self._calibrated():
            assert self.cost is not None
            prefill_ms = sum(self._chunk_ms(p) for p in prefills)
            batch.predicted_ms = self.cost.overhead_ms + decodes_ms + prefill_ms
            left = prefill_ms_left or 0.0
            batch.prefill_share = prefill_ms / left if left > 0 else 1.0
        self.stats.tokens_scheduled = batch.num_tokens
        return batch, aborted

    def _calibrated(self) -> bool:
        """Whether the step cost model is in milliseconds of this device (timed at start-up), so measured
        step times can correct it."""
        return self.cost is not None and self.cost.source == "calibrated"

    def _target_ms(self) -> float:
        """The step-time target in the model's milliseconds: a calibrated model's is corrected by what the
        steps it sized really took."""
        assert self.cost is not None
        if not self._calibrated():
            return self.cost.target_ms
        return self.feedback.target_ms(self.cost.target_ms)

    def on_read(self, batch: ScheduledBatch) -> None:
        """A step's tokens reached the host: with a calibrated model, how long the step took against the
        model's figure feeds the target's correction."""
        if self._calibrated():
            self.feedback.on_read(batch.planned_at, batch.predicted_ms, batch.prefill_share, batch.follows)

    def _hold_admissions(
        self, decodes: int, claim_tokens: int, eager: bool, claim_ms: float, ms: float | None
    ) -> bool:
        """Batch waiting (TensorRT-LLM's batch_wait_timeout_iters / batch_wait_max_tokens_ratio). A step of
        decode rows alone replays a CUDA graph; one with a prefill chunk runs the model eagerly, launching
        every layer's kernels from the host, once per step however many prompts it holds. So while decodes
        run, no other prefill makes the step eager anyway and more requests wait than slots are free
        (admission is bound by slots, which finishing requests free), admissions wait: until the decode
        rows and the admissible first chunks (`claim_tokens`) reach batch_wait_max_tokens_ratio of
        max_num_tokens, the first chunks fill most of the step-time budget (BATCH_WAIT_MS_SHARE), or
        batch_wait_timeout_iters steps have passed. Requests wait only when the queue is longer than the
        free slots, so a lightly loaded server never holds one back. A step with nothing admissible (no
        free slot) neither holds nor counts toward the timeout."""
        if claim_tokens == 0:
            return False
        hold = (
            self._held_iters < self.batch_wait_iters
            and decodes > 0
            and not eager
            and len(self.waiting) > self._room()
            and decodes + claim_tokens < self.batch_wait_tokens
            and (ms is None or claim_ms < BATCH_WAIT_MS_SHARE * ms)
        )
        self._held_iters = self._held_iters + 1 if hold else 0
        self.stats.batch_wait_steps += bool(hold)
        return bool(hold)

    def _room(self) -> int:
        """Requests that can start now: free batch places that have a free live state slot."""
        return max(0, min(self.max_batch_size - len(self.running), self.cache.states.num_free_live()))

    def _decodes_ms(self, batch: ScheduledBatch) -> float:
        """The model's milliseconds for the decode rows planned so far (0 without a cost model)."""
        if self.cost is None:
            return 0.0
        return sum(self.cost.decode_ms(s.start_pos) for s in batch.seqs)

    def _ms_after_decodes(self, decodes_ms: float) -> float | None:
        """The step-time budget left for prefill chunks after the decode rows (None: no time target)."""
        if self.cost is None:
            return None
        return self._target_ms() - self.cost.overhead_ms - decodes_ms

    def _chunk_ms(self, seq: ScheduledSeq) -> float:
        """A planned chunk's predicted milliseconds (a time budget exists only with a cost model)."""
        assert self.cost is not None
        return self.cost.chunk_ms(seq.start_pos, len(seq.token_ids))

    def _arrival_claim(self, budget: int, ms: float | None, conts: int) -> tuple[int, float]:
        """Tokens (and milliseconds) set aside for the first chunks of the requests that can be admitted
        this step: a short prompt whole, a long one its capped share; a continuing prefill (`conts` of
        them) keeps at least one SSD chunk of the budget, so it progresses every step. As in `admit`, a
        first chunk that leaves its prompt unfinished is set aside only while fewer than
        max_num_partial_prefills prompts are part-way."""
        reserve = min(budget, self.chunk_size) if conts else 0
        avail = budget - reserve
        room = self._room()
        tokens, spent, partials = 0, 0.0, conts
        cost = self.cost if ms is not None else None  # the time budget, where there is one
        if ms is not None and conts:
            ms *= ARRIVAL_MS_SHARE
        for i, req in enumerate(self.waiting):
            if i >= room or tokens >= avail or req.num_inflight:
                break
            if ms is not None and i and spent >= ms:  # as admit: one first chunk past the time budget at most
                break
            want = min(req.num_tokens, avail - tokens)
            if conts:
                want = min(want, self.long_prefill_token_threshold)
            if cost is not None and ms is not None:
                want = max(min(want, cost.max_chunk(0, ms - spent)), min(want, self.chunk_size))
            if want < req.num_tokens:
                if partials >= self.max_num_partial_prefills:
                    break
                partials += 1
            spent += cost.chunk_ms(0, want) if cost is not None else 0.0
            tokens += want
        return tokens, spent

    def _continue(
        self, conts: list[Request], budget: int, ms: float | None, scheduled: set[str], batch: ScheduledBatch
    ) -> list[ScheduledSeq]:
        """The next chunks of up to max_num_partial_prefills continuing prefills (admission order), each
        taking an equal share of what is left (one alone takes it all)."""
        out: list[ScheduledSeq] = []
        active = conts[: self.max_num_partial_prefills]
        for i, req in enumerate(active):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted for an earlier one's blocks
                continue
            share = -(-budget // (len(active) - i))
            share_ms = None if ms is None else ms / (len(active) - i)
            seq = self._plan_chunk(req, share, ms=share_ms)
            if seq is None:
                continue
            if not self._grow_or_preempt(req, seq.start_pos + len(seq.token_ids), scheduled, batch):
                continue
            self._secure(req, seq)
            out.append(seq)
            scheduled.add(req.request_id)
            budget -= len(seq.token_ids)
            if ms is not None:
                ms -= self._chunk_ms(seq)
        return out

    def _decode_row(self, req: Request) -> ScheduledSeq:
        assert req.live_slot is not None
        fed = req.num_inflight > 0  # the input token is still on the device
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=[0] if fed else req.token_slice(req.num_computed, req.num_computed + 1),
            start_pos=req.num_computed,
            block_ids=list(req.block_ids),
            state_src=req.live_slot,
            state_dst=req.live_slot,
            sample=True,
            snapshots=[],
            params=req.params,
            num_output_tokens=len(req.output_token_ids) + req.num_inflight,
            feed_row=req.inflight_row if fed else None,
        )

    def _draft(self, req: Request, budget: int) -> list[int]:
        """Draft tokens for a decoding request: none while its newest token is on the device, or where
        nothing could be emitted after them (max_tokens, max_seq_len)."""
        if self.drafter is None or req.num_inflight:
            return []
        room = min(
            self.num_spec_tokens,
            budget - 1,
            req.params.max_tokens - len(req.output_token_ids) - 1,
            self.max_seq_len - req.num_tokens - 1,
        )
        return self.drafter(req, room) if room > 0 else []

    def _ends_in_flight(self, req: Request) -> bool:
        """Whether the request's unread tokens finish it for certain (max_tokens, max_seq_len): it then
        needs no further row."""
        if not req.num_inflight:
            return False
        return (
            len(req.output_token_ids) + req.num_inflight >= req.params.max_tokens
            or req.num_tokens + req.num_inflight >= self.max_seq_len
        )

    def _feeds_chunk(self, req: Request) -> bool:
        """Whether the request's next row is a prefill chunk rather than a decode row: it still feeds known
        tokens, or only its prompt's last token is left (a budget cut) and the prompt's end is a snapshot
        boundary, which a decode row would not take."""
        if req.in_prefill:
            return True
        n = req.num_prompt_tokens
        return req.num_computed + 1 == n == req.num_tokens and n in self.cache.snapshot_boundaries(n)

    def admit(
        self, budget: int, *, ms: float | None = None, capped: bool = False, partials: int = 0
    ) -> list[ScheduledSeq]:
        """Admit waiting requests strictly in queue order within `budget` tokens (and `ms` of predicted step
        time) and the batch-size limit; returns their first chunks. Admission stops at the first that cannot
        start, so a large request is not overtaken for ever by small ones queued behind it. `capped`:
        continuing prefills share the step, so a long prompt's first chunk takes at most
        long_prefill_token_threshold tokens. `partials`: prompts part-way through their prefill; once
        max_num_partial_prefills are, a request starts only if its whole prompt fits this step (a prompt
        started with one chunk would hold its slot waiting for a share of a later step). Once the step's
        time is spent, at most one more first chunk starts, and none beside continuing prefills."""
        seqs: list[ScheduledSeq] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            if ms is not None and ms <= 0 and (seqs or capped):
                break  # the step's time is spent (the first chunk past it keeps arrivals from starving)
            req = self.waiting[0]
            if req.num_inflight:  # preempted with a token still on the device: readmit once it is read
                break
            cap = self.long_prefill_token_threshold if capped else budget
            share_ms = None if ms is None else max(ms, 0.0)
            whole = partials >= self.max_num_partial_prefills
            seq = self._admit(req, min(budget, cap), share_ms, whole=whole)
            if seq is None:
                break
            partials += not seq.sample
            self.waiting.popleft()
            # under "priority" at its key, so decodes and continuing prefills serve the best key first and
            # preemption spares it
            self._place(self.running, req, self.running.append)
            seqs.append(seq)
            budget -= len(seq.token_ids)
            if ms is not None:
                ms -= self._chunk_ms(seq)
        return seqs

    def _place(
        self, seq: deque[Request] | list[Request], req: Request, fcfs_put: Callable[[Request], None]
    ) -> None:
        """Put `req` into the waiting queue or the running list: at its key under "priority", else where
        `fcfs_put` (that sequence's append or appendleft) puts it."""
        if self.by_priority:
            bisect.insort(seq, req, key=priority_key)
        else:
            fcfs_put(req)

    def _plan_chunk(
        self, req: Request, budget: int, *, ms: float | None = None, whole: bool = False
    ) -> ScheduledSeq | None:
        """The next prefill chunk of `req` within `budget` tokens, ending where the cache says a chunk may
        (`cache/alignment.py`). Snapshot positions are recorded; slots are attached only once the chunk's
        blocks are secured (`_secure`). None if nothing can be scheduled."""
        start = req.num_computed
        total = req.num_tokens
        n = min(total - start, budget)
        if ms is not None and self.cost is not None and n > self.chunk_size:
            # the step-time target, one SSD chunk at least; a chunk it cuts ends on an SSD chunk boundary,
            # so the next starts aligned (an unaligned start is cut again at the next snapshot boundary,
            # which the scan cannot produce mid-chunk)
            timed = max(self.cost.max_chunk(start, ms), self.chunk_size)
            if timed < n:
                n = ssd_aligned_length(start, timed, self.chunk_size)
        if n <= 0 or ((whole or not self.chunked) and n < total - start):
            return None
        span = self.cache.chunk_span(start, n, prompt_len=req.num_prompt_tokens, chunk_size=self.chunk_size)
        n, positions = span.num_tokens, span.snapshots
        if whole and start + n < total:  # a snapshot boundary cut it
            return None
        assert req.live_slot is not None
        if req.init_snapshot_slot is not None:
            src: int | None = req.init_snapshot_slot
        else:
            src = None if start == 0 else req.live_slot
        return ScheduledSeq(
            request_id=req.request_id,
            token_ids=req.token_slice(start, start + n),
            start_pos=start,
            block_ids=[],
            state_src=src,
            state_dst=req.live_slot,
            sample=start + n == total,
            snapshots=[],
            params=req.params,
            num_output_tokens=len(req.output_token_ids),
            snapshot_positions=positions,
        )

    def _secure(self, req: Request, seq: ScheduledSeq) -> None:
        """A chunk whose blocks are covered: attach its snapshot slots and the block table."""
        for b in seq.snapshot_positions:
            got = self.cache.allocate_snapshot(self._hashes(req), b)
            if got is not None:
                slot, key = got
                seq.snapshots.append((b - seq.start_pos, slot))
                seq.snapshot_keys.append(key)
        seq.block_ids = list(req.block_ids)

    def _admit(
        self, req: Request, budget: int, ms: float | None = None, *, whole: bool = False
    ) -> ScheduledSeq | None:
        slot = self.cache.allocate_live_slot()
        if slot is None:
            return None
        # only prompt blocks are ever indexed, so the prompt's hashes cover a recomputed request too
        if req.params.prompt_logprobs is None:
            hit = self.cache.match_prefix(self._hashes(req), req.num_tokens)
        else:  # prompt logprobs need every prompt position computed: no prefix-cache hit
            hit = PrefixHit(0, [], None)
        req.live_slot = slot
        req.block_ids = list(hit.blocks)
        req.num_computed = hit.num_tokens
        req.num_published_blocks = len(hit.blocks)
        req.init_snapshot_slot = hit.snapshot_slot
        req.status = RequestStatus.RUNNING
        seq = self._plan_chunk(req, budget, ms=ms, whole=whole)
        if seq is None or not self.cache.grow(req.block_ids, seq.start_pos + len(seq.token_ids)):
            # undo: nothing of this attempt stays allocated
            self._release(req, publish=False)
            req.num_computed = 0
            req.status = RequestStatus.WAITING
            return None
        if req.num_preemptions == 0:
            req.num_cached_tokens = hit.num_tokens
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self._secure(req, seq)
        return seq

    def update(self, batch: ScheduledBatch, requests: dict[str, Request]) -> None:
        """After the model ran `batch`: advance computed counts, release step pins, publish blocks."""
        for seq in batch.seqs:
            req = requests.get(seq.request_id)
            for _, slot in seq.snapshots:
                self.cache.commit_snapshot(slot)  # written by this step: visible to later lookups
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            # a speculative row's input token is computed; its accepted draft tokens are added once read
            req.num_computed = seq.start_pos + len(seq.token_ids) - len(seq.draft)
            if req.init_snapshot_slot is not None and seq.state_src == req.init_snapshot_slot:
                self.cache.release_snapshot(req.init_snapshot_slot)
                req.init_snapshot_slot = None
            self._publish(req)

    def discard_step(self, batch: ScheduledBatch) -> None:
        """The model failed on `batch`: its snapshots hold garbage, so drop them from the prefix cache."""
        for seq in batch.seqs:
            for (_, slot), key in zip(seq.snapshots, seq.snapshot_keys):
                self.cache.release_snapshot(slot)
                self.cache.drop_snapshot(key)
            seq.snapshots = []
