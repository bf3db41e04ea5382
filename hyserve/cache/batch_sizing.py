"""Sizing `max_batch_size` and `max_num_tokens` from memory when the user leaves them unset.

A running request of a hybrid model holds a Mamba state slot for its whole life, so the most requests that
can run at once is a memory decision: each costs its state slot (47 MiB for Nemotron 3 Nano 30B-A3B with
float32 state, 137.5 MiB for Nano 9B v2) plus the KV of its context. vLLM defaults to 1,024 sequences on
large GPUs whatever the model; here the default is the largest batch whose pools fit the budget:

    need(B) = (B + pad + snapshots(B)) x state_bytes                 live, CUDA-graph pad, snapshot slots
            + (ceil(max_seq_len / tpb) + B x ceil(ctx / tpb)) x block_bytes
                                                                    one max_seq_len request + B contexts
    ctx          = min(max_seq_len, AUTO_CONTEXT_TOKENS)
    snapshots(B) = max(MIN_SNAPSHOT_SLOTS, ceil(B / SNAPSHOT_SHARE))  (prefix caching keeps Mamba state)
    B            = the largest candidate <= cap with need(B) <= budget  (cap: 1,024 on a GPU, 256 on the CPU)

The capacity planner then plans with that B as if the user had set it, keeping at least snapshots(B)
snapshot slots (or SNAPSHOT_BUDGET_SHARE of the budget in slots, if more), so the plan is exactly as safe as
an explicit one and prefix caching keeps Mamba state to reuse. `max_num_tokens` unset becomes
max(DEFAULT_MAX_NUM_TOKENS, B). Pure arithmetic: no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "AUTO_CONTEXT_TOKENS",
    "AUTO_MAX_BATCH_SIZE_CPU",
    "AUTO_MAX_BATCH_SIZE_CUDA",
    "BatchSizing",
    "DEFAULT_MAX_NUM_TOKENS",
    "auto_snapshot_slots",
    "size_batch",
]

AUTO_MAX_BATCH_SIZE_CUDA = 1024  # vLLM's max_num_seqs on large GPUs
AUTO_MAX_BATCH_SIZE_CPU = 256
AUTO_CONTEXT_TOKENS = 2048  # KV room each auto-sized running request is planned with
SNAPSHOT_SHARE = 8  # one Mamba snapshot slot kept per this many running requests ...
MIN_SNAPSHOT_SLOTS = 16  # ... and at least this many, or this share of the budget if that is more:
SNAPSHOT_BUDGET_SHARE = 0.1
DEFAULT_MAX_NUM_TOKENS = 8192


@dataclass(frozen=True)
class BatchSizing:
    """The sizes chosen, and what stopped `max_batch_size` from going higher."""

    max_batch_size: int
    max_num_tokens: int
    min_snapshot_slots: int
    limit: str
    auto_batch: bool
    auto_tokens: bool

    def describe(self) -> str:
        b = f"max_batch_size {self.max_batch_size:,}"
        b += f" (sized from memory: {self.limit})" if self.auto_batch else ""
        t = f"max_num_tokens {self.max_num_tokens:,}" + (" (default)" if self.auto_tokens else "")
        return f"{b}; {t}"


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def auto_snapshot_slots(batch: int, state_bytes: int, enable_block_reuse: bool) -> int:
    """Snapshot slots kept for prefix caching beside `batch` running requests (0 without Mamba state or
    without block reuse)."""
    if state_bytes <= 0 or not enable_block_reuse:
        return 0
    return max(MIN_SNAPSHOT_SLOTS, _ceil_div(batch, SNAPSHOT_SHARE))


def _candidates(cap: int) -> list[int]:
    """Batch sizes tried, largest first: multiples of 64 down from the cap, then 48, 32, 16, 8, 4, 2, 1."""
    big = list(range(cap // 64 * 64, 63, -64))
    small = [b for b in (48, 32, 16, 8, 4, 2, 1) if b < cap]
    return sorted({cap, *big, *small}, reverse=True)


def size_batch(
    *,
    budget_bytes: int,
    kv_bytes_per_token: int,
    state_bytes_per_slot: int,
    max_seq_len: int,
    tokens_per_block: int,
    num_pad_slots: int,
    enable_block_reuse: bool,
    cap: int,
    max_batch_size: int | None,
    max_num_tokens: int | None,
) -> BatchSizing:
    """Fill in whichever of `max_batch_size` / `max_num_tokens` is None (see the module docstring); a value
    the user set is kept as it is (the capacity planner checks it)."""
    auto_tokens = max_num_tokens is None
    if max_batch_size is not None:
        tokens = max(DEFAULT_MAX_NUM_TOKENS, max_batch_size) if max_num_tokens is None else max_num_tokens
        return BatchSizing(max_batch_size, tokens, 0, "set by the user", False, auto_tokens)
    if max_num_tokens is not None:
        cap = min(cap, max_num_tokens)  # a decode step needs one token per running request
    block = kv_bytes_per_token * tokens_per_block
    ctx_blocks = _ceil_div(min(max_seq_len, AUTO_CONTEXT_TOKENS), tokens_per_block)
    floor_blocks = _ceil_div(max_seq_len, tokens_per_block)

    def parts(b: int) -> tuple[int, int]:
        slots = b + num_pad_slots + auto_snapshot_slots(b, state_bytes_per_slot, enable_block_reuse)
        return slots * state_bytes_per_slot, (floor_blocks + b * ctx_blocks) * block

    chosen = next((b for b in _candidates(cap) if sum(parts(b)) <= budget_bytes), None)
    if chosen is None:
        # not even one request: plan with one, and the capacity planner says what does not fit
        chosen, limit = 1, "memory: the planner below says what does not fit"
    elif chosen == cap:
        limit = f"the default cap of {cap:,}" if max_num_tokens is None else f"max_num_tokens {cap:,}"
    else:
        state, kv = parts(chosen)
        limit = (
            f"the Mamba state pool ({state / 2**30:,.1f} GiB for {chosen:,} running requests) and "
            f"their KV ({kv / 2**30:,.1f} GiB) fill the {budget_bytes / 2**30:,.1f} GiB budget"
            if state >= kv
            else f"the KV cache ({kv / 2**30:,.1f} GiB for {chosen:,} requests of {AUTO_CONTEXT_TOKENS:,} "
            f"tokens and one of max_seq_len) and the Mamba state ({state / 2**30:,.1f} GiB) fill the "
            f"{budget_bytes / 2**30:,.1f} GiB budget"
        )
    tokens = max(DEFAULT_MAX_NUM_TOKENS, chosen) if max_num_tokens is None else max_num_tokens
    snaps = auto_snapshot_slots(chosen, state_bytes_per_slot, enable_block_reuse)
    if snaps:  # the planner keeps at least this many: a share of the budget where slots are cheap
        snaps = max(snaps, int(SNAPSHOT_BUDGET_SHARE * budget_bytes) // state_bytes_per_slot)
    return BatchSizing(chosen, tokens, snaps, limit, True, auto_tokens)
