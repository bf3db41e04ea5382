"""Nemotron 3 mixture of experts as Triton kernels, with no host sync and no shape that depends on the
routing, so a decode step replays from a CUDA graph (contracts: `moe.py`; layout: docs/architecture.md).

    logits     _router_gemv_kernel (few tokens), grid (T, E / BLOCK_E): the float32 gate GEMV reading the
               16-bit activation as it is (cuBLAS at these sizes took a cast, a GEMV and a reduce); more
               tokens: F.linear in float32
    route      _route_kernel, grid (T,): sigmoid, score-correction bias, group-limited top-k by repeated
               argmax over the token's [groups, experts per group] tile, normalised weights x scale
    gemv path  (few tokens) no sort: _up_gemv_kernel, grid (rows x I / BLOCK_N), reads only each pair's
               expert, relu^2 at the end; _down_gemv_kernel, grid (T, d / BLOCK_N), walks the token's k
               experts and sums their weighted rows in registers (the combine): BLOCK_N of 2-8 rows gives
               thousands of programs, so one token's six experts stream at HBM speed. A shared expert of
               S x the routed intermediate size rides along as S more (token, chunk) pairs of weight 1:
               its up rows in the same launch, its down columns as S more slots of the down GEMV's loop.
               Under PDL, with EARLY set in the config, reads that do not depend on the kernel before
               run ahead of its wait: the shared up rows read and multiply while the route kernel runs
               (their stores wait), and the down GEMV loads its first expert tile while the up GEMV
               finishes
    gemm path  _align_{count,offsets,scatter}_kernel: histogram per chunk of pairs, one program for the
               prefix sums, block padding and expert id per block, then a stable scatter (rank inside a
               chunk from a one-hot cumsum); _up_gemm_kernel / _down_gemm_kernel, grid (max blocks x
               N tiles): block b multiplies the rows of sorted_ids[b] (gathered tokens, or h's rows) by
               expert expert_ids[b]; relu^2 in the up epilogue, the routing weight in the down one;
               blocks past num_tokens_post_pad return at once; _combine_kernel sums each token's k rows
    w8a8       (FP8 experts, a tuned entry with A8 = 1) x quantised to e4m3 per row and 128 columns, e4m3 x
               e4m3 warp-group MMAs a K tile at a time (each tile's product scaled into the float32
               accumulator: Hopper's e4m3 accumulator is short), h quantised the same way in the up GEMM's
               epilogue; contract `moe.moe_experts_w8a8_ref` (vLLM's FP8 MoE is w8a8 too). Chosen per
               bucket by `bench_moe.py --tune --fp8` where it is faster; otherwise FP8 experts are w8a16

Tile settings per (experts E, intermediate N, hidden K, token bucket) come from `moe_configs/<GPU>.json`
(autotuned offline by `benchmarks/bench_moe.py --tune`; serving never autotunes) and otherwise from a
heuristic. Token and pair counts are `do_not_specialize`; `moe_token_buckets` lists one token count per
bucket, so a warm-up that runs each compiles every variant.
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

from hyserve.kernels.fp8_linear import ACT_GROUP
from hyserve.kernels.launch_util import device_arch, device_file, device_name, pdl, same_arch_names
from hyserve.kernels.moe import (
    _check_experts_args,
    _check_route_args,
    check_shared_args,
    moe_max_blocks,
    router_logits_ref,
)
from hyserve.kernels.triton_activation import relu2_triton
from hyserve.kernels.triton_common import dot_acc, pdl_enter, pdl_release, pdl_wait
from hyserve.kernels.triton_fp8_linear import _e4m3_bits, quantize_rows_triton

CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"
# Token-count buckets: T uses the config of the smallest bucket >= T (the last one beyond it).
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_GEMV_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
_GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
# The A8 (w8a8) form's activation scales: one per row and this many columns (DeepSeek-V3's 1 x 128 tiles)
A8_GROUP = ACT_GROUP


# --------------------------------------------------------------------------- routing


@triton.jit
def _router_gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    E,
    K,
    s_xt,
    s_we,
    s_ot,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,
):
    """logits[t, e] = sum_k x[t, k] * gate[e, k] in float32 for BLOCK_E experts e of token t. The gate's first
    K tile loads before the PDL wait (no kernel writes it)."""
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    me = offs_e < E
    rows = tl.minimum(offs_e, E - 1)  # clamped rows: weight loads need no row mask
    offs_k = tl.arange(0, BLOCK_K)
    km0 = offs_k < K
    w0 = tl.load(w_ptr + rows[:, None] * s_we + offs_k[None, :], mask=km0[None, :], other=0.0).to(tl.float32)
    pdl_enter(PDL)
    part = w0 * tl.load(x_ptr + t * s_xt + offs_k, mask=km0, other=0.0).to(tl.float32)[None, :]
    for k0 in tl.range(BLOCK_K, K, BLOCK_K, num_stages=NUM_STAGES):
        kk = k0 + offs_k
        km = kk < K
        xv = tl.load(x_ptr + t * s_xt + kk, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows[:, None] * s_we + kk[None, :], mask=km[None, :], other=0.0).to(tl.float32)
        part += w * xv[None, :]
    tl.store(out_ptr + t * s_ot + offs_e, tl.sum(part, axis=1), mask=me)


# Few tokens: the GEMV kernel; from here on F.linear in float32 (a GEMM shares each weight read).
ROUTER_GEMV_MAX_TOKENS = 4


def router_settings(on_gpu: bool) -> dict[str, int]:
    """The gate GEMV's launch settings: 2 experts a program (64 programs for 128 experts, each streaming
    two float32 rows), or small tiles for the interpreter."""
    if on_gpu:
        return dict(BLOCK_E=2, BLOCK_K=1024, num_warps=4, num_stages=3)
    return dict(BLOCK_E=4, BLOCK_K=32, num_warps=1, num_stages=1)


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, d] (16 or 32 bit); weight: [E, d] float32 -> logits [T, E] float32 (router_logits_ref)."""
    T = x.shape[0] if x.dim() == 2 else -1
    if (
        T < 1
        or T > ROUTER_GEMV_MAX_TOKENS
        or weight.dtype != torch.float32
        or weight.dim() != 2
        or weight.shape[1] != x.shape[1]
        or x.stride(1) != 1
        or weight.stride(1) != 1
    ):
        return router_logits_ref(x, weight)
    E, K = weight.shape
    out = torch.empty(T, E, dtype=torch.float32, device=x.device)
    cfg = router_settings(x.is_cuda)
    stages = cfg.pop("num_stages")
    _router_gemv_kernel[(T, triton.cdiv(E, cfg["BLOCK_E"]))](
        x,
        weight,
        out,
        E,
        K,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        NUM_STAGES=stages,
        **cfg,
        **pdl(x),
    )
    return out


@triton.jit
def _route_kernel(
    logit_ptr,
    bias_ptr,
    w_ptr,
    id_ptr,
    s_lt,
    scale,
    PER: tl.constexpr,
    TOP_K: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
    G_PAD: tl.constexpr,
    PER_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, G_PAD)
    j = tl.arange(0, PER_PAD)
    valid = (g[:, None] < N_GROUP) & (j[None, :] < PER)
    e = g[:, None] * PER + j[None, :]  # [G_PAD, PER_PAD] expert ids
    logit = tl.load(logit_ptr + t * s_lt + e, mask=valid, other=0.0).to(tl.float32)
    score = tl.sigmoid(logit)
    choice = score + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if N_GROUP > 1:  # group-limited: keep the TOPK_GROUP groups with the largest top-2 sums
        a1 = tl.argmax(choice, axis=1)
        m1 = tl.max(choice, axis=1)
        m2 = tl.max(tl.where(j[None, :] == a1[:, None], float("-inf"), choice), axis=1)
        gs = tl.where(g < N_GROUP, m1 + m2, float("-inf"))
        keep = g < 0
        for _i in tl.static_range(TOPK_GROUP):
            gi = tl.argmax(gs, axis=0)
            keep = keep | (g == gi)
            gs = tl.where(g == gi, float("-inf"), gs)
        choice = tl.where(keep[:, None], choice, float("-inf"))
    flat_c = tl.reshape(choice, [G_PAD * PER_PAD])
    flat_s = tl.reshape(score, [G_PAD * PER_PAD])
    flat_e = tl.reshape(e, [G_PAD * PER_PAD])
    f = tl.arange(0, G_PAD * PER_PAD)
    ks = tl.arange(0, K_PAD)
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    ws = tl.zeros([K_PAD], dtype=tl.float32)
    for i in tl.static_range(TOP_K):  # descending choice order, lowest id on ties (as torch.topk)
        a = tl.argmax(flat_c, axis=0)
        sel = f == a
        ws = tl.where(ks == i, tl.sum(tl.where(sel, flat_s, 0.0), axis=0), ws)
        ids = tl.where(ks == i, tl.sum(tl.where(sel, flat_e, 0), axis=0), ids)
        flat_c = tl.where(sel, float("-inf"), flat_c)
    if NORM:
        ws = ws / (tl.sum(ws, axis=0) + 1e-20)
    km = ks < TOP_K
    tl.store(w_ptr + t * TOP_K + ks, ws * scale, mask=km)
    tl.store(id_ptr + t * TOP_K + ks, ids, mask=km)


