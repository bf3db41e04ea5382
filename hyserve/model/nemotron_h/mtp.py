"""NemotronH's multi-token-prediction (MTP) block, as Nemotron 3 checkpoints ship it (`mtp.layers.{j}.*`,
`num_nextn_predict_layers: 1`, sublayers `mtp_hybrid_override_pattern`, "*E" for Super: attention, then MoE).

Given the target model's final-normed hidden state h_t at position t and the embedding of token t + 1, it
predicts token t + 2 through the model's own embedding and lm_head:

    x   = eh_proj([enorm(embed(x_{t+1})) | hnorm(h_t)])          (the embedding first; eh_proj: 2d -> d)
    for sublayer j: x = x + mixer_j(norm_j(x))                   (pre-norm residual blocks)
    out = final_layernorm(x)                                     (the next pass's h, and the logits' input)

The first sublayer holds enorm / hnorm / eh_proj, the last final_layernorm. The block runs at position t (its
attention writes its own KV there: cache layer ids after the backbone's), and is reused for every draft
token: a pass's output and its drafted token are the next pass's inputs. Its weights stay 16-bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.norm import RMSNorm
from hyserve.model.parallel_linear import ReplicatedLinear


class MTPSublayer(nn.Module):
    enorm: RMSNorm
    hnorm: RMSNorm
    eh_proj: ReplicatedLinear
    final_layernorm: RMSNorm
    norm: RMSNorm
    mixer: nn.Module

    def __init__(
        self,
        cfg: HybridModelConfig,
        j: int,
        mixer: Callable[..., nn.Module],
        *,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.layer_norm_epsilon
        self.kind = cfg.mtp_layer_types[j]
        if j == 0:
            self.enorm = RMSNorm(h, eps, device=device, dtype=dtype)
            self.hnorm = RMSNorm(h, eps, device=device, dtype=dtype)
            self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, device=device, dtype=dtype)
        self.norm = RMSNorm(h, eps, device=device, dtype=dtype)
        self.mixer = mixer(cfg, cfg.num_layers + j, device=device, dtype=dtype)
        if j == len(cfg.mtp_layer_types) - 1:
            self.final_layernorm = RMSNorm(h, eps, device=device, dtype=dtype)


class NemotronHMTP(nn.Module):
    def __init__(
        self, cfg: HybridModelConfig, mixers: dict[str, Callable[..., nn.Module]], *, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            MTPSublayer(cfg, j, mixers[kind], device=device, dtype=dtype)
            for j, kind in enumerate(cfg.mtp_layer_types)
        )

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, meta: ForwardMeta, cache: CacheTensors
    ) -> torch.Tensor:
        """embeds: [T, d] embeddings of the tokens after each position; hidden: [T, d] the target's (or the
        previous pass's) final-normed hidden states at those positions -> this pass's output [T, d]."""
        subs: list[MTPSublayer] = list(self.layers)  # type: ignore[arg-type]
        first, last = subs[0], subs[-1]
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        residual: torch.Tensor | None = None
        for sub in subs:
            y, residual = sub.norm.residual_forward(x, residual)
            x = sub.mixer(y, meta, cache)
        assert residual is not None
        return last.final_layernorm.add_forward(x, residual)[0]
