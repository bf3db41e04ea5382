"""Containing failures (docs/architecture.md, "One step"): a step that raises fails only the request that
makes it fail, and a failure outside any step leaves an engine that can serve again.

`FailureIsolation.isolate`: the step raised in the forward, the prompt logprobs or sampling. Its rows are
rerun in halves (probes) to find the one that fails:

    n rows failed -> probe the first half: fails -> keep it | passes -> the second half is the suspect
    ... down to one row, confirmed by a probe of its own when it was only deduced: <= ceil(log2 n) + 1 probes

A probe runs the rows as the failed step planned them (no snapshot writes, prompt logprobs recorded on
copies, a throwaway sampler stream) and keeps nothing: what it writes lies in the rows' own blocks past
their computed tokens and in their own live slots. Then the innocent rows are made exact again: a prefill
chunk that read its state from zeros or a prefix snapshot, in a step the scheduler had not taken in, is
simply planned again; every other row's live Mamba state may be overwritten in place, so the request is
requeued to be recomputed like a preemption (outputs kept; prefix-cache hits where its prompt's blocks and
snapshots were published). If no single row reproduces the failure (a fault of the batch as a whole, or a
transient one), or it is strict_warmup's late compilation (the step's, not a request's), the whole batch
fails, so a failure can never loop.

`FailureIsolation.end_all` (with `LLMEngine.reset_after_failure`): an exception outside a step's guards
(scheduler, output processing) may leave the books inconsistent, so every request ends with an error and
the pools' bookkeeping starts afresh (every block and slot free, the prefix cache empty); the in-flight
step is dropped (whatever reuses its slots is queued behind it on the device).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import torch

from hyserve.config import EngineConfig
from hyserve.engine.errors import JitAfterReadyError
from hyserve.engine.output_processor import OutputProcessor
from hyserve.engine.outputs import StreamDelta
from hyserve.engine.pending_step import PendingStep
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.sampling.sampler import Sampler
from hyserve.engine.sampling.structured_output import StructuredOutputs
from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq, Scheduler

logger = logging.getLogger("hyserve")


class IsolatedEngine(Protocol):
    """What isolation calls on the engine: its books, and running / sampling rows as a step would."""

    config: EngineConfig
    requests: dict[str, Request]
    scheduler: Scheduler
    outputs: OutputProcessor
    structured: StructuredOutputs

    def fail_request(self, req: Request, error: str) -> StreamDelta: ...

    def execute_rows(
        self, batch: ScheduledBatch, prev: PendingStep | None, requests: dict[str, Request]
    ) -> torch.Tensor: ...

    def sample_rows(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        prev: PendingStep | None,
        sampler: Sampler,
        requests: dict[str, Request],
    ) -> PendingStep: ...


class FailureIsolation:
    """Contains failures for one engine, counting what it did (`counters`, in the engine's stats)."""

    def __init__(self, engine: IsolatedEngine) -> None:
        self.engine = engine
        self.step_failures = 0  # steps that raised
        self.probes = 0  # probe steps run to find a culprit
        self.restarts = 0  # failures outside any step: every request ended, the books started afresh

    def counters(self) -> dict[str, int]:
        return {
            "step_failures_total": self.step_failures,
            "isolation_probes_total": self.probes,
            "engine_restarts_total": self.restarts,
        }

    def reset_counters(self) -> None:
        self.step_failures = self.probes = self.restarts = 0

    def isolate(
        self, batch: ScheduledBatch, feed: PendingStep | None, err: Exception, *, updated: bool
    ) -> list[StreamDelta]:
        """`batch` raised `err`; `feed`: the step its device-fed decode rows read from; `updated`: the
        scheduler had taken the step in (its snapshots committed). Fails the culprit, restores the others;
        returns the failed requests' final deltas."""
        eng = self.engine
        self.step_failures += 1
        if not updated:
            eng.scheduler.discard_step(batch)  # the step's snapshots may hold garbage
        alive = [
            s for s in batch.seqs if (r := eng.requests.get(s.request_id)) is not None and not r.finished
        ]
        decodes = {s.request_id for s in batch.seqs[: batch.num_decodes]}
        # strict_warmup's late compilation is the step's, not a request's: no probe (it could compile again)
        culprit, cause = (
            (None, err)
            if isinstance(err, JitAfterReadyError)
            else self._find_culprit(alive, decodes, feed, err)
        )
        # the culprit's own failure: with two faulty requests in one step, the step's error may be the other's
        msg = f"internal error while running this request: {type(cause).__name__}: {cause}"
        if culprit is None:
            logger.error(
                "step failed (%s) and no single request of its %d fails it alone: failing them all",
                err,
                len(alive),
            )
            failed = alive
        else:
            logger.error(
                "step failed (%s); request %s fails it alone: failing it, %d others continue",
                err,
                culprit.request_id,
                len(alive) - 1,
            )
            failed = [culprit]
        out = [eng.fail_request(eng.requests[s.request_id], msg) for s in failed]
        bad = {s.request_id for s in failed}
        for s in reversed(alive):  # requeued at the front of the queue: keep their order
            if s.request_id in bad or (not updated and s.state_src != s.state_dst):
                continue  # failed, or its source state is intact: the scheduler plans the chunk again
            eng.scheduler.requeue(eng.requests[s.request_id])
        return out

    def _find_culprit(
        self, seqs: list[ScheduledSeq], decodes: set[str], feed: PendingStep | None, err: Exception
    ) -> tuple[ScheduledSeq | None, Exception]:
        """The row of `seqs` (a failed step, in batch order, that raised `err`) that fails alone, or None, and
        the error of the last step that failed with it in."""
        suspects, cause = seqs, err  # the failed step confirms the whole batch
        confirmed = True
        while len(suspects) > 1:
            half = len(suspects) // 2
            failure = self._fails(suspects[:half], decodes, feed)
            if failure is not None:
                suspects, cause, confirmed = suspects[:half], failure, True
            else:
                suspects, confirmed = suspects[half:], False
        if suspects and not confirmed:
            failure = self._fails(suspects, decodes, feed)
            if failure is None:
                return None, err
            cause = failure
        return (suspects[0], cause) if suspects else (None, err)

    def _fails(
        self, seqs: list[ScheduledSeq], decodes: set[str], feed: PendingStep | None
    ) -> Exception | None:
        """Rerun `seqs` as a step of their own, keeping nothing; the exception if it raises."""
        eng = self.engine
        self.probes += 1
        rows = [dataclasses.replace(s, snapshots=[], snapshot_keys=[], snapshot_positions=[]) for s in seqs]
        nd = sum(s.request_id in decodes for s in rows)
        # a speculative step's decode rows keep their drafts: the probe verifies them the same way
        width = max((1 + len(s.draft) for s in rows[:nd]), default=1)
        probe = ScheduledBatch(seqs=rows, num_decodes=nd, spec_width=width)
        shadow = {
            s.request_id: dataclasses.replace(r, prompt_logprobs=list(r.prompt_logprobs))
            for s in rows
            if (r := eng.requests.get(s.request_id)) is not None
        }
        try:
            logits = eng.execute_rows(probe, feed, shadow)
            if any(s.sample for s in rows):
                eng.sample_rows(probe, logits, feed, Sampler(eng.config.seed), shadow)
        except Exception as e:
            logger.info("isolation probe of %d rows failed: %s: %s", len(rows), type(e).__name__, e)
            return e
        return None

    def end_all(self, reason: str) -> list[StreamDelta]:
        """Finish every request with `reason` as its error and drop its output and grammar state; their final
        deltas. The engine then forgets them and starts its pools' books afresh."""
        eng = self.engine
        self.restarts += 1
        out = []
        for req in list(eng.requests.values()):
            req.status, req.finish_reason, req.error = RequestStatus.FINISHED, "error", reason
            try:
                out.append(eng.outputs.delta(req, finished=True))
            except Exception:  # its output state is what failed: a bare final delta
                out.append(_bare_error_delta(req, reason))
            eng.outputs.drop(req.request_id)
            eng.structured.remove(req.request_id)
        return out


def _bare_error_delta(req: Request, reason: str) -> StreamDelta:
    return StreamDelta(
        request_id=req.request_id,
        token_ids=[],
        text="",
        logprobs=None,
        finished=True,
        finish_reason="error",
        num_prompt_tokens=req.num_prompt_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_output_tokens=len(req.output_token_ids),
        error=reason,
    )
