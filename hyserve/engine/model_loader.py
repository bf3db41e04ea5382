"""Resolve the model directory, device and dtype, build the model and fill its weights.

`model=None` means the built-in tiny model. `load_format="dummy"` gives random weights, so a directory
holding only config.json (the real architectures in shared/configs) runs with token-id prompts.

`kv_cache_config.dtype: fp8` is a float8 e4m3 KV pool with a k_scale / v_scale per attention layer,
taken from the checkpoint's KV-scale tensors (see `attention.parse_kv_scale_name` for the spellings)
or 1.0 (always with dummy weights). It runs the Triton kernels on CUDA and the torch reference on CPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from hyserve.config import EngineConfig
from hyserve.kernels.attention import FP8_KV_DTYPES
from hyserve.kernels.triton_registry import register_triton_kernels
from hyserve.model.attention import Attention, parse_kv_scale_name
from hyserve.model.config import LAYER_ATTENTION, HybridModelConfig, parse_dtype
from hyserve.model.nemotron_h import NemotronHForCausalLM
from hyserve.model.tiny import BUILTIN_MODEL_NAME, builtin_model_dir
from hyserve.model.tokenizer import Tokenizer, TokenizerNotFoundError
from hyserve.model.weights import (
    StateDictModule,
    canonical_name,
    checkpoint_files,
    init_random_weights,
    load_checkpoint,
)

logger = logging.getLogger("hyserve")


@dataclass
class LoadedModel:
    model: NemotronHForCausalLM
    config: HybridModelConfig  # with the run dtype and cache dtypes folded in
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    model_dir: Path
    name: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: 'cuda' was requested but no CUDA device is available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, cfg: HybridModelConfig, device: torch.device) -> torch.dtype:
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


def load_model(config: EngineConfig) -> LoadedModel:
    if config.model is None:
        model_dir = builtin_model_dir()
        name = BUILTIN_MODEL_NAME
    else:
        model_dir = Path(config.model).expanduser()
        if not model_dir.exists():
            raise ValueError(
                f"model: {config.model!r} is not a local directory (hyserve loads checkpoints from disk; "
                "download the model first, or omit MODEL to use the built-in tiny model)"
            )
        name = model_dir.name
    cfg = HybridModelConfig.from_hf(model_dir)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, cfg, device)
    kv_dtype = resolve_kv_dtype(config.cache.dtype, dtype, device)
    cfg = cfg.with_cache_dtypes(
        ssm_cache_dtype=config.cache.mamba_ssm_cache_dtype,
        kv_cache_dtype=kv_dtype,
        ssm_stochastic_rounding=config.cache.mamba_ssm_stochastic_rounding,
        ssm_philox_rounds=config.cache.mamba_ssm_philox_rounds,
        ssm_rounding_seed=config.seed,
    )

    if device.type == "cuda":
        names = register_triton_kernels()
        logger.info("Triton kernels in use on %s: %s", device, ", ".join(names))

    with torch.device("meta"):
        model = NemotronHForCausalLM(cfg, dtype=dtype)
    model = model.to_empty(device=device)
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
        init_random_weights(model, cfg, seed=config.seed)
        kv_scales: dict[int, dict[str, float]] = {}
    else:
        kv_scales = load_checkpoint_with_kv_scales(model, model_dir)
    apply_kv_scales(model, kv_scales, fp8=kv_dtype in FP8_KV_DTYPES, dummy=fmt == "dummy")
    model.eval()

    try:
        tokenizer: Tokenizer | None = Tokenizer.from_dir(model_dir)
    except TokenizerNotFoundError:
        logger.info("no tokenizer in %s: prompts must be token ids", model_dir)
        tokenizer = None
    return LoadedModel(
        model=model,
        config=model.config,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        model_dir=model_dir,
        name=config.served_model_name or name,
    )


# ---- float8 KV scales ----------------------------------------------------------------------------------


def _kv_scale_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of each KV-scale tensor in the checkpoint (from the file headers only)."""
    found: dict[str, tuple[int, ...]] = {}
    for path, names in checkpoint_files(model_dir).items():
        if names is not None and not any(_is_kv_scale(n) for n in names):
            continue  # an indexed shard without scales: no need to open it
        wanted = None if names is None else set(names)
        with safe_open(str(path), framework="pt") as f:
            for ck in f.keys():
                if (wanted is None or ck in wanted) and _is_kv_scale(ck):
                    found[canonical_name(ck)[0]] = tuple(f.get_slice(ck).get_shape())  # type: ignore[index]
    return found


