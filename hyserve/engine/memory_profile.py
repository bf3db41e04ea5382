"""Profiled activation memory: run the largest steps the scheduler can build on a throwaway cache and
read the CUDA allocator's peak, so the cache budget leaves exactly that much room.

    budget for pools = free_gpu_memory_fraction * free (after weights) - prefill peak - decode peak

The prefill peak is the larger of two `max_num_tokens` steps: one long sequence (the widest Mamba scan
and attention rows) and `max_batch_size` sequences sharing the tokens (the most logits rows). The
decode peak is one decode step of `graph_batch_size` sequences, which is what a captured CUDA graph
keeps in its private memory pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.engine.runner import ModelRunner
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler import ScheduledBatch, ScheduledSeq
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.nemotron_h import NemotronHForCausalLM


@dataclass(frozen=True)
class ActivationProfile:
    prefill_peak_bytes: int
    decode_peak_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.prefill_peak_bytes + self.decode_peak_bytes


def _seq(tokens: list[int], blocks: list[int], slot: int) -> ScheduledSeq:
    return ScheduledSeq(
        request_id="profile", token_ids=tokens, start_pos=0, block_ids=blocks, state_src=None, state_dst=slot,
        sample=True, snapshots=[], params=SamplingParams(), num_output_tokens=0,
    )


def _split(n: int, parts: int) -> list[int]:
    parts = max(1, min(parts, n))
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def profile_activations(
    model: NemotronHForCausalLM,
    device: torch.device,
    *,
    max_num_tokens: int,
    max_batch_size: int,
    graph_batch_size: int,
    tokens_per_block: int,
) -> ActivationProfile:
    """Peak bytes allocated above the baseline by the largest prefill and decode steps (CUDA only)."""
    cfg = model.config
    bs = tokens_per_block
    blocks_needed = -(-max_num_tokens // bs) + max_batch_size
    cache = CacheTensors.allocate(cfg, num_blocks=blocks_needed, tokens_per_block=bs, num_slots=2, device=device)
    runner = ModelRunner(model, cache, device)

    def peak(runner: ModelRunner, batch: ScheduledBatch) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        logits = runner.execute(batch)
        torch.cuda.synchronize(device)
        del logits
        return torch.cuda.max_memory_allocated(device) - base

    prefill = 0
    for parts in sorted({1, max_batch_size}):
        seqs, next_block = [], 0
        for n in _split(max_num_tokens, parts):
            nb = -(-n // bs)
            seqs.append(_seq([1] * n, list(range(next_block, next_block + nb)), slot=1))
            next_block += nb
        prefill = max(prefill, peak(runner, ScheduledBatch(seqs=seqs, num_decodes=0)))
    decode = peak(runner, ScheduledBatch(seqs=[_seq([1], [0], slot=1) for _ in range(graph_batch_size)],
                                 num_decodes=graph_batch_size))
    del runner, cache
    torch.cuda.empty_cache()
    return ActivationProfile(prefill_peak_bytes=prefill, decode_peak_bytes=decode)
