"""Small host tensors a step sends to the device: built from Python ints through `array` (a C-level
conversion, 2-3x faster than `torch.tensor` on the thousands of ints of a large decode step's block tables),
and copied without waiting for the device."""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import torch

_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D host tensor of `values` (ints or bools) as `dtype` (torch.int64 or torch.int32)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_ARRAY_CODES[dtype], values), dtype=dtype)


def concat_ints(parts: Iterable[list[int] | list[bool]], align: int = 1) -> torch.Tensor:
    """One int64 host tensor of `parts` (lists of ints or bools) end to end, each zero-padded to a multiple
    of `align` elements: the lists joined first (a list's extend by a list copies pointers; an array's
    extend converts int by int, 2-3x slower), then converted once."""
    flat: list[int] = []
    for p in parts:
        flat += p
        if len(p) % align:
            flat += [0] * (align - len(p) % align)
    return int_tensor(flat)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor -> `device` without waiting for the device (pinned + non-blocking on CUDA):
    a plain copy from pageable memory would wait for every step already queued (async scheduling
    launches the next step before the sampler's copies)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
