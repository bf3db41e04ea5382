"""Prometheus metrics for `GET /metrics`: hyserve's own, prefixed `hyserve_`, and the series vLLM exports,
prefixed `vllm:` with a `model_name` label, so dashboards and alerts written for vLLM read this server too.

Two sources:
- per-request latency histograms (TTFT, TPOT, end-to-end) and request counters, observed by the server
  where the client's clock is (the HTTP handler), so they include queueing and detokenisation;
- engine state (running/waiting, KV blocks, Mamba state slots, snapshot slots, prefix-cache hits,
  preemptions, token totals, JIT compiles after ready) read from `engine.stats()` at scrape time by a
  custom collector, so the numbers are never stale and the engine needs no Prometheus dependency.

The vLLM series: request counts and KV usage, preemptions, token and prefix-cache counters (from the same
`engine.stats()`), and per-request histograms (TTFT, inter-token latency, end to end, queue / prefill /
decode / inference time, prompt and generation lengths) with `vllm:request_success_total` by
`finished_reason`. Queue time is the engine's arrival to its first scheduling of the request; prefill runs
from there to the first token, decode from the first token to the last. The inter-token latency is observed
once per engine step a request gets tokens in, into a plain bucket array (a few hundred nanoseconds on the
event loop per token, not a locked prometheus observation), and exported under both of vLLM's names for it
(`inter_token_latency_seconds` and the older `time_per_output_token_seconds`).

Each app gets its own `CollectorRegistry` so several apps in one process (tests) don't collide.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from hyserve.engine.speculative.speculation import ACCEPTED_AT  # stats() keys "<prefix><position>"

logger = logging.getLogger("hyserve.server")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_E2E_BUCKETS = (
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
_LEN_BUCKETS = tuple(float(2**i) for i in range(0, 21))
# vLLM's request phase buckets (queue, prefill, decode, inference time)
_PHASE_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0)
_PHASE_BUCKETS += (40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# engine.stats() key -> (metric name without prefix, help, kind)
_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_running", "num_requests_running", "Requests currently scheduled (prefill or decode).", "gauge"),
    ("num_waiting", "num_requests_waiting", "Requests waiting for admission.", "gauge"),
    ("kv_blocks_total", "kv_cache_blocks_total", "Paged attention KV blocks in the pool.", "gauge"),
    (
        "kv_blocks_free",
        "kv_cache_blocks_free",
        "KV blocks free (not held by a request; may hold reusable prefix).",
        "gauge",
    ),
    ("live_slots_total", "state_slots_total", "Mamba state slots for running requests.", "gauge"),
    ("live_slots_used", "state_slots_used", "Mamba state slots in use.", "gauge"),
    ("snapshot_slots_total", "snapshot_slots_total", "Mamba snapshot slots for the prefix cache.", "gauge"),
    (
        "snapshot_slots_used",
        "snapshot_slots_used",
        "Mamba snapshot slots holding a cached prefix state.",
        "gauge",
    ),
    ("prefix_cache_entries", "prefix_cache_entries", "Prefix-cache entries.", "gauge"),
    (
        "prefix_cache_queries",
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "counter",
    ),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens served from the prefix cache.", "counter"),
    (
        "num_preemptions",
        "num_preemptions",
        "Requests preempted (recomputed) because the pools ran out.",
        "counter",
    ),
    (
        "batch_wait_steps",
        "batch_wait_steps",
        "Steps whose admissions batch waiting held back (batch_wait_timeout_iters).",
        "counter",
    ),
    (
        "step_time_scale",
        "step_time_scale",
        "Measured / predicted time of the steps the step-time target sized (1 before any; max_step_ms).",
        "gauge",
    ),
    ("prompt_tokens_total", "prompt_tokens", "Prompt tokens processed.", "counter"),
    ("generation_tokens_total", "generation_tokens", "Tokens generated.", "counter"),
    (
        "requests_finished_total",
        "engine_requests_finished",
        "Requests the engine finished (any reason).",
        "counter",
    ),
    ("steps_total", "engine_steps", "Engine steps that ran a batch.", "counter"),
    (
        "prefill_steps_total",
        "engine_prefill_steps",
        "Engine steps that carried prompt (prefill) tokens.",
        "counter",
    ),
    (
        "prefill_tokens_scheduled_total",
        "prefill_tokens_scheduled",
        "Prompt tokens scheduled into steps (prefill chunks; prefix-cache hits are not scheduled).",
        "counter",
    ),
    (
        "overlapped_steps_total",
        "overlapped_steps",
        "Decode steps launched before the host read the previous step's tokens (async scheduling).",
        "counter",
    ),
    (
        "jit_compiles_after_ready",
        "jit_compiles_after_ready",
        "Kernel compilations after the engine reported ready (should stay 0).",
        "counter",
    ),
    (
        "cuda_alloc_retries",
        "cuda_alloc_retries",
        "CUDA allocations that freed the caching allocator and retried, each a device sync (should stay 0).",
        "counter",
    ),
    (
        "slow_reader_aborts_total",
        "slow_reader_aborts",
        "Streams ended because their client left more unread output than the limit.",
        "counter",
    ),
    (
        "step_failures_total",
        "step_failures",
        "Engine steps that raised (each failing its requests, or isolated to the ones that made it fail).",
        "counter",
    ),
    ("request_failures_total", "request_failures", "Requests the engine ended with an error.", "counter"),
    (
        "engine_restarts_total",
        "engine_restarts",
        "Times the engine loop failed outside a step, aborted its requests and resumed serving.",
        "counter",
    ),
    ("healthy", "healthy", "1 when the engine loop is alive and serving.", "gauge"),
    (
        "spec_decode_num_drafts",
        "spec_decode_num_drafts",
        "Speculative decoding: sequences that carried draft tokens into a step.",
        "counter",
    ),
    (
        "spec_decode_num_draft_tokens",
        "spec_decode_num_draft_tokens",
        "Speculative decoding: draft tokens verified.",
        "counter",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens",
        "Speculative decoding: draft tokens accepted.",
        "counter",
    ),
)


# engine.stats() key -> vLLM's series (with a model_name label)
_VLLM_ENGINE_METRICS: tuple[tuple[str, str, str, str], ...] = (
    ("num_running", "vllm:num_requests_running", "Number of requests in model execution batches.", "gauge"),
    ("num_waiting", "vllm:num_requests_waiting", "Number of requests waiting to be processed.", "gauge"),
    (
        "num_preemptions",
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        "counter",
    ),
    ("prompt_tokens_total", "vllm:prompt_tokens", "Number of prefill tokens processed.", "counter"),
    (
        "generation_tokens_total",
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        "counter",
    ),
    (
        "prefix_cache_queries",
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "counter",
    ),
    (
        "prefix_cache_hits",
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "counter",
    ),
    ("spec_decode_num_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "counter"),
    (
        "spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_draft_tokens",
        "Number of draft tokens.",
        "counter",
    ),
    (
        "spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "Number of accepted tokens.",
        "counter",
    ),
)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str = "") -> None:
        self._stats = stats
        self._model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # collected lazily at scrape time; nothing to pre-register

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._stats()
        except Exception:
            logger.exception("engine.stats() failed during a metrics scrape")
            g = GaugeMetricFamily("hyserve_healthy", "1 when the engine loop is alive and serving.")
            g.add_metric([], 0.0)
            yield g
            return
        for key, name, doc, kind in _ENGINE_METRICS:
            if key not in s:
                continue
            fam = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = fam(f"hyserve_{name}", doc)
            m.add_metric([], float(s[key]))
            yield m
        # Derived ratios dashboards want directly.
        tot, free = s.get("kv_blocks_total"), s.get("kv_blocks_free")
        if tot:
            m = GaugeMetricFamily("hyserve_kv_cache_usage_ratio", "Fraction of KV blocks held by requests.")
            m.add_metric([], 1.0 - float(free or 0) / float(tot))
            yield m
        tot, used = s.get("live_slots_total"), s.get("live_slots_used")
        if tot:
            m = GaugeMetricFamily("hyserve_state_slot_usage_ratio", "Fraction of Mamba state slots in use.")
            m.add_metric([], float(used or 0) / float(tot))
            yield m
        q, h = s.get("prefix_cache_queries"), s.get("prefix_cache_hits")
        if q is not None:
            m = GaugeMetricFamily("hyserve_prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens).")
            m.add_metric([], float(h or 0) / float(q) if q else 0.0)
            yield m
        yield from self._accepted_per_position(s)
        yield from self._vllm(s)

    def _accepted_per_position(self, s: dict[str, Any]) -> Iterator[Metric]:
        """Accepted draft tokens per draft position (0 = the first drafted token), hyserve's and vLLM's."""
        per = sorted((int(k.removeprefix(ACCEPTED_AT)), v) for k, v in s.items() if k.startswith(ACCEPTED_AT))
        if not per:
            return
        doc = "Speculative decoding: accepted draft tokens per draft position."
        mine = CounterMetricFamily(
            "hyserve_spec_decode_num_accepted_tokens_per_pos", doc, labels=["position"]
        )
        vllm = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos", doc, labels=["model_name", "position"]
        )
        for pos, n in per:
            mine.add_metric([str(pos)], float(n))
            vllm.add_metric([self._model_name, str(pos)], float(n))
        yield mine
        yield vllm

    def _vllm(self, s: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's names for the engine's state, labelled with the served model's name."""
        label = [self._model_name]
        for key, name, doc, kind in _VLLM_ENGINE_METRICS:
            if key.startswith("spec_decode") and key not in s:
                continue  # speculative decoding is off
            fam = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            m = fam(name, doc, labels=["model_name"])
            m.add_metric(label, float(s.get(key, 0)))
            yield m
        tot, free = s.get("kv_blocks_total"), s.get("kv_blocks_free")
        usage = 1.0 - float(free or 0) / float(tot) if tot else 0.0
        for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            m = GaugeMetricFamily(name, "KV-cache usage. 1 means 100 percent usage.", labels=["model_name"])
            m.add_metric(label, usage)
            yield m


