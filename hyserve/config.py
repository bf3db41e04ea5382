"""Engine configuration: frozen, keyword-only, composed dataclasses, built from one options dict.

The option names are those of the server's YAML (`extra-llm-api-config.yml` style) and of `LLM(...)`:

    EngineConfig
      model, dtype, device, load_format, quantization, served_model_name, seed, warmup, strict_warmup,
      cache_dir, async_scheduling
      scheduler: SchedulerConfig   max_batch_size, max_num_tokens, max_seq_len, enable_chunked_prefill,
                                   scheduling_policy, ...
      cache:     CacheConfig       kv_cache_config.* (tokens_per_block, enable_block_reuse, avg_seq_len, ...)
      cuda_graph: CudaGraphConfig  cuda_graph_config.* (enable_padding, max_batch_size, batch_sizes,
                                   piecewise, piecewise_token_sizes)
      parallel:  ParallelConfig    tp_size, ep_size

The dataclass fields are the one source of truth: each field's metadata says how its option is read and
checked (`option`) or where its section sits in the YAML (`section`), and `build_engine_config` walks
the fields, so the accepted keys, their defaults and their checks cannot drift apart. Errors are
`ValueError`s naming the key path. Keys accepted for compatibility but without effect here are collected
in `EngineConfig.ignored_keys` so the caller can print one start-up warning.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8")
# other servers' spellings of a value, read as hyserve's (vLLM's --dtype half, --kv-cache-dtype fp8_e4m3);
# "auto" of the SSM state dtype is hyserve's default, float32 (vLLM's follows the model's dtype)
DTYPE_SPELLINGS = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
KV_DTYPE_SPELLINGS = {"fp8_e4m3": "fp8", "half": "float16", "float": "float32"}
SSM_DTYPE_SPELLINGS = {"auto": "float32", "half": "float16", "float": "float32"}
KV_DTYPES_REFUSED = {
    "fp8_e5m2": "hyserve's fp8 KV cache is e4m3 (fp8 or fp8_e4m3); e5m2 is not implemented",
    "fp8_inc": "hyserve's fp8 KV cache is e4m3 (fp8 or fp8_e4m3)",
}
# kv_cache_config.kv_scales: where an fp8 KV cache's per-layer k_scale / v_scale come from. "checkpoint": its
# KV-scale tensors (start-up fails naming the attention layers without them); "calibrate": amax / 448 of a
# start-up prefill (engine/assembly/kv_calibration.py); "unit": 1.0; "auto": the checkpoint's where it
# has them, calibrated elsewhere
KV_SCALE_SOURCES = ("auto", "checkpoint", "calibrate", "unit")
SSM_CACHE_DTYPES = ("float32", "bfloat16", "float16")
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")
MAX_MODEL_NAME_CHARS = 256  # served_model_name: each name
MAX_PHILOX_ROUNDS = 32  # kv_cache_config.mamba_ssm_philox_rounds: each round is unrolled in the kernels
WARMUP_MODES = ("auto", "on", "off")
# Keys of a serve YAML that configure the HTTP server rather than the engine (vLLM's --config takes any
# flag); whoever builds an engine from such a YAML drops them first.
SERVER_YAML_KEYS = (
    "host",
    "port",
    "reasoning_parser",
    "tool_parser",
    "api_key",
    "no_auth",
    "log_level",
    "default_max_tokens",
    "max_request_body_bytes",
    "shutdown_timeout",
    "disable_log_requests",
    "enable_log_requests",
    "disable_log_stats",
    "log_format",
    "chat_template",
    "generation_config",
    "max_logprobs",
    "enable_auto_tool_choice",
    "allowed_origins",
    "allowed_methods",
    "allowed_headers",
    "allow_credentials",
    "max_sequences_per_request",
    "request_read_timeout",
    "max_connections",
    "max_inflight_body_bytes",
    "engine_process",
)
# engine seeds are int64 (as the API's per-request seeds)
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
LOAD_FORMATS = ("auto", "safetensors", "dummy")
DUMMY_INIT = ("auto", "host")
# weight formats `quantization` can ask for (None: the checkpoint's own, 16-bit unless it is an FP8
# checkpoint)
QUANTIZATIONS = ("fp8",)
DEVICES = ("auto", "cpu", "cuda")
# the waiting queue's order (vLLM's --scheduling-policy): "fcfs" arrival order; "priority" each request's
# `priority` (lower first), ties by arrival
SCHEDULING_POLICIES = ("fcfs", "priority")

# speculative decoding (`speculative_config`): the drafting methods, other servers' names for them, the most
# tokens a step drafts per request, and n-gram drafting's match lengths when none are given (vLLM's)
SPEC_METHODS = ("ngram", "mtp")
SPEC_METHOD_SPELLINGS = {"nemotron_h_mtp": "mtp", "[ngram]": "ngram", "ngram_gpu": "ngram"}
MAX_SPEC_TOKENS = 15
DEFAULT_PROMPT_LOOKUP = 5

# Keys of the TensorRT-LLM YAML that hyserve accepts and ignores (they select that engine's internals).
COMPAT_IGNORED_KEYS = frozenset(
    {
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


def _backend_problem(v: Any) -> str | None:
    if isinstance(v, str) and v.lower() == "pytorch":
        return None
    return (
        f"{v!r} is not available: hyserve is one engine, in PyTorch (trtllm-serve's 'pytorch' backend is the "
        "only value it accepts); TensorRT-LLM's other backends build or run that engine's own kernels"
    )


def _beam_width_problem(v: Any) -> str | None:
    if v == 1 and not isinstance(v, bool):
        return None
    return f"{v!r} is not available: hyserve has no beam search, so max_beam_width must be 1"


# Keys of the TensorRT-LLM YAML (and trtllm-serve flags) that hyserve accepts without effect when their value
# is what hyserve does anyway, and refuses otherwise: key -> (value -> why it is refused, or None).
COMPAT_CHECKED_KEYS: dict[str, Callable[[Any], str | None]] = {
    "backend": _backend_problem,
    "max_beam_width": _beam_width_problem,
}

# ---- value checks: each takes (value, key path) and returns the value to store ---------------------------

Check = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Int:
    lo: int | None = None
    hi: int | None = None
    none_ok: bool = False
    hint: str = ""  # appended to the upper-bound error

    def __call__(self, v: Any, path: str) -> int | None:
        return None if v is None and self.none_ok else self.integer(v, path)

    def integer(self, v: Any, path: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{path}: expected an integer, got {v!r}")
        if self.lo is not None and v < self.lo:
            raise ValueError(f"{path}: must be >= {self.lo}, got {v}")
        if self.hi is not None and v > self.hi:
            raise ValueError(f"{path}: must be <= {self.hi}, got {v}{f' ({self.hint})' if self.hint else ''}")
        return v


def boolean(v: Any, path: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"{path}: expected true or false, got {v!r}")
    return v


@dataclass(frozen=True)
class Choice:
    allowed: tuple[str, ...]
    # other accepted spellings -> the allowed value they stand for; refused values -> why
    spellings: dict[str, str] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def __call__(self, v: Any, path: str) -> str:
        s = str(v).lower() if v is not None else v
        if s in self.refused:
            raise ValueError(f"{path}: {v!r} is not supported: {self.refused[s]}")
        s = self.spellings.get(s, s) if isinstance(s, str) else s
        if s not in self.allowed:
            others = f" (or {', '.join(sorted(self.spellings))})" if self.spellings else ""
            raise ValueError(f"{path}: {v!r} is not one of {list(self.allowed)}{others}")
        return s


def fraction(v: Any, path: str) -> float:
    """A number in (0, 1]."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not (0.0 < float(v) <= 1.0):
        raise ValueError(f"{path}: must be in (0, 1], got {v!r}")
    return float(v)


