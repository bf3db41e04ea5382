"""Building an engine's parts from its config, in start-up order: load the model, calibrate an fp8 KV
cache's scales where the checkpoint has none (`kv_calibration`), profile activations
(CUDA), size the cache pools (the capacity plan), allocate them, build the cache manager, scheduler and
runner, capture the decode graphs. The engine holds the result; the warm-up runs after (`startup.py`).

When the model spans several ranks every rank runs this in step (each loads its shard, profiles and
captures with the same collectives in the same order); the ranks plan from the smallest budget among them,
so block and slot ids mean the same on every rank, and rank 0's runner becomes the `DriverRunner` that
tells the others each step (docs/architecture.md, "Parallelism")."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hyserve import envs
from hyserve.cache.batch_sizing import (
    AUTO_MAX_BATCH_SIZE_CPU,
    AUTO_MAX_BATCH_SIZE_CUDA,
    DEFAULT_MAX_NUM_TOKENS,
    size_batch,
)
from hyserve.cache.capacity import CapacityInputs, CapacityPlan, device_cache_budget, plan_capacity
from hyserve.cache.manager import HybridCacheManager
from hyserve.config import EngineConfig
from hyserve.distributed import parallel_info
from hyserve.engine.assembly.kv_calibration import calibrate_kv_scales
from hyserve.engine.assembly.memory_profile import ActivationProfile, profile_activations
from hyserve.engine.parallel.parallel_runner import DriverRunner
from hyserve.engine.parallel.step_channel import StepChannel
from hyserve.engine.runner.cuda_graphs import DecodeGraphs, default_capture_sizes
from hyserve.engine.runner.jit_sentinel import use_kernel_cache_dir
from hyserve.engine.runner.mixed_graphs import MixedGraphs, default_token_sizes
from hyserve.engine.runner.model_loader import LoadedModel, load_model
from hyserve.engine.runner.runner import ModelRunner
from hyserve.engine.scheduler.scheduler import Scheduler
from hyserve.engine.speculative.speculation import Speculation, spec_scratch_slots
from hyserve.kernels.launch_util import pdl_active, set_pdl
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.protocol import CausalLM

DEFAULT_CPU_CACHE_BYTES = 512 * 2**20
# how long the ranks wait for each other to finish loading weights (shards of a large checkpoint load at
# different speeds); every later collective has the group's own timeout
LOAD_SKEW_TIMEOUT_S = 1800.0


@dataclass
class EngineParts:
    config: EngineConfig  # as given, with an unset max_batch_size / max_num_tokens sized (size_pools)
    loaded: LoadedModel
    max_seq_len: int
    graph_sizes: list[int]
    activations: ActivationProfile | None
    plan: CapacityPlan
    cache_tensors: CacheTensors
    cache: HybridCacheManager
    scheduler: Scheduler
    runner: ModelRunner  # rank 0 of several: a DriverRunner
    channel: StepChannel | None = None  # several ranks: rank 0 -> the others
    speculation: Speculation | None = None  # speculative decoding, when configured


def assemble(config: EngineConfig, log: Callable[[str], None]) -> EngineParts:
    t0 = time.monotonic()
    set_pdl(envs.HYSERVE_PDL)  # before any kernel runs: the warm-up compiles the variants of this setting
    channel = StepChannel.open() if parallel_info().world_size > 1 else None  # every rank, first
    log("hyserve: loading model ...")
    lm = load_model(config)
    if channel is not None:
        channel.wait_for_all("loading the weights", max(LOAD_SKEW_TIMEOUT_S, channel.control.timeout_s))
    if lm.device.type == "cuda":
        d = use_kernel_cache_dir(Path(config.cache_dir) if config.cache_dir else envs.HYSERVE_CACHE_DIR)
        log(f"hyserve: kernel cache: {d}")
        pdl_on = pdl_active(lm.device)
        log(
            "hyserve: decode-path kernels launch "
            f"{'as programmatic dependent launches' if pdl_on else 'in order'}"
            f"{'' if pdl_on or envs.HYSERVE_PDL else ' (HYSERVE_PDL=0)'}"
        )
    if lm.device.type == "cpu" and torch.get_num_threads() <= 2:
        torch.set_num_threads(1)  # 2 threads on 2-core machines were 2-50x slower (docs/architecture.md)
    log(
        f"hyserve: {lm.name}: {lm.config.describe()}, {str(lm.dtype).removeprefix('torch.')} on {lm.device} "
        f"({time.monotonic() - t0:.1f}s); weights on this rank {lm.weight_bytes / 2**30:,.2f} GiB "
        f"({lm.weight_format})"
    )
    sc = config.scheduler
    max_seq_len = sc.max_seq_len or lm.config.max_position_embeddings
    # before anything else runs the model: the profile, the decode graphs and the warm-up see the final scales
    # (and on CUDA its kernels compile into the kernel cache set above)
    kv_cal = calibrate_kv_scales(lm, tokens_per_block=config.cache.tokens_per_block, max_seq_len=max_seq_len)
    if kv_cal is not None:
        log(f"hyserve: {kv_cal.describe()}")
    config, plan, graph_sizes, activations = size_pools(config, lm, max_seq_len, channel, log)
    sc = config.scheduler
    assert sc.max_batch_size is not None and sc.max_num_tokens is not None  # sized by size_pools
    tensors = lm.model.allocate_cache(
        num_blocks=plan.num_kv_blocks,
        tokens_per_block=config.cache.tokens_per_block,
        num_slots=plan.num_live_slots + plan.num_pad_slots + plan.num_snapshot_slots,
        device=lm.device,
    )
    ms = config.cache.mamba_state_config
    cache = HybridCacheManager(
        plan,
        has_mamba=lm.config.has_recurrent_state,
        enable_block_reuse=config.cache.enable_block_reuse,
        snapshot_interval=ms.periodic_snapshot_interval,
        snapshot_offsets_from_end=ms.additional_snapshot_offsets_from_end,
    )
    scheduler = Scheduler(
        cache,
        max_batch_size=sc.max_batch_size,
        max_num_tokens=sc.max_num_tokens,
        enable_chunked_prefill=sc.enable_chunked_prefill,
        chunk_size=lm.config.chunk_size,
        max_seq_len=max_seq_len,
        max_num_partial_prefills=sc.max_num_partial_prefills,
        long_prefill_token_threshold=sc.long_prefill_token_threshold,
        scheduling_policy=sc.scheduling_policy,
        batch_wait_timeout_iters=sc.batch_wait_timeout_iters,
        batch_wait_max_tokens_ratio=sc.batch_wait_max_tokens_ratio,
    )
    runner = ModelRunner(lm.model, tensors, lm.device)
    speculation = Speculation.build(config.speculative, sc.max_batch_size, runner)
    if speculation is not None:
        scheduler.drafter, scheduler.num_spec_tokens = speculation.propose, speculation.k
        # the pad slots after the graphs' padding target (`pad_slots`)
        runner.spec_scratch = cache.states.pad_slots[1 if graph_sizes else 0 :]
        log(f"hyserve: {speculation.describe()}")
    if graph_sizes:
        g = runner.capture_graphs(
            graph_sizes,
            pad_slot=cache.states.pad_slots[0],
            enable_padding=config.cuda_graph.enable_padding,
            max_blocks_per_seq=min(plan.num_kv_blocks, -(-max_seq_len // config.cache.tokens_per_block)),
            spec_widths=range(2, speculation.k + 2) if speculation is not None else (),
            spec_max_batch=speculation.max_batch if speculation is not None else 0,
            mixed_sizes=piecewise_sizes(config, graph_sizes, sc.max_num_tokens),
        )
        log_graphs(g, runner.mixed_graphs, log)
    if channel is not None and channel.is_driver:
        runner = DriverRunner(runner, channel)
    return EngineParts(
        config,
        lm,
        max_seq_len,
        graph_sizes,
        activations,
        plan,
        tensors,
        cache,
        scheduler,
        runner,
        channel,
        speculation,
    )


def size_pools(
    config: EngineConfig,
    lm: LoadedModel,
    max_seq_len: int,
    channel: StepChannel | None,
    log: Callable[[str], None],
) -> tuple[EngineConfig, CapacityPlan, list[int], ActivationProfile | None]:
    """Profile the activations, take the pools' budget (the smallest of the ranks'), size an unset
    max_batch_size / max_num_tokens from it (cache/batch_sizing.py) and plan the pools. Returns the config
    with those sizes filled in, the plan, the decode graph sizes and the activation profile."""
    sc = config.scheduler
    cap = AUTO_MAX_BATCH_SIZE_CUDA if lm.device.type == "cuda" else AUTO_MAX_BATCH_SIZE_CPU
    # an unset batch size is profiled (and its graphs' logits reserved) at the most it can become
    most = sc.max_batch_size or (min(cap, sc.max_num_tokens) if sc.max_num_tokens else cap)
    most_tokens = sc.max_num_tokens or max(DEFAULT_MAX_NUM_TOKENS, most)
    graph_sizes = graph_batch_sizes(config, lm, log, most)
    activations = None
    if lm.device.type == "cuda":
        activations = profile_activations(
            lm.model,
            lm.device,
            max_num_tokens=most_tokens,
            max_batch_size=most,
            graph_batch_size=max(graph_sizes, default=0) or most,
            tokens_per_block=config.cache.tokens_per_block,
            mixed_tokens=max(piecewise_sizes(config, graph_sizes, most_tokens), default=0),
        )
        mixed = activations.mixed_peak_bytes
        log(
            f"hyserve: activation peak (profiled): {activations.prefill_peak_bytes / 2**20:,.0f} MiB for a "
            f"{most_tokens}-token step, {activations.decode_peak_bytes / 2**20:,.0f} MiB for a decode step"
            + (f", {mixed / 2**20:,.0f} MiB for a piecewise-graph step with its buffers" if mixed else "")
        )
    budget = cache_budget_bytes(config, lm, activations, graph_sizes)
    if channel is not None:
        budget = smallest_budget(channel, lm, budget, log)
    kv_bytes, state_bytes = cache_bytes(lm)
    sizing = size_batch(
        budget_bytes=budget,
        kv_bytes_per_token=kv_bytes,
        state_bytes_per_slot=state_bytes,
        max_seq_len=max_seq_len,
        tokens_per_block=config.cache.tokens_per_block,
        num_pad_slots=pad_slots(config, graph_sizes, sc.max_batch_size),
        enable_block_reuse=config.cache.enable_block_reuse,
        cap=cap,
        max_batch_size=sc.max_batch_size,
        max_num_tokens=sc.max_num_tokens,
    )
    log(f"hyserve: {sizing.describe()}")
    config = config.replace(
        scheduler=dataclasses.replace(
            sc, max_batch_size=sizing.max_batch_size, max_num_tokens=sizing.max_num_tokens
        )
    )
    if sizing.max_batch_size != most:
        graph_sizes = graph_batch_sizes(config, lm, log, sizing.max_batch_size)
    inputs = capacity_inputs(config, lm, budget, max_seq_len, graph_sizes)
    if sizing.auto_batch:
        inputs = dataclasses.replace(
            inputs,
            min_snapshot_slots=sizing.min_snapshot_slots,
            batch_size_source=f"max_batch_size sized from memory: {sizing.limit}",
        )
    return config, plan_capacity(inputs), graph_sizes, activations


def log_graphs(g: DecodeGraphs, mixed: MixedGraphs | None, log: Callable[[str], None]) -> None:
    verify = len(g.keys) - len(g.sizes)
    if mixed is not None:
        sizes = mixed.sizes
        log(
            f"hyserve: captured piecewise CUDA graphs of prefill and mixed steps for {len(sizes)} token "
            f"counts ({sizes[0]}..{sizes[-1]}, {mixed.num_pieces} pieces) in {mixed.capture_seconds:.1f}s, "
            f"{mixed.graph_bytes / 2**20:,.0f} MiB (buffers {mixed.buffer_bytes / 2**20:,.0f} MiB)"
        )
    log(
        f"hyserve: captured {len(g.sizes)} decode CUDA graphs (batch sizes {g.sizes[0]}..{g.sizes[-1]})"
        + (f" and {verify} speculative verify graphs" if verify else "")
        + f" in {g.capture_seconds:.1f}s, {g.graph_bytes / 2**20:,.0f} MiB"
    )


def piecewise_sizes(config: EngineConfig, graph_sizes: list[int], max_num_tokens: int) -> list[int]:
    """Token counts to capture piecewise graphs of prefill and mixed steps for (empty: those steps run
    eagerly): only where decode graphs are captured, and none above max_num_tokens."""
    cg = config.cuda_graph
    if not graph_sizes or not cg.piecewise:
        return []
    if cg.piecewise_token_sizes is None:
        return default_token_sizes(max_num_tokens)
    return [n for n in cg.piecewise_token_sizes if n <= max_num_tokens]


def pad_slots(config: EngineConfig, graph_sizes: list[int], max_batch_size: int | None) -> int:
    """State slots never allocated to a request: the CUDA graphs' padding rows' target (one, when graphs are
    captured), then the scratch slots speculative steps chain their verified positions through."""
    return (1 if graph_sizes else 0) + spec_scratch_slots(config.speculative, max_batch_size)


def smallest_budget(channel: StepChannel, lm: LoadedModel, budget: int, log: Callable[[str], None]) -> int:
    """Every rank's cache budget (and free memory on CUDA); all plan from the smallest, so the pools hold
    the same blocks and slots on every rank. Rank 0 logs each rank's figures."""
    free = torch.cuda.mem_get_info(lm.device)[0] if lm.device.type == "cuda" else -1
    rows = channel.gather_ints([budget, free])
    least = min(b for b, _ in rows)
    per_rank = ", ".join(
        f"rank {r} {b / 2**30:,.2f} GiB" + (f" of {f / 2**30:,.2f} GiB free" if f >= 0 else "")
        for r, (b, f) in enumerate(rows)
    )
    log(
        f"hyserve: cache budget per rank: {per_rank}; every rank plans from the smallest, "
        f"{least / 2**30:,.2f} GiB"
    )
    return least


