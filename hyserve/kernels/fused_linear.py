"""A linear layer with the elementwise/norm op before it fused in (plain-torch references).

At batch 1 a decode step is a chain of weight-bandwidth-bound GEMVs with a small op between each pair
(the Mamba gated norm before out_proj, relu^2 before the MLP's down_proj, a block's residual add + RMSNorm
before its first projection). On CUDA these run as one kernel (`triton_fused_linear.py`) for small row
counts; these references are the contracts and the CPU path: the op, then `F.linear`.

    gated_norm_linear(x, z)       = linear(rmsnorm_gated(x, z))
    relu2_linear(x)               = linear(relu2(x))
    add_rms_norm_linear(x, r)     = (linear(rms_norm(r + x)), r + x)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.activation import relu2_ref
from hyserve.kernels.rmsnorm import add_rms_norm_ref, rmsnorm_gated_ref


def gated_norm_linear_ref(
    x: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x, z: [T, K]; norm_weight: [K]; weight: [N, K] -> [T, N]."""
    return F.linear(rmsnorm_gated_ref(x, z, norm_weight, eps, group_size), weight, bias)


def relu2_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, K]; weight: [N, K] -> [T, N]."""
    return F.linear(relu2_ref(x), weight, bias)


def add_rms_norm_linear_ref(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, K] -> (linear(rms_norm(residual + x)) [T, N], residual + x [T, K])."""
    normed, total = add_rms_norm_ref(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), total
