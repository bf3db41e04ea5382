"""Profiled activation memory: run the largest steps the scheduler can build on a throwaway cache and
read the CUDA allocator's peak, so the cache budget leaves exactly that much room.

    budget for pools = free_gpu_memory_fraction * free (after weights) - prefill peak - decode peak

The prefill peak is the larger of two `max_num_tokens` steps: one long sequence (the widest Mamba scan
and attention rows; it also writes prefix-cache snapshots, so the scan's per-chunk states are counted)
and `max_batch_size` sequences sharing the tokens (the most logits rows). The
decode peak is one decode step of `graph_batch_size` sequences, which is what a captured CUDA graph
keeps in its private memory pool. With piecewise graphs (`mixed_tokens`) the pool also holds a padded
forward of that many tokens, and their static buffers sit beside it: the mixed peak is building them (one
such forward) on the throwaway cache. The pool holds the larger of the two graph peaks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from hyserve.engine.runner.mixed_graphs import MixedGraphs
from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq, standalone_prefill
from hyserve.model.protocol import CausalLM


@dataclass(frozen=True)
class ActivationProfile:
    prefill_peak_bytes: int
    decode_peak_bytes: int
    mixed_peak_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.prefill_peak_bytes + max(self.decode_peak_bytes, self.mixed_peak_bytes)


def _seq(
    tokens: list[int], blocks: list[int], slot: int, snapshots: list[tuple[int, int]] | None = None
) -> ScheduledSeq:
    return ScheduledSeq(
        request_id="profile",
        token_ids=tokens,
        start_pos=0,
        block_ids=blocks,
        state_src=None,
        state_dst=slot,
        sample=True,
        snapshots=snapshots or [],
        params=SamplingParams(),
        num_output_tokens=0,
    )


def _split(n: int, parts: int) -> list[int]:
    parts = max(1, min(parts, n))
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def profile_activations(
    model: CausalLM,
    device: torch.device,
    *,
    max_num_tokens: int,
    max_batch_size: int,
    graph_batch_size: int,
    tokens_per_block: int,
    mixed_tokens: int = 0,
) -> ActivationProfile:
    """Peak bytes allocated above the baseline by the largest prefill and decode steps, and by building
    piecewise graph buffers for `mixed_tokens` tokens (0: none) (CUDA only)."""
    cfg = model.config
    bs = tokens_per_block
    blocks_needed = -(-max_num_tokens // bs) + max_batch_size
    cache = model.allocate_cache(num_blocks=blocks_needed, tokens_per_block=bs, num_slots=3, device=device)
    runner = ModelRunner(model, cache, device)

    def peak(fn: Callable[[], object]) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        del out
        return torch.cuda.max_memory_allocated(device) - base

    prefill_batches, decode_batch = profile_batches(
        cfg.chunk_size,
        max_num_tokens=max_num_tokens,
        max_batch_size=max_batch_size,
        graph_batch_size=graph_batch_size,
        tokens_per_block=bs,
    )
    prefill = max(peak(partial(runner.execute, b)) for b in prefill_batches)
    decode = peak(partial(runner.execute, decode_batch))
    mixed = 0
    if mixed_tokens:
        build = partial(MixedGraphs, model, cache, device, sizes=[mixed_tokens], pad_slot=2, capture=False)
        mixed = peak(build)
    del runner, cache
    torch.cuda.empty_cache()
    return ActivationProfile(prefill_peak_bytes=prefill, decode_peak_bytes=decode, mixed_peak_bytes=mixed)


def profile_batches(
    chunk_size: int, *, max_num_tokens: int, max_batch_size: int, graph_batch_size: int, tokens_per_block: int
) -> tuple[list[ScheduledBatch], ScheduledBatch]:
    """The steps to profile, on a cache of 3 state slots (1 live, 0 and 2 for snapshots): one sequence of
    `max_num_tokens` that also writes prefix-cache snapshots (at its last chunk boundary and at its end,
    so the scan keeps its per-chunk states, as a step with snapshots does), `max_batch_size` sequences
    sharing the tokens, and a decode step of `graph_batch_size` sequences."""
    batches = []
    for parts in sorted({1, max_batch_size}):
        lengths = _split(max_num_tokens, parts)
        snaps = None
        if parts == 1:
            boundary = (lengths[0] - 1) // chunk_size * chunk_size
            snaps = [([(boundary, 0)] if boundary > 0 else []) + [(lengths[0], 2)]]
        batches.append(
            standalone_prefill(
                [[1] * n for n in lengths],
                tokens_per_block=tokens_per_block,
                request_id="profile",
                slots=[1] * len(lengths),
                params=SamplingParams(),
                snapshots=snaps,
            )
        )
    decode = ScheduledBatch(
        seqs=[_seq([1], [0], slot=1) for _ in range(graph_batch_size)], num_decodes=graph_batch_size
    )
    return batches, decode
