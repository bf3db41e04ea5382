"""The weight format of a model: 16-bit, or FP8 (float8 e4m3 weights with float32 dequantisation scales).

Where the format comes from, in order:

    config.json "quantization_config"         quant_method modelopt (quant_algo FP8) or fp8
    hf_quant_config.json "quantization"       ModelOpt's own file (producer modelopt, quant_algo FP8)
    the engine option `quantization: fp8`     a 16-bit checkpoint quantised while it loads ("online")

    method     weights in the checkpoint      scales (dequantise: w = w_fp8 * scale)
    modelopt   e4m3                           `weight_scale` one per tensor; `input_scale` (static
                                              activation scale) is read past: the kernels scale
                                              activations per token, dynamically
    fp8        e4m3                           `weight_scale_inv` per [128, 128] block (weight_block_size),
                                              or `weight_scale` per tensor without a block size
    online     16/32-bit                      one per output channel, computed at load (amax / 448)

Modules in the checkpoint's exclusion list (`exclude_modules`, `ignore`, `ignored_layers`,
`modules_to_not_convert`; names or fnmatch patterns, `model.` read as `backbone.`) stay 16-bit, as do
the embeddings, lm_head, norms, the MoE router and the Mamba conv / A / D / dt parameters (never
quantised: they are not projections). Anything else (another quant method or algorithm, another block
size, static activation scales for the block format) is refused with what was found and what is supported.
"""

from __future__ import annotations

import fnmatch
import json
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
QUANTIZABLE_LINEARS = frozenset({
    "in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
    "fc1_latent_proj", "fc2_latent_proj",
})
SUPPORTED = ("quant_method modelopt with quant_algo FP8 (per-tensor weight_scale), quant_method fp8 "
             f"(weight_block_size [{BLOCK}, {BLOCK}], or per-tensor without one), or a 16-bit checkpoint "
             "with quantization: fp8")


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """How the quantised projections store their weights. `scheme` is the scale layout:
    tensor (one scale, held per output channel), channel ([N]) or block ([ceil(N/128), ceil(K/128)])."""

    method: str  # "modelopt" | "fp8" | "online"
    scheme: str  # one of SCHEMES
    exclude: tuple[str, ...] = ()
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
        short = module_name.removeprefix("backbone.")
        for pat in self.exclude:
            p = "backbone." + pat[len("model."):] if pat.startswith("model.") else pat
            for name in (module_name, short):
                if name == p or name.startswith(p + ".") or fnmatch.fnmatchcase(name, p):
                    return False
        return True

    def describe(self) -> str:
        scales = {"tensor": "per-tensor", "channel": "per-output-channel",
                  "block": f"per-[{BLOCK}, {BLOCK}]-block"}[self.scheme]
        where = "quantised at load" if self.method == "online" else f"{self.method} checkpoint"
        excl = f", {len(self.exclude)} excluded module patterns" if self.exclude else ""
        return f"fp8 e4m3 weights ({where}, {scales} scales{excl})"


def fp8_scale_count(scheme: str, shape: tuple[int, ...]) -> int:
    """float32 scales hyserve holds for an [N, K] FP8 weight (a per-tensor scale is held per row)."""
    n, k = shape
    return -(-n // BLOCK) * -(-k // BLOCK) if scheme == "block" else n


def _exclude_list(q: dict[str, Any], where: str) -> tuple[str, ...]:
    out: list[str] = []
    for key in EXCLUDE_KEYS:
        v = q.get(key)
        if v is None:
            continue
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ValueError(f"{where}: {key} must be a list of module names, got {v!r}")
        out.extend(v)
    return tuple(out)


def _modelopt(q: dict[str, Any], where: str) -> QuantConfig:
    algo = q.get("quant_algo")
    if not isinstance(algo, str) or algo.upper() != "FP8":
        raise ValueError(f"{where}: ModelOpt quant_algo {algo!r} is not supported; hyserve loads {SUPPORTED}")
    kv = q.get("kv_cache_quant_algo")
    if kv is not None and str(kv).upper() not in ("FP8", "NONE"):
        raise ValueError(f"{where}: kv_cache_quant_algo {kv!r} is not supported (FP8 or none)")
    return QuantConfig(method="modelopt", scheme="tensor", exclude=_exclude_list(q, where),
                       kv_cache_fp8=kv is not None and str(kv).upper() == "FP8", source=where)


def _fp8(q: dict[str, Any], where: str) -> QuantConfig:
    fmt = q.get("fmt", "e4m3")
    if str(fmt).lower() != "e4m3":
        raise ValueError(f"{where}: fp8 fmt {fmt!r} is not supported; hyserve's FP8 weights are e4m3")
    block = q.get("weight_block_size")
    act = q.get("activation_scheme", "dynamic")
    if block is not None:
        if not isinstance(block, list | tuple) or list(block) != [BLOCK, BLOCK]:
            raise ValueError(f"{where}: weight_block_size {block!r} is not supported; the FP8 kernels take "
                             f"[{BLOCK}, {BLOCK}] blocks (or per-tensor scales without weight_block_size)")
        if act != "dynamic":
            raise ValueError(f"{where}: activation_scheme {act!r} with block scales is not supported (dynamic)")
        return QuantConfig(method="fp8", scheme="block", exclude=_exclude_list(q, where), source=where)
    if act not in ("dynamic", "static"):
        raise ValueError(f"{where}: activation_scheme {act!r} is not one of ['dynamic', 'static']")
    return QuantConfig(method="fp8", scheme="tensor", exclude=_exclude_list(q, where), source=where)


def parse_quant_config(q: Any, where: str) -> QuantConfig:
    """A `quantization_config` mapping (config.json) -> QuantConfig; ValueError naming what is unsupported."""
    if not isinstance(q, dict):
        raise ValueError(f"{where}: expected a mapping, got {q!r}")
    method = q.get("quant_method")
    if method == "modelopt":
        return _modelopt(q, where)
    if method == "fp8":
        return _fp8(q, where)
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
        return parse_quant_config(raw_config["quantization_config"], f"{d / 'config.json'}: quantization_config")
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


def resolve_quant(option: str | None, model_dir: str | Path, raw_config: dict[str, Any] | None = None) -> QuantConfig | None:
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
