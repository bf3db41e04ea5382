"""`ModelRunner`: turns a `ScheduledBatch` into tensors (`ForwardMeta`), runs the model, returns the
logits of the sequences that sample this step.

Index arithmetic for the KV writes (bs = tokens_per_block):

    new token j of a sequence sits at position p = start_pos + j
    slot_mapping = block_ids[p // bs] * bs + p % bs     (computed on the device: runner/block_index.py)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from hyserve.engine.host_tensors import parts_to_device, to_device
from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.runner.block_index import fill_block_tables, slot_mapping
from hyserve.engine.runner.cuda_graphs import DecodeGraphs
from hyserve.engine.runner.mixed_graphs import MixedGraphs
from hyserve.engine.runner.mtp_passes import MTPCatchUp, MTPChain, mtp_catch_up, mtp_passes
from hyserve.engine.sampling.sampler import token_logprobs
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq
from hyserve.engine.scheduler.verify_rows import scratch_of, verify_rows
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta, SnapshotWrite
from hyserve.model.protocol import CausalLM


class ModelRunner:
    """What the engine calls: `execute` a step, read `prompt_logprobs` of the step just run, and set up
    decode graphs once. A runner per rank sits behind the same interface: under tensor parallelism rank 0
    holds a `parallel_runner.DriverRunner`, which tells the other ranks' runners each call first."""

    def __init__(self, model: CausalLM, cache: CacheTensors, device: torch.device) -> None:
        self.model = model
        self.cache = cache
        self.device = device
        self.tokens_per_block = cache.tokens_per_block
        # decode-only steps replay captured graphs when set (hyserve.engine.runner.cuda_graphs.DecodeGraphs)
        self._graphs: DecodeGraphs | None = None
        # prefill and mixed steps replay piecewise graphs when set (runner/mixed_graphs.py)
        self._mixed: MixedGraphs | None = None
        # the last eager step's hidden states and cu_seqlens, kept only when a sequence of it wants prompt
        # logprobs (`prompt_logprobs`), until the next step
        self._kept: tuple[torch.Tensor, list[int]] | None = None
        # state slots a speculative step chains its verified positions through (never allocated to a
        # request): decoding sequence i of the step uses spec_scratch[i * (width - 1) : (i + 1) * (width - 1)]
        self.spec_scratch: list[int] = []
        # MTP drafting reads every step's final hidden states (and its rows' cu_seqlens): kept until the next
        # step when set (decode graphs then copy them out, `DecodeGraphs(keep_hidden=True)`)
        self.keep_step_hidden = False
        self.step_hidden: tuple[torch.Tensor, list[int]] | None = None

    @property
    def graphs(self) -> DecodeGraphs | None:
        return self._graphs

    @property
    def mixed_graphs(self) -> MixedGraphs | None:
        return self._mixed

    def capture_graphs(
        self,
        sizes: Sequence[int],
        *,
        max_blocks_per_seq: int,
        pad_slot: int,
        enable_padding: bool,
        spec_widths: Sequence[int] = (),
        spec_max_batch: int = 0,
        mixed_sizes: Sequence[int] = (),
    ) -> DecodeGraphs:
        """Capture a decode graph per batch size, and with speculative decoding a verify graph per (batch size
        up to `spec_max_batch`, width in `spec_widths`); with `mixed_sizes`, first the piecewise graphs of
        prefill and mixed steps per padded token count, in the same memory pool. On the CPU the same
        static-buffer steps run eagerly."""
        capture = self.device.type == "cuda"
        pool = torch.cuda.graph_pool_handle() if capture else None
        if mixed_sizes:
            self._mixed = MixedGraphs(
                self.model,
                self.cache,
                self.device,
                sizes=mixed_sizes,
                pad_slot=pad_slot,
                capture=capture,
                pool=pool,
            )
        self._graphs = DecodeGraphs(
            self.model,
            self.cache,
            self.device,
            sizes=sizes,
            max_blocks_per_seq=max_blocks_per_seq,
            pad_slot=pad_slot,
            enable_padding=enable_padding,
            capture=capture,
            spec_widths=spec_widths,
            spec_max_batch=spec_max_batch,
            spec_scratch=self.spec_scratch,
            keep_hidden=self.keep_step_hidden,
            pool=pool,
        )
        return self._graphs

    @contextmanager
    def eager_decode(self) -> Iterator[None]:
        """Within: every step runs eagerly (the warm-up compiles the eager decode kernels)."""
        graphs, self._graphs = self._graphs, None
        mixed, self._mixed = self._mixed, None
        try:
            yield
        finally:
            self._graphs, self._mixed = graphs, mixed

    @property
    def keeps_hidden(self) -> bool:
        """Whether the step just run kept its hidden states (a prefill chunk wants prompt logprobs)."""
        return self._kept is not None

    def build_meta(self, batch: ScheduledBatch) -> tuple[torch.Tensor, ForwardMeta]:
        q = batch.spec_width
        ids: list[int] = []
        tables: list[int] = []  # every row's block ids end to end, `counts` per row
        counts: list[int] = []
        cu = [0]
        seq_lens, starts, writes, src, dst, has_init, logits_idx = [], [], [], [], [], [], []
        snaps: list[SnapshotWrite] = []
        max_blocks = max((len(s.block_ids) for s in batch.seqs), default=1) or 1

        def row(
            tokens: list[int], start: int, s: ScheduledSeq, slots: tuple[int, int], *, write_kv: bool = True
        ) -> None:
            ids.extend(tokens)
            cu.append(len(ids))
            starts.append(start)
            writes.append(write_kv)
            seq_lens.append(start + len(tokens))
            tables.extend(s.block_ids)
            counts.append(len(s.block_ids))
            src.append(slots[0])
            dst.append(slots[1])
            if s.sample:
                logits_idx.append(cu[-1] - 1)

        for i, s in enumerate(batch.seqs):
            if i < batch.num_decodes and q > 1:
                # a verified sequence: one row per position (scheduler/verify_rows.py)
                for v in verify_rows(s, q, scratch_of(self.spec_scratch, i, q)):
                    row([v.token], v.position, s, (v.src, v.dst), write_kv=v.writes_kv)
                    has_init.append(True)
                continue
            row(
                s.token_ids,
                s.start_pos,
                s,
                (s.state_dst if s.state_src is None else s.state_src, s.state_dst),
            )
            has_init.append(s.state_src is not None)
            snaps.extend(SnapshotWrite(seq=len(cu) - 2, num_tokens=n, slot=slot) for n, slot in s.snapshots)
        parts: list[tuple[list[int] | list[bool], torch.dtype]] = [
            (ids, torch.long),
            (cu, torch.int32),
            (seq_lens, torch.int32),
            (tables, torch.int32),
            (counts, torch.int64),
            (starts, torch.int64),
            (writes, torch.bool),
            (src, torch.int64),
            (dst, torch.int64),
            (has_init, torch.bool),
            (logits_idx, torch.int64),
        ]
        on_dev = parts_to_device(parts, self.device)  # one pinned copy
        input_ids, cu_t, lens_t, blocks_t, counts_t, starts_t, writes_t, src_t, dst_t, init, logits = on_dev
        tables_t = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=self.device)
        fill_block_tables(tables_t, blocks_t, counts_t)
        meta = ForwardMeta(
            num_decodes=batch.num_decodes * q,
            cu_seqlens=cu,
            seq_lens=seq_lens,
            cu_seqlens_t=cu_t,
            seq_lens_t=lens_t,
            block_tables=tables_t,
            slot_mapping=slot_mapping(tables_t, cu_t, starts_t, writes_t, self.tokens_per_block, len(ids)),
            state_src=src_t,
            state_dst=dst_t,
            has_initial_state=init,
            logits_indices=logits,
            snapshots=snaps,
            decode_width=q,
            prefill_initial_states=any(has_init[batch.num_decodes * q :]),
        )
        return input_ids, meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, feed: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step; returns float32 logits [num sampling seqs, vocab] in batch order.

        feed: the previous step's samples, still on the device (async scheduling): a decode sequence with
        a `feed_row` takes its input token from feed[feed_row] (its token id in `batch` is a placeholder);
        the others feed their own host tokens."""
        self._kept = None
        decodes = batch.seqs[: batch.num_decodes]
        rows = [-1 if s.feed_row is None else s.feed_row for s in decodes] if feed is not None else None
        q = batch.spec_width
        graphs = self._graphs  # usable when they keep the hidden states MTP drafting reads
        if (
            graphs is not None
            and (graphs.keep_hidden or not self.keep_step_hidden)
            and batch.num_decodes == len(batch.seqs)
        ):
            logits = graphs.execute(batch.seqs, None if feed is None else (feed, rows or []), q)
            if logits is not None:  # every decode sequence samples
                if self.keep_step_hidden:
                    n = len(batch.seqs) * q
                    self.step_hidden = (graphs.hidden(n), list(range(n + 1)))
                return logits
        input_ids, meta = self.build_meta(batch)
        if feed is not None and rows:  # decodes come first, `q` rows each (a fed one has no draft)
            r = to_device(torch.tensor(rows, dtype=torch.long), self.device)[:, None]
            head = input_ids[: batch.num_decodes * q].view(-1, q)
            head.copy_(torch.where(r >= 0, feed.index_select(0, r[:, 0].clamp(min=0))[:, None], head))
        prompt_logprobs = any(s.params.prompt_logprobs is not None for s in batch.seqs[batch.num_decodes :])
        hidden = self._mixed.execute(input_ids, meta) if self._mixed is not None else None
        if hidden is None:
            hidden = self.model(input_ids, meta, self.cache)
        elif prompt_logprobs or self.keep_step_hidden:  # read after the step: out of the graphs' memory
            hidden = hidden.clone()
        if prompt_logprobs:
            self._kept = (hidden, meta.cu_seqlens)
        if self.keep_step_hidden:
            self.step_hidden = (hidden, meta.cu_seqlens)
        return self.model.compute_logits(hidden[meta.logits_indices])

    @torch.inference_mode()
    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """For each (dst, src): state slot dst takes slot src's Mamba state, every layer's conv and SSM
        state (after a speculative step, the live slot takes the state of the last accepted token)."""
        idx = to_device(torch.tensor(copies, dtype=torch.long), self.device)
        dst, src = idx[:, 0], idx[:, 1]
        for pool in (*self.cache.conv.values(), *self.cache.ssm.values()):
            pool.index_copy_(0, dst, pool.index_select(0, src))

    @torch.inference_mode()
    def mtp_draft(self, batch: ScheduledBatch, firsts: list[int], chain: MTPChain) -> list[list[int]]:
        """The MTP block's passes over the step just run (runner/mtp_passes.py), from its kept hidden states
        (consumed): the drafts of the `chain` entries."""
        hidden, _ = self._take_step_hidden()
        return mtp_passes(self, hidden, batch, firsts, chain)

    @torch.inference_mode()
    def mtp_catch_up(self, step: ScheduledBatch, plan: MTPCatchUp, samples: torch.Tensor | None) -> None:
        """The MTP block's catch-up pass alone over `step`, just launched (runner/mtp_passes.py), from its
        kept hidden states (consumed); `samples`: its samples on the device."""
        hidden, cu = self._take_step_hidden()
        mtp_catch_up(self, hidden, cu, step, plan, samples)

    def _take_step_hidden(self) -> tuple[torch.Tensor, list[int]]:
        """The last step's kept hidden states and cu_seqlens, handed over once."""
        kept, self.step_hidden = self.step_hidden, None
        assert kept is not None, "no kept hidden states (keep_step_hidden is off)"
        return kept

    def _prompt_logit_passes(
        self, row: int, offset: int, n: int, rows_per_pass: int
    ) -> Iterator[torch.Tensor]:
        """Vocabulary-wide logits of the kept step's sequence `row`, new-token positions offset ..
        offset + n - 1, `rows_per_pass` positions at a time ([<= rows_per_pass, vocab] float32 each)."""
        assert self._kept is not None, "no kept hidden states (the step had no prompt-logprobs sequence)"
        hidden, cu = self._kept
        start = cu[row] + offset
        assert start + n <= cu[row + 1]
        for a in range(0, n, rows_per_pass):
            yield self.model.compute_logits(hidden[start + a : start + min(a + rows_per_pass, n)])

    @torch.inference_mode()
    def prompt_logprobs(
        self, row: int, offset: int, targets: list[int], k: int, rows_per_pass: int = 256
    ) -> list[TokenLogprob]:
        """Logprobs of `targets` (the prompt tokens that follow) at the kept step's sequence `row`, from
        its new-token position `offset` on, with the top-k alternatives; vocabulary-wide logits are
        formed `rows_per_pass` positions at a time."""
        out: list[TokenLogprob] = []
        passes = self._prompt_logit_passes(row, offset, len(targets), rows_per_pass)
        for a, logits in zip(range(0, len(targets), rows_per_pass), passes):
            tg = targets[a : a + rows_per_pass]
            out += token_logprobs(logits, torch.tensor(tg, device=logits.device), tg, [k] * len(tg))
        return out

    @torch.inference_mode()
    def follow_prompt_logprobs(self, row: int, offset: int, n: int, rows_per_pass: int = 256) -> None:
        """A rank other than 0: the same passes as rank 0's `prompt_logprobs` (the lm_head is vocab-parallel,
        each pass a collective), values unused."""
        for _ in self._prompt_logit_passes(row, offset, n, rows_per_pass):
            pass

    def close(self) -> None:
        """Nothing to release on one rank (`parallel_runner.DriverRunner` stops the others)."""
