"""A linear layer with the op before it (plain-torch references).

At batch 1 a decode step is a chain of weight-bandwidth-bound GEMVs with small ops between them (the
Mamba gated norm before out_proj, relu^2 before the MLP's down_proj). On CUDA a single row runs as one
Triton GEMV (`triton_fused_linear.py`: relu^2 applied inside it as the activation loads; the gated norm
its own kernel before it); these references are the contracts and the CPU path: the op, then `F.linear`.

    linear(x)                     = x @ W^T + b     (every 16-bit projection: the GEMV at one row)
    gated_norm_linear(x, z)       = linear(rmsnorm_gated(x, z))
    relu2_linear(x)               = linear(relu2(x))
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.activation import relu2_ref
from hyserve.kernels.rmsnorm import rmsnorm_gated_ref


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] -> [..., N]."""
    return F.linear(x, weight, bias)


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
