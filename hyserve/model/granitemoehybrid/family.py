"""The Granite-4.0-H family's registry entry (GraniteMoeHybridForCausalLM: Micro dense, Tiny / Small MoE)."""

from __future__ import annotations

from hyserve.model.family import Family
from hyserve.model.granitemoehybrid.config import GraniteMoeHybridConfig
from hyserve.model.granitemoehybrid.model import KERNEL_OPS, GraniteMoeHybridForCausalLM
from hyserve.model.hybrid_lm import meta_weight_bytes

GRANITE_MOE_HYBRID = Family(
    name="granitemoehybrid",
    model_types=("granitemoehybrid",),
    architectures=("GraniteMoeHybridForCausalLM",),
    config_type=GraniteMoeHybridConfig,
    model_type=GraniteMoeHybridForCausalLM,
    parse=lambda raw, name: GraniteMoeHybridConfig.from_dict(raw, name=name),
    build_model=lambda cfg, dtype: GraniteMoeHybridForCausalLM(cfg, dtype=dtype),
    weight_bytes_of=lambda cfg, dtype: meta_weight_bytes(
        GraniteMoeHybridForCausalLM(cfg, device="meta", dtype=dtype)
    ),
    kernel_ops=KERNEL_OPS,
)
