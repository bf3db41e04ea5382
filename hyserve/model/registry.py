"""Model families: architecture name -> (config parser, model class, weight loader).

The engine asks the registry for a checkpoint directory's family and builds through it, so a new hybrid
family (Granite-4.0-H, Bamba, Falcon-H1, Zamba2) is one entry here plus its own files under `model/`
(docs/architecture.md, "Adding a model family").
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyserve.kernels.ops import Op
from hyserve.model.config import HybridModelConfig, read_config_json
from hyserve.model.kv_scales import (
    apply_kv_scales,
    load_checkpoint_with_kv_scales,
    record_kv_amax,
    update_kv_scales,
)
from hyserve.model.nemotron_h import KERNEL_OPS, NemotronHForCausalLM
from hyserve.model.protocol import CausalLM, ModelSpec
from hyserve.model.quant_config import QuantConfig
from hyserve.model.weights import init_random_weights, weight_bytes


@dataclass(frozen=True)
class ModelFamily:
    name: str
    model_types: tuple[str, ...]  # config.json "model_type" values
    architectures: tuple[str, ...]  # config.json "architectures" entries
    parse_config: Callable[[dict[str, Any], str], ModelSpec]  # (raw config.json, checkpoint name)
    build: Callable[[Any, torch.dtype], CausalLM]  # (parsed config, dtype); call under a device context
    init_random: Callable[[Any, Any, int], None]  # (model, parsed config, seed): load_format dummy
    # (model, checkpoint dir) -> float8 KV scales found beside the weights, {layer: {"k": s, "v": s}}
    load_weights: Callable[[Any, Path], dict[int, dict[str, float]]]
    # (model, scales, fp8 pool?, dummy weights?, kv_cache_config.kv_scales): every attention layer's k/v scale
    # set -> what is left to calibrate, {layer: ("k", "v") or the one missing}
    set_kv_scales: Callable[..., dict[int, tuple[str, ...]]]
    # (model, {layer: {"k": s, "v": s}}): set calibrated scales (a layer may give one of the two)
    update_kv_scales: Callable[[Any, dict[int, dict[str, float]]], None]
    # (model) -> within: each attention layer's max |K|, |V| of the forwards run, {layer: float32 [2] tensor}
    record_kv_amax: Callable[[Any], AbstractContextManager[dict[int, torch.Tensor]]]
    # (run dtype, cache dtypes...) folded into the parsed config: see HybridModelConfig.with_cache_dtypes
    with_cache_dtypes: Callable[..., ModelSpec]
    # (parsed config, QuantConfig | None) -> the config with that weight format (model/quant_config.py)
    with_quant: Callable[[Any, QuantConfig | None], ModelSpec]
    # (parsed config, run dtype) -> bytes of the weights at tp_size 1 in that format (the pre-load check)
    weight_bytes: Callable[[Any, torch.dtype], int]
    # the kernel ops the model may call (kernels/ops.py): on CUDA each must have a CUDA implementation
    kernel_ops: tuple[Op[..., Any], ...]
    # (model) once its weights are loaded on its device: serving layouts (NemotronH: packed q/k/v weights)
    finish_load: Callable[[Any], None] = lambda model: None


_FAMILIES: list[ModelFamily] = [
    ModelFamily(
        name="nemotron_h",
        model_types=("nemotron_h",),
        architectures=("NemotronHForCausalLM",),
        parse_config=lambda raw, name: HybridModelConfig.from_dict(raw, name=name),
        build=lambda cfg, dtype: NemotronHForCausalLM(cfg, dtype=dtype),
        init_random=lambda model, cfg, seed: init_random_weights(model, cfg, seed=seed),
        load_weights=load_checkpoint_with_kv_scales,
        set_kv_scales=apply_kv_scales,
        update_kv_scales=update_kv_scales,
        record_kv_amax=record_kv_amax,
        with_cache_dtypes=lambda cfg, **kw: cfg.with_cache_dtypes(**kw),
        with_quant=lambda cfg, quant: cfg.with_quant(quant),
        weight_bytes=lambda cfg, dtype: weight_bytes(cfg, dtype),
        kernel_ops=KERNEL_OPS,
        finish_load=lambda model: model.pack_weights(),
    ),
]


def register(family: ModelFamily) -> None:
    """Add a family (its model types and architecture names must be new)."""
    for f in _FAMILIES:
        clash = set(f.model_types) & set(family.model_types) or set(f.architectures) & set(
            family.architectures
        )
        if clash:
            raise ValueError(f"model family {family.name!r}: {sorted(clash)} already belong to {f.name!r}")
    _FAMILIES.append(family)


def supported() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.architectures)})" for f in _FAMILIES)


def family_for(raw: dict[str, Any]) -> ModelFamily:
    """The family of a config.json dict: by model_type, else by architectures; a config that names
    neither is taken as the first family (older NemotronH exports omit both)."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    for f in _FAMILIES:
        if model_type in f.model_types:
            return f
    if model_type is None:
        for f in _FAMILIES:
            if any(a in f.architectures for a in archs if isinstance(a, str)):
                return f
        if not archs:
            return _FAMILIES[0]
    what = f"model_type {model_type!r}" if model_type is not None else f"architectures {archs!r}"
    raise ValueError(f"{what} is not supported; hyserve serves: {supported()}")


def read_config(path: str | Path) -> tuple[ModelFamily, ModelSpec]:
    """Read a checkpoint directory's (or a config.json path's) family and parsed config."""
    raw, name = read_config_json(path)
    fam = family_for(raw)
    return fam, fam.parse_config(raw, name)
