"""Falcon-H1 (FalconH1ForCausalLM) served through the normal loader matches transformers on the CPU: every
layer runs attention and Mamba2 side by side, with the µP multipliers (embedding, lm_head, key, attention and
SSM in / out, the zxbcdt and MLP multipliers), in the Mamba output variants (gated without a norm, the norm
after or before the gate), with and without projector, attention and MLP biases, tied and untied embeddings;
the family declares the kernel ops its forwards look up; tp_size 2 gives tp_size 1's tokens; the config parses
as transformers reads it, and the options it cannot run are refused naming the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyserve.model import registry
from hyserve.model.falcon_h1.config import FalconH1Config
from tests.families.hf_parity import check_family_parity, check_tp2_matches_tp1

transformers = pytest.importorskip("transformers")

_MULTIPLIERS: dict[str, Any] = {
    "embedding_multiplier": 5.0,
    "lm_head_multiplier": 0.3,
    "key_multiplier": 0.6,
    "attention_in_multiplier": 1.3,
    "attention_out_multiplier": 0.9,
    "ssm_in_multiplier": 0.8,
    "ssm_out_multiplier": 0.25,
    "ssm_multipliers": [0.35, 0.5, 0.7, 1.4, 0.45],
    "mlp_multipliers": [0.9, 0.6],
}

VARIANTS: dict[str, dict[str, Any]] = {
    # Falcon-H1 0.5B-7B's shape: no Mamba norm, untied, µP multipliers; mamba_d_ssm null: expand * hidden
    "gated": {"mamba_d_ssm": None, "mamba_rms_norm": False, **_MULTIPLIERS},
    # grouped norm after the gate, a Mamba wider than 2 * hidden, head_dim not hidden / heads, biases
    "norm-after-gate": {
        "mamba_d_ssm": 96,
        "mamba_n_heads": 6,
        "mamba_n_groups": 2,
        "mamba_rms_norm": True,
        "mamba_norm_before_gate": False,
        "head_dim": 24,
        "projectors_bias": True,
        "attention_bias": True,
        "mlp_bias": True,
        **_MULTIPLIERS,
    },
    # the norm before the gate, tied embeddings, no multipliers (transformers' defaults)
    "norm-before-gate": {
        "mamba_d_ssm": 64,
        "mamba_n_groups": 2,
        "mamba_rms_norm": True,
        "mamba_norm_before_gate": True,
        "tie_word_embeddings": True,
    },
}


# the output ops a variant does not call: gated_norm_linear is the norm after the gate fused with out_proj,
# rmsnorm_gated the norm before it
UNUSED_OPS = {
    "gated": {"gated_norm_linear", "rmsnorm_gated"},
    "norm-after-gate": {"rmsnorm_gated"},
    "norm-before-gate": {"gated_norm_linear"},
}


def _hf_model(variant: str, **over: Any) -> Any:
    torch.manual_seed(0)
    kw: dict[str, Any] = {
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "mamba_n_heads": 8,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 8,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "initializer_range": 0.1,
    }
    kw.update(VARIANTS[variant])
    kw.update(over)
    hf = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**kw)).float().eval()
    with torch.no_grad():  # visible SSM, norm and bias parameters (init leaves them at 1, log(1..H), 0)
        for name, p in hf.named_parameters():
            if name.endswith(("dt_bias", "bias")):
                p.normal_(0.0, 0.5 if name.endswith("dt_bias") else 0.05)
            elif name.endswith(".D") or name.endswith("norm.weight"):
                p.normal_(1.0, 0.2 if name.endswith(".D") else 0.1)
    return hf


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_falcon_h1_greedy_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variant: str
) -> None:
    _, declared, looked_up = check_family_parity(
        tmp_path, monkeypatch, _hf_model(variant), "falcon_h1", FalconH1Config
    )
    assert declared - looked_up == UNUSED_OPS[variant] | {"fp8_linear"}  # 16-bit weights here


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_falcon_h1_tp2_matches_tp1(tmp_path: Path, variant: str) -> None:
    """Over two gloo ranks: each rank's rows of the ssm_multipliers, its B/C groups' norm, its KV heads."""
    _hf_model(variant).save_pretrained(tmp_path)
    check_tp2_matches_tp1(str(tmp_path))


def _raw(**over: object) -> dict[str, object]:
    raw: dict[str, object] = {
        "architectures": ["FalconH1ForCausalLM"],
        "model_type": "falcon_h1",
        "vocab_size": 512,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "mamba_n_heads": 8,
        "mamba_d_ssm": 192,
        "mamba_d_state": 16,
        "rope_theta": 1e11,
        "torch_dtype": "bfloat16",
        **_MULTIPLIERS,
    }
    raw.update(over)
    return raw


def test_config_reads_as_transformers_does() -> None:
    fam = registry.family_for(_raw())
    cfg = fam.parse_config(_raw(), "tiny")
    assert isinstance(cfg, FalconH1Config)
    # every layer holds a KV cache and a Mamba state
    assert cfg.attention_layer_ids == cfg.mamba_layer_ids == (0, 1, 2)
    layout = cfg.cache_layout()
    assert set(layout.attention) == set(layout.recurrent) == {0, 1, 2}
    assert cfg.kv_bytes_per_token == 3 * 2 * 2 * 32 * 2
    assert cfg.attention.head_dim == 32 and cfg.attention.rope is not None
    assert (cfg.attention.rope.theta, cfg.attention.rope.rotary_dim) == (1e11, 32)
    assert cfg.attention.key_multiplier == 0.6 and cfg.attention.softmax_scale == 32**-0.5
    assert (cfg.mamba.d_inner, cfg.mamba.head_dim) == (192, 24)
    assert not cfg.mamba.rms_norm and cfg.mamba.norm_before_gate  # transformers' defaults
    assert cfg.ssm_multipliers == (0.35, 0.5, 0.7, 1.4, 0.45) and cfg.mlp_multipliers == (0.9, 0.6)
    absent = {k: v for k, v in _raw().items() if k not in ("mamba_d_ssm", "num_key_value_heads")}
    defaults = fam.parse_config(absent, "tiny")  # transformers' defaults: a 1024-wide Mamba, 8 KV heads
    assert isinstance(defaults, FalconH1Config)
    assert (defaults.mamba.d_inner, defaults.attention.num_kv_heads) == (1024, 8)
    wide = fam.parse_config(_raw(mamba_d_ssm=None, mamba_expand=3), "tiny")
    assert isinstance(wide, FalconH1Config) and wide.mamba.d_inner == 3 * 128
    variants = [
        cfg,
        fam.parse_config(_raw(mamba_rms_norm=True, projectors_bias=True, attention_bias=True), "tiny"),
        fam.parse_config(_raw(mlp_bias=True, mamba_proj_bias=True, tie_word_embeddings=True), "tiny"),
    ]
    for cfg_ in variants:  # the module tree builds on the meta device, its size the config's count
        with torch.device("meta"):
            model = fam.build(cfg_, torch.bfloat16)
        assert isinstance(model, torch.nn.Module)
        assert sum(p.numel() for p in model.parameters()) == cfg_.num_parameters()
    assert not cfg.sharding_problems(tp_size=2, ep_size=1)
    before = fam.parse_config(_raw(mamba_rms_norm=True, mamba_norm_before_gate=True), "tiny")
    assert isinstance(before, FalconH1Config)
    assert any("mamba_n_groups" in p for p in before.sharding_problems(tp_size=2, ep_size=1))


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"hidden_act": "gelu"}, "hidden_act: only 'silu' is supported, got 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, "rope_type: only 'default'.*'yarn'"),
        ({"mamba_d_ssm": 100}, r"mamba_n_heads \(8\) must divide the Mamba width mamba_d_ssm \(100\)"),
        ({"mamba_d_head": 16}, r"mamba_d_head \(16\) \* mamba_n_heads \(8\) must equal mamba_d_ssm \(192\)"),
        ({"ssm_multipliers": [1.0, 1.0]}, r"ssm_multipliers: expected a list of 5 numbers, got \[1.0, 1.0\]"),
        ({"mlp_multipliers": "big"}, "mlp_multipliers: expected a list of 2 numbers, got 'big'"),
    ],
)
def test_config_options_it_cannot_run_are_refused(over: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.family_for(_raw()).parse_config(_raw(**over), "tiny")


def test_kv_calibration_records_the_keys_the_cache_gets(tmp_path: Path) -> None:
    """The keys written to the KV cache are k_proj's times key_multiplier: the recorded amax is theirs."""
    from hyserve.model.kv_scales import record_kv_amax
    from tests.model_harness import Harness

    _hf_model("gated").save_pretrained(tmp_path)
    family, cfg = registry.read_config(tmp_path)
    model = family.build(cfg, torch.float32)
    family.load_weights(model, tmp_path)
    assert isinstance(model, torch.nn.Module) and isinstance(cfg, FalconH1Config)
    layers = list(model.model.layers)
    seen: dict[int, torch.Tensor] = {}  # each attention's input, projected here
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda _m, args, i=i: seen.__setitem__(i, args[0].clone()))
        for i, layer in enumerate(layers)
    ]
    with record_kv_amax(model) as amax:  # type: ignore[arg-type]
        Harness(model).step([(0, [5, 17, 33, 2, 9, 41, 8, 100]), (1, [7, 8, 9])])  # type: ignore[arg-type]
    for h in handles:
        h.remove()
    assert sorted(amax) == [0, 1]
    for i, layer in enumerate(layers):
        with torch.no_grad():
            k = layer.self_attn.k_proj(seen[i]) * cfg.attention.key_multiplier
            v = layer.self_attn.v_proj(seen[i])
        torch.testing.assert_close(amax[i], torch.stack([k.abs().max(), v.abs().max()]))
