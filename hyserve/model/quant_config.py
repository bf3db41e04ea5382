"""The weight format of a model: 16-bit, or FP8 (float8 e4m3 weights with float32 dequantisation scales).

Where the format comes from, in order:

    config.json "quantization_config"         quant_method modelopt or fp8 (ModelOpt's keys may also
                                              sit in a nested "quantization" mapping there)
    hf_quant_config.json "quantization"       ModelOpt's own file (producer modelopt)
    the engine option `quantization: fp8`     a 16-bit checkpoint quantised while it loads ("online")

    method / quant_algo            weights   scales (dequantise: w = w_fp8 * scale)
    modelopt FP8                   e4m3      `weight_scale` one per tensor; `input_scale` (static activation
                                             scale) is read past: the kernels scale activations per token,
                                             dynamically
    modelopt                       e4m3      `weight_scale` one per output channel ([N] or [N, 1])
      FP8_PER_CHANNEL_PER_TOKEN
    modelopt FP8_PB_WO             e4m3      `weight_scale` per [128, 128] block ([N/128, K/128], or
                                             ModelOpt's [N/128, 1, K/128, 1])
    modelopt MIXED_PRECISION       e4m3      the one FP8 algorithm above that every `quantized_layers` entry
                                             names; the projections it does not list stay 16-bit
    fp8                            e4m3      `weight_scale_inv` per [128, 128] block (weight_block_size),
                                             or `weight_scale` per tensor without a block size
    compressed-tensors             e4m3      llm-compressor's float-quantized format: `weight_scale` per
      (FP8 config_groups)                    tensor ([1]), channel ([N, 1]) or [128, 128] block, one strategy
                                             in every group; the groups' `targets` ("Linear", names,
                                             `re:` patterns) say which projections; static `input_scale`s
                                             are read past
    online                         16/32-bit one per output channel, computed at load (amax / 448)

The KV cache's FP8 scales are announced as `kv_cache_quant_algo: FP8` (hf_quant_config.json) or as
`kv_cache_scheme: {type: float, num_bits: 8}` (config.json's form). Modules in the checkpoint's exclusion
list (`exclude_modules`, `ignore`, `ignored_layers`, `modules_to_not_convert`; names, fnmatch patterns or
compressed-tensors' `re:` regular expressions, `model.` read as `backbone.`) stay 16-bit, as do the
embeddings, lm_head, norms, the MoE router and the Mamba conv / A / D / dt parameters (never quantised: they
are not projections). Anything else (another quant method or algorithm, NVFP4 layers in a mixed-precision
checkpoint, another block size, static activation scales for the block format) is refused with what was found
and what is supported.
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FP8_MAX = 448.0  # largest finite float8 e4m3fn
BLOCK = 128  # the one weight block size the kernels take: [BLOCK, BLOCK]
QUANT_OPTIONS = (None, "fp8")  # the engine option `quantization`
SCHEMES = ("tensor", "channel", "block")
HF_QUANT_FILE = "hf_quant_config.json"
EXCLUDE_KEYS = ("exclude_modules", "ignore", "ignored_layers", "modules_to_not_convert")
# the projections that can hold FP8 weights (last component of the module name); everything else stays 16-bit
QUANTIZABLE_LINEARS = frozenset(
    {
        "in_proj",
        "out_proj",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "up_proj",
        "down_proj",
        "gate_proj",
        "input_linear",
        "output_linear",
        "fc1_latent_proj",
        "fc2_latent_proj",
    }
)
# ModelOpt's FP8 algorithms and the scale layout each stores
MODELOPT_FP8 = {"FP8": "tensor", "FP8_PER_CHANNEL_PER_TOKEN": "channel", "FP8_PB_WO": "block"}
MIXED = "MIXED_PRECISION"
COMPRESSED = "compressed-tensors"
SUPPORTED = (
    f"quant_method modelopt with quant_algo {' / '.join(MODELOPT_FP8)} (or {MIXED} whose "
    "quantized_layers all name one of them), quant_method fp8 "
    f"(weight_block_size [{BLOCK}, {BLOCK}], or per-tensor without one), quant_method {COMPRESSED} "
    "with 8-bit float weights (tensor, channel or block strategy), or a 16-bit checkpoint "
    "with quantization: fp8"
)


def canonical_module_name(name: str) -> str:
    """A module name as the quantisation rules read it (`model.` read as `backbone.`): NemotronH's own
    names, and the checkpoint names of the families whose modules sit under `model.`."""
    return "backbone." + name[len("model.") :] if name.startswith("model.") else name


def _matches(module_name: str, pattern: str) -> bool:
    """Whether a module list entry names `module_name` (canonical) or a module above it: the name itself,
    an fnmatch pattern (tried with and without `backbone.`; `model.` reads as `backbone.`), or a `re:` regular
    expression, matched from the start of the whole name as compressed-tensors does, in its `backbone.` and
    `model.` spellings. ModelOpt's `path*` (no dot before the star) means the module `path` and everything
    under it, as vLLM reads it, not `path0`...`path9`."""
    short = module_name.removeprefix("backbone.")
    if pattern.startswith("re:"):
        rx = pattern[3:]
        return bool(re.match(rx, module_name) or re.match(rx, "model." + short))
    p = canonical_module_name(pattern)
    globs = (p[:-1], p[:-1] + ".*") if len(p) >= 2 and p[-1] == "*" and p[-2] != "." else (p,)
    return any(
        n == g or n.startswith(g + ".") or fnmatch.fnmatchcase(n, g)
        for n in (module_name, short)
        for g in globs
    )


def _ancestors(module_name: str) -> list[str]:
    """`a.b.c` -> [`a.b.c`, `a.b`, `a`]."""
    parts = module_name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """How the quantised projections store their weights. `scheme` is the scale layout:
    tensor (one scale, held per output channel), channel ([N]) or block ([ceil(N/128), ceil(K/128)])."""

    method: str  # "modelopt" | "fp8" | "compressed-tensors" | "online"
    scheme: str  # one of SCHEMES
    exclude: tuple[str, ...] = ()
    # a mixed-precision checkpoint's FP8 modules (canonical names, `backbone.`...): only these are FP8; None:
    # every projection the exclusion list leaves
    include: frozenset[str] | None = None
    # compressed-tensors' config_groups targets, names or `re:` patterns; () = all (also for a "Linear"
    # target)
    targets: tuple[str, ...] = ()
    kv_cache_fp8: bool = False  # the checkpoint also ships FP8 KV scales (kv_cache_quant_algo FP8)
    source: str = ""  # where it was read, for messages

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"quantization scheme {self.scheme!r} is not one of {list(SCHEMES)}")

    @property
    def from_checkpoint(self) -> bool:
        """True when the checkpoint holds e4m3 weights (False: 16-bit weights quantised at load)."""
        return self.method != "online"

    @property
    def block_size(self) -> tuple[int, int] | None:
        return (BLOCK, BLOCK) if self.scheme == "block" else None

    def quantizes(self, module_name: str) -> bool:
        """Whether the projection `module_name` (canonical, `backbone.layers.3.mixer.in_proj`) is FP8."""
        leaf = module_name.rsplit(".", 1)[-1]
        if leaf not in QUANTIZABLE_LINEARS:
            return False
        if self.include is not None and not any(a in self.include for a in _ancestors(module_name)):
            return False
        if self.targets and not any(_matches(module_name, t) for t in self.targets):
            return False
        return not any(_matches(module_name, pat) for pat in self.exclude)

    def quantizes_experts(self, experts_name: str) -> bool:
        """Whether the routed experts `experts_name` (`backbone.layers.3.mixer.experts`) are FP8: their up and
        down projections both, or neither (the fused-MoE kernels take both in one format); ValueError naming
        the module where the config covers one of them only."""
        up, down = (self.quantizes(f"{experts_name}.0.{w}") for w in ("up_proj", "down_proj"))
        if up != down:
            fp8, other = ("up_proj", "down_proj") if up else ("down_proj", "up_proj")
            raise ValueError(
                f"{self.source or 'quantization config'}: the routed experts {experts_name} would have "
                f"an FP8 {fp8} and a 16-bit {other}; hyserve's fused MoE takes both in one format, so "
                "the config must quantise or exclude both"
            )
        return up

    def describe(self) -> str:
        scales = {
            "tensor": "per-tensor",
            "channel": "per-output-channel",
            "block": f"per-[{BLOCK}, {BLOCK}]-block",
        }[self.scheme]
        where = "quantised at load" if self.method == "online" else f"{self.method} checkpoint"
        excl = f", {len(self.exclude)} excluded module patterns" if self.exclude else ""
        if self.include is not None:
            excl += f", {len(self.include)} FP8 modules listed"
        if self.targets:
            excl += f", {len(self.targets)} target patterns"
        return f"fp8 e4m3 weights ({where}, {scales} scales{excl})"


def fp8_scale_count(scheme: str, shape: tuple[int, ...]) -> int:
    """float32 scales hyserve holds for an [N, K] FP8 weight (a per-tensor scale is held per row)."""
    n, k = shape
    return -(-n // BLOCK) * -(-k // BLOCK) if scheme == "block" else n


def _check_patterns(names: list[str], where: str, key: str) -> None:
    """Refuse a `re:` entry that is not a regular expression, naming it."""
    for n in names:
        if n.startswith("re:"):
            try:
                re.compile(n[3:])
            except re.error as e:
                raise ValueError(f"{where}: {key} entry {n!r} is not a regular expression ({e})") from None


def _exclude_list(q: dict[str, Any], where: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in EXCLUDE_KEYS:
        v = q.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"{where}: {key} must be a list of module names, got {v!r}")
        _check_patterns(v, where, key)
        out.extend(v)
    return tuple(out)


def _kv_fp8(q: dict[str, Any], where: str) -> bool:
    """Whether the checkpoint ships FP8 KV scales: `kv_cache_quant_algo` (FP8 or none) or config.json's
    `kv_cache_scheme` ({type: float, num_bits: 8}, or null)."""
    kv = q.get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() not in ("FP8", "NONE"):
        raise ValueError(f"{where}: kv_cache_quant_algo {kv!r} is not supported (FP8 or none)")
    scheme = q.get("kv_cache_scheme")
    if scheme is not None and not (
        isinstance(scheme, dict)
        and str(scheme.get("type")).lower() == "float"
        and scheme.get("num_bits") == 8
    ):
        raise ValueError(
            f"{where}: kv_cache_scheme {scheme!r} is not supported (type float, num_bits 8, or null)"
        )
    return (kv is not None and str(kv).upper() == "FP8") or scheme is not None


def _mixed(q: dict[str, Any], where: str) -> tuple[str, frozenset[str]]:
    """(scheme, FP8 module names) of a MIXED_PRECISION config: every `quantized_layers` entry must name the
    same ModelOpt FP8 algorithm (one scale layout a model); anything else is refused, with the algorithms
    found and a module of each."""
    layers = q.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise ValueError(f"{where}: quant_algo {MIXED} needs a non-empty 'quantized_layers' mapping")
    algos: dict[str, str] = {}
    for name, info in layers.items():
        algo = info.get("quant_algo") if isinstance(info, dict) else None
        if not isinstance(algo, str):
            raise ValueError(f"{where}: quantized_layers[{name!r}] has no quant_algo: {info!r}")
        algos.setdefault(algo.upper(), name)
    other = {a: n for a, n in algos.items() if a not in MODELOPT_FP8}
    if other:
        found = ", ".join(f"{a} (e.g. {n})" for a, n in sorted(other.items()))
        raise ValueError(
            f"{where}: {MIXED} checkpoint with layers in {found}: not supported; hyserve loads "
            f"{' / '.join(MODELOPT_FP8)} layers"
        )
    if len(algos) > 1:
        raise ValueError(
            f"{where}: {MIXED} checkpoint mixes FP8 scale layouts {sorted(algos)}: not supported "
            "(one of them a model)"
        )
    return MODELOPT_FP8[next(iter(algos))], frozenset(canonical_module_name(n) for n in layers)


def _modelopt(q: dict[str, Any], where: str) -> QuantConfig:
    if isinstance(q.get("quantization"), dict):  # config.json holding hf_quant_config.json's nesting
        q = {**q, **q["quantization"]}
    algo = q.get("quant_algo")
    name = algo.upper() if isinstance(algo, str) else None
    if name != MIXED and name not in MODELOPT_FP8:
        raise ValueError(f"{where}: ModelOpt quant_algo {algo!r} is not supported; hyserve loads {SUPPORTED}")
    kv = _kv_fp8(q, where)
    scheme, include = _mixed(q, where) if name == MIXED else (MODELOPT_FP8[name], None)
    return QuantConfig(
        method="modelopt",
        scheme=scheme,
        exclude=_exclude_list(q, where),
        include=include,
        kv_cache_fp8=kv,
        source=where,
    )


def _fp8(q: dict[str, Any], where: str) -> QuantConfig:
    fmt = q.get("fmt", "e4m3")
    if str(fmt).lower() != "e4m3":
        raise ValueError(f"{where}: fp8 fmt {fmt!r} is not supported; hyserve's FP8 weights are e4m3")
    block = q.get("weight_block_size")
    act = q.get("activation_scheme", "dynamic")
    if block is not None:
        if not isinstance(block, list | tuple) or list(block) != [BLOCK, BLOCK]:
            raise ValueError(
                f"{where}: weight_block_size {block!r} is not supported; the FP8 kernels take "
                f"[{BLOCK}, {BLOCK}] blocks (or per-tensor scales without weight_block_size)"
            )
        if act != "dynamic":
            raise ValueError(
                f"{where}: activation_scheme {act!r} with block scales is not supported (dynamic)"
            )
        return QuantConfig(method="fp8", scheme="block", exclude=_exclude_list(q, where), source=where)
    if act not in ("dynamic", "static"):
        raise ValueError(f"{where}: activation_scheme {act!r} is not one of ['dynamic', 'static']")
    return QuantConfig(method="fp8", scheme="tensor", exclude=_exclude_list(q, where), source=where)


_CT_FORMATS = ("float-quantized", "naive-quantized")


def _ct_scheme(group: str, w: Any, where: str) -> str:
    """The scale layout of one compressed-tensors group's `weights`: 8-bit symmetric float, static, with
    tensor, channel or [128, 128] block strategy."""
    if not isinstance(w, dict):
        raise ValueError(f"{where}: config_groups.{group}.weights must be a mapping, got {w!r}")
    if w.get("num_bits") != 8 or str(w.get("type")).lower() != "float":
        raise ValueError(
            f"{where}: config_groups.{group} has {w.get('num_bits')}-bit {w.get('type')} weights: not "
            f"supported; hyserve loads {SUPPORTED}"
        )
    if w.get("symmetric") is False or w.get("dynamic"):
        raise ValueError(
            f"{where}: config_groups.{group}: asymmetric or dynamic weight scales are not supported"
        )
    strategy = w.get("strategy")
    if strategy == "block":
        if list(w.get("block_structure") or []) != [BLOCK, BLOCK]:
            raise ValueError(
                f"{where}: config_groups.{group}: block_structure {w.get('block_structure')!r} is not "
                f"supported; the FP8 kernels take [{BLOCK}, {BLOCK}] blocks"
            )
        return "block"
    if strategy in ("tensor", "channel"):
        return str(strategy)
    raise ValueError(
        f"{where}: config_groups.{group}: weight strategy {strategy!r} is not supported "
        "(tensor, channel or block)"
    )


def _compressed_tensors(q: dict[str, Any], where: str) -> QuantConfig:
    fmt = q.get("format")
    if fmt not in _CT_FORMATS:
        raise ValueError(
            f"{where}: {COMPRESSED} format {fmt!r} is not supported ({' or '.join(_CT_FORMATS)})"
        )
    for key in (
        "sparsity_config",
        "transform_config",
    ):  # 2:4 sparse weights, online rotations: other numerics
        if q.get(key):
            raise ValueError(f"{where}: {COMPRESSED} with a {key} is not supported (dense FP8 weights only)")
    kv = q.get("kv_cache_scheme")
    if isinstance(kv, dict) and kv.get("strategy") not in (None, "tensor"):
        raise ValueError(
            f"{where}: kv_cache_scheme strategy {kv.get('strategy')!r} is not supported: the FP8 KV "
            "cache takes one k_scale and one v_scale a layer (strategy tensor)"
        )
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: {COMPRESSED} needs a non-empty 'config_groups' mapping")
    schemes: dict[str, str] = {}
    targets: list[str] = []
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise ValueError(f"{where}: config_groups.{name} must be a mapping, got {g!r}")
        if g.get("weights") is None:  # activations only: its modules' weights stay 16-bit
            continue
        schemes[name] = _ct_scheme(name, g.get("weights"), where)
        t = g.get("targets")
        if not isinstance(t, list) or not t or not all(isinstance(x, str) for x in t):
            raise ValueError(
                f"{where}: config_groups.{name}.targets must be a non-empty list of names, got {t!r}"
            )
        for x in t:  # a class name other than Linear would silently target nothing here
            if x != "Linear" and not x.startswith("re:") and "." not in x:
                raise ValueError(
                    f"{where}: config_groups.{name}.targets entry {x!r} is not supported (Linear, "
                    "module names or re: patterns)"
                )
        _check_patterns(t, where, f"config_groups.{name}.targets")
        targets.extend(t)
    if not schemes:
        raise ValueError(
            f"{where}: no config_groups entry quantises weights (only activations): not supported"
        )
    if len(set(schemes.values())) > 1:
        raise ValueError(
            f"{where}: config_groups mix weight strategies {schemes}: not supported (one a model)"
        )
    scheme = next(iter(schemes.values()))
    if scheme == "block" and any(
        isinstance(g.get("input_activations"), dict) and g["input_activations"].get("dynamic") is False
        for g in groups.values()
    ):
        raise ValueError(
            f"{where}: static activation scales with block-scaled weights are not supported (dynamic)"
        )
    return QuantConfig(
        method=COMPRESSED,
        scheme=scheme,
        exclude=_exclude_list(q, where),
        targets=() if "Linear" in targets else tuple(targets),
        kv_cache_fp8=_kv_fp8(q, where),
        source=where,
    )


def parse_quant_config(q: Any, where: str) -> QuantConfig:
    """A `quantization_config` mapping (config.json) -> QuantConfig; ValueError naming what is unsupported."""
    if not isinstance(q, dict):
        raise ValueError(f"{where}: expected a mapping, got {q!r}")
    method = q.get("quant_method")
    if method == "modelopt":
        return _modelopt(q, where)
    if method == "fp8":
        return _fp8(q, where)
    if method in (COMPRESSED, "compressed_tensors"):
        return _compressed_tensors(q, where)
    raise ValueError(f"{where}: quant_method {method!r} is not supported; hyserve loads {SUPPORTED}")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def checkpoint_quant(model_dir: str | Path, raw_config: dict[str, Any] | None = None) -> QuantConfig | None:
    """The checkpoint's own weight format: config.json's quantization_config, else hf_quant_config.json,
    else None (16-bit weights). `raw_config` is config.json's object when the caller has read it."""
    d = Path(model_dir)
    if raw_config is None and (d / "config.json").is_file():
        raw_config = _read_json(d / "config.json")
    if isinstance(raw_config, dict) and raw_config.get("quantization_config") is not None:
        return parse_quant_config(
            raw_config["quantization_config"], f"{d / 'config.json'}: quantization_config"
        )
    hf = d / HF_QUANT_FILE
    if not hf.is_file():
        return None
    data = _read_json(hf)
    where = f"{hf}: quantization"
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        raise ValueError(f"{hf}: expected a 'quantization' mapping (ModelOpt's format)")
    producer = data.get("producer")
    producer = producer.get("name", "modelopt") if isinstance(producer, dict) else "modelopt"
    if producer != "modelopt":
        raise ValueError(f"{hf}: producer {producer!r} is not supported; hyserve loads {SUPPORTED}")
    return _modelopt(data["quantization"], where)


def resolve_quant(
    option: str | None, model_dir: str | Path, raw_config: dict[str, Any] | None = None
) -> QuantConfig | None:
    """The weight format to run: the checkpoint's when it is quantised (the option may say fp8 or nothing),
    else per-channel online quantisation when `option` is "fp8", else None."""
    if option not in QUANT_OPTIONS:
        raise ValueError(f"quantization: {option!r} is not one of {list(QUANT_OPTIONS)}")
    ckpt = checkpoint_quant(model_dir, raw_config)
    if ckpt is not None:
        return ckpt
    if option == "fp8":
        return QuantConfig(method="online", scheme="channel", source="quantization: fp8")
    return None
