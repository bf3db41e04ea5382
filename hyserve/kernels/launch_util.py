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


__all__ = ["device_index"]