def _is_kv_scale(ckpt_name: str) -> bool:
    mapped = canonical_name(ckpt_name)
    return mapped is not None and mapped[1] is None and parse_kv_scale_name(mapped[0]) is not None


def load_checkpoint_with_kv_scales(model: NemotronHForCausalLM, model_dir: Path) -> dict[int, dict[str, float]]:
    """`load_checkpoint`, plus the checkpoint's KV scales: {layer: {"k": s, "v": s}} (empty without any).

    The scales are not weights (the model keeps them as non-persistent buffers), and load_checkpoint
    refuses tensors the module lacks, so it loads into a module holding the model's tensors plus one
    float32 holder per scale tensor; everything else (validation, streaming) is load_checkpoint's own."""
    shapes = _kv_scale_shapes(model_dir)
    if not shapes:
        load_checkpoint(model, model_dir)
        return {}
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # tied weights once
            seen.add(id(t))
            tensors[name] = t
    holders = {name: torch.empty(shape, dtype=torch.float32) for name, shape in shapes.items()}
    load_checkpoint(StateDictModule({**tensors, **holders}), model_dir)

    cfg = model.config
    scales: dict[int, dict[str, float]] = {}
    for name, t in holders.items():
        layer, kind = parse_kv_scale_name(name)  # type: ignore[misc]
        if layer >= cfg.num_layers or cfg.layer_types[layer] != LAYER_ATTENTION:
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
            raise ValueError(f"checkpoint {model_dir}: {name}: a KV scale must be positive and finite, got {value}")
        for key in ("k", "v") if kind == "kv" else (kind,):
            if key in scales.setdefault(layer, {}):
                raise ValueError(f"checkpoint {model_dir}: layer {layer}: {key}_scale is given more than once")
            scales[layer][key] = value
    return scales


def apply_kv_scales(
    model: NemotronHForCausalLM, scales: dict[int, dict[str, float]], *, fp8: bool, dummy: bool = False
) -> None:
    """Set every attention layer's k_scale / v_scale (1.0 where `scales` has none) and say once, for a
    float8 pool, which layers run with 1.0."""
    cfg = model.config
    defaulted = []
    for i in cfg.attention_layer_ids:
        got = scales.get(i, {})
        if "k" not in got or "v" not in got:
            defaulted.append(i)
        mixer = model.backbone.layers[i].mixer
        assert isinstance(mixer, Attention)
        mixer.set_kv_scales(got.get("k", 1.0), got.get("v", 1.0))
    if not fp8:
        if scales:
            logger.info("the checkpoint's KV scales (%d layers) are unused: the KV cache is not fp8", len(scales))
        return
    n = len(cfg.attention_layer_ids)
    if not defaulted:
        logger.info("fp8 KV cache: k_scale / v_scale from the checkpoint for all %d attention layers", n)
    elif dummy:
        logger.info("fp8 KV cache: load_format=dummy, k_scale = v_scale = 1.0 in all %d attention layers", n)
    elif len(defaulted) == n:
        logger.warning(
            "fp8 KV cache: the checkpoint has no k_scale / v_scale tensors; using 1.0 in all %d attention layers "
            "(K/V values beyond +-448 saturate)", n,
        )
    else:
        logger.warning(
            "fp8 KV cache: the checkpoint has no k_scale / v_scale for %d of %d attention layers (%s); using 1.0 "
            "there (values beyond +-448 saturate)", len(defaulted), n, ", ".join(map(str, defaulted)),
        )
