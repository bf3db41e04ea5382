"""Dense relu^2 MLP of NemotronH: down(relu(up(x))^2). No gate projection.

relu^2 runs fused into down_proj (`relu2_linear`): the MLP is two kernels at batch 1 on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from hyserve.kernels import ops


def relu2(x: torch.Tensor) -> torch.Tensor:
    """square(relu(x)); one fused kernel on CUDA."""
    return ops.get("relu2", x.is_cuda)(x)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, *, device=None, dtype=None) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias, device=device, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: object = None, cache: object = None) -> torch.Tensor:
        """x: [T, hidden]. `meta` / `cache` are unused (the mixer signature; an MLP keeps no state)."""
        u = self.up_proj(x)
        return ops.get("relu2_linear", u.is_cuda)(u, self.down_proj.weight, self.down_proj.bias)
