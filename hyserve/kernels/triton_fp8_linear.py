"""FP8 linear layers in Triton: e4m3 weights with per-channel or [128, 128]-block scales (contract and CPU
path: `fp8_linear.py`).

Two forms, by row count M (tokens):

    M == 1                 the one-row GEMV of `triton_fused_linear.py` (float32 FMAs, the e4m3 weight upcast
                           as it loads, channel scales after the K sum, block scales per K tile): at batch 1
                           the dot form below padded M to 16 rows and ran at 0.15 of the FP8 weight-read
                           roofline on the H200 (Nano 9B v2 decode, 2026-12-03).
    M <= SMALL_M (decode)  w8a16: the activation stays 16-bit; each program upcasts its e4m3 weight tile
                           (exact in bf16 / fp16) and runs a 16-bit tensor-core dot, M padded to 16 rows
                           (under the interpreter, whose 16-bit dots are wrong, the same tiles in float32).
                           K is split over programs when the N tiles alone would not fill the GPU, so batch 1
                           streams the weight (1 byte a weight) at HBM speed; the fp32 partials are summed in
                           a fixed order by a second small kernel, which also applies the channel scales and
                           the bias (deterministic, no atomics).
    M > SMALL_M (prefill)  w8a8: `_quant_tile_kernel` quantises the activation per token (per token and 128
                           columns for block weights: DeepSeek-V3's scheme), then an e4m3 x e4m3 tensor-core
                           GEMM accumulates in fp32: channel scales once in the epilogue, block scales per
                           128-wide K step (BLOCK_K divides 128, so every K tile lies in one scale block).
                           With channel scales and bf16 activations on sm_90+ the GEMM is torch._scaled_mm
                           (cuBLASLt / CUTLASS, row-wise activation and column-wise weight scales) where it
                           takes the shape (`PREFILL_GEMM`); the Triton GEMM otherwise.

Activation quantisation builds the e4m3 codes itself (`_e4m3_bits`: the float32 mantissa rounded to 3 bits
with ties to even by integer arithmetic, the exponent rebiased; subnormals on the 2^-9 grid) and stores
bytes, so the codes equal torch's `.to(float8_e4m3fn)` bit for bit on every backend (the Triton
interpreter's own float32 -> e4m3 cast rounds values just below a power of two down a binade and drops
the sign of -0).

The contract the tests check: w8a16 is the float64 product of x and the dequantised weight within fp32
accumulation and one output rounding; w8a8 is the float64 product of the dequantised activation codes and
weight, with the activation's own quantisation error bounded separately (e4m3: 2^-4 relative). Launch
settings: starting points for Hopper (benchmarks/bench_kernels.py --only fp8_linear measures them); the
interpreter runs small tiles. Token counts and split sizes are `do_not_specialize`, so the variants are fixed
by the layer shapes, the dtypes, the scale layout and the form (M <= SMALL_M or not).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from hyserve.kernels.fp8_linear import ACT_GROUP, BLOCK, E4M3, fp8_linear_ref, fp8_relu2_linear_ref
from hyserve.kernels.launch_util import hopper_or_newer, pdl
from hyserve.kernels.triton_common import dot_acc, pdl_enter
from hyserve.kernels.triton_fused_linear import gemv_fp8

SMALL_M = 16  # rows up to which the w8a16 (decode) form runs
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
_GPU_SMALL = (16, 64, 256, 4, 4)
_GPU_MID = (64, 128, 128, 4, 4)  # w8a8, M <= 64
_GPU_LARGE = (128, 128, 128, 8, 3)
_CPU_SMALL = (16, 32, 32, 1, 1)
_CPU_LARGE = (16, 32, 32, 1, 1)
_GPU_SPLIT_TARGET = 2  # programs per SM the decode form aims for
_CPU_PROGRAMS = 8  # the interpreter: enough programs to split K at test sizes


@triton.jit
def _e4m3_bits(v):
    """float32 in [-448, 448] -> the e4m3fn code (uint8) of its nearest e4m3 value, ties to even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.int32)
    r = bits + 0x7FFFF + ((bits >> 20) & 1)  # the mantissa rounded to 3 bits (a carry moves the exponent)
    normal = ((((r >> 23) & 0xFF) - 120) << 3) | ((r >> 20) & 7)  # e4m3 exponent bias 7 = 127 - 120
    t = tl.abs(v) * 512.0  # below 2^-6 the codes are multiples of 2^-9: round t to an integer, ties to even
    sub = ((t + 12582912.0) - 12582912.0).to(tl.int32)  # 8 (2^-6, the smallest normal) is its code too
    return (sign | tl.where(tl.abs(v) < 0.015625, sub, normal)).to(tl.uint8)


