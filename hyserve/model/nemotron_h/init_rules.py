"""How NemotronH's parameters are drawn for random weights (`random_init.py` draws them)."""

from __future__ import annotations

import math
from typing import Protocol


class _Sizes(Protocol):
    @property
    def num_layers(self) -> int: ...

    @property
    def conv_kernel(self) -> int: ...


def init_rule(name: str, cfg: _Sizes) -> tuple[str, float]:
    """(kind, std) for a canonical name; kinds: normal, ones, zeros, A_log, dt_bias."""
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)  # NemotronH rescale_prenorm_residual
    if name.endswith("norm.weight") or name == "backbone.norm_f.weight":
        return "ones", 0.0
    if name.endswith(".A_log"):
        return "A_log", 0.0
    if name.endswith(".D"):
        return "ones", 0.0
    if name.endswith(".dt_bias"):
        return "dt_bias", 0.0
    if name.endswith("conv1d.weight"):
        return "normal", 1.0 / math.sqrt(cfg.conv_kernel)
    if name.endswith("conv1d.bias"):
        return "normal", 0.02
    if name.endswith("gate.e_score_correction_bias"):
        return "normal", 0.01  # breaks ties in grouped top-k
    if name.endswith(".bias"):
        return "zeros", 0.0
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return "normal", residual_std
    if name.endswith((".weight", "experts.up_proj")):
        return "normal", 0.02
    raise ValueError(f"init_random_weights: no init rule for parameter {name!r}")
