"""The device tensors behind the cache pools: paged KV blocks per attention layer and conv/SSM state
slots per Mamba layer. The bookkeeping (which block or slot belongs to whom) lives in hyserve.cache;
this file only owns the memory layout.

    k[layer], v[layer]: [num_blocks, tokens_per_block, kv_heads, head_dim]   (KV cache dtype)
    conv[layer]:        [num_slots, conv_dim, conv_kernel - 1]               (model dtype)
    ssm[layer]:         [num_slots, mamba_heads, mamba_head_dim, state_size] (SSM cache dtype)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.model.layer_specs import CacheLayout


@dataclass
class CacheTensors:
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    conv: dict[int, torch.Tensor]
    ssm: dict[int, torch.Tensor]
    tokens_per_block: int

    @classmethod
    def allocate(
        cls,
        layout: CacheLayout,
        *,
        num_blocks: int,
        tokens_per_block: int,
        num_slots: int,
        device: torch.device | str,
    ) -> CacheTensors:
        k, v, conv, ssm = {}, {}, {}, {}
        for i, a in layout.attention.items():
            shape = (num_blocks, tokens_per_block, a.num_kv_heads, a.head_dim)
            k[i] = torch.zeros(shape, dtype=a.dtype, device=device)
            v[i] = torch.zeros(shape, dtype=a.dtype, device=device)
        for i, m in layout.mamba.items():
            conv[i] = torch.zeros((num_slots, m.conv_dim, m.conv_width), dtype=m.conv_dtype, device=device)
            ssm[i] = torch.zeros(
                (num_slots, m.num_heads, m.head_dim, m.state_size), dtype=m.ssm_dtype, device=device
            )
        return cls(k=k, v=v, conv=conv, ssm=ssm, tokens_per_block=tokens_per_block)
