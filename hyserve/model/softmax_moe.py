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
from hyserve.kernels.fp8_linear import quantize_weight_ref
from hyserve.model.fp8_weights import is_fp8_source
from hyserve.model.parallel_linear import ShardLoading, SliceLike, loaded_shape, read_block


class StackedExperts(ShardLoading):
    """One stacked weight of all experts, [E, rows, cols]; after `to_fp8`, e4m3 with float32 `weight_scale`
    [E, rows] (per expert and output channel), quantised from the checkpoint's 16-bit experts one expert at
    a time as they load."""

    def __init__(self, *shape: int, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))
        self.weight_scale: nn.Parameter | None = None

    def to_fp8(self) -> None:
        shape = tuple(self.weight.shape)
        dev = self.weight.device
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(shape[:2], dtype=torch.float32, device=dev), requires_grad=False
        )
        self.register_shard("weight", self._load_quantised, shape, by_row=True)

    @torch.no_grad()
    def _load_quantised(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, expert: int | None = None
    ) -> None:
        """A 16-bit checkpoint tensor (all experts, or expert `expert`'s matrix) quantised per output row."""
        if is_fp8_source(loaded):
            raise ValueError(
                "experts: the checkpoint's routed experts are e4m3; these experts take 16-bit weights "
                "and quantise them as they load"
            )
        want = tuple(param.shape) if expert is None else tuple(param.shape[1:])
        if loaded_shape(loaded) != want:
            raise ValueError(
                f"experts: checkpoint tensor has shape {list(loaded_shape(loaded))}, expected {list(want)}"
            )
        assert self.weight_scale is not None  # set by to_fp8, with this loader
        for e in range(param.shape[0]) if expert is None else [expert]:
            mat = read_block(loaded, {0: (e, 1)})[0] if expert is None else torch.as_tensor(loaded)
            q, sc = quantize_weight_ref(mat.to(device=param.device), "channel")
            param[e].copy_(q)
            self.weight_scale[e].copy_(sc)


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

    def to_fp8(self) -> None:
        """The experts' weights in e4m3 with per-expert channel scales (`quantization: fp8` on a 16-bit
        checkpoint)."""
        self.input_linear.to_fp8()
        self.output_linear.to_fp8()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> the routed experts' weighted sum [T, hidden]."""
        w, ids = self.route(x)
        experts = ops.moe_experts_silu.get(x.is_cuda)
        gate_up, down = self.input_linear, self.output_linear
        return experts(x, gate_up.weight, down.weight, w, ids, gate_up.weight_scale, down.weight_scale)