def unit_share(v: Any, path: str) -> float:
    """A number in [0, 1]."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not (0.0 <= float(v) <= 1.0):
        raise ValueError(f"{path}: must be in [0, 1], got {v!r}")
    return float(v)


def fraction_or_none(v: Any, path: str) -> float | None:
    return None if v is None else fraction(v, path)


def positive_ms_or_none(v: Any, path: str) -> float | None:
    """A time in milliseconds > 0, or None (off)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int | float) or not (0.0 < float(v) < float("inf")):
        raise ValueError(f"{path}: expected a positive number of milliseconds or null (off), got {v!r}")
    return float(v)


# max_step_ms "auto": chunks of long prompts sized so a step stays under this on CUDA (beside a 1M-token
# prompt on an H200 it kept short requests' TTFT p99 at 386 ms)
DEFAULT_MAX_STEP_MS = 150.0
# batch waiting (SchedulerConfig): the most steps admissions wait; the share of max_num_tokens they fill
DEFAULT_BATCH_WAIT_ITERS = 0
DEFAULT_BATCH_WAIT_RATIO = 0.75


def step_ms_target(v: Any, path: str) -> float | str | None:
    """The step-time target: "auto", "off" / None, or a time in milliseconds > 0."""
    if isinstance(v, str) and v.lower() in ("auto", "off", "none"):
        return "auto" if v.lower() == "auto" else None
    if isinstance(v, str):
        try:
            v = float(v)
        except ValueError:
            raise ValueError(
                f"{path}: expected a positive number of milliseconds, 'auto' or 'off', got {v!r}"
            ) from None
    try:
        return positive_ms_or_none(v, path)
    except ValueError:
        raise ValueError(
            f"{path}: expected a positive number of milliseconds, 'auto' or 'off', got {v!r}"
        ) from None


