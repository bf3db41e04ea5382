"""Float8 KV scales of a model of any family: read them beside the weights, set them on the attention layers
as `kv_cache_config.kv_scales` says (checkpoint / calibrate / unit / auto, config.KV_SCALE_SOURCES), and
record the K / V magnitudes a calibration prefill produces (`record_kv_amax`; the prefill itself and the
scales it gives are engine/assembly/kv_calibration.py's)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from torch import nn

from hyserve.model.attention import Attention
from hyserve.model.weights import (
    CheckpointNames,
    StateDictModule,
    _model_tensors,
    checkpoint_files,
    load_checkpoint,
)

logger = logging.getLogger("hyserve")


class KVScaledModel(Protocol):
    """A model whose attention layers hold float8 KV scales (every family's model)."""

    @property
    def checkpoint_names(self) -> CheckpointNames: ...

    def attention_layers(self) -> Mapping[int, Attention]: ...


# KV-scale tensor names in FP8-KV checkpoints, after the family's renaming, P its attention module path:
#   P.k_scale / .v_scale                       (vLLM's layout)
#   P.attn.k_scale                             (vLLM's module path)
#   P.k_proj.k_scale / v_proj...               (ModelOpt, llm-compressor)
#   P.qkv_proj.k_scale                         (fused-QKV exporters)
#   P.k_proj.output_scale / v_...              (compressed-tensors' and Quark's older exports: the
#                                               projection's output quantiser)
#   P.kv_scale                                 (deprecated: one scale for K and V)
#   ...q_scale, q_proj.output_scale            (query quantisation: hyserve keeps q 16-bit, ignored)
def parse_kv_scale_name(name: str, names: CheckpointNames) -> tuple[int, str] | None:
    """(layer index, 'k' | 'v' | 'kv' | 'q') for a canonical KV-scale tensor name, else None."""
    p = names.attention_prefix
    m = re.match(rf"^{p}\.(?:(?:attn|k_proj|v_proj|qkv_proj)\.)?(k|v|kv|q)_scale$", name) or re.match(
        rf"^{p}\.(k|v|q)_proj\.output_scale$", name
    )
    return (int(m.group(1)), m.group(2)) if m else None


def _module(model: KVScaledModel) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{type(model).__name__} is not a torch module")
    return model


def _kv_scale_shapes(model_dir: Path, names: CheckpointNames) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of each KV-scale tensor in the checkpoint (from the file headers only)."""
    found: dict[str, tuple[int, ...]] = {}
    for path, tensors in checkpoint_files(model_dir).items():
        if tensors is not None and not any(_kv_scale_name(n, names) for n in tensors):
            continue  # an indexed shard without scales: no need to open it
        wanted = None if tensors is None else set(tensors)
        with safe_open(str(path), framework="pt") as f:
            for ck in f.keys():
                canon = _kv_scale_name(ck, names) if wanted is None or ck in wanted else None
                if canon is not None:
                    found[canon] = tuple(f.get_slice(ck).get_shape())
    return found


def _kv_scale_name(ckpt_name: str, names: CheckpointNames) -> str | None:
    """The canonical name of a checkpoint's KV-scale tensor (None: not one)."""
    mapped = names.canonical(ckpt_name)
    if mapped is None or mapped[1] is not None or parse_kv_scale_name(mapped[0], names) is None:
        return None
    return mapped[0]


def load_checkpoint_with_kv_scales(model: KVScaledModel, model_dir: Path) -> dict[int, dict[str, float]]:
    """`load_checkpoint`, plus the checkpoint's KV scales: {layer: {"k": s, "v": s}} (empty without any).

    The scales are not weights (the model keeps them as non-persistent buffers), and load_checkpoint
    refuses tensors the module lacks, so it loads into a module holding the model's tensors plus one
    float32 holder per scale tensor; everything else (validation, streaming) is load_checkpoint's own."""
    names = model.checkpoint_names
    shapes = _kv_scale_shapes(model_dir, names)
    if not shapes:
        load_checkpoint(_module(model), model_dir, names=names)
        return {}
    tensors, _ = _model_tensors(_module(model))  # tied weights once
    holders = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    load_checkpoint(StateDictModule({**tensors, **holders}), model_dir, names=names)

    attention = model.attention_layers()
    scales: dict[int, dict[str, float]] = {}
    for name, t in holders.items():
        parsed = parse_kv_scale_name(name, names)
        assert parsed is not None  # holders hold KV-scale names only
        layer, kind = parsed
        if layer not in attention:
            raise ValueError(f"checkpoint {model_dir}: {name}: layer {layer} is not an attention layer")
        if kind == "q":
            logger.debug("ignoring %s: hyserve does not quantise queries", name)
            continue
        if t.numel() != 1:
            raise ValueError(
                f"checkpoint {model_dir}: {name}: expected one per-tensor scale, got shape {list(t.shape)} "
                "(per-head or per-channel KV scales are not supported)"
            )
        value = float(t.reshape(()))
        if not (0.0 < value < float("inf")):
            raise ValueError(
                f"checkpoint {model_dir}: {name}: a KV scale must be positive and finite, got {value}"
            )
        for key in ("k", "v") if kind == "kv" else (kind,):
            if key in scales.setdefault(layer, {}):
                raise ValueError(
                    f"checkpoint {model_dir}: layer {layer}: {key}_scale is given more than once"
                )
            scales[layer][key] = value
    return scales


def apply_kv_scales(
    model: KVScaledModel,
    scales: dict[int, dict[str, float]],
    *,
    fp8: bool,
    dummy: bool = False,
    source: str = "auto",
) -> dict[int, tuple[str, ...]]:
    """Set every attention layer's k_scale / v_scale from `scales` (the checkpoint's) as `source` says, 1.0
    elsewhere, and return what is left to calibrate: {layer: ("k", "v") or the one missing} (empty unless
    fp8 with source auto or calibrate). Says once at start-up where the scales came from.

    checkpoint: every attention layer must have both (else a ValueError naming the layers without);
    unit: 1.0 everywhere, the checkpoint's unused; calibrate: every layer calibrated; auto: the checkpoint's
    where it has them, the rest calibrated. With a 16/32-bit pool the scales are set (unused) and nothing is
    calibrated (config.CacheConfig refuses a source other than auto there)."""
    layers = model.attention_layers()
    ids = sorted(layers)
    use = {} if fp8 and source in ("unit", "calibrate") else scales
    missing = {i: tuple(k for k in ("k", "v") if k not in use.get(i, {})) for i in ids}
    missing = {i: m for i, m in missing.items() if m}
    for i in ids:
        got = use.get(i, {})
        layers[i].set_kv_scales(got.get("k", 1.0), got.get("v", 1.0))
    if not fp8:
        if scales:
            logger.info(
                "the checkpoint's KV scales (%d layers) are unused: the KV cache is not fp8", len(scales)
            )
        return {}
    n = len(ids)
    if source == "checkpoint" and missing:
        where = "load_format=dummy has no checkpoint" if dummy else "the checkpoint has none"
        raise ValueError(
            f"kv_cache_config.kv_scales: 'checkpoint', but {where} for {len(missing)} of {n} attention "
            "layers: "
            + ", ".join(f"layer {i} ({' / '.join(k + '_scale' for k in m)})" for i, m in missing.items())
            + "; use kv_scales 'auto' or 'calibrate' (computed at start-up) or 'unit' (1.0, values beyond "
            "+-448 saturate)"
        )
    unused = (
        f"; the checkpoint's scales for {len(scales)} layers are not used"
        if scales and use is not scales
        else ""
    )
    if source == "unit":
        logger.info(
            "fp8 KV cache: kv_scales unit, k_scale = v_scale = 1.0 in all %d attention layers%s", n, unused
        )
        return {}
    if not missing:
        logger.info("fp8 KV cache: k_scale / v_scale from the checkpoint for all %d attention layers", n)
    elif unused:
        logger.info("fp8 KV cache: kv_scales calibrate%s", unused)
    return missing


def update_kv_scales(model: KVScaledModel, scales: dict[int, dict[str, float]]) -> None:
    """Set the given layers' k_scale and / or v_scale (each positive and finite), keeping the others."""
    layers = model.attention_layers()
    for i, got in scales.items():
        mixer = layers[i]
        mixer.set_kv_scales(got.get("k", float(mixer.k_scale)), got.get("v", float(mixer.v_scale)))


@contextmanager
def record_kv_amax(model: KVScaledModel) -> Iterator[dict[int, torch.Tensor]]:
    """Within, every attention layer's forward records max |K| and max |V| over the tokens it projects
    (what it writes to the KV cache, before any quantisation), per tensor: the yielded dict maps each
    attention layer to a float32 [2] device tensor (K, V), a running max kept on the device (no host sync
    per layer; non-finite values propagate). The hooks on k_proj / v_proj read their outputs and return
    nothing, so the forward's results are unchanged; they are removed on exit, also after an error."""
    amax: dict[int, torch.Tensor] = {}
    handles = []
    layers = model.attention_layers()
    mixers = list(layers.values())
    try:
        for i, mixer in layers.items():
            amax[i] = torch.zeros(2, dtype=torch.float32, device=mixer.k_scale.device)
            mixer.use_packed_qkv = False  # the three projections called as modules, so the hooks run
            for j, proj in enumerate((mixer.k_proj, mixer.v_proj)):
                scale = mixer.key_multiplier if j == 0 else 1.0  # the keys written are k_proj's times it
                handles.append(proj.register_forward_hook(_amax_hook(amax[i], j, scale)))
        yield amax
    finally:
        for h in handles:
            h.remove()
        for mixer in mixers:
            mixer.use_packed_qkv = True


def _amax_hook(acc: torch.Tensor, j: int, scale: float = 1.0):
    def hook(_module: torch.nn.Module, _inputs: tuple, out: torch.Tensor) -> None:
        if out.numel():
            amax = out.detach().abs().amax().float() * abs(scale)
            acc[j] = torch.maximum(acc[j], amax)  # max() would drop NaN

    return hook
