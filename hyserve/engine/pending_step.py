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
from hyserve.engine.sampling.structured_output import StructuredOutputs
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq
from hyserve.engine.speculative.verify import SampledRun, sampling_rows, verified_run


@dataclass
class PendingStep:
    batch: ScheduledBatch
    sampling: list[ScheduledSeq]  # the batch's sequences that sample, in logits-row order
    reqs: list[Request | None]  # each sequence's request when launched (an id may be reused once it finished)
    tokens: torch.Tensor  # [rows] long, on the device
    host: torch.Tensor  # their host copy (pinned on CUDA, filled without waiting)
    logprobs: PendingLogprobs | None  # the rows that want logprobs: their table, copied likewise
    logprobs_host: torch.Tensor | None
    done: torch.cuda.Event | None  # recorded after the copies (CUDA)
    # rows per sampling sequence: 1, or a speculative step's decode width for its decoding sequences
    widths: list[int] | None = None
    # MTP: the block's catch-up pass over this step already ran when it was launched (speculation.on_launch)
    mtp_caught_up: bool = False

    def hold(self) -> None:
        """Each request of the step has one more step in flight, at its row here."""
        for i, req in enumerate(self.reqs):
            if req is not None:
                req.num_inflight += 1
                req.inflight_row = i

    def read(self) -> list[SampledRun]:
        """Wait for the copies; what each sampling sequence produced, in order."""
        if self.done is not None:
            self.done.synchronize()
        tokens = [int(t) for t in self.host.tolist()]
        lps: list[TokenLogprob | None] = [None] * len(tokens)
        if self.logprobs is not None and self.logprobs_host is not None:
            lps = self.logprobs.entries(tokens, self.logprobs_host.tolist())
        if self.widths is None:
            return [SampledRun(r, (t,), (lp,)) for r, t, lp in zip(self.reqs, tokens, lps)]
        out, row = [], 0
        for req, seq, w in zip(self.reqs, self.sampling, self.widths):
            out.append(verified_run(req, seq.draft, tokens[row : row + w], lps[row : row + w]))
            row += w
        return out


def penalty_inputs(
    rows: list[tuple[ScheduledSeq, int]], requests: dict[str, Request], prev: PendingStep | None
) -> tuple[list[History | None] | None, torch.Tensor | None]:
    """Penalties, per sampling row (`sampling_rows`): the prompt and output ids the row has seen (host
    lists, None for a row without penalties; a speculative row at position j has also seen the first j
    draft tokens), and with a step in flight (`prev`) each row's token still on the device, -1 where none,
    counted in its history. (None, None) when no row has penalties."""
    if not any(s.params.needs_history for s, _ in rows):
        return None, None
    histories: list[History | None] = []
    for s, j in rows:
        req = requests.get(s.request_id)
        if req is None or not s.params.needs_history:
            histories.append(None)
        else:
            histories.append(
                (req.prompt_token_ids, req.output_token_ids + s.draft[:j] if j else req.output_token_ids)
            )
    if prev is None:
        return histories, None
    pending = torch.full((len(rows),), -1, dtype=torch.long, device=prev.tokens.device)
    fed = [(i, s.feed_row) for i, (s, _) in enumerate(rows) if s.feed_row is not None]
    if fed:
        idx = to_device(torch.tensor([i for i, _ in fed], dtype=torch.long), prev.tokens.device)
        src = to_device(torch.tensor([r for _, r in fed], dtype=torch.long), prev.tokens.device)
        pending[idx] = prev.tokens.index_select(0, src)
    return histories, pending


def grammar_masks(
    structured: StructuredOutputs, rows: list[tuple[ScheduledSeq, int]], speculative: bool
) -> torch.Tensor | None:
    """The structured-outputs bitmask of the sampling rows (`sampling_rows`); in a `speculative` step a row
    at position j is masked as its grammar stands after the first j draft tokens."""
    drafts = [s.draft[:j] for s, j in rows] if speculative else None
    return structured.fill_bitmask([s.request_id for s, _ in rows], drafts)


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
    (`Sampler.sample_tokens`). A speculative step samples every verified position (`sampling_rows`)."""
    sampling, rows = sampling_rows(batch)
    params = [s.params for s, _ in rows]
    tokens = sampler.sample_tokens(
        logits, params, [s.num_output_tokens + j for s, j in rows], histories, pending, bitmask
    )
    lp = sampler.pending_logprobs(logits, tokens, params)
    reqs = [requests.get(s.request_id) for s in sampling]
    widths = None
    if batch.spec_width > 1:
        widths = [
            batch.spec_width if i < batch.num_decodes else 1 for i, s in enumerate(batch.seqs) if s.sample
        ]
    if not tokens.is_cuda:
        return PendingStep(
            batch, sampling, reqs, tokens, tokens, lp, lp.table if lp is not None else None, None, widths
        )
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    lp_host = None
    if lp is not None:
        lp_host = torch.empty(lp.table.shape, dtype=lp.table.dtype, pin_memory=True)
        lp_host.copy_(lp.table, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tokens.device))
    return PendingStep(batch, sampling, reqs, tokens, host, lp, lp_host, done, widths)
