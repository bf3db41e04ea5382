"""Paged attention over the block pool as Triton kernels: KV write, split-KV decode, prefill/extend.

The CUDA path of `attention.write_kv_ref` and `attention.paged_attention_ref` (same contracts; the pool
layout is in attention.py). The kernels gather K/V through the block table, so any block size works; step
shapes are runtime values, so serving compiles nothing after the warm-up. `cuda_attention` dispatches here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hyserve.kernels.attention import FP8_KV_DTYPES, check_kv_scales
from hyserve.kernels.host_index import HostIndex, host_list
from hyserve.kernels.launch_util import device_index, pdl, split_kv_args, split_kv_count, tma_tiles_fit
from hyserve.kernels.triton_common import dot, dot_acc, pdl_enter

_LOG2E = 1.4426950408889634


# --------------------------------------------------------------------------- KV write


@triton.jit
def _quantize(x, scale_ptr, SCALED: tl.constexpr, FP8: tl.constexpr):
    """x / scale in float32 (correctly rounded, like torch), clamped to the e4m3 range for a float8 cache."""
    if SCALED:
        x = tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr).to(tl.float32))
    if FP8:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)  # attention.FP8_E4M3_MAX
    return x


@triton.jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    ks_ptr,
    vs_ptr,
    num_tokens,
    s_k_t,
    s_k_h,
    s_v_t,
    s_v_h,
    s_kc_b,
    s_kc_r,
    s_kc_h,
    s_vc_b,
    s_vc_r,
    s_vc_h,
    BS: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr,
    D_PAD: tl.constexpr,
    KV_SCALED: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    blk = slot // BS
    row = slot % BS
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    m = (offs_h < HKV)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t * s_k_t + offs_h[:, None] * s_k_h + offs_d[None, :], mask=m)
    v = tl.load(v_ptr + t * s_v_t + offs_h[:, None] * s_v_h + offs_d[None, :], mask=m)
    k = _quantize(k, ks_ptr, KV_SCALED, FP8)
    v = _quantize(v, vs_ptr, KV_SCALED, FP8)
    tl.store(
        kc_ptr + blk * s_kc_b + row * s_kc_r + offs_h[:, None] * s_kc_h + offs_d[None, :],
        k.to(kc_ptr.dtype.element_ty),
        mask=m,
    )
    tl.store(
        vc_ptr + blk * s_vc_b + row * s_vc_r + offs_h[:, None] * s_vc_h + offs_d[None, :],
        v.to(vc_ptr.dtype.element_ty),
        mask=m,
    )


def write_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, kv_heads, head_dim]; writes them at slot_mapping ([T], -1 = skip) into the caches,
    quantised with the device scalars k_scale / v_scale when given (as `write_kv_ref`)."""
    assert k.dim() == 3 and v.shape == k.shape and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
    assert v_cache.dtype == k_cache.dtype
    scaled = check_kv_scales(k_scale, v_scale, k.device)
    T, Hkv, Dh = k.shape
    assert k_cache.shape[2:] == (Hkv, Dh), f"k {tuple(k.shape)} vs cache {tuple(k_cache.shape)}"
    assert slot_mapping.shape == (T,) and not slot_mapping.dtype.is_floating_point
    assert slot_mapping.is_contiguous()
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if scaled else slot_mapping,
        v_scale if scaled else slot_mapping,  # unread when unscaled
        T,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        BS=k_cache.shape[1],
        HKV=Hkv,
        HEAD_DIM=Dh,
        H_PAD=triton.next_power_of_2(Hkv),
        D_PAD=triton.next_power_of_2(Dh),
        KV_SCALED=scaled,
        FP8=k_cache.dtype in FP8_KV_DTYPES,
        num_warps=4,
        **pdl(k),
    )


# --------------------------------------------------------------------------- shared tile steps
#
# Softmax in float32 with exp2 (the scale folded with log2(e)); P is cast to the V dtype for the PV product,
# as flash attention does. Float8 (e4m3) caches with per-layer scales: the write kernel stores
# clamp(k / k_scale, -448, 448); the readers upcast the raw e4m3 tile to q's dtype (exact: every e4m3 value
# is a bf16/fp16 value; bf16 queries turn float16 first, `_f16_queries`) and fold the scales into scalars
# instead of touching every element,
#
#     scores = (q . k8) * (softmax_scale * k_scale)      out = (sum_j p_j v8_j / l) * v_scale
#
# the dequantised attention up to float32 rounding order. KV_SCALED is a constexpr (the unscaled kernels are
# unchanged) and the scales are read from device memory (a decode step with them can be graph-captured).


@triton.jit
def _v_tile(v, q, PIN: tl.constexpr):
    """A V tile in q's dtype; with PIN (a float8 cache on a GPU) through an opaque identity (an impure
    inline-asm mov) after the cast, so the compiler keeps the e4m3 -> 16-bit convert before the tile's move to
    the dot-operand layout. Left to itself it moves the convert after that shared-memory round trip, where an
    8-bit V tile (transposed for P @ V) loads a byte at a time (sm_90 PTX of the decode kernel: 256
    ld.shared.b8); pinned, the 16-bit tile goes through ldmatrix.trans. Never under the interpreter (no
    PTX)."""
    v = v.to(q.dtype)
    if PIN:
        v = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=2)
    return v


