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
are never read. With async scheduling the ids are not known on the host yet: a sixth staging row says
where each sequence's token sits in the previous step's samples, gathered on the device before replay.
Nothing the kernels launch depends on host values (the attention launcher takes the device tensors on
pure decode steps), so one recording serves every replay.

Graphs are used only for decode-only steps up to the largest captured size; prefill and mixed steps
run eagerly. On the CPU `DecodeGraphs` runs the same static-buffer step eagerly (`capture=False`),
which is what the tests exercise without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from hyserve.engine.host_tensors import int_tensor, to_device
from hyserve.engine.scheduler.scheduler import ScheduledSeq
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.protocol import CausalLM

_ROWS = 6  # ids, slot_mapping, state_src, state_dst, seq_lens, feed rows (async scheduling)


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
) -> list[int]:
    """The [_ROWS, padded] int64 staging rows of one decode step, flattened row-major (see the
    module docstring for what padding rows hold). The last row holds `feed_rows` (where each sequence's
    input token sits in the previous step's device samples), zeros when the ids are known here."""
    b = len(seqs)
    assert b <= padded
    bs = tokens_per_block
    pad = padded - b
    ids = [s.token_ids[0] for s in seqs] + [0] * pad
    slots = [s.block_ids[s.start_pos // bs] * bs + s.start_pos % bs for s in seqs] + [-1] * pad
    src = [s.state_dst if s.state_src is None else s.state_src for s in seqs] + [pad_slot] * pad
    dst = [s.state_dst for s in seqs] + [pad_slot] * pad
    lens = [s.start_pos + 1 for s in seqs] + [1] * pad
    feed = (list(feed_rows) if feed_rows is not None else [0] * b) + [0] * pad
    return ids + slots + src + dst + lens + feed


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
        bmax = self.sizes[-1]
        i32, i64 = torch.int32, torch.int64
        self._stage = torch.zeros(_ROWS * bmax, dtype=i64, device=device)
        # Two pinned staging buffers used in turn, each reused only after the event recorded behind its
        # last copy: with async scheduling the host fills the next step's rows while the previous
        # copy may still be queued on the stream.
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(_ROWS * bmax, dtype=i64, pin_memory=pin) for _ in range(2)]
        self._host_done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._ids = torch.zeros(bmax, dtype=i64, device=device)
        self._slots = torch.full((bmax,), -1, dtype=i64, device=device)
        self._src = torch.full((bmax,), pad_slot, dtype=i64, device=device)
        self._dst = torch.full((bmax,), pad_slot, dtype=i64, device=device)
        self._lens = torch.ones(bmax, dtype=i32, device=device)
        self._cu = torch.arange(bmax + 1, dtype=i32, device=device)
        self._tables = torch.zeros(bmax, max(1, max_blocks_per_seq), dtype=i32, device=device)
        self._has_init = torch.ones(bmax, dtype=torch.bool, device=device)
        self._rows = torch.arange(bmax, dtype=i64, device=device)
        # every graph writes its float32 logits into the first rows of this one buffer: a graph's output
        # would otherwise stay allocated in the graph pool, one [B, vocab] tensor per captured size (27 GB
        # for the sizes up to 1,024 of a 131k vocabulary)
        self._logits = torch.empty(bmax, model.config.vocab_size, dtype=torch.float32, device=device)
        self._run: dict[int, Callable[[], torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        if capture:
            self._capture_all()
        else:
            for B in self.sizes:
                self._run[B] = self._eager_fn(B)

    # ---- capture ----------------------------------------------------------------------------------
    def _meta(self, B: int) -> ForwardMeta:
        return ForwardMeta(
            num_decodes=B,
            cu_seqlens=list(range(B + 1)),
            seq_lens=[1] * B,
            cu_seqlens_t=self._cu[: B + 1],
            seq_lens_t=self._lens[:B],
            block_tables=self._tables[:B],
            slot_mapping=self._slots[:B],
            state_src=self._src[:B],
            state_dst=self._dst[:B],
            has_initial_state=self._has_init[:B],
            logits_indices=self._rows[:B],
        )

    def _eager_fn(self, B: int) -> Callable[[], torch.Tensor]:
        meta = self._meta(B)

        @torch.inference_mode()
        def run() -> torch.Tensor:
            hidden = self.model(self._ids[:B], meta, self.cache)
            return self.model.compute_logits(hidden, out=self._logits[:B])

        return run

    def _capture_all(self) -> None:
        t0 = time.monotonic()
        before = torch.cuda.memory_allocated(self.device)
        pool = torch.cuda.graph_pool_handle()
        for B in reversed(self.sizes):  # largest first: the smaller graphs reuse its pool memory
            fn = self._eager_fn(B)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # lazy initialisation (cuBLAS workspaces, Triton loads) off the graph
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=pool):
                out = fn()
            self._run[B] = self._replay_fn(graph, out)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.monotonic() - t0
        self.graph_bytes = torch.cuda.memory_allocated(self.device) - before

    @staticmethod
    def _replay_fn(graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            graph.replay()
            return out

        return run

    # ---- replay -----------------------------------------------------------------------------------
    def size_for(self, batch_size: int) -> int | None:
        """The captured size a decode batch of `batch_size` runs in, or None (run it eagerly)."""
        for B in self.sizes:
            if B == batch_size or (self.enable_padding and B > batch_size):
                return B
        return None

    def execute(
        self, seqs: Sequence[ScheduledSeq], feed: tuple[torch.Tensor, list[int]] | None = None
    ) -> torch.Tensor | None:
        """Run a decode-only step; float32 logits [len(seqs), vocab], or None when no graph fits.
        feed = (tokens, rows): sequence i's input token is tokens[rows[i]] on the device
        (`ModelRunner.execute`)."""
        b = len(seqs)
        B = self.size_for(b)
        if B is None:
            return None
        packed = pack_decode_rows(
            seqs, B, self.tokens_per_block, self.pad_slot, feed[1] if feed is not None else None
        )
        n = _ROWS * B
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
        rows = stage.view(_ROWS, B)
        self._ids[:B].copy_(rows[0])
        self._slots[:B].copy_(rows[1])
        self._src[:B].copy_(rows[2])
        self._dst[:B].copy_(rows[3])
        self._lens[:B].copy_(rows[4])
        if feed is not None:  # the previous step's samples, gathered on the device (no host round trip);
            r = rows[5, :b]
            if min(feed[1]) >= 0:
                self._ids[:b].copy_(feed[0].index_select(0, r))
            else:  # a row of -1 keeps the token the host knows
                self._ids[:b].copy_(
                    torch.where(r >= 0, feed[0].index_select(0, r.clamp(min=0)), self._ids[:b])
                )
        width = max(len(s.block_ids) for s in seqs)
        if width > self._tables.shape[1]:
            raise ValueError(
                f"decode graph: a block table of {width} blocks exceeds the captured width "
                f"{self._tables.shape[1]}"
            )
        # one flat list (zeros past each table's end) and one pinned copy: a copy from pageable memory
        # would wait for every step already queued on the stream, so the host could no longer prepare a
        # step while the previous one runs
        flat: list[int] = []
        zeros = [0] * width
        for s in seqs:
            flat += s.block_ids
            flat += zeros[: width - len(s.block_ids)]
        tables = int_tensor(flat, torch.int32).view(b, width)
        self._tables[:b, :width].copy_(to_device(tables, self.device), non_blocking=True)
        return self.replay(B)[:b]

    def replay(self, batch_size: int) -> torch.Tensor:
        """Replay the graph of a captured size on whatever the buffers hold; its logits [B, vocab]."""
        return self._run[batch_size]()