@triton.jit
def _load_act(ptrs, mask, RELU2: tl.constexpr):
    """Activations as float32 (0 where masked), relu(x)^2 when RELU2."""
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if RELU2:
        x = tl.maximum(x, 0.0)
        x = x * x
    return x


@triton.jit(do_not_specialize=["M"])
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    s_xm,
    s_qm,
    s_sm,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RELU2: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, g): with GROUP > 0 the 128 columns of group g of one row; with GROUP == 0 the whole
    row (two passes over it: amax, then the codes). scale = amax / 448 (1 for an all-zero group); both
    divisions round to nearest (div_rn: a plain `/` compiles to the approximate division on CUDA, and the
    codes must match torch's bit for bit). RELU2: the row is relu(x)^2 (in float32, as it loads)."""
    pdl_enter(PDL)
    row = tl.program_id(0)
    g = tl.program_id(1)
    if GROUP > 0:
        offs = g * GROUP + tl.arange(0, GROUP)
        mask = offs < K
        x = _load_act(x_ptr + row * s_xm + offs, mask, RELU2)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
        tl.store(q_ptr + row * s_qm + offs, _e4m3_bits(v), mask=mask)
        tl.store(s_ptr + row * s_sm + g, scale)
    else:
        offs = tl.arange(0, BLOCK_K)
        m = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs
            x = _load_act(x_ptr + row * s_xm + kk, kk < K, RELU2)
            m = tl.maximum(m, tl.abs(x))
        amax = tl.max(m, axis=0)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + offs
            x = _load_act(x_ptr + row * s_xm + kk, kk < K, RELU2)
            v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -448.0), 448.0)
            tl.store(q_ptr + row * s_qm + kk, _e4m3_bits(v), mask=kk < K)
        tl.store(s_ptr + row * s_sm, scale)


