"""The Bamba family's registry entry (BambaForCausalLM: Bamba-9B)."""

from __future__ import annotations

from hyserve.model.bamba.config import BambaConfig
from hyserve.model.bamba.model import KERNEL_OPS, BambaForCausalLM
from hyserve.model.family import Family
from hyserve.model.hybrid_lm import meta_weight_bytes

BAMBA = Family(
    name="bamba",
    model_types=("bamba",),
    architectures=("BambaForCausalLM",),
    config_type=BambaConfig,
    model_type=BambaForCausalLM,
    parse=lambda raw, name: BambaConfig.from_dict(raw, name=name),
    build_model=lambda cfg, dtype: BambaForCausalLM(cfg, dtype=dtype),
    weight_bytes_of=lambda cfg, dtype: meta_weight_bytes(BambaForCausalLM(cfg, device="meta", dtype=dtype)),
    kernel_ops=KERNEL_OPS,
)
