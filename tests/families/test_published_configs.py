"""The other hybrid families' published config.json files in `benchmarks/configs/` (Bamba-9B,
granite-4.0-h-small) read through the model registry as transformers reads them: the family, the layer
kinds, the parameter count of transformers' own model built on the meta device, and the per-sequence Mamba
state and per-token KV sizes from first principles."""

from __future__ import annotations

import json

import pytest
import torch

from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA
from hyserve.model.registry import read_config
from tests.shipped_configs import OTHER_FAMILIES, config_dir

transformers = pytest.importorskip("transformers")

HF_CLASSES = {
    "bamba": ("BambaConfig", "BambaForCausalLM"),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
}


@pytest.mark.parametrize("name", OTHER_FAMILIES)
def test_published_config_reads_as_transformers_builds_it(name: str) -> None:
    raw = json.loads((config_dir(name) / "config.json").read_text())
    family, spec = read_config(config_dir(name))
    assert raw["model_type"] in family.model_types
    cfg_cls, model_cls = (getattr(transformers, c) for c in HF_CLASSES[raw["model_type"]])
    hf_cfg = cfg_cls(**raw)
    if raw["model_type"] == "bamba":
        attn = set(hf_cfg.attn_layer_indices)
    else:
        attn = {
            i for i, kind in enumerate(hf_cfg.layer_types) if "attention" in kind and "linear" not in kind
        }
    want_kinds = [LAYER_ATTENTION if i in attn else LAYER_MAMBA for i in range(hf_cfg.num_hidden_layers)]
    assert list(spec.layer_types) == want_kinds
    with torch.device("meta"):
        hf = model_cls(hf_cfg)
    assert spec.num_parameters() == sum(p.numel() for p in hf.parameters())
    # cache sizes from the JSON alone: conv + float32 SSM state per Mamba layer, K and V per attention layer
    n_mamba, n_attn = want_kinds.count(LAYER_MAMBA), want_kinds.count(LAYER_ATTENTION)
    inner = raw["mamba_n_heads"] * raw["mamba_d_head"]
    conv_dim = inner + 2 * raw["mamba_n_groups"] * raw["mamba_d_state"]
    ssm = raw["mamba_n_heads"] * raw["mamba_d_head"] * raw["mamba_d_state"] * 4
    conv = conv_dim * (raw["mamba_d_conv"] - 1) * spec.dtype.itemsize
    assert spec.state_bytes_per_sequence == n_mamba * (ssm + conv)
    head_dim = raw.get("head_dim", raw["hidden_size"] // raw["num_attention_heads"])
    assert spec.kv_bytes_per_token == n_attn * 2 * raw["num_key_value_heads"] * head_dim * spec.dtype.itemsize