def moe_route_triton(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] float32; bias: [E] -> (weights [T, k] float32, ids [T, k] int32) (moe_route_ref)."""
    _check_route_args(logits, bias, top_k, n_group, topk_group)
    T, E = logits.shape
    lg = logits.float()
    if lg.stride(1) != 1:
        lg = lg.contiguous()
    grouped = n_group > 1 and topk_group < n_group
    G = n_group if grouped else 1
    w = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T:
        _route_kernel[(T,)](
            lg,
            bias.float().contiguous(),
            w,
            ids,
            lg.stride(0),
            float(routed_scaling_factor),
            PER=E // G,
            TOP_K=top_k,
            N_GROUP=G,
            TOPK_GROUP=topk_group if grouped else 1,
            NORM=bool(norm_topk_prob),
            G_PAD=triton.next_power_of_2(G),
            PER_PAD=triton.next_power_of_2(E // G),
            K_PAD=triton.next_power_of_2(top_k),
            num_warps=4 if E >= 256 else 1,
            **pdl(lg),
        )
    return w, ids


# --------------------------------------------------------------------------- align (sort by expert)


@triton.jit(do_not_specialize=["n", "P", "fill_per"])
def _align_count_kernel(
    ids_ptr,
    cnt_ptr,
    sorted_ptr,
    n,
    P,
    fill_per,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
    PDL: tl.constexpr,
):
    """Histogram of chunk pid's pairs -> cnt[pid, :]; fills its share of sorted_ids with the pad value n."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    m = offs < n
    v = tl.load(ids_ptr + offs, mask=m, other=0).to(tl.int32)
    eo = tl.arange(0, E_PAD)
    h = tl.histogram(v, E_PAD) - tl.where(eo == 0, CHUNK - tl.sum(m.to(tl.int32), axis=0), 0)
    tl.store(cnt_ptr + pid * E_PAD + eo, h)
    fo = tl.arange(0, FILL)
    pad = tl.zeros([FILL], dtype=tl.int32) + n
    for f0 in range(0, fill_per, FILL):
        idx = pid * fill_per + f0 + fo
        tl.store(sorted_ptr + idx, pad, mask=(idx < P) & (f0 + fo < fill_per))


