"""SiLU-gated MLP (SwiGLU): down(silu(gate(x)) * up(x)), in the two checkpoint layouts families use:

    GatedMLP         gate_proj [I, H], up_proj [I, H], down_proj [H, I]        (Bamba, Llama-style)
    MergedGatedMLP   input_linear [2I, H] = [gate | up], output_linear [H, I]  (Granite's shared MLP)

Tensor parallel: the gate and up columns split over the ranks (a merged weight loads each half's rows on
its own), the down projection is row-parallel and one all-reduce sums the ranks' partial outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.distributed import Group
from hyserve.model.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    ShardedPart,
)


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool = False,
        *,
        group: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"bias": bias, "group": group, "device": device, "dtype": dtype}
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, replicate=False, **kw)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, replicate=False, **kw)
        self.down_proj = RowParallelLinear(intermediate, hidden, **kw)

    def forward(self, x: torch.Tensor, meta: object = None, cache: object = None) -> torch.Tensor:
        """x: [T, hidden]. `meta` / `cache` are unused (the mixer signature; an MLP keeps no state)."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MergedGatedMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool = False,
        *,
        group: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        kw = {"group": group, "device": device, "dtype": dtype}
        parts = [ShardedPart(name="gate", units=intermediate), ShardedPart(name="up", units=intermediate)]
        self.input_linear = MergedColumnParallelLinear(hidden, parts, bias, **kw)
        self.output_linear = RowParallelLinear(intermediate, hidden, bias, **kw)

    def forward(self, x: torch.Tensor, meta: object = None, cache: object = None) -> torch.Tensor:
        """x: [T, hidden]. `meta` / `cache` are unused."""
        gate, up = self.input_linear.split(self.input_linear(x))
        return self.output_linear(F.silu(gate) * up)
