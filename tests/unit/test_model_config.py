"""`HybridModelConfig`: parsing every shipped config, derived cache sizes, key aliases, and validation
errors."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA, LAYER_MLP, LAYER_MOE
from hyserve.model.nemotron_h.config import HybridModelConfig
from tests.shipped_configs import ALL, config_dir

torch.set_num_threads(1)

MIB = 2**20
PATTERN = {"M": LAYER_MAMBA, "*": LAYER_ATTENTION, "-": LAYER_MLP, "E": LAYER_MOE}
HF_NAMES = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def raw(name: str) -> dict:
    return json.loads((config_dir(name) / "config.json").read_text())


def layer_kinds(d: dict) -> list[str]:
    if "layers_block_type" in d:
        m = {"mamba": LAYER_MAMBA, "linear_attention": LAYER_MAMBA, "attention": LAYER_ATTENTION,
             "full_attention": LAYER_ATTENTION, "mlp": LAYER_MLP, "moe": LAYER_MOE}  # fmt: skip
        return [m[t] for t in d["layers_block_type"]]
    return [PATTERN[c] for c in d["hybrid_override_pattern"]]


def test_all_shipped_configs_are_present():
    assert {"NVIDIA-Nemotron-Nano-9B-v2", "tiny-nemotron-h-dense", "tiny-nemotron-3-moe",
            "tiny-nemotron-3-latent-moe"} <= set(ALL)  # fmt: skip


@pytest.mark.parametrize("name", ALL)
def test_every_config_parses_and_matches_its_json(name):
    d = raw(name)
    cfg = HybridModelConfig.from_hf(config_dir(name))
    assert cfg.name == name
    assert list(cfg.layer_types) == layer_kinds(d)
    assert cfg.num_layers == len(cfg.layer_types)
    if "num_hidden_layers" in d:
        assert cfg.num_layers == d["num_hidden_layers"]
    assert cfg.hidden_size == d["hidden_size"] and cfg.vocab_size == d["vocab_size"]
    assert cfg.mamba_num_heads == d["mamba_num_heads"] and cfg.mamba_head_dim == d["mamba_head_dim"]
    assert cfg.ssm_state_size == d["ssm_state_size"] and cfg.n_groups == d["n_groups"]
    assert cfg.chunk_size == d["chunk_size"] and cfg.conv_kernel == d["conv_kernel"]
    assert cfg.num_key_value_heads == d["num_key_value_heads"]
    assert cfg.head_dim == d.get("head_dim", d.get("attention_head_dim"))
    if any(t == LAYER_MOE for t in cfg.layer_types):
        assert cfg.n_routed_experts == d["n_routed_experts"]
        assert cfg.num_experts_per_tok == d["num_experts_per_tok"]
        assert cfg.moe_latent_size == d.get("moe_latent_size")
        assert cfg.routed_scaling_factor == d["routed_scaling_factor"]
    # checkpoint dtype: explicit "torch_dtype"/"dtype", else bfloat16
    want = d.get("torch_dtype") or d.get("dtype") or "bfloat16"
    assert cfg.dtype == getattr(torch, want)
    assert cfg.ssm_cache_dtype == torch.float32
    assert cfg.num_parameters() > 0


@pytest.mark.parametrize("name", ALL)
def test_cache_sizes_follow_from_first_principles(name):
    """Independent arithmetic from the raw JSON, per layer kind."""
    d = raw(name)
    kinds = layer_kinds(d)
    n_mamba, n_attn = kinds.count(LAYER_MAMBA), kinds.count(LAYER_ATTENTION)
    head_dim = d.get("head_dim", d.get("attention_head_dim"))
    cfg = HybridModelConfig.from_hf(config_dir(name))
    model_bytes = cfg.dtype.itemsize
    assert cfg.kv_bytes_per_token == n_attn * 2 * d["num_key_value_heads"] * head_dim * model_bytes
    conv_dim = d["mamba_num_heads"] * d["mamba_head_dim"] + 2 * d["n_groups"] * d["ssm_state_size"]
    conv = conv_dim * (d["conv_kernel"] - 1) * model_bytes
    for ssm_dtype, nbytes in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        c = cfg.with_cache_dtypes(ssm_cache_dtype=ssm_dtype)
        ssm = d["mamba_num_heads"] * d["mamba_head_dim"] * d["ssm_state_size"] * nbytes
        assert c.mamba_cache_spec().conv_bytes == conv
        assert c.mamba_cache_spec().ssm_bytes == ssm
        assert c.state_bytes_per_sequence == n_mamba * (conv + ssm)
    a = cfg.attention_cache_spec()
    assert a.bytes_per_token * n_attn == cfg.kv_bytes_per_token


def test_nano_9b_v2_figures_from_design():
    cfg = HybridModelConfig.from_hf(config_dir("NVIDIA-Nemotron-Nano-9B-v2"))
    assert len(cfg.mamba_layer_ids) == 27 and len(cfg.attention_layer_ids) == 4
    assert cfg.num_layers == 56
    fp32 = cfg.state_bytes_per_sequence / MIB
    # the project's notes round this to 137.5 MiB; the exact figure is
    # 27 * (12288*3*2 + 128*80*128*4) B = 136.9 MiB
    assert fp32 == pytest.approx(136.9, rel=0.01)
    assert fp32 == pytest.approx(137.5, rel=0.01)
    assert cfg.state_bytes_per_sequence == 27 * (12288 * 3 * 2 + 128 * 80 * 128 * 4)
    for half in ("bfloat16", "float16"):
        assert cfg.with_cache_dtypes(ssm_cache_dtype=half).state_bytes_per_sequence / MIB == pytest.approx(
            69, rel=0.01
        )
    assert cfg.kv_bytes_per_token == 4 * 2 * 8 * 128 * 2
    # the same through the config key instead of the engine option
    d = raw("NVIDIA-Nemotron-Nano-9B-v2")
    d["mamba_ssm_cache_dtype"] = "bfloat16"
    assert HybridModelConfig.from_dict(d).state_bytes_per_sequence / MIB == pytest.approx(69, rel=0.01)


def test_kv_cache_dtype_override():
    cfg = HybridModelConfig.from_hf(config_dir("NVIDIA-Nemotron-Nano-9B-v2"))
    c = cfg.with_cache_dtypes(kv_cache_dtype=torch.float32)
    assert c.kv_bytes_per_token == 2 * cfg.kv_bytes_per_token
    assert c.state_bytes_per_sequence == cfg.state_bytes_per_sequence
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype"):
        cfg.with_cache_dtypes(ssm_cache_dtype="int8")


# ---- aliases and the two layer-list spellings ---------------------------------------------------
LEGACY = {  # current key -> legacy key, with a non-default value so a dropped alias cannot pass
    "n_groups": ("mamba_n_groups", 4),
    "conv_kernel": ("mamba_d_conv", 3),
    "chunk_size": ("mamba_chunk_size", 16),
    "ssm_state_size": ("mamba_d_state", 32),
    "time_step_min": ("mamba_dt_min", 0.002),
    "time_step_max": ("mamba_dt_max", 0.2),
    "time_step_limit": ("mamba_dt_limit", [0.001, 50.0]),
    "use_conv_bias": ("mamba_conv_bias", False),
    "head_dim": ("attention_head_dim", 8),
    "layer_norm_epsilon": ("rms_norm_eps", 1e-6),
}


def test_legacy_mamba_aliases_give_the_same_config():
    modern = raw("tiny-nemotron-3-moe")
    legacy = copy.deepcopy(modern)
    for key, (old, value) in LEGACY.items():
        modern[key] = value
        legacy.pop(key, None)
        legacy[old] = value
    a, b = HybridModelConfig.from_dict(modern), HybridModelConfig.from_dict(legacy)
    assert a == b
    assert (b.n_groups, b.conv_kernel, b.chunk_size, b.ssm_state_size) == (4, 3, 16, 32)
    assert b.time_step_min == 0.002 and b.time_step_limit == (0.001, 50.0)
    assert (b.use_conv_bias, b.head_dim, b.layer_norm_epsilon) == (False, 8, 1e-6)


def test_norm_eps_alias():
    d = raw("tiny-nemotron-3-moe")
    d.pop("layer_norm_epsilon")
    d["norm_eps"] = 3e-6
    assert HybridModelConfig.from_dict(d).layer_norm_epsilon == 3e-6


def test_nemotron_h_8b_uses_legacy_names():
    """Nemotron-H 8B spells head_dim `attention_head_dim` and eps `rms_norm_eps`."""
    cfg = HybridModelConfig.from_hf(config_dir("Nemotron-H-8B-Base-8K"))
    assert cfg.head_dim == 128 and cfg.layer_norm_epsilon == 1e-5


def test_mamba_heads_derived_from_expand_when_absent():
    d = raw("tiny-nemotron-3-moe")
    d.pop("mamba_num_heads")
    assert (
        HybridModelConfig.from_dict(d).mamba_num_heads
        == d["expand"] * d["hidden_size"] // d["mamba_head_dim"]
    )


@pytest.mark.parametrize("name", [n for n in ALL if "hybrid_override_pattern" in raw(n)])
def test_pattern_and_layers_block_type_agree(name):
    d = raw(name)
    for names in (HF_NAMES, {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}):
        alt = copy.deepcopy(d)
        alt["layers_block_type"] = [names[c] for c in alt.pop("hybrid_override_pattern")]
        assert HybridModelConfig.from_dict(alt) == HybridModelConfig.from_dict(d)


@pytest.mark.parametrize("name", [n for n in ALL if "layers_block_type" in raw(n)])
def test_layers_block_type_and_pattern_agree(name):
    d = raw(name)
    inv = {
        "mamba": "M",
        "linear_attention": "M",
        "attention": "*",
        "full_attention": "*",
        "mlp": "-",
        "moe": "E",
    }
    alt = copy.deepcopy(d)
    alt["hybrid_override_pattern"] = "".join(inv[t] for t in alt.pop("layers_block_type"))
    assert HybridModelConfig.from_dict(alt) == HybridModelConfig.from_dict(d)


def test_from_hf_accepts_a_config_json_path_and_rejects_missing_files(tmp_path):
    p = config_dir("tiny-nemotron-h-dense") / "config.json"
    assert HybridModelConfig.from_hf(p).layer_types == HybridModelConfig.from_hf(p.parent).layer_types
    with pytest.raises(FileNotFoundError):
        HybridModelConfig.from_hf(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="JSON"):
        HybridModelConfig.from_hf(tmp_path)


# ---- validation: every bad field named in a ValueError ------------------------------------------
DROP = object()
BAD = [
    # (base config, changes, a substring naming the field)
    ("tiny-nemotron-3-moe", {"hidden_size": DROP}, "hidden_size"),
    ("tiny-nemotron-3-moe", {"hidden_size": 0}, "hidden_size"),
    ("tiny-nemotron-3-moe", {"hidden_size": "wide"}, "hidden_size"),
    ("tiny-nemotron-3-moe", {"vocab_size": DROP}, "vocab_size"),
    ("tiny-nemotron-3-moe", {"model_type": "llama"}, "model_type"),
    ("NVIDIA-Nemotron-Nano-9B-v2", {"hybrid_override_pattern": "M-X*"}, "hybrid_override_pattern"),
    ("NVIDIA-Nemotron-Nano-9B-v2", {"hybrid_override_pattern": ["M"]}, "hybrid_override_pattern"),
    ("NVIDIA-Nemotron-Nano-9B-v2", {"num_hidden_layers": 3}, "num_hidden_layers"),
    ("tiny-nemotron-3-moe", {"layers_block_type": ["mamba", "conv"]}, "layers_block_type"),
    ("tiny-nemotron-3-moe", {"layers_block_type": "ME"}, "layers_block_type"),
    ("tiny-nemotron-3-moe", {"layers_block_type": []}, "layers_block_type"),
    ("tiny-nemotron-3-moe", {"layers_block_type": DROP}, "layers_block_type"),
    ("tiny-nemotron-3-moe", {"n_groups": 3}, "n_groups"),
    ("tiny-nemotron-3-moe", {"n_groups": 0}, "n_groups"),
    ("tiny-nemotron-3-moe", {"num_key_value_heads": 3}, "num_key_value_heads"),
    ("tiny-nemotron-3-moe", {"num_key_value_heads": 0}, "num_key_value_heads"),
    ("tiny-nemotron-3-moe", {"mamba_head_dim": 0}, "mamba_head_dim"),
    ("tiny-nemotron-3-moe", {"mamba_num_heads": -4}, "mamba_num_heads"),
    ("tiny-nemotron-3-moe", {"ssm_state_size": 0}, "ssm_state_size"),
    ("tiny-nemotron-3-moe", {"chunk_size": 0}, "chunk_size"),
    ("tiny-nemotron-3-moe", {"conv_kernel": 1}, "conv_kernel"),
    ("tiny-nemotron-3-moe", {"dtype": "int8"}, "dtype"),
    ("tiny-nemotron-3-moe", {"mamba_ssm_cache_dtype": "float64"}, "mamba_ssm_cache_dtype"),
    ("tiny-nemotron-3-moe", {"time_step_limit": [0.1]}, "time_step_limit"),
    ("tiny-nemotron-3-moe", {"time_step_limit": [0.5, 0.1]}, "time_step_limit"),
    ("tiny-nemotron-3-moe", {"mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
    ("tiny-nemotron-3-moe", {"mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
    ("tiny-nemotron-3-moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("tiny-nemotron-3-moe", {"n_group": 3}, "n_group"),
    ("tiny-nemotron-3-moe", {"topk_group": 2}, "topk_group"),
    ("tiny-nemotron-3-moe", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ("tiny-nemotron-3-moe", {"moe_latent_size": 0}, "moe_latent_size"),
    ("tiny-nemotron-3-moe", {"layer_norm_epsilon": 0}, "layer_norm_epsilon"),
    ("tiny-nemotron-h-dense", {"intermediate_size": 0}, "intermediate_size"),
]


def _case_id(changes: dict) -> str:
    k, v = next(iter(changes.items()))
    return f"{k}-missing" if v is DROP else f"{k}={v!r}"[:40]


@pytest.mark.parametrize("base,changes,field", BAD, ids=[_case_id(c) for _, c, _ in BAD])
def test_invalid_field_raises_value_error_naming_it(base, changes, field):
    d = raw(base)
    for k, v in changes.items():
        if v is DROP:
            d.pop(k, None)
        else:
            d[k] = v
    with pytest.raises(ValueError, match=field):
        HybridModelConfig.from_dict(d)


def test_config_is_frozen():
    cfg = HybridModelConfig.from_hf(config_dir("tiny-nemotron-h-dense"))
    with pytest.raises(AttributeError):
        cfg.hidden_size = 3  # type: ignore[misc]
