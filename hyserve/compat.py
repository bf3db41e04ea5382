"""The option names of `vllm serve` and `trtllm-serve`, read as hyserve's.

A YAML file (`--config`, `--extra_llm_api_options`) and the command line both arrive here as one flat
mapping of names to values; `translate` sorts it into hyserve's engine options (the nested keys of
`build_engine_config`) and server options (the keys of `ServerOptions`), whichever server's spelling each
name is in:

    vLLM                          hyserve
    max_model_len                 max_seq_len
    gpu_memory_utilization        kv_cache_config.gpu_memory_utilization
    tensor_parallel_size          tp_size
    enable_expert_parallel        ep_size = tp_size
    kv_cache_dtype                kv_cache_config.dtype
    mamba_ssm_cache_dtype         kv_cache_config.mamba_ssm_cache_dtype
    enable_prefix_caching         kv_cache_config.enable_block_reuse
    enforce_eager                 cuda_graph_config.enabled: false
    compilation_config (-O)       cudagraph_mode NONE: cuda_graph_config.enabled false; FULL_DECODE_ONLY:
                                  piecewise false; FULL_AND_PIECEWISE, PIECEWISE, FULL: both (decode
                                  steps replay whole-step graphs, the others piecewise ones);
                                  cudagraph_capture_sizes: batch_sizes; max_cudagraph_capture_size:
                                  max_batch_size; a level (-O0 .. -O3): 0 is no graphs. Its torch.compile
                                  keys are accepted without effect
    tool_call_parser              tool_parser
    uvicorn_log_level             log_level

Names may be written with hyphens (`max-model-len`, as vLLM's `--config` YAML does). One option given twice
in one source under two names with different values (`max_seq_len: 4096` beside `max-model-len: 8192`) is
refused naming both; between sources the later wins (`merge`: YAML < command line).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hyserve.config import (
    COMPAT_CHECKED_KEYS,
    COMPAT_IGNORED_KEYS,
    SERVER_YAML_KEYS,
    EngineConfig,
    accepted_keys,
    closest_key,
)


def _boolean(name: str) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        if not isinstance(v, bool):
            raise ValueError(f"{name}: expected true or false, got {v!r}")
        return v

    return check


def _negated(name: str) -> Callable[[Any], bool]:
    check = _boolean(name)
    return lambda v: not check(v)


@dataclass(frozen=True)
class Spelling:
    """Another server's name for a hyserve option: the option's key path and how a value converts."""

    target: str
    convert: Callable[[Any], Any] | None = None


# other servers' names of engine options -> hyserve's key path
ENGINE_SPELLINGS: dict[str, Spelling] = {
    "max_model_len": Spelling("max_seq_len"),
    "gpu_memory_utilization": Spelling("kv_cache_config.gpu_memory_utilization"),
    "tensor_parallel_size": Spelling("tp_size"),
    "moe_expert_parallel_size": Spelling("ep_size"),
    "max_num_seqs": Spelling("max_batch_size"),
    "max_num_batched_tokens": Spelling("max_num_tokens"),
    "kv_cache_dtype": Spelling("kv_cache_config.dtype"),
    "mamba_ssm_cache_dtype": Spelling("kv_cache_config.mamba_ssm_cache_dtype"),
    "enable_prefix_caching": Spelling("kv_cache_config.enable_block_reuse"),
    "enforce_eager": Spelling("cuda_graph_config.enabled", _negated("enforce_eager")),
    "kv_cache_free_gpu_memory_fraction": Spelling("kv_cache_config.free_gpu_memory_fraction"),
    "mamba_state_config": Spelling("kv_cache_config.mamba_state_config"),
    # resolved by `finish` once tp_size is known
    "enable_expert_parallel": Spelling("enable_expert_parallel", _boolean("enable_expert_parallel")),
}
# other servers' names of server options -> hyserve's
SERVER_SPELLINGS: dict[str, str] = {
    "tool_call_parser": "tool_parser",
    "uvicorn_log_level": "log_level",
    "disable_uvicorn_access_log": "disable_log_requests",
}
# every server option's name (ServerOptions is built from these in hyserve/cli.py)
SERVER_KEYS = frozenset(SERVER_YAML_KEYS)
# engine options that take a mapping, read key by key so a flag can set one of their keys
_SECTIONS = ("kv_cache_config", "cuda_graph_config")
# the two ways to size the cache pools on a GPU: a later source giving one replaces the other
_MEMORY_SHARES = ("kv_cache_config.gpu_memory_utilization", "kv_cache_config.free_gpu_memory_fraction")


def known_names() -> frozenset[str]:
    """Every top-level name `translate` accepts."""
    compat = {k for k in COMPAT_IGNORED_KEYS | set(COMPAT_CHECKED_KEYS) if "." not in k}
    return frozenset(
        accepted_keys(EngineConfig)
        | compat
        | set(ENGINE_SPELLINGS)
        | SERVER_KEYS
        | set(SERVER_SPELLINGS)
        | {"compilation_config"}
    )


@dataclass
class Options:
    """Engine options (nested, as build_engine_config takes them) and server options, with the name each
    option was given under (for the messages), and the names accepted without effect."""

    source: str
    engine: dict[str, Any] = field(default_factory=dict)
    server: dict[str, Any] = field(default_factory=dict)
    given_as: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def set(self, path: str, value: Any, name: str) -> None:
        """Set the option at `path` ("server.NAME" for a server option); the same option given before under
        another name must have had the same value."""
        node = self.server if path.startswith("server.") else self.engine
        parts = path.removeprefix("server.").split(".")
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ValueError(f"{self.source}: {p}: expected a mapping, got {child!r}")
            node = child
        leaf = parts[-1]
        if leaf in node and node[leaf] != value:
            raise ValueError(
                f"{self.source}: {self.given_as.get(path, path)!r} ({node[leaf]!r}) and {name!r} ({value!r}) "
                f"set the same option ({path.removeprefix('server.')}) to different values: give it once"
            )
        node[leaf] = value
        self.given_as[path] = name


def canonical_name(key: Any, known: frozenset[str]) -> Any:
    """`max-model-len` -> `max_model_len` when that is a known name; anything else as it is."""
    if isinstance(key, str) and key not in known and key.replace("-", "_") in known:
        return key.replace("-", "_")
    return key


def translate(raw: Mapping[Any, Any], source: str) -> Options:
    """Sort one source's names (YAML keys or flags, in any server's spelling) into hyserve's options.

    Raises ValueError naming the source for an unknown name (with the closest known one) or an option given
    twice with different values."""
    known = known_names()
    out = Options(source)
    for key, value in raw.items():
        name = canonical_name(key, known)
        if name in SERVER_KEYS or name in SERVER_SPELLINGS:
            out.set(f"server.{SERVER_SPELLINGS.get(name, name)}", value, str(key))
        elif name in ENGINE_SPELLINGS:
            sp = ENGINE_SPELLINGS[name]
            try:
                converted = sp.convert(value) if sp.convert else value
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
            out.set(sp.target, converted, str(key))
        elif name == "compilation_config":
            try:
                effective, ignored = compilation_options(value)
            except ValueError as e:
                raise ValueError(f"{source}: {e}") from None
            for path, v in effective:
                out.set(path, v, f"{key}.{path.rsplit('.', 1)[1]}")
            out.ignored += ignored
        elif name in _SECTIONS and (value is None or isinstance(value, dict)):
            for sub, v in (value or {}).items():
                out.set(f"{name}.{sub}", v, f"{name}.{sub}")
        elif name in known:
            out.set(name, value, str(key))
        else:
            near = closest_key(key, known)
            hint = f" (did you mean {near!r}?)" if near else ""
            raise ValueError(
                f"{source}: unknown option {key!r}{hint}: not an option of hyserve, trtllm-serve or vllm "
                "serve (docs/configuration.md lists them)"
            )
    return out


def merge(base: Options, over: Options) -> Options:
    """`over`'s options on top of `base`'s (nested mappings merged key by key); a pool share given in
    `over` replaces the other share in `base`."""
    ignored = _union(base.ignored, over.ignored)
    out = Options(over.source, _deep_copy(base.engine), dict(base.server), dict(base.given_as), ignored)
    kv = out.engine.get("kv_cache_config")
    for share, other in (_MEMORY_SHARES, _MEMORY_SHARES[::-1]):
        if share in over.given_as and isinstance(kv, dict):
            kv.pop(other.rsplit(".", 1)[1], None)
    _deep_update(out.engine, over.engine)
    out.server.update(over.server)
    out.given_as.update(over.given_as)
    return out


def combine(a: Options, b: Options) -> Options:
    """The options of two sources of equal rank (two YAML files): together, each option with one value."""
    out = Options(f"{a.source} and {b.source}" if a.given_as else b.source)
    out.ignored = _union(a.ignored, b.ignored)
    for src in (a, b):
        for path, name in src.given_as.items():
            node: Any = src.server if path.startswith("server.") else src.engine
            for part in path.removeprefix("server.").split("."):
                node = node[part]
            out.set(path, node, f"{name} ({src.source})" if a.given_as else name)
    return out


# vLLM's CUDA-graph modes -> (cuda_graph_config.enabled, .piecewise). With graphs on, hyserve replays
# whole-step graphs for decode steps and piecewise ones for the rest: the nearest it has to PIECEWISE and FULL
CUDAGRAPH_MODES = {
    "NONE": (False, False),
    "FULL_DECODE_ONLY": (True, False),
    "FULL_AND_PIECEWISE": (True, True),
    "PIECEWISE": (True, True),
    "FULL": (True, True),
}
# the optimisation levels (-O0 .. -O3): 0 has no CUDA graphs, the others vLLM's default graphs
_LEVELS = range(4)


def compilation_options(value: Any) -> tuple[list[tuple[str, Any]], list[str]]:
    """vLLM's compilation_config (a mapping, a JSON object's text, or an optimisation level 0-3) as
    ([(hyserve key path, value)], [names accepted without effect])."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("{") else int(text)
        except ValueError:
            raise ValueError(
                f"compilation_config: {value!r} is neither a JSON object nor an optimisation level 0-3"
            ) from None
    if isinstance(value, int) and not isinstance(value, bool):
        if value not in _LEVELS:
            raise ValueError(f"compilation_config: optimisation level {value} is not one of 0, 1, 2, 3")
        return ([("cuda_graph_config.enabled", False)] if value == 0 else []), []
    if not isinstance(value, dict):
        raise ValueError(f"compilation_config: expected a mapping or a level 0-3, got {value!r}")
    out: list[tuple[str, Any]] = []
    ignored: list[str] = []
    for k, v in value.items():
        if k == "cudagraph_mode":
            mode = v.upper() if isinstance(v, str) else v
            if mode not in CUDAGRAPH_MODES:
                raise ValueError(
                    f"compilation_config.cudagraph_mode: {v!r} is not one of {', '.join(CUDAGRAPH_MODES)}"
                )
            enabled, piecewise = CUDAGRAPH_MODES[mode]
            out.append(("cuda_graph_config.enabled", enabled))
            if enabled:
                out.append(("cuda_graph_config.piecewise", piecewise))
        elif k == "cudagraph_capture_sizes":
            out.append(("cuda_graph_config.batch_sizes", v))
        elif k == "max_cudagraph_capture_size":
            out.append(("cuda_graph_config.max_batch_size", v))
        else:  # torch.compile's settings (level, mode, backend, custom_ops, ...): hyserve does not compile
            ignored.append(f"compilation_config.{k}")
    return out, ignored


def finish(opts: Options) -> dict[str, Any]:
    """The engine options for build_engine_config: `enable_expert_parallel` resolved to ep_size = tp_size
    (vLLM's expert parallelism shards the experts over every tensor-parallel rank)."""
    engine = _deep_copy(opts.engine)
    if engine.pop("enable_expert_parallel", False):
        tp = engine.get("tp_size", 1)
        ep = engine.get("ep_size")
        if ep is not None and ep != tp:
            raise ValueError(
                f"enable_expert_parallel shards the experts over all tp_size = {tp} ranks, but ep_size is "
                f"{ep}: give one of them"
            )
        engine["ep_size"] = tp
    return engine


def _union(a: list[str], b: list[str]) -> list[str]:
    """a's names, then b's that a lacks."""
    return list(dict.fromkeys([*a, *b]))


def _deep_copy(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def _deep_update(into: dict[str, Any], new: dict[str, Any]) -> None:
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _deep_update(into[k], v)
        else:
            into[k] = _deep_copy(v) if isinstance(v, dict) else v
