"""Drafting with the checkpoint's multi-token-prediction block (model/nemotron_h/mtp.py).

The block at position t takes the target's final hidden state h_t and token t + 1 and predicts token t + 2;
its attention keeps its own KV (a cache layer after the backbone's), so it must see every position once, with
the true token after it. After each drafting step is read (drafting steps are read at once):

1. **Catch-up.** One MTP pass over each sequence's newly computed positions, from the step's kept hidden
   states: a prefill chunk's positions (next tokens: the prompt's, then the token sampled after it), a
   decode row's position (next: its sample), a verified sequence's input and accepted positions (next: the
   accepted draft tokens and the target's own token after them). The last row's logits give the first draft.
2. **Chain.** k - 1 one-row passes, each from the previous pass's output and the token it drafted, at the
   next position (their KV is rewritten by the next catch-up).

A step that drafts nothing (more requests run than `disable_by_batch_size`) has its catch-up pass alone
launched right after it is sampled (`catch_up_launched`), its samples read on the device: it keeps async
scheduling and its decode graph (which copies out its hidden states), and no draft is kept.

This module plans the passes on rank 0 (which positions, which rows of the kept hidden states, how far each
chain may run); `runner.mtp_draft` runs them (runner/mtp_passes.py), on every rank under tensor parallelism.
Drafts are argmax tokens (one-hot drafts: verification keeps the target's distribution) and are kept for the
context length they continue; `propose` hands them out only while that length is the request's. Draft
quality never changes outputs, only how many drafts are accepted.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq
from hyserve.engine.speculative.verify import SampledRun

# (catch-up sequence j, the context length its draft continues, how many chain passes it runs): the plan
# runner/mtp_passes.py carries out (the same type; the runner's floor is this package's, so it is spelt here)
MTPChain = list[tuple[int, int, int]]
# (the step's sequence i, the token after its last position or -1 for the step's own sample, the sample row)
MTPCatchUp = list[tuple[int, int, int]]

_PARAMS = SamplingParams()


class MTPRunner(Protocol):
    """What the drafter needs of the model runner (under tensor parallelism rank 0's, which has the other
    ranks run the same passes)."""

    tokens_per_block: int
    step_hidden: tuple[torch.Tensor, list[int]] | None

    def mtp_draft(self, batch: ScheduledBatch, firsts: list[int], chain: MTPChain) -> list[list[int]]: ...

    def mtp_catch_up(self, step: ScheduledBatch, plan: MTPCatchUp, samples: torch.Tensor | None) -> None: ...


class MTPDrafter:
    def __init__(self, k: int) -> None:
        self.k = k
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (context length, draft)

    def propose(self, req: Request, k: int) -> list[int]:
        got = self._drafts.get(req.request_id)
        return got[1][:k] if got is not None and got[0] == req.num_tokens else []

    def remove(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

    def after_step(
        self,
        batch: ScheduledBatch,
        runs: list[SampledRun],
        requests: dict[str, Request],
        runner: MTPRunner,
    ) -> None:
        """The MTP passes of a step just read (`runs`: its sampling sequences' results, in batch order)."""
        kept = runner.step_hidden
        if kept is None:
            return
        cu = kept[1]
        by_seq = {id(s): r for s, r in zip([s for s in batch.seqs if s.sample], runs)}
        seqs: list[ScheduledSeq] = []
        firsts: list[int] = []
        chain: MTPChain = []
        cap = runner.tokens_per_block
        for i, s in enumerate(batch.seqs):
            req = requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            got = self._catch_up(s, i, batch, by_seq.get(id(s)), req, cu)
            if got is None:
                continue
            seq, first, ctx = got
            if ctx is not None:  # chain pass p runs at position ctx - 2 + p, inside the request's blocks
                chain.append((len(seqs), ctx, max(0, min(self.k - 1, len(req.block_ids) * cap - ctx + 1))))
            seqs.append(seq)
            firsts.append(first)
        if not seqs:
            runner.step_hidden = None
            return
        drafts = runner.mtp_draft(ScheduledBatch(seqs=seqs, num_decodes=0), firsts, chain)
        for (j, ctx, _), draft in zip(chain, drafts):
            self._drafts[seqs[j].request_id] = (ctx, draft)

    def catch_up_launched(
        self,
        batch: ScheduledBatch,
        samples: torch.Tensor | None,
        requests: dict[str, Request],
        runner: MTPRunner,
    ) -> None:
        """The catch-up pass of a step that drafts nothing, as soon as it is launched: a position whose next
        token is the step's own sample reads it from `samples` (the device samples, one per sampling
        sequence in batch order), so the step is read later, as any other. No draft is kept."""
        if runner.step_hidden is None:
            return
        assert batch.spec_width == 1
        plan: MTPCatchUp = []
        row = -1  # the sample row of the sequence at hand
        for i, s in enumerate(batch.seqs):
            row += s.sample
            req = requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            after = s.start_pos + len(s.token_ids)  # the position after this step's last
            if s.sample:
                plan.append((i, -1, row))
            elif after < req.num_tokens:
                plan.append((i, req.token_slice(after, after + 1)[0], -1))
        if not plan:
            runner.step_hidden = None
            return
        runner.mtp_catch_up(batch, plan, samples)

    def _catch_up(
        self,
        s: ScheduledSeq,
        i: int,
        batch: ScheduledBatch,
        run: SampledRun | None,
        req: Request,
        cu: list[int],
    ) -> tuple[ScheduledSeq, int, int | None] | None:
        """The catch-up sequence of batch sequence i (None: nothing to do), the first of the step's hidden
        rows it reads, and the context length its draft continues (None: the request does not sample yet)."""
        q = batch.spec_width
        if i < batch.num_decodes:  # a decode row, or a verified sequence's q rows: its accepted positions
            if run is None:
                return None
            first = i * q
            nxt = list(run.tokens[: run.accepted + 1])
        else:  # a prefill chunk: its positions; the token after its last, from the prompt or its sample
            first = cu[i + (q - 1) * batch.num_decodes]
            after = s.start_pos + len(s.token_ids)
            if run is not None:
                tail = list(run.tokens[:1])
            elif after < req.num_tokens:
                tail = req.token_slice(after, after + 1)
            else:
                return None
            nxt = list(s.token_ids[1:]) + tail
        # the context length once this step's tokens are appended (its draft's first token goes there)
        context = s.start_pos + len(nxt) + 1 if run is not None else None
        return _mtp_seq(req, nxt, s.start_pos), first, context


def _mtp_seq(req: Request, tokens: list[int], start: int) -> ScheduledSeq:
    """An MTP pass over `tokens` (each the token after its position) from position `start` of `req`, in the
    request's blocks; the block has no Mamba layer, so the state slots are never read."""
    slot = req.live_slot if req.live_slot is not None else 0
    return ScheduledSeq(
        request_id=req.request_id,
        token_ids=tokens,
        start_pos=start,
        block_ids=list(req.block_ids),
        state_src=slot,
        state_dst=slot,
        sample=True,
        snapshots=[],
        params=_PARAMS,
        num_output_tokens=0,
    )
