"""Softmax top-k MoE with SiLU-gated experts (Granite-4.0-H Tiny / Small; the shared expert is the family's
layer's own MLP, added by the layer):

    logits = x @ router^T (float32);  ids = top-k of logits;  w = softmax over those k logits
    out[t] = sum_s w[t, s] * expert_{ids[t, s]}(x[t])

The logits come from the `router_logits` op (NemotronH's router GEMV), the top-k and softmax are torch ops on
the device (no host sync), the experts run through the `moe_experts_silu` op (kernels/moe_silu.py). Expert
weights are stacked as the checkpoints store them: input_linear [E, 2I, d] ([gate | up] rows),
output_linear [E, d, I]. One rank holds every expert (the family's sharding rules refuse tp_size > 1).
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.kernels import ops


class StackedExperts(nn.Module):
    """One stacked weight of all experts, [E, rows, cols]."""

    def __init__(self, *shape: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


class Router(nn.Module):
    """The router's linear layer (`router.layer.weight`, [E, d], in the model's dtype)."""

    def __init__(self, hidden: int, num_experts: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden, num_experts, bias=False, device=device, dtype=dtype)


class SoftmaxTopkMoE(nn.Module):
    def __init__(
        self, hidden: int, num_experts: int, top_k: int, intermediate: int, *, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = Router(hidden, num_experts, device=device, dtype=dtype)
        self.input_linear = StackedExperts(num_experts, 2 * intermediate, hidden, device=device, dtype=dtype)
        self.output_linear = StackedExperts(num_experts, hidden, intermediate, device=device, dtype=dtype)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> (weights [T, k] float32, expert ids [T, k] int64)."""
        logits = ops.router_logits.get(x.is_cuda)(x, self.router.layer.weight)
        top, ids = logits.topk(self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> the routed experts' weighted sum [T, hidden]."""
        w, ids = self.route(x)
        experts = ops.moe_experts_silu.get(x.is_cuda)
        return experts(x, self.input_linear.weight, self.output_linear.weight, w, ids)
