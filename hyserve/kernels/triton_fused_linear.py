"""Single-row linear layers as one Triton GEMV kernel, with relu^2 fused into its activation load
(contracts: `fused_linear.py`).

At batch 1 every projection of a decode step is a GEMV bound by reading its weight; cuBLAS runs the Nano
9B v2 down_proj and out_proj split-K with a memset and a reduce around it, and down_proj waits for a
separate relu^2 kernel. This kernel streams the weight once and applies relu^2 as it loads x:

    y[n] = sum_k W[n, k] * p(x[k])        p = relu(.)^2 or the identity;  grid = (cdiv(N, BLOCK_N),)

Every other one-row 16-bit projection (`linear`: Mamba in_proj, attention QKV and O, MLP up, latent
projections) takes the same kernel with p = identity: on the H200 cuBLAS ran the Nemotron 3 Nano 30B-A3B
QKV and O projections split-K with a reduce (~32 us a layer for 47 MB, 1.5 TB/s) and in_proj at 3.4 TB/s.
The relu^2 is not rounded to the model dtype before the product (the reference rounds once there): within
bf16 tolerance. More than one row, other dtypes or layouts go to `F.linear` (from two rows up cuBLAS shares
each weight read between rows); the Mamba gated norm stays its own kernel before this one (fusing it was
slower; benchmarks/README.md).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hyserve.kernels.launch_util import device_file, device_name, pdl
from hyserve.kernels.triton_activation import relu2_triton
from hyserve.kernels.triton_common import pdl_enter
from hyserve.kernels.triton_rmsnorm import rmsnorm_gated_triton

# Launch settings, from `bench_kernels.py --only linear_sweep` (benchmarks/README.md): one program owns
# BLOCK_N output columns and walks K in BLOCK_K tiles, num_stages loads in flight. A GEMV is bound by how many
# loads are in flight, so a projection with few output columns takes narrower programs: each table below is
# tried in order and the first whose grid has at least _MIN_PROGRAMS programs is taken (the last one else).
# 16-bit, rows of 4096 and longer: Nano 9B v2 in_proj / out_proj / down_proj at 0.99 / 0.91 / 0.91 of the
# H100's read ceiling with 4 x 512 (linear_sweep_fdb35a5_h100); Nemotron 3 Nano 30B-A3B's out_proj and o_proj
# (4096 -> 2688, 672 such programs) at 0.67 with it against 0.83 with 2 x 512 on 2 warps
_GPU = (
    dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=3),
    dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, num_stages=4),
)
# short rows (K < 4096: the 30B-A3B hidden 2688): its in_proj (2688 -> 10304) at 0.94 with 8 x 256 (0.94
# against 0.83 for 4 x 512 on the H200, kernels_fp8_eecf32e.md); narrower outputs (q, k, v) one column a
# program on one warp (a 2688 -> 4608 projection 0.86 against 0.81 with 8 x 256, linear_sweep_fdb35a5_h100)
_GPU_SHORT_K = (
    dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=3),
    dict(BLOCK_N=1, BLOCK_K=512, num_warps=1, num_stages=6),
)
_MIN_PROGRAMS = 1024
# e4m3 weights (one byte a weight). Channel scales: 16 rows x 512 up to K = 8192 (Nano 9B v2 in_proj at 0.86
# of the ceiling against 0.73 for 4 x 1024 on the H200; 0.92 on the H100); longer rows 2 x 2048 (its down_proj
# 15680 -> 4480 at 0.81 of the H100's ceiling against 0.70 for 4 x 1024, linear_sweep_fdb35a5_h100). Block
# scales keep a K tile inside one 128-wide scale block (0.73 / 0.32 at in_proj / down_proj against 0.55 / 0.25
# before)
_GPU_FP8 = dict(BLOCK_N=2, BLOCK_K=2048, num_warps=4, num_stages=3)
_GPU_FP8_SHORT_K = dict(BLOCK_N=16, BLOCK_K=512, num_warps=4, num_stages=3)
_GPU_FP8_BLOCK = dict(BLOCK_N=32, BLOCK_K=128, num_warps=8, num_stages=4)
_GPU_FP8_BLOCK_SHORT_K = dict(BLOCK_N=64, BLOCK_K=128, num_warps=8, num_stages=3)
_CPU = dict(BLOCK_N=8, BLOCK_K=32, num_warps=1, num_stages=1)  # the interpreter at test sizes
# K tiles of the weight each program loads before its PDL wait (1 or 2). `bench_model.py` timed both forms of
# a decode step in one run (up to be8f8c5), on the H100: one tile 2,799 against 2,849 us a Nano 30B-A3B
# batch-1 step, Nano 9B v2 bf16 6,061 against 6,077 us; only Nano 9B v2 FP8 ran faster with two (3,701 against
# 3,738)
PREFETCH_TILES = 1


# Where one GPU's sweep disagrees with the tables above, `linear_configs/<GPU>.json` (named as the MoE
# launcher's `moe_configs/`) sets that shape on that GPU alone: {"configs": {"<w_scale>,<K>,<N>": {BLOCK_N,
# BLOCK_K, num_warps, num_stages}}}, each entry citing the sweep it came from in the file's "source".
CONFIG_DIR = Path(__file__).resolve().parent / "linear_configs"
_SETTING_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def shape_key(w_scale: int, k: int, n: int) -> str:
    return f"{w_scale},{k},{n}"


def validate_setting(cfg: dict[str, Any], where: str = "setting") -> dict[str, int]:
    """A GEMV launch setting: exactly BLOCK_N, BLOCK_K (powers of two; BLOCK_K >= 16), num_warps (1, 2, 4
    or 8) and num_stages (1..8), all integers; raises ValueError naming what is wrong."""
    if not isinstance(cfg, dict) or sorted(cfg) != sorted(_SETTING_KEYS):
        got = sorted(cfg) if isinstance(cfg, dict) else type(cfg).__name__
        raise ValueError(f"{where}: a GEMV setting has exactly the keys {list(_SETTING_KEYS)}, got {got}")
    for key in _SETTING_KEYS:
        if not isinstance(cfg[key], int) or isinstance(cfg[key], bool):
            raise ValueError(f"{where}: {key} must be an integer, got {cfg[key]!r}")
    for key, lo in (("BLOCK_N", 1), ("BLOCK_K", 16)):
        v = cfg[key]
        if v < lo or v & (v - 1):
            raise ValueError(f"{where}: {key} must be a power of two >= {lo}, got {v}")
    if cfg["num_warps"] not in (1, 2, 4, 8):
        raise ValueError(f"{where}: num_warps must be 1, 2, 4 or 8, got {cfg['num_warps']}")
    if not 1 <= cfg["num_stages"] <= 8:
        raise ValueError(f"{where}: num_stages must be in 1..8, got {cfg['num_stages']}")
    return dict(cfg)


@functools.lru_cache(maxsize=8)
def device_table(name: str) -> dict[str, dict[str, int]]:
    """The GEMV settings `linear_configs/<GPU>.json` sets for the GPU called `name` (empty without a file),
    each entry validated."""
    path = device_file(CONFIG_DIR, name)
    if not path.exists():
        return {}
    table = json.loads(path.read_text()).get("configs", {})
    for key, cfg in table.items():
        parts = key.split(",")
        if len(parts) != 3 or not all(p.isdigit() for p in parts) or int(parts[0]) not in (0, 1, 2):
            raise ValueError(f"{path.name}: key {key!r} is not '<w_scale 0|1|2>,<K>,<N>'")
        validate_setting(cfg, f"{path.name} [{key}]")
        if int(parts[0]) == 2 and 128 % cfg["BLOCK_K"]:
            # a block-scaled weight's K tile takes the one scale of its 128-wide block (see _gemv_tile)
            raise ValueError(
                f"{path.name} [{key}]: a block-scaled weight needs BLOCK_K dividing 128, got {cfg['BLOCK_K']}"
            )
    return table


def gpu_settings(w_scale: int, k: int, n: int, device: str = "") -> dict[str, int]:
    """The GEMV's launch settings on the GPU called `device` for a weight of this kind (0: 16-bit, 1: e4m3
    with channel scales, 2: e4m3 with block scales), row length K and N output columns: that GPU's file entry
    where it has one, else the tables above (`bench_kernels.py --only linear_sweep` replaces it to time each
    setting)."""
    tuned = device_table(device).get(shape_key(w_scale, k, n)) if device else None
    if tuned is not None:
        return tuned
    if w_scale == 0:
        table = _GPU_SHORT_K if k < 4096 else _GPU
        return next((s for s in table if triton.cdiv(n, s["BLOCK_N"]) >= _MIN_PROGRAMS), table[-1])
    if w_scale == 1:
        return _GPU_FP8_SHORT_K if k <= 8192 else _GPU_FP8
    return _GPU_FP8_BLOCK_SHORT_K if k <= 8192 else _GPU_FP8_BLOCK


@triton.jit
def _gemv_tile(
    x_ptr, w, ws_ptr, s_ws, offs_n, mask_n, kk, mask_k, k0, RELU2: tl.constexpr, W_SCALE: tl.constexpr
):
    """One K tile's [BLOCK_N, BLOCK_K] float32 products p(x[kk]) * w (w: the tile's weight, already
    loaded)."""
    h = tl.load(x_ptr + kk, mask=mask_k, other=0.0).to(tl.float32)
    if RELU2:
        h = tl.maximum(h, 0.0)
        h = h * h
    wf = w.to(tl.float32)
    if W_SCALE == 2:
        wf = wf * tl.load(ws_ptr + (offs_n // 128) * s_ws + k0 // 128, mask=mask_n, other=0.0)[:, None]
    return h[None, :] * wf


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    s_w,
    ws_ptr,
    s_ws,
    RELU2: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    W_SCALE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PREFETCH: tl.constexpr,
    PDL: tl.constexpr,
):
    """W_SCALE 0: a 16-bit weight. FP8 weights (triton_fp8_linear.py, one row): 1, e4m3 rows times their
    channel scales ws[n] after the K sum; 2, [128, 128] block scales ws[n // 128, k // 128] on each K tile's
    partial (BLOCK_K divides 128, so a tile lies in one scale block).
    No kernel writes the weight, so its first PREFETCH (1 or 2) K tiles are loaded before the PDL wait:
    with programmatic dependent launch those bytes are in flight while the kernel before this one finishes."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n[:, None] * s_w
    mask_k0 = offs_k < K
    w0 = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k0[None, :], other=0.0)
    if PREFETCH >= 2:
        kk1 = BLOCK_K + offs_k
        mask_k1 = kk1 < K
        w1 = tl.load(w_rows + kk1[None, :], mask=mask_n[:, None] & mask_k1[None, :], other=0.0)
    pdl_enter(PDL)
    # reduced over K once, after the loop
    part = _gemv_tile(x_ptr, w0, ws_ptr, s_ws, offs_n, mask_n, offs_k, mask_k0, 0, RELU2, W_SCALE)
    if PREFETCH >= 2:  # (a second tile past K reads no block scale: its column would lie past the last)
        part += _gemv_tile(
            x_ptr, w1, ws_ptr, s_ws, offs_n, mask_n & (BLOCK_K < K), kk1, mask_k1, BLOCK_K, RELU2, W_SCALE
        )
    for k0 in tl.range(PREFETCH * BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        mask_k = kk < K
        w = tl.load(w_rows + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        part += _gemv_tile(x_ptr, w, ws_ptr, s_ws, offs_n, mask_n, kk, mask_k, k0, RELU2, W_SCALE)
    acc = tl.sum(part, axis=1)
    if W_SCALE == 1:
        acc = acc * tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _gpu(x: torch.Tensor) -> bool:
    """Whether to launch with the GPU settings (tests/sm90_compile_check.py says yes for CPU tensors)."""
    return x.is_cuda


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the fused kernel takes this call: one row, unit strides along K, 16-bit weights and bias of
    x's dtype (F.linear refuses mixed dtypes), weight offsets within int32 (the kernel's index type)."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.stride(1) == 1
        and weight.dim() == 2
        and weight.stride(1) == 1
        and weight.shape[1] == x.shape[1]
        and weight.shape[0] * weight.stride(0) < 2**31
        and weight.dtype == x.dtype
        and x.dtype in (torch.float16, torch.bfloat16)
        and (
            bias is None
            or (bias.shape == (weight.shape[0],) and bias.is_contiguous() and bias.dtype == x.dtype)
        )
    )