def positive_seconds(v: Any, path: str) -> float:
    """A time in seconds > 0."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not (0.0 < float(v) < float("inf")):
        raise ValueError(f"{path}: expected a positive number of seconds, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class IntList:
    """A list of integers >= lo, stored as a tuple (sorted without repeats when `sorted_set`)."""

    lo: int
    non_empty: bool = False
    sorted_set: bool = False
    none_ok: bool = False

    def __call__(self, v: Any, path: str) -> tuple[int, ...] | None:
        if v is None and self.none_ok:
            return None
        if not isinstance(v, list | tuple) or (self.non_empty and not v):
            raise ValueError(
                f"{path}: expected a {'non-empty ' if self.non_empty else ''}list of integers >= {self.lo}"
            )
        items = [Int(lo=self.lo).integer(x, f"{path}[]") for x in v]
        return tuple(sorted(set(items))) if self.sorted_set else tuple(items)


def path_str(v: Any, path: str) -> str | None:
    """A filesystem path (str or os.PathLike), stored as str; None stays None."""
    if v is None:
        return None
    if not isinstance(v, str | os.PathLike):
        raise ValueError(f"{path}: expected a path, got {v!r}")
    return str(v)


def quantization(v: Any, path: str) -> str | None:
    """None (or "none"): the checkpoint's format; "fp8": FP8 weights (quantised at load from 16 bits)."""
    if v is None or (isinstance(v, str) and v.lower() in ("none", "")):
        return None
    if not isinstance(v, str) or v.lower() not in QUANTIZATIONS:
        raise ValueError(
            f"{path}: {v!r} is not supported; use one of {list(QUANTIZATIONS)} or null "
            "(the checkpoint's own format)"
        )
    return v.lower()


def optional_str(v: Any, path: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{path}: expected a string, got {v!r}")
    return v


def nonempty_str_or_none(v: Any, path: str) -> str | None:
    """None, or a string with something in it (a Hub revision: a branch, tag or commit)."""
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{path}: expected a non-empty string, got {v!r}")
    return v.strip()


def model_names(v: Any, path: str) -> tuple[str, ...] | None:
    """None, a name, or a list of names (vLLM's --served-model-name takes several): the first is the one
    responses and metrics report, clients may send any."""
    if v is None:
        return None
    if not isinstance(v, str | list | tuple):
        raise ValueError(f"{path}: expected a string, got {v!r}")
    items = [v] if isinstance(v, str) else list(v)
    if not items:
        raise ValueError(f"{path}: expected at least one name, got an empty list")
    names: list[str] = []
    for i, name in enumerate(items):
        where = path if isinstance(v, str) else f"{path}[{i}]"
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"{where}: expected a non-empty string, got {name!r}")
        if len(name) > MAX_MODEL_NAME_CHARS:
            raise ValueError(
                f"{where}: {len(name)} characters; a model name has at most {MAX_MODEL_NAME_CHARS}"
            )
        if name.strip() not in names:
            names.append(name.strip())
    return tuple(names)


# ---- field metadata -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Option:
    check: Check
    aliases: tuple[str, ...] = ()  # other accepted spellings; the field's own name wins when both are given


@dataclass(frozen=True)
class _Section:
    cls: type
    key: str | None  # the nested mapping's YAML key; None: its options sit at the parent's level


def option(default: Any, check: Check, *, aliases: tuple[str, ...] = ()) -> Any:
    """A field read from the option of the same name (or an alias), checked by `check`."""
    return field(default=default, metadata={"hyserve": _Option(check, aliases)})


