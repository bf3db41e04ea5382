"""What rank 0 tells the other ranks, and how (docs/architecture.md, "Parallelism").

Rank 0 schedules; each step it sends the batch as plain data over a gloo group of its own, in host memory,
so the message never queues behind the GPU and a worker has the next step while its GPU still runs this
one. A decode row fed from the previous step's samples on the device (async scheduling) needs that tensor:
it follows over the model's group (NCCL on CUDA: device to device, no host round trip). The messages:

    (STEP, seqs, num_decodes, feed_len, eager, spec_width)
                                                       run this batch (feed_len: the feed tensor's rows,
                                                       -1 none; eager: decode steps skip the captured
                                                       graphs; spec_width: rows per decoding sequence)
    (COPY_STATES, copies)                              copy Mamba state slots (dst, src) after a
                                                       speculative step's drafts were verified
    (MTP_DRAFT, seqs, firsts, chain)                   the MTP block's passes over the step just run
                                                       (runner/mtp_passes.py)
    (MTP_CATCH_UP, plan, samples_len)                  its catch-up pass alone over the step just
                                                       run (the samples follow as the feed does)
    (PROMPT_LOGITS, row, offset, n, rows_per_pass)     the kept step's prompt-logprob passes
    (CAPTURE, sizes, max_blocks_per_seq, pad_slot, enable_padding, spec_widths, spec_max_batch,
     mixed_sizes)
    (READY,)  (HEARTBEAT,)  (SHUTDOWN,)

A gloo receive waits at most the group timeout, so while rank 0 has nothing to send (and is not in a step
with the others) a thread sends a heartbeat every quarter of it. A peer that is gone or hangs turns the
next send or receive into CollectiveError, which the callers treat as fatal.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hyserve.distributed import CollectiveError, Group, all_gather, parallel_info, tp_group
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq

STEP, PROMPT_LOGITS, CAPTURE, COPY_STATES, MTP_DRAFT, MTP_CATCH_UP, READY, HEARTBEAT, SHUTDOWN = (
    "step",
    "prompt_logits",
    "capture",
    "copy_states",
    "mtp_draft",
    "mtp_catch_up",
    "ready",
    "hb",
    "stop",
)
# A message is one broadcast of a fixed buffer ([8-byte length | pickle]) and, past it, one more of the rest:
# ~95 us for a small message on a loaded 2-core host against ~400 us through torch's broadcast_object_list
# (two broadcasts and a receiver turnaround between them), ~390 against ~830 us for a 64-row decode step at
# 8k tokens of context (benchmarks/bench_tp_step.py). 64 KiB holds such a step of up to ~150 rows.
FRAME_BYTES = 64 * 1024
_LEN = 8

# a worker's ScheduledSeq carries no request state: only whether the runner keeps hidden states for it
_PLAIN = SamplingParams()
_KEEPS_HIDDEN = SamplingParams(prompt_logprobs=0)

# One seq on the wire: (token_ids, start_pos, block_ids, state_src, state_dst, sample, snapshots, feed_row,
# wants prompt logprobs, draft): plain tuples pickle in ~1.4 us a decode row at 8k tokens of context, against
# ~3.1 us for the dataclasses with their SamplingParams (benchmarks/bench_tp_step.py).
WireSeq = tuple[
    list[int], int, list[int], int | None, int, bool, list[tuple[int, int]], int | None, bool, list[int]
]


def encode_seqs(batch: ScheduledBatch) -> tuple[WireSeq, ...]:
    """The part of `batch` every rank's runner reads (no request ids, sampling settings or prefix keys)."""
    return tuple(
        (
            s.token_ids,
            s.start_pos,
            s.block_ids,
            s.state_src,
            s.state_dst,
            s.sample,
            s.snapshots,
            s.feed_row,
            s.params.prompt_logprobs is not None,
            s.draft,
        )
        for s in batch.seqs
    )


def decode_seqs(seqs: tuple[WireSeq, ...], num_decodes: int, spec_width: int = 1) -> ScheduledBatch:
    return ScheduledBatch(
        seqs=[
            ScheduledSeq(
                request_id="",
                token_ids=tok,
                start_pos=start,
                block_ids=blocks,
                state_src=src,
                state_dst=dst,
                sample=sample,
                snapshots=snaps,
                params=_KEEPS_HIDDEN if plp else _PLAIN,
                num_output_tokens=0,
                feed_row=feed,
                draft=draft,
            )
            for tok, start, blocks, src, dst, sample, snaps, feed, plp, draft in seqs
        ],
        num_decodes=num_decodes,
        spec_width=spec_width,
    )


