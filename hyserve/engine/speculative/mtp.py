"""Drafting with the checkpoint's multi-token-prediction block (model/nemotron_h/mtp.py).

The block at position t takes the target's final hidden state h_t and token t + 1 and predicts token t + 2;
its attention keeps its own KV (a cache layer after the backbone's), so it must see every position once, with
the true token after it. After each step is read (every step is read at once when MTP drafts):

1. **Catch-up.** One MTP pass over each sequence's newly computed positions, from the step's kept hidden
   states: a prefill chunk's positions (next tokens: the prompt's, then the token sampled after it), a
   decode row's position (next: its sample), a verified sequence's input and accepted positions (next: the
   accepted draft tokens and the target's own token after them). The last row's logits give the first draft.
2. **Chain.** k - 1 one-row passes, each from the previous pass's output and the token it drafted, at the
   next position (their KV is rewritten by the next catch-up).

Drafts are argmax tokens (one-hot drafts: verification keeps the target's distribution) and are kept for the
context length they continue; `propose` hands them out only while that length is the request's. Draft
quality never changes outputs, only how many drafts are accepted.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq
from hyserve.engine.speculative.verify import SampledRun

_PARAMS = SamplingParams()


class MTPRunner(Protocol):
    """What the drafter needs of the model runner."""

    model: Any
    cache: Any
    tokens_per_block: int
    step_hidden: tuple[torch.Tensor, list[int]] | None

    def build_meta(self, batch: ScheduledBatch) -> tuple[torch.Tensor, Any]: ...


class MTPDrafter:
    def __init__(self, runner: MTPRunner, k: int) -> None:
        self.runner = runner
        self.k = k
        self._drafts: dict[str, tuple[int, list[int]]] = {}  # request id -> (context length, draft)

    def propose(self, req: Request, k: int) -> list[int]:
        got = self._drafts.get(req.request_id)
        return got[1][:k] if got is not None and got[0] == req.num_tokens else []

    def remove(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)

    @torch.inference_mode()
    def after_step(self, batch: ScheduledBatch, runs: list[SampledRun], requests: dict[str, Request]) -> None:
        """The MTP passes of a step just read (`runs`: its sampling sequences' results, in batch order)."""
        kept = self.runner.step_hidden
        if kept is None:
            return
        hidden, cu = kept
        self.runner.step_hidden = None
        by_seq = {id(s): r for s, r in zip([s for s in batch.seqs if s.sample], runs)}
        seqs, rows, owners = [], [], []
        for i, s in enumerate(batch.seqs):
            req = requests.get(s.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            got = self._catch_up(s, i, batch, by_seq.get(id(s)), req, cu)
            if got is not None:
                seq, first, ctx = got
                seqs.append(seq)
                rows.append(torch.arange(first, first + len(seq.token_ids), device=hidden.device))
                owners.append((req, ctx))
        if not seqs:
            return
        model = self.runner.model
        ids, meta = self.runner.build_meta(ScheduledBatch(seqs=seqs, num_decodes=0))
        out = model.mtp_forward(ids, hidden[torch.cat(rows)], meta, self.runner.cache)
        last = out[meta.logits_indices]
        drafts = [[t] for t in model.compute_logits(last).argmax(-1).tolist()]
        self._chain(owners, last, drafts)

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

    def _chain(
        self, owners: list[tuple[Request, int | None]], hidden: torch.Tensor, drafts: list[list[int]]
    ) -> None:
        """k - 1 more one-row passes for the sequences that keep a draft; store the drafts."""
        keep = [(j, req, ctx) for j, (req, ctx) in enumerate(owners) if ctx is not None]
        bs = self.runner.tokens_per_block
        live = keep
        for step in range(1, self.k):
            # pass `step` runs at position ctx - 2 + step: covered by the request's blocks, or the draft stops
            live = [(j, req, ctx) for j, req, ctx in live if ctx + step - 2 < len(req.block_ids) * bs]
            if not live:
                break
            seqs = [_mtp_seq(req, [drafts[j][-1]], ctx + step - 2) for j, req, ctx in live]
            ids, meta = self.runner.build_meta(ScheduledBatch(seqs=seqs, num_decodes=len(seqs)))
            idx = torch.tensor([j for j, _, _ in live], device=hidden.device)
            out = self.runner.model.mtp_forward(ids, hidden.index_select(0, idx), meta, self.runner.cache)
            hidden = hidden.index_copy(0, idx, out)
            for (j, _, _), t in zip(live, self.runner.model.compute_logits(out).argmax(-1).tolist()):
                drafts[j].append(t)
        for j, req, ctx in keep:
            self._drafts[req.request_id] = (ctx, drafts[j])


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
