"""Nemotron 3 mixture of experts: sigmoid router with score-correction bias, grouped top-k, normalised
top-k weights times a routed scaling factor, relu^2 experts, a shared expert, and (Super) a latent
projection that runs the routed experts in a smaller dimension:

    x --gate--> top-k experts, weights w
    x --fc1_latent--> x_lat --experts(w)--> y_lat --fc2_latent--> y
    out = y + shared_expert(x)

Routing, the token sort and the expert GEMMs run on the device through the `moe_route` / `moe_experts`
ops (kernels/moe.py, kernels/triton_moe.py): no host sync, so a decode step can replay from a CUDA graph.
The latent projections and the shared expert are plain linears (the MLP's relu^2 GEMV path).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.kernels import ops
from hyserve.model.config import HybridModelConfig
from hyserve.model.mlp import MLP


class TopkRouter(nn.Module):
    """Router weights stay float32 (as the checkpoints store them): routing decisions are sensitive."""

    def __init__(self, cfg: HybridModelConfig, *, device=None) -> None:
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, cfg.hidden_size, device=device, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(e, device=device, dtype=torch.float32))
        self.top_k = cfg.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scale = cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights [T, k] float32, expert ids [T, k] int32), on the device (no host sync)."""
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return ops.get("moe_route", x.is_cuda)(
            logits, self.e_score_correction_bias, self.top_k, self.n_group, self.topk_group,
            self.norm_topk_prob, self.scale,
        )


class Experts(nn.Module):
    """Stacked expert weights: up [E, I, d], down [E, d, I]."""

    def __init__(self, num: int, dim: int, inter: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num, inter, dim, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num, dim, inter, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, d]; w, ids: [T, k] -> [T, d]. On CUDA the fused kernels (sort, grouped GEMMs, combine
        on the device; `kernels/triton_moe.py`); on the CPU the per-expert reference loop."""
        return ops.get("moe_experts", x.is_cuda)(x, self.up_proj, self.down_proj, w, ids)


class MoE(nn.Module):
    def __init__(self, cfg: HybridModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        h = cfg.hidden_size
        d = cfg.moe_latent_size or h
        self.gate = TopkRouter(cfg, device=device)
        self.experts = Experts(cfg.n_routed_experts, d, cfg.moe_intermediate_size, device=device, dtype=dtype)
        self.shared_experts = MLP(
            h, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias, device=device, dtype=dtype
        )
        self.latent = cfg.moe_latent_size is not None
        if self.latent:
            self.fc1_latent_proj = nn.Linear(h, d, bias=cfg.mlp_bias, device=device, dtype=dtype)
            self.fc2_latent_proj = nn.Linear(d, h, bias=cfg.mlp_bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, meta: object = None, cache: object = None) -> torch.Tensor:
        """x: [T, hidden]. `meta` / `cache` are unused (the mixer signature; MoE keeps no state)."""
        w, ids = self.gate(x)
        r = self.fc1_latent_proj(x) if self.latent else x
        r = self.experts(r, w, ids)
        if self.latent:
            r = self.fc2_latent_proj(r)
        return r + self.shared_experts(x)