class StepChannel:
    """The control group of one engine's ranks. Rank 0 sends (`send`, from any thread), the others
    receive (`recv`); `gather_ints` and `wait_for_all` are start-up collectives every rank calls."""

    def __init__(self, control: Group, model: Group) -> None:
        self.control = control
        self.model = model
        self.failure: CollectiveError | None = None  # set by the heartbeat thread when a send fails
        self._lock = threading.Lock()
        self._last_send = time.monotonic()
        self.in_step = False  # rank 0 is running a step with the others: they are not waiting on this channel
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self._frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self._frame_np = self._frame.numpy()

    @classmethod
    def open(cls) -> StepChannel:
        """Every rank, at the same point of start-up (a new process group is a collective)."""
        info = parallel_info()
        if info.world_size == 1:
            raise RuntimeError("StepChannel.open: a world of one rank has nobody to talk to")
        ranks = list(range(info.world_size))
        pg = dist.new_group(ranks, backend="gloo", timeout=datetime.timedelta(seconds=info.timeout_s))
        control = Group(
            name="control",
            rank=info.rank,
            size=info.world_size,
            ranks=tuple(ranks),
            timeout_s=info.timeout_s,
            pg=pg,
        )
        return cls(control, tp_group())

    @property
    def is_driver(self) -> bool:
        return self.control.rank == 0

    # ---- start-up collectives (every rank) -------------------------------------------------------------
    def gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (same length on each), in rank order."""
        t = all_gather(torch.tensor([values], dtype=torch.int64), self.control)  # [world, len(values)]
        return [[int(v) for v in row] for row in t.tolist()]

    def wait_for_all(self, what: str, timeout_s: float) -> None:
        """A barrier with its own, longer timeout (ranks finish loading weights at different times)."""
        try:
            dist.monitored_barrier(group=self.control.pg, timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            raise CollectiveError(f"barrier after {what} ({timeout_s:g} s)", self.control, e) from e

    # ---- rank 0 ---------------------------------------------------------------------------------------
    def send(self, msg: tuple[Any, ...]) -> None:
        with self._lock:
            if self.failure is not None:
                raise self.failure
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(data)
            head = min(n, FRAME_BYTES - _LEN)
            self._frame_np[:_LEN] = np.frombuffer(n.to_bytes(_LEN, "little"), dtype=np.uint8)
            self._frame_np[_LEN : _LEN + head] = np.frombuffer(data, dtype=np.uint8, count=head)
            self._broadcast(self._frame)
            if n > head:
                self._broadcast(torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=head).copy()))
            self._last_send = time.monotonic()
            self.in_step = msg[0] in (STEP, PROMPT_LOGITS, CAPTURE, MTP_DRAFT, MTP_CATCH_UP)

    def step_done(self) -> None:
        """Rank 0 finished its part of a step: the others are about to wait on the channel again."""
        self.in_step = False
        self._last_send = time.monotonic()

    def start_heartbeat(self) -> None:
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._beat, name="hyserve-heartbeat", daemon=True)
            self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=self.control.timeout_s)
            self._heartbeat = None

    def _beat(self) -> None:
        every = self.control.timeout_s / 4
        while not self._stop.wait(every / 4):
            if self.in_step or time.monotonic() - self._last_send < every:
                continue
            try:
                self.send((HEARTBEAT,))
            except CollectiveError as e:
                self.failure = self.failure or e
                return

    def broadcast_feed(self, feed: torch.Tensor | None, n: int, device: torch.device) -> torch.Tensor:
        """The previous step's device samples ([n] int64) from rank 0 to every rank, over the model's
        group (workers pass None and get the tensor)."""
        t = feed if self.is_driver and feed is not None else torch.empty(n, dtype=torch.long, device=device)
        try:
            dist.broadcast(t, src=self.model.ranks[0], group=self.model.pg)
        except RuntimeError as e:
            raise CollectiveError("broadcast of the fed tokens", self.model, e) from e
        return t

    def _broadcast(self, t: torch.Tensor) -> None:
        try:
            dist.broadcast(t, src=self.control.ranks[0], group=self.control.pg)
        except RuntimeError as e:
            raise CollectiveError("broadcast of a step message", self.control, e) from e

    # ---- ranks > 0 ------------------------------------------------------------------------------------
    def recv(self) -> tuple[Any, ...]:
        self._broadcast(self._frame)
        n = int.from_bytes(self._frame_np[:_LEN].tobytes(), "little")
        head = min(n, FRAME_BYTES - _LEN)
        data = self._frame_np[_LEN : _LEN + head].tobytes()
        if n > head:
            rest = torch.empty(n - head, dtype=torch.uint8)
            self._broadcast(rest)
            data += rest.numpy().tobytes()
        msg = pickle.loads(data)
        if not isinstance(msg, tuple) or not msg:
            raise RuntimeError(f"rank {self.control.rank}: unexpected message from rank 0: {msg!r}")
        return msg
