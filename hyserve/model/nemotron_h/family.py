"""The NemotronH family's registry entry (Nemotron-H, Nemotron Nano 9B/12B v2, Nemotron 3)."""

from __future__ import annotations

from hyserve.model.family import Family
from hyserve.model.nemotron_h.checkpoint import weight_bytes
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import KERNEL_OPS, NemotronHForCausalLM

NEMOTRON_H = Family(
    name="nemotron_h",
    model_types=("nemotron_h",),
    architectures=("NemotronHForCausalLM",),
    config_type=HybridModelConfig,
    model_type=NemotronHForCausalLM,
    parse=lambda raw, name: HybridModelConfig.from_dict(raw, name=name),
    build_model=lambda cfg, dtype: NemotronHForCausalLM(cfg, dtype=dtype),
    weight_bytes_of=lambda cfg, dtype: weight_bytes(cfg, dtype),
    kernel_ops=KERNEL_OPS,
)
