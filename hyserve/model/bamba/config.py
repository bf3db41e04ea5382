"""`BambaConfig`: a BambaForCausalLM config.json as hyserve needs it. Mamba2 layers, with RoPE attention at
`attn_layer_indices` (partial rotary: `rope_parameters.partial_rotary_factor`, 0.5 when absent, as
transformers has it), and a SiLU-gated MLP in every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA, Fields
from hyserve.model.hybrid_config import (
    HybridDecoderConfig,
    check_rope_type,
    check_silu,
    decoder_fields,
    listed_layer_types,
    parse_mamba,
    rope_theta,
)
from hyserve.model.layer_specs import AttentionSpec, RopeSpec, divides


def _layer_types(f: Fields) -> tuple[str, ...]:
    listed = listed_layer_types(f)
    if listed is not None:
        return listed
    n = f.req("num_hidden_layers")
    attn = f.d.get("attn_layer_indices") or []
    if not isinstance(attn, list) or not all(isinstance(i, int) and 0 <= i < n for i in attn):
        raise ValueError(
            f"attn_layer_indices: expected layer indices below num_hidden_layers ({n}), got {attn!r}"
        )
    return tuple(LAYER_ATTENTION if i in attn else LAYER_MAMBA for i in range(n))


@dataclass(frozen=True, kw_only=True)
class BambaConfig(HybridDecoderConfig):
    intermediate_size: int
    mlp_bias: bool = False

    def ffn_parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        return 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)

    def ffn_sharding_problems(self, tp_size: int, ep_size: int) -> list[str]:
        return divides("intermediate_size", self.intermediate_size, tp_size)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "") -> BambaConfig:
        f = Fields(raw)
        check_silu(f)
        check_rope_type(f)
        hidden = f.req("hidden_size")
        eps = f.get("rms_norm_eps", 1e-5, float)
        heads = f.req("num_attention_heads")
        head_dim = f.get("head_dim", hidden // heads, int)
        params = raw.get("rope_parameters")
        factor = params.get("partial_rotary_factor", 0.5) if isinstance(params, dict) else 0.5
        attention = AttentionSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=f.get("num_key_value_heads", heads, int),
            head_dim=head_dim,
            bias=bool(f.get("attention_bias", False)),
            rope=RopeSpec(theta=rope_theta(f), rotary_dim=int(head_dim * float(factor))),
        )
        cfg = cls(
            layer_types=_layer_types(f),
            **decoder_fields(f, hidden, eps, 262144),
            mamba=parse_mamba(f, hidden, eps),
            attention=attention,
            intermediate_size=f.req("intermediate_size"),
            mlp_bias=bool(f.get("mlp_bias", False)),
            name=name,
        )
        cfg.validate()
        return cfg
