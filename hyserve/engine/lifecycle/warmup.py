"""`Warmup`: before the engine reports ready, drive it through every kind of step serving can produce,
so every Triton kernel variant is compiled (or loaded from the persistent cache) up front.

Triton compiles one variant per combination of constexprs (fixed by the model shape and the cache
dtypes), integer specialisations (token counts and batch sizes are `do_not_specialize`) and pointer
alignment (16 bytes). Within a step the kernels see slices of packed buffers: the prefill part starts
after the `num_decodes` decode rows, so its alignment depends on num_decodes modulo 8. The cases:

    prefill, 1 sequence     1 token | chunk_size | chunk_size + 3 | the full token budget
    chunked continuation    a prompt longer than max_num_tokens (second chunk starts from a state)
    prefix-cache hits       a repeated prompt (initial state from a snapshot, snapshot writes)
    multi-sequence prefill  several lengths in one step, with and without initial states
    mixed steps             d decodes + 1 prefill for d = 1 .. 16 (every alignment residue); through the
                            piecewise graphs' buffers, and eagerly too when steps above their largest size
                            run eagerly (max_num_tokens beyond it)
    decode                  eager decode (graphs cover their own sizes at capture)
    speculative verify      (speculative decoding on) steps whose decode rows carry full drafts: 1 and 8
                            sequences, and beside a prefill
    sampling                greedy, temperature, top-k, top-p, min-p, seeded, logprobs, and all mixed

Each case runs through the real scheduler and runner with throwaway requests, so it exercises exactly
the code serving runs. A case that fails (e.g. out of memory for a shape) is reported and skipped;
the rest still run. Afterwards the prefix cache, counters and the sampler's generator are reset, so the
warm-up leaves no trace in results.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import torch

from hyserve.engine.engine import LLMEngine
from hyserve.engine.request import Request
from hyserve.engine.sampling_params import SamplingParams
from hyserve.engine.warmup_report import WarmupReport
from hyserve.kernels import ops
from hyserve.kernels.token_bitmask import bitmask_width

logger = logging.getLogger("hyserve")

GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SAMPLING_CASES: tuple[tuple[str, SamplingParams], ...] = (
    ("greedy", SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)),
    ("temperature", SamplingParams(max_tokens=2, temperature=0.8, ignore_eos=True)),
    ("top-k", SamplingParams(max_tokens=2, temperature=0.8, top_k=20, ignore_eos=True)),
    ("top-p", SamplingParams(max_tokens=2, temperature=0.8, top_p=0.9, ignore_eos=True)),
    ("min-p", SamplingParams(max_tokens=2, temperature=0.8, min_p=0.05, ignore_eos=True)),
    ("seeded", SamplingParams(max_tokens=2, temperature=0.8, seed=1, ignore_eos=True)),
    ("logprobs", SamplingParams(max_tokens=2, temperature=0.0, logprobs=5, ignore_eos=True)),
)
MAX_MIXED_DECODES = 16


class Warmup:
    def __init__(self, engine: LLMEngine, *, log: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self._log = log or logger.info
        self._n = 0
        cfg = engine.model_config
        self._gen = torch.Generator().manual_seed(0)
        self._vocab = cfg.vocab_size
        self._low = min(3, cfg.vocab_size - 1)
        self._longest = 1  # the longest prompt a case may send (set by cases())

    # ---- the cases ------------------------------------------------------------------------------------
    def cases(self) -> list[tuple[str, Callable[[], None]]]:
        e = self.engine
        sc = e.config.scheduler
        # the sized limits (the config leaves them None when they are sized from memory)
        max_tokens, max_batch = e.scheduler.max_num_tokens, e.scheduler.max_batch_size
        C = e.model_config.chunk_size
        fit = e.plan.max_request_tokens - 2  # room for the generated tokens
        if not sc.enable_chunked_prefill:  # a prompt must then fit one step
            fit = min(fit, max_tokens)
        self._longest = fit
        budget = min(max_tokens, fit)
        out: list[tuple[str, Callable[[], None]]] = []

        def add(name: str, fn: Callable[[], None]) -> None:
            out.append((name, fn))

        # one sequence of each length; on CUDA also a step of each token bucket whose kernel variants
        # differ (MoE tile configs)
        buckets = e.loaded.model.kernel_token_buckets(budget) if e.device.type == "cuda" else []
        for n in sorted({1, C, C + 3, budget, *buckets}):
            if 1 <= n <= fit:
                add(f"prefill 1 x {n} tokens", partial(self._run, [n]))
        if sc.enable_chunked_prefill and max_tokens + C + 7 <= fit:
            n = max_tokens + C + 7
            add(f"chunked prefill of {n} tokens", partial(self._run, [n]))
        if e.config.cache.enable_block_reuse:
            add("prefix-cache hit", self._prefix_hit)
        lens = [n for n in (1, C, C + 5, 2 * C + 1) if n <= fit]
        if sum(lens) <= max_tokens and len(lens) <= max_batch:
            add(f"prefill {len(lens)} sequences", lambda: self._run(lens))
        if sc.enable_chunked_prefill and 2 * (max_tokens + C + 7) <= fit and max_batch >= 2:
            n = max_tokens + C + 7  # two continuing prefills sharing steps
            add(f"two chunked prefills of {n} tokens together", partial(self._run, [n, n]))
        for d in range(1, min(MAX_MIXED_DECODES, max_batch - 1) + 1):
            add(f"mixed step: {d} decodes + 1 prefill", partial(self._mixed, d))
        mixed_graphs = e.runner.mixed_graphs
        if mixed_graphs is not None and mixed_graphs.sizes[-1] < max_tokens:
            # steps above the largest piecewise size run eagerly, their cores on views of the projections'
            # outputs rather than the graphs' buffers: that layout's alignments too
            for d in range(1, min(MAX_MIXED_DECODES, max_batch - 1) + 1):
                add(f"eager mixed step: {d} decodes + 1 prefill", partial(self._eager_mixed, d))
        add("eager decode", self._eager_decode)
        if e.spec is not None:
            for n in sorted({1, min(8, max_batch, e.spec.max_batch)}):
                add(f"speculative verify: {n} x {e.spec.k} draft tokens", partial(self._verify, n))
            add("speculative verify beside a prefill", partial(self._verify, 1, prefill=True))
        for name, p in SAMPLING_CASES:
            add(f"sampling: {name}", partial(self._run, [8], params=p))
        mix = [p for _, p in SAMPLING_CASES][:max_batch]
        add("sampling: mixed batch", lambda: self._run([8] * len(mix), params=mix))
        if e.device.type == "cuda":
            add("structured outputs: token mask", self._token_mask)
        return out

    def run(self) -> WarmupReport:
        rep = WarmupReport()
        jit = self.engine.jit
        t0 = time.monotonic()
        cases = self.cases()
        for i, (name, fn) in enumerate(cases, 1):
            t = time.monotonic()
            before = len(jit.events)
            why = self._guarded(fn)
            new = len(jit.events) - before
            status = "ok" if why is None else f"FAILED: {why}"
            self._log(
                f"hyserve: warm-up [{i}/{len(cases)}] {name}: {status} ({time.monotonic() - t:.2f}s, "
                f"{new} kernel variants)"
            )
            if why is None:
                rep.cases.append(name)
            else:
                rep.failed.append((name, why))
        self.engine.reset_after_warmup()
        # everything since the engine started: the profiling run and graph capture compile too
        events = [ev for ev in jit.events if not ev.after_ready]
        rep.compiled = sum(not ev.cache_hit for ev in events)
        rep.loaded = sum(ev.cache_hit for ev in events)
        rep.seconds = time.monotonic() - t0
        return rep

    # ---- driving the engine -----------------------------------------------------------------------------
    def _ids(self, n: int) -> list[int]:
        return torch.randint(self._low, self._vocab, (n,), generator=self._gen).tolist()

    def _add(self, prompt: list[int], params: SamplingParams) -> str:
        self._n += 1
        rid = f"warmup-{self._n}"
        self.engine.add_request(rid, prompt, params)
        return rid

    def _drain(self, ids: set[str]) -> None:
        """Step until every request in `ids` finished; raise if one failed."""
        errors = []
        while ids:
            for d in self.engine.step():
                if d.finished and d.request_id in ids:
                    ids.discard(d.request_id)
                    if d.error:
                        errors.append(d.error)
        if errors:
            raise RuntimeError(errors[0])

    def _run(self, lengths: list[int], params: SamplingParams | list[SamplingParams] = GREEDY) -> None:
        ps = params if isinstance(params, list) else [params] * len(lengths)
        self._drain({self._add(self._ids(n), p) for n, p in zip(lengths, ps)})

    def _prefix_hit(self) -> None:
        e = self.engine
        ms = e.config.cache.mamba_state_config
        C = e.model_config.chunk_size
        tail = min(C + 3, max(1, self._longest // 4))
        n = max(1, min(2 * (ms.periodic_snapshot_interval or 2 * C) + 5, self._longest - tail))
        shared = self._ids(n)
        self._drain({self._add(shared, GREEDY)})
        # one sequence resuming from a snapshot alone, then two (one hit, one cold) in the same step
        self._drain({self._add(shared + self._ids(min(9, tail)), GREEDY)})
        self._drain({self._add(shared + self._ids(tail), GREEDY), self._add(self._ids(tail), GREEDY)})

    def _mixed(self, decodes: int) -> None:
        e = self.engine
        long = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        running = {self._add(self._ids(2), long) for _ in range(decodes)}
        e.step()  # their prefill; from the next step on they decode
        new = self._add(self._ids(min(e.model_config.chunk_size + 3, self._longest)), GREEDY)
        self._drain(running | {new})

    def _eager_mixed(self, decodes: int) -> None:
        with self.engine.runner.eager_decode():
            self._mixed(decodes)

    def _eager_decode(self) -> None:
        with self.engine.runner.eager_decode():
            # 8 rows where the batch allows: the decode kernels switch tiles at 8 rows (conv1d_update)
            n = min(8, self.engine.scheduler.max_batch_size)
            self._run([4] * n, params=SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))

    def _verify(self, n: int, *, prefill: bool = False) -> None:
        """`n` requests decoding with a full random draft every step (rejected, as good as any for the
        kernels); with `prefill`, a prompt arrives while they verify."""
        spec = self.engine.spec
        assert spec is not None
        drafter = spec.drafter
        spec.drafter = _RandomDrafts(self)
        try:
            p = SamplingParams(max_tokens=spec.k + 3, temperature=0.0, ignore_eos=True)
            running = {self._add(self._ids(4), p) for _ in range(n)}
            if prefill:
                self.engine.step()  # their prefill; the prompt below arrives beside their verify rows
                running.add(
                    self._add(self._ids(min(self.engine.model_config.chunk_size + 3, self._longest)), GREEDY)
                )
            self._drain(running)
        finally:
            spec.drafter = drafter

    def _token_mask(self) -> None:
        """The structured-outputs mask kernel over the sampler's float32 logits: its variant depends on the
        vocabulary alone (rows are its grid), and the bitmask fill itself is host work, so one call covers
        every constrained step without compiling a grammar here."""
        e = self.engine
        vocab = e.model_config.vocab_size
        logits = torch.zeros(2, vocab, device=e.device)
        mask = torch.full((2, bitmask_width(vocab)), -1, dtype=torch.int32, device=e.device)
        ops.apply_token_bitmask.get(True)(logits, mask)

    def _guarded(self, fn: Callable[[], None]) -> str | None:
        try:
            fn()
            return None
        except Exception as err:  # noqa: BLE001 - a case that fails is reported and skipped
            self._abort_all()
            if isinstance(err, torch.OutOfMemoryError) and torch.cuda.is_available():
                torch.cuda.empty_cache()
            return f"{type(err).__name__}: {err}"

    def _abort_all(self) -> None:
        e = self.engine
        for rid in [r for r in list(e.requests) if r.startswith("warmup-")]:
            e.abort(rid)
        while e.has_unfinished():
            e.step()


class _RandomDrafts:
    """A drafter of k random tokens, for the warm-up's verify steps."""

    def __init__(self, warmup: Warmup) -> None:
        self.warmup = warmup

    def propose(self, req: Request, k: int) -> list[int]:
        return self.warmup._ids(k)

    def remove(self, request_id: str) -> None:
        pass