def section(cls: type, key: str | None = None) -> Any:
    """A nested config read from the mapping at `key` (None: flattened into the parent's keys)."""
    return field(default_factory=cls, metadata={"hyserve": _Section(cls, key)})


# ---- cross-field checks (also called by the capacity planner, which plans from the same knobs) -----------


def check_snapshot_interval(interval: int | None, tokens_per_block: int) -> None:
    if interval is not None and interval % tokens_per_block:
        raise ValueError(
            f"kv_cache_config.mamba_state_config.periodic_snapshot_interval={interval} must be a positive "
            f"multiple of kv_cache_config.tokens_per_block={tokens_per_block}: Mamba snapshots are keyed on "
            f"full KV blocks. Try {-(-interval // tokens_per_block) * tokens_per_block}."
        )


def check_token_budget(max_num_tokens: int, max_batch_size: int) -> None:
    if max_num_tokens < max_batch_size:
        raise ValueError(
            f"max_num_tokens={max_num_tokens} is smaller than max_batch_size={max_batch_size}: a decode step "
            "needs one token per running request. Raise max_num_tokens or lower max_batch_size."
        )


def expert_split_problem(tp_size: int, ep_size: int) -> str | None:
    """Why ep_size cannot split tp_size's ranks, or None (also checked against the world at start-up)."""
    if tp_size % ep_size:
        return (
            f"ep_size ({ep_size}) must divide tp_size ({tp_size}): experts are sharded over the "
            "tensor-parallel ranks, each expert tensor-parallel over tp_size / ep_size of them"
        )
    return None


# ---- the configs -----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class MambaStateConfig:
    periodic_snapshot_interval: int | None = option(256, Int(lo=1, none_ok=True))
    additional_snapshot_offsets_from_end: tuple[int, ...] = option((0,), IntList(lo=0))


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    tokens_per_block: int = option(64, Int(lo=1))
    enable_block_reuse: bool = option(True, boolean)
    avg_seq_len: int | None = option(None, Int(lo=1, none_ok=True))
    free_gpu_memory_fraction: float = option(0.9, fraction)
    # vLLM's --gpu-memory-utilization: the share of the GPU's total memory this engine may hold in all
    # (weights, activations and pools); set, it replaces free_gpu_memory_fraction
    gpu_memory_utilization: float | None = option(None, fraction_or_none)
    max_tokens: int | None = option(None, Int(lo=1, none_ok=True))  # cap on KV tokens
    # explicit byte budget for KV + state pools (the CPU's budget)
    max_gpu_total_bytes: int | None = option(None, Int(lo=1, none_ok=True))
    dtype: str = option(
        "auto", Choice(KV_CACHE_DTYPES, KV_DTYPE_SPELLINGS, KV_DTYPES_REFUSED)
    )  # KV cache dtype
    kv_scales: str = option("auto", Choice(KV_SCALE_SOURCES))  # fp8 only: KV_SCALE_SOURCES
    mamba_ssm_cache_dtype: str = option("float32", Choice(SSM_CACHE_DTYPES, SSM_DTYPE_SPELLINGS))
    mamba_ssm_stochastic_rounding: bool = option(False, boolean)
    mamba_ssm_philox_rounds: int = option(
        10, Int(lo=1, hi=MAX_PHILOX_ROUNDS, hint="10 is Philox's usual count")
    )
    mamba_state_config: MambaStateConfig = section(MambaStateConfig, "mamba_state_config")
    allow_oversized_max_seq_len: bool = option(False, boolean)

    def check(self) -> None:
        check_snapshot_interval(self.mamba_state_config.periodic_snapshot_interval, self.tokens_per_block)
        if self.mamba_ssm_stochastic_rounding and self.mamba_ssm_cache_dtype != "float16":
            raise ValueError(
                "kv_cache_config.mamba_ssm_stochastic_rounding needs kv_cache_config.mamba_ssm_cache_dtype: "
                f"float16 (got {self.mamba_ssm_cache_dtype})"
            )
        if self.kv_scales != "auto" and self.dtype != "fp8":
            # an explicit choice that could do nothing is a mistake worth stopping for (a 16/32-bit pool
            # stores K and V unscaled); "auto" is the default and means nothing without fp8
            raise ValueError(
                f"kv_cache_config.kv_scales: {self.kv_scales!r} chooses the k_scale / v_scale of an fp8 KV "
                f"cache, but kv_cache_config.dtype is {self.dtype!r} (K and V are stored unscaled); set "
                "kv_cache_config.dtype: fp8, or leave kv_scales at 'auto' (allowed: "
                f"{list(KV_SCALE_SOURCES)})"
            )


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    # None: sized at start-up from memory and the model (cache/batch_sizing.py): the most requests whose
    # Mamba state and KV fit, up to 1,024 on a GPU (256 on the CPU); max_num_tokens None: max(8192, batch)
    max_batch_size: int | None = option(None, Int(lo=1, none_ok=True), aliases=("max_num_seqs",))
    max_num_tokens: int | None = option(None, Int(lo=1, none_ok=True), aliases=("max_num_batched_tokens",))
    max_seq_len: int | None = option(
        None, Int(lo=2, none_ok=True)
    )  # None -> the model's max_position_embeddings
    enable_chunked_prefill: bool = option(True, boolean)
    # step composition (docs/architecture.md): continuing prefills that share a step's budget, the most a
    # long prompt's chunk takes when other prefills share the step (None: max_num_tokens /
    # max_num_partial_prefills), and the step-time target chunks are sized for once the warm-up has
    # calibrated the step cost model ("auto", the default: DEFAULT_MAX_STEP_MS on CUDA, calibrated at
    # start-up; on the CPU the token budget and long_prefill_token_threshold alone; None / "off": the token
    # budget only)
    max_num_partial_prefills: int = option(4, Int(lo=1))
    long_prefill_token_threshold: int | None = option(None, Int(lo=1, none_ok=True))
    max_step_ms: float | str | None = option("auto", step_ms_target)
    # batch waiting, as TensorRT-LLM's: while a full batch decodes and more requests wait than slots are
    # free, admissions wait (at most batch_wait_timeout_iters steps; 0: never) until their first chunks and
    # the decode rows fill batch_wait_max_tokens_ratio of max_num_tokens, so fewer steps run eagerly
    # (Scheduler._hold_admissions)
    batch_wait_timeout_iters: int = option(DEFAULT_BATCH_WAIT_ITERS, Int(lo=0))
    batch_wait_max_tokens_ratio: float = option(DEFAULT_BATCH_WAIT_RATIO, unit_share)
    # admission and preemption order (SCHEDULING_POLICIES); under "fcfs" a request's priority must be 0
    scheduling_policy: str = option("fcfs", Choice(SCHEDULING_POLICIES))

    def check(self) -> None:
        if self.max_num_tokens is not None and self.max_batch_size is not None:
            check_token_budget(self.max_num_tokens, self.max_batch_size)

    def step_target_ms(self, device_type: str) -> float | None:
        """The step-time target in force on a device: "auto" is DEFAULT_MAX_STEP_MS on CUDA, off elsewhere
        (the CPU has no calibration of its own)."""
        if self.max_step_ms == "auto":
            return DEFAULT_MAX_STEP_MS if device_type == "cuda" else None
        return None if isinstance(self.max_step_ms, str) else self.max_step_ms


