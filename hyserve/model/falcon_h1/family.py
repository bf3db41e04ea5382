"""The Falcon-H1 family's registry entry (FalconH1ForCausalLM: Falcon-H1 0.5B to 34B)."""

from __future__ import annotations

from hyserve.model.falcon_h1.config import FalconH1Config
from hyserve.model.falcon_h1.model import KERNEL_OPS, FalconH1ForCausalLM
from hyserve.model.family import Family
from hyserve.model.hybrid_lm import meta_weight_bytes

FALCON_H1 = Family(
    name="falcon_h1",
    model_types=("falcon_h1",),
    architectures=("FalconH1ForCausalLM",),
    config_type=FalconH1Config,
    model_type=FalconH1ForCausalLM,
    parse=lambda raw, name: FalconH1Config.from_dict(raw, name=name),
    build_model=lambda cfg, dtype: FalconH1ForCausalLM(cfg, dtype=dtype),
    weight_bytes_of=lambda cfg, dtype: meta_weight_bytes(
        FalconH1ForCausalLM(cfg, device="meta", dtype=dtype)
    ),
    kernel_ops=KERNEL_OPS,
)
