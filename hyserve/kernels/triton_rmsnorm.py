"""RMSNorm and grouped gated RMSNorm as Triton kernels.

Same contracts (and roundings) as `rmsnorm.rms_norm_ref` and `rmsnorm.rmsnorm_gated_ref`:

    rms_norm:       out = (w * x * rsqrt(mean(x^2) + eps)) in x.dtype          (one rounding)
    add_rms_norm:   s = (residual + x) in x.dtype (stored: the next residual); out = rms_norm(s)
                    (one kernel for a block's residual add and the next block's pre-norm)
    rmsnorm_gated:  h = x * silu(z); per group of `group_size` channels
                    out = w * (h * rsqrt(mean(h^2) + eps)).to(x.dtype)        (as the reference: the
                    normalised value is rounded to x.dtype before the weight multiply; out dtype is
                    promote(w.dtype, x.dtype))

One program per (row, group); the whole group sits in registers (group_size <= 16k).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.kernels.launch_util import pdl
from hyserve.kernels.triton_common import pdl_enter


@triton.jit(do_not_specialize=["rows"])
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    rows,
    dim,
    eps,
    s_x_r,
    s_out_r,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < dim
    x = tl.load(x_ptr + r * s_x_r + offs, mask=m, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * s_out_r + offs, (w * (x * rstd)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["rows"])
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    rows,
    dim,
    eps,
    s_x_r,
    s_res_r,
    s_out_r,
    s_sum_r,
    BLOCK: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < dim
    # before the PDL wait: the weight, and with EARLY the residual (a block's stream, written by the
    # add_rms_norm a whole mixer back, never by the kernel just before: see add_rms_norm_triton)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if EARLY:
        res = tl.load(res_ptr + r * s_res_r + offs, mask=m, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    if not EARLY:
        res = tl.load(res_ptr + r * s_res_r + offs, mask=m, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + r * s_x_r + offs, mask=m, other=0.0).to(tl.float32)
    s = (x + res).to(sum_ptr.dtype.element_ty)  # rounded like torch's residual + x
    tl.store(sum_ptr + r * s_sum_r + offs, s, mask=m)
    h = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / dim + eps)
    tl.store(out_ptr + r * s_out_r + offs, (w * (h * rstd)).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["rows"])
def _rmsnorm_gated_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    rows,
    eps,
    s_x_r,
    s_z_r,
    s_out_r,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_Z: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, BLOCK)
    m = tl.arange(0, BLOCK) < GROUP
    # before the PDL wait: the weight, and with EARLY the gate (the Mamba mixer's z, an in_proj output that
    # the conv and SSM kernels stand between: see rmsnorm_gated_triton)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_Z and EARLY:
        z = tl.load(z_ptr + r * s_z_r + offs, mask=m, other=0.0).to(tl.float32)
    pdl_enter(PDL)
    if HAS_Z and not EARLY:
        z = tl.load(z_ptr + r * s_z_r + offs, mask=m, other=0.0).to(tl.float32)
    h = tl.load(x_ptr + r * s_x_r + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_Z:
        h = h * (z / (1.0 + tl.exp(-z)))
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / GROUP + eps)
    # Round to the input dtype first, exactly like the reference's `weight * h.to(x.dtype)`.
    hn = (h * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + r * s_out_r + offs, (w * hn).to(out_ptr.dtype.element_ty), mask=m)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """[..., d] -> [rows, d] with unit stride along d (a view whenever possible)."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(1) == 1 else t2.contiguous()


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., D], weight: [D] -> [..., D] in x.dtype."""
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.is_contiguous(), (
        f"weight {tuple(weight.shape)} vs x {tuple(x.shape)}"
    )
    assert x.dtype in _FLOATS, "float64 runs on the reference path"
    assert d <= 65536
    x2 = _rows(x, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        BLOCK = triton.next_power_of_2(d)
        _rms_norm_kernel[(rows,)](
            x2,
            weight,
            out,
            rows,
            d,
            float(eps),
            x2.stride(0),
            out.stride(0),
            BLOCK=BLOCK,
            num_warps=min(16, max(1, BLOCK // 256)),
            **pdl(x2),
        )
    return out.view(x.shape)


def add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [..., D] (one dtype), weight: [D] -> (rms_norm(residual + x), residual + x).

    With programmatic dependent launch the kernel reads `residual` before it waits for the kernel launched
    just before it, so that kernel must not write `residual`: the block stack passes the stream an
    add_rms_norm returned a whole mixer (at least one kernel) earlier (`nemotron_h.py`). A residual this
    launcher has to copy into rows is read after the wait (the copy is that kernel)."""
    d = x.shape[-1]
    assert weight.shape == (d,) and weight.is_contiguous(), (
        f"weight {tuple(weight.shape)} vs x {tuple(x.shape)}"
    )
    assert residual.shape == x.shape and residual.dtype == x.dtype, (
        f"residual {tuple(residual.shape)} {residual.dtype} vs x {tuple(x.shape)} {x.dtype}"
    )
    assert x.dtype in _FLOATS, "float64 runs on the reference path"
    assert d <= 65536
    x2, r2 = _rows(x, d), _rows(residual, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        BLOCK = triton.next_power_of_2(d)
        _add_rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            total,
            rows,
            d,
            float(eps),
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            total.stride(0),
            BLOCK=BLOCK,
            EARLY=r2.data_ptr() == residual.data_ptr(),
            num_warps=min(16, max(1, BLOCK // 256)),
            **pdl(x2),
        )
    return out.view(x.shape), total.view(x.shape)


def rmsnorm_gated_triton(
    x: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """x, z: [..., D]; weight: [D] -> [..., D] in promote(weight.dtype, x.dtype).

    With programmatic dependent launch the kernel reads `z` before it waits for the kernel launched just
    before it, so that kernel must not write `z`: the Mamba mixer's gate comes from in_proj, with the conv
    and SSM kernels (or the prefill scan) between (`mamba2.py`). A gate this launcher has to copy into rows
    is read after the wait (the copy is that kernel)."""
    d = x.shape[-1]
    if d % group_size:
        raise ValueError(f"rmsnorm_gated: last dim {d} is not a multiple of group_size {group_size}")
    assert weight.shape == (d,) and weight.is_contiguous(), (
        f"weight {tuple(weight.shape)} vs x {tuple(x.shape)}"
    )
    assert x.dtype in _FLOATS and weight.dtype in _FLOATS, "float64 runs on the reference path"
    assert z is None or z.shape == x.shape, f"z {None if z is None else tuple(z.shape)} vs x {tuple(x.shape)}"
    assert group_size <= 16384
    x2 = _rows(x, d)
    z2 = _rows(z, d) if z is not None else x2
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        BLOCK = triton.next_power_of_2(group_size)
        _rmsnorm_gated_kernel[(rows, d // group_size)](
            x2,
            z2,
            weight,
            out,
            rows,
            float(eps),
            x2.stride(0),
            z2.stride(0),
            out.stride(0),
            GROUP=group_size,
            BLOCK=BLOCK,
            HAS_Z=z is not None,
            EARLY=z is None or z2.data_ptr() == z.data_ptr(),
            num_warps=min(16, max(1, BLOCK // 256)),
            **pdl(x2),
        )
    return out.view(x.shape)
