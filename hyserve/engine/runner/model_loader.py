"""Resolve the model directory, device and dtype, build the model and fill its weights.

`model=None` means the built-in tiny model. `load_format="dummy"` gives random weights, so a directory
holding only config.json (the real architectures in benchmarks/configs) runs with token-id prompts.

`kv_cache_config.dtype: fp8` is a float8 e4m3 KV pool with a k_scale / v_scale per attention layer,
chosen by `kv_cache_config.kv_scales`: the checkpoint's KV-scale tensors (see
`attention.parse_kv_scale_name` for the spellings), 1.0 (`unit`), or calibrated; the layers left to
calibrate are `LoadedModel.kv_scales_to_calibrate`, which `assembly` hands to `kv_calibration` before
anything runs on the model. It runs the Triton kernels on CUDA and the torch reference on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hyserve.config import EngineConfig
from hyserve.distributed import parallel_info
from hyserve.hub import ModelSource, hub_options, resolve_model
from hyserve.kernels import ops
from hyserve.kernels.attention import FP8_KV_DTYPES
from hyserve.model.config import parse_dtype
from hyserve.model.fp8_weights import tensor_bytes
from hyserve.model.protocol import CausalLM, ModelSpec
from hyserve.model.quant_config import QuantConfig, resolve_quant
from hyserve.model.registry import ModelFamily, read_config
from hyserve.model.tiny import BUILTIN_MODEL_NAME, builtin_model_dir
from hyserve.model.tokenizer import Tokenizer, TokenizerNotFoundError

logger = logging.getLogger("hyserve")

# the kernel ops the engine calls itself: the structured-outputs mask, and the calibration times attention
ENGINE_OPS: tuple[ops.Op[..., Any], ...] = (ops.apply_token_bitmask, ops.paged_attention)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelSpec  # with the run dtype and cache dtypes folded in
    family: ModelFamily
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    model_dir: Path
    name: str
    weight_bytes: int = 0  # this rank's parameters and buffers
    weight_format: str = "16-bit"  # for the start-up report: "16-bit" or the FP8 layout and its share
    # fp8 KV pool: the attention layers whose k_scale / v_scale (or one of them) are still to be calibrated
    kv_scales_to_calibrate: dict[int, tuple[str, ...]] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, cfg: ModelSpec, device: torch.device) -> torch.dtype:
    if name == "auto":
        # CPU: float32 (bf16 matmuls are slow and imprecise there); GPU: the checkpoint's dtype
        return torch.float32 if device.type == "cpu" else cfg.dtype
    return parse_dtype(name, field="dtype", allowed=("bfloat16", "float16", "float32"))


def resolve_kv_dtype(name: str, run_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    if name == "auto":
        return run_dtype
    if name == "fp8":
        # e4m3 + per-layer scales; on CPU the torch reference path runs it (float8 casts work there)
        return torch.float8_e4m3fn
    return parse_dtype(name, field="kv_cache_config.dtype", allowed=("bfloat16", "float16", "float32"))


def check_cuda_kernels(family: ModelFamily) -> list[str]:
    """On CUDA, before the model is built: bind the CUDA kernels and fail, naming the op, when one that the
    family's model or the engine calls has no CUDA implementation. Returns the op names in use."""
    ops.load_cuda_kernels()
    used = (*family.kernel_ops, *ENGINE_OPS)
    ops.require_cuda(used)
    return list(dict.fromkeys(op.name for op in used))


def check_weights_fit(weight_bytes: int, quant: QuantConfig | None, device: torch.device) -> None:
    """Before anything is allocated: this rank's share of the weights must fit the device's free memory,
    else a message with the numbers (and FP8's figure when the weights are 16-bit) instead of an OOM."""
    tp = parallel_info().tp_size
    need = weight_bytes // tp
    free = torch.cuda.mem_get_info(device)[0]
    if need <= free:
        return
    hint = " (FP8 weights, `quantization: fp8`, hold about half of that)" if quant is None else ""
    raise ValueError(
        f"the weights need {need / 2**30:.1f} GiB on each of {tp} rank(s){hint} but {device} has "
        f"{free / 2**30:.1f} GiB free: raise tp_size, use FP8 weights, or free the GPU"
    )


def model_source(config: EngineConfig) -> ModelSource:
    """Where the model's files are and its default served name: the built-in tiny model, a local directory,
    or a Hugging Face Hub id's snapshot, downloaded or from the cache (hyserve/hub.py)."""
    if config.model is None:
        return ModelSource(path=builtin_model_dir(), name=BUILTIN_MODEL_NAME)
    return resolve_model(config.model, **hub_options(config))


def load_model(config: EngineConfig) -> LoadedModel:
    source = model_source(config)
    model_dir, name = source.path, source.name
    family, cfg = read_config(model_dir)
    quant = resolve_quant(config.quantization, model_dir)
    cfg = family.with_quant(cfg, quant)
    if config.speculative.method == "mtp":  # its MTP block built and loaded: it drafts
        cfg = family.with_mtp(cfg)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, cfg, device)
    kv_dtype = resolve_kv_dtype(config.cache.dtype, dtype, device)
    cfg = family.with_cache_dtypes(
        cfg,
        ssm_cache_dtype=config.cache.mamba_ssm_cache_dtype,
        kv_cache_dtype=kv_dtype,
        ssm_stochastic_rounding=config.cache.mamba_ssm_stochastic_rounding,
        ssm_philox_rounds=config.cache.mamba_ssm_philox_rounds,
        ssm_rounding_seed=config.seed,
    )

    if device.type == "cuda":
        names = check_cuda_kernels(family)
        logger.info("CUDA kernels in use on %s: %s", device, ", ".join(names))

    if device.type == "cuda":
        check_weights_fit(family.weight_bytes(cfg, dtype), quant, device)
    with torch.device("meta"):
        model = family.build(cfg, dtype)
    model = model.to_empty(device=device)  # type: ignore[attr-defined]
    fmt = config.load_format
    if fmt == "auto":
        has_weights = any(model_dir.glob("*.safetensors"))
        if not has_weights:
            raise ValueError(
                f"model: {model_dir} has no *.safetensors weights; pass load_format='dummy' "
                "(--load-format dummy) to run it with random weights"
            )
        fmt = "safetensors"
    if fmt == "dummy":
        family.init_random(model, cfg, config.seed, on_device=config.dummy_init == "auto")
        kv_scales: dict[int, dict[str, float]] = {}
    else:
        kv_scales = family.load_weights(model, model_dir)
    to_calibrate = family.set_kv_scales(
        model, kv_scales, fp8=kv_dtype in FP8_KV_DTYPES, dummy=fmt == "dummy", source=config.cache.kv_scales
    )
    model.eval()  # type: ignore[attr-defined]
    family.finish_load(model)
    if quant is not None and device.type == "cuda":
        # the 16-bit tensors quantised on the device: their blocks back to free memory
        torch.cuda.empty_cache()
    total, fp8 = tensor_bytes(model)  # type: ignore[arg-type]
    fmt_line = "16-bit" if quant is None else f"{quant.describe()}: {fp8 / 2**30:,.2f} GiB e4m3 + scales"

    try:
        tokenizer: Tokenizer | None = Tokenizer.from_dir(model_dir)
    except TokenizerNotFoundError:
        logger.info("no tokenizer in %s: prompts must be token ids", model_dir)
        tokenizer = None
    return LoadedModel(
        model=model,
        config=model.config,
        family=family,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        model_dir=model_dir,
        name=config.served_names[0] if config.served_names else name,
        weight_bytes=total,
        weight_format=fmt_line,
        kv_scales_to_calibrate=to_calibrate,
    )
