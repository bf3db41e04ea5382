"""A linear layer with the op before it (plain-torch references).

At batch 1 a decode step is a chain of weight-bandwidth-bound GEMVs with small ops between them (the
Mamba gated norm before out_proj, relu^2 before the MLP's down_proj). On CUDA a single row runs as one
Triton GEMV (`triton_fused_linear.py`: relu^2 applied inside it as the activation loads; the gated norm
its own kernel before it); these references are the contracts and the CPU path: the op, then `F.linear`.

    linear(x)                     = x @ W^T + b     (every 16-bit projection: the GEMV at one row)
    gated_norm_linear(x, z)       = linear(rmsnorm_gated(x, z))
    relu2_linear(x)               = linear(relu2(x))
    linear_conv1d_update(x, ...)  = linear(x) with the decode conv1d_update on its conv channels (Mamba in_proj;
                                    one GEMV with the conv in its epilogue at one row on CUDA)

Each takes `post` (`rmsnorm.AddNorm`: the block's residual add and the next block's pre-norm); with it the
op returns `add_rms_norm(out, ...)`, the pair (normed, residual + out), instead of out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.activation import relu2_ref
from hyserve.kernels.conv1d import causal_conv1d_update_ref
from hyserve.kernels.rmsnorm import AddNorm, add_norm_ref, rmsnorm_gated_ref

Out = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def finish(out: torch.Tensor, post: AddNorm | None) -> Out:
    """An op's result: out, or with `post` the pair add_rms_norm gives."""
    return out if post is None else add_norm_ref(out, post)


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: AddNorm | None = None) -> Out:
    """x: [..., K]; weight: [N, K] -> [..., N]."""
    return finish(F.linear(x, weight, bias), post)


def gated_norm_linear_ref(
    x: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    post: AddNorm | None = None,
) -> Out:
    """x, z: [T, K]; norm_weight: [K]; weight: [N, K] -> [T, N]."""
    return finish(F.linear(rmsnorm_gated_ref(x, z, norm_weight, eps, group_size), weight, bias), post)


def relu2_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     post: AddNorm | None = None) -> Out:
    """x: [T, K]; weight: [N, K] -> [T, N]."""
    return finish(F.linear(relu2_ref(x), weight, bias), post)


def linear_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    start: int,
) -> torch.Tensor:
    """A decode step's Mamba in_proj with the conv after it: y = linear(x) [T, N]; its columns start .. start + D
    (D = conv_weight.shape[0], the conv channels [x | B | C]) are replaced by causal_conv1d_update (SiLU) of
    them, which shifts conv_pool[src] into conv_pool[dst]. Returns y."""
    y = F.linear(x, weight, bias)
    D = conv_weight.shape[0]
    y[:, start : start + D] = causal_conv1d_update_ref(y[:, start : start + D], conv_pool, conv_weight, conv_bias,
                                                       src_slots, dst_slots)
    return y
