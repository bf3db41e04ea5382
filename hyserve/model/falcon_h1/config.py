"""`FalconH1Config`: a FalconH1ForCausalLM config.json (Falcon-H1 0.5B to 34B) as hyserve needs it. Every
layer is hybrid: attention and a Mamba2 mixer read the same normed input side by side and their outputs are
summed, then a SiLU-gated MLP. The µP multipliers, as transformers applies them:

    embeddings * embedding_multiplier;  logits * lm_head_multiplier
    attention(x * attention_in_multiplier) * attention_out_multiplier, its keys * key_multiplier
    mamba(x * ssm_in_multiplier) * ssm_out_multiplier, in_proj's z / x / B / C / dt rows * ssm_multipliers
    down(up(x) * silu(gate(x) * mlp_multipliers[0])) * mlp_multipliers[1]

The Mamba mixer is `mamba_d_ssm` wide (absent: transformers' 1024; null: mamba_expand * hidden_size), its
output gated by z with a grouped RMSNorm (`mamba_rms_norm`, before or after the gate as
`mamba_norm_before_gate` says) or without; out_proj has a bias when `projectors_bias` is set. Attention is
RoPE over the whole head (`head_dim`, else hidden_size / num_attention_heads).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyserve.model.config import (
    LAYER_HYBRID,
    Fields,
    number,
)
from hyserve.model.hybrid_config import (
    HybridDecoderConfig,
    check_rope_type,
    check_silu,
    decoder_fields,
    parse_mamba,
    rope_theta,
)
from hyserve.model.layer_specs import AttentionSpec, MambaSpec, RopeSpec, divides

# transformers' FalconH1Config defaults for keys a config.json leaves out
_D_SSM_DEFAULT = 1024
_KV_HEADS_DEFAULT = 8


def _multipliers(f: Fields, key: str, n: int) -> tuple[float, ...]:
    v = f.d.get(key)
    if v is None:
        return (1.0,) * n
    if not isinstance(v, list | tuple) or len(v) != n:
        raise ValueError(f"{key}: expected a list of {n} numbers, got {v!r}")
    return tuple(float(number(key, x, float)) for x in v)


def _parse_mamba(f: Fields, hidden: int, eps: float) -> MambaSpec:
    heads = f.get("mamba_n_heads", 128, int)
    if "mamba_d_ssm" not in f.d:
        d_ssm = _D_SSM_DEFAULT
    elif f.d["mamba_d_ssm"] is None:
        d_ssm = f.get("mamba_expand", 2, int) * hidden
    else:
        d_ssm = f.req("mamba_d_ssm")
    if heads <= 0 or d_ssm % heads:
        raise ValueError(f"mamba_n_heads ({heads}) must divide the Mamba width mamba_d_ssm ({d_ssm})")
    d_head = f.d.get("mamba_d_head")
    head_dim = d_ssm // heads if d_head in (None, "auto") else f.req("mamba_d_head")
    if head_dim * heads != d_ssm:
        raise ValueError(
            f"mamba_d_head ({head_dim}) * mamba_n_heads ({heads}) must equal mamba_d_ssm ({d_ssm})"
        )
    return parse_mamba(
        f,
        hidden,
        eps,
        heads=heads,
        head_dim=head_dim,
        out_bias=bool(f.get("projectors_bias", False)),
        rms_norm=bool(f.get("mamba_rms_norm", False)),
        norm_before_gate=bool(f.get("mamba_norm_before_gate", True)),
    )


def _parse_attention(f: Fields, hidden: int) -> AttentionSpec:
    check_rope_type(f)
    heads = f.req("num_attention_heads")
    kv = f.d.get("num_key_value_heads", _KV_HEADS_DEFAULT)
    head_dim = f.get("head_dim", hidden // heads, int)
    return AttentionSpec(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=heads if kv is None else number("num_key_value_heads", kv, int),
        head_dim=head_dim,
        bias=bool(f.get("attention_bias", False)),
        rope=RopeSpec(theta=rope_theta(f), rotary_dim=head_dim),
        key_multiplier=f.get("key_multiplier", 1.0, float),
    )


@dataclass(frozen=True, kw_only=True)
class FalconH1Config(HybridDecoderConfig):
    intermediate_size: int
    mlp_bias: bool = False
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0,) * 5  # in_proj's z, x, B, C, dt rows
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # gate, down

    def ffn_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)

    def ffn_sharding_problems(self, tp_size: int, ep_size: int) -> list[str]:
        return divides("intermediate_size", self.intermediate_size, tp_size)

    def layer_summary(self) -> str:
        return "attention and Mamba2 side by side"

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "") -> FalconH1Config:
        f = Fields(raw)
        check_silu(f)
        hidden = f.req("hidden_size")
        eps = f.get("rms_norm_eps", 1e-5, float)
        gate, down = _multipliers(f, "mlp_multipliers", 2)
        cfg = cls(
            layer_types=(LAYER_HYBRID,) * f.req("num_hidden_layers"),
            **decoder_fields(f, hidden, eps, 8192),
            mamba=_parse_mamba(f, hidden, eps),
            attention=_parse_attention(f, hidden),
            intermediate_size=f.req("intermediate_size"),
            mlp_bias=bool(f.get("mlp_bias", False)),
            embedding_multiplier=f.get("embedding_multiplier", 1.0, float),
            lm_head_multiplier=f.get("lm_head_multiplier", 1.0, float),
            attention_in_multiplier=f.get("attention_in_multiplier", 1.0, float),
            attention_out_multiplier=f.get("attention_out_multiplier", 1.0, float),
            ssm_in_multiplier=f.get("ssm_in_multiplier", 1.0, float),
            ssm_out_multiplier=f.get("ssm_out_multiplier", 1.0, float),
            ssm_multipliers=_multipliers(f, "ssm_multipliers", 5),
            mlp_multipliers=(gate, down),
            name=name,
        )
        cfg.validate()
        return cfg
