"""Pool of Mamba state slots: live slots, CUDA-graph pad slots and prefix-cache snapshot slots.

A slot holds the conv + SSM state of every Mamba layer for one sequence. Snapshots are pinned while an
in-flight operation reads or writes them and only unpinned cached ones are ever evicted, so an allocation
can never destroy state the current step depends on. Pure Python bookkeeping: no torch, no CUDA.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

__all__ = ["NoFreeSlots", "StatePool"]


class NoFreeSlots(RuntimeError):
    """Raised when no live state slot is free (more running requests than ``max_batch_size``)."""


def _check_count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")


class StatePool:
    """Allocator for live, pad and snapshot Mamba state slots. The ids of the three kinds are disjoint
    ranges, so a slot id alone says what it is::

        0 ........ num_live-1 | num_live ... num_live+num_pad-1 | ... num_slots-1
        live (one per running  | pad (targets for CUDA-graph     | snapshot (owned by the prefix
        request)               |  padding rows; never allocated) |  cache, keyed by a chain hash)

    Snapshot slots are in one of four states::

        free      no key, pin 0           -> in the free list
        cached    key, pin 0              -> in the LRU (first = least recently used); evictable
        pinned    key, pin > 0            -> an in-flight operation reads/writes it; never evicted
        doomed    no key, pin > 0         -> dropped while pinned; freed on the last unpin

    A snapshot slot taken for a key is *unwritten* until the step that computes it has been taken in
    (`mark_written`): `lookup_snapshot` does not return it before, so a request admitted in that same step
    cannot start from a slot the step has not written yet (its own read of the initial state would come
    first). `has_snapshot` still sees the key, so nobody allocates it twice.

    Why pins instead of refcounts on the key: the prefix cache may drop an entry (its KV prefix was
    evicted) while the runner is still copying from or writing into the slot in the current step.
    The key disappears at once (no new lookup can find it), but the slot is not reused until the
    operation that pinned it is done. ``allocate_snapshot`` only ever evicts *cached* slots, so an
    allocation can never destroy state that an in-flight operation depends on; callers that allocate
    several snapshots for one step should pass ``pin=True`` so that a later allocation in the same
    step cannot evict an earlier one.

    O(1) per operation except the flushes and ``check_invariants``.
    """

    def __init__(self, num_live: int, num_pad: int, num_snapshot: int) -> None:
        _check_count("num_live", num_live)
        _check_count("num_pad", num_pad)
        _check_count("num_snapshot", num_snapshot)
        self._num_live = num_live
        self._num_pad = num_pad
        self._num_snapshot = num_snapshot
        self._snap_base = num_live + num_pad
        self._unwritten: set[int] = set()  # keyed (or doomed) slots whose state a pending step still writes

        self._live_free: deque[int] = deque(range(num_live))
        self._live_used: list[bool] = [False] * num_live

        self._snap_free: deque[int] = deque(range(self._snap_base, self._snap_base + num_snapshot))
        self._slot_of_key: dict[int, int] = {}
        self._key_of_slot: dict[int, int] = {}  # cached + pinned slots
        self._pins: dict[int, int] = {}  # slot -> pin count > 0 (pinned + doomed slots)
        self._doomed: set[int] = set()
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached (unpinned, keyed) slots
        self._evict_listeners: list[Callable[[int, int], None]] = []

    # ------------------------------------------------------------------ sizes

    @property
    def num_live(self) -> int:
        return self._num_live

    @property
    def num_pad(self) -> int:
        return self._num_pad

    @property
    def num_snapshot(self) -> int:
        return self._num_snapshot

    @property
    def num_slots(self) -> int:
        return self._snap_base + self._num_snapshot

    @property
    def pad_slots(self) -> list[int]:
        return list(range(self._num_live, self._snap_base))

    def is_live_slot(self, slot: int) -> bool:
        return 0 <= slot < self._num_live

    def is_pad_slot(self, slot: int) -> bool:
        return self._num_live <= slot < self._snap_base

    def is_snapshot_slot(self, slot: int) -> bool:
        return self._snap_base <= slot < self.num_slots

    # ------------------------------------------------------------- live slots

    def allocate_live(self) -> int:
        """Slot for a request that starts running. Raises NoFreeSlots when all are in use."""
        if not self._live_free:
            raise NoFreeSlots(f"all {self._num_live} live state slots are in use")
        slot = self._live_free.popleft()
        self._live_used[slot] = True
        return slot

    def free_live(self, slot: int) -> None:
        """Return a live slot. Freeing a slot that is not allocated (double free) raises."""
        if not self.is_live_slot(slot):
            raise ValueError(f"slot {slot} is not a live slot (live range [0, {self._num_live}))")
        if not self._live_used[slot]:
            raise ValueError(f"free_live of live slot {slot} that is not allocated (double free)")
        self._live_used[slot] = False
        self._live_free.append(slot)

    def num_free_live(self) -> int:
        return len(self._live_free)

    # --------------------------------------------------------- snapshot slots

    def allocate_snapshot(self, key: int, *, pin: bool = False) -> int | None:
        """Slot owned by ``key`` (the hash of the token chain it snapshots), or None.

        If ``key`` already has a slot, that slot is returned (and bumped in the LRU). Otherwise a
        free snapshot slot is taken, or else the least recently used *unpinned* one is evicted
        (evict listeners get ``(slot, old_key)``). Returns None when every snapshot slot is
        pinned or there are none. With ``pin=True`` the returned slot is also pinned once, in
        the same step, so nothing can evict it before the caller has written it.
        """
        slot = self._slot_of_key.get(key)
        if slot is not None:
            if slot in self._lru:
                self._lru.move_to_end(slot)
            if pin:
                self.pin_snapshot(slot)
            return slot
        evicted_key: int | None = None
        if self._snap_free:
            slot = self._snap_free.popleft()
        elif self._lru:
            slot, _ = self._lru.popitem(last=False)
            evicted_key = self._key_of_slot.pop(slot)
            del self._slot_of_key[evicted_key]
        else:
            return None
        self._slot_of_key[key] = slot
        self._key_of_slot[slot] = key
        self._unwritten.add(slot)
        self._lru[slot] = None
        if pin:
            self.pin_snapshot(slot)
        # Listeners run once the pool is consistent (and the new slot pinned, if asked), so they
        # may query or call back into the pool.
        if evicted_key is not None:
            for fn in self._evict_listeners:
                fn(slot, evicted_key)
        return slot

    def lookup_snapshot(self, key: int) -> int | None:
        """Slot holding the written snapshot for ``key``, or None (none, or its step not taken in yet).
        A hit bumps the LRU."""
        slot = self._slot_of_key.get(key)
        if slot is None or slot in self._unwritten:
            return None
        if slot in self._lru:
            self._lru.move_to_end(slot)
        return slot

    def has_snapshot(self, key: int) -> bool:
        """Whether ``key`` owns a slot, written or still being written."""
        return key in self._slot_of_key

    def mark_written(self, slot: int) -> None:
        """The step writing this snapshot slot has been taken in: lookups may return it from now on."""
        if not self.is_snapshot_slot(slot):
            raise ValueError(f"slot {slot} is not a snapshot slot")
        self._unwritten.discard(slot)

    def snapshot_key(self, slot: int) -> int | None:
        """Key owning a snapshot slot (None if free or doomed)."""
        return self._key_of_slot.get(slot)

    def pin_count(self, slot: int) -> int:
        return self._pins.get(slot, 0)

    def pin_snapshot(self, slot: int) -> None:
        """Protect a snapshot slot from eviction while an operation reads or writes it."""
        if not self.is_snapshot_slot(slot):
            raise ValueError(f"slot {slot} is not a snapshot slot")
        count = self._pins.get(slot, 0)
        if count == 0:
            if slot not in self._lru:
                raise ValueError(f"pin of free snapshot slot {slot}")
            del self._lru[slot]
        self._pins[slot] = count + 1

    def unpin_snapshot(self, slot: int) -> None:
        """Release one pin. At zero the slot becomes evictable (MRU end), or free if it was
        dropped while pinned. Unpinning an unpinned slot raises."""
        if not self.is_snapshot_slot(slot):
            raise ValueError(f"slot {slot} is not a snapshot slot")
        count = self._pins.get(slot, 0)
        if count <= 0:
            raise ValueError(f"unpin of snapshot slot {slot} that is not pinned")
        if count > 1:
            self._pins[slot] = count - 1
            return
        del self._pins[slot]
        if slot in self._doomed:
            self._doomed.discard(slot)
            self._unwritten.discard(slot)
            self._snap_free.append(slot)
        else:
            self._lru[slot] = None

    def drop_snapshot(self, key: int) -> None:
        """Remove ``key``'s entry (e.g. its KV prefix was evicted). No-op if absent.

        The key disappears immediately. A pinned slot is freed on its last unpin; an unpinned
        one is freed now. Evict listeners are not called: the caller initiated the drop.
        """
        slot = self._slot_of_key.pop(key, None)
        if slot is None:
            return
        del self._key_of_slot[slot]
        if slot in self._pins:
            self._doomed.add(slot)
        else:
            del self._lru[slot]
            self._unwritten.discard(slot)
            self._snap_free.append(slot)

    def drop_all_snapshots(self) -> int:
        """Flush every unpinned entry (listeners are called for each); pinned ones stay.

        Returns the number of entries dropped.
        """
        dropped: list[tuple[int, int]] = []
        while self._lru:
            slot, _ = self._lru.popitem(last=False)
            key = self._key_of_slot.pop(slot)
            del self._slot_of_key[key]
            self._unwritten.discard(slot)
            self._snap_free.append(slot)
            dropped.append((slot, key))
        for slot, key in dropped:
            for fn in self._evict_listeners:
                fn(slot, key)
        return len(dropped)

    def num_snapshots_used(self) -> int:
        """Snapshot slots not free (cached, pinned or doomed)."""
        return self._num_snapshot - len(self._snap_free)

    def num_snapshots_evictable(self) -> int:
        return len(self._lru)

    def add_evict_listener(self, fn: Callable[[int, int], None]) -> None:
        """Call ``fn(slot, key)`` when the pool removes an entry on its own (eviction by
        ``allocate_snapshot``, or ``drop_all_snapshots``)."""
        self._evict_listeners.append(fn)

    # ----------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Assert internal consistency (O(num_slots); for tests and debugging)."""
        # live
        live_free = set(self._live_free)
        assert len(live_free) == len(self._live_free), "duplicate live slot in free list"
        assert all(0 <= s < self._num_live for s in live_free), "non-live slot in live free list"
        for slot in range(self._num_live):
            assert self._live_used[slot] != (slot in live_free), f"live slot {slot} state"
        # snapshots
        lo, hi = self._snap_base, self.num_slots
        snap_free = set(self._snap_free)
        assert len(snap_free) == len(self._snap_free), "duplicate snapshot slot in free list"
        keyed = set(self._key_of_slot)
        pinned = set(self._pins)
        lru = set(self._lru)
        assert len(self._slot_of_key) == len(self._key_of_slot), "key maps differ in size"
        for slot, key in self._key_of_slot.items():
            assert self._slot_of_key.get(key) == slot, f"key maps disagree on slot {slot}"
        assert all(c > 0 for c in self._pins.values()), "non-positive pin count stored"
        assert self._doomed <= pinned, "doomed slot without pins"
        assert not (self._doomed & keyed), "doomed slot still has a key"
        assert lru == keyed - pinned, "LRU must hold exactly the keyed, unpinned slots"
        assert pinned <= keyed | self._doomed
        assert self._unwritten <= keyed | self._doomed, "unwritten mark on a free slot"
        for slot in range(lo, hi):
            states = (slot in snap_free) + (slot in lru) + (slot in pinned)
            assert states == 1, f"snapshot slot {slot} in {states} states"
        for s in snap_free | keyed | pinned:
            assert lo <= s < hi, f"slot {s} outside the snapshot range [{lo}, {hi})"

    def __repr__(self) -> str:
        return (
            f"StatePool(live={self._num_live - len(self._live_free)}/{self._num_live}, "
            f"pad={self._num_pad}, snapshots={self.num_snapshots_used()}/{self._num_snapshot}, "
            f"pinned={len(self._pins)})"
        )
