"""A step's block tables and KV write positions, built on the device from what the host sends ragged:
each row's block ids end to end with a count per row, and a start position per row (bs = tokens_per_block):

    tables[r, j] = block j of row r's sequence                  (j < counts[r]; the rest left as they were)
    token t of row r (cu[r] <= t < cu[r + 1]) sits at position p = starts[r] + t - cu[r]
    slot_mapping[t] = tables[r, p // bs] * bs + p % bs,         or -1 where row r writes no KV

The host work is then one int per block and a few per row. Padding every table to the longest one on the
host cost one int per (row, longest table) cell: 1,024 decodes beside one 800k-token sequence are 12.8M
ints a step; and the per-token positions of an 8,192-token prefill chunk cost about 2 ms. The `_ref`
functions are the host loops these replace."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def fill_block_tables(out: torch.Tensor, block_ids: torch.Tensor, counts: torch.Tensor) -> None:
    """out [rows >= len(counts), width]: row r's first counts[r] columns := its ids from `block_ids` (every
    row's ids end to end). Columns past a row's count keep what they held (attention reads a table only
    up to its sequence's length). No host synchronisation."""
    n = block_ids.numel()
    if n == 0:
        return
    dev = out.device
    row = torch.repeat_interleave(torch.arange(counts.numel(), device=dev), counts, output_size=n)
    first = torch.cumsum(counts, 0) - counts  # each row's offset into block_ids
    col = torch.arange(n, device=dev) - first[row]
    out.index_put_((row, col), block_ids.to(out.dtype))


def slot_mapping(
    tables: torch.Tensor,
    cu_seqlens: torch.Tensor,
    starts: torch.Tensor,
    writes: torch.Tensor,
    tokens_per_block: int,
    num_tokens: int,
) -> torch.Tensor:
    """tables [rows, width] block tables, cu_seqlens [rows + 1], starts [rows] (tokens already cached per
    row), writes [rows] bool -> int64 [num_tokens]. No host synchronisation."""
    dev = tables.device
    if num_tokens == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    cu = cu_seqlens.long()
    rows = torch.arange(cu.numel() - 1, device=dev)
    row = torch.repeat_interleave(rows, cu[1:] - cu[:-1], output_size=num_tokens)
    pos = torch.arange(num_tokens, device=dev) - cu[row] + starts[row]
    # a row that writes no KV (a verified draft position past its sequence's blocks) may point past its
    # table: clamp the column, the result is discarded anyway
    col = (pos // tokens_per_block).clamp(max=tables.shape[1] - 1)
    slot = tables[row, col].long() * tokens_per_block + pos % tokens_per_block
    return torch.where(writes[row], slot, torch.full_like(slot, -1))


def block_tables_ref(block_ids: Sequence[Sequence[int]], width: int) -> list[list[int]]:
    """Each row's block ids, zero-padded to `width`."""
    return [list(b) + [0] * (width - len(b)) for b in block_ids]


def slot_mapping_ref(
    block_ids: Sequence[Sequence[int]],
    lens: Sequence[int],
    starts: Sequence[int],
    writes: Sequence[bool],
    tokens_per_block: int,
) -> list[int]:
    """`slot_mapping`, one token at a time from each row's block ids."""
    bs = tokens_per_block
    out: list[int] = []
    for blocks, n, start, w in zip(block_ids, lens, starts, writes):
        out.extend(blocks[p // bs] * bs + p % bs if w else -1 for p in range(start, start + n))
    return out
