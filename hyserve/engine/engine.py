"""`LLMEngine`: the synchronous core. One `step()` reads like its description:

    schedule -> launch (forward + sampling on the device) -> read the previous step -> emit

With async scheduling (default) a step's samples stay on the device while the next step is planned and
launched, fed those samples on the device; the host reads them after, so stop checks, detokenising,
the caller's streaming and the next step's set-up run while the GPU computes:

    host:  launch N | read N-1, emit | launch N+1 | read N, emit | launch N+2 | ...
    GPU:        [ step N          ][ step N+1         ][ step N+2 ...

Without it the same loop reads each step right after launching it. Only the scheduler composes steps
(it counts each request's unread tokens); the engine validates (`InputProcessor`), runs (`ModelRunner`)
and turns tokens into deltas (`OutputProcessor`). A step that raises fails only the request that makes it
fail, and a host-side failure of one request's output fails it alone (`FailureIsolation`). Built by
`startup.start_engine`: construct, warm up, mark ready (docs/architecture.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from hyserve import envs
from hyserve.config import EngineConfig
from hyserve.engine.assembly.assemble import assemble
from hyserve.engine.engine_stats import engine_stats
from hyserve.engine.errors import JitAfterReadyError
from hyserve.engine.faults import FaultInjector
from hyserve.engine.input_processor import InputProcessor
from hyserve.engine.isolation import FailureIsolation
from hyserve.engine.output_processor import OutputProcessor, record_prompt_logprobs
from hyserve.engine.outputs import StreamDelta
from hyserve.engine.pending_step import PendingStep, grammar_masks, penalty_inputs, sample_step
from hyserve.engine.request import Request
from hyserve.engine.runner.alloc_retries import AllocRetries
from hyserve.engine.runner.jit_sentinel import JitSentinel
from hyserve.engine.sampling.sampler import Sampler
from hyserve.engine.sampling.structured_output import StructuredOutputs
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler.scheduler import ScheduledBatch, SchedulerStats
from hyserve.engine.scheduler.step_cost import StepCostModel
from hyserve.engine.speculative.verify import SampledRun, sampling_rows
from hyserve.engine.warmup_report import WarmupReport

logger = logging.getLogger("hyserve")
# the engine's own counters (stats(), /metrics); isolation keeps its own (`FailureIsolation.counters`)
COUNTERS = (
    "prompt_tokens_total generation_tokens_total requests_finished_total request_failures_total "
    "overlapped_steps_total steps_total prefill_steps_total prefill_tokens_scheduled_total"
).split()


class LLMEngine:
    def __init__(self, config: EngineConfig, *, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._log = log or logger.info
        self.jit = JitSentinel()
        self.jit.install()
        parts = assemble(config, self._log)
        self.config = config = parts.config  # an unset max_batch_size / max_num_tokens is sized now
        self.loaded = parts.loaded
        self.model_config = parts.loaded.config
        self.tokenizer = parts.loaded.tokenizer
        self.device = parts.loaded.device
        self.max_seq_len = parts.max_seq_len
        self.graph_sizes = parts.graph_sizes
        self.activations = parts.activations
        self.plan = parts.plan
        self.cache_tensors = parts.cache_tensors
        self.cache = parts.cache
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.inputs = InputProcessor(
            vocab_size=self.model_config.vocab_size,
            max_seq_len=self.max_seq_len,
            plan=self.plan,
            scheduler=config.scheduler,
        )
        self.outputs = OutputProcessor(
            tokenizer=self.tokenizer,
            eos_token_ids=self.model_config.eos_token_ids,
            max_seq_len=self.max_seq_len,
        )
        self.sampler = Sampler(config.seed)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size)  # per request
        self._inflight: PendingStep | None = None
        self.requests: dict[str, Request] = {}
        self.alloc_retries = AllocRetries(self.device)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.faults = FaultInjector.parse(envs.HYSERVE_FAULT_INJECT)  # None unless set (engine/faults.py)
        self.isolation = FailureIsolation(self)  # a step that raises fails only its culprit
        self.warmup_report: WarmupReport | None = None  # set by the start-up (lifecycle/startup.py)
        self.spec = parts.speculation  # speculative decoding (engine/speculative/), None when off
        self._log(self.capacity_report())

    def record_warmup(self, report: WarmupReport) -> None:
        self.warmup_report = report

    def use_step_cost(self, cost: StepCostModel | None) -> None:
        """The scheduler's step cost model (calibrated or counted at start-up; None: chunks by tokens
        alone)."""
        self.scheduler.cost = cost

    def mark_ready(self) -> None:
        """From here on, any Triton compilation is a variant the warm-up did not cover."""
        self.jit.mark_ready()

    def capacity_report(self) -> str:
        return self.plan.report()

    # ---- requests ---------------------------------------------------------------------------------
    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Raise RequestRejected for a request that must not enter the engine (GrammarError, a ValueError, for
        a structured-outputs spec that cannot compile)."""
        self.inputs.validate(prompt_token_ids, params, priority)
        self.structured.validate(params)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """`priority`: lower is served earlier under scheduling_policy "priority" (0 only under "fcfs")."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.inputs.validate(prompt_token_ids, params, priority)
        self.structured.add(request_id, params)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            prompt=prompt,
            priority=priority,
        )
        self.requests[request_id] = req
        self.outputs.add(req)
        self.scheduler.add(req)
        self.counters["prompt_tokens_total"] += len(prompt_token_ids)
        return req

    def abort(self, request_id: str) -> None:
        if request_id in self.requests:
            self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    # ---- the step ---------------------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """schedule -> launch -> read the previous step -> emit. Returns the deltas of every request that
        progressed (with async scheduling a step's tokens come out of the next call)."""
        # drafting needs every decoding request's newest token on the host: such steps are read at once
        drafting, sync = self.spec.step_mode(self.scheduler.running) if self.spec else (False, False)
        deltas = self.drain() if sync else []
        batch, aborted = self.scheduler.schedule(draft=drafting)
        deltas += [self._finish_delta(r) for r in aborted]
        if self.faults is not None:  # a failure outside any request's guard (AsyncEngine supervises it)
            self.faults.check_rows("engine", batch.seqs)
        prev, self._inflight = self._inflight, None
        feed = prev  # the step this batch's device-fed rows read from
        launched: PendingStep | None = None
        updated = False  # once the scheduler has taken the step in, its snapshot pins are released
        if not batch.empty:
            self._count_step(batch)
            try:
                logits = self.execute_rows(batch, prev, self.requests)
                self.scheduler.update(batch, self.requests)
                updated = True
                if prev is not None and self.structured.constrains(
                    [s.request_id for s in batch.seqs if s.sample]
                ):
                    # a grammar's next mask needs its previous token: read the in-flight step first
                    deltas += self._read(prev)
                    prev = None
                sampled = None
                if any(s.sample for s in batch.seqs):
                    sampled = self.sample_rows(batch, logits, prev, self.sampler, self.requests)
                if self.spec is not None:  # MTP: the block's passes over this step's positions
                    self.spec.on_launch(batch, sampled, self.requests, self.runner, drafting)
                if sampled is not None:
                    launched = sampled
                    launched.hold()
            except Exception as e:  # model, prompt logprobs or sampling: fail only the request that causes it
                logger.exception("model step of %d requests failed; isolating the request", len(batch.seqs))
                deltas += self.isolation.isolate(batch, feed, e, updated=updated)
        if prev is not None:
            deltas += self._read(prev)  # the previous step's tokens, while this one runs
        if launched is not None:
            if self.config.async_scheduling and not sync:
                self._inflight = launched
            else:
                deltas += self._read(launched)
        return deltas

    def _count_step(self, batch: ScheduledBatch) -> None:
        """Steps, and the prefill tokens they carried: over an interval, how many steps a long prompt took and
        how large its chunks were (`bench_fairness.py` reads them from /metrics)."""
        self.counters["steps_total"] += 1
        prefill = batch.num_prefill_tokens
        if prefill:
            self.counters["prefill_steps_total"] += 1
            self.counters["prefill_tokens_scheduled_total"] += prefill

    def execute_rows(
        self, batch: ScheduledBatch, prev: PendingStep | None, requests: dict[str, Request]
    ) -> torch.Tensor:
        """Run `batch` on the model and record its prompt logprobs into `requests` (copies for an isolation
        probe). Returns the sampling rows' logits."""
        fed = prev is not None and any(s.feed_row is not None for s in batch.seqs[: batch.num_decodes])
        if self.faults is not None:
            self.faults.check_rows("forward", batch.seqs)
        logits = self.runner.execute(batch, prev.tokens if fed and prev is not None else None)
        if fed:
            self.counters["overlapped_steps_total"] += 1
        self._check_strict_warmup()
        if self.runner.keeps_hidden:
            record_prompt_logprobs(self.runner, batch, requests)
        return logits

    def sample_rows(
        self,
        batch: ScheduledBatch,
        logits: torch.Tensor,
        prev: PendingStep | None,
        sampler: Sampler,
        requests: dict[str, Request],
    ) -> PendingStep:
        """Sample `batch`'s sampling rows with `sampler` (a throwaway one for an isolation probe)."""
        sampling, rows = sampling_rows(batch)  # a speculative step: a row per verified position
        if self.faults is not None:
            self.faults.check_rows("sample", sampling)
        histories, pending = penalty_inputs(rows, self.requests, prev)
        bitmask = grammar_masks(self.structured, rows, batch.spec_width > 1)
        return sample_step(sampler, batch, logits, requests, histories, pending, bitmask)

    def _read(self, step: PendingStep) -> list[StreamDelta]:
        deltas, runs = [], step.read()
        self.scheduler.on_read(step.batch)  # how long the step took, against its predicted time
        if self.spec is not None:  # accepted drafts (their Mamba state), the next drafts
            self.spec.on_read(step, runs, self.requests, self.runner)
        for run in runs:
            req = run.req
            if req is None:
                continue
            req.num_inflight -= 1
            # finished on an earlier token (this row was computed and is dropped), or the id now names a
            # new request
            if req.finished or self.requests.get(req.request_id) is not req:
                continue
            try:
                deltas.append(self._append_tokens(req, run))
            except Exception as e:  # token append, stop strings, detokenizer, grammar: this request alone
                logger.exception("request %s failed on the host", req.request_id)
                deltas.append(
                    self.fail_request(
                        req, f"internal error while processing this request's output: {type(e).__name__}: {e}"
                    )
                )
        return deltas

    def drain(self) -> list[StreamDelta]:
        """Read the in-flight step, if any, without launching another; returns its deltas."""
        step, self._inflight = self._inflight, None
        return self._read(step) if step is not None else []

    def _append_tokens(self, req: Request, run: SampledRun) -> StreamDelta:
        """Append a step's tokens of one request (several after accepted draft tokens) until one ends it."""
        for tok, lp in zip(run.tokens, run.logprobs):
            if self.faults is not None:
                self.faults.check("host", req.request_id, len(req.output_token_ids))
            self.counters["generation_tokens_total"] += 1
            self.structured.accept(req.request_id, tok)
            finish = self.outputs.append_token(
                req, tok, lp, grammar_done=self.structured.done(req.request_id)
            )
            if finish is not None:
                self.scheduler.finish(req, finish.reason, finish.stop_reason)
                return self._finish_delta(req)
        return self.outputs.delta(req, finished=False)

    def _finish_delta(self, req: Request) -> StreamDelta:
        self.counters["requests_finished_total"] += 1
        self.requests.pop(req.request_id, None)
        self.structured.remove(req.request_id)
        if self.spec is not None:
            self.spec.forget(req.request_id)
        return self.outputs.delta(req, finished=True)

    def fail_request(self, req: Request, error: str) -> StreamDelta:
        """Finish one request with `error` (its blocks and slot freed); its final delta."""
        req.error = error
        self.scheduler.finish(req, "error")
        self.counters["request_failures_total"] += 1
        return self._finish_delta(req)

    def reset_after_failure(self, reason: str) -> list[StreamDelta]:
        """After an exception outside a step's guards: every request ends with `reason`, the pools' books
        start afresh (the in-flight step is dropped: whatever reuses its slots is queued behind it on the
        device). Returns the final deltas."""
        self._inflight = None
        out = self.isolation.end_all(reason)
        self.requests.clear()
        self.cache = self.cache.fresh()
        self.scheduler.reset(self.cache)
        return out

    def _check_strict_warmup(self) -> None:
        new = self.jit.unreported_after_ready()
        if new and self.config.strict_warmup:
            raise JitAfterReadyError(
                f"strict_warmup: Triton compiled {', '.join(new)} after ready (a kernel variant the warm-up "
                "did not cover)"
            )

    # ---- after the warm-up, introspection ----------------------------------------------------------
    def reset_after_warmup(self) -> None:
        """Forget the warm-up: prefix cache, counters, statistics and the sampler's random stream. Called
        when idle (an in-flight step then holds only finished requests' rows)."""
        self.drain()
        self.reset_prefix_cache()
        self.cache.prefix_queries = self.cache.prefix_hits = 0
        self.scheduler.stats = SchedulerStats()
        self.counters = dict.fromkeys(self.counters, 0)
        self.isolation.reset_counters()
        if self.spec is not None:
            self.spec.reset_counters()
        self.sampler = Sampler(self.config.seed)
        if self.device.type == "cuda":
            self.alloc_retries.reset()

    def cache_usage(self) -> dict[str, int]:
        return self.cache.usage()

    def reset_prefix_cache(self) -> int:
        return self.cache.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        return engine_stats(
            self.scheduler, self.cache, self.jit, self.counters, self.isolation, self.spec, self.alloc_retries
        )
