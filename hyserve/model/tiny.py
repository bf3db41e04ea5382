"""`make-tiny`: deterministic tiny NemotronH checkpoints, and the built-in default model.

A tiny checkpoint is a complete Hub-layout model directory (config, safetensors, tokenizer, chat template,
generation config) that transformers can load too, so tests, examples and `hyserve serve` with no model work
on any machine without a download. The configs are embedded here (not read from the repo's configs/) because
an installed package must be able to build them; they follow configs/tiny-* with the vocabulary resized to
the tiny tokenizer.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from hyserve import envs
from hyserve.model.fp8_export import write_modelopt_fp8
from hyserve.model.nemotron_h.checkpoint import NAMES
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.random_init import init_random_weights
from hyserve.model.tokenizer import IM_END, write_tiny_tokenizer
from hyserve.model.weights import SINGLE_FILE, save_checkpoint

BUILTIN_MODEL_NAME = "hyserve-tiny"
# Bump the suffix whenever the tiny model's files change, so cached copies are rebuilt.
BUILTIN_MODEL_DIRNAME = "hyserve-tiny-dense-v1"
TINY_VARIANTS = ("dense", "moe", "latent-moe")
TINY_VOCAB_SIZE = 320  # = the tiny tokenizer's size (3 specials + 256 bytes + 53 merges + 8 added tokens)

_BASE_CONFIG: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "dtype": "float32",
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "layer_norm_epsilon": 1e-05,
    "initializer_range": 0.02,
    "rescale_prenorm_residual": True,
    "residual_in_fp32": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
    "use_cache": True,
    "num_logits_to_keep": 1,
    "num_nextn_predict_layers": 0,
    # mamba2
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "expand": 2,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "use_conv_bias": True,
    "use_bias": False,
    "mamba_proj_bias": False,
    "mamba_hidden_act": "silu",
    "mamba_ssm_cache_dtype": "float32",
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 0.0001,
    "time_step_limit": [0.0, 1e30],
    # attention
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "attention_bias": False,
    "sliding_window": None,
    # mlp
    "intermediate_size": 128,
    "mlp_bias": False,
    "mlp_hidden_act": "relu2",
}

_MOE_CONFIG: dict[str, Any] = {
    "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "moe_shared_expert_overlap": True,
    "n_shared_experts": 1,
    "moe_latent_size": None,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
}

_VARIANTS: dict[str, dict[str, Any]] = {
    # several attention layers so paged-KV bookkeeping is exercised across layers
    "dense": {
        "layers_block_type": [
            "linear_attention",
            "full_attention",
            "linear_attention",
            "mlp",
            "linear_attention",
            "full_attention",
            "mlp",
        ]
    },
    "moe": _MOE_CONFIG,
    "latent-moe": {**_MOE_CONFIG, "n_routed_experts": 8, "moe_latent_size": 32, "routed_scaling_factor": 5.0},
}


def tiny_config(variant: str = "dense") -> dict[str, Any]:
    """The config.json contents of a tiny variant (a fresh dict)."""
    if variant not in _VARIANTS:
        raise ValueError(f"make-tiny: unknown variant {variant!r}; choose one of {', '.join(TINY_VARIANTS)}")
    return copy.deepcopy({**_BASE_CONFIG, **_VARIANTS[variant]})


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_weights(out: Path, cfg: HybridModelConfig, seed: int) -> None:
    # the real model class, so the file holds exactly the parameters the engine will load (the MTP block's
    # too, when the config has one)
    model = NemotronHForCausalLM(cfg.with_mtp(bool(cfg.mtp_layer_types)))
    init_random_weights(model, cfg, seed=seed)
    save_checkpoint(model, out, names=NAMES)


def make_tiny(
    out_dir: str | Path, *, variant: str = "dense", seed: int = 0, fp8: bool = False, mtp: bool = False
) -> Path:
    """Write a deterministic tiny checkpoint (same variant and seed -> byte-identical files); returns the dir.
    fp8: its projections (and routed experts) as FP8 in ModelOpt's layout (`model/fp8_export.py`); mtp: with
    a multi-token-prediction block as Nemotron 3 ships it (attention then the variant's MLP or MoE, `mtp.*`
    tensors, 16-bit)."""
    config = tiny_config(variant)
    if mtp:
        config["num_nextn_predict_layers"] = 1
        config["mtp_hybrid_override_pattern"] = "*-" if variant == "dense" else "*E"
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _dump(out / "config.json", config)
    cfg = HybridModelConfig.from_hf(out)
    tok = write_tiny_tokenizer(out, model_max_length=config["max_position_embeddings"])
    if tok.get_vocab_size() != cfg.vocab_size:  # pragma: no cover - guards edits of the tokenizer
        raise ValueError(f"tiny tokenizer has {tok.get_vocab_size()} tokens, config says {cfg.vocab_size}")
    im_end = tok.token_to_id(IM_END)
    _dump(
        out / "generation_config.json",
        {"bos_token_id": config["bos_token_id"], "eos_token_id": [config["eos_token_id"], im_end],
         "pad_token_id": config["pad_token_id"]},
    )  # fmt: skip
    _write_weights(out, cfg, seed)
    if fp8:
        write_modelopt_fp8(out)
    return out


def _is_complete(d: Path) -> bool:
    return all(
        (d / f).is_file() for f in ("config.json", SINGLE_FILE, "tokenizer.json", "tokenizer_config.json")
    )


def builtin_model_dir() -> Path:
    """The default model (`BUILTIN_MODEL_NAME`), built under HYSERVE_CACHE_DIR/models on first use.

    Built in a temporary sibling directory and renamed into place, so concurrent first uses never see a
    half-written model: the first rename wins and the others discard their copy.
    """
    final = envs.HYSERVE_CACHE_DIR / "models" / BUILTIN_MODEL_DIRNAME
    if _is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_MODEL_DIRNAME}-", dir=final.parent))
    try:
        make_tiny(tmp, variant="dense", seed=0)
        if final.exists() and not _is_complete(final):  # damaged copy: move it aside, then replace
            trash = Path(tempfile.mkdtemp(prefix=".trash-", dir=final.parent))
            try:
                os.rename(final, trash / "old")
            except OSError:
                pass  # someone else moved it first
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
