"""Tensor-parallel linear layers whose parameters load their own shard (docs/architecture.md, "Parallelism").

    ReplicatedLinear             every rank holds the whole weight
    ColumnParallelLinear         output features split over the tp group   (optionally gathered after)
    MergedColumnParallelLinear   output = several logical parts, each split on its own:
                                 Mamba2 in_proj [z | x | B | C | dt], attention [q | k | v]
    RowParallelLinear            input features split; the partial outputs all-reduced, bias added once

A part is `units` heads (or groups) of `unit_size` rows. With `units % tp == 0` rank r holds units
[r * units/tp, (r+1) * units/tp); with fewer units than ranks (`tp % units == 0`: 2 KV heads or 1 Mamba
group over 4 ranks) each unit is replicated and rank r holds unit r // (tp / units), the one its query
heads / Mamba heads read. Anything else is refused with the numbers.

Every parameter carries `weight_loader(param, loaded, shard_id=None)` and `checkpoint_shape` (its shape
in the checkpoint), kept across `to()` / `to_empty()` by `ShardLoading`. `loaded` is a tensor or a safetensors
slice (`safe_open(...).get_slice(name)`); the loader indexes only this rank's rows, so a slice is read from
disk shard by shard, never whole. With one rank every layer is its unsharded torch equivalent, computed the
same way (no collective, same call).

Every layer computes through `LinearBase.matmul`: the `linear` op for 16-bit weights (`F.linear`; a one-row
GEMV kernel on CUDA), the `fp8_linear` op once `model/fp8_weights.py` has given the layer an e4m3 weight and
float32 scales (loaded shard-aware too).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from hyserve.distributed import Group, all_gather, all_reduce, tp_group
from hyserve.kernels import ops


class SliceLike(Protocol):
    """What the loaders need from a safetensors PySafeSlice (a torch.Tensor is taken beside it)."""

    def __getitem__(self, index: Any) -> torch.Tensor: ...

    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...


Loader = Callable[..., None]  # (param, loaded: torch.Tensor | SliceLike, shard_id: str | None = None)


def loaded_shape(loaded: torch.Tensor | SliceLike) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_rows(loaded: torch.Tensor | SliceLike, dim: int, start: int, length: int) -> torch.Tensor:
    """loaded[..., start:start+length (on dim), ...]: only those rows are read from a safetensors slice."""
    index = (slice(None),) * dim + (slice(start, start + length),)
    out = loaded[index]
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


def read_block(loaded: torch.Tensor | SliceLike, ranges: dict[int, tuple[int, int]]) -> torch.Tensor:
    """loaded with dim d narrowed to ranges[d] = (start, length) for each given dim; one read of a slice."""
    last = max(ranges) if ranges else -1
    index = tuple(
        slice(ranges[d][0], ranges[d][0] + ranges[d][1]) if d in ranges else slice(None)
        for d in range(last + 1)
    )
    out = loaded[index] if index else (loaded if isinstance(loaded, torch.Tensor) else loaded[:])
    return out if isinstance(out, torch.Tensor) else torch.as_tensor(out)


@dataclass(frozen=True, kw_only=True)
class ShardedPart:
    """One logical part of a sharded dimension: `units` heads / groups of `unit_size` rows each."""

    name: str
    units: int
    unit_size: int = 1

    @property
    def size(self) -> int:
        return self.units * self.unit_size

    def check(self, tp: int, *, knob: str = "tp_size", replicate: bool = True) -> None:
        if self.units <= 0 or self.unit_size <= 0:
            raise ValueError(
                f"part {self.name}: needs units and unit_size >= 1, got {self.units} x {self.unit_size}"
            )
        if self.units % tp == 0 or (replicate and tp % self.units == 0):
            return
        extra = f" (or a divisor of it, replicated: {knob} % {self.units} == 0)" if replicate else ""
        raise ValueError(
            f"{self.name}: {self.units} units do not split over {knob} {tp}; need a multiple of {tp}{extra}"
        )

    def replicated(self, tp: int) -> bool:
        return self.units % tp != 0

    def local_units(self, tp: int) -> int:
        return 1 if self.replicated(tp) else self.units // tp

    def local_size(self, tp: int) -> int:
        return self.local_units(tp) * self.unit_size

    def first_unit(self, rank: int, tp: int) -> int:
        """The first unit rank `rank` holds."""
        if self.replicated(tp):
            return rank // (tp // self.units)
        return rank * (self.units // tp)

    def rows(self, rank: int, tp: int) -> tuple[int, int]:
        """(first row, row count) of this rank's shard inside the part."""
        return self.first_unit(rank, tp) * self.unit_size, self.local_size(tp)


