"""Stochastic rounding of float32 SSM states into a float16 pool, in Triton: the tile helper the state
update kernel calls, and the `store_ssm_state` op for the prefill path's final states and snapshots.

Bit for bit the rule and random stream of `stochastic_rounding.py` (`stochastic_round_fp16`,
`StochasticRounding`): Philox-4x32 via
`tl.philox` with key = seed mod 2**64 and counter (element group, position, layer, 0); one Philox call
gives the draws of 4 consecutive elements along N, so a [BLOCK_R, BLOCK_N] tile runs Philox on
[BLOCK_R, BLOCK_N / 4] counters and interleaves the four output words back into columns:

    columns    0   1   2   3 | 4   5   6   7 | ...
    word       r0  r1  r2  r3| r0  r1  r2  r3| ...      group g = row * ceil(N / 4) + column // 4

The rounding itself is integer arithmetic on the fp32 bits (uint32), the same steps as the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.kernels.stochastic_rounding import StochasticRounding


@triton.jit
def _round_fp16_bits(x, r):
    """float32 tile x, uint32 draws r (same shape) -> float16 tile (see stochastic_round_fp16)."""
    bits = x.to(tl.uint32, bitcast=True)
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    e = mag >> 23
    # fp16-normal range: drop 13 mantissa bits; a carry moves into the exponent; clamp at 65504
    up_n = ((mag & 0x1FFF) << 19) > r
    h_norm = tl.minimum((mag >> 13) - (112 << 10) + up_n.to(tl.uint32), 0x7BFF)
    # fp16-subnormal range: units of 2**-24 (the other branch's values are computed but not selected)
    ec = tl.minimum(tl.maximum(e, 1), 112)
    m = (mag & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0).to(tl.uint32)
    s = 126 - ec
    sc = tl.minimum(s, 31)
    q = m >> sc
    rem = m - (q << sc)
    thr = tl.where(s <= 32, rem << (32 - tl.minimum(s, 32)), rem >> tl.minimum(tl.maximum(s, 32) - 32, 31))
    h_sub = q + (thr > r).to(tl.uint32)
    h = tl.where(e >= 113, h_norm, h_sub)
    special = tl.where(mag == 0x7F800000, 0x7C00, 0x7E00).to(tl.uint32)
    h = tl.where(mag >= 0x7F800000, special, h)
    return (h | sign).to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def stochastic_round_tile(
    x, rows, pos, layer, seed, N: tl.constexpr, BLOCK_N: tl.constexpr, ROUNDS: tl.constexpr
):
    """x: [BLOCK_R, BLOCK_N] float32 holding columns 0..BLOCK_N-1 of state rows `rows` ([BLOCK_R],
    row = h * P + p); pos, layer: integer scalars; seed: the 64-bit Philox key. -> float16 tile."""
    GROUPS: tl.constexpr = (N + 3) // 4
    g = tl.arange(0, BLOCK_N // 4).to(tl.uint32)
    c0 = rows.to(tl.uint32)[:, None] * GROUPS + g[None, :]
    zero = c0 * 0
    c1 = zero + pos.to(tl.uint32)
    c2 = zero + layer.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, zero, ROUNDS)
    r = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))
    return _round_fp16_bits(x, r)


@triton.jit(
    do_not_specialize=["seed", "layer"],
    do_not_specialize_on_alignment=["slots_ptr", "pos_ptr"],
)
def _store_sr_kernel(
    pool_ptr,
    states_ptr,
    slots_ptr,
    pos_ptr,
    seed,
    layer,
    s_pool_slot,
    s_pool_h,
    s_pool_p,  # pool stride along N is 1
    s_st_r,
    s_st_h,
    s_st_p,  # states stride along N is 1
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROUNDS: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.program_id(2).to(tl.int64)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask = (offs_p < P)[:, None] & (offs_n < N)[None, :]
    slot = tl.load(slots_ptr + r).to(tl.int64)
    pos = tl.load(pos_ptr + r)
    x = tl.load(
        states_ptr + r * s_st_r + h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :],
        mask=mask,
        other=0.0,
    ).to(tl.float32)
    out = stochastic_round_tile(x, h * P + offs_p, pos, layer, seed, N, BLOCK_N, ROUNDS)
    tl.store(
        pool_ptr + slot * s_pool_slot + h * s_pool_h + offs_p[:, None] * s_pool_p + offs_n[None, :],
        out,
        mask=mask,
    )


def sr_block_sizes(P: int, N: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of a state tile: whole rows (BLOCK_N >= 4 for the Philox groups), ~2k elements."""
    block_n = max(4, triton.next_power_of_2(N))
    return max(1, min(triton.next_power_of_2(P), 2048 // block_n)), block_n


def store_ssm_state_triton(
    ssm_pool: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    *,
    rounding: StochasticRounding | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """Same contract as `stochastic_rounding.store_ssm_state_ref`. Round-to-nearest stays the plain
    indexed copy (no kernel); stochastic rounding runs one program per [BLOCK_P, N] tile of a row's head."""
    assert states.dim() == 4 and states.shape[1:] == ssm_pool.shape[1:], (
        f"states {tuple(states.shape)} vs pool {tuple(ssm_pool.shape)}"
    )
    R = states.shape[0]
    assert slots.shape == (R,) and not slots.dtype.is_floating_point
    if rounding is None:
        ssm_pool[slots] = states.to(ssm_pool.dtype)
        return
    assert ssm_pool.dtype == torch.float16, f"stochastic rounding needs a float16 pool, got {ssm_pool.dtype}"
    assert positions is not None and positions.shape == (R,) and not positions.dtype.is_floating_point
    assert states.dtype == torch.float32, f"states must be float32, got {states.dtype}"
    assert states.stride(3) == 1 and ssm_pool.stride(3) == 1
    assert slots.is_contiguous() and positions.is_contiguous()
    assert all(t.device == ssm_pool.device for t in (states, slots, positions))
    if R == 0:
        return
    _, H, P, N = ssm_pool.shape
    block_p, block_n = sr_block_sizes(P, N)
    grid = (triton.cdiv(P, block_p), H, R)
    _store_sr_kernel[grid](
        ssm_pool,
        states,
        slots,
        positions,
        rounding.key,
        rounding.layer,
        ssm_pool.stride(0),
        ssm_pool.stride(1),
        ssm_pool.stride(2),
        states.stride(0),
        states.stride(1),
        states.stride(2),
        P=P,
        N=N,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        ROUNDS=rounding.rounds,
        num_warps=4,
    )
