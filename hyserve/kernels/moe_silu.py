"""Routed experts with SiLU-gated MLPs (Granite-4.0-H Tiny / Small): the plain-torch reference, the CPU path.
On CUDA the op runs `triton_moe.moe_experts_silu_triton` (the grouped GEMMs' gated form, 16- or 32-bit
experts).

    out[t] = sum_s w[t, s] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),   e = ids[t, s]

gate_up[e] stacks [gate | up] rows ([2I, d]), as the checkpoints store them. The order of rounding is
`moe_experts_ref`'s (the same per-expert loop, `weighted_expert_sum`): each expert's GEMMs in x.dtype, the
weighted outputs summed in float32, rounded once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.moe import _check_experts_args, weighted_expert_sum


def moe_experts_silu_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x: [T, d]; gate_up: [E, 2I, d]; down: [E, d, I]; topk_w: [T, k] (float32); topk_ids: [T, k] integer
    -> [T, d] in x.dtype."""
    _check_experts_args(x, gate_up, down, topk_w, topk_ids, gated=True)

    def expert(e: int, xt: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(xt, gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down[e])

    return weighted_expert_sum(x, topk_w, topk_ids, gate_up.shape[0], expert).to(x.dtype)
