"""relu^2 as one Triton kernel (torch runs relu and square as two): out = max(x, 0)^2, computed in
float32 and rounded once to x.dtype, as `activation.relu2_ref` (torch squares a bf16 value in float32
and rounds once too)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.kernels.launch_util import pdl
from hyserve.kernels.triton_common import pdl_enter


@triton.jit(do_not_specialize=["n"])
def _relu2_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.maximum(tl.load(x_ptr + offs, mask=m, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + offs, (x * x).to(out_ptr.dtype.element_ty), mask=m)


def relu2_triton(x: torch.Tensor) -> torch.Tensor:
    assert x.dtype in (torch.float32, torch.float16, torch.bfloat16), "float64 runs on the reference path"
    xc = x if x.is_contiguous() else x.contiguous()
    out = torch.empty_like(xc)
    n = xc.numel()
    if n:
        BLOCK = 2048 if xc.is_cuda else 256
        _relu2_kernel[(triton.cdiv(n, BLOCK),)](xc, out, n, BLOCK=BLOCK, num_warps=4, **pdl(xc))
    return out


__all__ = ["relu2_triton"]
