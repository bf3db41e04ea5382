"""BlockPool: exact unit tests plus a hypothesis state machine against a reference model."""

from __future__ import annotations

import time

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hyserve.cache import BlockPool, NoFreeBlocks

# ----------------------------------------------------------------------------- unit tests


def test_fresh_pool_is_all_free() -> None:
    pool = BlockPool(4)
    assert pool.num_blocks == 4
    assert (pool.num_free(), pool.num_evictable(), pool.num_used()) == (4, 0, 0)
    pool.check_invariants()


def test_allocate_and_release_without_hash_returns_to_free_list() -> None:
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    assert sorted(blocks) == [0, 1, 2]
    assert all(pool.refcount(b) == 1 for b in blocks)
    with pytest.raises(NoFreeBlocks):
        pool.allocate()
    for b in blocks:
        pool.decref(b)
    assert pool.num_free() == 3 and pool.num_evictable() == 0
    pool.check_invariants()


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    pool.decref(b)
    with pytest.raises(ValueError, match="double free"):
        pool.decref(b)
    pool.check_invariants()


def test_out_of_range_ids_raise() -> None:
    pool = BlockPool(2)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="out of range"):
            pool.decref(bad)
        with pytest.raises(ValueError, match="out of range"):
            pool.refcount(bad)


def test_incref_of_free_block_raises() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="free block"):
        pool.incref(0)


def test_register_lookup_and_cached_release() -> None:
    pool = BlockPool(4)
    b = pool.allocate()
    pool.register(b, 111)
    assert pool.lookup(111) == b and pool.block_hash(b) == 111
    pool.decref(b)
    # Still cached, now evictable; lookup does not change refcount.
    assert pool.lookup(111) == b and pool.refcount(b) == 0
    assert pool.num_evictable() == 1 and pool.num_free() == 4 and pool.num_used() == 0
    pool.incref(b)  # share it again: leaves the LRU
    assert pool.refcount(b) == 1 and pool.num_evictable() == 0 and pool.num_used() == 1
    pool.check_invariants()


def test_register_first_wins_and_one_hash_per_block() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.register(a, 7)
    pool.register(b, 7)  # duplicate content: keep a
    assert pool.lookup(7) == a and pool.block_hash(b) is None
    pool.register(a, 7)  # idempotent
    with pytest.raises(ValueError, match="already registered"):
        pool.register(a, 8)
    pool.decref(b)  # unhashed duplicate goes straight back to the free list
    assert pool.num_evictable() == 0
    pool.check_invariants()


def test_register_requires_reference() -> None:
    pool = BlockPool(2)
    with pytest.raises(ValueError, match="refcount 0"):
        pool.register(0, 5)


def test_free_list_is_used_before_eviction_then_lru_order() -> None:
    pool = BlockPool(4)
    events: list[tuple[int, int]] = []
    pool.add_evict_listener(lambda blk, h: events.append((blk, h)))
    blocks = pool.allocate_many(3)
    for i, b in enumerate(blocks):
        pool.register(b, 100 + i)
    for b in blocks:  # LRU order: blocks[0] oldest
        pool.decref(b)
    pool.touch(blocks[0])  # now blocks[1] is the oldest
    # One truly free block remains (id 3): it must be used before any cached block.
    assert pool.allocate() == 3 and events == []
    got = pool.allocate()
    assert got == blocks[1] and events == [(blocks[1], 101)]
    assert pool.lookup(101) is None and pool.block_hash(got) is None
    assert pool.allocate() == blocks[2]
    assert pool.allocate() == blocks[0]
    assert [h for _, h in events] == [101, 102, 100]
    with pytest.raises(NoFreeBlocks):
        pool.allocate()
    pool.check_invariants()


def test_listener_sees_consistent_pool() -> None:
    pool = BlockPool(1)
    b = pool.allocate()
    pool.register(b, 5)
    pool.decref(b)
    seen: list[int] = []

    def listener(block: int, h: int) -> None:
        pool.check_invariants()
        seen.append(pool.refcount(block))

    pool.add_evict_listener(listener)
    assert pool.allocate() == b
    assert seen == [1]


