"""Softmax top-k MoE with SiLU-gated experts (Granite-4.0-H Tiny / Small; the shared expert is the family's
layer's own MLP, added by the layer):

    logits = x @ router^T (float32);  ids = top-k of logits;  w = softmax over those k logits
    out[t] = sum_s w[t, s] * expert_{ids[t, s]}(x[t])

The logits come from the `router_logits` op (NemotronH's router GEMV), the top-k and softmax are torch ops on
the device (no host sync), the experts run through the `moe_experts_silu` op (kernels/moe_silu.py). Expert
weights are stacked as the checkpoints store them: input_linear [E, 2I, d] ([gate | up] rows),
output_linear [E, d, I].

Several ranks split the experts as NemotronH's do (`expert_shard.py`: the gate_up rows of an expert's slice
are the matching gate and up rows, the down slice its columns); the layer all-reduces the ranks' partial
sums over the tensor-parallel group.
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.distributed import Group, all_reduce, ep_group, moe_tp_group, tp_group
from hyserve.kernels import ops
from hyserve.kernels.fp8_linear import quantize_weight_ref
from hyserve.model.expert_shard import ExpertShard
from hyserve.model.fp8_weights import is_fp8_source
from hyserve.model.parallel_linear import ShardLoading, SliceLike, loaded_shape, read_block


class StackedExperts(ShardLoading):
    """This rank's experts of one stacked weight: `gate_up` [E_local, 2 I_local, d] (each expert's rows of
    the gate half, then the same rows of the up half) or `down` [E_local, d, I_local]. After `to_fp8`, e4m3
    with float32 `weight_scale` [E_local, rows] per expert and output channel, quantised from each expert's
    whole 16-bit matrix as it loads (so the scales are the same at every tp_size)."""

    def __init__(
        self,
        kind: str,
        num: int,
        hidden: int,
        inter: int,
        *,
        ep: Group,
        moe_tp: Group,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.kind, self.inter = kind, inter
        self.shard = sh = ExpertShard.of(num, inter, ep, moe_tp, ("num_local_experts", "intermediate_size"))
        full = (num, 2 * inter, hidden) if kind == "gate_up" else (num, hidden, inter)
        local = (
            (sh.num_local, 2 * sh.inter_local, hidden)
            if kind == "gate_up"
            else (sh.num_local, hidden, sh.inter_local)
        )
        self.weight = nn.Parameter(torch.empty(local, device=device, dtype=dtype))
        self.weight_scale: nn.Parameter | None = None
        self.register_shard("weight", self._load, full, by_row=True)

    def _slice(self, mat: torch.Tensor) -> torch.Tensor:
        """One expert's whole matrix -> this rank's rows (gate_up) or columns (down)."""
        a, n = self.shard.inter_start, self.shard.inter_local
        if self.kind == "gate_up":
            return torch.cat([mat[a : a + n], mat[self.inter + a : self.inter + a + n]])
        return mat[:, a : a + n]

    @torch.no_grad()
    def _load(self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, expert: int | None = None) -> None:
        """All experts stacked (expert None) or expert `expert`'s matrix: this rank's experts and slice of
        them, quantised per output row from the whole matrix when the weight is e4m3."""
        full = param.checkpoint_shape  # type: ignore[attr-defined]
        want = tuple(full) if expert is None else tuple(full[1:])
        if loaded_shape(loaded) != want:
            raise ValueError(
                f"experts: checkpoint tensor has shape {list(loaded_shape(loaded))}, expected {list(want)}"
            )
        fp8 = self.weight_scale is not None
        if fp8 and is_fp8_source(loaded):
            raise ValueError(
                "experts: the checkpoint's routed experts are e4m3; these experts take 16-bit weights "
                "and quantise them as they load"
            )
        for e, i in self.shard.local(expert):
            mat = read_block(loaded, {0: (e, 1)})[0] if expert is None else torch.as_tensor(loaded)
            mat = mat.to(device=param.device)
            if not fp8:
                param[i].copy_(self._slice(mat))
                continue
            assert self.weight_scale is not None
            q, sc = quantize_weight_ref(mat, "channel")
            param[i].copy_(self._slice(q.view(torch.uint8)).view(torch.float8_e4m3fn))
            self.weight_scale[i].copy_(self._slice(sc[:, None])[:, 0] if self.kind == "gate_up" else sc)

    def to_fp8(self) -> None:
        shape, dev = tuple(self.weight.shape), self.weight.device
        self.weight = nn.Parameter(
            torch.empty(shape, dtype=torch.float8_e4m3fn, device=dev), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.ones(shape[:2], dtype=torch.float32, device=dev), requires_grad=False
        )
        self._attach_shards()  # the loader onto the new parameter


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
        kw = {"ep": ep_group(), "moe_tp": moe_tp_group(), "device": device, "dtype": dtype}
        self.input_linear = StackedExperts("gate_up", num_experts, hidden, intermediate, **kw)
        self.output_linear = StackedExperts("down", num_experts, hidden, intermediate, **kw)
        self.tp = tp_group()

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
        gate_up, down = self.input_linear, self.output_linear
        w, ids = gate_up.shard.to_local(w, ids)
        experts = ops.moe_experts_silu.get(x.is_cuda)
        out = experts(x, gate_up.weight, down.weight, w, ids, gate_up.weight_scale, down.weight_scale)
        return all_reduce(out, self.tp) if self.tp.size > 1 else out