def _gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    relu2: bool,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One row: x [1, K] (unit stride) @ weight [N, K]^T -> [1, N] in x.dtype. weight_scale: an e4m3
    weight's float32 channel [N] or block [ceil(N/128), ceil(K/128)] scales (`gemv_fp8`)."""
    K = x.shape[1]
    N = weight.shape[0]
    out = torch.empty(1, N, dtype=x.dtype, device=x.device)
    w_scale = 0 if weight_scale is None else (1 if weight_scale.dim() == 1 else 2)
    gpu = device_name(x.device.index) if x.is_cuda else ""  # "" under tests/sm90_compile_check.py
    cfg = dict(gpu_settings(w_scale, K, N, gpu) if _gpu(x) else _CPU)
    stages = cfg.pop("num_stages")
    ws = weight_scale if weight_scale is not None else weight
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        N,
        K,
        weight.stride(0),
        ws,
        ws.stride(0) if w_scale == 2 else 0,
        RELU2=relu2,
        HAS_BIAS=bias is not None,
        W_SCALE=w_scale,
        NUM_STAGES=stages,
        PREFETCH=PREFETCH_TILES,
        **cfg,
        **pdl(x),
    )
    return out


def gemv_fp8(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, relu2: bool
) -> torch.Tensor:
    """The FP8 linear's one-row form (`triton_fp8_linear.py`): x [1, K] 16-bit with a unit stride, e4m3
    weight [N, K], channel or block scales; the weight streams 1 byte a weight through the FMA GEMV."""
    return _gemv(x, weight, bias, relu2, weight_scale)


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [..., K]; weight: [N, K] -> [..., N] in x.dtype: this GEMV for one row, F.linear otherwise."""
    if x.dim() != 2:
        if x.numel() != x.shape[-1] or x.dim() < 1:
            return F.linear(x, weight, bias)
        return linear_triton(x.reshape(1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])
    if not _fits(x, weight, bias):
        return F.linear(x, weight, bias)
    return _gemv(x, weight, bias, relu2=False)


def gated_norm_linear_triton(
    x: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    group_size: int,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """x, z: [T, K]; norm_weight: [K]; weight: [N, K] -> [T, N] in x.dtype: the gated norm kernel, then this
    GEMV for one row (F.linear otherwise)."""
    normed = rmsnorm_gated_triton(x, z, norm_weight, eps, group_size)
    if normed.dtype == x.dtype and _fits(normed, weight, bias):
        return _gemv(normed, weight, bias, relu2=False)
    return F.linear(normed, weight, bias)


def relu2_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: [T, K]; weight: [N, K] -> [T, N] in x.dtype: relu^2 inside this GEMV for one row (its own
    kernel + F.linear otherwise)."""
    if not _fits(x, weight, bias):
        return F.linear(relu2_triton(x), weight, bias)
    return _gemv(x, weight, bias, relu2=True)


__all__ = ["gated_norm_linear_triton", "gemv_fp8", "linear_triton", "relu2_linear_triton"]