def rank_cache_bytes(model: CausalLM) -> tuple[int, int]:
    """(KV bytes per token, state bytes per slot) of this rank's pools: a one-token block and one slot
    allocated on the meta device, so the figures are whatever `allocate_cache` gives this rank's shard."""
    t = model.allocate_cache(num_blocks=1, tokens_per_block=1, num_slots=1, device="meta")

    def nbytes(d: dict[int, torch.Tensor]) -> int:
        return sum(x.numel() * x.element_size() for x in d.values())

    return nbytes(t.k) + nbytes(t.v), nbytes(t.conv) + nbytes(t.ssm)


def cache_bytes(lm: LoadedModel) -> tuple[int, int]:
    """(KV bytes per token, state bytes per slot) of this rank's pools."""
    if parallel_info().tp_size > 1:  # this rank's heads and groups only
        return rank_cache_bytes(lm.model)
    return lm.config.kv_bytes_per_token, lm.config.state_bytes_per_sequence


def capacity_inputs(
    config: EngineConfig, lm: LoadedModel, budget: int, max_seq_len: int, graph_sizes: list[int]
) -> CapacityInputs:
    c = config.cache
    sc = config.scheduler
    assert sc.max_batch_size is not None and sc.max_num_tokens is not None  # sized by size_pools
    kv_bytes, state_bytes = cache_bytes(lm)
    return CapacityInputs(
        budget_bytes=budget,
        kv_bytes_per_token=kv_bytes,
        state_bytes_per_slot=state_bytes,
        max_batch_size=sc.max_batch_size,
        max_seq_len=max_seq_len,
        max_num_tokens=sc.max_num_tokens,
        tokens_per_block=c.tokens_per_block,
        enable_block_reuse=c.enable_block_reuse,
        periodic_snapshot_interval=c.mamba_state_config.periodic_snapshot_interval,
        num_snapshot_offsets=len(c.mamba_state_config.additional_snapshot_offsets_from_end),
        avg_seq_len=c.avg_seq_len,
        num_pad_slots=pad_slots(config, graph_sizes, sc.max_batch_size),
        max_kv_tokens=c.max_tokens,
        allow_oversized_max_seq_len=c.allow_oversized_max_seq_len,
        weight_bytes=lm.weight_bytes,
        weight_format=lm.weight_format,
    )


