"""Mamba2 SSD chunked scan over packed variable-length sequences as Triton kernels.

The CUDA path of `ssd.ssd_chunked_ref` (same contract: chunks never straddle two sequences, each sequence
starts from its own initial state, and the state after every chunk comes back, so prefix-cache snapshots
cost no extra pass). Three launches driven by one host-built chunk table, so token, chunk and sequence
counts are runtime values and never cause a recompile mid-serving.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.kernels.host_index import cached_on_device, host_list
from hyserve.kernels.launch_util import device_index
from hyserve.kernels.ssd import SSDOutput, chunk_offsets_for
from hyserve.kernels.triton_common import dot, softplus

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _chunk_of(meta_ptr, c, num_seqs, L: tl.constexpr):
    """Sequence s of chunk c, its first token t0, its token count and the sequence's first chunk."""
    s = tl.load(meta_ptr + 2 * (num_seqs + 1) + c)
    c_first = tl.load(meta_ptr + num_seqs + 1 + s)
    t0 = tl.load(meta_ptr + s) + (c - c_first) * L
    n_valid = tl.minimum(tl.load(meta_ptr + s + 1) - t0, L)
    return s, t0, n_valid, c_first


# --------------------------------------------------------------------------- 1. dt, cumsum, C B^T
#
# grid (num_chunks * G). Per (chunk, group): dt -> softplus(dt + bias) clamped for the H/G heads of the
# group and its running sum cs = cumsum(dt * A) along the chunk (-> dtc, cs [chunks, H, LP]); CB = C @ B^T of
# the group's tokens, shared by its heads (-> cb [chunks, G, LP, LP]). LP = chunk_size padded to a power of
# 2 >= 16; positions past a chunk's tokens get dt = 0, so cs stays flat and cs[LP-1] is the chunk's total
# decay exponent.


