"""Small host tensors a step sends to the device: built from Python ints through `array` (a C-level
conversion, 2-3x faster than `torch.tensor` on the thousands of ints of a large decode step's block tables),
and copied without waiting for the device."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

_ARRAY_CODES = {torch.int64: "q", torch.int32: "i"}


def int_tensor(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A 1-D host tensor of `values` (ints or bools) as `dtype` (torch.int64 or torch.int32)."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array(_ARRAY_CODES[dtype], values), dtype=dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor -> `device` without waiting for the device (pinned + non-blocking on CUDA):
    a plain copy from pageable memory would wait for every step already queued (async scheduling
    launches the next step before the sampler's copies)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def parts_to_device(
    parts: Sequence[tuple[list[int] | list[bool], torch.dtype]], device: torch.device
) -> list[torch.Tensor]:
    """Several small int (or bool) lists -> `device` as tensors of their dtypes, in one pinned copy: one
    int64 buffer (a copy per array costs the host a pinned staging buffer each), split and cast there.
    Each part starts 16 bytes into the buffer: Triton specialises a kernel on whether its pointers are
    16-byte aligned, so a view at an odd int64 offset would be another variant to compile (and warm up).
    The lists are joined before the one conversion (a list's extend by a list copies pointers; an array's
    extend converts int by int, 2-3x slower)."""
    flat: list[int] = []
    for values, _ in parts:
        flat += values
        flat += [0] * (len(values) % 2)
    sizes = [len(values) for values, _ in parts]
    views = to_device(int_tensor(flat), device).split([n + n % 2 for n in sizes])
    return [v[:n].to(dtype) for v, n, (_, dtype) in zip(views, sizes, parts)]
