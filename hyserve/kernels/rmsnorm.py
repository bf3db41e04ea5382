"""RMSNorm and grouped gated RMSNorm (the Mamba2 output norm), plain-torch references.

Both compute in float32 (float64 when given float64) and cast back to the input dtype, matching
NemotronH's reference implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x.dtype. The weight multiply stays in float32."""
    cd = _compute_dtype(x)
    h = x.to(cd)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(cd) * h).to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add of one block and the next block's pre-norm: s = residual + x (in x.dtype, as the
    model's `h + mixer(...)`), out = rms_norm_ref(s). Returns (out, s)."""
    s = residual + x
    return rms_norm_ref(s, weight, eps), s


def rmsnorm_gated_ref(
    x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """Grouped gated RMSNorm: y = weight * norm_per_group(x * silu(z)).

    x, z: [..., D]; weight: [D]; the mean of squares is taken over each `group_size` slice of D
    (one group per Mamba B/C group). Gating happens before the norm ("norm_before_gate=False").
    """
    cd = _compute_dtype(x)
    h = x.to(cd)
    if z is not None:
        h = h * F.silu(z.to(cd))
    *prefix, d = h.shape
    if d % group_size:
        raise ValueError(f"rmsnorm_gated: last dim {d} is not a multiple of group_size {group_size}")
    hg = h.view(*prefix, d // group_size, group_size)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    h = hg.view(*prefix, d)
    return (weight.to(cd) * h).to(x.dtype) if x.dtype == torch.float64 else weight * h.to(x.dtype)