def load_parts(
    param: torch.Tensor,
    loaded: torch.Tensor | SliceLike,
    parts: Sequence[ShardedPart],
    group: Group,
    *,
    dim: int = 0,
    shard_id: str | None = None,
    what: str = "parameter",
) -> None:
    """Copy this rank's rows of `parts` (laid out one after the other along `dim` of `loaded`) into
    `param` (the local parts one after the other). With `shard_id`, `loaded` is that one part."""
    tp, rank = group.size, group.rank
    selected = list(parts) if shard_id is None else [p for p in parts if p.name == shard_id]
    if not selected:
        raise ValueError(f"{what}: unknown shard_id {shard_id!r}; parts are {[p.name for p in parts]}")
    shape = loaded_shape(loaded)
    full = sum(p.size for p in selected)
    want = (*param.shape[:dim], full, *param.shape[dim + 1 :])
    if shape != want:
        label = f"part {shard_id!r}" if shard_id is not None else "tensor"
        raise ValueError(f"{what}: checkpoint {label} has shape {list(shape)}, expected {list(want)}")
    src_off = 0
    dst_off = 0
    for p in parts:
        n_local = p.local_size(tp)
        if p in selected:
            start, n = p.rows(rank, tp)
            param.narrow(dim, dst_off, n).copy_(read_rows(loaded, dim, src_off + start, n))
            src_off += p.size
        dst_off += n_local


def load_whole(param: torch.Tensor, loaded: torch.Tensor | SliceLike, what: str = "parameter") -> None:
    shape = loaded_shape(loaded)
    if shape != tuple(param.shape):
        raise ValueError(f"{what}: checkpoint tensor has shape {list(shape)}, expected {list(param.shape)}")
    param.copy_(loaded if isinstance(loaded, torch.Tensor) else loaded[:])


def set_loader(
    param: torch.Tensor, loader: Loader, checkpoint_shape: tuple[int, ...], by_row: bool = False
) -> None:
    """Attach the shard loader and the checkpoint shape to a parameter (weights.py reads both). by_row: the
    loader also takes one index of dim 0 alone (`loader(param, tensor[i], i)`, as an expert's matrix), so
    random init streams it row by row instead of drawing the whole checkpoint tensor first."""
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.checkpoint_shape = checkpoint_shape  # type: ignore[attr-defined]
    param.loads_by_row = by_row  # type: ignore[attr-defined]


class ShardLoading(nn.Module):
    """Base of modules whose parameters load their own shard. `register_shard(path, loader, shape)` puts
    the loader and the checkpoint shape on the parameter at `path` (relative to this module, so a child's
    parameter can be included); they are put back after every `to()` / `to_empty()` / `cuda()`, which
    replace parameter objects and would otherwise drop them."""

    def __init__(self) -> None:
        super().__init__()
        self._shards: dict[str, tuple[Loader, tuple[int, ...], bool]] = {}

    def register_shard(
        self, path: str, loader: Loader, checkpoint_shape: tuple[int, ...], by_row: bool = False
    ) -> None:
        self._shards[path] = (loader, tuple(checkpoint_shape), by_row)
        set_loader(self.get_parameter(path), loader, tuple(checkpoint_shape), by_row)

    def _attach_shards(self) -> None:
        for path, (loader, shape, by_row) in self._shards.items():
            set_loader(self.get_parameter(path), loader, shape, by_row)

    def _apply(self, fn: Any, recurse: bool = True) -> ShardLoading:  # type: ignore[override]
        out = super()._apply(fn, recurse)
        self._attach_shards()
        return out


