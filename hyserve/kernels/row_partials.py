"""A [T, d] result left as float32 partial rows that its consumer sums (docs/architecture.md, "Partial sums
summed by the next norm").

The MoE decode path's split down GEMV writes one float32 row per (token, slot) and a combine kernel summed
them into the layer's output, which the next block's `add_rms_norm` then read: one launch and one round
trip more than needed. A layer whose last kernel leaves partials hands them on as `RowPartials`, and the
norm sums them as it loads (`add_rms_norm` takes either). The sum is the combine's, to the bit: in part
order, in float32, rounded once to `dtype`.
"""

from __future__ import annotations

import dataclasses

import torch


def sum_row_parts(rows: torch.Tensor, parts: int) -> torch.Tensor:
    """rows [T * parts, d] -> [T, d]: token t's rows t * parts ... t * parts + parts - 1 added one after
    another, in rows.dtype (the order the kernels add in, so the result is theirs bit for bit)."""
    r = rows.view(-1, parts, rows.shape[-1])
    acc = r[:, 0].clone()
    for p in range(1, parts):
        acc += r[:, p]
    return acc


@dataclasses.dataclass(frozen=True)
class RowPartials:
    """rows: [T * parts, d] float32 (float64 on the reference path's oracles), token t's partials at rows
    t * parts ... t * parts + parts - 1 with a unit stride along d; dtype: what their sum rounds to (the
    model's activations)."""

    rows: torch.Tensor
    parts: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.rows.dim() != 2 or self.parts < 1 or self.rows.shape[0] % self.parts:
            raise ValueError(f"RowPartials: rows [T * parts, d] expected, got {tuple(self.rows.shape)} with parts "
                             f"{self.parts}")
        if self.rows.dtype not in (torch.float32, torch.float64) or self.rows.stride(1) != 1:
            raise ValueError(f"RowPartials: float32 rows with a unit stride along d expected, got {self.rows.dtype} "
                             f"with strides {self.rows.stride()}")

    @property
    def shape(self) -> torch.Size:
        """The shape of the summed result, [T, d]."""
        return torch.Size((self.rows.shape[0] // self.parts, self.rows.shape[1]))

    @property
    def is_cuda(self) -> bool:
        return self.rows.is_cuda

    def total(self) -> torch.Tensor:
        """The summed [T, d] result in `dtype`."""
        return sum_row_parts(self.rows, self.parts).to(self.dtype)


__all__ = ["RowPartials", "sum_row_parts"]
