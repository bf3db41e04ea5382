"""Property-based state-machine tests of pools + cache manager + scheduler, without the model.

A fake "model step" advances what the scheduler planned and samples random tokens. Hypothesis drives
arrivals (with shared prefixes), cancellations, finishes and memory pressure; after every step the
bookkeeping must be consistent, and after drain + flush every block and slot must be free.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hyserve.cache.capacity import CapacityInputs, plan_capacity
from hyserve.cache.manager import HybridCacheManager
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import Scheduler

BS = 4  # tokens per block
CHUNK = 4


def make(num_blocks: int, max_batch: int, budget_tokens: int, snapshots: int, max_seq_len: int):
    inp = CapacityInputs(
        budget_bytes=num_blocks * BS * 8 + (max_batch + snapshots) * 100,
        kv_bytes_per_token=8,
        state_bytes_per_slot=100,
        max_batch_size=max_batch,
        max_seq_len=max_seq_len,
        max_num_tokens=budget_tokens,
        tokens_per_block=BS,
        enable_block_reuse=True,
        periodic_snapshot_interval=8,
        num_snapshot_offsets=1,
        avg_seq_len=16,
        num_pad_slots=0,
        allow_oversized_max_seq_len=True,
    )
    plan = plan_capacity(inp)
    cache = HybridCacheManager(
        plan, has_mamba=True, enable_block_reuse=True, snapshot_interval=8, snapshot_offsets_from_end=(0, 3)
    )
    sched = Scheduler(
        cache,
        max_batch_size=max_batch,
        max_num_tokens=budget_tokens,
        enable_chunked_prefill=True,
        chunk_size=CHUNK,
        max_seq_len=1 << 30,
    )
    return plan, cache, sched


class EngineMachine(RuleBasedStateMachine):
    preemptions_seen = 0  # summed over one run's examples: the machine must actually exercise preemption

    @initialize(
        num_blocks=st.integers(6, 24),
        max_batch=st.integers(1, 6),
        budget=st.integers(6, 24),
        seed=st.integers(0, 2**16),
    )
    def setup(self, num_blocks: int, max_batch: int, budget: int, seed: int) -> None:
        budget = max(budget, max_batch)
        self.plan, self.cache, self.sched = make(num_blocks, max_batch, budget, 6, 200)
        self.fit = self.plan.max_request_tokens
        self.rng = random.Random(seed)
        self.requests: dict[str, Request] = {}
        self.done: set[str] = set()
        self.n = 0
        self.prefixes = [[self.rng.randrange(50) for _ in range(12)] for _ in range(3)]

    @rule(
        plen=st.integers(1, 30),
        max_tokens=st.integers(1, 12),
        shared=st.integers(-1, 2),
        burst=st.integers(1, 4),
    )
    def arrive(self, plen: int, max_tokens: int, shared: int, burst: int) -> None:
        for _ in range(burst):
            self._arrive(plen, max_tokens, shared)

    def _arrive(self, plen: int, max_tokens: int, shared: int) -> None:
        prompt = [self.rng.randrange(50) for _ in range(plen)]
        if shared >= 0:
            prompt = self.prefixes[shared][: self.rng.randrange(1, 13)] + prompt
        if len(prompt) + max_tokens > self.fit:  # the engine rejects these at admission
            return
        rid = f"r{self.n}"
        self.n += 1
        req = Request(rid, prompt, SamplingParams(max_tokens=max_tokens))
        self.requests[rid] = req
        self.sched.add(req)

    @precondition(lambda self: bool(self.requests))
    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        live = [r for r in self.requests if r not in self.done]
        if live:
            self.sched.abort(data.draw(st.sampled_from(sorted(live))))

    @rule()
    def flush(self) -> None:
        self.cache.reset_prefix_cache()

    @rule(steps=st.integers(1, 8))
    def run_steps(self, steps: int) -> None:
        for _ in range(steps):
            self._step()

    def _step(self) -> None:
        batch, aborted = self.sched.schedule()
        for r in aborted:
            self.done.add(r.request_id)
        # the plan must be executable: every token has a block, every state has a slot
        seen_slots = set()
        for s in batch.seqs:
            req = self.requests[s.request_id]
            assert req.status is RequestStatus.RUNNING
            assert len(s.block_ids) * BS >= s.start_pos + len(s.token_ids)
            assert s.state_dst not in seen_slots
            seen_slots.add(s.state_dst)
            assert s.token_ids == req.all_token_ids[s.start_pos : s.start_pos + len(s.token_ids)]
            for off, slot in s.snapshots:
                assert 0 < off <= len(s.token_ids)
                assert off % CHUNK == 0 or off == len(s.token_ids)
                assert slot >= self.cache.states.num_live + self.cache.states.num_pad
        assert batch.num_tokens <= self.sched.max_num_tokens
        assert len(self.sched.running) <= self.sched.max_batch_size
        self.sched.update(batch, self.requests)
        for s in batch.seqs:
            if not s.sample:
                continue
            req = self.requests[s.request_id]
            if req.status is not RequestStatus.RUNNING:
                continue
            req.output_token_ids.append(self.rng.randrange(50))
            if len(req.output_token_ids) >= req.params.max_tokens or self.rng.random() < 0.05:
                self.sched.finish(req, "length")
                self.done.add(req.request_id)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_invariants()
        held = sum(len(r.block_ids) for r in self.sched.running)
        # blocks are shared, so held references >= blocks in use
        assert held >= self.cache.blocks.num_used()
        for r in self.sched.waiting:
            assert not r.block_ids and r.live_slot is None and r.init_snapshot_slot is None

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        # drain: with no new arrivals every admitted request finishes (no deadlock)
        for _ in range(5000):
            if not self.sched.has_work():
                break
            self._step()
        assert not self.sched.has_work(), "engine did not drain: deadlock or starvation"
        EngineMachine.preemptions_seen += self.sched.stats.num_preemptions
        assert self.done == set(self.requests)
        self.cache.reset_prefix_cache()
        self.cache.check_invariants()
        assert self.cache.blocks.num_free() == self.cache.blocks.num_blocks
        assert self.cache.states.num_free_live() == self.cache.states.num_live
        assert self.cache.states.num_snapshots_used() == 0


def test_engine_machine_keeps_bookkeeping_consistent_and_exercises_preemption() -> None:
    """The machine runs here, so the preemption count it checks is this run's own, whatever the test order."""
    EngineMachine.preemptions_seen = 0
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(  # derandomized: the same examples every run, so the preemption check cannot flake
            max_examples=150,
            stateful_step_count=50,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert EngineMachine.preemptions_seen > 0


def test_lone_request_always_progresses_under_pressure() -> None:
    """A request that needs the whole pool, arriving behind others, still completes."""
    plan, cache, sched = make(num_blocks=10, max_batch=4, budget_tokens=8, snapshots=2, max_seq_len=40)
    reqs = {}
    for i in range(4):
        r = Request(f"r{i}", list(range(i, i + 10)), SamplingParams(max_tokens=30 - 10))
        reqs[r.request_id] = r
        sched.add(r)
    drain(sched, reqs, 2000)
    assert sched.stats.num_preemptions > 0
    cache.reset_prefix_cache()
    assert cache.blocks.num_free() == cache.blocks.num_blocks


def drain(sched, reqs: dict, max_steps: int, after_schedule=None) -> None:
    """Run the scheduler with a fake model (every sampled row emits token 7) until nothing is left, within
    `max_steps` steps; `after_schedule(sched)` checks an invariant after each schedule(). Every request must
    finish."""
    for _ in range(max_steps):
        if not sched.has_work():
            break
        fake_step(sched, reqs, after_schedule)
    assert all(r.finished for r in reqs.values())


def fake_step(sched, reqs: dict, after_schedule=None):
    """One step with the fake model: every sampled row emits token 7, and a request finishes at max_tokens;
    `after_schedule(sched)` runs between planning and taking in the step. Returns the planned batch."""
    batch, _ = sched.schedule()
    if after_schedule is not None:
        after_schedule(sched)
    sched.update(batch, reqs)
    for s in batch.seqs:
        r = reqs[s.request_id]
        if s.sample and r.status is RequestStatus.RUNNING:
            r.output_token_ids.append(7)
            if len(r.output_token_ids) >= r.params.max_tokens:
                sched.finish(r, "length")
    return batch


def test_token_slice_equals_all_token_ids_slice() -> None:
    from hyserve.engine.request import Request
    from hyserve.engine.sampling_params import SamplingParams

    for n_prompt in range(4):
        for n_out in range(4):
            req = Request("r", list(range(10, 10 + n_prompt)), SamplingParams())
            req.output_token_ids = list(range(50, 50 + n_out))
            total = n_prompt + n_out
            for a in range(total + 1):
                for b in range(a, total + 1):
                    assert req.token_slice(a, b) == req.all_token_ids[a:b], (n_prompt, n_out, a, b)


def _run(sched: Scheduler, batch) -> None:
    """Take in a planned step as the engine would (every row computed; a sampling row gets token 7)."""
    reqs = {r.request_id: r for r in sched.running}
    sched.update(batch, reqs)
    for seq in batch.seqs:
        if seq.sample:
            reqs[seq.request_id].output_token_ids.append(7)


def test_last_prompt_token_at_a_snapshot_boundary_runs_as_a_chunk_with_its_snapshot() -> None:
    """A budget cut that leaves only the prompt's last token: when the prompt's end is a snapshot boundary
    (8: the 8-token interval and offset 0), that token runs as a one-token prefill chunk that takes the
    end-of-prompt snapshot (a decode row takes none); otherwise (9 tokens) it runs as a decode row."""
    for plen, boundary_at_end in ((8, True), (9, False)):
        _, cache, sched = make(
            num_blocks=16, max_batch=2, budget_tokens=plen - 1, snapshots=6, max_seq_len=64
        )
        req = Request("a", list(range(1, plen + 1)), SamplingParams(max_tokens=3))
        sched.add(req)
        first, _ = sched.schedule()
        assert [len(s.token_ids) for s in first.seqs] == [plen - 1] and not first.seqs[0].sample
        _run(sched, first)
        second, _ = sched.schedule()
        (seq,) = second.seqs
        assert seq.token_ids == [plen] and seq.sample and seq.start_pos == plen - 1
        if boundary_at_end:
            assert second.num_decodes == 0 and seq.snapshot_positions == [plen] and len(seq.snapshots) == 1
            assert seq.snapshots[0][0] == 1  # taken after the chunk's one token
        else:
            assert second.num_decodes == 1 and seq.snapshots == []
        _run(sched, second)
        third, _ = sched.schedule()  # then ordinary decoding
        assert third.num_decodes == 1 and third.seqs[0].token_ids == [7]
        if boundary_at_end:
            assert cache.states.has_snapshot(seq.snapshot_keys[0])
