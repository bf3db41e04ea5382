"""GQA self-attention of NemotronH over the paged KV pool. No positional encoding (the Mamba layers
carry position), so a token's K/V never depends on where its block sits."""

from __future__ import annotations

import torch
from torch import nn

from hyserve.kernels import ops
from hyserve.model.config import HybridModelConfig
from hyserve.model.forward_meta import ForwardMeta


class Attention(nn.Module):
    def __init__(self, cfg: HybridModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d
        self.scale = d**-0.5
        b = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=b, device=device, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=b, device=device, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=b, device=device, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=b, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, meta: ForwardMeta, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        cuda = x.is_cuda
        ops.get("write_kv", cuda)(k, v, k_cache, v_cache, meta.slot_mapping)
        # A pure decode step hands the kernels device tensors only (graph-capturable, no host reads);
        # other steps pass the host lists the launcher sizes its grid from.
        decode_only = meta.num_decodes == T
        o = ops.get("paged_attention", cuda)(
            q, k_cache, v_cache, meta.block_tables,
            meta.seq_lens_t if decode_only else meta.seq_lens,
            meta.cu_seqlens_t if decode_only else meta.cu_seqlens,
            self.scale,
        )
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))
