"""Engine configuration: frozen, keyword-only, composed dataclasses, built from one options dict.

The option names are those of the server's YAML (`extra-llm-api-config.yml` style) and of `LLM(...)`:

    EngineConfig
      model, dtype, device, load_format, served_model_name, seed, warmup, strict_warmup, cache_dir,
      async_scheduling
      scheduler: SchedulerConfig   max_batch_size, max_num_tokens, max_seq_len, enable_chunked_prefill
      cache:     CacheConfig       kv_cache_config.* (tokens_per_block, enable_block_reuse, avg_seq_len, ...)
      cuda_graph: CudaGraphConfig  cuda_graph_config.* (enable_padding, max_batch_size, batch_sizes)
      parallel:  ParallelConfig    tp_size, ep_size

`build_engine_config(options)` validates everything in one place and raises `ValueError` with the key
path and the allowed values. Keys accepted for compatibility but without effect here are collected
in `EngineConfig.ignored_keys` so the caller can print one start-up warning.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8")
SSM_CACHE_DTYPES = ("float32", "bfloat16", "float16")
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")
MAX_PHILOX_ROUNDS = 32  # kv_cache_config.mamba_ssm_philox_rounds: each round is unrolled in the kernels
WARMUP_MODES = ("auto", "on", "off")
# Keys of a serve YAML that configure the HTTP server rather than the engine (vLLM's --config takes any
# flag); whoever builds an engine from such a YAML drops them first.
SERVER_YAML_KEYS = ("host", "port", "reasoning_parser", "tool_parser", "api_key", "log_level")
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DEVICES = ("auto", "cpu", "cuda")

# Keys of the TensorRT-LLM YAML that hyserve accepts and ignores (they select that engine's internals).
COMPAT_IGNORED_KEYS = frozenset(
    {
        "backend",
        "disable_overlap_scheduler",
        "enable_attention_dp",
        "trust_remote_code",
        "moe_config",
        "print_iter_log",
        "enable_iter_perf_stats",
        "kv_cache_config.event_buffer_max_size",
        "kv_cache_config.enable_partial_reuse",
        "kv_cache_config.copy_on_partial_reuse",
    }
)


@dataclass(frozen=True, kw_only=True)
class MambaStateConfig:
    periodic_snapshot_interval: int | None = 256
    additional_snapshot_offsets_from_end: tuple[int, ...] = (0,)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    tokens_per_block: int = 64
    enable_block_reuse: bool = True
    avg_seq_len: int | None = None
    free_gpu_memory_fraction: float = 0.9
    max_tokens: int | None = None  # cap on KV tokens
    max_gpu_total_bytes: int | None = None  # explicit byte budget for KV + state pools (CPU: required-ish)
    dtype: str = "auto"  # KV cache dtype
    mamba_ssm_cache_dtype: str = "float32"
    mamba_ssm_stochastic_rounding: bool = False
    mamba_ssm_philox_rounds: int = 10
    mamba_state_config: MambaStateConfig = field(default_factory=MambaStateConfig)
    allow_oversized_max_seq_len: bool = False


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_seq_len: int | None = None  # None -> the model's max_position_embeddings
    enable_chunked_prefill: bool = True


@dataclass(frozen=True, kw_only=True)
class CudaGraphConfig:
    enabled: bool = True
    enable_padding: bool = True
    max_batch_size: int | None = None  # None -> scheduler.max_batch_size
    batch_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp_size: int = 1
    ep_size: int = 1


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str | None = None  # None -> the built-in tiny model
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    served_model_name: str | None = None
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    cuda_graph: CudaGraphConfig = field(default_factory=CudaGraphConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # warm-up before ready: "auto" = on CUDA (the CPU path has nothing to compile), "on", "off"
    warmup: str = "auto"
    strict_warmup: bool = False  # a Triton compilation after ready fails the step that caused it
    cache_dir: str | None = None  # persistent kernel cache root (default: envs.HYSERVE_CACHE_DIR)
    # launch the next decode step before the host has read this one's tokens (they are fed to it on the
    # device), so the host's per-step work overlaps the GPU's (LLMEngine docstring)
    async_scheduling: bool = True
    ignored_keys: tuple[str, ...] = ()

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


# ---- building from options -----------------------------------------------------------------------

_TOP = {
    "model", "dtype", "device", "load_format", "served_model_name", "seed",
    "max_batch_size", "max_num_tokens", "max_seq_len", "enable_chunked_prefill",
    "kv_cache_config", "cuda_graph_config", "tp_size", "ep_size",
    "tensor_parallel_size", "moe_expert_parallel_size", "warmup", "strict_warmup", "cache_dir",
    "async_scheduling",
}
_KV = {
    "tokens_per_block", "enable_block_reuse", "avg_seq_len", "free_gpu_memory_fraction", "max_tokens",
    "max_gpu_total_bytes", "dtype", "mamba_ssm_cache_dtype", "mamba_ssm_stochastic_rounding",
    "mamba_ssm_philox_rounds", "mamba_state_config", "allow_oversized_max_seq_len",
}
_MAMBA_STATE = {"periodic_snapshot_interval", "additional_snapshot_offsets_from_end"}
_GRAPH = {"enable_padding", "max_batch_size", "batch_sizes", "enabled"}


def _check_keys(d: dict[str, Any], allowed: set[str], path: str, ignored: list[str]) -> None:
    for k in d:
        full = f"{path}.{k}" if path else k
        if k in allowed:
            continue
        if full in COMPAT_IGNORED_KEYS:
            ignored.append(full)
            continue
        raise ValueError(f"unknown option {full!r}; allowed keys{' in ' + path if path else ''}: {sorted(allowed)}")


def _int(v: Any, path: str, *, lo: int | None = None, none_ok: bool = False) -> Any:
    if v is None and none_ok:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{path}: expected an integer, got {v!r}")
    if lo is not None and v < lo:
        raise ValueError(f"{path}: must be >= {lo}, got {v}")
    return v


def _bool(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{path}: expected true or false, got {v!r}")
    return v


def _choice(v: Any, path: str, allowed: tuple[str, ...]) -> str:
    s = str(v).lower() if v is not None else v
    if s not in allowed:
        raise ValueError(f"{path}: {v!r} is not one of {list(allowed)}")
    return s


def build_engine_config(options: dict[str, Any] | None = None, **kwargs: Any) -> EngineConfig:
    """Validate an options dict (YAML keys / LLM kwargs; nested dicts for kv_cache_config etc.)."""
    opts: dict[str, Any] = dict(options or {})
    opts.update({k: v for k, v in kwargs.items()})
    ignored: list[str] = []
    _check_keys(opts, _TOP, "", ignored)

    kv = opts.get("kv_cache_config") or {}
    if not isinstance(kv, dict):
        raise ValueError(f"kv_cache_config: expected a mapping, got {kv!r}")
    _check_keys(kv, _KV, "kv_cache_config", ignored)
    ms = kv.get("mamba_state_config") or {}
    if not isinstance(ms, dict):
        raise ValueError(f"kv_cache_config.mamba_state_config: expected a mapping, got {ms!r}")
    _check_keys(ms, _MAMBA_STATE, "kv_cache_config.mamba_state_config", ignored)
    cg = opts.get("cuda_graph_config")
    if cg is None:
        cg = {}
    elif not isinstance(cg, dict):
        raise ValueError(f"cuda_graph_config: expected a mapping, got {cg!r}")
    _check_keys(cg, _GRAPH, "cuda_graph_config", ignored)

    p = "kv_cache_config.mamba_state_config"
    interval = _int(ms.get("periodic_snapshot_interval", 256), f"{p}.periodic_snapshot_interval", lo=1, none_ok=True)
    offsets_raw = ms.get("additional_snapshot_offsets_from_end", [0])
    if not isinstance(offsets_raw, list | tuple):
        raise ValueError(f"{p}.additional_snapshot_offsets_from_end: expected a list of integers >= 0")
    offsets = tuple(_int(o, f"{p}.additional_snapshot_offsets_from_end[]", lo=0) for o in offsets_raw)

    tpb = _int(kv.get("tokens_per_block", 64), "kv_cache_config.tokens_per_block", lo=1)
    if interval is not None and interval % tpb:
        raise ValueError(
            f"{p}.periodic_snapshot_interval ({interval}) must be a multiple of "
            f"kv_cache_config.tokens_per_block ({tpb})"
        )
    frac = kv.get("free_gpu_memory_fraction", 0.9)
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not (0.0 < float(frac) <= 1.0):
        raise ValueError(f"kv_cache_config.free_gpu_memory_fraction: must be in (0, 1], got {frac!r}")
    cache = CacheConfig(
        tokens_per_block=tpb,
        enable_block_reuse=_bool(kv.get("enable_block_reuse", True), "kv_cache_config.enable_block_reuse"),
        avg_seq_len=_int(kv.get("avg_seq_len"), "kv_cache_config.avg_seq_len", lo=1, none_ok=True),
        free_gpu_memory_fraction=float(frac),
        max_tokens=_int(kv.get("max_tokens"), "kv_cache_config.max_tokens", lo=1, none_ok=True),
        max_gpu_total_bytes=_int(
            kv.get("max_gpu_total_bytes"), "kv_cache_config.max_gpu_total_bytes", lo=1, none_ok=True
        ),
        dtype=_choice(kv.get("dtype", "auto"), "kv_cache_config.dtype", KV_CACHE_DTYPES),
        mamba_ssm_cache_dtype=_choice(
            kv.get("mamba_ssm_cache_dtype", "float32"), "kv_cache_config.mamba_ssm_cache_dtype", SSM_CACHE_DTYPES
        ),
        mamba_ssm_stochastic_rounding=_bool(
            kv.get("mamba_ssm_stochastic_rounding", False), "kv_cache_config.mamba_ssm_stochastic_rounding"
        ),
        mamba_ssm_philox_rounds=_int(
            kv.get("mamba_ssm_philox_rounds", 10), "kv_cache_config.mamba_ssm_philox_rounds", lo=1
        ),
        mamba_state_config=MambaStateConfig(
            periodic_snapshot_interval=interval, additional_snapshot_offsets_from_end=offsets
        ),
        allow_oversized_max_seq_len=_bool(
            kv.get("allow_oversized_max_seq_len", False), "kv_cache_config.allow_oversized_max_seq_len"
        ),
    )
    if cache.mamba_ssm_philox_rounds > MAX_PHILOX_ROUNDS:
        raise ValueError(
            f"kv_cache_config.mamba_ssm_philox_rounds: must be <= {MAX_PHILOX_ROUNDS}, got "
            f"{cache.mamba_ssm_philox_rounds} (10 is Philox's usual count)"
        )
    if cache.mamba_ssm_stochastic_rounding and cache.mamba_ssm_cache_dtype != "float16":
        raise ValueError(
            "kv_cache_config.mamba_ssm_stochastic_rounding needs kv_cache_config.mamba_ssm_cache_dtype: float16 "
            f"(got {cache.mamba_ssm_cache_dtype})"
        )

    sched = SchedulerConfig(
        max_batch_size=_int(opts.get("max_batch_size", 64), "max_batch_size", lo=1),
        max_num_tokens=_int(opts.get("max_num_tokens", 8192), "max_num_tokens", lo=1),
        max_seq_len=_int(opts.get("max_seq_len"), "max_seq_len", lo=2, none_ok=True),
        enable_chunked_prefill=_bool(opts.get("enable_chunked_prefill", True), "enable_chunked_prefill"),
    )
    if sched.max_num_tokens < sched.max_batch_size:
        raise ValueError(
            f"max_num_tokens ({sched.max_num_tokens}) must be >= max_batch_size ({sched.max_batch_size}): "
            "every running request needs one token of budget per decode step"
        )

    sizes_raw = cg.get("batch_sizes")
    sizes = None
    if sizes_raw is not None:
        if not isinstance(sizes_raw, list | tuple) or not sizes_raw:
            raise ValueError("cuda_graph_config.batch_sizes: expected a non-empty list of integers >= 1")
        sizes = tuple(sorted({_int(b, "cuda_graph_config.batch_sizes[]", lo=1) for b in sizes_raw}))
    graphs = CudaGraphConfig(
        enabled=_bool(cg.get("enabled", True), "cuda_graph_config.enabled"),
        enable_padding=_bool(cg.get("enable_padding", True), "cuda_graph_config.enable_padding"),
        max_batch_size=_int(cg.get("max_batch_size"), "cuda_graph_config.max_batch_size", lo=1, none_ok=True),
        batch_sizes=sizes,
    )

    tp = _int(opts.get("tp_size", opts.get("tensor_parallel_size", 1)), "tp_size", lo=1)
    ep = _int(opts.get("ep_size", opts.get("moe_expert_parallel_size", 1)), "ep_size", lo=1)
    if tp != 1 or ep != 1:
        raise ValueError(
            f"tp_size={tp}, ep_size={ep}: this hyserve build runs on one device; use tp_size: 1 and ep_size: 1"
        )

    model = opts.get("model")
    if model is not None and not isinstance(model, str | Path):
        raise ValueError(f"model: expected a path, got {model!r}")
    return EngineConfig(
        model=None if model is None else str(model),
        dtype=_choice(opts.get("dtype", "auto"), "dtype", MODEL_DTYPES),
        device=_choice(opts.get("device", "auto"), "device", DEVICES),
        load_format=_choice(opts.get("load_format", "auto"), "load_format", LOAD_FORMATS),
        served_model_name=opts.get("served_model_name"),
        seed=_int(opts.get("seed", 0), "seed"),
        scheduler=sched,
        cache=cache,
        cuda_graph=graphs,
        parallel=ParallelConfig(tp_size=tp, ep_size=ep),
        warmup=_choice(opts.get("warmup", "auto"), "warmup", WARMUP_MODES),
        strict_warmup=_bool(opts.get("strict_warmup", False), "strict_warmup"),
        cache_dir=None if opts.get("cache_dir") is None else str(opts["cache_dir"]),
        async_scheduling=_bool(opts.get("async_scheduling", True), "async_scheduling"),
        ignored_keys=tuple(ignored),
    )


def load_yaml_options(path: str | Path) -> dict[str, Any]:
    """Read a YAML options file; errors name the file."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config: file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {p}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {p}: expected a mapping of options at the top level")
    return data