@triton.jit(do_not_specialize=["nprog", "nb"])
def _align_offsets_kernel(
    cnt_ptr,
    starts_ptr,
    eid_ptr,
    npad_ptr,
    nprog,
    nb,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr,
    BB: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program: cnt[p, e] becomes the count of expert e in chunks before p; starts[e] = padded start
    of expert e's run; num_tokens_post_pad; expert id of every block (-1 past the end)."""
    pdl_enter(PDL)
    eo = tl.arange(0, E_PAD)
    real = eo < E
    ro = tl.arange(0, ROWS)
    running = tl.zeros([E_PAD], dtype=tl.int32)
    for r0 in range(0, nprog, ROWS):
        rr = r0 + ro
        rm = (rr < nprog)[:, None]
        ptrs = cnt_ptr + rr[:, None] * E_PAD + eo[None, :]
        c = tl.load(ptrs, mask=rm, other=0)
        tl.store(ptrs, running[None, :] + tl.cumsum(c, axis=0) - c, mask=rm)
        running += tl.sum(c, axis=0)
    padded = tl.where(real, (running + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(starts_ptr + eo, ends - padded)
    tl.store(npad_ptr, total)
    bo = tl.arange(0, BB)
    for b0 in range(0, nb, BB):
        blk = b0 + bo
        bs = blk * BLOCK_M
        done = tl.sum(((ends[None, :] <= bs[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(eid_ptr + blk, tl.where(bs < total, done, -1), mask=blk < nb)


@triton.jit(do_not_specialize=["n"])
def _align_scatter_kernel(
    ids_ptr,
    pre_ptr,
    starts_ptr,
    sorted_ptr,
    n,
    E_PAD: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Chunk pid's pairs to their slots, in order: slot = start of the expert's run + pairs of that
    expert in earlier chunks + rank inside this chunk (a cumsum over the one-hot [SUB, E_PAD] tile)."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    eo = tl.arange(0, E_PAD)
    run = tl.load(pre_ptr + pid * E_PAD + eo) + tl.load(starts_ptr + eo)
    so = tl.arange(0, SUB)
    for s0 in range(0, CHUNK, SUB):
        offs = pid * CHUNK + s0 + so
        m = offs < n
        v = tl.load(ids_ptr + offs, mask=m, other=E_PAD).to(tl.int32)  # E_PAD matches no expert
        oh = (v[:, None] == eo[None, :]).to(tl.int32)
        rank = tl.sum(tl.cumsum(oh, axis=0) * oh, axis=1) - 1
        base = tl.sum(oh * run[None, :], axis=1)
        tl.store(sorted_ptr + base + rank, offs, mask=m)
        run += tl.sum(oh, axis=0)


def moe_align_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids: [T, k] -> (sorted_ids [P], expert_ids [P / block_m], num_tokens_post_pad [1]), int32,
    as moe_align_ref (the same order). Three launches, no host sync, sizes fixed by T, k, E, block_m."""
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"moe_align: expert ids must be int32 or int64, got {topk_ids.dtype}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"moe_align: block_m must be a power of two >= 16, got {block_m}")
    flat = topk_ids.reshape(-1).contiguous()
    n = flat.numel()
    dev = flat.device
    nb = moe_max_blocks(n, num_experts, block_m)
    P = nb * block_m
    sorted_ids = torch.empty(P, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(nb, dtype=torch.int32, device=dev)
    npad = torch.empty(1, dtype=torch.int32, device=dev)
    if n == 0:
        npad.zero_()
        return sorted_ids, expert_ids, npad
    E_PAD = max(16, triton.next_power_of_2(num_experts))
    gpu = flat.is_cuda
    CHUNK = 256 if gpu else 32
    SUB = max(8, min(CHUNK, 8192 // E_PAD)) if gpu else 16
    nprog = triton.cdiv(n, CHUNK)
    cnt = torch.empty(nprog, E_PAD, dtype=torch.int32, device=dev)
    starts = torch.empty(E_PAD, dtype=torch.int32, device=dev)
    fill_per = triton.cdiv(P, nprog)
    _align_count_kernel[(nprog,)](
        flat,
        cnt,
        sorted_ids,
        n,
        P,
        fill_per,
        E_PAD=E_PAD,
        CHUNK=CHUNK,
        FILL=1024 if gpu else 64,
        num_warps=4,
        **pdl(flat),
    )
    _align_offsets_kernel[(1,)](
        cnt,
        starts,
        expert_ids,
        npad,
        nprog,
        nb,
        E=num_experts,
        E_PAD=E_PAD,
        BLOCK_M=block_m,
        ROWS=max(1, min(16, 16384 // E_PAD)),
        BB=max(1, min(64, 16384 // E_PAD)),
        num_warps=8 if gpu else 1,
        **pdl(flat),
    )
    _align_scatter_kernel[(nprog,)](
        flat, cnt, starts, sorted_ids, n, E_PAD=E_PAD, CHUNK=CHUNK, SUB=SUB, num_warps=4, **pdl(flat)
    )
    return sorted_ids, expert_ids, npad


# --------------------------------------------------------------------------- grouped GEMMs


@triton.jit
def _tile(pid, num_m, num_n, group_m):
    """Grouped ordering: GROUP_M consecutive M blocks share each N tile (its weight tile stays in L2)."""
    per_group = group_m * num_n
    first_m = (pid // per_group) * group_m
    size_m = tl.minimum(num_m - first_m, group_m)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def _expert_tile(
    a_ptr,
    s_am,
    a_rows,
    a_valid,
    w_ptr,
    s_wn,
    offs_n,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    W_FP8: tl.constexpr,
    SWAP: tl.constexpr,
    MASK_ROWS: tl.constexpr,
):
    """float32 a[a_rows] @ w[offs_n]^T for one expert (w_ptr at its first row): [BLOCK_M, BLOCK_N], or its
    transpose [BLOCK_N, BLOCK_M] with SWAP. SWAP computes w @ a^T: the weight tile is the dot's first operand,
    which a warp-group MMA reads from registers, so an e4m3 tile converted there (W_FP8) goes straight in;
    unswapped, the converted tile is written back to shared memory for the MMA each step. MASK_ROWS: the
    rows where a_valid is false read zeros (else every row is read)."""
    offs_k = tl.arange(0, BLOCK_K)
    if SWAP:
        a_ptrs = a_ptr + a_rows[None, :] * s_am + offs_k[:, None]
        w_ptrs = w_ptr + offs_n[:, None] * s_wn + offs_k[None, :]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        a_ptrs = a_ptr + a_rows[:, None] * s_am + offs_k[None, :]
        w_ptrs = w_ptr + offs_n[None, :] * s_wn + offs_k[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = offs_k < K - k0
        if SWAP:
            if EVEN_K:
                w = tl.load(w_ptrs)
                if MASK_ROWS:
                    a = tl.load(a_ptrs, mask=a_valid[None, :], other=0.0)
                else:
                    a = tl.load(a_ptrs)
            else:
                w = tl.load(w_ptrs, mask=km[None, :], other=0.0)
                if MASK_ROWS:
                    a = tl.load(a_ptrs, mask=a_valid[None, :] & km[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=km[:, None], other=0.0)
            if W_FP8:
                w = w.to(a.dtype)
            acc = dot_acc(w, a, acc, IEEE)
        else:
            if EVEN_K:
                w = tl.load(w_ptrs)
                if MASK_ROWS:
                    a = tl.load(a_ptrs, mask=a_valid[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs)
            else:
                w = tl.load(w_ptrs, mask=km[:, None], other=0.0)
                if MASK_ROWS:
                    a = tl.load(a_ptrs, mask=a_valid[:, None] & km[None, :], other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
            if W_FP8:
                w = w.to(a.dtype)
            acc = dot_acc(a, w, acc, IEEE)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _a8_tile(
    a_ptr,
    s_am,
    a_rows,
    a_valid,
    w_ptr,
    s_wn,
    offs_n,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    as_ptr,
    s_as,
):
    """_expert_tile's w8a8 form (A8): a holds e4m3 codes with one float32 scale per row and 128 columns,
    as[a_rows, k // 128], and w e4m3 codes; each K tile (BLOCK_K divides 128) is an e4m3 x e4m3 dot of its
    own, scaled by its rows' group scales and added to the float32 accumulator, so Hopper's short e4m3
    accumulator never sums more than one tile. [BLOCK_M, BLOCK_N] float32; the weights' channel scales are
    the caller's."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * s_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * s_wn + offs_k[:, None]
    s_ptrs = as_ptr + a_rows * s_as
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = offs_k < K - k0
        if EVEN_K:
            w = tl.load(w_ptrs)
            if MASK_ROWS:
                a = tl.load(a_ptrs, mask=a_valid[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs)
        else:
            w = tl.load(w_ptrs, mask=km[:, None], other=0.0)
            if MASK_ROWS:
                a = tl.load(a_ptrs, mask=a_valid[:, None] & km[None, :], other=0.0)
            else:
                a = tl.load(a_ptrs, mask=km[None, :], other=0.0)
        if MASK_ROWS:
            sa = tl.load(s_ptrs + k0 // 128, mask=a_valid, other=0.0)
        else:
            sa = tl.load(s_ptrs + k0 // 128)
        acc += tl.dot(a, w, out_dtype=tl.float32) * sa[:, None]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _store_a8(h_ptr, hs_ptr, v, offs_m, n0, N, s_hm, s_hsm, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the float32 tile v [BLOCK_M, BLOCK_N] (columns n0.., n0 a multiple of 128) as
    e4m3 codes (h_ptr: bytes) with one scale per row and 128 columns, amax / 448 (1 for an all-zero group),
    into hs [rows, ceil(N / 128)]: `fp8_linear.quantize_rows_ref(v, 128)` bit for bit. Columns past N are
    left out of the groups' amax and not stored."""
    G: tl.constexpr = BLOCK_N // 128
    cn = n0 + tl.arange(0, BLOCK_N)
    live = cn < N
    v = tl.where(live[None, :], v, 0.0)
    amax = tl.max(tl.reshape(tl.abs(v), (BLOCK_M, G, 128)), axis=2)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    q = tl.math.div_rn(tl.reshape(v, (BLOCK_M, G, 128)), scale[:, :, None])
    q = tl.reshape(tl.minimum(tl.maximum(q, -448.0), 448.0), (BLOCK_M, BLOCK_N))
    rows = offs_m.to(tl.int64)
    tl.store(h_ptr + rows[:, None] * s_hm + cn[None, :], _e4m3_bits(q), mask=live[None, :])
    g = n0 // 128 + tl.arange(0, G)
    tl.store(hs_ptr + rows[:, None] * s_hsm + g[None, :], scale, mask=(g * 128 < N)[None, :])


@triton.jit
def _tile_out(v, SWAP: tl.constexpr):
    """A tile's per-row (SWAP: per-column) values broadcast over its other axis."""
    if SWAP:
        r = v[None, :]
    else:
        r = v[:, None]
    return r


@triton.jit
def _tile_col(v, SWAP: tl.constexpr):
    """A tile's per-output-channel values broadcast over its rows."""
    if SWAP:
        r = v[:, None]
    else:
        r = v[None, :]
    return r


@triton.jit(do_not_specialize=["num_pairs", "nb", "group_m"])
def _up_gemm_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    sorted_ptr,
    eid_ptr,
    npad_ptr,
    num_pairs,
    nb,
    N,
    K,
    group_m,
    s_xt,
    s_we,
    s_wn,
    s_hm,
    sc_ptr,
    xs_ptr,
    s_xs,
    hs_ptr,
    s_hs,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    W_FP8: tl.constexpr,
    SWAP: tl.constexpr,
    GATED: tl.constexpr,
    A8: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[r, n] = relu(x[sorted_ids[r] // k] @ w_up[e]^T)^2 for the rows r of block pid_m (0 for padding).
    W_FP8: e4m3 weight tiles converted to x's dtype for the dot (exact), the expert's channel scales
    sc[e, n] applied to the accumulator before relu^2. SWAP: the tile is formed transposed (_expert_tile).
    GATED (SiLU-gated experts, w_up [E, 2N, K] of [gate | up] rows, W_FP8 scales [E, 2N]): h = silu(x @
    gate^T) * (x @ up^T). A8 (w8a8): x holds e4m3 codes with scales xs [T, K / 128] (_a8_tile), and h is
    stored as e4m3 codes (h_ptr: bytes) with scales hs [rows, N / 128] (_store_a8) for the down GEMM."""
    pdl_enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), nb, tl.cdiv(N, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(eid_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)
    valid = rows < num_pairs
    tok = tl.where(valid, rows // TOP_K, 0).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N  # wrapped columns: loads need no mask
    if A8:
        acc = _a8_tile(
            x_ptr, s_xt, tok, valid, w_ptr + e * s_we, s_wn, offs_n, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
            True, xs_ptr, s_xs,
        )  # fmt: skip
    else:
        acc = _expert_tile(
            x_ptr, s_xt, tok, valid, w_ptr + e * s_we, s_wn, offs_n, K, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
            IEEE, W_FP8, SWAP, True,
        )  # fmt: skip
    if GATED:  # the up rows follow the N gate rows (and their scales the gate rows' scales)
        if A8:
            up = _a8_tile(
                x_ptr, s_xt, tok, valid, w_ptr + e * s_we + N * s_wn, s_wn, offs_n, K, BLOCK_M, BLOCK_N,
                BLOCK_K, EVEN_K, True, xs_ptr, s_xs,
            )  # fmt: skip
        else:
            up = _expert_tile(
                x_ptr, s_xt, tok, valid, w_ptr + e * s_we + N * s_wn, s_wn, offs_n, K, BLOCK_M, BLOCK_N,
                BLOCK_K, EVEN_K, IEEE, W_FP8, SWAP, True,
            )  # fmt: skip
        if W_FP8:
            acc = acc * _tile_col(tl.load(sc_ptr + e * 2 * N + offs_n), SWAP)
            up = up * _tile_col(tl.load(sc_ptr + e * 2 * N + N + offs_n), SWAP)
        acc = acc * tl.sigmoid(acc) * up
    else:
        if W_FP8:
            acc = acc * _tile_col(tl.load(sc_ptr + e * N + offs_n), SWAP)
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if A8:
        _store_a8(h_ptr, hs_ptr, acc, offs_m, pid_n * BLOCK_N, N, s_hm, s_hs, BLOCK_M, BLOCK_N)
    else:
        cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        h_ptrs = h_ptr + _tile_out(offs_m.to(tl.int64) * s_hm, SWAP) + _tile_col(cn, SWAP)
        tl.store(h_ptrs, acc.to(h_ptr.dtype.element_ty), mask=_tile_col(cn < N, SWAP))


@triton.jit(do_not_specialize=["num_pairs", "nb", "group_m"])
def _down_gemm_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    tw_ptr,
    sorted_ptr,
    eid_ptr,
    npad_ptr,
    num_pairs,
    nb,
    N,
    K,
    group_m,
    s_hm,
    s_we,
    s_wn,
    s_ym,
    sc_ptr,
    hs_ptr,
    s_hs,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    W_FP8: tl.constexpr,
    SWAP: tl.constexpr,
    A8: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[p, n] = topk_w.flat[p] * (h[r] @ w_down[e]^T) for the real rows r (pair p) of block pid_m (W_FP8:
    as in the up GEMM, the channel scales before the routing weight; SWAP: as in the up GEMM; A8: h holds
    e4m3 codes with scales hs [rows, K / 128], as the up GEMM's A8 form stores them)."""
    pdl_enter(PDL)
    pid_m, pid_n = _tile(tl.program_id(0), nb, tl.cdiv(N, BLOCK_N), group_m)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    e = tl.load(eid_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + offs_m)
    valid = rows < num_pairs
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    # every row of h is read: the up GEMM wrote the padded ones too
    if A8:
        acc = _a8_tile(
            h_ptr, s_hm, offs_m.to(tl.int64), valid, w_ptr + e * s_we, s_wn, offs_n, K, BLOCK_M, BLOCK_N,
            BLOCK_K, EVEN_K, False, hs_ptr, s_hs,
        )  # fmt: skip
    else:
        acc = _expert_tile(
            h_ptr, s_hm, offs_m.to(tl.int64), valid, w_ptr + e * s_we, s_wn, offs_n, K, BLOCK_M, BLOCK_N,
            BLOCK_K, EVEN_K, IEEE, W_FP8, SWAP, False,
        )  # fmt: skip
    if W_FP8:
        acc = acc * _tile_col(tl.load(sc_ptr + e * N + offs_n), SWAP)
    acc = acc * _tile_out(tl.load(tw_ptr + rows, mask=valid, other=0.0).to(tl.float32), SWAP)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    y_ptrs = y_ptr + _tile_out(tl.where(valid, rows, 0).to(tl.int64) * s_ym, SWAP) + _tile_col(cn, SWAP)
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=_tile_out(valid, SWAP) & _tile_col(cn < N, SWAP))


@triton.jit
def _combine_kernel(
    y_ptr,
    extra_ptr,
    out_ptr,
    N,
    s_ym,
    s_et,
    s_ot,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_EXTRA: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = sum over the token's k rows of y (+ its row of extra: the shared expert), in float32, in slot
    order, rounded once."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = cn < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in tl.static_range(TOP_K):
        acc += tl.load(y_ptr + (t * TOP_K + s) * s_ym + cn, mask=m, other=0.0).to(tl.float32)
    if HAS_EXTRA:
        acc += tl.load(extra_ptr + t * s_et + cn, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_ot + cn, acc.to(out_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- decode GEMVs


@triton.jit
def _k_load(ptrs, kk, K, EVEN_K: tl.constexpr):
    """`ptrs` (last axis along kk) loaded, masked past K unless EVEN_K."""
    if EVEN_K:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=kk < K, other=0.0)


@triton.jit
def _gemv_tile(v_row, w_rows, kk, K, EVEN_K: tl.constexpr):
    """K tile `kk` of a vector row and of the BLOCK_N weight rows `w_rows` ([BLOCK_N, 1] pointers), masked
    past K unless EVEN_K."""
    return _k_load(v_row + kk, kk, K, EVEN_K), _k_load(w_rows + kk[None, :], kk, K, EVEN_K)


@triton.jit
def _rows_dot(
    v_row,
    w_rows,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    """float32 [BLOCK_N]: the weight rows `w_rows` ([BLOCK_N, 1] pointers) times the vector row `v_row`
    over K, one pipelined loop of BLOCK_K tiles, reduced over K once after it."""
    offs_k = tl.arange(0, BLOCK_K)
    part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        v, w = _gemv_tile(v_row, w_rows, k0 + offs_k, K, EVEN_K)
        part += w.to(tl.float32) * v.to(tl.float32)[None, :]
    return tl.sum(part, axis=1)


@triton.jit
def _slot_part(w, hv, ws, sc_ptr, e, N, offs_n, W_FP8: tl.constexpr):
    """One (slot, K tile) of the down GEMV's flat loop: the weight tile times h scaled by the slot's routing
    weight, an FP8 expert's rows times their channel scales."""
    wf = w.to(tl.float32)
    if W_FP8:  # the slot's expert changes along the loop: scale its rows as they load
        wf = wf * tl.load(sc_ptr + e * N + offs_n)[:, None]
    return wf * (hv.to(tl.float32) * ws)[None, :]


@triton.jit(do_not_specialize=["n_routed"])
def _up_gemv_kernel(
    x_ptr,
    w_ptr,
    ids_ptr,
    h_ptr,
    su_ptr,
    N,
    K,
    n_routed,
    s_xt,
    s_we,
    s_wn,
    s_hm,
    sc_ptr,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    W_FP8: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[p, n] = relu(w_up[ids[p]] @ x[p // k])^2 for BLOCK_N columns n: the pair's expert only. Rows
    p >= n_routed (= T*k) are the shared expert's: chunk j = q % S of token q // S, q = p - n_routed,
    its up rows j*N .. j*N + N (SHARED = S, and 1 without a shared expert, when no such row exists).
    W_FP8: e4m3 expert rows, the expert's channel scale sc[e, n] on the sum before relu^2 (FP8 experts
    come without a folded shared expert).
    One program per (row, BLOCK_N columns) over a 1-D grid of n_rows rows (n_routed + the shared rows) x
    the column blocks.
    EARLY = 0: program i takes row i % n_rows of column block i // n_rows, and every program waits for the
    kernel before it (the route, which writes ids). EARLY = 1: the shared rows come first in the grid
    (program i: row i // column blocks), release the next kernel at once and wait only before their store:
    they read only x and the shared weights, and x was written before the route kernel passed its own wait
    (the router between them waited for it), so under PDL their reads and products run while the route
    still runs. This rests on how PDL schedules blocks (a kernel's blocks start only after every block of the
    one before released, each after its wait), not on a documented promise of griddepcontrol.wait, which
    speaks of the kernels still in flight. The precondition is the caller's: x must not be the output of the
    kernel right before this one (`moe_experts_triton` turns EARLY off when it had to copy x). The store
    waits: h is fresh from the caching allocator, which may hand out memory freed by a tensor the route
    kernel is still reading (its logits). The routed rows wait first, for ids, and release after it, so the
    down GEMV still starts after the route has finished."""
    pid = tl.program_id(0)
    ncb = tl.cdiv(N, BLOCK_N)
    n_rows = tl.num_programs(0) // ncb
    n_sh = n_rows - n_routed
    if EARLY:
        r = pid // ncb
        cb = pid - r * ncb
        shared_row = r < n_sh
        p = tl.where(shared_row, n_routed + r, r - n_sh).to(tl.int64)
    else:
        p = (pid % n_rows).to(tl.int64)
        cb = pid // n_rows
        shared_row = p >= n_routed
    cn = cb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.minimum(cn, N - 1)  # clamped rows: loads need no mask
    if shared_row:
        if EARLY:
            pdl_release(
                PDL
            )  # the routed rows release after their wait, so the down GEMV still follows the route
        else:
            pdl_enter(PDL)
        q = p - n_routed
        x_row = x_ptr + (q // SHARED) * s_xt
        w_base = su_ptr + (q % SHARED) * N * s_wn
        sc_row = sc_ptr
    else:
        pdl_enter(PDL)
        e = tl.load(ids_ptr + p).to(tl.int64)
        x_row = x_ptr + (p // TOP_K) * s_xt
        w_base = w_ptr + e * s_we
        sc_row = sc_ptr + e * N
    acc = _rows_dot(x_row, w_base + offs_n[:, None] * s_wn, K, BLOCK_N, BLOCK_K, EVEN_K, NUM_STAGES)
    if W_FP8:
        acc = acc * tl.load(sc_row + offs_n)
    acc = tl.maximum(acc, 0.0)
    if EARLY:
        if (
            shared_row
        ):  # only now: h may lie in memory the allocator took back from what the route still reads
            pdl_wait(PDL)
    tl.store(h_ptr + p * s_hm + cn, (acc * acc).to(h_ptr.dtype.element_ty), mask=cn < N)


@triton.jit(do_not_specialize=["n_routed"])
def _down_gemv_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    tw_ptr,
    out_ptr,
    sd_ptr,
    N,
    K,
    n_routed,
    s_hm,
    s_we,
    s_wn,
    s_ot,
    s_sdn,
    sc_ptr,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    FLAT: tl.constexpr,
    W_FP8: tl.constexpr,
    EARLY: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, n] = sum_s topk_w[t, s] * (w_down[ids[t, s]] @ h[t*k + s])[n]: the combine in registers.
    FLAT walks the token's (slot, K tile) pairs as one pipelined loop (h pre-scaled by the slot's weight),
    so the loads do not drain at every expert; otherwise one K loop per slot. SHARED > 0: the shared
    expert too, sum_j shared_down[:, j*K : j*K + K] @ h[n_routed + t*S + j] with weight 1, as S more slots
    of the flat loop, or in a second loop after the nested ones.
    W_FP8: each expert's e4m3 rows times its channel scales sc[e, n] (no shared expert with FP8).
    EARLY (FLAT only): slot 0's expert id, weight and first weight tile load before the PDL wait, which
    only h (the up GEMV's output) needs: ids and tw were written before the up GEMV passed its own wait, and
    this kernel's blocks are scheduled only after every up-GEMV block has passed it."""
    t = tl.program_id(0).to(tl.int64)
    cn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.minimum(cn, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    if FLAT:
        # slots TOP_K .. TOP_K + SHARED - 1 are the shared expert's chunks (weight 1), in the same pipelined
        # loop: the loads stream on from the routed experts into the shared one without a drain
        kt = tl.cdiv(K, BLOCK_K)
        part = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if EARLY:  # iteration 0 (slot 0, K tile 0), its weight loaded before the wait
            p0 = t * TOP_K
            e0 = tl.load(ids_ptr + p0).to(tl.int64)
            w0 = _k_load(w_ptr + e0 * s_we + offs_n[:, None] * s_wn + offs_k[None, :], offs_k, K, EVEN_K)
            ws0 = tl.load(tw_ptr + p0).to(tl.float32)
            pdl_enter(PDL)
            part += _slot_part(
                w0, _k_load(h_ptr + p0 * s_hm + offs_k, offs_k, K, EVEN_K), ws0, sc_ptr, e0, N, offs_n, W_FP8
            )
        else:
            pdl_enter(PDL)
        for it in tl.range(1 if EARLY else 0, (TOP_K + SHARED) * kt, num_stages=NUM_STAGES):
            s = it // kt
            kk = (it - s * kt) * BLOCK_K + offs_k
            routed = s < TOP_K
            p = t * TOP_K + tl.minimum(s, TOP_K - 1)
            e = tl.load(ids_ptr + p).to(tl.int64)
            ws = tl.where(routed, tl.load(tw_ptr + p).to(tl.float32), 1.0)
            j = tl.maximum(s - TOP_K, 0)
            h_row = tl.where(routed, h_ptr + p * s_hm, h_ptr + (n_routed + t * SHARED + j) * s_hm)
            w_rows = tl.where(
                routed, w_ptr + e * s_we + offs_n[:, None] * s_wn, sd_ptr + offs_n[:, None] * s_sdn + j * K
            )
            hv, w = _gemv_tile(h_row, w_rows, kk, K, EVEN_K)
            part += _slot_part(w, hv, ws, sc_ptr, e, N, offs_n, W_FP8)
        out = tl.sum(part, axis=1)
    else:
        pdl_enter(PDL)
        out = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in range(TOP_K):
            p = t * TOP_K + s
            e = tl.load(ids_ptr + p).to(tl.int64)
            h_row = h_ptr + p * s_hm
            r = _rows_dot(
                h_row, w_ptr + e * s_we + offs_n[:, None] * s_wn, K, BLOCK_N, BLOCK_K, EVEN_K, NUM_STAGES
            )
            if W_FP8:
                r = r * tl.load(sc_ptr + e * N + offs_n)
            out += tl.load(tw_ptr + p).to(tl.float32) * r
    if SHARED > 0 and not FLAT:
        kt_s = tl.cdiv(K, BLOCK_K)
        part_s = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for it in tl.range(0, SHARED * kt_s, num_stages=NUM_STAGES):
            j = it // kt_s
            kk = (it - j * kt_s) * BLOCK_K + offs_k
            h_row = h_ptr + (n_routed + t * SHARED + j) * s_hm
            hv, w = _gemv_tile(h_row, sd_ptr + offs_n[:, None] * s_sdn + j * K, kk, K, EVEN_K)
            part_s += w.to(tl.float32) * hv.to(tl.float32)[None, :]
        out += tl.sum(part_s, axis=1)
    tl.store(out_ptr + t * s_ot + cn, out.to(out_ptr.dtype.element_ty), mask=cn < N)


@triton.jit(do_not_specialize=["n_routed"])
def _down_split_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    tw_ptr,
    y_ptr,
    sd_ptr,
    N,
    K,
    n_routed,
    s_hm,
    s_we,
    s_wn,
    s_ym,
    s_sdn,
    sc_ptr,
    TOP_K: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    W_FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """The down GEMV split by slot (config down.SPLIT): y[r, n] = ws * (W_s @ h_s)[n] in float32 for row
    r = t * (TOP_K + SHARED) + s, slot s of token t: a routed slot's expert w_down[ids[t, s]] on h row
    t*k + s, weighted by topk_w[t, s] (an FP8 expert's channel scales on the sum); a shared slot
    (s = TOP_K + j) the shared expert's columns j*K .. j*K + K on h row n_routed + t*SHARED + j, weight 1.
    `_combine_kernel` then sums each token's TOP_K + SHARED rows in slot order. Laid out like the up GEMV
    (program i: row i % n_rows of column block i // n_rows, a K loop over one expert's rows), so many short
    programs stream the experts instead of one long walk over every slot per output column."""
    pid = tl.program_id(0)
    n_rows = tl.num_programs(0) // tl.cdiv(N, BLOCK_N)
    r = (pid % n_rows).to(tl.int64)
    cn = (pid // n_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.minimum(cn, N - 1)  # clamped rows: loads need no mask
    t = r // (TOP_K + SHARED)
    s = r - t * (TOP_K + SHARED)
    pdl_enter(PDL)
    if s < TOP_K:
        p = t * TOP_K + s
        e = tl.load(ids_ptr + p).to(tl.int64)
        h_row = h_ptr + p * s_hm
        w_rows = w_ptr + e * s_we + offs_n[:, None] * s_wn
        ws = tl.load(tw_ptr + p).to(tl.float32)
    else:
        e = tl.zeros([], dtype=tl.int64)  # an FP8 model folds no shared expert: its scale is never read here
        h_row = h_ptr + (n_routed + t * SHARED + (s - TOP_K)) * s_hm
        w_rows = sd_ptr + offs_n[:, None] * s_sdn + (s - TOP_K) * K
        ws = tl.full([], 1.0, dtype=tl.float32)
    acc = _rows_dot(h_row, w_rows, K, BLOCK_N, BLOCK_K, EVEN_K, NUM_STAGES)
    if W_FP8:
        acc = acc * tl.load(sc_ptr + e * N + offs_n)
    tl.store(y_ptr + r * s_ym + cn, acc * ws, mask=cn < N)


# --------------------------------------------------------------------------- configs


def shape_key(num_experts: int, inter: int, hidden: int, fp8: bool = False) -> str:
    """Config-file key of a layer: E experts of up [N=inter, K=hidden] (down is its transpose); e4m3 experts
    (one byte a weight, so other tiles may win) under their own key with ",w=fp8"."""
    return f"E={num_experts},N={inter},K={hidden}" + (",w=fp8" if fp8 else "")


def _device_file(device_name: str) -> Path:
    return device_file(CONFIG_DIR, device_name)


def validate_config(cfg: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """A tile config is {"variant": "gemv", "up": {...}, "down": {...}} or {"variant": "gemm", "BLOCK_M":
    16..256, "up": {...}, "down": {...}} (gemv's down may add FLAT: 0/1 or SPLIT: 0/1, and gemv's up and down
    EARLY: 0/1, default 0, which `benchmarks/bench_moe_decode.py --write` sets where it measured faster: see
    _up_gemv_kernel / _down_gemv_kernel / _down_split_kernel; gemm's up and down may add SWAP: 0/1, default
    0: the tile formed transposed, see _expert_tile; gemm may add A8: 0/1, default 0, FP8 experts' w8a8 form,
    whose up BLOCK_N is a multiple of 128 and whose BLOCK_Ks divide 128, with no SWAP); raises
    ValueError naming the missing or bad field."""
    variant = cfg.get("variant")
    if variant not in ("gemv", "gemm"):
        raise ValueError(f"{where}: variant must be 'gemv' or 'gemm', got {variant!r}")
    _validate_a8(cfg, where)
    keys = _GEMV_KEYS if variant == "gemv" else _GEMM_KEYS
    if variant == "gemm":
        bm = cfg.get("BLOCK_M")
        if not isinstance(bm, int) or bm < 16 or bm > 256 or bm & (bm - 1):
            raise ValueError(f"{where}: BLOCK_M must be a power of two in [16, 256], got {bm!r}")
    for part in ("up", "down"):
        sub = cfg.get(part)
        if not isinstance(sub, dict):
            raise ValueError(f"{where}: missing the {part!r} settings")
        for k in keys:
            v = sub.get(k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{where}: {part}.{k} must be a positive integer, got {v!r}")
        for k in ("BLOCK_N", "BLOCK_K"):
            if sub[k] & (sub[k] - 1) or (variant == "gemm" and sub[k] < 16):
                raise ValueError(f"{where}: {part}.{k} must be a power of two (>= 16 for gemm), got {sub[k]}")
        for flag in ("FLAT", "EARLY"):
            if sub.get(flag, 0) not in (0, 1):
                raise ValueError(f"{where}: {part}.{flag} must be 0 or 1, got {sub[flag]!r}")
        if sub.get("EARLY", 0) and (variant != "gemv" or (part == "down" and not sub.get("FLAT", 0))):
            raise ValueError(
                f"{where}: {part}.EARLY applies to the gemv variant only, and to its down GEMV with FLAT = 1"
            )
        if sub.get("SWAP", 0) not in (0, 1):
            raise ValueError(f"{where}: {part}.SWAP must be 0 or 1, got {sub['SWAP']!r}")
        if sub.get("SWAP", 0) and variant != "gemm":
            raise ValueError(f"{where}: {part}.SWAP applies to the gemm variant only")
        if sub.get("SPLIT", 0) not in (0, 1):
            raise ValueError(f"{where}: {part}.SPLIT must be 0 or 1, got {sub['SPLIT']!r}")
        if sub.get("SPLIT", 0) and (variant != "gemv" or part != "down" or sub.get("FLAT", 0)):
            raise ValueError(
                f"{where}: {part}.SPLIT applies to the gemv variant's down GEMV only, with FLAT = 0 "
                "(the split form has no flat loop)"
            )
    return cfg


def _validate_a8(cfg: dict[str, Any], where: str) -> None:
    a8 = cfg.get("A8", 0)
    if a8 not in (0, 1):
        raise ValueError(f"{where}: A8 must be 0 or 1, got {a8!r}")
    if not a8:
        return
    up, dn = cfg.get("up") or {}, cfg.get("down") or {}
    bad = (
        "the gemm variant" if cfg.get("variant") != "gemm"
        else "an up BLOCK_N that is a multiple of 128" if up.get("BLOCK_N", 0) % A8_GROUP
        else "BLOCK_Ks that divide 128" if A8_GROUP % up.get("BLOCK_K", 1) or A8_GROUP % dn.get("BLOCK_K", 1)
        else "SWAP = 0" if up.get("SWAP", 0) or dn.get("SWAP", 0)
        else None
    )  # fmt: skip
    if bad is not None:
        raise ValueError(f"{where}: A8 = 1 (the w8a8 expert form) needs {bad}")


@functools.lru_cache(maxsize=8)
def _tuned_table(device_name: str) -> dict[str, dict[str, dict[str, Any]]]:
    path = _device_file(device_name)
    if not path.exists():
        return {}
    doc = json.loads(path.read_text())
    table = doc.get("configs", {})
    for shape, buckets in table.items():
        for b, cfg in buckets.items():
            validate_config(cfg, f"{path.name} [{shape}][{b}]")
    return table


def token_bucket(num_tokens: int) -> int:
    for b in TOKEN_BUCKETS:
        if num_tokens <= b:
            return b
    return TOKEN_BUCKETS[-1]


def moe_token_buckets(max_num_tokens: int) -> list[int]:
    """One token count per bucket up to max_num_tokens (the bucket's bound, or max_num_tokens for the
    bucket that holds it): a warm-up forward at each compiles every MoE kernel variant serving can use."""
    if max_num_tokens < 1:
        raise ValueError(f"moe_token_buckets: max_num_tokens must be >= 1, got {max_num_tokens}")
    out: list[int] = []
    lo = 0
    for b in TOKEN_BUCKETS:
        if lo >= max_num_tokens:
            break
        out.append(min(b, max_num_tokens))
        lo = b
    if max_num_tokens > TOKEN_BUCKETS[-1]:
        out.append(max_num_tokens)
    return out


def heuristic_config(
    num_experts: int, inter: int, hidden: int, num_tokens: int, top_k: int
) -> dict[str, Any]:
    """Settings for a shape or GPU without tuned entries: the gemv path for up to 2 tokens, else the grouped
    GEMMs with BLOCK_M sized to the mean pairs per expert."""
    if num_tokens <= 2:
        # the fastest batch-1 settings of the Nano 30B-A3B chain on an untuned GPU (H100, 1303d9a: its
        # moe_decode_1303d9a_h100.md is in git history): short up tiles on 2 warps; the down GEMV one output
        # row a warp, so 2688 programs keep the loads in flight (4 rows on 4 warps: 0.74 of the read
        # ceiling against 0.83)
        return {
            "variant": "gemv",
            "up": dict(BLOCK_N=4, BLOCK_K=128, num_warps=2, num_stages=6),
            "down": dict(BLOCK_N=1, BLOCK_K=512, num_warps=1, num_stages=6, FLAT=1),
        }
    per_expert = num_tokens * top_k / num_experts
    bm = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64 if per_expert <= 128 else 128
    if bm <= 32:
        g = dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4)
    elif bm == 64:
        g = dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4)
    else:
        g = dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)
    return {"variant": "gemm", "BLOCK_M": bm, "up": dict(g), "down": dict(g)}


_INTERPRETER_GEMM = {
    "variant": "gemm",
    "BLOCK_M": 16,
    "up": dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=2, num_warps=1, num_stages=1),
    "down": dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=1, num_warps=1, num_stages=1),
}
_INTERPRETER_GEMV = {
    "variant": "gemv",
    "up": dict(BLOCK_N=32, BLOCK_K=32, num_warps=1, num_stages=1),
    "down": dict(BLOCK_N=32, BLOCK_K=16, num_warps=1, num_stages=1, FLAT=1),
}


def moe_config(
    num_experts: int,
    inter: int,
    hidden: int,
    num_tokens: int,
    top_k: int,
    device: torch.device,
    fp8: bool = False,
) -> dict[str, Any]:
    """The tile config for this layer and token count: the tuned entry for this token bucket and shape on
    this GPU, else on a GPU of the same chip (`_chip_tables`: its own file first), else `heuristic_config`
    of the bucket (the interpreter: small tiles). A bucket the files lack never borrows a neighbour's
    entry: a file holding only the 1-token entry (`bench_moe_decode.py --write` on a GPU without a full
    tuning) must not send 8192-token prefills down the one-token GEMVs. A function of the token bucket
    only, so warming one count per bucket compiles every variant. fp8: e4m3 experts take an FP8 entry
    (`bench_moe.py --tune --fp8`, which may pick the w8a8 form) where a file of the chip has one for the
    bucket, else the 16-bit shape's (the same tiles read half the bytes)."""
    return _bucket_config(
        num_experts, inter, hidden, token_bucket(num_tokens), top_k, device.type, device.index, fp8
    )


@functools.lru_cache(maxsize=8)
def _chip_tables(name: str, arch: str) -> tuple[dict[str, dict[str, dict[str, Any]]], ...]:
    """This GPU's tuned table, then those of the other files measured on the same chip (`same_arch_names`:
    an H200 without an entry takes the H100 SXM's, the same 132 SMs)."""
    return tuple(_tuned_table(n) for n in (name, *same_arch_names(CONFIG_DIR, name, arch)))


@functools.lru_cache(maxsize=1024)
def _bucket_config(
    num_experts: int,
    inter: int,
    hidden: int,
    bucket: int,
    top_k: int,
    dev_type: str,
    dev_index: int | None,
    fp8: bool = False,
) -> dict[str, Any]:
    if dev_type != "cuda":
        return _INTERPRETER_GEMV if bucket <= 2 else _INTERPRETER_GEMM
    tables = _chip_tables(device_name(dev_index), device_arch(dev_index))
    keys = [shape_key(num_experts, inter, hidden, True)] if fp8 else []
    for key in [*keys, shape_key(num_experts, inter, hidden)]:
        for table in tables:
            tuned = table.get(key, {}).get(str(bucket))
            if tuned is not None:
                return tuned
    return heuristic_config(num_experts, inter, hidden, bucket, top_k)


# --------------------------------------------------------------------------- launcher
# One function per launch, so `benchmarks/bench_moe.py --tune` can time each stage on its own.


def _launch(sub: dict[str, Any]) -> dict[str, int]:
    return dict(num_warps=sub["num_warps"], num_stages=sub["num_stages"])


def launch_up_gemv(
    x,
    w_up,
    ids,
    h,
    up: dict[str, Any],
    shared_up: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """h [T*k (+ T*S), I] = relu(x[p // k] @ w_up[ids[p]]^T)^2, then the shared expert's S chunks per token
    (scale: FP8 experts' [E, I] channel scales). With up["EARLY"] under PDL, x must have been written before
    the kernel launched right before this one (see _up_gemv_kernel)."""
    inter, d = w_up.shape[1], w_up.shape[2]
    S = 0 if shared_up is None else shared_up.shape[0] // inter
    n_routed = ids.numel()
    n_rows = n_routed + ids.shape[0] * S
    _up_gemv_kernel[(n_rows * triton.cdiv(inter, up["BLOCK_N"]),)](
        x,
        w_up,
        ids,
        h,
        w_up if shared_up is None else shared_up,
        inter,
        d,
        n_routed,
        x.stride(0),
        w_up.stride(0),
        w_up.stride(1),
        h.stride(0),
        scale if scale is not None else h,
        TOP_K=ids.shape[1],
        SHARED=max(S, 1),
        BLOCK_N=up["BLOCK_N"],
        BLOCK_K=up["BLOCK_K"],
        EVEN_K=d % up["BLOCK_K"] == 0,
        NUM_STAGES=up["num_stages"],
        W_FP8=scale is not None,
        EARLY=bool(up.get("EARLY", 0)),
        num_warps=up["num_warps"],
        **pdl(x),
    )


def _down_operands(
    w_down: torch.Tensor, shared_down: torch.Tensor | None
) -> tuple[int, int, int, torch.Tensor]:
    """(d, I, S, the shared expert's down weight or a stand-in) of a decode down projection: S chunks of the
    routed intermediate size in the shared expert, 0 without one (then w_down stands in, never read)."""
    d, inter = w_down.shape[1], w_down.shape[2]
    if shared_down is None:
        return d, inter, 0, w_down
    return d, inter, shared_down.shape[1] // inter, shared_down


def launch_down_gemv(
    h,
    w_down,
    ids,
    tw,
    out,
    dn: dict[str, Any],
    shared_down: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """out [T, d] = sum_s tw[t, s] * w_down[ids[t, s]] @ h[t*k + s] (+ the shared expert's chunks of h;
    scale: FP8 experts' [E, d] channel scales)."""
    d, inter, S, sd = _down_operands(w_down, shared_down)
    _down_gemv_kernel[(out.shape[0], triton.cdiv(d, dn["BLOCK_N"]))](
        h,
        w_down,
        ids,
        tw,
        out,
        sd,
        d,
        inter,
        ids.numel(),
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        out.stride(0),
        sd.stride(0),
        scale if scale is not None else tw,
        TOP_K=ids.shape[1],
        SHARED=S,
        BLOCK_N=dn["BLOCK_N"],
        BLOCK_K=dn["BLOCK_K"],
        EVEN_K=inter % dn["BLOCK_K"] == 0,
        NUM_STAGES=dn["num_stages"],
        FLAT=bool(dn.get("FLAT", 0)),
        W_FP8=scale is not None,
        EARLY=bool(dn.get("EARLY", 0)),
        num_warps=dn["num_warps"],
        **pdl(h),
    )


def launch_down(
    h,
    w_down,
    ids,
    tw,
    out,
    dn: dict[str, Any],
    shared_down: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """The decode path's down projection and combine into out [T, d]: the down GEMV, or with dn["SPLIT"] the
    per-slot partials (`_down_split_kernel`, float32 [T * (k + S), d]) and the combine kernel."""
    if not dn.get("SPLIT", 0):
        launch_down_gemv(h, w_down, ids, tw, out, dn, shared_down, scale)
        return
    d, inter, S, sd = _down_operands(w_down, shared_down)
    T, k = ids.shape
    y = torch.empty(T * (k + S), d, dtype=torch.float32, device=h.device)
    _down_split_kernel[(T * (k + S) * triton.cdiv(d, dn["BLOCK_N"]),)](
        h,
        w_down,
        ids,
        tw,
        y,
        sd,
        d,
        inter,
        ids.numel(),
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        y.stride(0),
        sd.stride(0),
        scale if scale is not None else tw,
        TOP_K=k,
        SHARED=S,
        BLOCK_N=dn["BLOCK_N"],
        BLOCK_K=dn["BLOCK_K"],
        EVEN_K=inter % dn["BLOCK_K"] == 0,
        NUM_STAGES=dn["num_stages"],
        W_FP8=scale is not None,
        num_warps=dn["num_warps"],
        **pdl(h),
    )
    launch_combine(y, out, k + S)


def launch_up_gemm(
    x,
    w_up,
    h,
    sorted_ids,
    expert_ids,
    npad,
    num_pairs: int,
    top_k: int,
    block_m: int,
    up: dict[str, Any],
    scale: torch.Tensor | None = None,
    gated: bool = False,
    a8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """h [P, I] over the align layout (moe_up_ref; gated: w_up holds [gate | up] rows, [E, 2I, d], and h is
    silu(gate) * up; scale: FP8 experts' [E, I] channel scales, [E, 2I] gated). a8 (w8a8, with `scale`):
    (x's scales [T, d / 128], h's scales [P, I / 128] to fill); x holds e4m3 codes and h is e4m3."""
    inter, d = w_up.shape[1] // (2 if gated else 1), w_up.shape[2]
    nb = expert_ids.numel()
    xs, hs = a8 if a8 is not None else (h, h)
    _up_gemm_kernel[(nb * triton.cdiv(inter, up["BLOCK_N"]),)](
        x,
        w_up,
        h.view(torch.uint8) if a8 is not None else h,
        sorted_ids,
        expert_ids,
        npad,
        num_pairs,
        nb,
        inter,
        d,
        up["GROUP_M"],
        x.stride(0),
        w_up.stride(0),
        w_up.stride(1),
        h.stride(0),
        scale if scale is not None else h,
        xs,
        xs.stride(0),
        hs,
        hs.stride(0),
        TOP_K=top_k,
        BLOCK_M=block_m,
        BLOCK_N=up["BLOCK_N"],
        BLOCK_K=up["BLOCK_K"],
        EVEN_K=d % up["BLOCK_K"] == 0,
        IEEE=x.dtype == torch.float32,
        W_FP8=scale is not None,
        SWAP=up.get("SWAP", 0),
        GATED=gated,
        A8=a8 is not None,
        **_launch(up),
        **pdl(x),
    )


def launch_down_gemm(
    h,
    w_down,
    y,
    tw,
    sorted_ids,
    expert_ids,
    npad,
    block_m: int,
    dn: dict[str, Any],
    scale: torch.Tensor | None = None,
    h_scale: torch.Tensor | None = None,
) -> None:
    """y [T*k, d], each pair's row weighted (moe_down_ref); h_scale (w8a8, with `scale`): h holds e4m3
    codes with these scales [P, I / 128]."""
    d, inter = w_down.shape[1], w_down.shape[2]
    nb = expert_ids.numel()
    _down_gemm_kernel[(nb * triton.cdiv(d, dn["BLOCK_N"]),)](
        h,
        w_down,
        y,
        tw,
        sorted_ids,
        expert_ids,
        npad,
        y.shape[0],
        nb,
        d,
        inter,
        dn["GROUP_M"],
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        y.stride(0),
        scale if scale is not None else tw,
        h_scale if h_scale is not None else tw,
        h_scale.stride(0) if h_scale is not None else 0,
        BLOCK_M=block_m,
        BLOCK_N=dn["BLOCK_N"],
        BLOCK_K=dn["BLOCK_K"],
        EVEN_K=inter % dn["BLOCK_K"] == 0,
        IEEE=h.dtype == torch.float32,
        W_FP8=scale is not None,
        SWAP=dn.get("SWAP", 0),
        A8=h_scale is not None,
        **_launch(dn),
        **pdl(h),
    )


def launch_combine(y, out, top_k: int, extra: torch.Tensor | None = None) -> None:
    """out [T, d] = sum of each token's k rows of y (moe_combine_ref), plus extra [T, d] when given."""
    T, d = out.shape
    bc = 1024 if y.is_cuda else 64
    ex = y if extra is None else extra
    _combine_kernel[(T, triton.cdiv(d, bc))](
        y,
        ex,
        out,
        d,
        y.stride(0),
        ex.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_N=bc,
        HAS_EXTRA=extra is not None,
        num_warps=4,
        **pdl(y),
    )


def moe_experts_triton(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """x: [T, d]; w_up: [E, I, d]; w_down: [E, d, I]; topk_w: [T, k] float32; topk_ids: [T, k] int -> [T, d]
    in x.dtype (moe_experts_ref, with the shared expert when given). FP8 experts: e4m3 weights with up_scale
    [E, I] and down_scale [E, d] float32 (per expert and output channel), no shared expert. `config`
    overrides the tuned / heuristic tile config (tests, tuning)."""
    _check_experts_args(x, w_up, w_down, topk_w, topk_ids, up_scale, down_scale)
    if up_scale is not None and (shared_up is not None or shared_down is not None):
        raise ValueError(
            "moe_experts: FP8 experts take no folded shared expert (an FP8 model runs it as its MLP)"
        )
    S = check_shared_args(w_up, shared_up, shared_down)
    out = _output(x, w_up, w_down)
    T, d = x.shape
    E, inter, _ = w_up.shape
    k = topk_ids.shape[1]
    if T == 0:
        return out
    if shared_up is not None and shared_down is not None:  # S > 0
        if (
            not shared_up.is_contiguous()
            or shared_down.stride(1) != 1
            or shared_up.stride(0) != w_up.stride(1)
        ):
            raise ValueError(
                "moe_experts: the shared expert's weights must be contiguous rows like the experts'"
            )
    cfg = (
        validate_config(config)
        if config is not None
        else moe_config(E, inter, d, T, k, x.device, fp8=up_scale is not None)
    )
    xc = x if x.stride(1) == 1 else x.contiguous()
    ids = topk_ids.contiguous()
    tw = topk_w.float().contiguous()
    if cfg["variant"] == "gemv":
        h = torch.empty(T * (k + S), inter, dtype=x.dtype, device=x.device)
        # EARLY shared rows read x before their wait: not a copy made by the kernel right before them
        up = cfg["up"] if xc is x else dict(cfg["up"], EARLY=0)
        launch_up_gemv(xc, w_up, ids, h, up, shared_up if S else None, up_scale)
        launch_down(h, w_down, ids, tw, out, cfg["down"], shared_down if S else None, down_scale)
        return out
    # many tokens: the shared expert as two GEMMs (each weight read once for all rows), added in the combine
    shared = None
    if shared_up is not None and shared_down is not None:  # S > 0
        shared = F.linear(relu2_triton(F.linear(xc, shared_up)), shared_down)
    return _grouped_gemms(xc, w_up, w_down, tw, ids, cfg, out, up_scale, down_scale, extra=shared)


def _output(x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The experts' output buffer [T, d] in x.dtype, after the kernels' own input checks."""
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"moe_experts: float32, float16 or bfloat16 expected, got {x.dtype}")
    if w_up.stride(2) != 1 or w_down.stride(2) != 1:
        raise ValueError("moe_experts: expert weights need a unit stride along their last dimension")
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def _grouped_gemms(
    xc: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tw: torch.Tensor,
    ids: torch.Tensor,
    cfg: dict[str, Any],
    out: torch.Tensor,
    up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
    *,
    gated: bool = False,
    extra: torch.Tensor | None = None,
) -> torch.Tensor:
    """The gemm variant into `out`: align the (token, slot) pairs by expert, the up and down GEMMs, the
    combine (plus `extra` [T, d] when given). gated: w_up holds [gate | up] rows."""
    T, k = ids.shape
    E, inter = w_up.shape[0], w_down.shape[2]
    bm = cfg["BLOCK_M"]
    sorted_ids, expert_ids, npad = moe_align_triton(ids, E, bm)
    P = sorted_ids.numel()
    y = torch.empty(T * k, out.shape[1], dtype=xc.dtype, device=xc.device)
    if cfg.get("A8", 0):
        if up_scale is None or down_scale is None:
            raise ValueError("moe_experts: the A8 (w8a8) form is for FP8 experts (e4m3 weights with scales)")
        # activations as e4m3 codes, one scale per row and 128 columns: x here, h in the up GEMM's epilogue
        xq, xs = quantize_rows_triton(xc, group=A8_GROUP)
        h = torch.empty(P, inter, dtype=torch.float8_e4m3fn, device=xc.device)
        hs = torch.empty(P, triton.cdiv(inter, A8_GROUP), dtype=torch.float32, device=xc.device)
        up, dn = cfg["up"], cfg["down"]
        launch_up_gemm(xq, w_up, h, sorted_ids, expert_ids, npad, T * k, k, bm, up, up_scale, gated, (xs, hs))
        launch_down_gemm(h, w_down, y, tw, sorted_ids, expert_ids, npad, bm, dn, down_scale, hs)
    else:
        h = torch.empty(P, inter, dtype=xc.dtype, device=xc.device)
        up, dn = cfg["up"], cfg["down"]
        launch_up_gemm(xc, w_up, h, sorted_ids, expert_ids, npad, T * k, k, bm, up, up_scale, gated=gated)
        launch_down_gemm(h, w_down, y, tw, sorted_ids, expert_ids, npad, bm, dn, down_scale)
    launch_combine(y, out, k, extra)
    return out


def moe_experts_silu_triton(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    config: dict[str, Any] | None = None,
) -> torch.Tensor:
    """SiLU-gated experts (kernels/moe_silu.py's contract): x [T, d]; gate_up [E, 2I, d] ([gate | up] rows);
    down [E, d, I]; topk_w [T, k] float; topk_ids [T, k] int -> [T, d] in x.dtype; FP8 experts: e4m3 weights
    with up_scale [E, 2I] and down_scale [E, d] float32. The grouped GEMMs at every token count (the decode
    GEMVs have no gated form): the bucket's tuned or heuristic GEMM settings; a bucket whose settings are
    GEMVs takes the heuristic GEMM settings of 3 tokens."""
    _check_experts_args(x, gate_up, down, topk_w, topk_ids, up_scale, down_scale, gated=True)
    out = _output(x, gate_up, down)
    T, d = x.shape
    E, inter = gate_up.shape[0], gate_up.shape[1] // 2
    k = topk_ids.shape[1]
    if T == 0:
        return out
    if config is not None:
        cfg = validate_config(config)
    else:
        cfg = moe_config(E, inter, d, T, k, x.device, fp8=up_scale is not None)
        if cfg["variant"] == "gemv":
            cfg = _INTERPRETER_GEMM if x.device.type != "cuda" else heuristic_config(E, inter, d, 3, k)
    if cfg["variant"] != "gemm":
        raise ValueError("moe_experts: SiLU-gated experts run the grouped GEMMs (variant 'gemm') only")
    xc = x if x.stride(1) == 1 else x.contiguous()
    tw, ids = topk_w.float().contiguous(), topk_ids.contiguous()
    return _grouped_gemms(xc, gate_up, down, tw, ids, cfg, out, up_scale, down_scale, gated=True)


__all__ = [
    "TOKEN_BUCKETS",
    "heuristic_config",
    "moe_align_triton",
    "moe_config",
    "moe_experts_silu_triton",
    "moe_experts_triton",
    "moe_route_triton",
    "moe_token_buckets",
    "router_logits_triton",
    "shape_key",
    "token_bucket",
    "validate_config",
]