@triton.jit
def _load_kv_tile(
    kc_ptr,
    vc_ptr,
    bt_row,
    pos,
    mn,
    offs_d,
    md,
    kvh,
    q,
    s_kc_b,
    s_kc_r,
    s_kc_h,
    s_vc_b,
    s_vc_r,
    s_vc_h,
    BS: tl.constexpr,
    MASK_N: tl.constexpr,
    MASK_D: tl.constexpr,
    PIN_V: tl.constexpr,
):
    """K and V rows of one head for token positions `pos` (masked by `mn` when MASK_N), found through
    the block table: position p lives in block bt_row[p // BS], row p % BS. Cast to q's dtype (a float8
    tile exactly; its scales are applied by the caller to the scores and the output). Full tiles of an
    unpadded head dim load without masks (MASK_N / MASK_D False)."""
    r = pos % BS
    if MASK_N:
        blk = tl.load(bt_row + pos // BS, mask=mn, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // BS).to(tl.int64)
    k_ptrs = kc_ptr + blk[:, None] * s_kc_b + r[:, None] * s_kc_r + kvh * s_kc_h + offs_d[None, :]
    v_ptrs = vc_ptr + blk[:, None] * s_vc_b + r[:, None] * s_vc_r + kvh * s_vc_h + offs_d[None, :]
    if MASK_N or MASK_D:
        mkv = mn[:, None] & md[None, :]
        k = tl.load(k_ptrs, mask=mkv, other=0.0).to(q.dtype)
        v = tl.load(v_ptrs, mask=mkv, other=0.0)
    else:
        k = tl.load(k_ptrs).to(q.dtype)
        v = tl.load(v_ptrs)
    return k, _v_tile(v, q, PIN_V)


@triton.jit
def _f16_queries(q, F16_TILES: tl.constexpr):
    """bf16 queries as float16 when the cache is float8 (F16_TILES), so the e4m3 tiles upcast to float16 and
    both products run in float16: e4m3 -> f16 is one instruction per pair on sm_89+ while e4m3 -> bf16 adds a
    scalar f16 -> bf16 convert per element (the sm_90 PTX of the decode loop: 256 cvt.rn.f16x2.e4m3x2 and 512
    cvt.bf16.f16). float16 holds every e4m3 value exactly and P in [0, 1] with 3 more mantissa bits than bf16;
    the queries are clamped to its +-65504 range."""
    if F16_TILES:
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
    return q


@triton.jit
def _online_softmax_step(qk, v, m_i, l_i, acc, IEEE: tl.constexpr):
    """Fold one tile of (already scaled, masked, log2-domain) scores and its V rows into the running
    max m_i, denominator l_i and output accumulator acc."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return m_new, l_i, acc


@triton.jit
def _online_softmax_step_fold(qk, v, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """_online_softmax_step on raw (unscaled, masked) scores: the scale rides in the max and in one fused
    multiply-add per score; the accumulator is rescaled before the PV product accumulates into it, and the
    denominator last (the order Triton's Hopper pipeliner keeps the PV product asynchronous in)."""
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = dot_acc(p.to(v.dtype), v, acc * alpha[:, None], IEEE)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return m_new, l_i, acc


@triton.jit
def _two_box_step(qka, qkb, va, vb, m_i, l_i, acc, qk_scale, IEEE: tl.constexpr):
    """_online_softmax_step_fold for a key tile held as two boxes: raw scores qka / qkb against the boxes'
    keys, their V rows va / vb; one max / rescale for the whole tile, both PV products into acc
    (alternatives timed: benchmarks/README.md)."""
    m_new = tl.maximum(m_i, tl.maximum(tl.max(qka, axis=1), tl.max(qkb, axis=1)) * qk_scale)
    pa = tl.exp2(qka * qk_scale - m_new[:, None])
    pb = tl.exp2(qkb * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = dot_acc(pa.to(va.dtype), va, acc * alpha[:, None], IEEE)
    acc = dot_acc(pb.to(vb.dtype), vb, acc, IEEE)
    l_i = l_i * alpha + tl.sum(pa, axis=1) + tl.sum(pb, axis=1)
    return m_new, l_i, acc


@triton.jit
def _load_kv_box(kd, vd, bt_row, start, kvh, BS: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K and V rows of one head for the positions from `start` on, through tensor descriptors over the
    pools flattened to [blocks * BS, kv_heads * HEAD_DIM]: one box of the descriptors' rows, all in the
    block that holds `start` (the launcher checks that boxes never cross a block)."""
    row = (tl.load(bt_row + start // BS) * BS + start % BS).to(tl.int32)
    col = (kvh * HEAD_DIM).to(tl.int32)
    return kd.load([row, col]), vd.load([row, col])


# --------------------------------------------------------------------------- decode (split-KV)


# block-table width and the partial buffers' split stride change from step to step: not specialised
@triton.jit(do_not_specialize=["seq_offset", "num_splits", "s_bt_s", "s_po_sp", "s_pl_sp"])
def _decode_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    lens_ptr,
    cu_ptr,
    po_ptr,
    plse_ptr,
    ks_ptr,
    vs_ptr,
    seq_offset,
    num_splits,
    qk_scale,
    s_q_t,
    s_q_h,
    s_kc_b,
    s_kc_r,
    s_kc_h,
    s_vc_b,
    s_vc_r,
    s_vc_h,
    s_bt_s,
    s_po_sp,
    s_po_s,
    s_po_h,  # partial out [splits, nd, Hq, D] fp32, last stride 1
    s_pl_sp,
    s_pl_s,  # partial lse [splits, nd, Hq] fp32, last stride 1
    BS: tl.constexpr,
    REP: tl.constexpr,
    REP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
    KV_SCALED: tl.constexpr,
    F16_TILES: tl.constexpr,
    PIN_V: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    s = tl.program_id(0).to(tl.int64)  # index among the decode sequences
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq = seq_offset + s
    L = tl.load(lens_ptr + seq).to(tl.int64)
    row = tl.load(cu_ptr + seq).to(tl.int64)
    # Each sequence cuts its own length into num_splits whole-BLOCK_N pieces (none shorter than
    # MIN_SPLIT), so the grid depends only on the batch shape: a short sequence leaves its trailing
    # splits empty, a long one spreads over all of them, and the launch is graph-capturable.
    per = tl.maximum(tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N, MIN_SPLIT)
    lo = sp.to(tl.int64) * per
    hi = tl.minimum(lo + per, L)

    offs_r = tl.arange(0, REP_PAD)
    offs_d = tl.arange(0, D_PAD)
    mr = offs_r < REP
    md = offs_d < HEAD_DIM
    heads = kvh * REP + offs_r
    q = tl.load(
        q_ptr + row * s_q_t + heads[:, None] * s_q_h + offs_d[None, :],
        mask=mr[:, None] & md[None, :],
        other=0.0,
    )
    q = _f16_queries(q, F16_TILES)

    if KV_SCALED:
        qk_scale = qk_scale * tl.load(ks_ptr).to(tl.float32)

    m_i = tl.full((REP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((REP_PAD,), dtype=tl.float32)
    acc = tl.zeros((REP_PAD, D_PAD), dtype=tl.float32)
    bt_row = bt_ptr + seq * s_bt_s
    offs_n = tl.arange(0, BLOCK_N)
    # whole tiles without masks, then the split's partial last tile (if any); the running max stays
    # finite: every tile holds >= 1 valid position
    full_hi = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, full_hi, BLOCK_N):
        pos = start + offs_n
        k, v = _load_kv_tile(
            kc_ptr,
            vc_ptr,
            bt_row,
            pos,
            pos < hi,
            offs_d,
            md,
            kvh,
            q,
            s_kc_b,
            s_kc_r,
            s_kc_h,
            s_vc_b,
            s_vc_r,
            s_vc_h,
            BS,
            False,
            HEAD_DIM != D_PAD,
            PIN_V,
        )
        qk = dot(q, tl.trans(k), IEEE) * qk_scale
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE)
    for start in range(full_hi, hi, BLOCK_N):
        pos = start + offs_n
        mn = pos < hi
        k, v = _load_kv_tile(
            kc_ptr,
            vc_ptr,
            bt_row,
            pos,
            mn,
            offs_d,
            md,
            kvh,
            q,
            s_kc_b,
            s_kc_r,
            s_kc_h,
            s_vc_b,
            s_vc_r,
            s_vc_h,
            BS,
            True,
            True,
            PIN_V,
        )
        qk = tl.where(mn[None, :], dot(q, tl.trans(k), IEEE) * qk_scale, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE)

    has = l_i > 0.0  # an empty split (lo >= L) contributes weight 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    if KV_SCALED:
        out = out * tl.load(vs_ptr).to(tl.float32)  # the combine is linear in the partial outputs
    lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(
        po_ptr + sp * s_po_sp + s * s_po_s + heads[:, None] * s_po_h + offs_d[None, :],
        out,
        mask=mr[:, None] & md[None, :],
    )
    tl.store(plse_ptr + sp * s_pl_sp + s * s_pl_s + heads, lse, mask=mr)


@triton.jit(do_not_specialize=["seq_offset", "num_splits", "s_po_sp", "s_pl_sp"])
def _combine_kernel(
    po_ptr,
    plse_ptr,
    cu_ptr,
    out_ptr,
    seq_offset,
    num_splits,
    s_po_sp,
    s_po_s,
    s_po_h,
    s_pl_sp,
    s_pl_s,
    s_o_t,
    s_o_h,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SP: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = sum_sp w_sp o_sp / sum_sp w_sp with w_sp = 2^(lse_sp - max lse), BLOCK_SP splits per
    vector load (no per-split branch or dependent scalar load: most splits of a short context are empty
    and cost one masked lane)."""
    pdl_enter(PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = tl.load(cu_ptr + seq_offset + s).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    md = offs_d < HEAD_DIM
    offs_sp = tl.arange(0, BLOCK_SP)
    m = tl.full((), float("-inf"), dtype=tl.float32)
    den = tl.zeros((), dtype=tl.float32)
    acc = tl.zeros((D_PAD,), dtype=tl.float32)
    for sp0 in range(0, num_splits, BLOCK_SP):
        sp = sp0 + offs_sp
        lse = tl.load(plse_ptr + sp * s_pl_sp + s * s_pl_s + h, mask=sp < num_splits, other=float("-inf"))
        live = lse > float("-inf")  # an empty split wrote -inf and no output
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        if m_new > float("-inf"):
            w = tl.where(live, tl.exp2(lse - m_new), 0.0)
            o = tl.load(
                po_ptr + sp[:, None] * s_po_sp + s * s_po_s + h * s_po_h + offs_d[None, :],
                mask=live[:, None] & md[None, :],
                other=0.0,
            )
            alpha = tl.exp2(m - m_new)
            acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
            den = den * alpha + tl.sum(w, axis=0)
            m = m_new
    tl.store(out_ptr + row * s_o_t + h * s_o_h + offs_d, (acc / den).to(out_ptr.dtype.element_ty), mask=md)


@triton.jit(do_not_specialize=["seq_offset", "num_splits", "s_po_sp", "s_pl_sp"])
def _combine_once_kernel(
    po_ptr,
    plse_ptr,
    cu_ptr,
    out_ptr,
    seq_offset,
    num_splits,
    s_po_sp,
    s_po_s,
    s_po_h,
    s_pl_sp,
    s_pl_s,
    s_o_t,
    s_o_h,
    HEAD_DIM: tl.constexpr,
    SP_ALL: tl.constexpr,
    D_BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_combine_kernel`'s merge with every split in one load: grid (sequences, q heads, head-dim blocks of
    D_BLOCK), each program loads the log-sum-exps of all splits (up to SP_ALL, a fixed bound, so the split
    count never compiles a variant) and their partial outputs for its D_BLOCK columns at once, instead of a
    loop whose every step waits on the previous one's loads (a long context split 198 ways took 13 of
    them)."""
    pdl_enter(PDL)
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.program_id(2) * D_BLOCK + tl.arange(0, D_BLOCK)
    md = offs_d < HEAD_DIM
    row = tl.load(cu_ptr + seq_offset + s).to(tl.int64)
    sp = tl.arange(0, SP_ALL)
    lse = tl.load(plse_ptr + sp * s_pl_sp + s * s_pl_s + h, mask=sp < num_splits, other=float("-inf"))
    live = lse > float("-inf")  # an empty split wrote -inf and no output
    o = tl.load(
        po_ptr + sp[:, None] * s_po_sp + s * s_po_s + h * s_po_h + offs_d[None, :],
        mask=live[:, None] & md[None, :],
        other=0.0,
    )
    m = tl.max(lse, axis=0)  # a decode sequence has at least one key, so one split is live
    w = tl.where(live, tl.exp2(lse - m), 0.0)
    out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
    tl.store(out_ptr + row * s_o_t + h * s_o_h + offs_d, out.to(out_ptr.dtype.element_ty), mask=md)


# --------------------------------------------------------------------------- prefill / extend


@triton.jit(do_not_specialize=["seq_offset", "s_bt_s"])
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    kd,
    vd,
    bt_ptr,
    lens_ptr,
    cu_ptr,
    out_ptr,
    ks_ptr,
    vs_ptr,
    seq_offset,
    qk_scale,
    s_q_t,
    s_q_h,
    s_kc_b,
    s_kc_r,
    s_kc_h,
    s_vc_b,
    s_vc_r,
    s_vc_h,
    s_bt_s,
    s_o_t,
    s_o_h,
    BS: tl.constexpr,
    REP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    KV_SCALED: tl.constexpr,
    F16_TILES: tl.constexpr,
    PIN_V: tl.constexpr,
    TMA: tl.constexpr,
):
    # TMA 1 / 2: kd / vd are tensor descriptors over the pools as [blocks * BS, kv_heads * HEAD_DIM] and
    # the unmasked tiles load through them, as one box of BLOCK_N rows or two of BLOCK_N / 2 (each within
    # one block), with the folded-scale softmax step (the faster one there; not with pointer loads);
    # TMA 0: pointer loads, kd / vd unused.
    # q heads fastest (the REP heads of a KV head run together and share its tiles in L2), then the
    # query blocks from the last (longest causal row) to the first, so the short ones fill the tail
    h = tl.program_id(0)
    mb = tl.num_programs(1) - 1 - tl.program_id(1)
    seq = seq_offset + tl.program_id(2).to(tl.int64)
    q0 = tl.load(cu_ptr + seq).to(tl.int64)
    n = tl.load(cu_ptr + seq + 1).to(tl.int64) - q0
    m0 = mb * BLOCK_M
    if m0 >= n:
        return
    L = tl.load(lens_ptr + seq).to(tl.int64)
    ctx = L - n  # cached tokens before this step's new ones
    kvh = h // REP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    mm = offs_m < n
    md = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (q0 + offs_m)[:, None] * s_q_t + h * s_q_h + offs_d[None, :],
        mask=mm[:, None] & md[None, :],
        other=0.0,
    )
    q = _f16_queries(q, F16_TILES)
    qpos = ctx + offs_m
    if KV_SCALED:
        qk_scale = qk_scale * tl.load(ks_ptr).to(tl.float32)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, D_PAD), dtype=tl.float32)
    bt_row = bt_ptr + seq * s_bt_s
    # Keys before ctx + m0 are visible to every query of this block (and exist: ctx + m0 < L), so the
    # whole tiles below that need no mask; the band up to the block's last query is masked.
    full_end = (ctx + m0) // BLOCK_N * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        if TMA == 2:
            # the tile's two halves may lie in different blocks: two boxes, two score products, one
            # softmax update for the whole tile
            ka, va = _load_kv_box(kd, vd, bt_row, start, kvh, BS, HEAD_DIM)
            kb, vb = _load_kv_box(kd, vd, bt_row, start + BLOCK_N // 2, kvh, BS, HEAD_DIM)
            ka, va, kb, vb = ka.to(q.dtype), _v_tile(va, q, PIN_V), kb.to(q.dtype), _v_tile(vb, q, PIN_V)
            m_i, l_i, acc = _two_box_step(
                dot(q, tl.trans(ka), IEEE), dot(q, tl.trans(kb), IEEE), va, vb, m_i, l_i, acc, qk_scale, IEEE
            )
        elif TMA == 1:
            k, v = _load_kv_box(kd, vd, bt_row, start, kvh, BS, HEAD_DIM)
            m_i, l_i, acc = _online_softmax_step_fold(
                dot(q, tl.trans(k.to(q.dtype)), IEEE), _v_tile(v, q, PIN_V), m_i, l_i, acc, qk_scale, IEEE
            )
        else:
            pos = start + offs_n
            k, v = _load_kv_tile(
                kc_ptr,
                vc_ptr,
                bt_row,
                pos,
                pos < full_end,
                offs_d,
                md,
                kvh,
                q,
                s_kc_b,
                s_kc_r,
                s_kc_h,
                s_vc_b,
                s_vc_r,
                s_vc_h,
                BS,
                False,
                HEAD_DIM != D_PAD,
                PIN_V,
            )
            qk = dot(q, tl.trans(k), IEEE) * qk_scale
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE)
    kv_end = tl.minimum(L, ctx + m0 + BLOCK_M)  # causal: nothing past this block's last query
    for start in range(full_end, kv_end, BLOCK_N):
        pos = start + offs_n
        mn = pos < kv_end
        k, v = _load_kv_tile(
            kc_ptr,
            vc_ptr,
            bt_row,
            pos,
            mn,
            offs_d,
            md,
            kvh,
            q,
            s_kc_b,
            s_kc_r,
            s_kc_h,
            s_vc_b,
            s_vc_r,
            s_vc_h,
            BS,
            True,
            True,
            PIN_V,
        )
        # Position 0 is visible to every query, so m_i is finite after the first tile and a row
        # whose tile is fully masked later just gets p = 0.
        ok = mn[None, :] & (pos[None, :] <= qpos[:, None])
        if TMA > 0:  # the step the unmasked tiles took
            qk = tl.where(ok, dot(q, tl.trans(k), IEEE), float("-inf"))
            m_i, l_i, acc = _online_softmax_step_fold(qk, v, m_i, l_i, acc, qk_scale, IEEE)
        else:
            qk = tl.where(ok, dot(q, tl.trans(k), IEEE) * qk_scale, float("-inf"))
            m_i, l_i, acc = _online_softmax_step(qk, v, m_i, l_i, acc, IEEE)

    out = acc / l_i[:, None]
    if KV_SCALED:
        out = out * tl.load(vs_ptr).to(tl.float32)
    tl.store(
        out_ptr + (q0 + offs_m)[:, None] * s_o_t + h * s_o_h + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mm[:, None] & md[None, :],
    )


# --------------------------------------------------------------------------- launcher

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
# Enough programs to fill an H200 (132 SMs) a few times over; splits never shorter than this.
_TARGET_PROGRAMS = 132 * 4
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 128
# Launch settings on a GPU, fixed per head size (no autotuning: the warm-up enumerates the variants);
# `benchmarks/bench_kernels.py --only attn_sweep` times alternatives. On the CPU (interpreter) small
# tiles so the tests cross several tiles and splits.
# The same settings serve float8 caches: `--only attn_sweep` timed 8 alternatives over fp8 and none was
# faster.
_DECODE_GPU = dict(BLOCK_N=128, num_warps=4, num_stages=3)
# Prefill on a GPU: key tiles through tensor descriptors where the pool allows (TMA, with the folded-scale
# softmax; faster than pointer loads, benchmarks/README.md).
_PREFILL_GPU = {
    128: dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, TMA=True),  # D_PAD <= 128
    256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
}
# float32 queries (IEEE products on the CUDA cores, their operands staged through shared memory): on sm_90
# the 128 x 128 tile asks 262,656 bytes of shared memory, over the 232,448 a block may have; 64 x 64 asks
# 114,944 (tests/sm90_compile_check.py compiles them). Decode key tiles of 256-wide heads halve for float32.
_PREFILL_GPU_F32 = {
    128: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    256: dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2),
}
_DECODE_CPU = dict(BLOCK_N=16, num_warps=4, num_stages=1)
# The merge of the split partials: `_combine_kernel`'s loop over BLOCK_SP splits at a time, or, from
# ONCE_MIN_SPLITS splits up (0: never), `_combine_once_kernel`: all splits (at most _COMBINE_SPLITS, which
# covers every split rule here and the sweeps' 256) in one load per head-dim block of D_BLOCK. On the H200
# (attn_sweep_c0ad159, graph replay, Nano 9B v2 heads) the one-shot merge took fp8 decode at batch 1 x 131k
# (the Gluon kernel's 198 splits) from 0.111 to 0.090 ms, and cost more where the splits are few (its masked
# 256-split tile is read whole): bf16 at 1 x 131k (66 splits) 0.153 -> 0.261 ms, fp8 at 64 x 8k (3 splits)
# 0.322 -> 0.378 ms.
_COMBINE_GPU = dict(ONCE_MIN_SPLITS=128, BLOCK_SP=16, D_BLOCK=32, num_warps=4)
_COMBINE_CPU = dict(ONCE_MIN_SPLITS=0, BLOCK_SP=2, D_BLOCK=16, num_warps=1)
_COMBINE_SPLITS = 256
_PREFILL_CPU = dict(BLOCK_M=16, BLOCK_N=16, num_warps=4, num_stages=1)


# A kernel that may take a step's prefill part in place of `_prefill_kernel`: called with (q, k_cache,
# v_cache, block_tables, lens_t, cu_t, out, seq_offset, num_seqs, max_new, qk_scale, k_scale=, v_scale=) (the
# scales: device scalars or None), it writes those sequences' rows of `out` and returns True, or returns False
# and writes nothing.
PrefillKernel = Callable[..., bool]
# A kernel that may take a step's decode part in place of `_decode_kernel`: called with (q, k_cache, v_cache,
# block_tables, lens_t, cu_t, num_decode, max_len, qk_scale, k_scale=, v_scale=) (max_len: the longest decode
# context when the host knows it, None in a captured step), it returns the partial outputs [splits, nd,
# q_heads, head_dim] and log-sum-exps [splits, nd, q_heads] (float32) that `_combine_kernel` merges, or None
# having launched nothing.
DecodeKernel = Callable[..., "tuple[torch.Tensor, torch.Tensor] | None"]


def _launch_settings(on_gpu: bool, ieee: bool, d_pad: int) -> tuple[dict, dict]:
    """(decode, prefill) launch settings, fresh copies: the CPU's, or the GPU's for this head size and for
    float32 (`ieee`) or 16-bit queries. PIN_V: whether float8 V tiles may be pinned (`_v_tile`: compiled
    kernels only); the launcher keeps it for float8 caches under 16-bit queries."""
    if not on_gpu:
        return dict(_DECODE_CPU, PIN_V=False), dict(_PREFILL_CPU, PIN_V=False)
    decode = dict(_DECODE_GPU, PIN_V=not ieee)
    if ieee and d_pad > 128:  # 128 float32 keys of 256 asked 287,296 bytes of shared memory on sm_90
        decode["BLOCK_N"] = min(decode["BLOCK_N"], 64)
    return decode, dict(
        (_PREFILL_GPU_F32 if ieee else _PREFILL_GPU)[128 if d_pad <= 128 else 256], PIN_V=not ieee
    )


def step_index(cu: list[int], lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's cumulative new-token offsets and sequence lengths on `device` in one asynchronous copy,
    each starting 16-byte aligned: Triton specialises pointer arguments on their alignment, so an offset
    that varied with the batch size would compile new kernel variants in the middle of serving."""
    lens_at = -(-len(cu) // 4) * 4
    both = device_index(cu + [0] * (lens_at - len(cu)) + lens, device)
    return both[: len(cu)], both[lens_at:]


class StepShape(NamedTuple):
    """What a step's launches need from its offsets: decode sequences first (`nd` of them), the longest
    decode context (None: a graph-safe decode step sizes its splits without it), the most new tokens of a
    prefill sequence, and the offsets and lengths on the device."""

    nd: int
    max_len: int | None
    max_new: int
    cu_t: torch.Tensor
    lens_t: torch.Tensor


def step_shape(
    cu_q: torch.Tensor | list[int], seq_lens: torch.Tensor | list[int], T: int, device: torch.device
) -> StepShape:
    """`StepShape` from host offsets and lengths (tensors are read to the host once), checked."""
    cu_h, lens_h = host_list(cu_q), host_list(seq_lens)
    S = len(cu_h) - 1
    assert len(lens_h) == S and cu_h[0] == 0 and cu_h[-1] == T, f"cu_q {cu_h} vs {T} tokens"
    for s in range(S):
        if cu_h[s + 1] - cu_h[s] > lens_h[s]:
            raise ValueError(
                f"paged_attention: sequence {s} has {cu_h[s + 1] - cu_h[s]} new tokens but seq_len "
                f"{lens_h[s]}"
            )
    nd = 0
    while nd < S and cu_h[nd + 1] - cu_h[nd] == 1:
        nd += 1
    max_len = max(lens_h[:nd], default=0)
    max_new = max((cu_h[s + 1] - cu_h[s] for s in range(nd, S)), default=0)
    if not isinstance(cu_q, torch.Tensor) and not isinstance(seq_lens, torch.Tensor):
        cu_t, lens_t = step_index(cu_h, lens_h, device)
    else:
        cu_t, lens_t = device_index(cu_q, device), device_index(seq_lens, device)
    return StepShape(nd, max_len, max_new, cu_t, lens_t)


def num_decode_splits(num_seqs: int, kv_heads: int, max_len: int | None = None) -> int:
    """Splits per decode sequence: enough programs to fill the GPU (`launch_util.split_kv_count`)."""
    return split_kv_count(
        num_seqs,
        kv_heads,
        max_len,
        target_programs=_TARGET_PROGRAMS,
        max_splits=_MAX_SPLITS,
        min_split_tokens=_MIN_SPLIT_TOKENS,
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    cu_q: torch.Tensor | list[int],
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    prefill: PrefillKernel | None = None,
    decode: DecodeKernel | None = None,
) -> torch.Tensor:
    """q: [T, q_heads, head_dim] -> out [T, q_heads, head_dim] in q.dtype.

    Step layout (ForwardMeta): the single-token decode sequences [0, nd) come first, then prefill/extend
    ones [nd, S). Decode: `_decode_kernel`, grid (nd, kv_heads, splits), one program reads one split of a
    sequence's KV once for all q heads of its GQA group and writes a partial output + log-sum-exp that
    `_combine_kernel` merges. Prefill: `_prefill_kernel`, grid (q_heads, q-blocks, S - nd), flash-attention
    online softmax, causal on absolute positions (new token j of n sits at seq_len - n + j); key tiles wholly
    below a query block's diagonal load unmasked (on a GPU as TMA boxes where the pool allows), only the band
    is masked.

    k_scale / v_scale: the cache's dequantisation scales (device scalars, as `paged_attention_ref`).
    prefill: offered the prefill part on a GPU first (`PrefillKernel`); None: this module's kernel.
    decode: offered the decode part on a GPU first (`DecodeKernel`); its partials go through the same combine.

    seq_lens / cu_q: host lists (preferred: no device sync; the launcher reads the step's shape from
    them) or int tensors. With tensors and T == S the step is taken to be pure decode (one new token
    per sequence) and the split count comes from the batch shape alone (each sequence divides its own
    length among the splits inside the kernel), so nothing syncs and the call can be captured in a
    CUDA graph; otherwise tensors are copied to the host once.
    """
    assert q.dim() == 3 and k_cache.dim() == 4 and v_cache.shape == k_cache.shape and block_tables.dim() == 2
    T, Hq, Dh = q.shape
    _, BS, Hkv, Dk = k_cache.shape
    assert Dk == Dh and Hq % Hkv == 0, f"q {tuple(q.shape)} vs cache {tuple(k_cache.shape)}"
    assert q.dtype in _FLOATS, "float64 runs on the reference path"
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert block_tables.stride(1) == 1 and not block_tables.dtype.is_floating_point
    if not scale > 0:  # the online softmax takes its running max on scaled scores
        raise ValueError(f"paged_attention: the softmax scale must be positive, got {scale}")
    scaled = check_kv_scales(k_scale, v_scale, q.device)
    S = (cu_q.shape[0] if isinstance(cu_q, torch.Tensor) else len(cu_q)) - 1
    assert S >= 0 and block_tables.shape[0] >= S
    dev = q.device
    out = torch.empty_like(q)
    if T == 0 or S == 0:
        return out
    rep = Hq // Hkv
    ieee = q.dtype == torch.float32
    f16_tiles = k_cache.dtype in FP8_KV_DTYPES and q.dtype == torch.bfloat16  # see _f16_queries
    qk_scale = float(scale) * _LOG2E
    D_PAD = triton.next_power_of_2(Dh)
    on_gpu = q.is_cuda

    if isinstance(cu_q, torch.Tensor) and isinstance(seq_lens, torch.Tensor) and T == S:
        # graph-safe: no host values needed
        shape = StepShape(S, None, 0, device_index(cu_q, dev), device_index(seq_lens, dev))
    else:
        # one analysis per step where the offsets come as the step's HostIndex (every attention layer of a
        # step shares it: ForwardMeta.step_cu)
        def build() -> StepShape:
            return step_shape(cu_q, seq_lens, T, dev)

        key = ("attention-shape", id(seq_lens))
        shape = cu_q.on_device(key, dev, build) if isinstance(cu_q, HostIndex) else build()
    nd, max_len, max_new, cu_t, lens_t = shape
    # unread when unscaled (scaled: both given, check_kv_scales)
    ks, vs = (k_scale, v_scale) if k_scale is not None and v_scale is not None else (q, q)
    strides_kv = (
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
    )
    dcfg, pcfg = _launch_settings(on_gpu, ieee, D_PAD)
    for cfg in (dcfg, pcfg):
        cfg["PIN_V"] = cfg["PIN_V"] and k_cache.dtype in FP8_KV_DTYPES  # see _v_tile

    if nd > 0:
        parts = None
        if decode is not None and on_gpu:
            parts = decode(
                q,
                k_cache,
                v_cache,
                block_tables,
                lens_t,
                cu_t,
                nd,
                max_len,
                qk_scale,
                k_scale=k_scale if scaled else None,
                v_scale=v_scale if scaled else None,
            )
        if parts is None:
            BLOCK_N = dcfg.pop("BLOCK_N")
            splits = num_decode_splits(nd, Hkv, max_len)
            po = torch.empty(splits, nd, Hq, Dh, dtype=torch.float32, device=dev)
            plse = torch.empty(splits, nd, Hq, dtype=torch.float32, device=dev)
            _decode_kernel[(nd, Hkv, splits)](
                *split_kv_args(
                    q, k_cache, v_cache, block_tables, lens_t, cu_t, po, plse, ks, vs, splits, qk_scale
                ),
                BS=BS,
                REP=rep,
                REP_PAD=max(16, triton.next_power_of_2(rep)),
                HEAD_DIM=Dh,
                D_PAD=D_PAD,
                BLOCK_N=BLOCK_N,
                MIN_SPLIT=triton.cdiv(_MIN_SPLIT_TOKENS, BLOCK_N) * BLOCK_N,
                IEEE=ieee,
                KV_SCALED=scaled,
                F16_TILES=f16_tiles,
                **dcfg,
                **pdl(q),
            )
        else:
            po, plse = parts
            splits = po.shape[0]
        ccfg = dict(_COMBINE_GPU if on_gpu else _COMBINE_CPU)
        merge_args = (
            po,
            plse,
            cu_t,
            out,
            0,
            splits,
            po.stride(0),
            po.stride(1),
            po.stride(2),
            plse.stride(0),
            plse.stride(1),
            out.stride(0),
            out.stride(1),
        )
        once_from = ccfg.pop("ONCE_MIN_SPLITS")
        if 0 < once_from <= splits <= _COMBINE_SPLITS:
            d_block = min(ccfg["D_BLOCK"], D_PAD)
            _combine_once_kernel[(nd, Hq, triton.cdiv(Dh, d_block))](
                *merge_args,
                HEAD_DIM=Dh,
                SP_ALL=_COMBINE_SPLITS,
                D_BLOCK=d_block,
                num_warps=ccfg["num_warps"],
                **pdl(q),
            )
        else:
            _combine_kernel[(nd, Hq)](
                *merge_args,
                HEAD_DIM=Dh,
                D_PAD=D_PAD,
                BLOCK_SP=ccfg["BLOCK_SP"],
                num_warps=ccfg["num_warps"],
                **pdl(q),
            )

    if nd < S and max_new > 0:
        if (
            prefill is not None
            and on_gpu
            and prefill(
                q,
                k_cache,
                v_cache,
                block_tables,
                lens_t,
                cu_t,
                out,
                nd,
                S - nd,
                max_new,
                qk_scale,
                k_scale=k_scale if scaled else None,
                v_scale=v_scale if scaled else None,
            )
        ):
            return out
        # tensor-descriptor key tiles as one box or two, whichever lies within a block, for 16-bit queries
        # (the setting measured; float32 operands would not fit shared memory); else pointer loads
        tma = 0
        if pcfg.pop("TMA", False) and not ieee:
            tma = next((n for n in (1, 2) if tma_tiles_fit(k_cache, v_cache, pcfg["BLOCK_N"] // n)), 0)
        box = pcfg["BLOCK_N"] // max(tma, 1)
        kd, vd = (
            (_pool_descriptor(k_cache, box), _pool_descriptor(v_cache, box)) if tma else (k_cache, v_cache)
        )
        _prefill_kernel[(Hq, triton.cdiv(max_new, pcfg["BLOCK_M"]), S - nd)](
            q,
            k_cache,
            v_cache,
            kd,
            vd,
            block_tables,
            lens_t,
            cu_t,
            out,
            ks,
            vs,
            nd,
            qk_scale,
            q.stride(0),
            q.stride(1),
            *strides_kv,
            block_tables.stride(0),
            out.stride(0),
            out.stride(1),
            BS=BS,
            REP=rep,
            HEAD_DIM=Dh,
            D_PAD=D_PAD,
            IEEE=ieee,
            KV_SCALED=scaled,
            F16_TILES=f16_tiles,
            TMA=tma,
            **pcfg,
        )
    return out


def _pool_descriptor(cache: torch.Tensor, block_n: int) -> TensorDescriptor:
    NB, BS, Hkv, Dh = cache.shape
    return TensorDescriptor(cache, [NB * BS, Hkv * Dh], [Hkv * Dh, 1], [block_n, Dh])


def attention_flops(new_tokens: list[int], seq_lens: list[int], q_heads: int, head_dim: int) -> float:
    """Causal attention FLOPs of one step (QK^T and PV, 2 FLOPs per MAC), for benchmarks."""
    total = 0.0
    for n, L in zip(new_tokens, seq_lens):
        ctx = L - n
        # query j attends to ctx + j + 1 keys
        total += n * ctx + n * (n + 1) / 2
    return 4.0 * total * q_heads * head_dim


__all__ = [
    "DecodeKernel",
    "PrefillKernel",
    "write_kv_triton",
    "paged_attention_triton",
    "num_decode_splits",
    "attention_flops",
    "step_index",
]