@dataclass(frozen=True, kw_only=True)
class CudaGraphConfig:
    enabled: bool = option(True, boolean)
    enable_padding: bool = option(True, boolean)
    max_batch_size: int | None = option(None, Int(lo=1, none_ok=True))  # None -> scheduler.max_batch_size
    batch_sizes: tuple[int, ...] | None = option(
        None, IntList(lo=1, non_empty=True, sorted_set=True, none_ok=True)
    )
    # prefill and mixed steps through piecewise graphs (engine/runner/mixed_graphs.py), one per padded
    # token count: `piecewise_token_sizes`, or None for the defaults up to max_num_tokens
    piecewise: bool = option(True, boolean)
    piecewise_token_sizes: tuple[int, ...] | None = option(
        None, IntList(lo=1, non_empty=True, sorted_set=True, none_ok=True)
    )


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tp_size: int = option(1, Int(lo=1), aliases=("tensor_parallel_size",))
    ep_size: int = option(1, Int(lo=1), aliases=("moe_expert_parallel_size",))

    def check(self) -> None:
        # the world, the visible GPUs and the model's heads / experts are checked at start-up
        # (engine/parallel/launch.py)
        problem = expert_split_problem(self.tp_size, self.ep_size)
        if problem:
            raise ValueError(problem)


