"""Prefill/extend paged attention for Hopper (sm_90) in Gluon, Triton's lower-level dialect.

Same contract, grid and step layout as `triton_attention._prefill_kernel`; what Gluon adds is warp
specialisation (a producer warp streaming K/V tiles by TMA, two consumer warp groups issuing their own
warp-group MMAs in turns), which a `tl.dot` loop cannot express. Over a float8 (e4m3) cache one more warp
group per pool (K's, V's) is both its producer and its converter: it lands the 8-bit tiles in a staging ring
and upcasts them to float16 into the ring the consumers read (the products run in float16, the scales fold
into the softmax scale and the output); on the H200 that runs at 0.74-0.75 of the 16-bit kernel on the same
values, 1.4-1.5x the Triton kernel over fp8 (benchmarks/README.md). The QK8 form (`_PREFILL_SM90_QK8`, not the
default: it has compiled for sm_90 but not yet run on a GPU) lands K's 8-bit tiles directly in the consumers'
ring and computes S as an e4m3 product against per-row e4m3 queries; only V is converted.
`cuda_attention` sends the steps it can take here (`sm90_prefill_box`); the CPU interpreter cannot run
Gluon, so the CPU tests compile it ahead of time for sm_90 and the GPU tests check it against the float64
reference.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from hyserve.kernels.launch_util import tma_tiles_fit

_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_GL_FP8 = {torch.float8_e4m3fn: gl.float8e4nv}  # float8 caches this kernel reads (16-bit queries only)
# Launch settings; `benchmarks/bench_kernels.py --only attn_sweep` times alternatives (benchmarks/README.md).
# maxnreg: the registers a thread at entry, 64k over the threads of every warp group (here 3 x 128), before
# each group re-takes its own count (`_prefill_kernel_sm90`).
_PREFILL_SM90 = dict(BLOCK_M=128, BLOCK_N=128, STAGES=3, num_warps=4, maxnreg=168)
# Over a float8 cache: STAGES 16-bit slots the consumers read, STAGES8 8-bit staging slots per pool the copy
# engine fills, and CONVERT_ROWS rows upcast at a time by each pool's converter (also its producer: a warp
# group of 4 with 24 registers a thread, beside 232 for each consumer group; the upcast is latency-bound, so
# more rows a step and a group per pool are what made it keep up). Q (32 KiB) + 2 x 64 + 2 x 32 KiB fill the
# 227 a block may have; `bench_kernels.py --only attn_sweep` times the alternatives (benchmarks/README.md).
# 4 warp groups of 128 threads: maxnreg 128.
_PREFILL_SM90_FP8 = dict(
    BLOCK_M=128, BLOCK_N=128, STAGES=2, STAGES8=2, CONVERT_ROWS=32, num_warps=4, maxnreg=128, QK8=False
)
# QK8 (not the default until a GPU run has checked and timed it: benchmarks/README.md): S = Q K^T as an e4m3
# warp-group MMA straight from the TMA-loaded 8-bit K tiles, with each query row quantised to e4m3 by its own
# scale (amax / 448) as it loads, the row scales folded into the softmax scale, as FlashAttention-3 does; only
# V goes through a converter group into a float16 ring. No K upcast, half the converter work, 2x the
# tensor-core rate for S. Shared memory: Q 16 KiB, K 3 x 16, V 3 x 32 + 2 x 16 staging: 192 KiB. 4 warp groups
# (the K producer warp fills one): maxnreg 128, re-divided 232 / 24 / 24 as in the converter form.
_PREFILL_SM90_QK8 = dict(_PREFILL_SM90_FP8, STAGES=3, QK8=True)


@gluon.constexpr_function
def _load_layout(head_dim, num_warps):
    """Registers layout for pointer loads of [rows, head_dim] 16-bit tiles: 8 elements (16 bytes) per
    thread along the head dim."""
    cols = min(32, head_dim // 8)
    return gl.BlockedLayout([1, 8], [32 // cols, cols], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _convert_layout(head_dim, num_warps):
    """Registers layout for the converter's [rows, head_dim] 8-bit tiles: 16 elements (16 bytes in, 32 out)
    per thread along the head dim."""
    cols = min(32, head_dim // 16)
    return gl.BlockedLayout([1, 16], [32 // cols, cols], [num_warps, 1], [1, 0])


@gluon.jit
def _issue_boxes(
    desc,
    bufs,
    bar,
    slot,
    start,
    bt_row,
    col,
    limit,
    BS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BOX: gl.constexpr,
):
    """TMA loads of the key tile at position `start` of one pool into ring slot `slot`, as BLOCK_N / BOX
    boxes, all signalling `bar` (the caller expects their bytes). A box at or past `limit` (whose block-table
    entry may not exist) loads the tile's first box again, so the byte count stays whole: its rows are masked
    by the reader."""
    for b in gl.static_range(BLOCK_N // BOX):
        pos = start + b * BOX
        pos = gl.where(pos < limit, pos, start)
        row = (gl.load(bt_row + pos // BS) * BS + pos % BS).to(gl.int32)
        tma.async_copy_global_to_shared(desc, [row, col], bar, bufs.index(slot).slice(b * BOX, BOX))


@gluon.jit
def _issue_tile(
    kd,
    vd,
    k_bufs,
    v_bufs,
    ready,
    bt_row,
    t,
    kvh,
    limit,
    BS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BOX: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Key tile t (positions t * BLOCK_N ..., starting below `limit`) of both pools into ring slot t % STAGES,
    both signalling the slot's barrier."""
    slot = t % STAGES
    bar = ready.index(slot)
    mbarrier.expect(bar, 2 * BLOCK_N * kd.block_type.shape[1] * kd.dtype.primitive_bitwidth // 8)
    col = (kvh * kd.block_type.shape[1]).to(gl.int32)
    _issue_boxes(kd, k_bufs, bar, slot, t * BLOCK_N, bt_row, col, limit, BS, BLOCK_N, BOX)
    _issue_boxes(vd, v_bufs, bar, slot, t * BLOCK_N, bt_row, col, limit, BS, BLOCK_N, BOX)


@gluon.jit
def _issue_one(
    desc,
    bufs8,
    ready8,
    bt_row,
    t,
    kvh,
    limit,
    BS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BOX: gl.constexpr,
    STAGES8: gl.constexpr,
):
    """Key tile t of one 8-bit pool into staging slot t % STAGES8 (the converter form: one pool per group)."""
    slot = t % STAGES8
    bar = ready8.index(slot)
    mbarrier.expect(bar, BLOCK_N * desc.block_type.shape[1] * desc.dtype.primitive_bitwidth // 8)
    col = (kvh * desc.block_type.shape[1]).to(gl.int32)
    _issue_boxes(desc, bufs8, bar, slot, t * BLOCK_N, bt_row, col, limit, BS, BLOCK_N, BOX)


@gluon.jit
def _softmax_rows(s, m_i, l_i, qk_row, DT: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr):
    """`_softmax` with a scale per query row (qk_row, in the rows layout of s, each > 0): the QK8 form's
    e4m3 query row scales times the softmax scale."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_row)
    p = gl.exp2(s * qk_row[:, None] - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return m_new, l_i, gl.convert_layout(p.to(DT), p_layout), gl.convert_layout(alpha, o_rows)


@gluon.jit
def _softmax(s, m_i, l_i, qk_scale, DT: gl.constexpr, p_layout: gl.constexpr, o_rows: gl.constexpr):
    """One online-softmax update on raw (unscaled, masked) scores s: the new running max and denominator,
    the probabilities in dtype DT as the PV product's register operand, and the factor (in the output's
    row layout) to rescale the output by."""
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return m_new, l_i, gl.convert_layout(p.to(DT), p_layout), gl.convert_layout(alpha, o_rows)


# --------------------------------------------------------------------------- kernel
#
#   producer    one warp (24 registers) streams the query block's key tiles, band included, through a ring
#               of STAGES [BLOCK_N, D] slots for K and V: TMA from descriptors over the pools flattened to
#               [blocks * BS, kv_heads * D], a tile as BLOCK_N / BOX boxes each inside one pool block. A
#               slot's `ready` barrier flips when its bytes land; it is refilled once its `empty` barrier
#               has an arrival from each consumer.
#   consumers   two warp groups (240 registers each), query rows [0, BLOCK_M/2) and [BLOCK_M/2, BLOCK_M), Q
#               in shared memory: S = Q K^T, masks on band tiles, online softmax in float32 (exp2, the scale
#               folded into one multiply-add), O += P V with P from registers, then release the slot.
#   turns       the groups take turns at the tensor cores (ping-pong, as FlashAttention-3): a group issues
#               its products (PV of tile t-1, S of tile t) only in its turn and then passes it on, so its
#               softmax of tile t runs while the other's products do. Two mbarriers carry the turn.
#   band        rows past the sequence in a band tile hold whatever the pool had (NaN included): their
#               scores are masked and their V rows zeroed in shared memory before the PV product.


@gluon.jit
def _ws_loader(
    kd,
    vd,
    k_bufs,
    v_bufs,
    ready,
    empty,
    bt_row,
    kvh,
    ntiles,
    kv_end,
    BS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BOX: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Producer warp: key tiles 0 .. ntiles-1 into the ring, each once both consumers have released its
    slot (empty barriers start released: the first pass waits on the phase before)."""
    for t in range(ntiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        _issue_tile(kd, vd, k_bufs, v_bufs, ready, bt_row, t, kvh, kv_end, BS, BLOCK_N, BOX, STAGES)


@gluon.jit
def _ws_k8_loader(
    kd,
    k_bufs,
    ready,
    empty,
    bt_row,
    kvh,
    ntiles,
    kv_end,
    BS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BOX: gl.constexpr,
    STAGES: gl.constexpr,
):
    """Producer warp of the QK8 form: the 8-bit K tiles straight into the ring the consumers' e4m3 MMAs read,
    each slot once both consumers released it. Its expect is one of the slot's two `ready` arrivals (V's
    converter gives the other) and the TMA bytes complete it."""
    for t in range(ntiles):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        _issue_one(kd, k_bufs, ready, bt_row, t, kvh, kv_end, BS, BLOCK_N, BOX, STAGES)


@gluon.jit
def _ws_band(s, v_smem, t, nfull, kv_end, qpos, offs_sn, offs_vn, BLOCK_N: gl.constexpr, ld: gl.constexpr):
    """Scores of key tile t with the causal and length masks when t is a band tile (t >= nfull); V rows
    past kv_end zeroed in shared memory: they hold whatever the pool (or a repeated box) had, NaN
    included, and P = 0 times NaN is NaN. The other consumer rewrites the same slot with the same values
    (both see the same kv_end), so neither's products can read anything else."""
    if t >= nfull:
        pos = t * BLOCK_N + offs_sn
        s = gl.where((pos < kv_end)[None, :] & (pos[None, :] <= qpos[:, None]), s, float("-inf"))
        if (t + 1) * BLOCK_N > kv_end:
            v = v_smem.load(ld)
            v_smem.store(gl.where((t * BLOCK_N + offs_vn < kv_end)[:, None], v, gl.zeros_like(v)))
            fence_async_shared()
            gl.thread_barrier()
    return s


@gluon.jit
def _ws_consumer(
    q_ptr,
    out_ptr,
    ks_ptr,
    vs_ptr,
    q_bufs,
    k_bufs,
    v_bufs,
    ready,
    empty,
    turn,
    q0,
    n,
    m0,
    ctx,
    h,
    nfull,
    ntiles,
    kv_end,
    qk_scale,
    s_q_t,
    s_q_h,
    s_o_t,
    s_o_h,
    HALF: gl.constexpr,
    ROWS: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr,
    DT: gl.constexpr,
    KV_SCALED: gl.constexpr,
    QK8: gl.constexpr,
):
    """One warp group: query rows m0 + HALF * ROWS .. + ROWS of the block against every key tile the
    producer loads (the first nfull unmasked, the rest masked on position), releasing each slot after its
    PV product; products issued in this group's turns (`turn`: one mbarrier per group), so one group's
    softmax overlaps the other's products. DT: the PV product's dtype (the V ring's; float16 over a float8
    cache, whose bf16 queries are clamped into its range). KV_SCALED: the cache's scales, device scalars, fold
    into the softmax scale (k_scale) and the output (v_scale). QK8: the K ring holds the cache's e4m3 tiles
    and S is an e4m3 product: each query row is quantised to e4m3 by its own scale (amax / 448, 1 for a zero
    row) and the row scales fold into the softmax scale."""
    WARPS: gl.constexpr = 4
    KS: gl.constexpr = 32 if QK8 else 16  # the MMA's K step: 32 bytes of 8-bit operands, 16 of 16-bit
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, KS]
    )
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
    s_cols: gl.constexpr = gl.SliceLayout(0, s_layout)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    ld: gl.constexpr = _load_layout(HEAD_DIM, WARPS)
    ld_rows: gl.constexpr = gl.SliceLayout(1, ld)

    r0 = m0 + HALF * ROWS
    q_smem = q_bufs.index(HALF)
    offs_m = r0 + gl.arange(0, ROWS, layout=ld_rows)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, ld))
    q = gl.load(
        q_ptr + (q0 + offs_m)[:, None] * s_q_t + h * s_q_h + offs_d[None, :],
        mask=(offs_m < n)[:, None],
        other=0.0,
    )
    if QK8:
        qf = q.to(gl.float32)
        amax = gl.max(gl.abs(qf), axis=1)
        q_rs = gl.where(amax > 0, gl.div_rn(amax, 448.0), 1.0)  # |q / q_rs| <= 448: no e4m3 overflow
        q_smem.store(
            gl.div_rn(qf, q_rs[:, None]).to(q_smem.dtype)
        )  # correctly rounded: the reference's codes
    else:
        if q.dtype != DT:  # bf16 queries over a float8 cache's float16 tiles
            q = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0)
        q_smem.store(q.to(DT))
    fence_async_shared()
    gl.thread_barrier()
    if KV_SCALED:
        qk_scale = qk_scale * gl.load(ks_ptr).to(gl.float32)
    if QK8:
        qk_row = gl.convert_layout(q_rs, s_rows) * qk_scale

    qpos = ctx + r0 + gl.arange(0, ROWS, layout=s_rows)
    offs_sn = gl.arange(0, BLOCK_N, layout=s_cols)
    offs_vn = gl.arange(0, BLOCK_N, layout=ld_rows)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, s_rows)
    l_i = gl.zeros([ROWS], gl.float32, s_rows)
    acc = gl.zeros([ROWS, HEAD_DIM], gl.float32, o_layout)
    # Turns: this group's products are issued only in its turn, and the turn passes to the other group
    # once they are issued, so one group's softmax runs while the other's products do. Turn 0 issues
    # S(0); turn t issues O += P(t-1) V(t-1) and S(t); turn ntiles the last PV. Group 0's first wait
    # passes at once (a fresh barrier's previous phase counts as complete).
    mine = turn.index(HALF)
    other = turn.index(1 - HALF)
    mbarrier.wait(ready.index(0), 0)
    mbarrier.wait(mine, 1 - HALF)
    s_tok = warpgroup_mma(
        q_smem,
        k_bufs.index(0).permute((1, 0)),
        gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
        use_acc=False,
        is_async=True,
    )
    mbarrier.arrive(other, count=1)
    s = warpgroup_mma_wait(0, deps=[s_tok])
    for t in range(ntiles - 1):
        slot = t % STAGES
        s = _ws_band(s, v_bufs.index(slot), t, nfull, kv_end, qpos, offs_sn, offs_vn, BLOCK_N, ld)
        if QK8:
            m_i, l_i, p, alpha = _softmax_rows(s, m_i, l_i, qk_row, DT, p_layout, o_rows)
        else:
            m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, DT, p_layout, o_rows)
        acc = acc * alpha[:, None]
        nxt = (t + 1) % STAGES
        mbarrier.wait(ready.index(nxt), ((t + 1) // STAGES) & 1)
        mbarrier.wait(mine, ((t + 1) & 1) ^ (1 - HALF))
        o_tok = warpgroup_mma(p, v_bufs.index(slot), acc, is_async=True)
        s_tok = warpgroup_mma(
            q_smem,
            k_bufs.index(nxt).permute((1, 0)),
            gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout),
            use_acc=False,
            is_async=True,
        )
        mbarrier.arrive(other, count=1)
        acc, s, p = warpgroup_mma_wait(0, deps=[o_tok, s_tok, p])
        gl.thread_barrier()  # every warp of this group is done with the slot
        mbarrier.arrive(empty.index(slot), count=1)
    last = ntiles - 1
    slot = last % STAGES
    s = _ws_band(s, v_bufs.index(slot), last, nfull, kv_end, qpos, offs_sn, offs_vn, BLOCK_N, ld)
    if QK8:
        m_i, l_i, p, alpha = _softmax_rows(s, m_i, l_i, qk_row, DT, p_layout, o_rows)
    else:
        m_i, l_i, p, alpha = _softmax(s, m_i, l_i, qk_scale, DT, p_layout, o_rows)
    acc = acc * alpha[:, None]
    mbarrier.wait(mine, (ntiles & 1) ^ (1 - HALF))
    o_tok = warpgroup_mma(p, v_bufs.index(slot), acc, is_async=True)
    mbarrier.arrive(other, count=1)
    acc, p = warpgroup_mma_wait(0, deps=[o_tok, p])
    gl.thread_barrier()
    mbarrier.arrive(empty.index(slot), count=1)

    out = acc / gl.convert_layout(l_i, o_rows)[:, None]
    if KV_SCALED:
        out = out * gl.load(vs_ptr).to(gl.float32)
    offs_om = r0 + gl.arange(0, ROWS, layout=o_rows)
    offs_od = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    gl.store(
        out_ptr + (q0 + offs_om)[:, None] * s_o_t + h * s_o_h + offs_od[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(offs_om < n)[:, None],
    )


@gluon.jit
def _ws_converter(
    desc,
    bufs8,
    bufs,
    ready8,
    ready,
    empty,
    bt_row,
    kvh,
    ntiles,
    kv_end,
    BS: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BOX: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr,
    STAGES8: gl.constexpr,
    ROWS: gl.constexpr,
):
    """Producer and converter warp group of one pool, K's or V's (float8 caches): key tile t lands by TMA in
    this group's staging slot t % STAGES8; once it has, and both consumers have released 16-bit slot
    t % STAGES, it is upcast into that slot ROWS rows at a time, the staging slot is refilled with tile
    t + STAGES8 and the group arrives on the slot's `ready` (which the consumers wait for from both groups).
    e4m3 -> f16 is exact (one instruction per pair); NaN bytes past a sequence stay NaN and are masked by the
    consumers."""
    ld: gl.constexpr = _convert_layout(HEAD_DIM, 4)
    DT: gl.constexpr = bufs.dtype
    for t in gl.static_range(STAGES8):
        if t < ntiles:
            _issue_one(desc, bufs8, ready8, bt_row, t, kvh, kv_end, BS, BLOCK_N, BOX, STAGES8)
    for t in range(ntiles):
        s8 = t % STAGES8
        slot = t % STAGES
        mbarrier.wait(ready8.index(s8), (t // STAGES8) & 1)
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        for c in gl.static_range(BLOCK_N // ROWS):
            x = bufs8.index(s8).slice(c * ROWS, ROWS).load(ld)
            bufs.index(slot).slice(c * ROWS, ROWS).store(x.to(DT))
        # the generic-proxy stores (and reads of the staging slot) before the tensor cores read the 16-bit
        # slot and the copy engine rewrites the staging one
        fence_async_shared()
        gl.thread_barrier()  # every warp of the group is done with both slots
        if t + STAGES8 < ntiles:
            _issue_one(desc, bufs8, ready8, bt_row, t + STAGES8, kvh, kv_end, BS, BLOCK_N, BOX, STAGES8)
        mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _alloc_barriers(count, arrivals: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(count):
        mbarrier.init(bars.index(i), count=arrivals)
    return bars


@gluon.jit
def _free_barriers(bars, count: gl.constexpr):
    for i in gl.static_range(count):
        mbarrier.invalidate(bars.index(i))


@gluon.jit(do_not_specialize=["seq_offset", "s_bt_s"])
def _prefill_kernel_sm90(
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
    BS: gl.constexpr,
    REP: gl.constexpr,
    HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BOX: gl.constexpr,
    STAGES: gl.constexpr,
    STAGES8: gl.constexpr,
    KV_SCALED: gl.constexpr,
    CONVERT_ROWS: gl.constexpr,
    QK8: gl.constexpr,
    num_warps: gl.constexpr,
):
    """A producer warp streams the key tiles (band included) through the ring, two consumer warp groups take
    BLOCK_M / 2 query rows each (the module docstring). STAGES8 > 0: the cache is float8; a producer-converter
    warp group per pool fills its 8-bit staging ring of STAGES8 slots and upcasts each tile into the 16-bit
    ring, CONVERT_ROWS rows at a time (`_ws_converter`); with QK8 only V's is converted and K's tiles land
    in the ring the consumers' e4m3 MMAs read (`_ws_k8_loader`)."""
    ROWS: gl.constexpr = BLOCK_M // 2
    h = gl.program_id(0)
    mb = gl.num_programs(1) - 1 - gl.program_id(1)
    seq = seq_offset + gl.program_id(2).to(gl.int64)
    q0 = gl.load(cu_ptr + seq).to(gl.int64)
    n = gl.load(cu_ptr + seq + 1).to(gl.int64) - q0
    m0 = mb * BLOCK_M
    L = gl.load(lens_ptr + seq).to(gl.int64)
    ctx = L - n
    kvh = h // REP
    bt_row = bt_ptr + seq * s_bt_s
    full_end = (ctx + m0) // BLOCK_N * BLOCK_N
    nfull = (full_end // BLOCK_N).to(gl.int32)
    kv_end = gl.minimum(L, ctx + m0 + BLOCK_M)
    ntiles = ((kv_end + BLOCK_N - 1) // BLOCK_N).to(gl.int32)

    if m0 < n:  # (a mixed step's grid has room for its longest prefill: most blocks are empty)
        turn = _alloc_barriers(2, 1)
        empty = _alloc_barriers(STAGES, 2)  # one arrival per consumer warp group
        # the TMA bytes landing (16-bit caches), or two arrivals (float8): both converter groups', or with QK8
        # the K producer's expect (its bytes landing completes it) and V's converter group's
        ready = _alloc_barriers(STAGES, 1 if STAGES8 == 0 else 2)
        # (each branch spells its partitions' argument tuples out: warp_specialize takes literal tuples, a
        # tuple built from parts does not compile in this Triton)
        if STAGES8 == 0:
            DT: gl.constexpr = kd.dtype
            q_bufs = gl.allocate_shared_memory(DT, [2, ROWS, HEAD_DIM], kd.layout)
            k_bufs = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, HEAD_DIM], kd.layout)
            v_bufs = gl.allocate_shared_memory(DT, [STAGES, BLOCK_N, HEAD_DIM], vd.layout)
            gl.warp_specialize(
                [
                    (
                        _ws_consumer,
                        (
                            q_ptr,
                            out_ptr,
                            ks_ptr,
                            vs_ptr,
                            q_bufs,
                            k_bufs,
                            v_bufs,
                            ready,
                            empty,
                            turn,
                            q0,
                            n,
                            m0,
                            ctx,
                            h,
                            nfull,
                            ntiles,
                            kv_end,
                            qk_scale,
                            s_q_t,
                            s_q_h,
                            s_o_t,
                            s_o_h,
                            0,
                            ROWS,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            DT,
                            KV_SCALED,
                            False,
                        ),
                    ),
                    (
                        _ws_consumer,
                        (
                            q_ptr,
                            out_ptr,
                            ks_ptr,
                            vs_ptr,
                            q_bufs,
                            k_bufs,
                            v_bufs,
                            ready,
                            empty,
                            turn,
                            q0,
                            n,
                            m0,
                            ctx,
                            h,
                            nfull,
                            ntiles,
                            kv_end,
                            qk_scale,
                            s_q_t,
                            s_q_h,
                            s_o_t,
                            s_o_h,
                            1,
                            ROWS,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            DT,
                            KV_SCALED,
                            False,
                        ),
                    ),
                    (
                        _ws_loader,
                        (
                            kd,
                            vd,
                            k_bufs,
                            v_bufs,
                            ready,
                            empty,
                            bt_row,
                            kvh,
                            ntiles,
                            kv_end,
                            BS,
                            BLOCK_N,
                            BOX,
                            STAGES,
                        ),
                    ),
                ],
                [4, 1],
                [240, 24],
            )
        elif QK8:
            F16: gl.constexpr = gl.float16
            ring: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], F16)
            q8_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, HEAD_DIM], kd.dtype)
            q_bufs = gl.allocate_shared_memory(kd.dtype, [2, ROWS, HEAD_DIM], q8_layout)
            k_bufs = gl.allocate_shared_memory(kd.dtype, [STAGES, BLOCK_N, HEAD_DIM], kd.layout)
            v_bufs = gl.allocate_shared_memory(F16, [STAGES, BLOCK_N, HEAD_DIM], ring)
            v8_bufs = gl.allocate_shared_memory(vd.dtype, [STAGES8, BLOCK_N, HEAD_DIM], vd.layout)
            v_ready8 = _alloc_barriers(STAGES8, 1)
            # K's producer warp (its expect is one of `ready`'s two arrivals) and V's producer + converter
            # group
            gl.warp_specialize(
                [
                    (
                        _ws_consumer,
                        (
                            q_ptr,
                            out_ptr,
                            ks_ptr,
                            vs_ptr,
                            q_bufs,
                            k_bufs,
                            v_bufs,
                            ready,
                            empty,
                            turn,
                            q0,
                            n,
                            m0,
                            ctx,
                            h,
                            nfull,
                            ntiles,
                            kv_end,
                            qk_scale,
                            s_q_t,
                            s_q_h,
                            s_o_t,
                            s_o_h,
                            0,
                            ROWS,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            F16,
                            KV_SCALED,
                            True,
                        ),
                    ),
                    (
                        _ws_consumer,
                        (
                            q_ptr,
                            out_ptr,
                            ks_ptr,
                            vs_ptr,
                            q_bufs,
                            k_bufs,
                            v_bufs,
                            ready,
                            empty,
                            turn,
                            q0,
                            n,
                            m0,
                            ctx,
                            h,
                            nfull,
                            ntiles,
                            kv_end,
                            qk_scale,
                            s_q_t,
                            s_q_h,
                            s_o_t,
                            s_o_h,
                            1,
                            ROWS,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            F16,
                            KV_SCALED,
                            True,
                        ),
                    ),
                    (
                        _ws_k8_loader,
                        (kd, k_bufs, ready, empty, bt_row, kvh, ntiles, kv_end, BS, BLOCK_N, BOX, STAGES),
                    ),
                    (
                        _ws_converter,
                        (
                            vd,
                            v8_bufs,
                            v_bufs,
                            v_ready8,
                            ready,
                            empty,
                            bt_row,
                            kvh,
                            ntiles,
                            kv_end,
                            BS,
                            BLOCK_N,
                            BOX,
                            HEAD_DIM,
                            STAGES,
                            STAGES8,
                            CONVERT_ROWS,
                        ),
                    ),
                ],
                [4, 1, 4],
                [232, 24, 24],
            )
            _free_barriers(v_ready8, STAGES8)
        else:  # constexpr locals per branch, as Gluon declares them (mypy reads a second definition)
            F16: gl.constexpr = gl.float16  # type: ignore[no-redef]
            ring: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], F16)  # type: ignore[no-redef]
            k_bufs = gl.allocate_shared_memory(F16, [STAGES, BLOCK_N, HEAD_DIM], ring)
            v_bufs = gl.allocate_shared_memory(F16, [STAGES, BLOCK_N, HEAD_DIM], ring)
            q_bufs = gl.allocate_shared_memory(F16, [2, ROWS, HEAD_DIM], ring)
            k8_bufs = gl.allocate_shared_memory(kd.dtype, [STAGES8, BLOCK_N, HEAD_DIM], kd.layout)
            v8_bufs = gl.allocate_shared_memory(vd.dtype, [STAGES8, BLOCK_N, HEAD_DIM], vd.layout)
            k_ready8 = _alloc_barriers(STAGES8, 1)
            v_ready8 = _alloc_barriers(STAGES8, 1)
            # one producer + converter warp group per pool, each with the 24 registers a thread that 232 for
            # each consumer group leave (registers are re-divided per warp group)
            gl.warp_specialize(
                [
                    (
                        _ws_consumer,
                        (
                            q_ptr,
                            out_ptr,
                            ks_ptr,
                            vs_ptr,
                            q_bufs,
                            k_bufs,
                            v_bufs,
                            ready,
                            empty,
                            turn,
                            q0,
                            n,
                            m0,
                            ctx,
                            h,
                            nfull,
                            ntiles,
                            kv_end,
                            qk_scale,
                            s_q_t,
                            s_q_h,
                            s_o_t,
                            s_o_h,
                            0,
                            ROWS,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            F16,
                            KV_SCALED,
                            False,
                        ),
                    ),
                    (
                        _ws_consumer,
                        (
                            q_ptr,
                            out_ptr,
                            ks_ptr,
                            vs_ptr,
                            q_bufs,
                            k_bufs,
                            v_bufs,
                            ready,
                            empty,
                            turn,
                            q0,
                            n,
                            m0,
                            ctx,
                            h,
                            nfull,
                            ntiles,
                            kv_end,
                            qk_scale,
                            s_q_t,
                            s_q_h,
                            s_o_t,
                            s_o_h,
                            1,
                            ROWS,
                            HEAD_DIM,
                            BLOCK_N,
                            STAGES,
                            F16,
                            KV_SCALED,
                            False,
                        ),
                    ),
                    (
                        _ws_converter,
                        (
                            kd,
                            k8_bufs,
                            k_bufs,
                            k_ready8,
                            ready,
                            empty,
                            bt_row,
                            kvh,
                            ntiles,
                            kv_end,
                            BS,
                            BLOCK_N,
                            BOX,
                            HEAD_DIM,
                            STAGES,
                            STAGES8,
                            CONVERT_ROWS,
                        ),
                    ),
                    (
                        _ws_converter,
                        (
                            vd,
                            v8_bufs,
                            v_bufs,
                            v_ready8,
                            ready,
                            empty,
                            bt_row,
                            kvh,
                            ntiles,
                            kv_end,
                            BS,
                            BLOCK_N,
                            BOX,
                            HEAD_DIM,
                            STAGES,
                            STAGES8,
                            CONVERT_ROWS,
                        ),
                    ),
                ],
                [4, 4, 4],
                [232, 24, 24],
            )
            _free_barriers(k_ready8, STAGES8)
            _free_barriers(v_ready8, STAGES8)
        _free_barriers(ready, STAGES)
        _free_barriers(empty, STAGES)
        _free_barriers(turn, 2)


