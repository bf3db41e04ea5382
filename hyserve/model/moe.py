"""Nemotron 3 mixture of experts: sigmoid router with score-correction bias, grouped top-k, normalised
top-k weights times a routed scaling factor, relu^2 experts, a shared expert, and (Super) a latent
projection that runs the routed experts in a smaller dimension:

    x --gate--> top-k experts, weights w
    x --fc1_latent--> x_lat --experts(w)--> y_lat --fc2_latent--> y
    out = y + shared_expert(x)

Routing, the token sort and the expert GEMMs run on the device through the `moe_route` / `moe_experts`
ops (kernels/moe.py, kernels/triton_moe.py): no host sync, so a decode step can replay from a CUDA graph.
The latent projections are plain linears. The shared expert runs inside the experts op (one more
expert of weight 1 for every token: at batch 1 its weights stream in the same two GEMV launches as the
routed experts') where its intermediate size is a multiple of the experts' and one rank holds it whole;
otherwise (latent MoE: it reads x, not the latent; tensor parallel; biases; FP8 weights) it is the MLP,
added after. With FP8 weights (model/fp8_weights.py) the experts, the latent projections and the shared
expert's MLP are FP8.

Expert / tensor parallel (docs/architecture.md, "Parallelism"): every rank routes every token (same
router, same input); a rank holds n_routed_experts / ep_size experts, each with its slice of the
intermediate dimension (tp_size / ep_size ranks share an expert), and the shared expert is tensor-parallel.
Each rank's partial output (routed + shared, through fc2_latent by linearity) is summed by one all-reduce.
Another rank's (token, slot) pairs run with weight 0 on a clamped local id, so shapes stay fixed; they
cost compute on those local experts (a skip in the align kernel would save it).
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.distributed import Group, all_reduce, ep_group, moe_tp_group, tp_group
from hyserve.kernels import ops
from hyserve.model.expert_shard import ExpertShard
from hyserve.model.layer_specs import MoESpec
from hyserve.model.mlp import MLP
from hyserve.model.parallel_linear import ReplicatedLinear, ShardLoading, SliceLike, loaded_shape, read_block


class TopkRouter(nn.Module):
    """Router weights stay float32 (as the checkpoints store them): routing decisions are sensitive."""

    def __init__(self, spec: MoESpec, *, device=None) -> None:
        super().__init__()
        e = spec.num_experts
        self.weight = nn.Parameter(torch.zeros(e, spec.hidden_size, device=device, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, device=device, dtype=torch.float32))
        self.top_k = spec.top_k
        self.n_group = spec.n_group
        self.topk_group = spec.topk_group
        self.norm_topk_prob = spec.norm_topk_prob
        self.scale = spec.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] float32, expert ids [T, k] int32), on the device (no host sync)."""
        logits = ops.router_logits.get(x.is_cuda)(x, self.weight)  # [T, E] float32
        return ops.moe_route.get(x.is_cuda)(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.scale,
        )


