"""`ModelRunner`: turns a `ScheduledBatch` into tensors (`ForwardMeta`), runs the model, returns the
logits of the sequences that sample this step.

Index arithmetic for the KV writes (bs = tokens_per_block):

    new token j of a sequence sits at position p = start_pos + j
    slot_mapping = block_ids[p // bs] * bs + p % bs
"""

from __future__ import annotations

import torch

from hyserve.engine.cuda_graphs import DecodeGraphs
from hyserve.engine.logits_processing import to_device
from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.sampler import token_logprobs
from hyserve.engine.scheduler import ScheduledBatch
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta, SnapshotWrite
from hyserve.model.protocol import CausalLM


class ModelRunner:
    def __init__(self, model: CausalLM, cache: CacheTensors, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.tokens_per_block = cache.tokens_per_block
        # decode-only steps replay captured graphs when set (hyserve.engine.cuda_graphs.DecodeGraphs)
        self.graphs: DecodeGraphs | None = None
        # the last eager step's hidden states and cu_seqlens, kept only when a sequence of it wants prompt
        # logprobs (`prompt_logprobs`); the engine drops them once it has read them
        self.kept: tuple[torch.Tensor, list[int]] | None = None

    def build_meta(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardMeta]:
        bs = self.tokens_per_block
        ids: list[int] = []
        cu = [0]
        seq_lens, slot_mapping, src, dst, has_init, logits_idx = [], [], [], [], [], []
        snaps: list[SnapshotWrite] = []
        max_blocks = max((len(s.block_ids) for s in batch.seqs), default=1) or 1
        rows: list[list[int]] = []  # block tables, zero-padded: one tensor built from them (not one per row)
        for i, s in enumerate(batch.seqs):
            ids.extend(s.token_ids)
            cu.append(len(ids))
            for p in range(s.start_pos, s.start_pos + len(s.token_ids)):
                slot_mapping.append(s.block_ids[p // bs] * bs + p % bs)
            seq_lens.append(s.start_pos + len(s.token_ids))
            rows.append(s.block_ids + [0] * (max_blocks - len(s.block_ids)))
            src.append(s.state_dst if s.state_src is None else s.state_src)
            dst.append(s.state_dst)
            has_init.append(s.state_src is not None)
            if s.sample:
                logits_idx.append(cu[-1] - 1)
            snaps.extend(SnapshotWrite(seq=i, num_tokens=n, slot=slot) for n, slot in s.snapshots)
        dev = self.device

        def t(x: list[int] | list[bool], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        meta = ForwardMeta(
            num_decodes=batch.num_decodes,
            cu_seqlens=cu,
            seq_lens=seq_lens,
            cu_seqlens_t=t(cu, torch.int32),
            seq_lens_t=t(seq_lens, torch.int32),
            block_tables=torch.tensor(rows, dtype=torch.int32).to(dev, non_blocking=True),
            slot_mapping=t(slot_mapping, torch.int64),
            state_src=t(src, torch.int64),
            state_dst=t(dst, torch.int64),
            has_initial_state=t(has_init, torch.bool),
            logits_indices=t(logits_idx, torch.int64),
            snapshots=snaps,
        )
        return t(ids, torch.long), meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, feed: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampling seqs, vocab] in batch order.

        feed = (tokens, rows): the decode sequences' input tokens are still on the device (the previous
        step's samples, not yet read by the host): decode sequence i feeds tokens[rows[i]], and its token
        id in `batch` is a placeholder. Prefill sequences after them feed their own (host) tokens."""
        if feed is not None:
            assert len(feed[1]) == batch.num_decodes, "one feed row per decode sequence"
        if self.graphs is not None and batch.num_decodes == len(batch.seqs):
            logits = self.graphs.execute(batch.seqs, feed)  # every decode sequence samples
            if logits is not None:
                return logits
        input_ids, meta = self.build_meta(batch)
        if feed is not None and batch.num_decodes:  # decodes come first, one token each
            rows = to_device(torch.tensor(feed[1], dtype=torch.long), self.device)
            input_ids[: batch.num_decodes] = feed[0].index_select(0, rows)
        hidden = self.model(input_ids, meta, self.cache)
        if any(s.params.prompt_logprobs is not None for s in batch.seqs[batch.num_decodes :]):
            self.kept = (hidden, meta.cu_seqlens)
        return self.model.compute_logits(hidden[meta.logits_indices])

    @torch.inference_mode()
    def prompt_logprobs(self, row: int, offset: int, targets: list[int], k: int,
                        rows_per_pass: int = 256) -> list[TokenLogprob]:
        """Logprobs of `targets` (the prompt tokens that follow) at the kept step's sequence `row`, from
        its new-token position `offset` on, with the top-k alternatives; vocabulary-wide logits are
        formed `rows_per_pass` positions at a time."""
        assert self.kept is not None, "no kept hidden states (the step had no prompt-logprobs sequence)"
        hidden, cu = self.kept
        start = cu[row] + offset
        assert start + len(targets) <= cu[row + 1]
        out: list[TokenLogprob] = []
        for a in range(0, len(targets), rows_per_pass):
            tg = targets[a : a + rows_per_pass]
            logits = self.model.compute_logits(hidden[start + a : start + a + len(tg)])
            out += token_logprobs(logits, torch.tensor(tg, device=logits.device), tg, [k] * len(tg))
        return out
