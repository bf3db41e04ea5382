"""Routed experts with SiLU-gated MLPs (Granite-4.0-H Tiny / Small): the plain-torch reference, the CPU path.
On CUDA the op runs `triton_moe.moe_experts_silu_triton` (the grouped GEMMs' gated form); experts may be
16/32-bit or e4m3 with per-expert channel scales.

    out[t] = sum_s w[t, s] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])),   e = ids[t, s]

gate_up[e] stacks [gate | up] rows ([2I, d]), as the checkpoints store them. The order of rounding is
`moe_experts_ref`'s (the same per-expert loop, `weighted_expert_sum`): each expert's GEMMs in x.dtype, the
weighted outputs summed in float32, rounded once at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.moe import _check_experts_args, dequantize_experts, weighted_expert_sum


def moe_experts_silu_ref(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, d]; gate_up: [E, 2I, d]; down: [E, d, I]; topk_w: [T, k] (float32); topk_ids: [T, k] integer
    -> [T, d] in x.dtype. FP8 experts (e4m3 weights, up_scale [E, 2I], down_scale [E, d] float32 per expert
    and output channel): each expert used is dequantised to x.dtype first, the rest the same."""
    _check_experts_args(x, gate_up, down, topk_w, topk_ids, up_scale, down_scale, gated=True)

    def expert(e: int, xt: torch.Tensor) -> torch.Tensor:
        gu, dn = gate_up[e], down[e]
        if up_scale is not None and down_scale is not None:
            gu = dequantize_experts(gu[None], up_scale[e][None], x.dtype)[0]
            dn = dequantize_experts(dn[None], down_scale[e][None], x.dtype)[0]
        gate, up = F.linear(xt, gu).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, dn)

    return weighted_expert_sum(x, topk_w, topk_ids, gate_up.shape[0], expert).to(x.dtype)
