"""Where a prefill chunk may end: the alignment rules of the hybrid cache.

A Mamba snapshot can only be taken where the SSD scan returns a state. The scan of one chunk returns the
state every `chunk_size` tokens into the chunk and at the chunk's end, nothing between. So a chunk that
covers a snapshot boundary (`HybridCacheManager.snapshot_boundaries`) it cannot produce is cut there, and
the boundary becomes the chunk's end:

    tokens into the chunk:  0          128         256    300
                            |-- 128 ---|-- 128 ----|- 44 -|...     chunk_size 128
    snapshot boundaries:                           ^      ^ (prompt end - offset: not a multiple of 128)
    256 is produced mid-chunk; 300 is not, so the chunk ends at 300 and the next one starts there.

A chunk cut short for time (the step cost model) ends on an SSD chunk boundary, an absolute multiple of
`chunk_size`, where one lies past its start, so the next chunk starts aligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSpan:
    num_tokens: int  # the chunk feeds positions [start, start + num_tokens)
    snapshots: list[int]  # absolute positions in (start, start + num_tokens] whose state it snapshots


def chunk_span(start: int, max_tokens: int, *, chunk_size: int, boundaries: Sequence[int]) -> ChunkSpan:
    """The longest chunk from `start` of at most `max_tokens` tokens that ends at or before the first
    snapshot boundary the scan cannot produce mid-chunk, and the boundaries (ascending) it writes."""
    n = max_tokens
    snapshots: list[int] = []
    for b in boundaries:
        if b <= start:
            continue
        if b > start + n:
            break
        snapshots.append(b)
        if (b - start) % chunk_size != 0 and b != start + n:
            n = b - start
            break
    return ChunkSpan(n, snapshots)


def ssd_aligned_length(start: int, num_tokens: int, chunk_size: int) -> int:
    """The length of a chunk from `start` cut short to at most `num_tokens` tokens: up to the last SSD chunk
    boundary (a multiple of `chunk_size`) past `start`, else `num_tokens` itself."""
    aligned = (start + num_tokens) // chunk_size * chunk_size - start
    return aligned if aligned > 0 else num_tokens