# --------------------------------------------------------------------------- launcher


def sm90_prefill_box(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> int:
    """Rows per TMA box when this kernel can take the step's prefill part, else 0: a Hopper GPU, 16-bit
    queries over caches of the same dtype or of float8 e4m3 with a head dim of 64 or 128, and key tiles that
    load as boxes of min(block size, block_n) rows (`launch_util.tma_tiles_fit`'s rules)."""
    if not q.is_cuda or not _is_hopper(
        q.device.index if q.device.index is not None else torch.cuda.current_device()
    ):
        return 0
    if (
        q.dtype not in _GL_DTYPES
        or v_cache.dtype != k_cache.dtype
        or k_cache.dtype not in (q.dtype, *_GL_FP8)
    ):
        return 0
    NB, BS, Hkv, Dh = k_cache.shape
    box = min(BS, block_n)
    if Dh not in (64, 128) or block_n % box or not tma_tiles_fit(k_cache, v_cache, box):
        return 0
    return box


@cache
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


@cache
def _box_layout(box: int, head_dim: int, dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of one [box, head_dim] TMA box (cached: the launcher's host time counts in
    every eager prefill layer)."""
    return gl.NVMMASharedLayout.get_default_for([box, head_dim], {**_GL_DTYPES, **_GL_FP8}[dtype])


def _pool_descriptor(cache: torch.Tensor, box: int) -> TensorDescriptor:
    NB, BS, Hkv, Dh = cache.shape
    return TensorDescriptor(
        cache, [NB * BS, Hkv * Dh], [Hkv * Dh, 1], [box, Dh], _box_layout(box, Dh, cache.dtype)
    )


def prefill_attention_sm90(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens_t: torch.Tensor,
    cu_t: torch.Tensor,
    out: torch.Tensor,
    seq_offset: int,
    num_seqs: int,
    max_new: int,
    qk_scale: float,
    *,
    box: int,
    BLOCK_M: int,
    BLOCK_N: int,
    STAGES: int,
    num_warps: int,
    maxnreg: int,
    STAGES8: int = 0,
    CONVERT_ROWS: int = 32,
    QK8: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """out[rows of sequences seq_offset .. seq_offset + num_seqs) = attention of those prefill/extend
    sequences (the launcher's checks done; `box` from `sm90_prefill_box`). lens_t / cu_t: the step's
    device seq_lens and cumulative new-token offsets. num_warps: a consumer warp group's 4; maxnreg: see
    `_PREFILL_SM90`. STAGES8: the
    staging slots of a float8 cache (required there, 0 for a 16-bit one); k_scale / v_scale: the cache's
    scales as device scalars, or None. CONVERT_ROWS: rows the converter upcasts at a time (float8 caches).
    QK8 (float8 caches): S as an e4m3 product over the cache's K tiles (`_PREFILL_SM90_QK8`)."""
    T, Hq, Dh = q.shape
    Hkv = k_cache.shape[2]
    fp8 = k_cache.dtype in _GL_FP8
    assert BLOCK_N % box == 0 and BLOCK_M == 128 and num_warps == 4
    assert (STAGES8 > 0) == fp8, "a float8 cache takes the converter's staging ring, a 16-bit one none"
    assert fp8 or not QK8, "QK8 is a float8 cache's form"
    scaled = k_scale is not None
    assert (v_scale is not None) == scaled
    _prefill_kernel_sm90[(Hq, triton.cdiv(max_new, BLOCK_M), num_seqs)](
        q,
        k_cache,
        v_cache,
        _pool_descriptor(k_cache, box),
        _pool_descriptor(v_cache, box),
        block_tables,
        lens_t,
        cu_t,
        out,
        k_scale if scaled else q,
        v_scale if scaled else q,
        seq_offset,
        qk_scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        BS=k_cache.shape[1],
        REP=Hq // Hkv,
        HEAD_DIM=Dh,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BOX=box,
        STAGES=STAGES,
        STAGES8=STAGES8,
        KV_SCALED=scaled,
        CONVERT_ROWS=CONVERT_ROWS,
        QK8=QK8,
        num_warps=num_warps,
        maxnreg=maxnreg,
    )


def prefill_sm90(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens_t: torch.Tensor,
    cu_t: torch.Tensor,
    out: torch.Tensor,
    seq_offset: int,
    num_seqs: int,
    max_new: int,
    qk_scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> bool:
    """The prefill part of a step on this kernel at `_PREFILL_SM90`'s settings (`_PREFILL_SM90_FP8`'s over a
    float8 cache) when it can take it (`sm90_prefill_box`; scales only with a float8 cache, the one the engine
    scales), returning True; False, with nothing written, otherwise (a `triton_attention.PrefillKernel`)."""
    fp8 = k_cache.dtype in _GL_FP8
    cfg: dict[str, Any] = _PREFILL_SM90_FP8 if fp8 else _PREFILL_SM90  # ints and the QK8 flag
    box = sm90_prefill_box(q, k_cache, v_cache, cfg["BLOCK_N"])
    if not box or (k_scale is not None and not fp8):
        return False
    prefill_attention_sm90(
        q,
        k_cache,
        v_cache,
        block_tables,
        lens_t,
        cu_t,
        out,
        seq_offset,
        num_seqs,
        max_new,
        qk_scale,
        box=box,
        k_scale=k_scale,
        v_scale=v_scale,
        **cfg,
    )
    return True


__all__ = ["sm90_prefill_box", "prefill_attention_sm90", "prefill_sm90"]