def test_allocate_many_is_all_or_nothing() -> None:
    pool = BlockPool(5)
    held = pool.allocate_many(3)
    b = held[0]
    pool.register(b, 9)
    pool.decref(b)
    assert pool.num_free() == 3
    with pytest.raises(NoFreeBlocks):
        pool.allocate_many(4)
    # No side effects: the cached block is still cached and nothing was taken.
    assert pool.lookup(9) == b and pool.num_free() == 3 and pool.num_evictable() == 1
    assert pool.allocate_many(0) == []
    got = pool.allocate_many(3)
    assert len(set(got)) == 3 and pool.num_free() == 0
    pool.check_invariants()


def test_evict_all_cached_keeps_in_use_hashes() -> None:
    pool = BlockPool(4)
    events: list[tuple[int, int]] = []
    pool.add_evict_listener(lambda blk, h: events.append((blk, h)))
    a, b, c = pool.allocate_many(3)
    pool.register(a, 1)
    pool.register(b, 2)
    pool.register(c, 3)
    pool.decref(a)
    pool.decref(b)
    assert pool.evict_all_cached() == 2
    assert sorted(events) == [(a, 1), (b, 2)]
    assert pool.lookup(1) is None and pool.lookup(2) is None and pool.lookup(3) == c
    assert pool.num_evictable() == 0 and pool.num_free() == 3
    pool.decref(c)  # still hashed: becomes evictable
    assert pool.num_evictable() == 1
    pool.check_invariants()


def test_touch_is_noop_for_non_evictable() -> None:
    pool = BlockPool(2)
    b = pool.allocate()
    pool.touch(b)
    pool.touch(1)
    pool.check_invariants()


def test_large_pool_is_fast() -> None:
    n = 200_000
    t0 = time.perf_counter()
    pool = BlockPool(n)
    blocks = pool.allocate_many(n)
    for i, b in enumerate(blocks):
        pool.register(b, i)
    for b in blocks:
        pool.decref(b)
    assert pool.num_evictable() == n
    for _ in range(n):  # every allocation evicts (free list empty)
        pool.allocate()
    elapsed = time.perf_counter() - t0
    assert pool.num_free() == 0
    assert elapsed < 10.0, f"O(1) operations expected, took {elapsed:.1f}s"


