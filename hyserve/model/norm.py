"""RMSNorm module (fp32 statistics and weight multiply, as NemotronH's reference), and `apply_post`: a
block's residual add with the next norm (`AddNorm`) where the op producing the block's output could not run it."""

from __future__ import annotations

import torch
from torch import nn

from hyserve.kernels import ops
from hyserve.kernels.rmsnorm import AddNorm

Out = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


def apply_post(out: torch.Tensor, post: AddNorm | None) -> Out:
    """out, or with `post` (normed, residual + out) from the add_rms_norm op."""
    if post is None:
        return out
    return ops.get("add_rms_norm", out.is_cuda)(out, post.residual, post.weight, post.eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.get("rms_norm", x.is_cuda)(x, self.weight, self.eps)

    def post(self, residual: torch.Tensor) -> AddNorm:
        """This norm, with the residual add before it, for the op that produces the previous block's output."""
        return AddNorm(residual, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the previous block's residual add fused with this norm."""
        return ops.get("add_rms_norm", x.is_cuda)(x, residual, self.weight, self.eps)
