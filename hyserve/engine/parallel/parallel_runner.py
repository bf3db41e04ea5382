"""Rank 0's runner when one model spans several ranks: the `ModelRunner` interface, each call first told
to the other ranks (`step_channel`), then run on this rank's shard (docs/architecture.md, "Parallelism").

The lm_head gathers the whole vocabulary's logits on every rank, so rank 0 samples alone and the result
is exact. Every rank runs every collective of a step in the same order; a step that fails on one rank
leaves the others waiting inside a collective, so any failure here is fatal (`RankLost`), never one
batch's error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

from hyserve.distributed import CollectiveError
from hyserve.engine.outputs import TokenLogprob
from hyserve.engine.parallel.step_channel import (
    CAPTURE,
    COPY_STATES,
    MTP_CATCH_UP,
    MTP_DRAFT,
    PROMPT_LOGITS,
    READY,
    SHUTDOWN,
    STEP,
    StepChannel,
    encode_seqs,
)
from hyserve.engine.runner.cuda_graphs import DecodeGraphs
from hyserve.engine.runner.mtp_passes import MTPCatchUp, MTPChain
from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.scheduler.scheduler import ScheduledBatch

T = TypeVar("T")


class RankLost(BaseException):
    """The ranks can no longer run steps together (a rank died or hung, or a step failed on this rank).

    A BaseException on purpose: the engine loop fails one batch on an `Exception` and goes on, which under
    tensor parallelism would send the next step to ranks still waiting in the last one. This unwinds the
    loop instead; the server reports unhealthy and exits non-zero (`launch.RankWatch`)."""


class DriverRunner(ModelRunner):
    """Rank 0's runner: built from the runner start-up assembled (same model shard, cache and graphs)."""

    def __init__(self, runner: ModelRunner, channel: StepChannel) -> None:
        super().__init__(runner.model, runner.cache, runner.device)
        self._graphs = runner.graphs
        self.spec_scratch = runner.spec_scratch
        self.keep_step_hidden = runner.keep_step_hidden
        self.channel = channel
        self.failure: str | None = None
        self._eager = False
        self._on_close: list[Callable[[bool], None]] = []
        self._closed = False
        # why a rank this process started is gone, or None (set by the launcher; torchrun watches its own)
        self.lost_rank: Callable[[], str | None] = lambda: None
        channel.start_heartbeat()

    # ---- failure ---------------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise RankLost if the ranks can no longer work together (seen by a step or by the heartbeat)."""
        if self._closed:
            raise RankLost("the engine's ranks were shut down (close())")
        if self.failure is None and self.channel.failure is not None:
            self.failure = f"lost contact with the other ranks: {self.channel.failure}"
        if self.failure is not None:
            raise RankLost(self.failure)

    def health(self) -> str | None:
        """Why the ranks can no longer work together, or None (polled by `launch.RankWatch`; a rank that
        exited is seen here before the next collective notices)."""
        if self._closed:
            return None
        if self.failure is None and self.channel.failure is not None:
            self.failure = f"lost contact with the other ranks: {self.channel.failure}"
        return self.failure or self.lost_rank()

    def _lost(self, err: BaseException) -> RankLost:
        if isinstance(err, CollectiveError):
            self.failure = f"lost contact with the other ranks: {err}"
        else:
            self.failure = (
                f"rank 0's step failed ({type(err).__name__}: {err}); under tensor parallelism "
                "the ranks are then out of step"
            )
        return RankLost(self.failure)

    def _tell(self, msg: tuple[Any, ...]) -> None:
        self.check()
        try:
            self.channel.send(msg)
        except Exception as e:
            raise self._lost(e) from e

    # ---- the ModelRunner interface ---------------------------------------------------------------------
    def _with_the_others(self, fn: Callable[[], T]) -> T:
        """Rank 0's part of a call every rank runs: any failure in it leaves the others out of step."""
        try:
            return fn()
        except Exception as e:
            raise self._lost(e) from e
        except BaseException as e:  # Ctrl-C mid-step: the others are left inside its collectives
            self.failure = self.failure or f"interrupted in a step ({type(e).__name__})"
            raise
        finally:
            self.channel.step_done()

    def execute(self, batch: ScheduledBatch, feed: torch.Tensor | None = None) -> torch.Tensor:
        n = -1 if feed is None else int(feed.shape[0])
        self._tell((STEP, encode_seqs(batch), batch.num_decodes, n, self._eager, batch.spec_width))
        run = super().execute

        def step() -> torch.Tensor:
            if feed is not None:
                self.channel.broadcast_feed(feed, n, self.device)
            return run(batch, feed)

        return self._with_the_others(step)

    def prompt_logprobs(
        self, row: int, offset: int, targets: list[int], k: int, rows_per_pass: int = 256
    ) -> list[TokenLogprob]:
        self._tell((PROMPT_LOGITS, row, offset, len(targets), rows_per_pass))
        run = super().prompt_logprobs
        return self._with_the_others(lambda: run(row, offset, targets, k, rows_per_pass))

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        self._tell((COPY_STATES, copies))
        run = super().copy_states
        self._with_the_others(lambda: run(copies))

    def mtp_draft(self, batch: ScheduledBatch, firsts: list[int], chain: MTPChain) -> list[list[int]]:
        self._tell((MTP_DRAFT, encode_seqs(batch), firsts, chain))
        run = super().mtp_draft
        return self._with_the_others(lambda: run(batch, firsts, chain))

    def mtp_catch_up(self, step: ScheduledBatch, plan: MTPCatchUp, samples: torch.Tensor | None) -> None:
        # the others rebuild the pass from the step they just ran: only the plan travels
        n = -1 if samples is None else int(samples.shape[0])
        self._tell((MTP_CATCH_UP, plan, n))
        run = super().mtp_catch_up

        def passes() -> None:
            if samples is not None:
                self.channel.broadcast_feed(samples, n, self.device)
            run(step, plan, samples)

        self._with_the_others(passes)

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
        self._tell(
            (
                CAPTURE,
                list(sizes),
                max_blocks_per_seq,
                pad_slot,
                enable_padding,
                list(spec_widths),
                spec_max_batch,
                list(mixed_sizes),
            )
        )
        run = super().capture_graphs
        return self._with_the_others(
            lambda: run(
                sizes,
                max_blocks_per_seq=max_blocks_per_seq,
                pad_slot=pad_slot,
                enable_padding=enable_padding,
                spec_widths=spec_widths,
                spec_max_batch=spec_max_batch,
                mixed_sizes=mixed_sizes,
            )
        )

    @contextmanager
    def eager_decode(self) -> Iterator[None]:
        self._eager = True
        try:
            with super().eager_decode():
                yield
        finally:
            self._eager = False

    # ---- lifecycle -------------------------------------------------------------------------------------
    def mark_ready(self) -> None:
        """The warm-up is over: every rank counts its Triton compilations from here on."""
        self._tell((READY,))

    def on_close(self, fn: Callable[[bool], None]) -> None:
        """`fn(told)` runs at close(); `told`: the other ranks were told to exit (else they are lost or
        stuck in a step, and the launcher should not wait for them)."""
        self._on_close.append(fn)

    def close(self) -> None:
        """Tell the other ranks to exit (unless they are lost), then run the launcher's clean-up."""
        if self._closed:
            return
        self._closed = True
        self.channel.stop_heartbeat()
        told = False
        if self.failure is None and self.channel.failure is None:
            try:
                self.channel.send((SHUTDOWN,))
                told = True
            except CollectiveError as e:
                self.failure = f"lost contact with the other ranks: {e}"
        for fn in self._on_close:
            fn(told)