class BucketHistogram:
    """A histogram kept as a bucket array, for observations on the hot path (one per engine step a request
    gets tokens in): no lock (every observation is on the event loop) and no label lookup."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, v)] += 1
        self.sum += v

    def family(self, name: str, doc: str, labels: list[str], values: list[str]) -> HistogramMetricFamily:
        cumulative, total = [], 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts):
            total += n
            cumulative.append((str(bound) if bound != float("inf") else "+Inf", float(total)))
        m = HistogramMetricFamily(name, doc, labels=labels)
        m.add_metric(values, cumulative, sum_value=self.sum)
        return m


class _BucketCollector(Collector):
    def __init__(self, hist: BucketHistogram, names: tuple[str, ...], doc: str, model_name: str) -> None:
        self._hist, self._names, self._doc, self._model_name = hist, names, doc, model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name in self._names:
            yield self._hist.family(name, self._doc, ["model_name"], [self._model_name])


class ServerMetrics:
    """The app's metrics registry: request-level histograms + the engine collector."""

    def __init__(self, engine_stats: Callable[[], dict[str, Any]], model_name: str = "") -> None:
        r = self.registry = CollectorRegistry()
        self.inflight = 0  # API requests not finished yet (kept by the middleware; a drain waits for 0)
        self.requests = Counter(
            "hyserve_requests",
            "HTTP requests to the API routes by route and status code.",
            ["route", "status"],
            registry=r,
        )
        self.request_success = Counter(
            "hyserve_request_success",
            "Generation requests finished, by finish reason.",
            ["finish_reason"],
            registry=r,
        )
        self.ttft = Histogram(
            "hyserve_time_to_first_token_seconds",
            "Request arrival to first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "hyserve_time_per_output_token_seconds",
            "Mean time between generated tokens of a request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "hyserve_e2e_request_latency_seconds",
            "Request arrival to last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            "hyserve_request_prompt_tokens",
            "Prompt length of finished requests.",
            buckets=_LEN_BUCKETS,
            registry=r,
        )
        self.gen_len = Histogram(
            "hyserve_request_generation_tokens",
            "Generated tokens of finished requests.",
            buckets=_LEN_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine_stats, model_name))
        self.vllm = VllmRequestMetrics(r, model_name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VllmRequestMetrics:
    """vLLM's per-request series (each with the model_name label)."""

    def __init__(self, r: CollectorRegistry, model_name: str) -> None:
        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token.", _TTFT_BUCKETS
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency.", _E2E_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Time spent in the WAITING phase.", _PHASE_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "Time spent in the PREFILL phase.", _PHASE_BUCKETS
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds", "Time spent in the DECODE phase.", _PHASE_BUCKETS
        )
        self.inference = hist(
            "vllm:request_inference_time_seconds", "Time spent in the RUNNING phase.", _PHASE_BUCKETS
        )
        self.prompt_len = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", _LEN_BUCKETS
        )
        self.gen_len = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", _LEN_BUCKETS
        )
        # the max_tokens each request asked for (vLLM's dashboard plots its rate beside the lengths)
        self.max_gen = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            _LEN_BUCKETS,
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.model_name = model_name
        self.itl = BucketHistogram(_TPOT_BUCKETS)
        r.register(
            _BucketCollector(
                self.itl,
                ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
                "Histogram of inter-token latency in seconds.",
                model_name,
            )
        )