@triton.jit(
    do_not_specialize=["num_seqs"],
    do_not_specialize_on_alignment=["dt_ptr", "A_ptr", "dt_bias_ptr", "meta_ptr"],
)
def _ssd_prep_kernel(
    dt_ptr,
    A_ptr,
    dt_bias_ptr,
    B_ptr,
    C_ptr,
    meta_ptr,
    dtc_ptr,
    cs_ptr,
    cb_ptr,
    num_seqs,
    dt_lo,
    dt_hi,
    s_dt_t,
    s_dt_h,
    s_B_t,
    s_B_g,
    s_C_t,
    s_C_g,  # B/C stride along N is 1
    s_w_c,
    s_w_h,  # dtc and cs: [chunks, H, LP], last stride 1
    s_cb_c,
    s_cb_g,
    s_cb_m,  # cb: [chunks, G, LP, LP], last stride 1
    G: tl.constexpr,
    REP: tl.constexpr,
    REP_PAD: tl.constexpr,
    L: tl.constexpr,
    LP: tl.constexpr,
    N: tl.constexpr,
    BLOCK_CB: tl.constexpr,
    BLOCK_KN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTPLUS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    g = pid % G
    c = pid // G
    s, t0, n_valid, c_first = _chunk_of(meta_ptr, c, num_seqs, L)
    t0 = t0.to(tl.int64)
    c64 = c.to(tl.int64)

    # dt of the group's heads over the chunk: [REP_PAD, LP]
    offs_r = tl.arange(0, REP_PAD)
    offs_l = tl.arange(0, LP)
    heads = g * REP + offs_r
    mr = offs_r < REP
    m2 = mr[:, None] & (offs_l < n_valid)[None, :]
    d = tl.load(dt_ptr + (t0 + offs_l)[None, :] * s_dt_t + heads[:, None] * s_dt_h, mask=m2, other=0.0)
    d = d.to(tl.float32)
    if HAS_BIAS:
        d += tl.load(dt_bias_ptr + heads, mask=mr, other=0.0).to(tl.float32)[:, None]
    if SOFTPLUS:
        d = softplus(d)
    if HAS_LIMIT:
        d = tl.minimum(tl.maximum(d, dt_lo), dt_hi)
    d = tl.where(m2, d, 0.0)  # padded positions: no decay, no input
    a = tl.load(A_ptr + heads, mask=mr, other=0.0).to(tl.float32)
    cs = tl.cumsum(d * a[:, None], axis=1)
    w_offs = c64 * s_w_c + heads[:, None] * s_w_h + offs_l[None, :]
    tl.store(dtc_ptr + w_offs, d, mask=mr[:, None])
    tl.store(cs_ptr + w_offs, cs, mask=mr[:, None])

    # CB[i, j] = C[i] . B[j] over the chunk's tokens (zero rows/columns past n_valid)
    offs_j = tl.arange(0, LP)
    mj = offs_j < n_valid
    cb_base = cb_ptr + c64 * s_cb_c + g * s_cb_g
    for mb in tl.static_range(LP // BLOCK_CB):
        offs_i = mb * BLOCK_CB + tl.arange(0, BLOCK_CB)
        mi = offs_i < n_valid
        acc = tl.zeros((BLOCK_CB, LP), dtype=tl.float32)
        for k in tl.static_range(0, N, BLOCK_KN):
            offs_k = k + tl.arange(0, BLOCK_KN)
            mk = offs_k < N
            ct = tl.load(
                C_ptr + (t0 + offs_i)[:, None] * s_C_t + g * s_C_g + offs_k[None, :],
                mask=mi[:, None] & mk[None, :],
                other=0.0,
            )
            bt = tl.load(
                B_ptr + (t0 + offs_j)[:, None] * s_B_t + g * s_B_g + offs_k[None, :],
                mask=mj[:, None] & mk[None, :],
                other=0.0,
            )
            acc += dot(ct, tl.trans(bt), IEEE)
        tl.store(cb_base + offs_i[:, None] * s_cb_m + offs_j[None, :], acc)


# --------------------------------------------------------------------------- 2. states across chunks
#
# grid (P-blocks * N-blocks, H, S). Per (sequence, head, state tile): walk the sequence's chunks in order
# from its initial state,  h <- exp(cs[LP-1]) * h + x^T (B * dt * exp(cs[LP-1] - cs))  ([P, LP] @ [LP, N]),
# and store h after every chunk (`chunk_states`; the last one also in `final_states`).


@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["meta_ptr"])
def _ssd_state_kernel(
    x_ptr,
    B_ptr,
    dtc_ptr,
    cs_ptr,
    init_ptr,
    meta_ptr,
    st_ptr,
    fin_ptr,
    num_seqs,
    s_x_t,
    s_x_h,  # x stride along P is 1
    s_B_t,
    s_B_g,
    s_w_c,
    s_w_h,
    s_init_s,
    s_init_h,
    s_init_p,  # initial_states stride along N is 1
    s_st_c,
    s_st_h,
    s_st_p,  # chunk states [chunks, H, P, N], last stride 1
    s_fin_s,
    s_fin_h,
    s_fin_p,
    REP: tl.constexpr,
    L: tl.constexpr,
    LP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_NB: tl.constexpr,
    HAS_INIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid0 = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    pb = pid0 // NUM_NB
    nb = pid0 % NUM_NB
    g = h // REP
    t_begin = tl.load(meta_ptr + s)
    t_end = tl.load(meta_ptr + s + 1)
    c_begin = tl.load(meta_ptr + num_seqs + 1 + s)
    c_end = tl.load(meta_ptr + num_seqs + 2 + s)

    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, LP)
    mp = offs_p < P
    mn = offs_n < N
    m_pn = mp[:, None] & mn[None, :]
    tile = offs_p[:, None] * s_st_p + offs_n[None, :]

    if HAS_INIT:
        hs = tl.load(
            init_ptr
            + s.to(tl.int64) * s_init_s
            + h * s_init_h
            + offs_p[:, None] * s_init_p
            + offs_n[None, :],
            mask=m_pn,
            other=0.0,
        ).to(tl.float32)
    else:
        hs = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)

    x_base = x_ptr + h * s_x_h + offs_p[None, :]
    b_base = B_ptr + g * s_B_g + offs_n[None, :]
    c_begin64 = c_begin.to(tl.int64)
    for c in tl.range(c_begin, c_end):
        c64 = c_begin64 + (c - c_begin)  # (the interpreter's loop index is a Python int)
        t0 = t_begin + (c64 - c_begin64) * L
        ml = offs_l < tl.minimum(t_end - t0, L)
        w_row = c64 * s_w_c + h * s_w_h
        d = tl.load(dtc_ptr + w_row + offs_l)
        cs = tl.load(cs_ptr + w_row + offs_l)
        cs_last = tl.load(cs_ptr + w_row + (LP - 1))  # padded positions keep cs flat
        wgt = d * tl.exp(cs_last - cs)  # [LP]: dt times the decay from token l to the chunk's end
        xt = tl.load(x_base + (t0 + offs_l)[:, None] * s_x_t, mask=ml[:, None] & mp[None, :], other=0.0)
        bt = tl.load(b_base + (t0 + offs_l)[:, None] * s_B_t, mask=ml[:, None] & mn[None, :], other=0.0)
        bs = (bt.to(tl.float32) * wgt[:, None]).to(bt.dtype)
        hs = hs * tl.exp(cs_last) + dot(tl.trans(xt), bs, IEEE)  # [BLOCK_P, BLOCK_N]
        tl.store(st_ptr + c64 * s_st_c + h * s_st_h + tile, hs, mask=m_pn)

    tl.store(
        fin_ptr + s.to(tl.int64) * s_fin_s + h * s_fin_h + offs_p[:, None] * s_fin_p + offs_n[None, :],
        hs,
        mask=m_pn,
    )


