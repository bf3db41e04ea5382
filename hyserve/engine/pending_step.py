"""A step's samples on their way to the host: drawn on the device, copied into pinned memory without
waiting, read when the engine gets to them (at once, or one step later with async scheduling)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.engine.host_tensors import to_device
from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.request import Request
from hyserve.engine.sampling.logits_processing import History
from hyserve.engine.sampling.sampler import PendingLogprobs, Sampler
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq


@dataclass
class PendingStep:
    batch: ScheduledBatch
    sampling: list[ScheduledSeq]  # the batch's sequences that sample, in logits-row order
    reqs: list[Request | None]  # each row's request when launched (an id may be reused once it finished)
    tokens: torch.Tensor  # [rows] long, on the device
    host: torch.Tensor  # their host copy (pinned on CUDA, filled without waiting)
    logprobs: PendingLogprobs | None  # the rows that want logprobs: their table, copied likewise
    logprobs_host: torch.Tensor | None
    done: torch.cuda.Event | None  # recorded after the copies (CUDA)

    def read(self) -> list[tuple[Request | None, int, TokenLogprob | None]]:
        """Wait for the copies; (request, token, logprob entry) per sampling row."""
        if self.done is not None:
            self.done.synchronize()
        tokens = [int(t) for t in self.host.tolist()]
        lps: list[TokenLogprob | None] = [None] * len(tokens)
        if self.logprobs is not None and self.logprobs_host is not None:
            lps = self.logprobs.entries(tokens, self.logprobs_host.tolist())
        return list(zip(self.reqs, tokens, lps))


def penalty_inputs(
    sampling: list[ScheduledSeq], requests: dict[str, Request], prev: PendingStep | None
) -> tuple[list[History | None] | None, torch.Tensor | None]:
    """Penalties: the prompt and output ids each sampling row has seen (host lists, None for a row without
    penalties), and with a step in flight (`prev`) each row's token still on the device, -1 where none,
    counted in its history. (None, None) when no row has penalties."""
    if not any(s.params.needs_history for s in sampling):
        return None, None
    histories: list[History | None] = []
    for s in sampling:
        req = requests.get(s.request_id)
        histories.append(
            (req.prompt_token_ids, req.output_token_ids)
            if req is not None and s.params.needs_history
            else None
        )
    if prev is None:
        return histories, None
    pending = torch.full((len(sampling),), -1, dtype=torch.long, device=prev.tokens.device)
    fed = [(i, s.feed_row) for i, s in enumerate(sampling) if s.feed_row is not None]
    if fed:
        idx = to_device(torch.tensor([i for i, _ in fed], dtype=torch.long), prev.tokens.device)
        rows = to_device(torch.tensor([r for _, r in fed], dtype=torch.long), prev.tokens.device)
        pending[idx] = prev.tokens.index_select(0, rows)
    return histories, pending


def sample_step(
    sampler: Sampler,
    batch: ScheduledBatch,
    logits: torch.Tensor,
    requests: dict[str, Request],
    histories: list[History | None] | None,
    pending: torch.Tensor | None,
    bitmask: torch.Tensor | None = None,
) -> PendingStep:
    """Sample `batch`'s sampling rows (and their logprobs) on the device and start the copies to the host;
    nothing here waits for the device. `histories` / `pending`: the penalty rows' host history and the
    token of each row still on the device; `bitmask`: the structured-outputs mask
    (`Sampler.sample_tokens`)."""
    sampling = [s for s in batch.seqs if s.sample]
    params = [s.params for s in sampling]
    tokens = sampler.sample_tokens(
        logits, params, [s.num_output_tokens for s in sampling], histories, pending, bitmask
    )
    lp = sampler.pending_logprobs(logits, tokens, params)
    reqs = [requests.get(s.request_id) for s in sampling]
    if not tokens.is_cuda:
        return PendingStep(
            batch, sampling, reqs, tokens, tokens, lp, lp.table if lp is not None else None, None
        )
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    lp_host = None
    if lp is not None:
        lp_host = torch.empty(lp.table.shape, dtype=lp.table.dtype, pin_memory=True)
        lp_host.copy_(lp.table, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tokens.device))
    return PendingStep(batch, sampling, reqs, tokens, host, lp, lp_host, done)
