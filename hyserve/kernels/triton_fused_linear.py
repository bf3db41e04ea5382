"""Single-row linear layers with their preceding op fused in, as one Triton GEMV kernel (contracts:
`fused_linear.py`).

At batch 1 every projection of a decode step is a GEMV bound by reading its weight. cuBLAS runs the
Nano 9B v2 down_proj (15680 -> 4480) and out_proj (10240 -> 4480) split-K, with a memset and a reduce
kernel around the GEMV, after the op's own kernel (relu^2, gated norm): four launches where the weight
read is one. Here one kernel streams the weight once and applies the op to the activation as it loads
it:

    y[n] = sum_g  rstd[g] * sum_{k in g}  W[n, k] * p(x)[k]

p is the op without its normalisation (relu(x)^2; x * silu(z) * w_norm). For the gated norm the sum of
squares of each group is accumulated from the same tiles and a group's partial sums are scaled by its
rstd at the tile that closes it, so the statistics cost no extra pass over x. The activation is not
rounded to the model dtype between the op and the matmul (the references round once there):
differences stay within bf16 tolerance.

One program owns BLOCK_N output columns and walks K in BLOCK_K tiles (a tile never straddles a norm
group). More than one row, other dtypes or layouts: the op's kernel + `F.linear`, as before (at two rows
and up cuBLAS shares each weight read between the rows; this kernel would not).

    grid = (cdiv(N, BLOCK_N),)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyserve.kernels.triton_activation import relu2_triton
from hyserve.kernels.triton_rmsnorm import rmsnorm_gated_triton

_NONE, _RELU2, _GATED_NORM = 0, 1, 2

# Launch settings, from `bench_kernels.py --only linear_sweep` on the H200 (2026-12-01).
_GPU = dict(BLOCK_N=8, BLOCK_K=512, num_warps=4, num_stages=4)
_CPU = dict(BLOCK_N=8, BLOCK_K=32, num_warps=1, num_stages=1)  # the interpreter at test sizes
# Whether the gated norm runs inside the GEMV (True) or as its own kernel before a plain GEMV (False).
GATED_NORM_IN_KERNEL = True


@triton.jit
def _fused_linear_kernel(
    x_ptr, z_ptr, nw_ptr, w_ptr, b_ptr, out_ptr,
    N, K, eps, s_w,
    PROLOGUE: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        mask_k = kk < K
        h = tl.load(x_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
        if PROLOGUE == 1:
            h = tl.maximum(h, 0.0)
            h = h * h
        elif PROLOGUE == 2:
            z = tl.load(z_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
            h = h * (z / (1.0 + tl.exp(-z)))
            ss += h * h
            h = h * tl.load(nw_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs_n[:, None] * s_w + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        part += h[None, :] * w.to(tl.float32)
        if PROLOGUE == 2:
            if (k0 + BLOCK_K) % GROUP == 0:  # this tile closes a norm group: scale its sums by the rstd
                rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / GROUP + eps)
                acc += tl.sum(part, axis=1) * rstd
                part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
                ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    if PROLOGUE != 2:
        acc = tl.sum(part, axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the fused kernel takes this call: one row, unit strides along K, 16-bit weights."""
    return (
        x.dim() == 2 and x.shape[0] == 1 and x.stride(1) == 1
        and weight.dim() == 2 and weight.stride(1) == 1 and weight.shape[1] == x.shape[1]
        and weight.dtype == x.dtype and x.dtype in (torch.float16, torch.bfloat16)
        and (bias is None or (bias.shape == (weight.shape[0],) and bias.is_contiguous()))
    )


def _launch(prologue: int, x, z, nw, weight, bias, group: int, eps: float) -> torch.Tensor:
    K = x.shape[1]
    N = weight.shape[0]
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    cfg = dict(_GPU) if x.is_cuda else dict(_CPU)
    stages = cfg.pop("num_stages")
    if prologue == _GATED_NORM:
        assert K % group == 0, f"K {K} is not a multiple of the norm group {group}"
        while group % cfg["BLOCK_K"]:  # a tile never straddles two groups
            cfg["BLOCK_K"] //= 2
    _fused_linear_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x, z if z is not None else x, nw if nw is not None else weight, weight,
        bias if bias is not None else weight, out,
        N, K, float(eps), weight.stride(0),
        PROLOGUE=prologue, GROUP=group, HAS_BIAS=bias is not None, NUM_STAGES=stages, **cfg,
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
    fits = _fits(x, weight, bias)
    if fits and GATED_NORM_IN_KERNEL and z.shape == x.shape and z.stride(1) == 1 and norm_weight.is_contiguous():
        return _launch(_GATED_NORM, x, z, norm_weight, weight, bias, group_size, eps)
    normed = rmsnorm_gated_triton(x, z, norm_weight, eps, group_size)
    if fits and normed.dtype == x.dtype:
        return _launch(_NONE, normed, None, None, weight, bias, 1, 0.0)
    return F.linear(normed, weight, bias)


def relu2_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, K]; weight: [N, K] -> [T, N] in x.dtype."""
    if not _fits(x, weight, bias):
        return F.linear(relu2_triton(x), weight, bias)
    return _launch(_RELU2, x, None, None, weight, bias, 1, 0.0)


__all__ = ["GATED_NORM_IN_KERNEL", "gated_norm_linear_triton", "relu2_linear_triton"]