def cache_budget_bytes(
    config: EngineConfig, lm: LoadedModel, activations: ActivationProfile | None, graph_sizes: list[int]
) -> int:
    c = config.cache
    if lm.device.type == "cpu":
        return c.max_gpu_total_bytes or DEFAULT_CPU_CACHE_BYTES
    free, total = torch.cuda.mem_get_info(lm.device)
    assert activations is not None
    # the allocator's reserve above the profiled peaks (fragmentation, cuBLAS workspaces)
    slack = 256 * 2**20
    # the decode graphs' shared float32 logits buffer (largest size x vocab) and the 16-bit logits of the
    # largest graph, cast into it, in the graph pool: 6 bytes per logit of the largest size
    graph_logits = max(graph_sizes, default=0) * lm.config.vocab_size * 6
    return device_cache_budget(
        free,
        c.free_gpu_memory_fraction,
        activations.total_bytes + graph_logits + slack,
        c.max_gpu_total_bytes,
        total_bytes=total,
        utilization=c.gpu_memory_utilization,
    )


def graph_batch_sizes(
    config: EngineConfig, lm: LoadedModel, log: Callable[[str], None], max_batch_size: int
) -> list[int]:
    """Decode batch sizes to capture as CUDA graphs (empty: decode runs eagerly)."""
    cg = config.cuda_graph
    if lm.device.type != "cuda" or not cg.enabled:
        return []
    if not lm.model.graph_capturable:
        log("hyserve: CUDA graphs off: this model's decode step reads host values (MoE expert dispatch)")
        return []
    limit = min(cg.max_batch_size or max_batch_size, max_batch_size)
    if cg.batch_sizes is None:
        return default_capture_sizes(limit)
    sizes = [b for b in cg.batch_sizes if b <= limit]
    if len(sizes) < len(cg.batch_sizes):
        log(f"hyserve: cuda_graph_config.batch_sizes above {limit} (max batch size) are not captured")
    return sizes
