"""StatePool: exact unit tests plus a hypothesis state machine against a reference model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hyserve.cache import NoFreeSlots, StatePool

# ----------------------------------------------------------------------------- unit tests


def test_slot_ranges_are_disjoint_and_ordered() -> None:
    pool = StatePool(num_live=3, num_pad=2, num_snapshot=4)
    assert (pool.num_live, pool.num_pad, pool.num_snapshot, pool.num_slots) == (3, 2, 4, 9)
    assert pool.pad_slots == [3, 4]
    live = [pool.allocate_live() for _ in range(3)]
    assert sorted(live) == [0, 1, 2]
    snaps = [pool.allocate_snapshot(k) for k in range(4)]
    assert sorted(s for s in snaps if s is not None) == [5, 6, 7, 8]
    assert pool.is_pad_slot(3) and not pool.is_live_slot(3) and not pool.is_snapshot_slot(4)
    pool.check_invariants()


def test_live_exhaustion_and_double_free() -> None:
    pool = StatePool(num_live=1, num_pad=1, num_snapshot=0)
    s = pool.allocate_live()
    assert pool.num_free_live() == 0
    with pytest.raises(NoFreeSlots):
        pool.allocate_live()
    pool.free_live(s)
    with pytest.raises(ValueError, match="double free"):
        pool.free_live(s)
    with pytest.raises(ValueError, match="not a live slot"):
        pool.free_live(1)  # the pad slot
    pool.check_invariants()


def test_no_snapshot_slots_returns_none() -> None:
    pool = StatePool(num_live=2, num_pad=0, num_snapshot=0)
    assert pool.allocate_snapshot(1) is None
    assert pool.lookup_snapshot(1) is None
    assert pool.drop_all_snapshots() == 0


def _written(pool: StatePool, key: int) -> int | None:
    """A snapshot slot for `key` whose step has been taken in (lookups return it)."""
    s = pool.allocate_snapshot(key)
    if s is not None:
        pool.mark_written(s)
    return s


def test_snapshot_same_key_returns_same_slot() -> None:
    pool = StatePool(num_live=1, num_pad=0, num_snapshot=3)
    a = _written(pool, 10)
    assert pool.allocate_snapshot(10) == a
    assert pool.lookup_snapshot(10) == a and pool.snapshot_key(a) == 10
    assert pool.num_snapshots_used() == 1


def test_snapshot_lru_eviction_skips_pinned() -> None:
    pool = StatePool(num_live=1, num_pad=1, num_snapshot=3)
    events: list[tuple[int, int]] = []
    pool.add_evict_listener(lambda slot, key: events.append((slot, key)))
    a, b, c = (_written(pool, k) for k in (1, 2, 3))
    assert None not in (a, b, c)
    pool.pin_snapshot(a)  # oldest, but pinned
    assert pool.lookup_snapshot(2) == b  # bump 2: now 3 is the LRU unpinned entry
    d = pool.allocate_snapshot(4)
    assert d == c and events == [(c, 3)] and pool.lookup_snapshot(3) is None
    e = pool.allocate_snapshot(5)
    assert e == b and events[-1] == (b, 2)
    pool.pin_snapshot(d)
    pool.pin_snapshot(e)
    assert pool.allocate_snapshot(6) is None  # everything pinned
    assert pool.lookup_snapshot(1) == a
    pool.check_invariants()


def test_unwritten_snapshot_is_not_a_lookup_hit() -> None:
    # taken for a step that has not been taken in yet: a request admitted in that step must not start
    # from it, and nobody may take the key again
    pool = StatePool(num_live=1, num_pad=0, num_snapshot=2)
    s = pool.allocate_snapshot(5, pin=True)
    assert s is not None
    assert pool.lookup_snapshot(5) is None and pool.has_snapshot(5)
    pool.mark_written(s)
    assert pool.lookup_snapshot(5) == s
    pool.unpin_snapshot(s)
    pool.drop_snapshot(5)  # freed: a new key on the slot starts unwritten again
    t = pool.allocate_snapshot(6)
    assert pool.lookup_snapshot(6) is None and not pool.has_snapshot(5)
    with pytest.raises(ValueError, match="not a snapshot slot"):
        pool.mark_written(0)
    assert t is not None
    pool.check_invariants()


def test_allocate_with_pin_protects_within_a_step() -> None:
    pool = StatePool(num_live=1, num_pad=0, num_snapshot=2)
    a = pool.allocate_snapshot(1, pin=True)
    b = pool.allocate_snapshot(2, pin=True)
    assert pool.allocate_snapshot(3, pin=True) is None  # would otherwise evict a
    assert pool.pin_count(a) == 1 and pool.pin_count(b) == 1
    pool.unpin_snapshot(a)
    assert pool.allocate_snapshot(3) == a
    pool.check_invariants()


def test_unpin_below_zero_and_pin_free_raise() -> None:
    pool = StatePool(num_live=0, num_pad=0, num_snapshot=2)
    with pytest.raises(ValueError, match="free snapshot slot"):
        pool.pin_snapshot(0)
    s = pool.allocate_snapshot(7)
    assert s is not None
    with pytest.raises(ValueError, match="not pinned"):
        pool.unpin_snapshot(s)
    with pytest.raises(ValueError, match="not a snapshot slot"):
        pool.pin_snapshot(5)


def test_drop_pinned_snapshot_frees_on_last_unpin() -> None:
    pool = StatePool(num_live=0, num_pad=0, num_snapshot=1)
    s = pool.allocate_snapshot(1)
    assert s is not None
    pool.pin_snapshot(s)
    pool.pin_snapshot(s)
    pool.drop_snapshot(1)
    assert pool.lookup_snapshot(1) is None and pool.snapshot_key(s) is None
    assert pool.allocate_snapshot(2) is None  # still pinned by the in-flight operation
    pool.unpin_snapshot(s)
    assert pool.num_snapshots_used() == 1
    pool.unpin_snapshot(s)
    assert pool.num_snapshots_used() == 0
    assert pool.allocate_snapshot(2) == s
    pool.drop_snapshot(99)  # absent key: no-op
    pool.check_invariants()


def test_drop_all_snapshots_keeps_pinned() -> None:
    pool = StatePool(num_live=0, num_pad=0, num_snapshot=3)
    events: list[tuple[int, int]] = []
    pool.add_evict_listener(lambda slot, key: events.append((slot, key)))
    a, b, c = (_written(pool, k) for k in (1, 2, 3))
    assert a is not None
    pool.pin_snapshot(a)
    assert pool.drop_all_snapshots() == 2
    assert sorted(events) == sorted([(b, 2), (c, 3)])
    assert pool.lookup_snapshot(1) == a and pool.num_snapshots_used() == 1
    pool.check_invariants()


# ------------------------------------------------------------------------- state machine


class StatePoolMachine(RuleBasedStateMachine):
    """Random live/snapshot traffic checked against a model of keys, pins and LRU order."""

    @initialize(
        num_live=st.integers(min_value=0, max_value=4),
        num_pad=st.integers(min_value=0, max_value=3),
        num_snapshot=st.integers(min_value=0, max_value=5),
    )
    def setup(self, num_live: int, num_pad: int, num_snapshot: int) -> None:
        self.pool = StatePool(num_live, num_pad, num_snapshot)
        self.num_live, self.num_pad, self.num_snapshot = num_live, num_pad, num_snapshot
        self.base = num_live + num_pad
        self.live_held: set[int] = set()
        self.slot_of: dict[int, int] = {}  # key -> slot
        self.key_of: dict[int, int] = {}  # slot -> key
        self.pins: dict[int, int] = {}
        self.doomed: set[int] = set()
        self.lru: list[int] = []  # unpinned keyed slots, oldest first
        self.free: set[int] = set(range(self.base, self.base + num_snapshot))
        self.unwritten: set[int] = set()  # keyed/doomed slots not yet marked written
        self.events: list[tuple[int, int]] = []
        self.pool.add_evict_listener(lambda slot, key: self.events.append((slot, key)))

    # -- live slots
    @rule()
    def allocate_live(self) -> None:
        if len(self.live_held) == self.num_live:
            try:
                self.pool.allocate_live()
            except NoFreeSlots:
                return
            raise AssertionError("allocate_live succeeded with all live slots in use")
        s = self.pool.allocate_live()
        assert 0 <= s < self.num_live, "live slot outside the live range"
        assert s not in self.live_held
        self.live_held.add(s)

    @precondition(lambda self: self.live_held)
    @rule(data=st.data())
    def free_live(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.live_held)))
        self.pool.free_live(s)
        self.live_held.discard(s)
        try:
            self.pool.free_live(s)
        except ValueError:
            return
        raise AssertionError("double free of a live slot did not raise")

    # -- snapshots
    @rule(key=st.integers(min_value=0, max_value=9), pin=st.booleans())
    def allocate_snapshot(self, key: int, pin: bool) -> None:
        got = self.pool.allocate_snapshot(key, pin=pin)
        if key in self.slot_of:
            s = self.slot_of[key]
            assert got == s
            assert self.events == []
            if s in self.lru:
                self.lru.remove(s)
                self.lru.append(s)
        elif self.free:
            assert got in self.free and self.events == []
            self.free.discard(got)
            self._own(got, key)
        elif self.lru:
            victim = self.lru.pop(0)
            assert self.pins.get(victim, 0) == 0
            assert got == victim, f"expected LRU unpinned victim {victim}, got {got}"
            old_key = self.key_of.pop(victim)
            del self.slot_of[old_key]
            assert self.events == [(victim, old_key)]
            self.events.clear()
            self.unwritten.discard(victim)
            self._own(got, key)
        else:
            assert got is None, "allocate_snapshot must return None when every slot is pinned"
            return
        assert got is not None and self.base <= got < self.base + self.num_snapshot
        if pin:
            if self.pins.get(got, 0) == 0 and got in self.lru:
                self.lru.remove(got)
            self.pins[got] = self.pins.get(got, 0) + 1

    def _own(self, slot: int, key: int) -> None:
        self.slot_of[key] = slot
        self.key_of[slot] = key
        self.unwritten.add(slot)
        self.lru.append(slot)

    @rule(key=st.integers(min_value=0, max_value=9))
    def lookup(self, key: int) -> None:
        got = self.pool.lookup_snapshot(key)
        s = self.slot_of.get(key)
        assert got == (None if s in self.unwritten else s)
        assert self.pool.has_snapshot(key) == (s is not None)
        if got is not None and got in self.lru:
            self.lru.remove(got)
            self.lru.append(got)

    @precondition(lambda self: self.unwritten)
    @rule(data=st.data())
    def mark_written(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.unwritten)))
        self.pool.mark_written(s)
        self.unwritten.discard(s)

    @precondition(lambda self: self.key_of or self.pins)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(set(self.key_of) | set(self.pins))))
        self.pool.pin_snapshot(s)
        if self.pins.get(s, 0) == 0:
            self.lru.remove(s)
        self.pins[s] = self.pins.get(s, 0) + 1

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        s = data.draw(st.sampled_from(sorted(self.pins)))
        self.pool.unpin_snapshot(s)
        self.pins[s] -= 1
        if self.pins[s] == 0:
            del self.pins[s]
            if s in self.doomed:
                self.doomed.discard(s)
                self.unwritten.discard(s)
                self.free.add(s)
            else:
                self.lru.append(s)

    @rule(slot_offset=st.integers(min_value=0, max_value=4))
    def unpin_unpinned_raises(self, slot_offset: int) -> None:
        s = self.base + slot_offset
        if s in self.pins:
            return
        try:
            self.pool.unpin_snapshot(s)
        except ValueError:
            return
        raise AssertionError("unpin below zero did not raise")

    @rule(key=st.integers(min_value=0, max_value=9))
    def drop(self, key: int) -> None:
        self.pool.drop_snapshot(key)
        s = self.slot_of.pop(key, None)
        if s is None:
            return
        del self.key_of[s]
        if s in self.pins:
            self.doomed.add(s)
        else:
            self.lru.remove(s)
            self.unwritten.discard(s)
            self.free.add(s)

    @rule()
    def drop_all(self) -> None:
        expected = [(s, self.key_of[s]) for s in self.lru]
        assert self.pool.drop_all_snapshots() == len(expected)
        assert self.events == expected
        self.events.clear()
        for s, k in expected:
            del self.key_of[s]
            del self.slot_of[k]
            self.unwritten.discard(s)
            self.free.add(s)
        self.lru.clear()

    # -- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "pool"):
            return
        pool = self.pool
        pool.check_invariants()
        assert self.events == []
        assert pool.num_free_live() == self.num_live - len(self.live_held)
        assert all(pool.is_live_slot(s) and not pool.is_pad_slot(s) for s in self.live_held)
        assert pool.pad_slots == list(range(self.num_live, self.base))
        assert pool.num_snapshots_used() == self.num_snapshot - len(self.free)
        for k, s in self.slot_of.items():
            assert pool.snapshot_key(s) == k
        for s in range(self.base, self.base + self.num_snapshot):
            assert pool.pin_count(s) == self.pins.get(s, 0)
        assert pool.num_snapshots_evictable() == len(self.lru)


StatePoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestStatePoolMachine = StatePoolMachine.TestCase
