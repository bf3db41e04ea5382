"""Decode steps replayed from CUDA graphs captured at start-up, one graph per batch size.

A pure decode step (every sequence feeds one token) has the same kernel launches every time; only the
batch size, the token ids, the positions and the slots change. Each captured size B records
`logits = compute_logits(model(ids[:B], meta_B, cache))` over static device buffers; a step of b <= B
sequences writes its rows into the buffers, pads rows b..B-1, and replays the graph:

    row        0 .. b-1 (real sequences)            b .. B-1 (padding)
    ids        the sequence's last token             0
    seq_lens   tokens in cache after the step        1
    slots      block[pos // bs] * bs + pos % bs      -1 (the KV write skips it)
    state      src / dst = the sequence's slot       src = dst = a pad slot (never allocated)
    blocks     the block table (first columns)       stale ids: a valid block, read for 1 position

Padding rows compute garbage in a pad state slot and a valid-but-unrelated KV position; their logits
are never read. With MTP drafting (`keep_hidden`) each graph also copies its final hidden states into one
static buffer. With async scheduling the ids are not known on the host yet: a sixth staging row says
where each sequence's token sits in the previous step's samples, gathered on the device before replay.
Nothing the kernels launch depends on host values (the attention launcher takes the device tensors on
pure decode steps), so one recording serves every replay.

With speculative decoding, verify steps are captured too, per (batch size, width) for the sizes up to the
speculating batch: each sequence is `width` consecutive rows (scheduler/verify_rows.py), padding sequences
`width` padding rows. Graphs are used only for decode-only steps up to the largest captured size; prefill
and mixed steps replay piecewise graphs (mixed_graphs.py, in the same memory pool) or run eagerly. On the
CPU `DecodeGraphs` runs the same static-buffer step eagerly (`capture=False`), which is what the tests
exercise without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from hyserve.engine.host_tensors import int_tensor, parts_to_device, to_device
from hyserve.engine.runner.block_index import fill_block_tables
from hyserve.engine.scheduler.scheduler import ScheduledSeq
from hyserve.engine.scheduler.verify_rows import scratch_of, verify_rows
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.protocol import CausalLM

# a decode step sends its block tables ragged (filled on the device) once zero-padding them to the longest
# would send this many times the ids themselves
RAGGED_TABLES_ABOVE = 4
_ROWS = 6  # ids, slot_mapping, state_src, state_dst, seq_lens, feed rows (async scheduling)


@dataclass
class CaptureCost:
    seconds: float = 0.0
    bytes: int = 0  # device memory the captured graphs keep


@contextmanager
def capture_cost(device: torch.device) -> Iterator[CaptureCost]:
    """Times the captures inside and counts the device memory they kept (synchronised at the end)."""
    cost = CaptureCost()
    t0, before = time.monotonic(), torch.cuda.memory_allocated(device)
    yield cost
    torch.cuda.synchronize(device)
    cost.seconds, cost.bytes = time.monotonic() - t0, torch.cuda.memory_allocated(device) - before


def default_capture_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to 256, every 16 above, and max_batch_size itself."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, min(max_batch_size, 256) + 1, 8))
    sizes += list(range(272, max_batch_size + 1, 16))
    return sorted({*sizes, max_batch_size})


def pack_decode_rows(
    seqs: Sequence[ScheduledSeq],
    padded: int,
    tokens_per_block: int,
    pad_slot: int,
    feed_rows: Sequence[int] | None = None,
    width: int = 1,
    scratch: Sequence[int] = (),
) -> list[int]:
    """The [_ROWS, padded * width] int64 staging rows of one decode step, flattened row-major (see the
    module docstring for what padding rows hold). The last row holds `feed_rows` (where each sequence's
    input token sits in the previous step's device samples), zeros when the ids are known here. A verify
    step (`width` > 1) lays each sequence out as `width` rows chained through its `scratch` slots."""
    b = len(seqs)
    assert b <= padded
    bs = tokens_per_block
    pad = (padded - b) * width
    fed = list(feed_rows) if feed_rows is not None else [0] * b
    feed = (fed if width == 1 else [f for f in fed for _ in range(width)]) + [0] * pad
    if width == 1:
        ids = [s.token_ids[0] for s in seqs]
        slots = [s.block_ids[s.start_pos // bs] * bs + s.start_pos % bs for s in seqs]
        src = [s.state_dst if s.state_src is None else s.state_src for s in seqs]
        dst = [s.state_dst for s in seqs]
        lens = [s.start_pos + 1 for s in seqs]
    else:
        rows = [
            (s, v) for i, s in enumerate(seqs) for v in verify_rows(s, width, scratch_of(scratch, i, width))
        ]
        ids = [v.token for _, v in rows]
        slots = [s.block_ids[v.position // bs] * bs + v.position % bs if v.writes_kv else -1 for s, v in rows]
        src = [v.src for _, v in rows]
        dst = [v.dst for _, v in rows]
        lens = [v.position + 1 for _, v in rows]
    return (
        ids
        + [0] * pad
        + slots
        + [-1] * pad
        + src
        + [pad_slot] * pad
        + dst
        + [pad_slot] * pad
        + lens
        + [1] * pad
        + feed
    )


class DecodeGraphs:
    """Static buffers and captured graphs for decode batches of the given sizes."""

    def __init__(
        self,
        model: CausalLM,
        cache: CacheTensors,
        device: torch.device,
        *,
        sizes: Sequence[int],
        max_blocks_per_seq: int,
        pad_slot: int,
        enable_padding: bool = True,
        capture: bool = True,
        spec_widths: Sequence[int] = (),
        spec_max_batch: int = 0,
        spec_scratch: Sequence[int] = (),
        keep_hidden: bool = False,
        pool: Any = None,
    ) -> None:
        if not sizes:
            raise ValueError("cuda_graph_config: no batch sizes to capture")
        self.model = model
        self.cache = cache
        self.device = device
        self.sizes = sorted(set(sizes))
        self.enable_padding = enable_padding
        self.pad_slot = pad_slot
        self.tokens_per_block = cache.tokens_per_block
        self.spec_scratch = list(spec_scratch)
        # (batch size, width) of every graph: plain decode at each size; verify steps at each width for the
        # sizes up to the first that holds spec_max_batch sequences
        verify_sizes = [B for B in self.sizes if B < spec_max_batch]
        verify_sizes += [B for B in self.sizes if B >= spec_max_batch][:1]
        self.keys = [(B, 1) for B in self.sizes] + [
            (B, q) for q in sorted(set(spec_widths) - {1}) for B in verify_sizes
        ]
        rmax = max(B * q for B, q in self.keys)
        i32, i64 = torch.int32, torch.int64
        self._stage = torch.zeros(_ROWS * rmax, dtype=i64, device=device)
        # Two pinned staging buffers used in turn, each reused only after the event recorded behind its
        # last copy: with async scheduling the host fills the next step's rows while the previous
        # copy may still be queued on the stream.
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(_ROWS * rmax, dtype=i64, pin_memory=pin) for _ in range(2)]
        self._host_done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._ids = torch.zeros(rmax, dtype=i64, device=device)
        self._slots = torch.full((rmax,), -1, dtype=i64, device=device)
        self._src = torch.full((rmax,), pad_slot, dtype=i64, device=device)
        self._dst = torch.full((rmax,), pad_slot, dtype=i64, device=device)
        self._lens = torch.ones(rmax, dtype=i32, device=device)
        self._cu = torch.arange(rmax + 1, dtype=i32, device=device)
        self._tables = torch.zeros(rmax, max(1, max_blocks_per_seq), dtype=i32, device=device)
        self._has_init = torch.ones(rmax, dtype=torch.bool, device=device)
        self._rows = torch.arange(rmax, dtype=i64, device=device)
        # every graph writes its float32 logits into the first rows of this one buffer: a graph's output
        # would otherwise stay allocated in the graph pool, one [B, vocab] tensor per captured size (27 GB
        # for the sizes up to 1,024 of a 131k vocabulary)
        self._logits = torch.empty(rmax, model.config.vocab_size, dtype=torch.float32, device=device)
        # keep_hidden (MTP drafting reads each step's final hidden states): every graph also copies them into
        # the first rows of one buffer, allocated by the first (largest) graph's warm-up run, off the graph
        self.keep_hidden = keep_hidden
        self._hidden: torch.Tensor | None = None
        self._rmax = rmax
        self._run: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        if capture:
            self._capture_all(pool)
        else:
            for key in self.keys:
                self._run[key] = self._eager_fn(*key)

    # ---- capture ----------------------------------------------------------------------------------
    def _meta(self, B: int, q: int = 1) -> ForwardMeta:
        n = B * q  # rows
        return ForwardMeta(
            num_decodes=n,
            cu_seqlens=list(range(n + 1)),
            seq_lens=[1] * n,
            cu_seqlens_t=self._cu[: n + 1],
            seq_lens_t=self._lens[:n],
            block_tables=self._tables[:n],
            slot_mapping=self._slots[:n],
            state_src=self._src[:n],
            state_dst=self._dst[:n],
            has_initial_state=self._has_init[:n],
            logits_indices=self._rows[:n],
            decode_width=q,
        )

    def _eager_fn(self, B: int, q: int = 1) -> Callable[[], torch.Tensor]:
        meta = self._meta(B, q)
        n = B * q

        @torch.inference_mode()
        def run() -> torch.Tensor:
            hidden = self.model(self._ids[:n], meta, self.cache)
            if self.keep_hidden:
                if self._hidden is None:
                    self._hidden = hidden.new_empty(self._rmax, hidden.shape[-1])
                self._hidden[:n].copy_(hidden)
            return self.model.compute_logits(hidden, out=self._logits[:n])

        return run

    def _capture_all(self, pool: Any = None) -> None:
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with capture_cost(self.device) as cost:
            # most rows first: the smaller graphs reuse its pool memory
            for key in sorted(self.keys, key=lambda k: k[0] * k[1], reverse=True):
                fn = self._eager_fn(*key)
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    for _ in range(2):  # lazy initialisation (cuBLAS workspaces, Triton loads) off the graph
                        fn()
                torch.cuda.current_stream(self.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                    out = fn()
                self._run[key] = self._replay_fn(graph, out)
        self.capture_seconds, self.graph_bytes = cost.seconds, cost.bytes

    @staticmethod
    def _replay_fn(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            graph.replay()
            return out

        return run

    # ---- replay -----------------------------------------------------------------------------------
    def size_for(self, batch_size: int, width: int = 1) -> int | None:
        """The captured size a decode batch of `batch_size` (verified over `width` positions) runs in, or
        None (run it eagerly)."""
        for B in self.sizes:
            if (B, width) in self._run and (B == batch_size or (self.enable_padding and B > batch_size)):
                return B
        return None

    def execute(
        self, seqs: Sequence[ScheduledSeq], feed: tuple[torch.Tensor, list[int]] | None = None, width: int = 1
    ) -> torch.Tensor | None:
        """Run a decode-only step; float32 logits [len(seqs) * width, vocab], or None when no graph fits.
        feed = (tokens, rows): sequence i's input token is tokens[rows[i]] on the device
        (`ModelRunner.execute`)."""
        b = len(seqs)
        B = self.size_for(b, width)
        if B is None:
            return None
        packed = pack_decode_rows(
            seqs,
            B,
            self.tokens_per_block,
            self.pad_slot,
            feed[1] if feed is not None else None,
            width,
            self.spec_scratch,
        )
        R, real = B * width, b * width  # rows, and the real sequences' rows
        n = _ROWS * R
        turn, self._turn = self._turn, 1 - self._turn
        host, done = self._hosts[turn], self._host_done[turn]
        if done is not None:
            done.synchronize()  # that buffer's previous copy has run (long ago, in practice)
        host[:n] = int_tensor(packed)
        stage = self._stage[:n]
        stage.copy_(host[:n], non_blocking=True)
        if host.is_pinned():
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))  # the stream the copy was queued on
            self._host_done[turn] = ev
        rows = stage.view(_ROWS, R)
        self._ids[:R].copy_(rows[0])
        self._slots[:R].copy_(rows[1])
        self._src[:R].copy_(rows[2])
        self._dst[:R].copy_(rows[3])
        self._lens[:R].copy_(rows[4])
        if feed is not None:  # the previous step's samples, gathered on the device (no host round trip);
            r = rows[5, :real]
            if min(feed[1]) >= 0:
                self._ids[:real].copy_(feed[0].index_select(0, r))
            else:  # a row of -1 keeps the token the host knows
                self._ids[:real].copy_(
                    torch.where(r >= 0, feed[0].index_select(0, r.clamp(min=0)), self._ids[:real])
                )
        cols = max(len(s.block_ids) for s in seqs)
        if cols > self._tables.shape[1]:
            raise ValueError(
                f"decode graph: a block table of {cols} blocks exceeds the captured width "
                f"{self._tables.shape[1]}"
            )
        # one pinned copy (a copy from pageable memory would wait for every step already queued on the
        # stream, so the host could no longer prepare a step while the previous one runs). Tables of similar
        # lengths go zero-padded to the longest, one copy into the buffer; when one long sequence would pad
        # every other row (an 800k-token context beside short ones), each table's ids go end to end with a
        # count per row and the rows are filled on the device (block_index.py): a few more device ops
        flat: list[int] = []
        ids = sum(len(s.block_ids) for s in seqs)
        if real * cols <= RAGGED_TABLES_ABOVE * ids:
            zeros = [0] * cols
            for s in seqs:
                flat += (s.block_ids + zeros[: cols - len(s.block_ids)]) * width
            tables = int_tensor(flat, torch.int32).view(real, cols)
            self._tables[:real, :cols].copy_(to_device(tables, self.device), non_blocking=True)
        else:
            for s in seqs:
                flat += s.block_ids * width
            counts = [len(s.block_ids) for s in seqs for _ in range(width)]
            blocks_t, counts_t = parts_to_device([(flat, torch.int64), (counts, torch.int64)], self.device)
            fill_block_tables(self._tables, blocks_t, counts_t)
        return self.replay(B, width)[:real]

    def hidden(self, rows: int) -> torch.Tensor:
        """The final hidden states of the last step's first `rows` rows (keep_hidden)."""
        assert self._hidden is not None, "these graphs keep no hidden states (keep_hidden is off)"
        return self._hidden[:rows]

    def replay(self, batch_size: int, width: int = 1) -> torch.Tensor:
        """Replay the graph of a captured size on whatever the buffers hold; its logits [rows, vocab]."""
        return self._run[(batch_size, width)]()