# --------------------------------------------------------------------------- 3. output
#
# grid (num_chunks * H * M-blocks * P-blocks). Per (chunk, head, rows): the carried-in state (the initial
# state for a sequence's first chunk, else chunk_states[c - 1]) plus the causal within-chunk part,
#     y[l] = exp(cs[l]) C[l] . h_in  +  sum_{m<=l} CB[l, m] exp(cs[l] - cs[m]) dt[m] x[m]  +  D x[l]
# skipping the key blocks above the diagonal.


@triton.jit
def _add_carried_state(
    acc, c_rows, mm, src, s_src_p, offs_p, mp, N: tl.constexpr, BLOCK_KN: tl.constexpr, IEEE: tl.constexpr
):
    """acc [BLOCK_M, BLOCK_P] += C[rows] @ h_in^T, h_in: [P, N] fp32 at src (stride along N is 1)."""
    for k in tl.static_range(0, N, BLOCK_KN):
        offs_k = k + tl.arange(0, BLOCK_KN)
        mk = offs_k < N
        ct = tl.load(
            c_rows + offs_k[None, :], mask=mm[:, None] & mk[None, :], other=0.0
        )  # [BLOCK_M, BLOCK_KN]
        hs = tl.load(
            src + offs_p[None, :] * s_src_p + offs_k[:, None], mask=mk[:, None] & mp[None, :], other=0.0
        )  # [BLOCK_KN, BLOCK_P]
        acc += dot(ct, hs.to(ct.dtype), IEEE)
    return acc


