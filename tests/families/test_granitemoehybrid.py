"""Granite-4.0-H (GraniteMoeHybridForCausalLM) served through the normal loader matches transformers on the
CPU: dense (Micro's shape: the shared MLP only) and MoE (Tiny / Small's: softmax top-k experts plus the
shared MLP, tied embeddings), NoPE attention and RoPE, with the µP multipliers; the family declares exactly
the kernel ops its forwards look up; the config parses as transformers reads it, and the newer exporters'
MoE tensor names load as the same tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from hyserve.model import registry
from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA
from hyserve.model.granitemoehybrid.config import GraniteMoeHybridConfig
from tests.families.hf_parity import check_family_parity, check_tp2_matches_tp1

transformers = pytest.importorskip("transformers")

# (local experts, position embedding, tied embeddings, Mamba B/C groups, attention multiplier)
VARIANTS = {
    "dense": (0, "nope", True, 2, 0.0078125),
    "moe": (4, "nope", False, 1, 0.0078125),
    "moe-rope": (4, "rope", False, 1, 0.25),  # scores large enough for positions to matter
}


def _hf_model(variant: str) -> Any:
    experts, pos, tied, groups, attention_multiplier = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = transformers.GraniteMoeHybridConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=8,
        mamba_n_groups=groups,
        mamba_d_state=16,
        mamba_chunk_size=8,
        num_local_experts=experts,
        num_experts_per_tok=2,
        position_embedding_type=pos,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=tied,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=attention_multiplier,
        logits_scaling=6.0,
        initializer_range=0.1,  # the published configs' (logits far from uniform)
    )
    hf = transformers.GraniteMoeHybridForCausalLM(cfg).float().eval()
    with torch.no_grad():  # visible SSM and norm parameters (init leaves them at 1, log(1..H))
        for m in hf.modules():
            if type(m).__name__ == "GraniteMoeHybridMambaLayer":
                m.dt_bias.normal_(0.0, 0.5)
                m.D.normal_(1.0, 0.2)
                m.norm.weight.normal_(1.0, 0.1)
    return hf


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_granite_greedy_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    cfg, declared, looked_up = check_family_parity(
        tmp_path, monkeypatch, _hf_model(variant), "granitemoehybrid", GraniteMoeHybridConfig
    )
    if cfg.num_local_experts:
        assert declared - looked_up == {"fp8_linear"}  # (16-bit weights here: test_fp8_families.py)
    else:
        assert declared - looked_up == {"router_logits", "moe_experts_silu", "fp8_linear"}


def test_newer_exporters_moe_tensor_names_load_as_the_same_tensors(tmp_path: Path) -> None:
    hf = _hf_model("moe")
    old, new = tmp_path / "old", tmp_path / "new"
    hf.save_pretrained(old)
    renames = {
        "block_sparse_moe.input_linear.weight": "block_sparse_moe.experts.gate_up_proj",
        "block_sparse_moe.output_linear.weight": "block_sparse_moe.experts.down_proj",
        "block_sparse_moe.router.layer.weight": "block_sparse_moe.router.weight",
    }
    tensors = load_file(old / "model.safetensors")
    renamed = {}
    for name, t in tensors.items():
        for a, b in renames.items():
            name = name.replace(a, b)
        renamed[name] = t
    assert renamed.keys() != tensors.keys()
    new.mkdir()
    save_file(renamed, new / "model.safetensors", metadata={"format": "pt"})
    (new / "config.json").write_text((old / "config.json").read_text())
    loaded = []
    for d in (old, new):
        family, cfg = registry.read_config(d)
        model = family.build(cfg, torch.float32)
        family.load_weights(model, d)
        assert isinstance(model, torch.nn.Module)
        loaded.append(model.state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    for name, t in loaded[0].items():
        assert torch.equal(t, loaded[1][name]), name


def _raw(**over: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "model_type": "granitemoehybrid",
        "vocab_size": 512,
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "shared_intermediate_size": 256,
        "intermediate_size": 64,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "mamba_n_heads": 8,
        "layers_block_type": ["mamba", "attention", "mamba", "mamba"],
        "position_embedding_type": "nope",
        "attention_multiplier": 0.015625,
        "torch_dtype": "bfloat16",
    }
    raw.update(over)
    return raw


def test_config_reads_as_transformers_does() -> None:
    fam = registry.family_for(_raw())
    cfg = fam.parse_config(_raw(), "tiny")
    assert isinstance(cfg, GraniteMoeHybridConfig)
    assert cfg.layer_types == (LAYER_MAMBA, LAYER_ATTENTION, LAYER_MAMBA, LAYER_MAMBA)
    assert cfg.attention.rope is None and cfg.attention.softmax_scale == 0.015625
    assert cfg.attention.head_dim == 16 and cfg.mamba.head_dim == 2 * 128 // 8
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (8, 2, 64)
    rope = fam.parse_config(_raw(position_embedding_type="rope", rope_theta=1e7, head_dim=32), "tiny")
    assert isinstance(rope, GraniteMoeHybridConfig) and rope.attention.rope is not None
    assert (rope.attention.rope.theta, rope.attention.rope.rotary_dim, rope.attention.head_dim) == (
        1e7,
        32,
        32,
    )
    no_types = {k: v for k, v in _raw().items() if k != "layers_block_type"}
    assert fam.parse_config(no_types, "tiny").mamba_layer_ids == (0, 1, 2, 3)  # transformers: all Mamba
    dense = fam.parse_config(_raw(num_local_experts=0, num_experts_per_tok=0), "tiny")
    assert isinstance(dense, GraniteMoeHybridConfig) and dense.num_experts_per_tok == 0
    for cfg_ in (cfg, dense, rope):  # the module tree builds on the meta device, its size the config's count
        with torch.device("meta"):
            model = fam.build(cfg_, torch.bfloat16)
        assert isinstance(model, torch.nn.Module)
        assert sum(p.numel() for p in model.parameters()) == cfg_.num_parameters()
    with pytest.raises(ValueError, match="position_embedding_type"):
        fam.parse_config(_raw(position_embedding_type="alibi"), "tiny")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        fam.parse_config(_raw(num_experts_per_tok=9), "tiny")
    assert not cfg.sharding_problems(tp_size=2, ep_size=2) and not dense.sharding_problems(
        tp_size=2, ep_size=1
    )
    odd = fam.parse_config(_raw(num_local_experts=3, num_experts_per_tok=2, intermediate_size=33), "tiny")
    problems = odd.sharding_problems(tp_size=2, ep_size=1) + odd.sharding_problems(tp_size=2, ep_size=2)
    assert any("intermediate_size (33)" in p and "tp_size / ep_size" in p for p in problems), problems
    assert any("num_local_experts (3)" in p and "ep_size" in p for p in problems), problems


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant, ep, quantization", [("dense", 1, None), ("moe", 1, None), ("moe", 2, None), ("moe", 1, "fp8")]
)
def test_granite_tp2_matches_tp1(tmp_path: Path, variant: str, ep: int, quantization: str | None) -> None:
    """Over two gloo ranks: each rank's Mamba heads, KV heads and shared-MLP columns; the routed experts
    split by their intermediate rows (ep_size 1) or by expert (ep_size 2); FP8 experts quantised from each
    expert's whole matrix, so every rank holds tp_size 1's codes and scales."""
    _hf_model(variant).save_pretrained(tmp_path)
    check_tp2_matches_tp1(str(tmp_path), ep_size=ep, quantization=quantization)
