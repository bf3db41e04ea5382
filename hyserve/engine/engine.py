"""`LLMEngine`: the synchronous core. One `step()` reads like its description:

    schedule -> run -> update -> emit

Everything else (threads, asyncio, HTTP) sits on top of `add_request` / `abort` / `step`.

Async scheduling (`async_scheduling`, on by default). A step that samples is left in flight: its tokens
(and logprob rows) stay on the device, their copies to the host start, and `step()` returns. The next
`step()` launches the following step first, feeding those tokens to it on the device, and only then
reads them and emits their deltas, so the host's work (stop checks, detokenising, the caller's
streaming, the next step's set-up) runs while the GPU computes:

    host:  launch N | read N-1, emit | launch N+1 | read N, emit | launch N+2 | ...
    GPU:        [ step N          ][ step N+1         ][ step N+2 ...

The overlapped step holds every request that sampled in the previous step (minus those whose last token
that was: max_tokens, max_seq_len), one block position on and fed its sample on the device; the next
chunk of each prompt still being fed; and the queue's admissions (first come, first served, as the
scheduler admits). It is planned only when nothing needs the scheduler's judgement: no pending abort, no
running request outside the previous step, blocks free without preempting. A penalty row's history is
the host's lists plus its in-flight token, counted on the device. Otherwise the in-flight step is read
first and a normal step follows. A request that stops on that token (EOS, stop string) has computed one
extra row, which is dropped; its slot and blocks are freed only after, and any later use of them is
queued behind it on the same stream. Outputs are those of the synchronous engine as far as batching
leaves a row's logits alone (the CPU tests check greedy and seeded rows token for token): an extra row
changes a step's batch size, as any batching difference does; unseeded rows draw from the same stream,
which extra rows can shift; a prompt's last token left over by a budget cut runs as a one-token prefill
row (the scheduler makes it a decode row unless the prompt's end is a snapshot boundary).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hyserve import envs
from hyserve.cache.capacity import CapacityInputs, CapacityPlan, plan_capacity
from hyserve.cache.manager import HybridCacheManager
from hyserve.config import EngineConfig
from hyserve.engine.cuda_graphs import DecodeGraphs, default_capture_sizes
from hyserve.engine.errors import JitAfterReadyError, RequestRejected
from hyserve.engine.jit_sentinel import JitSentinel
from hyserve.engine.logits_processing import to_device
from hyserve.engine.memory_profile import ActivationProfile, profile_activations
from hyserve.engine.model_loader import LoadedModel, load_model
from hyserve.engine.outputs import StreamDelta, TokenLogprob
from hyserve.engine.request import Request, RequestStatus
from hyserve.engine.runner import ModelRunner
from hyserve.engine.sampler import PendingLogprobs, Sampler
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.scheduler import ScheduledBatch, ScheduledSeq, Scheduler, SchedulerStats
from hyserve.engine.warmup import Warmup, WarmupReport, use_kernel_cache_dir
from hyserve.model.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("hyserve")

DEFAULT_CPU_CACHE_BYTES = 512 * 2**20


@dataclass
class _OutputState:
    """Per-request text state: incremental detokenizer and the stop-string hold-back."""

    detok: IncrementalDetokenizer | None
    text: str = ""  # all text so far (stop strings trimmed at finish)
    emitted: int = 0  # characters of `text` already handed out
    tokens_emitted: int = 0
    logprobs_emitted: int = 0
    prompt_logprobs_emitted: bool = False


@dataclass
class _InFlight:
    """A step whose sampled tokens are still on the device (async scheduling)."""

    batch: ScheduledBatch
    sampling: list[ScheduledSeq]  # its sequences that sample, in logits-row order
    reqs: list[Request | None]  # each row's request when launched (an id may be reused once it finished)
    tokens: torch.Tensor  # [rows] long, on the device
    host: torch.Tensor  # their host copy (pinned, filled without waiting on CUDA)
    logprobs: PendingLogprobs | None  # the rows that want logprobs: their table, copied likewise
    logprobs_host: torch.Tensor | None
    done: torch.cuda.Event | None  # recorded after the copies (CUDA)


class LLMEngine:
    def __init__(self, config: EngineConfig, *, log: Callable[[str], None] | None = None) -> None:
        self.config = config
        self._log = log or logger.info
        t0 = time.monotonic()
        self.jit = JitSentinel()
        self.jit.install()
        self._jit_seen = 0  # compilations after ready already reported (strict_warmup)
        self._log("hyserve: loading model ...")
        self.loaded: LoadedModel = load_model(config)
        lm = self.loaded
        self.model_config = lm.config
        self.tokenizer = lm.tokenizer
        self.device = lm.device
        if lm.device.type == "cuda":
            d = use_kernel_cache_dir(Path(config.cache_dir) if config.cache_dir else envs.HYSERVE_CACHE_DIR)
            self._log(f"hyserve: kernel cache: {d}")
        if lm.device.type == "cpu" and torch.get_num_threads() <= 2:
            torch.set_num_threads(1)  # 2 threads on 2-core machines were 2-50x slower (DESIGN.md)
        self._log(
            f"hyserve: {lm.name}: {lm.config.describe()}, {str(lm.dtype).removeprefix('torch.')} on "
            f"{lm.device} ({time.monotonic() - t0:.1f}s)"
        )
        sc = config.scheduler
        self.max_seq_len = sc.max_seq_len or lm.config.max_position_embeddings
        self.graph_sizes = self._graph_sizes()
        self.activations: ActivationProfile | None = None
        if lm.device.type == "cuda":
            self.activations = profile_activations(
                lm.model, lm.device, max_num_tokens=sc.max_num_tokens, max_batch_size=sc.max_batch_size,
                graph_batch_size=max(self.graph_sizes, default=0) or sc.max_batch_size,
                tokens_per_block=config.cache.tokens_per_block,
            )
            self._log(
                f"hyserve: activation peak (profiled): {self.activations.prefill_peak_bytes / 2**20:,.0f} MiB for "
                f"a {sc.max_num_tokens}-token step, {self.activations.decode_peak_bytes / 2**20:,.0f} MiB for a "
                "decode step"
            )
        self.plan: CapacityPlan = plan_capacity(self._capacity_inputs())
        self.cache_tensors = lm.model.allocate_cache(
            num_blocks=self.plan.num_kv_blocks,
            tokens_per_block=config.cache.tokens_per_block,
            num_slots=self.plan.num_live_slots + self.plan.num_pad_slots + self.plan.num_snapshot_slots,
            device=lm.device,
        )
        ms = config.cache.mamba_state_config
        self.cache = HybridCacheManager(
            self.plan,
            has_mamba=lm.config.has_recurrent_state,
            enable_block_reuse=config.cache.enable_block_reuse,
            snapshot_interval=ms.periodic_snapshot_interval,
            snapshot_offsets_from_end=ms.additional_snapshot_offsets_from_end,
        )
        self.scheduler = Scheduler(
            self.cache,
            max_batch_size=sc.max_batch_size,
            max_num_tokens=sc.max_num_tokens,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            chunk_size=lm.config.chunk_size,
        )
        self.runner = ModelRunner(lm.model, self.cache_tensors, lm.device)
        if self.graph_sizes:
            g = DecodeGraphs(
                lm.model, self.cache_tensors, lm.device, sizes=self.graph_sizes,
                max_blocks_per_seq=min(self.plan.num_kv_blocks, -(-self.max_seq_len // config.cache.tokens_per_block)),
                pad_slot=self.cache.states.pad_slots[0],
                enable_padding=config.cuda_graph.enable_padding,
                capture=lm.device.type == "cuda",  # elsewhere the same static-buffer steps run eagerly
            )
            self.runner.graphs = g
            self._log(
                f"hyserve: captured {len(g.sizes)} decode CUDA graphs (batch sizes {g.sizes[0]}..{g.sizes[-1]}) in "
                f"{g.capture_seconds:.1f}s, {g.graph_bytes / 2**20:,.0f} MiB"
            )
        self.sampler = Sampler(config.seed)
        self._inflight: _InFlight | None = None
        self.requests: dict[str, Request] = {}
        self._outputs: dict[str, _OutputState] = {}
        self._alloc_retries_base = 0
        self._allocator: tuple[float, int] = (0.0, 0)  # (when read, num_alloc_retries)
        self.counters = {
            "prompt_tokens_total": 0,
            "generation_tokens_total": 0,
            "requests_finished_total": 0,
            "step_failures_total": 0,
            "overlapped_steps_total": 0,  # async scheduling: steps launched with device-fed tokens
        }
        self._log(self.plan.report())
        self.warmup_report: WarmupReport | None = None
        if config.warmup == "on" or (config.warmup == "auto" and lm.device.type == "cuda"):
            self.warmup_report = Warmup(self, log=self._log).run()
            self._log(self.warmup_report.summary())
        # from here on, any Triton compilation is a variant the warm-up did not cover
        self.jit.mark_ready()

    # ---- set-up -----------------------------------------------------------------------------------
    def _capacity_inputs(self) -> CapacityInputs:
        c = self.config.cache
        cfg = self.model_config
        return CapacityInputs(
            budget_bytes=self._cache_budget_bytes(),
            kv_bytes_per_token=cfg.kv_bytes_per_token,
            state_bytes_per_slot=cfg.state_bytes_per_sequence,
            max_batch_size=self.config.scheduler.max_batch_size,
            max_seq_len=self.max_seq_len,
            max_num_tokens=self.config.scheduler.max_num_tokens,
            tokens_per_block=c.tokens_per_block,
            enable_block_reuse=c.enable_block_reuse,
            periodic_snapshot_interval=c.mamba_state_config.periodic_snapshot_interval,
            num_snapshot_offsets=len(c.mamba_state_config.additional_snapshot_offsets_from_end),
            avg_seq_len=c.avg_seq_len,
            num_pad_slots=1 if self.graph_sizes else 0,
            max_kv_tokens=c.max_tokens,
            allow_oversized_max_seq_len=c.allow_oversized_max_seq_len,
        )

    def _cache_budget_bytes(self) -> int:
        c = self.config.cache
        if self.device.type == "cpu":
            return c.max_gpu_total_bytes or DEFAULT_CPU_CACHE_BYTES
        free, _total = torch.cuda.mem_get_info(self.device)
        assert self.activations is not None
        # the allocator's reserve above the profiled peaks (fragmentation, cuBLAS workspaces)
        slack = 256 * 2**20
        # each captured graph keeps its float32 logits alive in the shared graph pool, and the 16-bit
        # logits they were cast from fragment it: 6 bytes per logit matched the 1,188 MiB measured for
        # Nano 9B v2's 19 graphs (batch 1..128) on the H200 to within 2% together with the peaks below
        graph_logits = sum(self.graph_sizes) * self.model_config.vocab_size * 6
        budget = int(free * c.free_gpu_memory_fraction) - self.activations.total_bytes - graph_logits - slack
        if c.max_gpu_total_bytes is not None:
            budget = min(budget, c.max_gpu_total_bytes)
        return max(budget, 0)

    def _graph_sizes(self) -> list[int]:
        """Decode batch sizes to capture as CUDA graphs (empty: decode runs eagerly)."""
        cg = self.config.cuda_graph
        sc = self.config.scheduler
        if self.device.type != "cuda" or not cg.enabled:
            return []
        if not self.loaded.model.graph_capturable:
            self._log("hyserve: CUDA graphs off: the MoE layers dispatch experts by host-side token counts")
            return []
        limit = min(cg.max_batch_size or sc.max_batch_size, sc.max_batch_size)
        if cg.batch_sizes is None:
            return default_capture_sizes(limit)
        sizes = [b for b in cg.batch_sizes if b <= limit]
        if len(sizes) < len(cg.batch_sizes):
            self._log(f"hyserve: cuda_graph_config.batch_sizes above {limit} (max batch size) are not captured")
        return sizes

    def capacity_report(self) -> str:
        return self.plan.report()

    # ---- requests ---------------------------------------------------------------------------------
    def validate_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected / ValueError for a request that must not enter the engine."""
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestRejected("the prompt is empty; send at least one token", param="prompt", code="empty_prompt")
        vocab = self.model_config.vocab_size
        # C-speed checks first: this sees every token of million-token prompts, twice per server request
        in_range = set(map(type, prompt_token_ids)) == {int} and (
            0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab
        )
        bad = [] if in_range else [
            t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise RequestRejected(
                f"prompt token ids must be integers in [0, {vocab - 1}] (the model's vocabulary); got {bad[:5]}",
                param="prompt",
                code="invalid_token_id",
            )
        bias_bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bias_bad:
            raise RequestRejected(
                f"logit_bias token ids must be in [0, {vocab - 1}] (the model's vocabulary); got {bias_bad[:5]}",
                param="logit_bias",
                code="invalid_token_id",
            )
        total = n + params.max_tokens
        if total > self.max_seq_len:
            raise RequestRejected(
                f"this request needs {total} tokens ({n} prompt + {params.max_tokens} max_tokens), more than "
                f"max_seq_len = {self.max_seq_len}; shorten the prompt or lower max_tokens",
                param="max_tokens" if n < self.max_seq_len else "prompt",
                code="context_length_exceeded",
            )
        fit = self.plan.max_request_tokens
        if total > fit:
            raise RequestRejected(
                f"this request needs {total} tokens ({n} prompt + {params.max_tokens} max_tokens), but the KV "
                f"cache holds at most {fit} tokens for one request even when the engine is empty "
                f"(max_seq_len = {self.max_seq_len}); shorten it or give the cache more memory",
                param="prompt",
                code="request_too_large",
            )
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and n > sc.max_num_tokens:
            raise RequestRejected(
                f"the prompt has {n} tokens, more than max_num_tokens = {sc.max_num_tokens} with chunked "
                "prefill disabled; enable_chunked_prefill or raise max_num_tokens",
                param="prompt",
                code="context_length_exceeded",
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, prompt: str | None = None
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate_request(prompt_token_ids, params)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            prompt=prompt,
        )
        self.requests[request_id] = req
        detok = (
            self.tokenizer.incremental_detokenizer(
                prompt_ids=prompt_token_ids, skip_special_tokens=params.skip_special_tokens
            )
            if self.tokenizer is not None
            else None
        )
        self._outputs[request_id] = _OutputState(detok=detok)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]  # the first prompt token has no context to be predicted from
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
        """schedule -> run -> update -> emit. Returns the deltas of every request that progressed (with
        async scheduling, a decode step's tokens come out of the next call; see the module docstring)."""
        if self._inflight is not None:
            return self._step_overlapped()
        return self._step_sync()

    def _step_sync(self) -> list[StreamDelta]:
        batch, aborted = self.scheduler.schedule()
        deltas = [self._finish_delta(r) for r in aborted]
        if batch.empty:
            return deltas
        updated = False  # once the scheduler has taken the step in, its snapshot pins are released
        try:
            logits = self._execute(batch)
            self.scheduler.update(batch, self.requests)
            updated = True
            sampling = [s for s in batch.seqs if s.sample]
            histories = self._histories(sampling)
            if self._can_defer(batch):
                self._inflight = self._defer(batch, logits, histories)
                return deltas
            tokens, lps = self.sampler.sample(
                logits, [s.params for s in sampling], [s.num_output_tokens for s in sampling], histories
            )
        except Exception as e:  # one bad batch (model, prompt logprobs or sampling) must not take the engine down
            logger.exception("model step failed; failing the %d requests of this batch", len(batch.seqs))
            self.counters["step_failures_total"] += 1
            return deltas + self._fail_batch(batch, e, discard=not updated)
        for seq, tok, lp in zip(sampling, tokens, lps):
            req = self.requests.get(seq.request_id)
            if req is None or req.finished:
                continue
            deltas.append(self._append_token(req, tok, lp))
        return deltas

    def _execute(self, batch: ScheduledBatch, feed: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Run `batch` on the model (`ModelRunner.execute`) and read its prompt logprobs while the runner
        keeps the hidden states. Returns the sampling rows' logits."""
        logits = self.runner.execute(batch, feed)
        self._check_strict_warmup()
        if self.runner.kept is not None:
            try:
                self._record_prompt_logprobs(batch)
            finally:
                self.runner.kept = None
        return logits

    def _histories(self, sampling: list[ScheduledSeq]) -> list[tuple[list[int], list[int]] | None] | None:
        """Penalties: the prompt and output ids each sampling row has seen (host lists), or None."""
        if not any(s.params.needs_history for s in sampling):
            return None
        out: list[tuple[list[int], list[int]] | None] = []
        for s in sampling:
            req = self.requests.get(s.request_id)
            out.append((req.prompt_token_ids, req.output_token_ids)
                       if req is not None and s.params.needs_history else None)
        return out

    # ---- async scheduling -------------------------------------------------------------------------
    def _can_defer(self, batch: ScheduledBatch) -> bool:
        """Whether this step's tokens may stay on the device: any step that samples (logprob rows are read
        with the tokens; a penalty row's newest token is counted on the device)."""
        return self.config.async_scheduling and any(s.sample for s in batch.seqs)

    def _defer(self, batch: ScheduledBatch, logits: torch.Tensor,
               histories: list[tuple[list[int], list[int]] | None] | None = None,
               pending: torch.Tensor | None = None) -> _InFlight:
        """Sample `batch`'s sampling rows (and their logprobs) on the device and start the copies to the
        host; nothing here waits for the device. `histories`/`pending`: the penalty rows' host history and
        the token of each row still on the device (`Sampler.sample_tokens`)."""
        sampling = [s for s in batch.seqs if s.sample]
        params = [s.params for s in sampling]
        tokens = self.sampler.sample_tokens(logits, params, [s.num_output_tokens for s in sampling],
                                            histories, pending)
        lp = self.sampler.pending_logprobs(logits, tokens, params)
        reqs = [self.requests.get(s.request_id) for s in sampling]
        if not tokens.is_cuda:
            return _InFlight(batch, sampling, reqs, tokens, tokens, lp, lp.table if lp is not None else None, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        lp_host = None
        if lp is not None:
            lp_host = torch.empty(lp.table.shape, dtype=lp.table.dtype, pin_memory=True)
            lp_host.copy_(lp.table, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(tokens.device))
        return _InFlight(batch, sampling, reqs, tokens, host, lp, lp_host, done)

    def _plan_overlapped(self, prev: _InFlight) -> tuple[ScheduledBatch, list[int]] | None:
        """The step after the in-flight one, planned without its tokens: each request that sampled there,
        one position on (less those that token finishes for certain), fed that sample on the device; the
        next chunk of each request still in prefill; then admissions. Returns the batch and, per decode
        row, its row of the in-flight samples. None when the scheduler must decide (an abort, a request
        of neither kind, blocks short without preempting)."""
        sched = self.scheduler
        if sched.has_pending_aborts():
            return None
        in_prev = {s.request_id for s in prev.batch.seqs}
        if any(r.request_id not in in_prev for r in sched.running):
            return None  # a running request that the in-flight step left out needs the scheduler
        decodes: list[ScheduledSeq] = []
        rows: list[int] = []
        for i, seq in enumerate(prev.sampling):
            req = self.requests.get(seq.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            # after the in-flight token: len(outputs) + 1 outputs, num_tokens + 1 tokens
            if len(req.output_token_ids) + 1 >= req.params.max_tokens or req.num_tokens + 1 >= self.max_seq_len:
                continue
            pos = seq.start_pos + len(seq.token_ids)
            if not self.cache.grow(req.block_ids, pos + 1):
                return None  # out of blocks: the scheduler decides whom to preempt
            assert req.live_slot is not None
            decodes.append(ScheduledSeq(
                request_id=req.request_id, token_ids=[0], start_pos=pos, block_ids=list(req.block_ids),
                state_src=req.live_slot, state_dst=req.live_slot, sample=True, snapshots=[],
                params=req.params, num_output_tokens=seq.num_output_tokens + 1,
            ))
            rows.append(i)
        budget = sched.max_num_tokens - len(decodes)
        feeding = [self.requests.get(s.request_id) for s in prev.batch.seqs if not s.sample]
        # prompts still being fed: their next chunks (host tokens), all or none
        prefills = sched.plan_continuations(
            [r for r in feeding if r is not None and r.status is RequestStatus.RUNNING], budget)
        if prefills is None:
            return None
        prefills += sched.admit(budget - sum(len(p.token_ids) for p in prefills))
        if not decodes and not prefills:
            return None
        return ScheduledBatch(seqs=decodes + prefills, num_decodes=len(decodes)), rows

    def _step_overlapped(self) -> list[StreamDelta]:
        prev = self._inflight
        assert prev is not None
        self._inflight = None
        planned = self._plan_overlapped(prev)
        failure: tuple[ScheduledBatch, Exception] | None = None
        updated = False  # once the scheduler has taken the step in, its snapshot pins are released
        if planned is not None:
            batch, rows = planned
            try:
                logits = self._execute(batch, feed=(prev.tokens, rows))
                self.scheduler.update(batch, self.requests)
                updated = True
                self.scheduler.stats.tokens_scheduled = batch.num_tokens
                sampling = [s for s in batch.seqs if s.sample]
                histories = self._histories(sampling)  # without the in-flight tokens, which are on the device:
                pending = None
                if histories is not None:
                    pending = torch.full((len(sampling),), -1, dtype=torch.long, device=prev.tokens.device)
                    if rows:
                        pending[: len(rows)] = prev.tokens.index_select(
                            0, to_device(torch.tensor(rows, dtype=torch.long), prev.tokens.device))
                if sampling:
                    self._inflight = self._defer(batch, logits, histories, pending)
                self.counters["overlapped_steps_total"] += 1
            except Exception as e:  # one bad batch must not take the engine down
                logger.exception("model step failed; failing the %d requests of this batch", len(batch.seqs))
                self.counters["step_failures_total"] += 1
                failure = (batch, e)
        deltas = self._read_inflight(prev)  # the previous step's tokens, while this one runs
        if failure is not None:
            deltas += self._fail_batch(*failure, discard=not updated)
        if planned is None:
            deltas += self._step_sync()
        return deltas

    def _read_inflight(self, step: _InFlight) -> list[StreamDelta]:
        if step.done is not None:
            step.done.synchronize()
        tokens = [int(t) for t in step.host.tolist()]
        lps: list[TokenLogprob | None] = [None] * len(tokens)
        if step.logprobs is not None and step.logprobs_host is not None:
            lps = step.logprobs.entries(tokens, step.logprobs_host.tolist())
        deltas = []
        for req, tok, lp in zip(step.reqs, tokens, lps):
            # finished on the step before (its row here was computed and is dropped), or its id now names
            # a new request
            if req is None or req.finished or self.requests.get(req.request_id) is not req:
                continue
            deltas.append(self._append_token(req, tok, lp))
        return deltas

    def drain(self) -> list[StreamDelta]:
        """Read the in-flight step, if any, without launching another; returns its deltas."""
        step, self._inflight = self._inflight, None
        return self._read_inflight(step) if step is not None else []

    def _record_prompt_logprobs(self, batch: ScheduledBatch) -> None:
        """For each prefill chunk that wants prompt logprobs: the logprob of every prompt token its
        positions predict (position p predicts token p + 1), skipping those already recorded (a chunk
        recomputed after a preemption)."""
        for row, seq in enumerate(batch.seqs):
            if row < batch.num_decodes or seq.params.prompt_logprobs is None:
                continue
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            rec = req.prompt_logprobs
            first = max(len(rec), seq.start_pos + 1)  # first prompt position to fill
            last = min(seq.start_pos + len(seq.token_ids), req.num_prompt_tokens - 1)  # inclusive
            if last < first:
                continue
            targets = req.prompt_token_ids[first : last + 1]
            rec.extend(self.runner.prompt_logprobs(row, first - 1 - seq.start_pos, targets,
                                                   seq.params.prompt_logprobs))

    def _check_strict_warmup(self) -> None:
        n = self.jit.compiles_after_ready
        if n > self._jit_seen:
            new = [ev.kernel for ev in self.jit.events if ev.after_ready][self._jit_seen :]
            self._jit_seen = n
            if self.config.strict_warmup:
                raise JitAfterReadyError(
                    f"strict_warmup: Triton compiled {', '.join(new)} after ready (a kernel variant the "
                    "warm-up did not cover)"
                )

    def reset_after_warmup(self) -> None:
        """Forget the warm-up: prefix cache, counters, statistics and the sampler's random stream. Called
        when idle (an in-flight step then holds only finished requests' rows)."""
        self.drain()
        self.reset_prefix_cache()
        self.cache.prefix_queries = self.cache.prefix_hits = 0
        self.scheduler.stats = SchedulerStats()
        self.counters = dict.fromkeys(self.counters, 0)
        self.sampler = Sampler(self.config.seed)
        if self.device.type == "cuda":
            self._alloc_retries_base = self._alloc_retries(max_age=0.0)

    def _alloc_retries(self, max_age: float = 1.0) -> int:
        """torch's count of allocations that failed, freed the caching allocator's blocks and retried
        (each one synchronises the device: a sign the activation headroom is too small). Read at most
        once per `max_age` seconds: memory_stats() builds a large dict."""
        now = time.monotonic()
        if now - self._allocator[0] >= max_age:
            self._allocator = (now, int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)))
        return self._allocator[1]

    def _fail_batch(self, batch: ScheduledBatch, err: Exception, *, discard: bool = True) -> list[StreamDelta]:
        """Finish every request of `batch` with an error. `discard`: the model did not complete the step, so
        its snapshots are dropped (False once the scheduler has taken the step in: they were written)."""
        if discard:
            self.scheduler.discard_step(batch)
        out = []
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is None or req.finished:
                continue
            req.error = f"internal error while running the model: {type(err).__name__}: {err}"
            self.scheduler.finish(req, "error")
            out.append(self._finish_delta(req))
        return out

    def _append_token(self, req: Request, tok: int, lp: TokenLogprob | None) -> StreamDelta:
        p = req.params
        st = self._outputs[req.request_id]
        req.output_token_ids.append(tok)
        if lp is not None:
            req.output_logprobs.append(lp)
        self.counters["generation_tokens_total"] += 1
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else self.model_config.eos_token_ids
        reason: str | None = None
        stop_reason: int | str | None = None
        if tok in p.stop_token_ids:
            reason, stop_reason = "stop", tok
        elif not p.ignore_eos and tok in eos:
            reason, stop_reason = "stop", tok
        else:
            if st.detok is not None:
                st.text += st.detok.feed(tok)
            hit = self._find_stop(st.text, st.emitted, p)
            if hit is not None:
                idx, s = hit
                st.text = st.text[: idx + (len(s) if p.include_stop_str_in_output else 0)]
                reason, stop_reason = "stop", s
        if reason is None and len(req.output_token_ids) >= p.max_tokens:
            reason = "length"
        if reason is None and req.num_tokens >= self.max_seq_len:
            reason = "length"
        if reason is not None:
            if not isinstance(stop_reason, str) and st.detok is not None:
                st.text += st.detok.flush()  # release a held-back partial character
            self.scheduler.finish(req, reason, stop_reason)
            return self._finish_delta(req)
        return self._delta(req, finished=False)

    @staticmethod
    def _find_stop(text: str, emitted: int, p: SamplingParams) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in p.stop:
            i = text.find(s, max(0, emitted - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        return best

    def _delta(self, req: Request, *, finished: bool) -> StreamDelta:
        st = self._outputs[req.request_id]
        p = req.params
        if finished:
            upto = len(st.text)
        else:
            # hold back a possible stop-string prefix so it never reaches the client
            hold = max((len(s) - 1 for s in p.stop), default=0)
            upto = max(st.emitted, len(st.text) - hold)
        text = st.text[st.emitted : upto]
        st.emitted = upto
        toks = req.output_token_ids[st.tokens_emitted :]
        st.tokens_emitted = len(req.output_token_ids)
        lps = None
        if p.logprobs is not None:
            lps = req.output_logprobs[st.logprobs_emitted :]
            st.logprobs_emitted = len(req.output_logprobs)
        plps = None
        if (p.prompt_logprobs is not None and not st.prompt_logprobs_emitted
                and len(req.prompt_logprobs) == req.num_prompt_tokens):
            plps = list(req.prompt_logprobs)
            st.prompt_logprobs_emitted = True
        return StreamDelta(
            request_id=req.request_id,
            token_ids=toks,
            text=text,
            logprobs=lps,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            num_output_tokens=len(req.output_token_ids),
            stop_reason=req.stop_reason if finished else None,
            error=req.error if finished else None,
            prompt_logprobs=plps,
        )

    def _finish_delta(self, req: Request) -> StreamDelta:
        self.counters["requests_finished_total"] += 1
        d = self._delta(req, finished=True)
        self.requests.pop(req.request_id, None)
        self._outputs.pop(req.request_id, None)
        return d

    # ---- introspection ----------------------------------------------------------------------------
    def cache_usage(self) -> dict[str, int]:
        return self.cache.usage()

    def reset_prefix_cache(self) -> int:
        return self.cache.reset_prefix_cache()

    def stats(self) -> dict[str, float]:
        u = self.cache.usage()
        s = self.scheduler.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            **u,
            "prefix_cache_queries": self.cache.prefix_queries,
            "prefix_cache_hits": self.cache.prefix_hits,
            "tokens_scheduled_last_step": s.tokens_scheduled,
            "num_preemptions": s.num_preemptions,
            "jit_compiles_after_ready": self.jit.compiles_after_ready,
            **self.counters,
            **({"cuda_alloc_retries": self._alloc_retries() - self._alloc_retries_base}
               if self.device.type == "cuda" else {}),
        }
