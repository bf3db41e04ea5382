"""`HostIndex`: a step's host list of packed-sequence offsets (cu_seqlens) that keeps the device tensors the
launchers derive from it. Every Mamba2 layer of a step launches the varlen conv and the SSD scan over the same
sequences; each launcher needs the offsets (and the scan its chunk table) on the device. Built from a plain
list, each layer would copy them again; from one `HostIndex` per step (`ForwardMeta.prefill_cu`) the first
layer builds them and the others reuse them. A `HostIndex` is a list of ints, so the plain-torch references
read it as any list. `host_list` is how every launcher and reference reads its offsets and lengths (a list, a
tensor, or a `HostIndex`)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar, cast

import torch

T = TypeVar("T")


class HostIndex(list[int]):
    def __init__(self, values: Iterable[int] = ()) -> None:
        super().__init__(values)
        self._on_device: dict[tuple[Hashable, torch.device], object] = {}

    def on_device(self, key: Hashable, device: torch.device, build: Callable[[], T]) -> T:
        """What `build()` gives for `key` on `device` (a tensor, or a step's plan of several), built at the
        first call (the list must not change after: the tensors are derived from its values then)."""
        k = (key, device)
        t = self._on_device.get(k)
        if t is None:
            t = self._on_device[k] = build()
        return cast(T, t)


def host_list(values: torch.Tensor | list[int] | HostIndex) -> list[int]:
    """Offsets or lengths as a host list of ints: a `HostIndex` as it is (its device tensors stay with it), a
    list copied as ints, a tensor read to the host."""
    if isinstance(values, HostIndex):
        return values
    return [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]


def cached_on_device(
    cu: list[int] | HostIndex, key: Hashable, device: torch.device, build: Callable[[], T]
) -> T:
    """`cu.on_device(key, device, build)` for a `HostIndex`, else `build()`."""
    return cu.on_device(key, device, build) if isinstance(cu, HostIndex) else build()