def spec_method(v: Any, path: str) -> str | None:
    """None (off) or a drafting method of SPEC_METHODS (or another server's name for one)."""
    return None if v is None else Choice(SPEC_METHODS, SPEC_METHOD_SPELLINGS)(v, path)


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding, in vLLM's form (`{"method": "ngram", "num_speculative_tokens": 3}`;
    TensorRT-LLM's `decoding_type` form is read by `normalize_speculative_config`). Off when `method` is
    None. A step drafts up to `num_speculative_tokens` tokens per decoding request and verifies them all in
    one forward (engine/speculative/)."""

    method: str | None = option(None, spec_method)
    num_speculative_tokens: int | None = option(None, Int(lo=1, hi=MAX_SPEC_TOKENS, none_ok=True))
    # n-gram drafting: the shortest and longest suffix of the context looked up in it (one given: both)
    prompt_lookup_min: int | None = option(None, Int(lo=1, none_ok=True))
    prompt_lookup_max: int | None = option(None, Int(lo=1, none_ok=True))
    # no drafting in a step with more decoding requests than this (None: the engine's measured default)
    disable_by_batch_size: int | None = option(None, Int(lo=1, none_ok=True))

    @property
    def enabled(self) -> bool:
        return self.method is not None

    def lookup_range(self) -> tuple[int, int]:
        """(shortest, longest) n-gram matched, vLLM's defaults filling what is unset."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            return DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP
        return (lo or hi or 1), (hi or lo or 1)

    def check(self) -> None:
        set_keys = [f.name for f in dataclasses.fields(self) if f.name != "method" and getattr(self, f.name)]
        if self.method is None:
            if set_keys:
                raise ValueError(
                    f"speculative_config: {', '.join(set_keys)} given without a method; set "
                    f"speculative_config.method to one of {list(SPEC_METHODS)}"
                )
            return
        if self.num_speculative_tokens is None:
            raise ValueError(
                f"speculative_config.num_speculative_tokens: method {self.method!r} needs the number of "
                f"tokens to draft per step (1 to {MAX_SPEC_TOKENS})"
            )
        lo, hi = self.lookup_range()
        if self.method != "ngram" and (self.prompt_lookup_min or self.prompt_lookup_max):
            raise ValueError(
                f"speculative_config: prompt_lookup_min / prompt_lookup_max belong to method 'ngram', "
                f"not {self.method!r}"
            )
        if lo > hi:
            raise ValueError(
                f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )


# TensorRT-LLM's speculative_config: decoding_type -> hyserve's method, and its keys -> hyserve's
_TRT_DECODING_TYPES = {"mtp": "mtp", "ngram": "ngram"}
_TRT_SPEC_KEYS = {
    "num_nextn_predict_layers": "num_speculative_tokens",
    "max_draft_len": "num_speculative_tokens",
    "max_matching_ngram_size": "prompt_lookup_max",
}