class LinearBase(ShardLoading):
    """What every linear here shares: `matmul`, this rank's product. A 16-bit weight runs the `linear` op
    (`F.linear`, or on CUDA a GEMV kernel for a single row); a layer converted to FP8
    (`model/fp8_weights.py`: float8 e4m3 `weight`, float32 `weight_scale`, `quant` set) runs the
    `fp8_linear` op."""

    quant: Any = None  # a QuantConfig once the layer holds FP8 weights
    weight: nn.Parameter
    bias: nn.Parameter | None
    in_features: int  # this rank's
    out_features: int  # this rank's
    weight_scale: nn.Parameter  # FP8 only (model/fp8_weights.py)
    _fp8_loaders: object  # FP8 only: fp8_weights.Fp8Loaders, kept alive beside the layer

    def matmul(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """x [..., in_local] -> this rank's x @ W^T (+ bias when `bias`), no collective."""
        b = self.bias if bias else None
        if self.quant is None:
            return ops.linear.get(x.is_cuda)(x, self.weight, b)
        return ops.fp8_linear.get(x.is_cuda)(x, self.weight, self.weight_scale, b)


class ReplicatedLinear(LinearBase):
    """nn.Linear whose weight every rank holds whole."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, *, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype)) if bias else None
        for name in ("weight", "bias") if bias else ("weight",):
            self.register_shard(name, self.weight_loader, tuple(getattr(self, name).shape))

    @torch.no_grad()
    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        load_whole(param, loaded, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)


class MergedColumnParallelLinear(LinearBase):
    """Column-parallel linear over logical parts, each sharded on its own (see the module docstring).

    weight [sum of local part sizes, in]; the output's last dim holds the local parts in order (`split`).
    The whole merged tensor loads with shard_id None; a part stored on its own (q_proj) with its name.
    """

    def __init__(
        self,
        in_features: int,
        parts: Sequence[ShardedPart],
        bias: bool = False,
        *,
        group: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group = group or tp_group()
        tp = self.group.size
        names = [p.name for p in parts]
        if not parts or len(set(names)) != len(names):
            raise ValueError(f"{type(self).__name__}: need parts with distinct names, got {names}")
        for p in parts:
            p.check(tp)
        self.parts = tuple(parts)
        self.in_features = in_features
        self.local_sizes = tuple(p.local_size(tp) for p in parts)
        out_local, out_full = sum(self.local_sizes), sum(p.size for p in parts)
        self.out_features = out_local
        self.weight = nn.Parameter(torch.empty(out_local, in_features, device=device, dtype=dtype))
        self.register_shard("weight", self.weight_loader, (out_full, in_features))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, device=device, dtype=dtype))
            self.register_shard("bias", self.weight_loader, (out_full,))

    @torch.no_grad()
    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        load_parts(param, loaded, self.parts, self.group, dim=0, shard_id=shard_id, what=type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """y [..., out_local] -> this rank's part outputs, in part order."""
        return torch.split(y, list(self.local_sizes), dim=-1)


class ColumnParallelLinear(MergedColumnParallelLinear):
    """Output features split over the group in blocks of `unit_size` (a head); fewer blocks than ranks
    are replicated unless `replicate=False`; `gather_output` concatenates every rank's block after the
    GEMM so each rank sees the whole output."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        gather_output: bool = False,
        unit_size: int = 1,
        replicate: bool = True,
        group: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        if out_features % unit_size:
            raise ValueError(
                f"ColumnParallelLinear: out_features {out_features} is not a multiple of unit_size "
                f"{unit_size}"
            )
        part = ShardedPart(name="out", units=out_features // unit_size, unit_size=unit_size)
        g = group or tp_group()
        if gather_output or not replicate:
            part.check(g.size, replicate=False)
        super().__init__(in_features, [part], bias, group=g, device=device, dtype=dtype)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x)
        if self.gather_output and self.group.size > 1:
            y = all_gather(y, self.group, dim=-1)
        return y


class RowParallelLinear(LinearBase):
    """Input features split over the group (blocks of `unit_size`); each rank's partial product is summed
    by an all-reduce and the bias (held whole) added once, after it. `forward` takes this rank's input
    slice; a fused kernel can compute the partial product itself and call `reduce`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        unit_size: int = 1,
        group: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.group = group or tp_group()
        tp = self.group.size
        if in_features % unit_size:
            raise ValueError(
                f"RowParallelLinear: in_features {in_features} is not a multiple of unit_size {unit_size}"
            )
        self.part = ShardedPart(name="in", units=in_features // unit_size, unit_size=unit_size)
        self.part.check(tp, replicate=False)
        self.in_features, self.out_features = self.part.local_size(tp), out_features
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features, device=device, dtype=dtype))
        self.register_shard("weight", self.weight_loader, (out_features, in_features))
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            self.register_shard("bias", self.weight_loader, (out_features,))

    @torch.no_grad()
    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        if param.dim() == 1:  # the bias, whole on every rank
            load_whole(param, loaded, f"{type(self).__name__} bias")
        else:
            load_parts(param, loaded, [self.part], self.group, dim=1, what=type(self).__name__)

    @property
    def sharded(self) -> bool:
        return self.group.size > 1

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial products (computed without bias) and add the bias."""
        y = all_reduce(partial, self.group)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return self.matmul(x)
        return self.reduce(self.matmul(x, bias=False))
