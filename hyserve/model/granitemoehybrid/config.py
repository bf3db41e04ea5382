"""`GraniteMoeHybridConfig`: a GraniteMoeHybridForCausalLM config.json (Granite-4.0-H Micro / Tiny / Small) as
hyserve needs it: Mamba2 and attention layers (`layer_types`), NoPE attention unless
`position_embedding_type` is "rope", a shared SiLU-gated MLP in every layer plus, with `num_local_experts` >
0, a softmax top-k MoE, and the µP multipliers: embeddings times `embedding_multiplier`, each residual branch
times `residual_multiplier`, attention scores times `attention_multiplier` (in place of head_dim^-0.5),
logits divided by `logits_scaling`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hyserve.model.config import LAYER_MAMBA, Fields
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
from hyserve.model.quant_config import QuantConfig, canonical_module_name


def _layer_types(f: Fields) -> tuple[str, ...]:
    """The listed layer kinds; none listed: every layer Mamba, as transformers reads it."""
    return listed_layer_types(f) or (LAYER_MAMBA,) * f.req("num_hidden_layers")


@dataclass(frozen=True, kw_only=True)
class GraniteMoeHybridConfig(HybridDecoderConfig):
    shared_intermediate_size: int
    num_local_experts: int = 0
    num_experts_per_tok: int = 0
    intermediate_size: int = 0  # each routed expert's
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    def ffn_parameters(self) -> int:
        h, e = self.hidden_size, self.num_local_experts
        return 3 * h * self.shared_intermediate_size + e * (h + 3 * h * self.intermediate_size)

    def quant_problem(self, quant: QuantConfig) -> str | None:
        """An FP8 checkpoint's routed experts must be 16-bit (excluded from its FP8 modules): its e4m3
        expert tensors are refused. `quantization: fp8` on a 16-bit checkpoint quantises the experts as they
        load, per expert and output channel (`softmax_moe.StackedExperts.to_fp8`)."""
        if not (self.num_local_experts and quant.from_checkpoint):
            return None
        names = (
            canonical_module_name(f"model.layers.{i}.block_sparse_moe.{w}")
            for i in range(self.num_layers)
            for w in ("input_linear", "output_linear")
        )
        if any(quant.quantizes(n) for n in names):
            return (
                "the checkpoint's routed experts are FP8, and Granite-4.0-H's routed experts load from "
                "16-bit tensors only; serve the 16-bit checkpoint with quantization: fp8 (every projection "
                "and expert quantised as it loads)"
            )
        return None

    def ffn_sharding_problems(self, tp_size: int, ep_size: int) -> list[str]:
        out = divides("shared_intermediate_size", self.shared_intermediate_size, tp_size)
        if self.num_local_experts:
            out += divides("num_local_experts", self.num_local_experts, ep_size, "ep_size")
            moe_tp = max(tp_size // ep_size, 1)
            out += divides("intermediate_size", self.intermediate_size, moe_tp, "tp_size / ep_size")
        return out

    def describe(self) -> str:
        moe = (
            f", {self.num_local_experts} experts top-{self.num_experts_per_tok}"
            if self.num_local_experts
            else ""
        )
        return super().describe() + moe

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "") -> GraniteMoeHybridConfig:
        f = Fields(raw)
        check_silu(f)
        hidden = f.req("hidden_size")
        eps = f.get("rms_norm_eps", 1e-6, float)
        heads = f.req("num_attention_heads")
        head_dim = f.get("head_dim", hidden // heads, int)
        pos = raw.get("position_embedding_type")
        if pos not in (None, "nope", "rope"):
            raise ValueError(f"position_embedding_type: expected 'nope' or 'rope', got {pos!r}")
        rope = None
        if pos == "rope":
            check_rope_type(f)
            rope = RopeSpec(theta=rope_theta(f), rotary_dim=head_dim)
        attention = AttentionSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=f.get("num_key_value_heads", heads, int),
            head_dim=head_dim,
            bias=bool(f.get("attention_bias", False)),
            scale=f.get("attention_multiplier", 1.0, float),
            rope=rope,
        )
        experts = f.get("num_local_experts", 8, int)  # transformers' defaults when the keys are absent
        cfg = cls(
            layer_types=_layer_types(f),
            **decoder_fields(f, hidden, eps, 2048),
            mamba=parse_mamba(f, hidden, eps),
            attention=attention,
            shared_intermediate_size=f.req("shared_intermediate_size"),
            num_local_experts=experts,
            num_experts_per_tok=f.get("num_experts_per_tok", 2, int) if experts else 0,
            intermediate_size=f.req("intermediate_size") if experts else 0,
            embedding_multiplier=f.get("embedding_multiplier", 1.0, float),
            residual_multiplier=f.get("residual_multiplier", 1.0, float),
            logits_scaling=f.get("logits_scaling", 1.0, float),
            name=name,
        )
        cfg.validate()
        if experts and not 0 < cfg.num_experts_per_tok <= experts:
            raise ValueError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be in [1, {experts}]")
        return cfg