def normalize_speculative_config(opts: dict[str, Any]) -> dict[str, Any]:
    """`speculative_config` in TensorRT-LLM's form (`decoding_type: MTP`, `num_nextn_predict_layers: 3`;
    `decoding_type: NGram`, `max_draft_len`, `max_matching_ngram_size`) rewritten in vLLM's, which
    `SpeculativeConfig` reads. Other forms pass through unchanged (and are checked there)."""
    spec = opts.get("speculative_config")
    if not isinstance(spec, dict) or "decoding_type" not in spec:
        return opts
    if "method" in spec:
        raise ValueError(
            "speculative_config: give method (vLLM's form) or decoding_type (TensorRT-LLM's), not both"
        )
    rest = dict(spec)
    kind = rest.pop("decoding_type")
    method = _TRT_DECODING_TYPES.get(str(kind).lower())
    if method is None:
        raise ValueError(
            f"speculative_config.decoding_type: {kind!r} is not supported; use one of ['MTP', 'NGram']"
        )
    out: dict[str, Any] = {"method": method}
    for k, v in rest.items():
        key = _TRT_SPEC_KEYS.get(k, k)
        if key in out and out[key] != v:
            raise ValueError(f"speculative_config: {k} ({v!r}) disagrees with {out[key]!r} given for {key}")
        out[key] = v
    return {**opts, "speculative_config": out}


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    model: str | None = option(None, path_str)  # None -> the built-in tiny model
    dtype: str = option("auto", Choice(MODEL_DTYPES, DTYPE_SPELLINGS))
    device: str = option("auto", Choice(DEVICES))
    load_format: str = option("auto", Choice(LOAD_FORMATS))
    # where load_format "dummy" draws its random weights (DUMMY_INIT): "auto" on the model's device (a GPU
    # draws a 30B model in a fraction of a second; its values depend on the kind of GPU), "host" on the CPU
    # (the same values on every device, many seconds for a large model)
    dummy_init: str = option("auto", Choice(DUMMY_INIT))
    # weight format: None = the checkpoint's (FP8 for a ModelOpt / block-fp8 checkpoint), "fp8" = FP8 weights,
    # quantised per output channel at load from a 16-bit checkpoint (or from dummy weights)
    quantization: str | None = option(None, quantization)
    # the names clients may send in `model`; the first is the one responses and metrics report (None: the
    # directory's name, or the Hub id)
    served_model_name: tuple[str, ...] | str | None = option(None, model_names)
    # a model given as a Hugging Face Hub id: its revision (branch, tag or commit; None: main) and where its
    # snapshot is kept (None: the Hub cache, $HF_HUB_CACHE or $HF_HOME/hub), as vLLM's --revision and
    # --download-dir (hyserve/hub.py)
    revision: str | None = option(None, nonempty_str_or_none)
    download_dir: str | None = option(None, path_str)
    seed: int = option(0, Int(lo=SEED_MIN, hi=SEED_MAX, hint="seeds are 64-bit signed integers"))
    scheduler: SchedulerConfig = section(SchedulerConfig)
    cache: CacheConfig = section(CacheConfig, "kv_cache_config")
    cuda_graph: CudaGraphConfig = section(CudaGraphConfig, "cuda_graph_config")
    parallel: ParallelConfig = section(ParallelConfig)
    speculative: SpeculativeConfig = section(SpeculativeConfig, "speculative_config")
    # warm-up before ready: "auto" = on CUDA (the CPU path has nothing to compile), "on", "off"
    warmup: str = option("auto", Choice(WARMUP_MODES))
    # a Triton compilation after ready fails the step that caused it
    strict_warmup: bool = option(False, boolean)
    cache_dir: str | None = option(
        None, path_str
    )  # persistent kernel cache root (default: envs.HYSERVE_CACHE_DIR)
    # launch the next decode step before the host has read this one's tokens (they are fed to it on the
    # device), so the host's per-step work overlaps the GPU's (LLMEngine docstring)
    async_scheduling: bool = option(True, boolean)
    # supervision (AsyncEngine): a failure outside a step resets the engine and serving goes on; the
    # engine_failure_limit-th such failure within engine_failure_window_s seconds stops it for good (the
    # server then exits non-zero, so a supervisor restarts the process)
    engine_failure_limit: int = option(5, Int(lo=1))
    engine_failure_window_s: float = option(60.0, positive_seconds)
    ignored_keys: tuple[str, ...] = ()  # filled in by build_engine_config; not an option

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)

    @property
    def served_names(self) -> tuple[str, ...]:
        """`served_model_name` as a tuple (empty: the default name)."""
        v = self.served_model_name
        return (v,) if isinstance(v, str) else tuple(v or ())


# ---- building from options -----------------------------------------------------------------------


def _meta(f: dataclasses.Field) -> _Option | _Section | None:
    return f.metadata.get("hyserve")


def accepted_keys(cls: type) -> set[str]:
    """The option keys one mapping level of `cls` accepts (flattened sections included)."""
    keys: set[str] = set()
    for f in dataclasses.fields(cls):
        m = _meta(f)
        if isinstance(m, _Option):
            keys |= {f.name, *m.aliases}
        elif isinstance(m, _Section):
            keys |= {m.key} if m.key is not None else accepted_keys(m.cls)
    return keys


def closest_key(key: Any, known: set[str] | frozenset[str]) -> str | None:
    """The known key most like `key` (a typo's correction), or None when none is close."""
    if not isinstance(key, str):
        return None
    lowered = {k.lower().replace("-", "_"): k for k in known}
    hit = difflib.get_close_matches(key.lower().replace("-", "_"), list(lowered), n=1, cutoff=0.6)
    return lowered[hit[0]] if hit else None


def unknown_key_error(key: Any, path: str, allowed: set[str]) -> ValueError:
    """The error of an unknown key at `path` (its parent's key path): its full path, the closest known key
    (its full path too) and the keys allowed there."""
    full = f"{path}.{key}" if path else str(key)
    compat = {p.rpartition(".") for p in COMPAT_IGNORED_KEYS | set(COMPAT_CHECKED_KEYS)}
    near = closest_key(key, allowed | {name for parent, _, name in compat if parent == path})
    hint = f" (did you mean {(f'{path}.{near}' if path else near)!r}?)" if near else ""
    return ValueError(
        f"unknown option {full!r}{hint}; allowed keys{' in ' + path if path else ''}: {sorted(allowed)}"
    )


