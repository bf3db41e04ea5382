"""Small-batch linear layers with their preceding op fused in, as one Triton kernel (contracts:
`fused_linear.py`).

At batch 1 every projection of a decode step is a GEMV bound by reading its weight; the op before it
(gated norm, relu^2, residual add + RMSNorm) is a separate kernel of a few microseconds whose launch and
round trip cost more than its arithmetic, and cuBLAS runs some of these shapes split-K with a second
reduce kernel. Here one kernel streams the weight once and applies the op to the activations as it
loads them:

    y[m, n] = sum_g  rstd[m, g] * sum_{k in g}  W[n, k] * p(x)[m, k]

p is the op without its normalisation (x * silu(z) * w_norm, relu(x)^2, (x + r) * w_norm); the sum of
squares of each norm group is accumulated from the same tiles, so the norm statistics cost no extra pass
and every weight element is read exactly once. The activations are not rounded to the model dtype
between the op and the matmul (the references round once there): differences stay within bf16
tolerance.

One program owns BLOCK_N output columns for all rows (rows <= BLOCK_M <= MAX_ROWS); its K loop walks the
norm groups in order. Above MAX_ROWS (a batch where the weight read is shared by enough rows that cuBLAS
is the better GEMM) the launcher runs the op's own kernel and `F.linear`, exactly as before.

    grid = (cdiv(N, BLOCK_N),)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyserve.kernels.triton_activation import relu2_triton
from hyserve.kernels.triton_rmsnorm import add_rms_norm_triton, rmsnorm_gated_triton

_NONE, _RELU2, _GATED_NORM, _ADD_NORM = 0, 1, 2, 3

# The most rows the fused kernel takes (above it: the op's kernel + cuBLAS), and its launch settings per
# BLOCK_M, from `bench_kernels.py --only linear_sweep` on the H200.
MAX_ROWS = 4
_GPU: dict[int, dict] = {
    1: dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=3),
    2: dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=3),
    4: dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=3),
}
_CPU = dict(BLOCK_N=8, BLOCK_K=32, num_warps=1, num_stages=1)  # the interpreter at test sizes


@triton.jit(do_not_specialize=["rows"])
def _fused_linear_kernel(
    x_ptr, z_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, sum_ptr,
    rows, N, K, eps,
    s_x, s_z, s_res, s_w, s_out, s_sum,
    PROLOGUE: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < rows
    mask_n = offs_n < N
    NORM: tl.constexpr = PROLOGUE == 2 or PROLOGUE == 3
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for g in range(0, K // GROUP):
        part = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(0, GROUP, BLOCK_K, num_stages=NUM_STAGES):
            kin = k0 + offs_k
            kk = g * GROUP + kin
            mask_k = kin < GROUP
            mask_mk = mask_m[:, None] & mask_k[None, :]
            h = tl.load(x_ptr + offs_m[:, None] * s_x + kk[None, :], mask=mask_mk, other=0.0).to(tl.float32)
            if PROLOGUE == 1:
                h = tl.maximum(h, 0.0)
                h = h * h
            elif PROLOGUE == 2:
                z = tl.load(z_ptr + offs_m[:, None] * s_z + kk[None, :], mask=mask_mk, other=0.0).to(tl.float32)
                h = h * (z / (1.0 + tl.exp(-z)))
            elif PROLOGUE == 3:
                r = tl.load(res_ptr + offs_m[:, None] * s_res + kk[None, :], mask=mask_mk, other=0.0)
                s = (h + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded like torch's r + x
                # every program computes the sum; the first one stores it (the next residual stream)
                tl.store(sum_ptr + offs_m[:, None] * s_sum + kk[None, :], s, mask=mask_mk & (pid == 0))
                h = s.to(tl.float32)
            if NORM:
                ss += h * h
                h = h * tl.load(nw_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)[None, :]
            w = tl.load(w_ptr + offs_n[:, None] * s_w + kk[None, :], mask=mask_n[:, None] & mask_k[None, :],
                        other=0.0).to(tl.float32)
            part += h[:, None, :] * w[None, :, :]
        dot = tl.sum(part, axis=2)
        if NORM:
            rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / GROUP + eps)
            dot = dot * rstd[:, None]
        acc += dot
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * s_out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the fused kernel takes this call (rows, layouts and dtypes it handles)."""
    return (
        x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.stride(1) == 1
        and weight.dim() == 2 and weight.stride(1) == 1 and weight.shape[1] == x.shape[1]
        and weight.dtype == x.dtype and x.dtype in (torch.float16, torch.bfloat16)
        and (bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous()))
    )


def _launch(prologue: int, x, z, res, nw, weight, bias, total, group: int, eps: float) -> torch.Tensor:
    rows, K = x.shape
    N = weight.shape[0]
    assert K % group == 0, f"K {K} is not a multiple of the norm group {group}"
    out = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    block_m = triton.next_power_of_2(rows)
    cfg = dict(_GPU[block_m]) if x.is_cuda else dict(_CPU)
    stages = cfg.pop("num_stages")
    dummy = x
    _fused_linear_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, z if z is not None else dummy, res if res is not None else dummy, nw if nw is not None else weight,
        weight, bias if bias is not None else weight, out, total if total is not None else dummy,
        rows, N, K, float(eps),
        x.stride(0), z.stride(0) if z is not None else 0, res.stride(0) if res is not None else 0,
        weight.stride(0), out.stride(0), total.stride(0) if total is not None else 0,
        PROLOGUE=prologue, GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=block_m, NUM_STAGES=stages, **cfg,
    )
    return out


def gated_norm_linear_triton(
    x: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x, z: [T, K]; norm_weight: [K]; weight: [N, K] -> [T, N] in x.dtype."""
    if not (_fits(x, weight, bias) and z.shape == x.shape and z.stride(1) == 1 and norm_weight.is_contiguous()
            and x.shape[1] % group_size == 0):
        return F.linear(rmsnorm_gated_triton(x, z, norm_weight, eps, group_size), weight, bias)
    return _launch(_GATED_NORM, x, z, None, norm_weight, weight, bias, None, group_size, eps)


def relu2_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, K]; weight: [N, K] -> [T, N] in x.dtype."""
    if not _fits(x, weight, bias):
        return F.linear(relu2_triton(x), weight, bias)
    return _launch(_RELU2, x, None, None, None, weight, bias, None, x.shape[1], 0.0)


def add_rms_norm_linear_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, K] -> (linear(rms_norm(residual + x)) [T, N], residual + x [T, K])."""
    if not (_fits(x, weight, bias) and residual.shape == x.shape and residual.dtype == x.dtype
            and residual.stride(1) == 1 and norm_weight.is_contiguous()):
        normed, total = add_rms_norm_triton(x, residual, norm_weight, eps)
        return F.linear(normed, weight, bias), total
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = _launch(_ADD_NORM, x, None, residual, norm_weight, weight, bias, total, x.shape[1], eps)
    return out, total


__all__ = ["MAX_ROWS", "add_rms_norm_linear_triton", "gated_norm_linear_triton", "relu2_linear_triton"]
