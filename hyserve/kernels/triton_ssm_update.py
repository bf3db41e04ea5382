"""Decode-time SSM state update (one token per sequence) as a Triton kernel.

Same contract as `ssm_update.selective_state_update_ref`: read the state of batch row b from
`ssm_pool[src_slots[b]]`, advance it by one token in float32, store it in the pool's dtype at
`ssm_pool[dst_slots[b]]`, and return y in x.dtype. With `rounding` the new state goes into a float16 pool
by stochastic rounding at `positions[b]` (`triton_stochastic_rounding.stochastic_round_tile`, bit for bit
the reference's); that branch is a constexpr, so the round-to-nearest variants are unchanged. The
position is read from device memory, so a captured CUDA graph replays with each step's positions.

One program owns a [BLOCK_P, N] tile of one (row, head) state: the kernel is bound by reading and
writing the state (fp32 state: 2 x 4 B per element), so every element is touched exactly once and the
tile is wide along N (the contiguous dimension) for coalesced 16-byte accesses.

    grid = (cdiv(P, BLOCK_P), H, batch)        # batch last: it is the dimension that varies per step

Rows may share a source slot (copy-on-write from a snapshot) and pad rows may all write the same pad
slot; a row's destination must not be another row's source (the scheduler never does that), because
rows run concurrently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.kernels.launch_util import pdl
from hyserve.kernels.stochastic_rounding import StochasticRounding
from hyserve.kernels.triton_common import pdl_enter, softplus
from hyserve.kernels.triton_stochastic_rounding import sr_block_sizes, stochastic_round_tile


@triton.jit(do_not_specialize=["batch", "sr_seed", "sr_layer"], do_not_specialize_on_alignment=["pos_ptr"])
def _ssm_update_kernel(
    pool_ptr,
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    dt_bias_ptr,
    src_ptr,
    dst_ptr,
    y_ptr,
    pos_ptr,
    batch,
    dt_lo,
    dt_hi,
    sr_seed,
    sr_layer,
    s_pool_slot,
    s_pool_h,
    s_pool_p,  # pool stride along N is 1
    s_x_b,
    s_x_h,  # x stride along P is 1
    s_dt_b,
    s_dt_h,
    s_B_b,
    s_B_g,  # B/C stride along N is 1
    s_C_b,
    s_C_g,
    s_y_b,
    s_y_h,
    P: tl.constexpr,
    N: tl.constexpr,
    HEADS_PER_GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    DT_SOFTPLUS: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    STOCHASTIC_ROUNDING: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    PDL: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    g = h // HEADS_PER_GROUP

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    mask = mask_p[:, None] & mask_n[None, :]

    # Before the PDL wait: what no kernel of this step writes before this one (the slot indices, the
    # per-head weights, and the state tile: only this kernel writes the SSM pool in a decode step, and the
    # previous step has finished), so the state's DRAM round trip overlaps the kernel before (the conv).
    src = tl.load(src_ptr + b).to(tl.int64)
    dst = tl.load(dst_ptr + b).to(tl.int64)
    tile = offs_p[:, None] * s_pool_p + offs_n[None, :]
    state = tl.load(pool_ptr + src * s_pool_slot + h * s_pool_h + tile, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + h).to(tl.float32)
    if HAS_DT_BIAS:
        d_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    if HAS_D:
        d_skip = tl.load(D_ptr + h).to(tl.float32)
    pdl_enter(PDL)

    d = tl.load(dt_ptr + b * s_dt_b + h * s_dt_h).to(tl.float32)
    if HAS_DT_BIAS:
        d += d_bias
    if DT_SOFTPLUS:
        d = softplus(d)
    if HAS_LIMIT:
        d = tl.minimum(tl.maximum(d, dt_lo), dt_hi)
    decay = tl.exp(d * a)

    x = tl.load(x_ptr + b * s_x_b + h * s_x_h + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    Bv = tl.load(B_ptr + b * s_B_b + g * s_B_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    Cv = tl.load(C_ptr + b * s_C_b + g * s_C_g + offs_n, mask=mask_n, other=0.0).to(tl.float32)

    state = state * decay + (d * x)[:, None] * Bv[None, :]
    if STOCHASTIC_ROUNDING:
        pos = tl.load(pos_ptr + b)
        new = stochastic_round_tile(state, h * P + offs_p, pos, sr_layer, sr_seed, N, BLOCK_N, PHILOX_ROUNDS)
    else:
        new = state.to(pool_ptr.dtype.element_ty)
    tl.store(pool_ptr + dst * s_pool_slot + h * s_pool_h + tile, new, mask=mask)
    y = tl.sum(state * Cv[None, :], axis=1)
    if HAS_D:
        y += d_skip * x
    tl.store(y_ptr + b * s_y_b + h * s_y_h + offs_p, y.to(y_ptr.dtype.element_ty), mask=mask_p)


_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def selective_state_update_triton(
    ssm_pool: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    rounding: StochasticRounding | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """ssm_pool: [num_slots, H, P, N]; x: [Bt, H, P]; dt: [Bt, H]; A, D, dt_bias: [H]; B, C: [Bt, G, N];
    positions: [Bt] integer (with `rounding` only).
    Returns y [Bt, H, P] in x.dtype; writes the new states into ssm_pool[dst_slots]."""
    assert ssm_pool.dim() == 4 and x.dim() == 3 and dt.dim() == 2 and B.dim() == 3 and C.dim() == 3
    _, H, P, N = ssm_pool.shape
    Bt = x.shape[0]
    G = B.shape[1]
    assert x.shape == (Bt, H, P), f"x {tuple(x.shape)} vs pool {tuple(ssm_pool.shape)}"
    assert dt.shape == (Bt, H) and B.shape == (Bt, G, N) and C.shape == (Bt, G, N)
    assert A.shape == (H,) and H % G == 0
    assert src_slots.shape == (Bt,) and dst_slots.shape == (Bt,)
    assert not src_slots.dtype.is_floating_point and not dst_slots.dtype.is_floating_point
    assert ssm_pool.dtype in _FLOATS and x.dtype in _FLOATS, "float64 runs on the reference path"
    assert ssm_pool.stride(3) == 1 and x.stride(2) == 1 and B.stride(2) == 1 and C.stride(2) == 1
    for t in (D, dt_bias):
        assert t is None or (t.shape == (H,) and t.is_contiguous())
    assert A.is_contiguous() and src_slots.is_contiguous() and dst_slots.is_contiguous()
    dev = x.device
    assert all(t.device == dev for t in (ssm_pool, dt, A, B, C, src_slots, dst_slots))
    sr = rounding is not None
    if sr:
        assert ssm_pool.dtype == torch.float16, (
            f"stochastic rounding needs a float16 pool, got {ssm_pool.dtype}"
        )
        assert positions is not None and positions.shape == (Bt,) and not positions.dtype.is_floating_point
        assert positions.is_contiguous() and positions.device == dev

    y = torch.empty(Bt, H, P, dtype=x.dtype, device=dev)
    if Bt == 0:
        return y
    lo, hi = float(dt_limit[0]), float(dt_limit[1])
    has_limit = lo > 0.0 or hi != float("inf")
    if sr:
        BLOCK_P, BLOCK_N = sr_block_sizes(P, N)
    else:
        BLOCK_N = triton.next_power_of_2(N)
        # ~2k elements per program: 8 KiB of fp32 state read and written, enough in flight per SM.
        BLOCK_P = max(1, min(triton.next_power_of_2(P), 2048 // BLOCK_N))
    grid = (triton.cdiv(P, BLOCK_P), H, Bt)
    _ssm_update_kernel[grid](
        ssm_pool,
        x,
        dt,
        A,
        B,
        C,
        D if D is not None else A,
        dt_bias if dt_bias is not None else A,
        src_slots,
        dst_slots,
        y,
        positions if sr else dst_slots,
        Bt,
        lo,
        hi if hi != float("inf") else 3.0e38,
        0 if rounding is None else rounding.key,
        0 if rounding is None else rounding.layer,
        ssm_pool.stride(0),
        ssm_pool.stride(1),
        ssm_pool.stride(2),
        x.stride(0),
        x.stride(1),
        dt.stride(0),
        dt.stride(1),
        B.stride(0),
        B.stride(1),
        C.stride(0),
        C.stride(1),
        y.stride(0),
        y.stride(1),
        P=P,
        N=N,
        HEADS_PER_GROUP=H // G,
        BLOCK_P=BLOCK_P,
        BLOCK_N=BLOCK_N,
        HAS_D=D is not None,
        HAS_DT_BIAS=dt_bias is not None,
        DT_SOFTPLUS=bool(dt_softplus),
        HAS_LIMIT=has_limit,
        STOCHASTIC_ROUNDING=sr,
        PHILOX_ROUNDS=0 if rounding is None else rounding.rounds,
        num_warps=4,
        **pdl(x),
    )
    return y