def _check_keys(d: dict[str, Any], allowed: set[str], path: str, ignored: list[str]) -> None:
    for k in d:
        full = f"{path}.{k}" if path else k
        if k in allowed:
            continue
        if full in COMPAT_IGNORED_KEYS:
            ignored.append(full)
            continue
        if full in COMPAT_CHECKED_KEYS:
            problem = COMPAT_CHECKED_KEYS[full](d[k])
            if problem:
                raise ValueError(f"{full}: {problem}")
            ignored.append(full)
            continue
        raise unknown_key_error(k, path, allowed)


def _build(cls: type, d: dict[str, Any], path: str, ignored: list[str], *, keys_checked: bool = False) -> Any:
    """An instance of config class `cls` from the mapping `d` found at key path `path`."""
    if not keys_checked:
        _check_keys(d, accepted_keys(cls), path, ignored)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        m = _meta(f)
        if isinstance(m, _Option):
            key = next((k for k in (f.name, *m.aliases) if k in d), None)
            if key is not None:
                values[f.name] = m.check(d[key], f"{path}.{f.name}" if path else f.name)
        elif isinstance(m, _Section) and m.key is None:  # same level: its keys were checked with ours
            values[f.name] = _build(m.cls, d, path, ignored, keys_checked=True)
        elif isinstance(m, _Section) and m.key is not None:
            sub_path = f"{path}.{m.key}" if path else m.key
            sub = d.get(m.key)
            if sub is None:
                sub = {}
            elif not isinstance(sub, dict):
                raise ValueError(f"{sub_path}: expected a mapping, got {sub!r}")
            values[f.name] = _build(m.cls, sub, sub_path, ignored)
    built = cls(**values)
    if hasattr(built, "check"):
        built.check()
    return built


def hoist_mamba_state_config(opts: dict[str, Any]) -> dict[str, Any]:
    """`mamba_state_config` given at the top level (as some TensorRT-LLM YAMLs write it) moved under
    `kv_cache_config`, where hyserve reads it; given in both places, the two must agree."""
    if "mamba_state_config" not in opts:
        return opts
    out = dict(opts)
    top = out.pop("mamba_state_config")
    kv = out.get("kv_cache_config")
    kv = {} if kv is None else kv
    if not isinstance(kv, dict):
        return opts  # _build names the bad kv_cache_config
    if "mamba_state_config" in kv and kv["mamba_state_config"] != top:
        raise ValueError(
            f"mamba_state_config ({top!r}) and kv_cache_config.mamba_state_config "
            f"({kv['mamba_state_config']!r}) differ: give it once"
        )
    out["kv_cache_config"] = {**kv, "mamba_state_config": top}
    return out


def _check_one_memory_share(opts: dict[str, Any]) -> None:
    kv = opts.get("kv_cache_config")
    if isinstance(kv, dict) and kv.get("gpu_memory_utilization") is not None:
        if kv.get("free_gpu_memory_fraction") is not None:
            raise ValueError(
                "kv_cache_config.gpu_memory_utilization (a share of the GPU's total memory, vLLM's "
                "--gpu-memory-utilization) and kv_cache_config.free_gpu_memory_fraction (a share of the "
                "memory free after the weights) size the same pools: give one of them"
            )


def build_engine_config(options: dict[str, Any] | None = None, **kwargs: Any) -> EngineConfig:
    """Validate an options dict (YAML keys / LLM kwargs; nested dicts for kv_cache_config etc.)."""
    opts: dict[str, Any] = dict(options or {})
    opts.update(kwargs)
    opts = hoist_mamba_state_config(opts)
    opts = normalize_speculative_config(opts)
    _check_one_memory_share(opts)
    ignored: list[str] = []
    config = _build(EngineConfig, opts, "", ignored)
    return dataclasses.replace(config, ignored_keys=tuple(ignored))


def load_yaml_options(path: str | Path, *, flag: str = "--config") -> dict[str, Any]:
    """Read a YAML options file; errors name the file (and `flag`, the option that named it)."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{flag}: file not found: {p}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{flag} {p}: not valid YAML ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{flag} {p}: expected a mapping of options at the top level")
    return data
