"""Pool of fixed-size attention-KV blocks with reference counts and a prefix-cache index.

A cached block whose refcount dropped to 0 keeps its prefix reusable until no truly free block is left,
and a referenced block is never evicted, so an allocation cannot evict the prefix chain the same operation
depends on (an engine once crashed on long prompts that way). Pure Python bookkeeping: no torch, no CUDA.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

__all__ = ["BlockPool", "NoFreeBlocks"]


class NoFreeBlocks(RuntimeError):
    """Raised when an allocation needs more blocks than are free or evictable.

    The scheduler treats this as "preempt someone or wait", never as a crash.
    """


class BlockPool:
    """Reference-counted KV blocks ``0 .. num_blocks-1`` with hash-keyed prefix caching.

    Every block is in exactly one of three states::

        free       refcount 0, no hash      -> in the free list (FIFO deque)
        evictable  refcount 0, has a hash   -> in the LRU (OrderedDict, oldest first)
        used       refcount > 0             -> held by one or more running requests
                                               (may or may not have a hash)

        allocate()            free --------------------------------> used (rc=1)
                              evictable (only if free list empty) -> used (rc=1, hash dropped,
                                                                      evict listeners called)
        incref()              used -> used (rc+1);  evictable -> used (rc=1, leaves the LRU)
        decref() to rc 0      used -> evictable (has hash, MRU end)  |  used -> free (no hash)
        evict_all_cached()    evictable -> free (hash dropped, listeners called)

    A cached block with refcount 0 is only recycled when no free block is left, least recently used first.
    Whoever matches a cached prefix must ``incref`` the matched blocks *before* allocating new ones. All
    operations are O(1) except ``evict_all_cached`` (O(evictable)) and ``check_invariants`` (O(num_blocks),
    for tests).
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        self._num_blocks = num_blocks
        self._refcount: list[int] = [0] * num_blocks
        # FIFO so freed blocks are reused round-robin; only ever holds rc==0, unhashed blocks.
        self._free: deque[int] = deque(range(num_blocks))
        # rc==0 blocks that still carry a hash; first item = least recently used.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._hash_of_block: dict[int, int] = {}
        self._block_of_hash: dict[int, int] = {}
        self._evict_listeners: list[Callable[[int, int], None]] = []

    # ------------------------------------------------------------------ sizes

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out now: truly free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    def num_evictable(self) -> int:
        """Cached blocks nobody references (they keep their prefix until reused)."""
        return len(self._evictable)

    def num_used(self) -> int:
        """Blocks with refcount > 0."""
        return self._num_blocks - self.num_free()

    # ------------------------------------------------------------- allocation

    def allocate(self) -> int:
        """Return a block with refcount 1.

        Truly free blocks go first; only when none is left is the least recently used evictable
        cached block recycled (its hash mapping is dropped and evict listeners are told).
        """
        if self._free:
            block = self._free.popleft()
            self._refcount[block] = 1
            return block
        if self._evictable:
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of_block.pop(block)
            del self._block_of_hash[block_hash]
            self._refcount[block] = 1
            # State is consistent before listeners run, so they may query the pool.
            for fn in self._evict_listeners:
                fn(block, block_hash)
            return block
        raise NoFreeBlocks(f"no free or evictable KV block (all {self._num_blocks} blocks in use)")

    def allocate_many(self, n: int) -> list[int]:
        """Allocate ``n`` blocks, all or nothing (no side effects when it raises)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        available = self.num_free()
        if available < n:
            raise NoFreeBlocks(f"need {n} KV blocks, only {available} free or evictable")
        return [self.allocate() for _ in range(n)]

    def incref(self, block: int) -> None:
        """Add a reference, e.g. a new request sharing a cached prefix block.

        An evictable block leaves the LRU (it can no longer be evicted). Increfing a truly free
        block is a bug: it was never handed out, so nobody can hold its id legitimately.
        """
        self._check_id(block)
        rc = self._refcount[block]
        if rc == 0:
            if block not in self._evictable:
                raise ValueError(f"incref of free block {block} (allocate it instead)")
            del self._evictable[block]
        self._refcount[block] = rc + 1

    def decref(self, block: int) -> None:
        """Drop a reference. At refcount 0 a hashed block becomes evictable (MRU end of the
        LRU), an unhashed one goes back to the free list. Decref at refcount 0 raises."""
        self._check_id(block)
        rc = self._refcount[block]
        if rc <= 0:
            raise ValueError(f"decref of block {block} with refcount 0 (double free)")
        rc -= 1
        self._refcount[block] = rc
        if rc == 0:
            if block in self._hash_of_block:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refcount[block]

    # ----------------------------------------------------------- prefix cache

    def lookup(self, block_hash: int) -> int | None:
        """Cached block holding ``block_hash``, or None. Does not change refcounts or the LRU:
        the caller increfs the blocks it decides to reuse."""
        return self._block_of_hash.get(block_hash)

    def register(self, block: int, block_hash: int) -> None:
        """Mark a full, in-use block as cached under ``block_hash``.

        If another block already holds that hash the existing mapping is kept (first wins) and
        this call does nothing: two requests computed the same prefix, and the duplicate block
        simply returns to the free list when released. Re-registering a block under its own hash
        is a no-op; registering it under a different hash raises (a block has at most one hash).
        Only blocks with refcount > 0 can be registered: a free block holds no valid content.
        """
        self._check_id(block)
        if self._refcount[block] <= 0:
            raise ValueError(f"register of block {block} with refcount 0 (it holds no content)")
        existing = self._hash_of_block.get(block)
        if existing is not None:
            if existing != block_hash:
                raise ValueError(
                    f"block {block} is already registered under hash {existing}, not {block_hash}"
                )
            return
        if block_hash in self._block_of_hash:
            return
        self._hash_of_block[block] = block_hash
        self._block_of_hash[block_hash] = block

    def block_hash(self, block: int) -> int | None:
        self._check_id(block)
        return self._hash_of_block.get(block)

    def touch(self, block: int) -> None:
        """Mark an evictable block as recently used (no-op for any other block)."""
        if block in self._evictable:
            self._evictable.move_to_end(block)

    def add_evict_listener(self, fn: Callable[[int, int], None]) -> None:
        """Call ``fn(block, hash)`` whenever a cached block loses its hash by eviction or flush.

        The prefix cache uses this to drop Mamba snapshots keyed on that block's chain.
        """
        self._evict_listeners.append(fn)

    def evict_all_cached(self) -> int:
        """Flush the prefix cache: every evictable block loses its hash and becomes free.

        Blocks in use keep their hash (they are still valid and may be cached again on release).
        Returns the number of blocks flushed.
        """
        flushed: list[tuple[int, int]] = []
        while self._evictable:
            block, _ = self._evictable.popitem(last=False)
            block_hash = self._hash_of_block.pop(block)
            del self._block_of_hash[block_hash]
            self._free.append(block)
            flushed.append((block, block_hash))
        for block, block_hash in flushed:
            for fn in self._evict_listeners:
                fn(block, block_hash)
        return len(flushed)

    # ----------------------------------------------------------------- checks

    def check_invariants(self) -> None:
        """Assert internal consistency (O(num_blocks); for tests and debugging)."""
        n = self._num_blocks
        assert len(self._refcount) == n
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "duplicate block in free list"
        evictable_set = set(self._evictable)
        assert not (free_set & evictable_set), "block both free and evictable"
        for block in range(n):
            rc = self._refcount[block]
            assert rc >= 0, f"block {block} has negative refcount {rc}"
            in_free = block in free_set
            in_evictable = block in evictable_set
            used = rc > 0
            assert in_free + in_evictable + used == 1, (
                f"block {block}: free={in_free} evictable={in_evictable} rc={rc}"
            )
            if in_free:
                assert block not in self._hash_of_block, f"free block {block} has a hash"
            if in_evictable:
                assert block in self._hash_of_block, f"evictable block {block} has no hash"
        assert all(0 <= b < n for b in free_set | evictable_set)
        assert len(self._hash_of_block) == len(self._block_of_hash), "hash maps differ in size"
        for block, block_hash in self._hash_of_block.items():
            assert 0 <= block < n
            assert self._block_of_hash.get(block_hash) == block, f"hash maps disagree on {block}"

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self._num_blocks:
            raise ValueError(f"block id {block} out of range [0, {self._num_blocks})")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self._num_blocks}, free={len(self._free)}, "
            f"evictable={len(self._evictable)}, used={self.num_used()})"
        )