@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["D_ptr", "meta_ptr"])
def _ssd_out_kernel(
    x_ptr,
    C_ptr,
    D_ptr,
    dtc_ptr,
    cs_ptr,
    cb_ptr,
    init_ptr,
    st_ptr,
    meta_ptr,
    y_ptr,
    num_seqs,
    s_x_t,
    s_x_h,
    s_C_t,
    s_C_g,
    s_w_c,
    s_w_h,
    s_cb_c,
    s_cb_g,
    s_cb_m,
    s_init_s,
    s_init_h,
    s_init_p,
    s_st_c,
    s_st_h,
    s_st_p,
    s_y_t,
    s_y_h,  # y stride along P is 1
    H: tl.constexpr,
    REP: tl.constexpr,
    L: tl.constexpr,
    LP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_KN: tl.constexpr,
    NUM_MB: tl.constexpr,
    NUM_PB: tl.constexpr,
    HAS_INIT: tl.constexpr,
    HAS_D: tl.constexpr,
    IEEE: tl.constexpr,
):
    # row block fastest, then P block, head, chunk: the programs of one chunk run together and share
    # its CB, C and dt/cs from L2
    pid = tl.program_id(0)
    mb = pid % NUM_MB
    rest = pid // NUM_MB
    pb = rest % NUM_PB
    rest = rest // NUM_PB
    h = rest % H
    c = rest // H
    g = h // REP
    s, t0, n_valid, c_first = _chunk_of(meta_ptr, c, num_seqs, L)
    if mb * BLOCK_M >= n_valid:
        return  # rows past the end of a partial chunk
    t0 = t0.to(tl.int64)
    c64 = c.to(tl.int64)

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < n_valid
    offs_p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    mp = offs_p < P
    w_row = c64 * s_w_c + h * s_w_h
    cs_m = tl.load(cs_ptr + w_row + offs_m)

    # carried-in state: the sequence's initial state for its first chunk, else the previous chunk's
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    c_rows = C_ptr + (t0 + offs_m)[:, None] * s_C_t + g * s_C_g
    if c == c_first:
        if HAS_INIT:
            acc = _add_carried_state(
                acc,
                c_rows,
                mm,
                init_ptr + s.to(tl.int64) * s_init_s + h * s_init_h,
                s_init_p,
                offs_p,
                mp,
                N,
                BLOCK_KN,
                IEEE,
            )
    else:
        acc = _add_carried_state(
            acc, c_rows, mm, st_ptr + (c64 - 1) * s_st_c + h * s_st_h, s_st_p, offs_p, mp, N, BLOCK_KN, IEEE
        )
    acc = acc * tl.exp(cs_m)[:, None]

    # within the chunk, causal: key blocks up to this row block's diagonal
    cb_rows = cb_ptr + c64 * s_cb_c + g * s_cb_g + offs_m[:, None] * s_cb_m
    x_head = x_ptr + h * s_x_h + offs_p[None, :]
    k_hi = tl.minimum((mb + 1) * BLOCK_M, n_valid)
    for k0 in tl.range(0, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mk = offs_k < n_valid
        cb = tl.load(cb_rows + offs_k[None, :])
        cs_k = tl.load(cs_ptr + w_row + offs_k)
        d_k = tl.load(dtc_ptr + w_row + offs_k)
        causal = (offs_k[None, :] <= offs_m[:, None]) & mk[None, :]
        # exp of -inf above the diagonal: no overflow from exp(cs_m - cs_k) with k > m
        decay = tl.exp(tl.where(causal, cs_m[:, None] - cs_k[None, :], float("-inf")))
        wgt = cb * decay * d_k[None, :]
        xk = tl.load(x_head + (t0 + offs_k)[:, None] * s_x_t, mask=mk[:, None] & mp[None, :], other=0.0)
        acc += dot(wgt.to(xk.dtype), xk, IEEE)

    m_out = mm[:, None] & mp[None, :]
    if HAS_D:
        xm = tl.load(x_head + (t0 + offs_m)[:, None] * s_x_t, mask=m_out, other=0.0).to(tl.float32)
        acc += tl.load(D_ptr + h).to(tl.float32) * xm
    tl.store(
        y_ptr + (t0 + offs_m)[:, None] * s_y_t + h * s_y_h + offs_p[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=m_out,
    )


# --------------------------------------------------------------------------- launcher


def _pad(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _gpu_config(LP: int, P: int, N: int) -> dict[str, dict[str, int]]:
    """Fixed block sizes and launch settings on a GPU, from the model shape only (LP: the chunk's tile
    length, chunk_size padded to a power of 2 >= 16)."""
    return dict(
        prep=dict(
            BLOCK_CB=min(LP, 64), BLOCK_KN=min(_pad(N), 64), num_warps=4 if LP <= 128 else 8, num_stages=2
        ),
        # a whole (padded) head dim per program: B is re-read once per P block, x once per N block; a
        # 3-stage pipeline over the chunk walk hides the sequential chain's load latency, and 32-wide key
        # steps with 64-wide state steps in 3 stages speed the output kernel (`--only ssd_sweep`,
        # benchmarks/README.md)
        state=dict(BLOCK_P=min(_pad(P), 128), BLOCK_N=min(_pad(N), 64), num_warps=8, num_stages=3),
        out=dict(
            BLOCK_M=min(LP, 64),
            BLOCK_K=min(LP, 32),
            BLOCK_P=min(_pad(P), 128),
            BLOCK_KN=min(_pad(N), 64),
            num_warps=4,
            num_stages=3,
        ),
    )


def _cpu_config(LP: int, P: int, N: int) -> dict[str, dict[str, int]]:
    """Interpreter: small tiles so the tests cover several row/key/state blocks per chunk."""
    return dict(
        prep=dict(BLOCK_CB=16, BLOCK_KN=16, num_warps=4, num_stages=1),
        state=dict(BLOCK_P=min(_pad(P), 16), BLOCK_N=16, num_warps=4, num_stages=1),
        out=dict(BLOCK_M=16, BLOCK_K=16, BLOCK_P=min(_pad(P), 32), BLOCK_KN=16, num_warps=4, num_stages=1),
    )


def _chunk_table(cu: list[int], offsets: list[int], device: torch.device) -> torch.Tensor:
    """[cu (S+1) | chunk offsets (S+1) | chunk -> sequence] as int32 on `device`, built on the host
    from Python lists: no device sync. Chunk c of sequence s starts at token cu[s] + (c - offsets[s]) * L
    and holds min(L, cu[s+1] - start) tokens (a sequence's last chunk may be partial)."""
    owner: list[int] = []
    for s in range(len(cu) - 1):
        owner.extend([s] * (offsets[s + 1] - offsets[s]))
    return device_index(cu + offsets + owner, device)


def ssd_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    cu_seqlens: torch.Tensor | list[int],
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    initial_states: torch.Tensor | None = None,
    return_chunk_states: bool = True,
) -> SSDOutput:
    """Chunked SSD over packed sequences; arguments and outputs as `ssd.ssd_chunked_ref`.

    x: [T, H, P]; dt: [T, H] (raw); A: [H]; B, C: [T, G, N] (x, B, C one dtype, last stride 1);
    D, dt_bias: [H]; initial_states: [S, H, P, N] or None (zeros); cu_seqlens: a host list (a tensor
    is read to the host). Returns y [T, H, P] in x.dtype, float32 final states [S, H, P, N] and, when
    asked, float32 chunk states [num_chunks, H, P, N].

    Numerics: states, cumsums and accumulators are float32; as in mamba_ssm the matmul operands are in the
    input dtype (on bf16 inputs the carried-in state, the decay-weighted scores and B * dt * decay round to
    bf16 before their dots); float32 inputs use IEEE float32 dots.
    Variants: counts are never specialised, so one model shape and dtype compiles per kernel once per flag
    set (prep: HAS_BIAS, SOFTPLUS, HAS_LIMIT; state: HAS_INIT; out: HAS_INIT, HAS_D; all: IEEE) and layout
    (x/B/C/dt strides and 16-byte alignment, fixed by the model's in_proj/conv layout). The model's prefill
    always passes D, dt_bias, softplus, its dt_limit and initial states, so it reaches 3 variants, all
    compiled by one warm-up prefill.
    """
    assert x.dim() == 3 and dt.dim() == 2 and A.dim() == 1 and B.dim() == 3 and C.dim() == 3
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    L = int(chunk_size)
    cu = host_list(cu_seqlens)
    S = len(cu) - 1
    assert S >= 0 and cu[0] == 0 and cu[-1] == T, f"cu_seqlens {cu} vs {T} tokens"
    assert all(cu[s] <= cu[s + 1] for s in range(S)), f"cu_seqlens {cu} must not decrease"
    assert H % G == 0, f"{H} heads not divisible into {G} groups"
    assert dt.shape == (T, H) and A.shape == (H,), (
        f"dt {tuple(dt.shape)}, A {tuple(A.shape)} vs x {tuple(x.shape)}"
    )
    assert B.shape == (T, G, N) and C.shape == (T, G, N), f"B {tuple(B.shape)}, C {tuple(C.shape)}"
    assert L >= 1, f"chunk_size {L}"
    assert x.dtype in _FLOATS and B.dtype == x.dtype and C.dtype == x.dtype, (
        "float64 runs on the reference path"
    )
    assert dt.dtype in _FLOATS and A.dtype in _FLOATS
    assert x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1
    for t in (D, dt_bias):
        assert t is None or (t.shape == (H,) and t.dtype in _FLOATS and t.stride(0) == 1)
    assert A.stride(0) == 1
    dev = x.device
    assert all(t.device == dev for t in (dt, A, B, C))
    if initial_states is not None:
        assert initial_states.shape == (S, H, P, N), f"initial_states {tuple(initial_states.shape)}"
        assert initial_states.device == dev
        if initial_states.dtype != torch.float32 or initial_states.stride(3) != 1:
            initial_states = initial_states.to(torch.float32).contiguous()

    offsets = chunk_offsets_for(cu, L)
    num_chunks = offsets[-1]
    f32 = torch.float32
    y = torch.empty(T, H, P, dtype=x.dtype, device=dev)
    final = torch.empty(S, H, P, N, dtype=f32, device=dev)
    states = torch.empty(num_chunks, H, P, N, dtype=f32, device=dev)
    if num_chunks == 0:  # no tokens at all: every state passes through
        if initial_states is None:
            final.zero_()
        else:
            final.copy_(initial_states)
        return SSDOutput(
            y=y,
            final_states=final,
            chunk_states=states if return_chunk_states else None,
            chunk_offsets=offsets,
        )

    rep = H // G
    ieee = x.dtype == torch.float32
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    has_limit = lo > 0.0 or hi != float("inf")
    LP = _pad(L)  # positions in a chunk's tiles; those past chunk_size are masked
    cfg = _gpu_config(LP, P, N) if x.is_cuda else _cpu_config(LP, P, N)
    meta = cached_on_device(cu, ("ssd chunks", L), dev, lambda: _chunk_table(cu, offsets, dev))
    dtc = torch.empty(num_chunks, H, LP, dtype=f32, device=dev)
    cs = torch.empty(num_chunks, H, LP, dtype=f32, device=dev)
    cb = torch.empty(num_chunks, G, LP, LP, dtype=f32, device=dev)

    _ssd_prep_kernel[(num_chunks * G,)](
        dt,
        A,
        dt_bias if dt_bias is not None else A,
        B,
        C,
        meta,
        dtc,
        cs,
        cb,
        S,
        lo,
        hi if hi != float("inf") else 3.0e38,
        dt.stride(0),
        dt.stride(1),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        dtc.stride(0),
        dtc.stride(1),
        cb.stride(0),
        cb.stride(1),
        cb.stride(2),
        G=G,
        REP=rep,
        REP_PAD=max(2, triton.next_power_of_2(rep)),
        L=L,
        LP=LP,
        N=N,
        HAS_BIAS=dt_bias is not None,
        SOFTPLUS=bool(dt_softplus),
        HAS_LIMIT=has_limit,
        IEEE=ieee,
        **cfg["prep"],
    )

    init = initial_states if initial_states is not None else final  # dummy pointer when absent
    st = cfg["state"]
    num_pb, num_nb = triton.cdiv(P, st["BLOCK_P"]), triton.cdiv(N, st["BLOCK_N"])
    _ssd_state_kernel[(num_pb * num_nb, H, S)](
        x,
        B,
        dtc,
        cs,
        init,
        meta,
        states,
        final,
        S,
        x.stride(0),
        x.stride(1),
        B.stride(0),
        B.stride(1),
        dtc.stride(0),
        dtc.stride(1),
        init.stride(0),
        init.stride(1),
        init.stride(2),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        final.stride(0),
        final.stride(1),
        final.stride(2),
        REP=rep,
        L=L,
        LP=LP,
        P=P,
        N=N,
        NUM_NB=num_nb,
        HAS_INIT=initial_states is not None,
        IEEE=ieee,
        **st,
    )

    oc = cfg["out"]
    assert LP % oc["BLOCK_M"] == 0 and oc["BLOCK_M"] % oc["BLOCK_K"] == 0
    num_mb, num_pb = LP // oc["BLOCK_M"], triton.cdiv(P, oc["BLOCK_P"])
    _ssd_out_kernel[(num_chunks * H * num_mb * num_pb,)](
        x,
        C,
        D if D is not None else A,
        dtc,
        cs,
        cb,
        init,
        states,
        meta,
        y,
        S,
        x.stride(0),
        x.stride(1),
        C.stride(0),
        C.stride(1),
        dtc.stride(0),
        dtc.stride(1),
        cb.stride(0),
        cb.stride(1),
        cb.stride(2),
        init.stride(0),
        init.stride(1),
        init.stride(2),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        y.stride(0),
        y.stride(1),
        H=H,
        REP=rep,
        L=L,
        LP=LP,
        P=P,
        N=N,
        NUM_MB=num_mb,
        NUM_PB=num_pb,
        HAS_INIT=initial_states is not None,
        HAS_D=D is not None,
        IEEE=ieee,
        **oc,
    )
    return SSDOutput(
        y=y, final_states=final, chunk_states=states if return_chunk_states else None, chunk_offsets=offsets
    )


__all__ = ["ssd_triton"]