@triton.jit(do_not_specialize=["M"])
def _quant_tile_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    M,
    K,
    s_xm,
    s_qm,
    s_sm,
    NG: tl.constexpr,
    GW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    RELU2: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_quant_rows_kernel` in one pass: BLOCK_M whole rows a program, held as [BLOCK_M, NG, GW] tiles (NG
    groups of GW columns: 128-column groups, or one group of the row padded to a power of two), so every
    load of the rows is in flight at once and each byte is read once. Same codes and scales."""
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.arange(0, NG)
    cols = g[:, None] * GW + tl.arange(0, GW)[None, :]  # [NG, GW]
    mask = (rows < M)[:, None, None] & (cols < K)[None, :, :]
    r64 = rows.to(tl.int64)[:, None, None]
    x = _load_act(x_ptr + r64 * s_xm + cols[None, :, :], mask, RELU2)
    amax = tl.max(tl.abs(x), axis=2)  # [BLOCK_M, NG]
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    v = tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, :, None]), -448.0), 448.0)
    tl.store(q_ptr + r64 * s_qm + cols[None, :, :], _e4m3_bits(v), mask=mask)
    s_mask = (rows < M)[:, None] & (g * GW < K)[None, :]
    tl.store(s_ptr + rows.to(tl.int64)[:, None] * s_sm + g[None, :], scale, mask=s_mask)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    s_am,
    s_asm,
    s_wn,
    s_wsn,
    s_om,
    BLOCK_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[M, N] = (a * a_scale) @ (w * w_scale)^T (+ bias); a, w e4m3; grouped tile order for L2 reuse."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % rows
    pid_n = (pid % per_group) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        mask_k = kk < K
        a = tl.load(
            a_ptr + offs_m[:, None] * s_am + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + offs_n[None, :] * s_wn + kk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        if BLOCK_SCALED:
            kb = k0 // 128
            xs = tl.load(as_ptr + offs_m * s_asm + kb, mask=mask_m, other=0.0)
            wsc = tl.load(ws_ptr + (offs_n // 128) * s_wsn + kb, mask=mask_n, other=0.0)
            acc += tl.dot(a, w, out_dtype=tl.float32) * (xs[:, None] * wsc[None, :])
        else:
            # Hopper's e4m3 warp-group MMA keeps a short accumulator (~14 mantissa bits, the DeepSeek-V3
            # report): Triton's sm_90 default accumulates the whole K there; promote to float32 after every K
            # tile.
            acc = tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K, out_dtype=tl.float32)
    if not BLOCK_SCALED:
        xs = tl.load(as_ptr + offs_m * s_asm, mask=mask_m, other=0.0)
        wsc = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
        acc = acc * xs[:, None] * wsc[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None] * s_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M", "k_split"])
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    ws_ptr,
    part_ptr,
    M,
    N,
    K,
    k_split,
    s_xm,
    s_wn,
    s_wsn,
    BLOCK_SCALED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_F32: tl.constexpr,
    RELU2: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (n tile, K split): the fp32 partial x[:, ks] @ (w[:, ks] (* block scales))^T of its split into
    part[split, M, N]; channel scales are applied after the splits are summed. DOT_F32 (the interpreter,
    whose 16-bit dots are wrong in Triton 3.6) multiplies the same tiles in float32 instead. RELU2: x is
    relu(x)^2, applied in float32 as the tile loads and rounded to x's dtype for the 16-bit dot (kept in
    float32 by DOT_F32: the interpreter's float32 -> bf16 cast truncates)."""
    pdl_enter(PDL)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_lo = pid_k * k_split
    k_hi = tl.minimum(K, k_lo + k_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        mask_k = kk < k_hi
        x = tl.load(
            x_ptr + offs_m[:, None] * s_xm + kk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        w = tl.load(
            w_ptr + offs_n[None, :] * s_wn + kk[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        if RELU2:
            xr = tl.maximum(x.to(tl.float32), 0.0)
            x = xr * xr if DOT_F32 else (xr * xr).to(x.dtype)
        if DOT_F32:
            x = x.to(tl.float32)
        w = w.to(x.dtype)  # e4m3 -> bf16 / fp16 (or float32) is exact
        if BLOCK_SCALED:
            wsc = tl.load(ws_ptr + (offs_n // 128) * s_wsn + k0 // 128, mask=mask_n, other=0.0)
            acc += dot_acc(x, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_F32) * wsc[None, :]
        else:
            acc = dot_acc(x, w, acc, DOT_F32)  # float32 tiles: IEEE products (no TF32 rounding)
    part = part_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :]
    tl.store(part, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit(do_not_specialize=["M", "splits"])
def _splitk_reduce_kernel(
    part_ptr,
    ws_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    splits,
    s_om,
    CHANNEL_SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[m, n] = (sum over splits, in order, of part[s, m, n]) (* w_scale[n]) (+ bias[n])."""
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    n = offs % N
    m = offs // N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
    if CHANNEL_SCALED:
        acc = acc * tl.load(ws_ptr + n, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * s_om + n, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers --------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _gpu(x: torch.Tensor) -> bool:
    """Whether to launch with the GPU settings (tests/sm90_compile_check.py says yes for CPU tensors)."""
    return x.is_cuda


def _check(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> bool:
    """Shape checks (AssertionError with the shapes); returns True for block-scaled weights."""
    assert weight.dtype == E4M3 and weight.dim() == 2 and weight.stride(1) == 1, (weight.dtype, weight.shape)
    n, k = weight.shape
    assert x.shape[-1] == k, f"x has {x.shape[-1]} features, weight {list(weight.shape)}"
    assert weight_scale.dtype == torch.float32 and weight_scale.is_contiguous(), weight_scale.dtype
    block = weight_scale.dim() == 2
    want = (triton.cdiv(n, BLOCK), triton.cdiv(k, BLOCK)) if block else (n,)
    assert tuple(weight_scale.shape) == want, (
        f"weight_scale {list(weight_scale.shape)}, expected {list(want)}"
    )
    assert bias is None or (bias.shape == (n,) and bias.is_contiguous()), None if bias is None else bias.shape
    assert n * weight.stride(0) < 2**31, "weight offsets must fit int32"
    return block


# rows of up to this many columns (a power of two at least K) are quantised by the one-pass tile kernel,
# TILE_ELEMS values a program (32 a thread on 8 warps), so a program never holds more; wider rows (Nano 9B
# v2's 15,680-wide MLP activations) by the two-pass row kernel
TILE_MAX_K = 8192
TILE_ELEMS = 8192


def quantize_rows_triton(
    x: torch.Tensor, group: int | None = None, relu2: bool = False, *, tile: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (e4m3 codes [M, K], float32 scales [M] or [M, ceil(K/group)]), as
    `fp8_linear.quantize_rows_ref`; group is None or 128. relu2: the codes of relu(x)^2 (float32). tile:
    the one-pass kernel where the row fits it, True / False forcing it or the two-pass row kernel (tests and
    benchmarks compare them); None: the faster as measured (`bench_kernels --only quant`, H100, 2,688-wide
    rows of 512 to 8,512): one-pass per 128 columns (2.2-3.4x), two-pass per token (the one-pass took
    1.1-1.6x as long: a whole row padded to a power of two, two rows a program)."""
    assert x.dim() == 2 and x.stride(1) == 1, (x.shape, x.stride())
    assert group in (None, ACT_GROUP), f"group must be None or {ACT_GROUP}, got {group}"
    m, k = x.shape
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    groups = 1 if group is None else triton.cdiv(k, group)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    kp = triton.next_power_of_2(k)
    gpu = _gpu(x)
    if tile is None:
        tile = group is not None
    if m > 0 and tile and kp <= TILE_MAX_K:
        gw = min(group, kp) if group else kp
        bm = max(1, min(TILE_ELEMS // kp, 16)) if gpu else 2
        _quant_tile_kernel[(triton.cdiv(m, bm),)](
            x,
            q.view(torch.uint8),
            scale,
            m,
            k,
            x.stride(0),
            q.stride(0),
            scale.stride(0),
            NG=kp // gw,
            GW=gw,
            BLOCK_M=bm,
            RELU2=relu2,
            num_warps=8 if gpu else 1,
            **pdl(x),
        )
    elif m > 0:
        _quant_rows_kernel[(m, groups)](
            x,
            q.view(torch.uint8),
            scale,
            m,
            k,
            x.stride(0),
            q.stride(0),
            scale.stride(0),
            GROUP=group or 0,
            BLOCK_K=1024 if gpu else 64,
            RELU2=relu2,
            num_warps=4 if gpu else 1,
            **pdl(x),
        )
    return q, (scale.view(m) if group is None else scale)


def _w8a16(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: bool,
    relu2: bool,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    gpu = _gpu(x)
    bm, bn, bk, warps, stages = _GPU_SMALL if gpu else _CPU_SMALL
    assert m <= bm, f"the decode form takes at most {bm} rows, got {m}"
    if block:
        bk = min(bk, BLOCK)
    n_tiles = triton.cdiv(n, bn)
    target = _GPU_SPLIT_TARGET * _sm_count(x.device.index or 0) if gpu else _CPU_PROGRAMS
    splits = max(1, min(triton.cdiv(target, n_tiles), triton.cdiv(k, bk)))
    k_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    splits = triton.cdiv(k, k_split)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _w8a16_kernel[(n_tiles, splits)](
        x,
        weight,
        weight_scale,
        part,
        m,
        n,
        k,
        k_split,
        x.stride(0),
        weight.stride(0),
        weight_scale.stride(0),
        BLOCK_SCALED=block,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        NUM_STAGES=stages,
        DOT_F32=not gpu,
        RELU2=relu2,
        num_warps=warps,
        **pdl(x),
    )
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    rblock = 1024 if gpu else 64
    _splitk_reduce_kernel[(triton.cdiv(m * n, rblock),)](
        part,
        weight_scale,
        bias if bias is not None else part,
        out,
        m,
        n,
        splits,
        out.stride(0),
        CHANNEL_SCALED=not block,
        HAS_BIAS=bias is not None,
        BLOCK=rblock,
        num_warps=4 if gpu else 1,
        **pdl(x),
    )
    return out


# Which GEMM runs the w8a8 form of channel-scaled weights: "auto" takes torch._scaled_mm (cuBLASLt's /
# CUTLASS's e4m3 GEMM with the activation's row scales and the weight's column scales in its epilogue) where
# it takes the call (`_scaled_mm_takes`), "triton" always the Triton GEMM below (benchmarks compare the two).
PREFILL_GEMM = {"form": "auto"}


# From this many rows up; at 64 rows (a decode step's batch) the Triton GEMM read the Nano 9B v2 in_proj and
# up_proj faster on the H200 (2.8 / 2.3 against 2.1 / 2.1 TB/s) and torch._scaled_mm the others (within 15%),
# while at 8192 rows torch._scaled_mm ran 1.35-1.6x the Triton GEMM
# (benchmarks/results/kernels_fp8_eecf32e.md).
SCALED_MM_MIN_ROWS = 65


def _scaled_mm_takes(x: torch.Tensor, weight: torch.Tensor, block: bool) -> bool:
    """Row-wise scaled e4m3 GEMMs of torch (sm_90+): bf16 output, N and K multiples of 16, a row-major
    weight, at least SCALED_MM_MIN_ROWS rows; block-scaled weights and float16 activations stay on the Triton
    GEMM."""
    n, k = weight.shape
    return (
        PREFILL_GEMM["form"] == "auto"
        and not block
        and x.dtype == torch.bfloat16
        and x.shape[0] >= SCALED_MM_MIN_ROWS
        and n % 16 == 0
        and k % 16 == 0
        and weight.stride(0) == k
        and hasattr(torch, "_scaled_mm")
        and hopper_or_newer(x.device)
    )


def _w8a8(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    block: bool,
    relu2: bool,
) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    a, a_scale = quantize_rows_triton(x, ACT_GROUP if block else None, relu2)
    if bias is None and _scaled_mm_takes(x, weight, block):
        # [M, K] row-major x [K, N] column-major (the weight's transpose view), float32 scales [M, 1] and
        # [1, N]; use_fast_accum=False: the e4m3 products are promoted to float32 as they accumulate (the
        # contract the Triton GEMM keeps with max_num_imprecise_acc)
        return torch._scaled_mm(
            a,
            weight.t(),
            scale_a=a_scale.view(m, 1),
            scale_b=weight_scale.view(1, n),
            out_dtype=torch.bfloat16,
            use_fast_accum=False,
        )
    if _gpu(x):
        bm, bn, bk, warps, stages = _GPU_MID if m <= 64 else _GPU_LARGE
    else:
        bm, bn, bk, warps, stages = _CPU_LARGE
    assert BLOCK % bk == 0 or not block, f"BLOCK_K {bk} must divide {BLOCK} for block scales"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](
        a,
        a_scale,
        weight,
        weight_scale,
        bias if bias is not None else out,
        out,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0) if block else 1,
        weight.stride(0),
        weight_scale.stride(0),
        out.stride(0),
        BLOCK_SCALED=block,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        NUM_STAGES=stages,
        num_warps=warps,
        **pdl(x),
    )
    return out


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    relu2: bool = False,
) -> torch.Tensor:
    """x [..., K] bf16 / fp16; weight e4m3 [N, K]; weight_scale float32 [N] or [ceil(N/128), ceil(K/128)]
    -> [..., N] in x.dtype. float32 activations take the reference (dequantise + F.linear). relu2: of
    relu(x)^2, applied as the activation loads (`fp8_relu2_linear_triton`)."""
    block = _check(x, weight, weight_scale, bias)
    if x.dtype not in (torch.bfloat16, torch.float16):
        return (fp8_relu2_linear_ref if relu2 else fp8_linear_ref)(x, weight, weight_scale, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, weight.shape[0])
    if m == 1:  # batch-1 decode: the FMA GEMV streams the e4m3 weight without padding M to a dot tile
        return gemv_fp8(x2, weight, weight_scale, bias, relu2).view(*lead, weight.shape[0])
    fn = _w8a16 if m <= SMALL_M else _w8a8
    return fn(x2, weight, weight_scale, bias, block, relu2).view(*lead, weight.shape[0])


def fp8_relu2_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`fp8_relu2_linear_ref` (the MLP's down_proj): relu^2 inside the decode form's tile loads and the
    prefill form's activation quantisation, so it costs no kernel of its own."""
    return fp8_linear_triton(x, weight, weight_scale, bias, relu2=True)


def fp8_token_buckets(max_num_tokens: int) -> list[int]:
    """One row count per launch configuration above (one row, decode form, w8a8 up to 64 rows, above 64), up
    to max_num_tokens: the warm-up runs a step of each so every FP8 variant compiles before ready."""
    return [m for m in (1, 2, SMALL_M + 1, 65) if m <= max_num_tokens]


__all__ = [
    "SMALL_M",
    "fp8_linear_triton",
    "fp8_relu2_linear_triton",
    "fp8_token_buckets",
    "quantize_rows_triton",
]
