"""The device tensors behind the cache pools: paged KV blocks per attention layer and conv / state slots
per recurrent layer. The bookkeeping (which block or slot belongs to whom) lives in hyserve.cache; this file
only owns the memory layout.

    k[layer], v[layer]: [num_blocks, tokens_per_block, kv_heads, head_dim]   (KV cache dtype)
    conv[layer]:        [num_slots, conv_dim, conv_width]                    (model dtype; tap-major memory)
    ssm[layer]:         [num_slots, *state_shape]                            (state cache dtype; a Mamba2
                                                                              layer's [heads, head_dim,
                                                                              state_size])
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.model.layer_specs import CacheLayout


def conv_state_pool(
    num_slots: int, conv_dim: int, width: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Zeroed conv state slots, [num_slots, conv_dim, width] (a channel's last `width` inputs along the
    last dimension) held tap-major in memory: each tap of a slot is one contiguous run of conv_dim
    elements. A decode step reads and shifts every running sequence's taps, so this way each of its loads
    and stores is a whole aligned row rather than `width` elements out of every channel."""
    return torch.zeros((num_slots, width, conv_dim), dtype=dtype, device=device).transpose(1, 2)


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
        for i, m in layout.recurrent.items():
            conv[i] = conv_state_pool(num_slots, m.conv_dim, m.conv_width, m.conv_dtype, device)
            ssm[i] = torch.zeros((num_slots, *m.state_shape), dtype=m.ssm_dtype, device=device)
        return cls(k=k, v=v, conv=conv, ssm=ssm, tokens_per_block=tokens_per_block)
