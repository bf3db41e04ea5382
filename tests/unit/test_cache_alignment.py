"""Where a prefill chunk may end (`hyserve/cache/alignment.py`): exact cases, a property over random
boundaries, and the cache manager asking it with its own snapshot boundaries."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hyserve.cache.alignment import ChunkSpan, chunk_span, ssd_aligned_length
from hyserve.cache.capacity import CapacityInputs, plan_capacity
from hyserve.cache.manager import HybridCacheManager


def test_a_boundary_the_scan_cannot_produce_mid_chunk_ends_the_chunk() -> None:
    # the module's diagram: 256 is two SSD chunks in (produced), 300 is not, so the chunk ends at 300
    assert chunk_span(0, 400, chunk_size=128, boundaries=[256, 300]) == ChunkSpan(300, [256, 300])
    # from an unaligned start the scan's states are at start + k * chunk_size: 64 + 128 = 192, not 256
    assert chunk_span(64, 400, chunk_size=128, boundaries=[256, 300]) == ChunkSpan(192, [256])


def test_boundaries_at_the_end_or_outside_the_chunk_do_not_cut_it() -> None:
    assert chunk_span(0, 300, chunk_size=128, boundaries=[300]) == ChunkSpan(300, [300])  # the chunk's end
    assert chunk_span(100, 50, chunk_size=16, boundaries=[64, 100, 151, 160]) == ChunkSpan(50, [])
    assert chunk_span(0, 40, chunk_size=16, boundaries=[]) == ChunkSpan(40, [])
    assert chunk_span(8, 40, chunk_size=16, boundaries=[24, 40]) == ChunkSpan(40, [24, 40])


def test_a_chunk_cut_for_time_ends_on_an_ssd_chunk_boundary() -> None:
    assert ssd_aligned_length(0, 300, 128) == 256
    assert ssd_aligned_length(64, 100, 128) == 64  # up to 128, the first SSD chunk boundary past 64
    assert ssd_aligned_length(130, 100, 128) == 100  # no boundary in (130, 230]: the length as asked
    assert ssd_aligned_length(256, 128, 128) == 128


@given(
    start=st.integers(0, 200),
    max_tokens=st.integers(1, 200),
    chunk_size=st.sampled_from([1, 4, 8, 16]),
    boundaries=st.lists(st.integers(1, 420), max_size=12, unique=True).map(sorted),
)
def test_the_span_is_the_longest_chunk_whose_snapshots_the_scan_produces(
    start: int, max_tokens: int, chunk_size: int, boundaries: list[int]
) -> None:
    span = chunk_span(start, max_tokens, chunk_size=chunk_size, boundaries=boundaries)
    end = start + span.num_tokens
    assert 1 <= span.num_tokens <= max_tokens
    assert span.snapshots == [b for b in boundaries if start < b <= end]  # every boundary covered is taken
    assert all((b - start) % chunk_size == 0 or b == end for b in span.snapshots)  # ... and producible
    if span.num_tokens < max_tokens:  # cut short only at an unaligned boundary
        assert end in boundaries and (end - start) % chunk_size != 0


@given(start=st.integers(0, 500), num_tokens=st.integers(1, 500), chunk_size=st.sampled_from([4, 8, 128]))
def test_an_ssd_aligned_cut_never_grows_and_ends_aligned_where_it_can(
    start: int, num_tokens: int, chunk_size: int
) -> None:
    n = ssd_aligned_length(start, num_tokens, chunk_size)
    assert 1 <= n <= num_tokens
    if (start + num_tokens) // chunk_size * chunk_size > start:
        assert (start + n) % chunk_size == 0 and num_tokens - n < chunk_size
    else:
        assert n == num_tokens


def _manager(*, interval: int | None, offsets: tuple[int, ...], reuse: bool = True) -> HybridCacheManager:
    inp = CapacityInputs(
        budget_bytes=64 * 4 * 8 + 6 * 100,
        kv_bytes_per_token=8,
        state_bytes_per_slot=100,
        max_batch_size=2,
        max_seq_len=200,
        max_num_tokens=64,
        tokens_per_block=4,
        enable_block_reuse=reuse,
        periodic_snapshot_interval=interval,
        num_snapshot_offsets=len(offsets),
        avg_seq_len=16,
        num_pad_slots=0,
        allow_oversized_max_seq_len=True,
    )
    return HybridCacheManager(
        plan_capacity(inp),
        has_mamba=True,
        enable_block_reuse=reuse,
        snapshot_interval=interval,
        snapshot_offsets_from_end=offsets,
    )


def test_the_manager_answers_with_its_snapshot_boundaries() -> None:
    cache = _manager(interval=8, offsets=(0, 3))
    # a 30-token prompt: boundaries 8, 16, 24 (interval) and 24, 28 (offsets 3 and 0, to whole blocks)
    assert cache.snapshot_boundaries(30) == [8, 16, 24, 28]
    assert cache.chunk_span(0, 30, prompt_len=30, chunk_size=16) == ChunkSpan(8, [8])
    assert cache.chunk_span(8, 22, prompt_len=30, chunk_size=8) == ChunkSpan(20, [16, 24, 28])
    assert cache.chunk_span(24, 6, prompt_len=30, chunk_size=16) == ChunkSpan(4, [28])
    assert cache.chunk_span(28, 2, prompt_len=30, chunk_size=16) == ChunkSpan(2, [])
    no_reuse = _manager(interval=8, offsets=(0,), reuse=False)  # no prefix cache: no snapshots to align to
    assert no_reuse.chunk_span(0, 30, prompt_len=30, chunk_size=16) == ChunkSpan(30, [])
