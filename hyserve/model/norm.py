"""RMSNorm module (fp32 statistics and weight multiply, as NemotronH's reference)."""

from __future__ import annotations

import torch
from torch import nn

from hyserve.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm.get(x.is_cuda)(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): the previous block's residual add fused with this norm."""
        return ops.add_rms_norm.get(x.is_cuda)(x, residual, self.weight, self.eps)

    def residual_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's first norm: (norm(residual + x), residual + x), or (norm(x), x) for the first layer,
        whose input is the embeddings (residual None)."""
        if residual is None:
            return self(x), x
        return self.add_forward(x, residual)