# ------------------------------------------------------------------------- state machine


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool with random operations and checks it against a simple model.

    The model tracks refcounts, hashes, the set of truly free blocks and the exact LRU order of
    evictable blocks, so every allocation's choice (free list first, else the LRU block) and
    every listener call can be predicted.
    """

    @initialize(n=st.integers(min_value=1, max_value=8))
    def setup(self, n: int) -> None:
        self.pool = BlockPool(n)
        self.n = n
        self.rc = [0] * n
        self.hash_of: dict[int, int] = {}
        self.block_of: dict[int, int] = {}
        self.free: set[int] = set(range(n))
        self.lru: list[int] = []  # oldest first
        self.held: list[int] = []  # one entry per reference we own
        self.events: list[tuple[int, int]] = []
        self.pool.add_evict_listener(self._on_evict)

    def _on_evict(self, block: int, block_hash: int) -> None:
        self.events.append((block, block_hash))

    # -- model helpers
    def _expect_allocate(self, got: int) -> None:
        if self.free:
            assert got in self.free, f"got {got}; free list {self.free} must be used before eviction"
            assert self.events == []
            self.free.discard(got)
        else:
            assert self.lru, "allocation succeeded with nothing free"
            victim = self.lru.pop(0)
            assert got == victim, f"expected LRU victim {victim}, got {got}"
            h = self.hash_of.pop(victim)
            del self.block_of[h]
            assert self.events == [(victim, h)]
        assert self.rc[got] == 0, "a referenced block was handed out again"
        self.events.clear()
        self.rc[got] = 1
        self.held.append(got)

    # -- rules
    @precondition(lambda self: self.free or self.lru)
    @rule(h=st.none() | st.integers(min_value=0, max_value=15))
    def allocate(self, h: int | None) -> None:
        b = self.pool.allocate()
        self._expect_allocate(b)
        if h is not None:  # a block that was filled and committed to the prefix cache
            self._register(b, h)

    @precondition(lambda self: self.free or self.lru)
    @rule(h=st.integers(min_value=0, max_value=15))
    def allocate_register_release(self, h: int) -> None:
        """The common life of a prompt block: filled, cached, released (becomes evictable)."""
        b = self.pool.allocate()
        self._expect_allocate(b)
        self._register(b, h)
        self.held.remove(b)
        self.pool.decref(b)
        self.rc[b] = 0
        if b in self.hash_of:
            self.lru.append(b)
        else:
            self.free.add(b)

    @precondition(lambda self: not self.free and not self.lru)
    @rule()
    def allocate_when_full_raises(self) -> None:
        try:
            self.pool.allocate()
        except NoFreeBlocks:
            return
        raise AssertionError("allocate succeeded on a full pool")

    @rule(k=st.integers(min_value=0, max_value=4))
    def allocate_many(self, k: int) -> None:
        available = len(self.free) + len(self.lru)
        if available < k:
            before = (self.pool.num_free(), self.pool.num_evictable())
            try:
                self.pool.allocate_many(k)
            except NoFreeBlocks:
                assert (self.pool.num_free(), self.pool.num_evictable()) == before
                assert self.events == []
                return
            raise AssertionError("allocate_many over capacity did not raise")
        # Run the real call with a listener snapshot, then replay in the model one by one.
        got = self.pool.allocate_many(k)
        events = list(self.events)
        for b in got:
            self.events = [events.pop(0)] if not self.free else []
            self._expect_allocate(b)
        assert events == []

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(min_value=0, max_value=len(self.held) - 1))
        b = self.held.pop(i)
        self.pool.decref(b)
        self.rc[b] -= 1
        if self.rc[b] == 0:
            if b in self.hash_of:
                self.lru.append(b)
            else:
                self.free.add(b)

    @rule(b=st.integers(min_value=0, max_value=7))
    def decref_unheld_raises(self, b: int) -> None:
        if b >= self.n or self.rc[b] > 0:
            return
        try:
            self.pool.decref(b)
        except ValueError:
            return
        raise AssertionError("decref at refcount 0 did not raise")

    @rule(h=st.integers(min_value=0, max_value=9))
    def lookup_and_share(self, h: int) -> None:
        b = self.pool.lookup(h)
        assert b == self.block_of.get(h)
        if b is None:
            return
        assert self.pool.refcount(b) == self.rc[b], "lookup must not change refcount"
        self.pool.incref(b)
        if self.rc[b] == 0:
            self.lru.remove(b)
        self.rc[b] += 1
        self.held.append(b)

    @precondition(lambda self: self.held)
    @rule(data=st.data(), h=st.integers(min_value=0, max_value=9))
    def register(self, data: st.DataObject, h: int) -> None:
        self._register(data.draw(st.sampled_from(self.held)), h)

    def _register(self, b: int, h: int) -> None:
        old = self.hash_of.get(b)
        if old is not None and old != h:
            try:
                self.pool.register(b, h)
            except ValueError:
                return
            raise AssertionError("re-registering a block under another hash did not raise")
        self.pool.register(b, h)
        if old is None and h not in self.block_of:
            self.hash_of[b] = h
            self.block_of[h] = b

    @rule(b=st.integers(min_value=0, max_value=7))
    def touch(self, b: int) -> None:
        if b >= self.n:
            return
        self.pool.touch(b)
        if b in self.lru:
            self.lru.remove(b)
            self.lru.append(b)

    @rule()
    def flush(self) -> None:
        expected = [(b, self.hash_of[b]) for b in self.lru]
        assert self.pool.evict_all_cached() == len(expected)
        assert self.events == expected
        self.events.clear()
        for b, h in expected:
            del self.hash_of[b]
            del self.block_of[h]
            self.free.add(b)
        self.lru.clear()

    @rule()
    def release_everything(self) -> None:
        for b in self.held:  # a block reaches refcount 0 (and its LRU position) on its last decref
            self.pool.decref(b)
            self.rc[b] -= 1
            if self.rc[b] == 0:
                if b in self.hash_of:
                    self.lru.append(b)
                else:
                    self.free.add(b)
        self.held.clear()
        assert self.pool.num_free() == self.n, "blocks leaked"
        assert self.pool.num_used() == 0

    # -- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        self.pool.check_invariants()
        assert self.events == []
        for b in range(self.n):
            assert self.pool.refcount(b) == self.rc[b] >= 0
            assert self.pool.block_hash(b) == self.hash_of.get(b)
        assert self.pool.num_evictable() == len(self.lru)
        assert self.pool.num_free() == len(self.free) + len(self.lru)
        assert self.pool.num_used() == sum(1 for r in self.rc if r > 0)
        assert sorted(self.held) == sorted(b for b in range(self.n) for _ in range(self.rc[b]))


BlockPoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestBlockPoolMachine = BlockPoolMachine.TestCase
