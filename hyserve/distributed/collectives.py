"""The collectives the model and the engine call, over a `Group` from `hyserve.distributed.state`.

A group of size 1 returns its input untouched (no copy, no call into torch.distributed), so the
single-device path costs one integer compare per call site. Larger groups run synchronously on the
group's process group; its timeout (set at `init_distributed`) bounds every call. gloo raises when it
expires or when a peer's connection drops, and the caller sees `CollectiveError` naming the operation,
the group and the timeout. NCCL launches asynchronously (so the calls can sit in CUDA graphs); its
watchdog aborts the process when a collective outlives the timeout, so a supervisor sees a non-zero
exit. Never a hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from hyserve.distributed.state import Group

# torch 2.10 renamed the tensor forms (all_gather_into_tensor / reduce_scatter_tensor -> *_single)
_all_gather_single: Callable[..., Any] = (
    getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
)
_reduce_scatter_single: Callable[..., Any] = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)


class CollectiveError(RuntimeError):
    """A collective failed: a rank is gone, hung past the timeout, or the group is broken. Fatal for the
    engine (the group cannot be trusted afterwards)."""

    def __init__(self, op: str, group: Group, cause: BaseException) -> None:
        super().__init__(
            f"{op} over the {group.name} group (rank {group.rank} of {group.size}, global ranks "
            f"{list(group.ranks)}, timeout {group.timeout_s:g} s) failed: {cause}"
        )
        self.op = op
        self.group_name = group.name


def _run(op: str, group: Group, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except (RuntimeError, OSError) as e:  # gloo / NCCL / store errors are RuntimeError subclasses
        raise CollectiveError(op, group, e) from e


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum `x` over the group, in place; returns `x`."""
    if group.size == 1:
        return x
    _run("all_reduce", group, lambda: dist.all_reduce(x, group=group.pg))
    return x


def all_gather(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on each) along `dim`, in group-rank order."""
    if group.size == 1:
        return x
    src = x.contiguous()
    out = torch.empty((group.size * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    _run("all_gather", group, lambda: _all_gather_single(out, src, group=group.pg))
    d = dim % x.dim()
    if d == 0:
        return out
    # [size * n0, ...] -> [size, n0, ..., nd, ...] -> [n0, ..., size * nd, ...]
    parts = out.view(group.size, *src.shape)
    return parts.movedim(0, d).reshape(*src.shape[:d], group.size * src.shape[d], *src.shape[d + 1 :])


def reduce_scatter(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum `x` over the group and keep this rank's 1/size slice of `dim` (which the size must divide)."""
    if group.size == 1:
        return x
    d = dim % x.dim()
    n = x.shape[d]
    if n % group.size:
        raise ValueError(
            f"reduce_scatter: dim {dim} has {n} entries, not a multiple of the {group.name} group size "
            f"{group.size}"
        )
    src = x.movedim(d, 0).contiguous()  # [n, ...rest]
    out = torch.empty((n // group.size, *src.shape[1:]), dtype=x.dtype, device=x.device)
    _run("reduce_scatter", group, lambda: _reduce_scatter_single(out, src, group=group.pg))
    return out.movedim(0, d)


def all_to_all(
    x: torch.Tensor,
    group: Group,
    *,
    send_counts: Sequence[int] | None = None,
    recv_counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Exchange rows of `x` (dim 0): `send_counts[j]` consecutive rows go to group rank j, and the result
    holds `recv_counts[j]` rows from rank j, in rank order. Without counts, equal splits."""
    if group.size == 1:
        return x
    if (send_counts is None) != (recv_counts is None):
        raise ValueError("all_to_all: give both send_counts and recv_counts, or neither")
    src = x.contiguous()
    if send_counts is None:
        if src.shape[0] % group.size:
            raise ValueError(
                f"all_to_all: {src.shape[0]} rows do not split evenly over the {group.name} group of "
                f"{group.size}"
            )
        out = torch.empty_like(src)
        _run("all_to_all", group, lambda: dist.all_to_all_single(out, src, group=group.pg))
        return out
    assert recv_counts is not None
    if len(send_counts) != group.size or len(recv_counts) != group.size:
        raise ValueError(
            f"all_to_all: need {group.size} send and recv counts, got {len(send_counts)} and "
            f"{len(recv_counts)}"
        )
    if sum(send_counts) != src.shape[0]:
        raise ValueError(f"all_to_all: send_counts sum to {sum(send_counts)} but x has {src.shape[0]} rows")
    out = src.new_empty((sum(recv_counts), *src.shape[1:]))
    _run(
        "all_to_all",
        group,
        lambda: dist.all_to_all_single(out, src, list(recv_counts), list(send_counts), group=group.pg),
    )
    return out


def broadcast_object(obj: Any, group: Group, src: int = 0) -> Any:
    """Group rank `src`'s `obj` (picklable), returned on every rank; other ranks' argument is ignored.
    An object that does not pickle raises on `src`; the others then time out with CollectiveError."""
    if group.size == 1:
        return obj
    if not 0 <= src < group.size:
        raise ValueError(
            f"broadcast_object: src {src} is not a rank of the {group.name} group of {group.size}"
        )
    box = [obj if group.rank == src else None]
    _run(
        "broadcast_object",
        group,
        lambda: dist.broadcast_object_list(box, src=group.ranks[src], group=group.pg),
    )
    return box[0]


def barrier(group: Group) -> None:
    """Wait until every rank of the group gets here (bounded by the group's timeout)."""
    if group.size == 1:
        return
    _run("barrier", group, lambda: dist.barrier(group=group.pg))
