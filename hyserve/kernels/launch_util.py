"""Host-side helpers shared by the Triton/Gluon launchers."""

from __future__ import annotations

import torch


def device_index(values: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """An int32 index vector on `device` without a device sync: host lists go through pinned memory and
    an asynchronous copy on the current stream (a plain `torch.tensor(list, device=cuda)` copies from
    pageable memory and waits for the stream to drain, which stalled every eager prefill layer);
    device tensors pass through (cast/contiguous as needed)."""
    if isinstance(values, torch.Tensor):
        assert values.dim() == 1 and not values.dtype.is_floating_point
        if values.device == device and values.dtype == torch.int32 and values.is_contiguous():
            return values
        return values.to(device=device, dtype=torch.int32).contiguous()
    host = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def tma_tiles_fit(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether a paged pool's key tiles can load as tensor-memory-access boxes of block_n rows (the rule the
    Triton and the Gluon prefill kernels share): every box lies in one block (block_n divides the block size),
    each pool flattens to rows of kv_heads * head_dim (a power-of-two head dim of at least 16 bytes) with
    16-byte aligned base and row stride, the row count fits the descriptor's int32 coordinates, and the
    elements are 16- or 8-bit (float32 boxes of a 128-key tile would not fit shared memory in the pipelined
    stages)."""
    NB, BS, Hkv, Dh = k_cache.shape
    if BS % block_n or Dh & (Dh - 1) or NB * BS >= 2**31 or k_cache.element_size() > 2:
        return False
    if Dh * k_cache.element_size() < 16 or block_n < 16:
        return False
    # (a power-of-two head dim of >= 16 bytes makes the row stride a multiple of 16 bytes)
    return all(c.stride() == (BS * Hkv * Dh, Hkv * Dh, Dh, 1) and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache))


__all__ = ["device_index", "tma_tiles_fit"]
