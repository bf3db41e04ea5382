"""`HybridCacheManager`: who owns which KV block and Mamba state slot, and the hybrid prefix cache.

Pure bookkeeping over `BlockPool` (attention KV blocks) and `StatePool` (Mamba state slots); the tensors
behind them live in the model layer. It keeps the rules that stop an allocation from ever evicting state
the current operation depends on (the long-prompt crash this engine exists to avoid).
"""

from __future__ import annotations

from dataclasses import dataclass

from hyserve.cache.alignment import ChunkSpan, chunk_span
from hyserve.cache.block_pool import BlockPool, NoFreeBlocks
from hyserve.cache.capacity import CapacityPlan
from hyserve.cache.state_pool import NoFreeSlots, StatePool

_ROOT_HASH = 0x9E3779B97F4A7C15


def chain_hashes(tokens: list[int], tokens_per_block: int) -> list[int]:
    """Hash chain over the full blocks of `tokens`; computed once per prompt by the scheduler."""
    out: list[int] = []
    h = _ROOT_HASH
    for b in range(len(tokens) // tokens_per_block):
        h = hash((h, tuple(tokens[b * tokens_per_block : (b + 1) * tokens_per_block])))
        out.append(h)
    return out


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int  # tokens served from the cache (a multiple of tokens_per_block)
    blocks: list[int]  # the shared KV blocks for those tokens (already referenced for the caller)
    snapshot_slot: int | None  # state slot holding the Mamba state at num_tokens (pinned for the caller)


class HybridCacheManager:
    """Rules that keep it crash-proof:

    * A request's shared prefix blocks are referenced (incref) and its source snapshot is pinned *before*
      anything else is allocated for it, so no allocation can evict state the request depends on.
    * A snapshot written during a step is pinned for that step; eviction only takes unpinned entries.
    * Allocation is all-or-nothing per request per step; on failure nothing changed and the scheduler
      decides (wait, or preempt someone younger).

    Hybrid prefix caching. Attention KV is reusable block by block (hash chain over full prompt blocks);
    Mamba state only exactly where a snapshot was taken. A hit therefore ends at the deepest block
    boundary p that has both every KV block of [0, p) cached and a snapshot keyed by the chain hash at p:

        prompt   |  blk0  |  blk1  |  blk2  |  blk3  | ...
        hashes      h0       h1       h2       h3          h_i = hash(h_{i-1}, tokens of block i)
        KV cached   yes      yes      yes      no
        snapshot    -        h1       -        -            -> hit = 2 blocks (state from snapshot h1)
    """

    def __init__(
        self,
        plan: CapacityPlan,
        *,
        has_mamba: bool,
        enable_block_reuse: bool,
        snapshot_interval: int | None,
        snapshot_offsets_from_end: tuple[int, ...],
    ) -> None:
        self.plan = plan
        self.tokens_per_block = plan.inputs.tokens_per_block
        self.blocks = BlockPool(plan.num_kv_blocks)
        self.states = StatePool(plan.num_live_slots, plan.num_pad_slots, plan.num_snapshot_slots)
        self.has_mamba = has_mamba
        self.reuse = enable_block_reuse
        self.snapshot_interval = snapshot_interval
        self.snapshot_offsets = snapshot_offsets_from_end
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # prompt tokens served from cache
        self.blocks.add_evict_listener(self._on_block_evicted)

    def fresh(self) -> HybridCacheManager:
        """A manager over the same plan with every block and slot free and the prefix cache empty (after a
        failure that may have left the books inconsistent); the prefix-cache counters carry over."""
        out = HybridCacheManager(
            self.plan,
            has_mamba=self.has_mamba,
            enable_block_reuse=self.reuse,
            snapshot_interval=self.snapshot_interval,
            snapshot_offsets_from_end=self.snapshot_offsets,
        )
        out.prefix_queries, out.prefix_hits = self.prefix_queries, self.prefix_hits
        return out

    # ---- capacity ---------------------------------------------------------------------------------
    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.tokens_per_block - 1) // self.tokens_per_block

    # ---- prefix cache -----------------------------------------------------------------------------
    def match_prefix(self, hashes: list[int], num_tokens: int) -> PrefixHit:
        """Find the longest reusable prefix of a `num_tokens`-token sequence whose full prompt blocks
        hash to `hashes` (`chain_hashes`), leaving at least one token to compute; take references on
        its blocks and pin its snapshot. Always returns a hit (possibly empty)."""
        if not self.reuse:
            return PrefixHit(0, [], None)
        bs = self.tokens_per_block
        hashes = hashes[: (num_tokens - 1) // bs]
        self.prefix_queries += num_tokens
        chain: list[int] = []
        best_blocks, best_slot = 0, None
        for i, h in enumerate(hashes):
            b = self.blocks.lookup(h)
            if b is None:
                break
            chain.append(b)
            if not self.has_mamba:
                best_blocks = i + 1
            else:
                slot = self.states.lookup_snapshot(h)
                if slot is not None:
                    best_blocks, best_slot = i + 1, slot
        if best_blocks == 0:
            return PrefixHit(0, [], None)
        shared = chain[:best_blocks]
        for b in shared:
            self.blocks.incref(b)
        if best_slot is not None:
            self.states.pin_snapshot(best_slot)
        self.prefix_hits += best_blocks * bs
        return PrefixHit(best_blocks * bs, shared, best_slot)

    def snapshot_boundaries(self, prompt_len: int) -> list[int]:
        """Token positions (block multiples, within the prompt) where a snapshot should be taken."""
        if not (self.reuse and self.has_mamba and self.states.num_snapshot > 0):
            return []
        bs = self.tokens_per_block
        out: set[int] = set()
        if self.snapshot_interval:
            out.update(range(self.snapshot_interval, prompt_len + 1, self.snapshot_interval))
        for off in self.snapshot_offsets:
            p = (prompt_len - off) // bs * bs
            if p > 0:
                out.add(p)
        return sorted(out)

    def chunk_span(self, start: int, max_tokens: int, *, prompt_len: int, chunk_size: int) -> ChunkSpan:
        """Where a prefill chunk of a `prompt_len`-token prompt, from `start` and of at most `max_tokens`
        tokens, may end for an SSD scan of `chunk_size`-token chunks, and which snapshots it writes
        (`cache/alignment.py`)."""
        return chunk_span(
            start, max_tokens, chunk_size=chunk_size, boundaries=self.snapshot_boundaries(prompt_len)
        )

    def allocate_snapshot(self, hashes: list[int], position: int) -> tuple[int, int] | None:
        """A pinned snapshot slot and its key (the chain hash at block boundary `position`). None when
        that snapshot already exists or no slot can be had: the snapshot is then skipped; correctness
        never depends on it."""
        h = hashes[position // self.tokens_per_block - 1]
        if self.states.has_snapshot(h):
            return None
        slot = self.states.allocate_snapshot(h, pin=True)
        if slot is None:
            return None
        return slot, h

    def drop_snapshot(self, key: int) -> None:
        self.states.drop_snapshot(key)

    def release_snapshot(self, slot: int) -> None:
        self.states.unpin_snapshot(slot)

    def commit_snapshot(self, slot: int) -> None:
        """The step that writes snapshot `slot` has been taken in: later lookups may start from it."""
        self.states.mark_written(slot)
        self.states.unpin_snapshot(slot)

    def register_blocks(self, block_ids: list[int], hashes: list[int], start: int, end: int) -> None:
        """Publish blocks [start, end) of a request (computed, full, prompt blocks) in the prefix index."""
        if not self.reuse:
            return
        for i in range(start, end):
            if self.blocks.block_hash(block_ids[i]) is None:
                self.blocks.register(block_ids[i], hashes[i])

    def _on_block_evicted(self, block: int, block_hash: int) -> None:
        # the snapshot at this block's end can no longer be used (its KV prefix is gone)
        self.states.drop_snapshot(block_hash)

    def reset_prefix_cache(self) -> int:
        """Flush every unreferenced cached block and unpinned snapshot. Returns entries dropped."""
        n = self.states.drop_all_snapshots()
        return n + self.blocks.evict_all_cached()

    # ---- per-request allocation -------------------------------------------------------------------
    def allocate_live_slot(self) -> int | None:
        try:
            return self.states.allocate_live()
        except NoFreeSlots:
            return None

    def grow(self, block_ids: list[int], num_tokens: int) -> bool:
        """Make `block_ids` cover `num_tokens` tokens. All-or-nothing; False if blocks are short."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need <= 0:
            return True
        try:
            block_ids.extend(self.blocks.allocate_many(need))
        except NoFreeBlocks:
            return False
        return True

    def free_blocks(self, block_ids: list[int]) -> None:
        # reverse order: a request's tail blocks become the least recently used, so they go first
        for b in reversed(block_ids):
            self.blocks.decref(b)
        block_ids.clear()

    def free_live_slot(self, slot: int) -> None:
        self.states.free_live(slot)

    # ---- introspection ----------------------------------------------------------------------------
    def usage(self) -> dict[str, int]:
        return {
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_free": self.blocks.num_free(),
            "live_slots_total": self.states.num_live,
            "live_slots_used": self.states.num_live - self.states.num_free_live(),
            "snapshot_slots_total": self.states.num_snapshot,
            "snapshot_slots_used": self.states.num_snapshots_used(),
            # cached blocks no request holds + snapshots: what a flush would drop
            "prefix_cache_entries": self.blocks.num_evictable() + self.states.num_snapshots_used(),
        }

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        self.states.check_invariants()
