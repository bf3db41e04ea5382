"""A headless rank (rank > 0) of an engine spanning several ranks (docs/architecture.md, "Parallelism").

It joins the group, runs the same start-up as rank 0 in step with it (load its shard, profile, agree on
the cache plan, allocate, capture graphs: `assembly.assemble`), then follows rank 0: receive a message,
run it on this rank's shard, repeat, until rank 0 says shutdown. Any failure exits non-zero: the other
ranks then see the group break and stop too.

Started by `hyserve serve` / `LLM(tp_size=...)` for the local ranks
(`python -m hyserve.engine.lifecycle.worker`, the config pickled on stdin) or, under torchrun, by
`hyserve serve` itself on every rank but 0.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable

from hyserve.config import EngineConfig
from hyserve.distributed import CollectiveError, destroy_distributed, parallel_info
from hyserve.engine.assembly.assemble import assemble
from hyserve.engine.gc_tuning import settle_for_serving
from hyserve.engine.parallel.launch import join_group
from hyserve.engine.parallel.step_channel import (
    CAPTURE,
    COPY_STATES,
    HEARTBEAT,
    MTP_CATCH_UP,
    MTP_DRAFT,
    PROMPT_LOGITS,
    READY,
    SHUTDOWN,
    STEP,
    StepChannel,
    decode_seqs,
)
from hyserve.engine.runner.jit_sentinel import JitSentinel
from hyserve.engine.runner.runner import ModelRunner

logger = logging.getLogger("hyserve")


class WorkerLoop:
    """Follow rank 0's messages on this rank's runner until SHUTDOWN."""

    def __init__(self, runner: ModelRunner, channel: StepChannel, jit: JitSentinel) -> None:
        self.runner = runner
        self.channel = channel
        self.jit = jit
        self.steps = 0

    def run(self) -> None:
        runner = self.runner
        step = decode_seqs((), 0)  # the last step run (an MTP catch-up pass follows it)
        while True:
            msg = self.channel.recv()
            kind = msg[0]
            if kind == STEP:
                _, seqs, num_decodes, feed_len, eager, spec_width = msg
                feed = self.channel.broadcast_feed(None, feed_len, runner.device) if feed_len >= 0 else None
                step = decode_seqs(seqs, num_decodes, spec_width)
                with runner.eager_decode() if eager else contextlib.nullcontext():
                    runner.execute(step, feed)
                self.steps += 1
            elif kind == PROMPT_LOGITS:
                runner.follow_prompt_logprobs(*msg[1:])
            elif kind == COPY_STATES:
                runner.copy_states(msg[1])
            elif kind == MTP_DRAFT:
                _, seqs, firsts, chain = msg
                runner.mtp_draft(decode_seqs(seqs, 0), firsts, chain)
            elif kind == MTP_CATCH_UP:  # over the step just run
                _, plan, n = msg
                samples = self.channel.broadcast_feed(None, n, runner.device) if n >= 0 else None
                runner.mtp_catch_up(step, plan, samples)
            elif kind == HEARTBEAT:
                continue
            elif kind == CAPTURE:
                _, sizes, max_blocks, pad_slot, padding, spec_widths, spec_max_batch, mixed_sizes = msg
                runner.capture_graphs(
                    sizes,
                    max_blocks_per_seq=max_blocks,
                    pad_slot=pad_slot,
                    enable_padding=padding,
                    spec_widths=spec_widths,
                    spec_max_batch=spec_max_batch,
                    mixed_sizes=mixed_sizes,
                )
            elif kind == READY:
                self.jit.mark_ready()
                settle_for_serving()  # this process serves from now on (engine/gc_tuning.py)
            elif kind == SHUTDOWN:
                return
            else:
                raise RuntimeError(f"unknown message from rank 0: {kind!r}")


def run_worker(
    config: EngineConfig,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    log: Callable[[str], None] | None = None,
) -> int:
    """Be rank `rank` (default: torchrun's RANK) until rank 0 shuts the engine down; the exit status."""
    say = log or (lambda s: print(s, file=sys.stderr, flush=True))
    jit = JitSentinel()
    jit.install()
    try:
        join_group(config, rank=rank, world_size=world_size, init_method=init_method)
    except ValueError as e:
        say(f"hyserve: error: {e}")
        return 2
    me = parallel_info().rank
    loop: WorkerLoop | None = None
    try:
        parts = assemble(config, lambda s: logger.debug("rank %d: %s", me, s))
        assert parts.channel is not None
        loop = WorkerLoop(parts.runner, parts.channel, jit)
        loop.run()
    except CollectiveError as e:
        say(f"hyserve: rank {me}: lost the other ranks after {loop.steps if loop else 0} steps: {e}")
        return 1
    except ValueError as e:  # a setting that does not fit (rank 0 reports the same)
        say(f"hyserve: rank {me}: error: {e}")
        return 2
    except BaseException:  # noqa: BLE001 - any failure takes this rank out of step: report and exit
        say(f"hyserve: rank {me}: failed:\n{traceback.format_exc()}")
        return 1
    if jit.compiles_after_ready:
        say(f"hyserve: rank {me}: {jit.compiles_after_ready} Triton compilations after ready (warm-up gaps)")
    destroy_distributed()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hyserve.engine.lifecycle.worker --rank R --world-size W --init-method tcp://...`
    (config on stdin)."""
    p = argparse.ArgumentParser(prog="hyserve-worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--init-method", required=True)
    args = p.parse_args(argv)
    # Ctrl-C reaches the whole process group; rank 0 shuts the ranks down in order
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = pickle.load(sys.stdin.buffer)
    if not isinstance(config, EngineConfig):
        raise SystemExit(
            f"hyserve-worker: expected a pickled EngineConfig on stdin, got {type(config).__name__}"
        )
    rc = run_worker(config, rank=args.rank, world_size=args.world_size, init_method=args.init_method)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # a broken NCCL communicator can block interpreter teardown


if __name__ == "__main__":
    main()
