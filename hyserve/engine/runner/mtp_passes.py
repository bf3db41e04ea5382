"""The MTP block's passes over one step's positions, as every rank runs them (`ModelRunner.mtp_draft`;
`speculative/mtp.py` plans them on rank 0, and under tensor parallelism the other ranks get the same plan).

1. **Catch-up**: one pass over `batch` (a sequence per drafting request: its newly computed positions, each
   with the token after it), reading the step's kept hidden states from row `firsts[j]` on for sequence j.
   The last row of each sequence gives its first draft token. A step that drafts nothing runs this pass
   alone (`mtp_catch_up`) as soon as it is sampled: the tokens after its positions that are its own samples
   are taken from the device samples, so the step need not be read first.
2. **Chain**: for each `chain` entry (j, ctx, n), n more one-row passes at positions ctx - 1, ctx, ..., each
   from the previous pass's output and the token it drafted, in sequence j's blocks.

Every pass is the same collectives on every rank (the block's attention and MoE, and the vocabulary-parallel
lm_head), and the drafts are argmax tokens of logits every rank holds whole, so every rank drafts the same
tokens and writes the same MTP KV.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hyserve.engine.host_tensors import int_tensor, to_device
from hyserve.engine.scheduler.scheduler import ScheduledBatch

# (catch-up sequence j, the context length its draft continues, how many chain passes it runs)
MTPChain = list[tuple[int, int, int]]


# a catch-up at launch: (the step's sequence i, the token after its last position, or -1 where that token is
# the step's own sample, with the sample row)
MTPCatchUp = list[tuple[int, int, int]]


def _catch_up(
    runner: Any, hidden: torch.Tensor, batch: ScheduledBatch, firsts: list[int], ids: torch.Tensor, meta: Any
) -> torch.Tensor:
    rows = [i for f, s in zip(firsts, batch.seqs) for i in range(f, f + len(s.token_ids))]
    return runner.model.mtp_forward(
        ids, hidden[to_device(int_tensor(rows), hidden.device)], meta, runner.cache
    )


def mtp_catch_up(
    runner: Any,
    hidden: torch.Tensor,
    cu: list[int],
    step: ScheduledBatch,
    plan: MTPCatchUp,
    samples: torch.Tensor | None,
) -> None:
    """The catch-up pass alone over the step just launched (`step`, whose hidden states and cu_seqlens these
    are): its KV writes are what it is for. Each planned sequence's positions take the tokens after them,
    its own next tokens then the planned last one, read from `samples` where that is the step's sample."""
    seqs, firsts, from_samples = [], [], []
    for i, tail, row in plan:
        s = step.seqs[i]
        nxt = [*s.token_ids[1:], max(tail, 0)]
        seqs.append(
            dataclasses.replace(s, token_ids=nxt, sample=False, snapshots=[], draft=[], feed_row=None)
        )
        firsts.append(cu[i])
        from_samples += [-1] * (len(nxt) - 1) + [row if tail < 0 else -1]
    batch = ScheduledBatch(seqs=seqs, num_decodes=sum(i < step.num_decodes for i, _, _ in plan))
    ids, meta = runner.build_meta(batch)
    if samples is not None and max(from_samples) >= 0:
        r = to_device(int_tensor(from_samples), ids.device)
        ids = torch.where(r >= 0, samples.index_select(0, r.clamp(min=0)), ids)
    _catch_up(runner, hidden, batch, firsts, ids, meta)


def mtp_passes(
    runner: Any, hidden: torch.Tensor, batch: ScheduledBatch, firsts: list[int], chain: MTPChain
) -> list[list[int]]:
    """The drafts of the `chain` entries, in their order (`runner`: the model, cache and build_meta)."""
    model = runner.model
    ids, meta = runner.build_meta(batch)
    last = _catch_up(runner, hidden, batch, firsts, ids, meta)[meta.logits_indices]
    drafts = [[t] for t in model.compute_logits(last).argmax(-1).tolist()]
    live = list(chain)
    for step in range(1, max((n for _, _, n in chain), default=0) + 1):
        live = [(j, ctx, n) for j, ctx, n in live if n >= step]
        seqs = [
            dataclasses.replace(batch.seqs[j], token_ids=[drafts[j][-1]], start_pos=ctx + step - 2)
            for j, ctx, _ in live
        ]
        ids, meta = runner.build_meta(ScheduledBatch(seqs=seqs, num_decodes=len(seqs)))
        idx = to_device(int_tensor([j for j, _, _ in live]), last.device)
        step_out = model.mtp_forward(ids, last.index_select(0, idx), meta, runner.cache)
        last = last.index_copy(0, idx, step_out)
        for (j, _, _), t in zip(live, model.compute_logits(step_out).argmax(-1).tolist()):
            drafts[j].append(t)
    return [drafts[j] for j, _, _ in chain]
