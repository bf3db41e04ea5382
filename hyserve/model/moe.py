"""Nemotron 3 mixture of experts: sigmoid router with score-correction bias, grouped top-k, normalised
top-k weights times a routed scaling factor, relu^2 experts, a shared expert, and (Super) a latent
projection that runs the routed experts in a smaller dimension:

    x --gate--> top-k experts, weights w
    x --fc1_latent--> x_lat --experts(w)--> y_lat --fc2_latent--> y
    out = y + shared_expert(x)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.model.config import HybridModelConfig
from hyserve.model.mlp import MLP, relu2


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
        """x: [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        T, E = choice.shape
        if self.n_group > 1 and self.topk_group < self.n_group:
            per = E // self.n_group
            group_scores = choice.view(T, self.n_group, per).topk(2, dim=-1)[0].sum(-1)  # [T, n_group]
            keep = torch.zeros_like(group_scores).scatter_(
                1, group_scores.topk(self.topk_group, dim=-1)[1], 1.0
            )
            mask = keep[:, :, None].expand(T, self.n_group, per).reshape(T, E).bool()
            choice = choice.masked_fill(~mask, float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        w = scores.gather(1, ids)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, ids


class Experts(nn.Module):
    """Stacked expert weights: up [E, I, d], down [E, d, I]."""

    def __init__(self, num: int, dim: int, inter: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.up_proj = nn.Parameter(torch.empty(num, inter, dim, device=device, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num, dim, inter, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, d]; w, ids: [T, k]. Token-sorted dispatch: one GEMM pair per expert that got tokens."""
        T, k = ids.shape
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.up_proj.shape[0]).tolist()
        tok = order // k
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            t = tok[start : start + n]
            h = relu2(F.linear(x[t], self.up_proj[e]))
            h = F.linear(h, self.down_proj[e])
            out.index_add_(0, t, h.float() * w.reshape(-1)[sel, None])
            start += n
        return out.to(x.dtype)


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
