"""Split-KV decode attention over a float8 (e4m3) paged KV cache, in Gluon with one warp a program.

Same contract as `triton_attention._decode_kernel`: grid (decode sequences, kv heads, splits); a program reads
one split of one sequence's K/V once for the q heads of its GQA group and writes a partial output and its
log-sum-exp, which `triton_attention._combine_kernel` merges.

Why a kernel of its own. In the `tl.dot` kernel every 8-bit tile crosses shared memory twice: once as it
lands, and again as the float16 operand of the product after its upcast (the sm_90 PTX of that loop; the
H200 read the cache at 0.55-0.65 of HBM bandwidth over fp8 against 0.90-0.95 over bf16). Here a tile never
touches shared memory:

  * One warp a program, so the running max and sum of the online softmax never leave the warp (no barrier,
    no shared-memory reduction); more splits keep the GPU full (`decode_splits`).
  * The products are `mma_v2` (m16n8k16, float16 in, float32 out) with S = Q K^T (the GQA group's q heads
    padded to 16 rows) and O += P V, P straight from S's accumulator registers.
  * K and V load from global memory straight into registers, in layouts whose every thread holds exactly
    the elements its MMA operand fragment needs, as contiguous bytes (16-byte loads):
      - K: the head dim is read in a permuted order. Thread lane % 4 == c holds, of each key row, the bytes
        [c D/4, (c + 1) D/4); viewing byte m = (D/4) c + 2 j + e as head-dim index 8 j + 2 c + e makes that
        exactly the B fragment of K^T. q is loaded in the same permuted order, and a dot product does not
        depend on the order of its terms.
      - V: thread lane // 4 == r holds the bytes [r D/8, (r + 1) D/8) of its keys' rows; byte m = (D/8) r + t
        is output column 8 t + r of the B fragment of V; the output is stored back in the cache's order.
    The reinterpretations are reshapes and permutes of the register tensors (`_as_kt`, `_as_v`): for K the
    result is the MMA operand layout itself, for V the same elements in another register order.
  * The e4m3 -> float16 upcast is exact; bf16 queries are clamped to float16 (as `_f16_queries` in the
    Triton kernel); k_scale folds into the softmax scale and v_scale into the partial output.
  * The next key tile's loads are issued before the current one's products (PREFETCH), so each warp keeps
    its loads in flight while it computes.

Measured on the H200 (CUDA-graph replay, Nano 9B v2 attention shapes: 40 q / 8 kv heads of 128, 64-token
blocks; benchmarks/results/attn_sweep_gluon_decode_*.json): batch 64 x 8k context 0.326 ms against 0.383 ms
for the Triton kernel (1.17x; 0.76-0.80 of the fp8 bytes roofline), batch 1 x 131k 0.111 ms against 0.112 (no
gain: 0.56 of the roofline; one long sequence is split 198 ways, 42 steps a warp). Slower in the same sweep:
SUB 32 (200 registers, fewer warps a SM: 1.45-1.63x), no prefetch (1.06-1.09x), 4 / 8 / 16 warps a SM in place
of 12. Launched eagerly (host seq lists) its Python launch costs more host time than the Triton kernel's.

`cuda_attention` offers the decode part of a step over a float8 cache here (`decode_fp8`); the CPU
interpreter cannot run Gluon, so the CPU tests compile it ahead of time for sm_90
(tests/gluon_compile_check.py) and the GPU tests check it against the float64 reference.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from hyserve.kernels.launch_util import pdl, split_kv_args, split_kv_count

_GL_FP8 = {torch.float8_e4m3fn: gl.float8e4nv}
_Q_DTYPES = (torch.float16, torch.bfloat16)
# Launch settings: SUB keys a loop step (one [16, SUB] score tile), one warp a program, PREFETCH: the next
# step's tiles in flight during this one's products. Programs: enough for about 12 resident warps on each of
# the H200's 132 SMs (`decode_splits`); maxnreg: ptxas gives the SUB=16 loop 167 registers and no spills under
# 192 (its default choice, 168 with 20 bytes spilled, would put loads on the local-memory path); 168-register
# warps leave room for 12 a SM. `bench_kernels.py --only attn_sweep` times alternatives.
_DECODE_FP8 = dict(SUB=16, PREFETCH=True, maxnreg=192)
_TARGET_PROGRAMS = 132 * 12
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 256
_ROWS = gl.constexpr(16)  # the MMA's M: the q heads of a GQA group, padded


@gluon.constexpr_function
def _mma_layout():
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8])


@gluon.constexpr_function
def _k_load_layout(sub, d):
    """[SUB keys, D / 4 words] of K, 32-bit words of 4 e4m3 bytes: thread (lane // 4, lane % 4 = c) holds keys
    lane // 4 + 8 i and, of each, the D / 4 contiguous bytes from c D / 4 (registers first along the row:
    16-byte loads)."""
    w = d // 4
    regs = [[0, 1 << i] for i in range((w // 4).bit_length() - 1)] + [
        [8 << i, 0] for i in range((sub // 8).bit_length() - 1)
    ]
    lanes = [[0, w // 4], [0, w // 2], [1, 0], [2, 0], [4, 0]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [sub, w])


@gluon.constexpr_function
def _v_load_layout(sub, d):
    """[SUB keys, D / 4 words] of V: thread (r = lane // 4, c = lane % 4) holds keys 2 c + {0, 1} + 8 i and,
    of each, the D / 8 contiguous bytes from r D / 8."""
    w = d // 4
    regs = (
        [[0, 1 << i] for i in range((w // 8).bit_length() - 1)]
        + [[1, 0]]
        + [[8 << i, 0] for i in range((sub // 8).bit_length() - 1)]
    )
    lanes = [[2, 0], [4, 0], [0, w // 8], [0, w // 4], [0, w // 2]]
    return gl.DistributedLinearLayout(regs, lanes, [], [], [sub, w])


@gluon.jit
def _pdl_enter(PDL: gl.constexpr):
    """`triton_common.pdl_enter` for a Gluon kernel: with PDL, wait for the previous kernel on the stream and
    let the next one's blocks be scheduled."""
    if PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _to_f16(x, SUB: gl.constexpr, D: gl.constexpr):
    """[SUB, D / 4] words of e4m3 bytes -> [SUB, D] float16 in memory order: two `cvt.rn.f16x2.e4m3x2` a word
    (the compiler's own conversion of byte tensors takes each byte into a register of its own and builds the
    pairs back with shifts and byte permutes)."""
    b0, b1, b2, b3 = gl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; .reg .b32 a, b; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 a, lo; "
        "cvt.rn.f16x2.e4m3x2 b, hi; mov.b32 {$0, $1}, a; mov.b32 {$2, $3}, b; }",
        "=h,=h,=h,=h,r",
        [x],
        dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
        is_pure=True,
        pack=1,
    )
    # join stacks on a new last axis: [..., a, b] of join(join(b0, b2), join(b1, b3)) is byte 2 a + b
    return gl.reshape(gl.join(gl.join(b0, b2), gl.join(b1, b3)), [SUB, D])