class Experts(ShardLoading):
    """Stacked expert weights: up [E, I, d], down [E, d, I]; under expert parallelism this rank's
    E / ep_size experts, each with its I / (tp_size / ep_size) slice of the intermediate dimension."""

    quant: object = None  # a QuantConfig once the experts hold FP8 weights (model/fp8_weights.py)
    up_proj_scale: nn.Parameter  # FP8 only: per expert and channel, float32 [E_local, I_local]
    down_proj_scale: nn.Parameter  # FP8 only: float32 [E_local, d]

    def __init__(
        self,
        num: int,
        dim: int,
        inter: int,
        *,
        ep: Group | None = None,
        moe_tp: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        ep, moe_tp = ep or ep_group(), moe_tp or moe_tp_group()
        self.shard = sh = ExpertShard.of(
            num, inter, ep, moe_tp, ("n_routed_experts", "moe_intermediate_size")
        )
        self.up_proj = nn.Parameter(
            torch.empty(sh.num_local, sh.inter_local, dim, device=device, dtype=dtype)
        )
        self.down_proj = nn.Parameter(
            torch.empty(sh.num_local, dim, sh.inter_local, device=device, dtype=dtype)
        )
        self.register_shard("up_proj", self._load_up, (num, inter, dim), by_row=True)
        self.register_shard("down_proj", self._load_down, (num, dim, inter), by_row=True)

    @torch.no_grad()
    def _load_up(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: int | None = None
    ) -> None:
        self._load(param, loaded, shard_id, inter_dim=0)

    @torch.no_grad()
    def _load_down(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: int | None = None
    ) -> None:
        self._load(param, loaded, shard_id, inter_dim=1)

    def _load(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, expert: int | None, inter_dim: int
    ) -> None:
        """`loaded`: all experts stacked (expert None) or expert `expert`'s matrix; copies this rank's
        experts and intermediate rows / columns only (another rank's expert is not read at all)."""
        full = param.checkpoint_shape  # type: ignore[attr-defined]
        want = full if expert is None else full[1:]
        if loaded_shape(loaded) != tuple(want):
            raise ValueError(
                f"experts: checkpoint tensor has shape {list(loaded_shape(loaded))}, expected {list(want)}"
            )
        sh = self.shard
        rows = (sh.inter_start, sh.inter_local)
        if expert is None:  # stacked: this rank's experts in one read
            param.copy_(read_block(loaded, {0: (sh.first_expert, sh.num_local), 1 + inter_dim: rows}))
            return
        for _, i in sh.local(expert):  # another rank's expert is not read at all
            param[i].copy_(read_block(loaded, {inter_dim: rows}))

    def forward(
        self,
        x: torch.Tensor,
        w: torch.Tensor,
        ids: torch.Tensor,
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: [T, d]; w, ids: [T, k] -> [T, d]. On CUDA the fused kernels (sort, grouped GEMMs, combine
        on the device; `kernels/triton_moe.py`); on the CPU the per-expert reference loop. Sharded: this
        rank's partial sum (its experts, its intermediate slice); the MoE layer all-reduces it. `shared`:
        the shared expert's (up, down) weights, summed in with weight 1 (unsharded experts only)."""
        w, ids = self.shard.to_local(w, ids)
        fn = ops.moe_experts.get(x.is_cuda)
        if self.quant is not None:  # FP8 experts (model/fp8_weights.py): e4m3 with per-expert channel scales
            assert shared is None, "FP8 experts run the shared expert as its MLP"
            return fn(
                x,
                self.up_proj,
                self.down_proj,
                w,
                ids,
                up_scale=self.up_proj_scale,
                down_scale=self.down_proj_scale,
            )
        su, sd = shared if shared is not None else (None, None)
        return fn(x, self.up_proj, self.down_proj, w, ids, su, sd)


class MoE(nn.Module):
    def __init__(self, spec: MoESpec, *, device=None, dtype=None) -> None:
        super().__init__()
        h = spec.hidden_size
        d = spec.latent_size or h
        self.gate = TopkRouter(spec, device=device)
        self.experts = Experts(spec.num_experts, d, spec.intermediate_size, device=device, dtype=dtype)
        self.tp = tp_group()
        self.shared_experts = MLP(h, spec.shared_intermediate_size, spec.bias, device=device, dtype=dtype)
        self.latent = spec.latent_size is not None
        # the shared expert inside the experts op: it reads what they read (not latent), one rank holds
        # everything (no partial sums), no biases, and its intermediate size is a whole number of experts'
        self.fold_shared = (
            spec.shared_intermediate_size > 0
            and not self.latent
            and self.tp.size == 1
            and not spec.bias
            and self.experts.shard.whole
            and spec.shared_intermediate_size % self.experts.shard.inter_local == 0
        )
        if self.latent:
            self.fc1_latent_proj = ReplicatedLinear(h, d, bias=spec.bias, device=device, dtype=dtype)
            self.fc2_latent_proj = ReplicatedLinear(d, h, bias=spec.bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: object = None, cache: object = None) -> torch.Tensor:
        """x: [T, hidden]. `meta` / `cache` are unused (the mixer signature; MoE keeps no state)."""
        w, ids = self.gate(x)
        s = self.shared_experts
        # FP8 weights (experts or the shared MLP, converted after __init__) keep the shared expert as the MLP
        if (
            self.fold_shared
            and self.experts.quant is None
            and s.up_proj.quant is None
            and s.down_proj.quant is None
        ):
            return self.experts(x, w, ids, (s.up_proj.weight, s.down_proj.weight))
        r = self.fc1_latent_proj(x) if self.latent else x
        r = self.experts(r, w, ids)
        if self.tp.size > 1:
            return self._reduce_partials(r, x)
        if self.latent:
            r = self.fc2_latent_proj(r)
        return r + self.shared_experts(x)

    def _reduce_partials(self, r: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Tensor / expert parallel: r is this rank's partial routed output (its experts' share) and the
        shared expert's is partial too; fc2_latent is linear, so it maps the partial sum and one
        all-reduce over the tp group sums everything; the biases are added once, after it."""
        out = self.shared_experts.partial(x)
        if self.latent:
            out = out + self.fc2_latent_proj.matmul(r, bias=False)
        else:
            out = out + r
        out = all_reduce(out, self.tp)
        for b in (self.shared_experts.down_proj.bias, self.fc2_latent_proj.bias if self.latent else None):
            if b is not None:
                out = out + b
        return out