class RequestTimer:
    """Per-request clock: call `token(delta)` when output arrives and `finish()` once at the end."""

    def __init__(self, metrics: ServerMetrics, max_tokens: int | None = None) -> None:
        self._m = metrics
        self.max_tokens = max_tokens  # what the request asked for (None: not known here)
        self.t0 = time.monotonic()
        self.t_first: float | None = None
        self.t_last: float | None = None
        # the engine's clock of this request (time.monotonic): arrival, first scheduled
        self.arrival: float | None = None
        self.scheduled: float | None = None
        self._done = False

    def token(self, delta: Any = None) -> None:
        t = time.monotonic()
        if delta is not None and self.scheduled is None:
            self.arrival = getattr(delta, "arrival_time", None)
            self.scheduled = getattr(delta, "first_scheduled_time", None)
        if self.t_first is None:
            self.t_first = t
            self._m.ttft.observe(t - self.t0)
            self._m.vllm.ttft.observe(t - self.t0)
        elif self.t_last is not None:
            # a delta a slow reader found merged holds several steps' tokens: each gets its share of the gap
            k = max(1, len(getattr(delta, "token_ids", ()) or ()))
            for _ in range(k):
                self._m.vllm.itl.observe((t - self.t_last) / k)
        self.t_last = t

    def finish(self, *, finish_reason: str | None, prompt_tokens: int, output_tokens: int) -> None:
        if self._done:
            return
        self._done = True
        t = time.monotonic()
        m, v = self._m, self._m.vllm
        m.e2e.observe(t - self.t0)
        m.request_success.labels(finish_reason=finish_reason or "unknown").inc()
        m.prompt_len.observe(prompt_tokens)
        m.gen_len.observe(output_tokens)
        if self.t_first is not None and output_tokens > 1:
            m.tpot.observe((t - self.t_first) / (output_tokens - 1))
        v.e2e.observe(t - self.t0)
        v.success.labels(v.model_name, finish_reason or "unknown").inc()
        v.prompt_len.observe(prompt_tokens)
        v.gen_len.observe(output_tokens)
        if self.max_tokens is not None:
            v.max_gen.observe(self.max_tokens)
        if self.scheduled is not None and self.arrival is not None:
            v.queue.observe(max(self.scheduled - self.arrival, 0.0))
            if self.t_first is not None and self.t_last is not None:
                v.prefill.observe(max(self.t_first - self.scheduled, 0.0))
                v.decode.observe(self.t_last - self.t_first)
                v.inference.observe(max(self.t_last - self.scheduled, 0.0))