@gluon.jit
def _as_kt(k, SUB: gl.constexpr, D: gl.constexpr):
    """A K tile [SUB, D] in `_k_load_layout` (byte m = (D/4) c + 2 j + e of a row) as K^T [D, SUB] with
    head-dim index 8 j + 2 c + e: the B operand fragment of S = Q K^T, element for element."""
    k = gl.reshape(k, [SUB, 4, D // 8, 2])
    k = gl.permute(k, [0, 2, 1, 3])
    k = gl.reshape(k, [SUB, D])
    return gl.permute(k, [1, 0])


@gluon.jit
def _as_v(v, SUB: gl.constexpr, D: gl.constexpr):
    """A V tile [SUB, D] in `_v_load_layout` (byte m = (D/8) r + t of a row) as [SUB, D] with output column
    8 t + r."""
    v = gl.reshape(v, [SUB, 8, D // 8])
    v = gl.permute(v, [0, 2, 1])
    return gl.reshape(v, [SUB, D])


@gluon.jit
def _tile_ptrs(
    c_ptr,
    bt_row,
    start,
    hi,
    kvh,
    s_b,
    s_r,
    s_h,
    layout: gl.constexpr,
    BS: gl.constexpr,
    SUB: gl.constexpr,
    D: gl.constexpr,
):
    """Word pointers to the [SUB, D] bytes of one head at positions start.. (through the block table; the
    strides in bytes, multiples of 4) in `layout`, and the mask of the positions below `hi`."""
    pos = start + gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
    mn = pos < hi
    blk = gl.load(bt_row + pos // BS, mask=mn, other=0).to(gl.int64)
    rows = (blk * s_b + (pos % BS) * s_r + kvh * s_h) // 4
    cols = gl.arange(0, D // 4, layout=gl.SliceLayout(0, layout))
    return c_ptr.to(gl.pointer_type(gl.int32)) + rows[:, None] + cols[None, :], mn[:, None]


@gluon.jit
def _load_tiles(
    kc_ptr,
    vc_ptr,
    bt_row,
    start,
    hi,
    kvh,
    s_kc_b,
    s_kc_r,
    s_kc_h,
    s_vc_b,
    s_vc_r,
    s_vc_h,
    BS: gl.constexpr,
    SUB: gl.constexpr,
    D: gl.constexpr,
):
    kl: gl.constexpr = _k_load_layout(SUB, D)
    vl: gl.constexpr = _v_load_layout(SUB, D)
    kp, km = _tile_ptrs(kc_ptr, bt_row, start, hi, kvh, s_kc_b, s_kc_r, s_kc_h, kl, BS, SUB, D)
    vp, vm = _tile_ptrs(vc_ptr, bt_row, start, hi, kvh, s_vc_b, s_vc_r, s_vc_h, vl, BS, SUB, D)
    return gl.load(kp, mask=km, other=0), gl.load(vp, mask=vm, other=0)


@gluon.jit
def _step(q_a, k8, v8, start, hi, m_i, l_i, acc, qk_scale, SUB: gl.constexpr, D: gl.constexpr):
    """Fold the key tile at `start` (its 8-bit K and V in the load layouts) into the running max m_i,
    denominator l_i and output acc: S = Q K^T, the masked online softmax (exp2, scale folded), O += P V."""
    mma: gl.constexpr = _mma_layout()
    b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2)
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    kt = gl.convert_layout(_as_kt(_to_f16(k8, SUB, D), SUB, D), b_op, assert_trivial=True)
    s = mma_v2(q_a, kt, gl.zeros([_ROWS, SUB], gl.float32, layout=mma))
    pos = start + gl.arange(0, SUB, layout=gl.SliceLayout(0, mma))
    s = gl.where((pos < hi)[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    p_a = gl.convert_layout(p.to(gl.float16), a_op)
    v = gl.convert_layout(_as_v(_to_f16(v8, SUB, D), SUB, D), b_op)
    acc = mma_v2(p_a, v, acc * alpha[:, None])
    return m_new, l_i, acc


@gluon.jit(do_not_specialize=["seq_offset", "num_splits", "s_bt_s", "s_po_sp", "s_pl_sp"])
def _decode_fp8_kernel(
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
    BS: gl.constexpr,
    REP: gl.constexpr,
    D: gl.constexpr,
    SUB: gl.constexpr,
    MIN_SPLIT: gl.constexpr,
    KV_SCALED: gl.constexpr,
    PREFETCH: gl.constexpr,
    PDL: gl.constexpr,
):
    _pdl_enter(PDL)
    mma: gl.constexpr = _mma_layout()
    a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    s = gl.program_id(0).to(gl.int64)
    kvh = gl.program_id(1)
    sp = gl.program_id(2)
    seq = seq_offset + s
    L = gl.load(lens_ptr + seq).to(gl.int64)
    row = gl.load(cu_ptr + seq).to(gl.int64)
    # the Triton kernel's split rule: whole SUB pieces, none shorter than MIN_SPLIT
    per = gl.maximum(gl.cdiv(gl.cdiv(L, num_splits), SUB) * SUB, MIN_SPLIT)
    lo = sp.to(gl.int64) * per
    hi = gl.minimum(lo + per, L)

    # q in the permuted head-dim order of `_as_kt`: index d = 8 j + 2 c + e reads element (D/4) c + 2 j + e
    r_a = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, a_op))
    d_a = gl.arange(0, D, layout=gl.SliceLayout(0, a_op))
    m_a = (d_a % 2) + (D // 4) * ((d_a // 2) % 4) + 2 * (d_a // 8)
    heads_a = kvh * REP + r_a
    q = gl.load(
        q_ptr + row * s_q_t + heads_a[:, None] * s_q_h + m_a[None, :], mask=(r_a < REP)[:, None], other=0.0
    )
    q_a = gl.minimum(gl.maximum(q.to(gl.float32), -65504.0), 65504.0).to(gl.float16)
    if KV_SCALED:
        qk_scale = qk_scale * gl.load(ks_ptr).to(gl.float32)

    m_i = gl.full([_ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, mma))
    l_i = gl.zeros([_ROWS], gl.float32, layout=gl.SliceLayout(1, mma))
    acc = gl.zeros([_ROWS, D], gl.float32, layout=mma)
    bt_row = bt_ptr + seq * s_bt_s
    if PREFETCH:
        k8, v8 = _load_tiles(
            kc_ptr, vc_ptr, bt_row, lo, hi, kvh, s_kc_b, s_kc_r, s_kc_h, s_vc_b, s_vc_r, s_vc_h, BS, SUB, D
        )
        for start in range(lo, hi, SUB):
            k8n, v8n = _load_tiles(
                kc_ptr,
                vc_ptr,
                bt_row,
                start + SUB,
                hi,
                kvh,
                s_kc_b,
                s_kc_r,
                s_kc_h,
                s_vc_b,
                s_vc_r,
                s_vc_h,
                BS,
                SUB,
                D,
            )
            m_i, l_i, acc = _step(q_a, k8, v8, start, hi, m_i, l_i, acc, qk_scale, SUB, D)
            k8 = k8n
            v8 = v8n
    else:
        for start in range(lo, hi, SUB):
            k8, v8 = _load_tiles(
                kc_ptr,
                vc_ptr,
                bt_row,
                start,
                hi,
                kvh,
                s_kc_b,
                s_kc_r,
                s_kc_h,
                s_vc_b,
                s_vc_r,
                s_vc_h,
                BS,
                SUB,
                D,
            )
            m_i, l_i, acc = _step(q_a, k8, v8, start, hi, m_i, l_i, acc, qk_scale, SUB, D)

    has = l_i > 0.0  # an empty split (lo >= L) contributes weight 0
    out = acc / gl.where(has, l_i, 1.0)[:, None]
    if KV_SCALED:
        out = out * gl.load(vs_ptr).to(gl.float32)  # the combine is linear in the partial outputs
    lse = gl.where(has, m_i + gl.log2(gl.where(has, l_i, 1.0)), float("-inf"))
    # output column n = 8 t + r is head-dim element (D/8) r + t (`_as_v`)
    r_o = gl.arange(0, _ROWS, layout=gl.SliceLayout(1, mma))
    n_o = gl.arange(0, D, layout=gl.SliceLayout(0, mma))
    m_o = (D // 8) * (n_o % 8) + n_o // 8
    heads_o = kvh * REP + r_o
    gl.store(
        po_ptr + sp * s_po_sp + s * s_po_s + heads_o[:, None] * s_po_h + m_o[None, :],
        out,
        mask=(r_o < REP)[:, None],
    )
    gl.store(plse_ptr + sp * s_pl_sp + s * s_pl_s + heads_o, lse, mask=r_o < REP)


def decode_fp8_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether this kernel takes a decode step: an e4m3 cache read by 16-bit queries (`decode_fp8_shape_fits`)
    on a GPU of compute capability 8.9+ (the e4m3 converts)."""
    return (
        decode_fp8_shape_fits(q, k_cache, v_cache)
        and q.is_cuda
        and torch.cuda.get_device_capability(q.device) >= (8, 9)
    )


def decode_fp8_shape_fits(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The device-independent half of `decode_fp8_fits`: e4m3 K and V, float16 or bf16 queries, head dim 32,
    64 or 128 (at 256 the [16, 256] float32 accumulator and the tiles in flight spill: 1 KB a thread under
    ptxas), at most 16 q heads per kv head, and K / V rows that start on 4-byte words (the tiles load as
    32-bit words)."""
    D = q.shape[-1]
    rep = q.shape[1] // k_cache.shape[2]
    words = all(
        c.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in c.stride()[:3]) for c in (k_cache, v_cache)
    )
    return (
        k_cache.dtype in _GL_FP8
        and v_cache.dtype == k_cache.dtype
        and q.dtype in _Q_DTYPES
        and D in (32, 64, 128)
        and rep <= _ROWS
        and words
    )


def decode_splits(num_seqs: int, kv_heads: int, max_len: int | None = None) -> int:
    """Splits per sequence for this kernel's one-warp programs (`launch_util.split_kv_count` at this kernel's
    program target)."""
    return split_kv_count(
        num_seqs,
        kv_heads,
        max_len,
        target_programs=_TARGET_PROGRAMS,
        max_splits=_MAX_SPLITS,
        min_split_tokens=_MIN_SPLIT_TOKENS,
    )


def decode_fp8(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens_t: torch.Tensor,
    cu_t: torch.Tensor,
    nd: int,
    max_len: int | None,
    qk_scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The partial outputs [splits, nd, Hq, D] and log-sum-exps [splits, nd, Hq] (float32) of the decode
    sequences [0, nd) of a step, for `_combine_kernel`; None, with nothing launched, when this kernel does
    not take the step (`decode_fp8_fits`). qk_scale: softmax scale x log2(e); max_len: the longest context
    when known (eager steps), None in a captured step. Launch settings: `_DECODE_FP8`."""
    if not decode_fp8_fits(q, k_cache, v_cache):
        return None
    _, Hq, D = q.shape
    _, BS, Hkv, _ = k_cache.shape
    splits = decode_splits(nd, Hkv, max_len)
    po = torch.empty(splits, nd, Hq, D, dtype=torch.float32, device=q.device)
    plse = torch.empty(splits, nd, Hq, dtype=torch.float32, device=q.device)
    scaled = k_scale is not None
    assert (v_scale is not None) == scaled
    cfg = dict(_DECODE_FP8)
    SUB = cfg.pop("SUB")
    ks, vs = (k_scale, v_scale) if k_scale is not None and v_scale is not None else (q, q)  # unread unscaled
    _decode_fp8_kernel[(nd, Hkv, splits)](
        *split_kv_args(q, k_cache, v_cache, block_tables, lens_t, cu_t, po, plse, ks, vs, splits, qk_scale),
        BS=BS,
        REP=Hq // Hkv,
        D=D,
        SUB=SUB,
        MIN_SPLIT=triton.cdiv(_MIN_SPLIT_TOKENS, SUB) * SUB,
        KV_SCALED=scaled,
        num_warps=1,
        **cfg,
        **pdl(q),
    )
    return po, plse


__all__ = ["decode_fp8", "decode_fp8_fits", "decode_fp8_shape_fits", "decode_splits"]
