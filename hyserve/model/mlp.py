"""Dense relu^2 MLP of NemotronH: down(relu(up(x))^2). No gate projection.

relu^2 runs fused into down_proj (`relu2_linear`): the MLP is two kernels at batch 1 on CUDA. Under
tensor parallelism up_proj is column-parallel and down_proj row-parallel: each rank computes its
columns' partial output, and one all-reduce sums them."""

from __future__ import annotations

import torch
from torch import nn

from hyserve.distributed import Group
from hyserve.kernels import ops
from hyserve.model.parallel_linear import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        *,
        group: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"bias": bias, "group": group, "device": device, "dtype": dtype}
        self.up_proj = ColumnParallelLinear(hidden, intermediate, replicate=False, **kw)
        self.down_proj = RowParallelLinear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor, meta: object = None, cache: object = None) -> torch.Tensor:
        """x: [T, hidden]. `meta` / `cache` are unused (the mixer signature; an MLP keeps no state)."""
        down = self.down_proj
        if not down.sharded:
            return self._down(self.up_proj(x), bias=True)
        return down.reduce(self.partial(x))

    def _down(self, u: torch.Tensor, bias: bool) -> torch.Tensor:
        down = self.down_proj
        if down.quant is not None:  # FP8 down_proj: relu^2 inside the FP8 linear's activation load
            return ops.fp8_relu2_linear.get(u.is_cuda)(
                u, down.weight, down.weight_scale, down.bias if bias else None
            )
        return ops.relu2_linear.get(u.is_cuda)(u, down.weight, down.bias if bias else None)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output, before the all-reduce and without down_proj's bias (the MoE
        layer sums it with its routed experts' share in one all-reduce)."""
        return self._down(self.up_proj(x), bias=False)
