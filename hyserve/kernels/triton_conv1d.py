"""Causal depthwise conv1d (+ SiLU) of the Mamba2 mixer as Triton kernels.

Same contracts as `conv1d.causal_conv1d_update_ref` (decode: one token per sequence, conv state read
from conv_pool[src], shifted state written to conv_pool[dst]) and `conv1d.causal_conv1d_varlen_ref`
(packed prefill with per-sequence initial states). Compute in float32.

Channel d of one sequence sees xs = [state[d, 0..K-2] | x[.., d]]; output j uses xs[j .. j+K-1]:

    xs index i:   0 .. K-2      K-1 .. K-2+n
    source:       state[:, i]   x[start + i - (K-1)]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.kernels.conv1d import uses_silu
from hyserve.kernels.host_index import cached_on_device, host_list
from hyserve.kernels.launch_util import device_index, pdl
from hyserve.kernels.triton_common import pdl_enter


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


# --------------------------------------------------------------------------- decode update


@triton.jit(do_not_specialize=["batch"])
def _conv1d_update_kernel(
    x_ptr,
    pool_ptr,
    w_ptr,
    bias_ptr,
    src_ptr,
    dst_ptr,
    out_ptr,
    batch,
    dim,
    s_x_b,  # x stride along D is 1
    s_pool_slot,
    s_w_d,  # weight stride along K is 1
    s_out_b,
    S_POOL_D: tl.constexpr,  # the state's strides within a slot: K-1 and 1 for a contiguous pool
    S_POOL_K: tl.constexpr,
    K: tl.constexpr,
    KP: tl.constexpr,  # K-1 rounded up to a power of two: the state tile's width
    TILED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    PDL: tl.constexpr,
):
    """Two forms, one per pool layout. Column (TILED = 0, the cache's tap-major pool, S_POOL_D = 1): a tap
    at a time, each load and store one contiguous run of BLOCK_D channels. TILED (a channel-major pool,
    S_POOL_K = 1): the state as [BLOCK_D, KP] tiles whose rows are a channel's K-1 taps, so a warp's lanes
    cover consecutive channels and each access is one contiguous run of channels x taps."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m = offs < dim
    # Before the PDL wait: the slot indices, the taps, the bias and the state (only this kernel writes the
    # conv pool in a decode step, and the previous step has finished), so those DRAM round trips overlap
    # the kernel before (in_proj); only x is that kernel's output. Column k of the state is tap k.
    src = tl.load(src_ptr + b).to(tl.int64)
    dst = tl.load(dst_ptr + b).to(tl.int64)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=m, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + offs * s_w_d + (K - 1), mask=m, other=0.0).to(tl.float32)
    if TILED:
        kk = tl.arange(0, KP)
        tile_m = m[:, None] & (kk < K - 1)[None, :]
        cell = offs[:, None] * S_POOL_D + kk[None, :] * S_POOL_K
        src_tile = pool_ptr + src * s_pool_slot + cell
        state = tl.load(src_tile, mask=tile_m, other=0.0)
        taps = tl.load(w_ptr + offs[:, None] * s_w_d + kk[None, :], mask=tile_m, other=0.0)
        acc += tl.sum(state.to(tl.float32) * taps.to(tl.float32), axis=1)
        # the new state is columns 1..K-2 followed by x: the shifted tile is read before anything is
        # written, so src == dst (the ordinary decode case) is safe (its sectors were just read: a cache hit)
        shifted = tl.load(src_tile + S_POOL_K, mask=m[:, None] & (kk + 1 < K - 1)[None, :], other=0.0)
        pdl_enter(PDL)
        x = tl.load(x_ptr + b * s_x_b + offs, mask=m, other=0.0)
        x_col = x.to(pool_ptr.dtype.element_ty)[:, None]
        new = tl.where((kk == K - 2)[None, :], x_col, shifted)
        tl.store(pool_ptr + dst * s_pool_slot + cell, new, mask=tile_m)
    else:
        src_base = pool_ptr + src * s_pool_slot + offs * S_POOL_D
        dst_base = pool_ptr + dst * s_pool_slot + offs * S_POOL_D
        for k in tl.static_range(0, K - 1):
            col = tl.load(src_base + k * S_POOL_K, mask=m, other=0.0).to(tl.float32)
            acc += col * tl.load(w_ptr + offs * s_w_d + k, mask=m, other=0.0).to(tl.float32)
        pdl_enter(PDL)
        x = tl.load(x_ptr + b * s_x_b + offs, mask=m, other=0.0)
        # every column was read above, so src == dst is safe (the second read of a column hits the cache)
        for k in tl.static_range(1, K - 1):
            col = tl.load(src_base + k * S_POOL_K, mask=m, other=0.0)
            tl.store(dst_base + (k - 1) * S_POOL_K, col, mask=m)
        tl.store(dst_base + (K - 2) * S_POOL_K, x.to(pool_ptr.dtype.element_ty), mask=m)
    acc += x.to(tl.float32) * w_last
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + b * s_out_b + offs, acc.to(out_ptr.dtype.element_ty), mask=m)


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
    *,
    tiled: bool | None = None,
) -> torch.Tensor:
    """x: [B, D]; conv_pool: [num_slots, D, K-1], any strides (conv_pool[dst] = shifted conv_pool[src]);
    weight: [D, K]; bias: [D]; src/dst_slots: [B]. Returns out [B, D] in x.dtype. tiled: the kernel's
    form; None picks the pool's own (the column form over a tap-major pool, the tiled one otherwise), and
    benchmarks force either to time both."""
    silu = uses_silu(activation)
    assert x.dim() == 2 and conv_pool.dim() == 3 and weight.dim() == 2
    Bt, Dm = x.shape
    K = weight.shape[1]
    assert K >= 2 and weight.shape == (Dm, K), f"weight {tuple(weight.shape)} vs x {tuple(x.shape)}"
    assert conv_pool.shape[1:] == (Dm, K - 1), (
        f"conv_pool {tuple(conv_pool.shape)} vs weight {tuple(weight.shape)}"
    )
    assert bias is None or (bias.shape == (Dm,) and bias.is_contiguous())
    assert src_slots.shape == (Bt,) and dst_slots.shape == (Bt,)
    assert src_slots.is_contiguous() and dst_slots.is_contiguous()
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert x.dtype != torch.float64 and conv_pool.dtype != torch.float64, "float64 runs on the reference path"
    out = torch.empty(Bt, Dm, dtype=x.dtype, device=x.device)
    if Bt == 0:
        return out
    if tiled is None:
        tiled = conv_pool.stride(1) != 1
    # small batches: narrow tiles, so a batch-1 step spreads over ~100 programs instead of 12 (its four
    # dependent column loads are latency, not bandwidth); two variants, both met by the warm-up's decodes
    BLOCK_D = min(1024 if Bt >= 8 else 128, triton.next_power_of_2(Dm))
    grid = (triton.cdiv(Dm, BLOCK_D), Bt)
    _conv1d_update_kernel[grid](
        x,
        conv_pool,
        weight,
        bias if bias is not None else weight,
        src_slots,
        dst_slots,
        out,
        Bt,
        Dm,
        x.stride(0),
        conv_pool.stride(0),
        weight.stride(0),
        out.stride(0),
        S_POOL_D=conv_pool.stride(1),
        S_POOL_K=conv_pool.stride(2),
        K=K,
        KP=triton.next_power_of_2(K - 1),
        TILED=tiled,
        BLOCK_D=BLOCK_D,
        HAS_BIAS=bias is not None,
        SILU=silu,
        num_warps=4,
        **pdl(x),
    )
    return out


# --------------------------------------------------------------------------- varlen prefill


@triton.jit
def _conv1d_varlen_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    cu_ptr,
    init_ptr,
    out_ptr,
    final_ptr,
    dim,
    s_x_t,  # x stride along D is 1
    s_w_d,
    s_init_s,
    s_init_d,
    s_init_k,
    s_out_t,
    s_fin_s,
    s_fin_d,
    s_fin_k,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT: tl.constexpr,
    SILU: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    s = tl.program_id(2)
    start = tl.load(cu_ptr + s).to(tl.int64)
    n = tl.load(cu_ptr + s + 1).to(tl.int64) - start
    t0 = pid_t * BLOCK_T
    if t0 >= n:
        return
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    md = offs_d < dim
    offs_j = t0 + tl.arange(0, BLOCK_T)  # new-token index within the sequence
    mj = offs_j < n

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_d, mask=md, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        w = tl.load(w_ptr + offs_d * s_w_d + k, mask=md, other=0.0).to(tl.float32)
        i = offs_j + k  # xs index
        from_x = i >= K - 1
        xv = tl.load(
            x_ptr + (start + i - (K - 1))[:, None] * s_x_t + offs_d[None, :],
            mask=(mj & from_x)[:, None] & md[None, :],
            other=0.0,
        ).to(tl.float32)
        if HAS_INIT:
            sv = tl.load(
                init_ptr + s * s_init_s + offs_d[None, :] * s_init_d + i[:, None] * s_init_k,
                mask=(mj & (i < K - 1))[:, None] & md[None, :],
                other=0.0,
            ).to(tl.float32)
            xv += sv
        acc += xv * w[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(
        out_ptr + (start + offs_j)[:, None] * s_out_t + offs_d[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mj[:, None] & md[None, :],
    )

    # The program holding the sequence's last token writes its final state: xs[n .. n+K-2].
    if t0 + BLOCK_T >= n:
        for c in tl.static_range(K - 1):
            xi = n + c  # a fresh name: `i` above is a block tensor of another type
            if xi >= K - 1:
                fv = tl.load(x_ptr + (start + xi - (K - 1)) * s_x_t + offs_d, mask=md, other=0.0).to(
                    tl.float32
                )
            else:
                if HAS_INIT:
                    fv = tl.load(
                        init_ptr + s * s_init_s + offs_d * s_init_d + xi * s_init_k, mask=md, other=0.0
                    ).to(tl.float32)
                else:
                    fv = tl.zeros((BLOCK_D,), dtype=tl.float32)
            tl.store(
                final_ptr + s * s_fin_s + offs_d * s_fin_d + c * s_fin_k,
                fv.to(final_ptr.dtype.element_ty),
                mask=md,
            )


def causal_conv1d_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | list[int],
    initial_states: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, D]; weight: [D, K]; bias: [D]; cu_seqlens: [S+1] (host list preferred: the grid needs
    the longest sequence); initial_states: [S, D, K-1] or None (zeros).
    Returns (out [T, D] in x.dtype, final_states [S, D, K-1] in x.dtype)."""
    silu = uses_silu(activation)
    assert x.dim() == 2 and weight.dim() == 2
    T, Dm = x.shape
    K = weight.shape[1]
    assert K >= 2 and weight.shape == (Dm, K)
    assert bias is None or (bias.shape == (Dm,) and bias.is_contiguous())
    assert x.stride(1) == 1 and weight.stride(1) == 1
    assert x.dtype != torch.float64, "float64 runs on the reference path"
    cu_host = host_list(cu_seqlens)
    S = len(cu_host) - 1
    assert S >= 0 and cu_host[0] == 0 and cu_host[-1] == T, f"cu_seqlens {cu_host} vs {T} tokens"
    if initial_states is not None:
        assert initial_states.shape == (S, Dm, K - 1), f"initial_states {tuple(initial_states.shape)}"
    out = torch.empty(T, Dm, dtype=x.dtype, device=x.device)
    finals = torch.empty(S, Dm, K - 1, dtype=x.dtype, device=x.device)
    if S == 0:
        return out, finals
    max_n = max(cu_host[s + 1] - cu_host[s] for s in range(S))
    BLOCK_T = 32
    BLOCK_D = min(128, triton.next_power_of_2(Dm))
    # Empty sequences still need their final state (= the initial state): one program each.
    grid = (max(1, triton.cdiv(max_n, BLOCK_T)), triton.cdiv(Dm, BLOCK_D), S)
    cu = cached_on_device(cu_host, "cu", x.device, lambda: device_index(cu_host, x.device))
    init = initial_states if initial_states is not None else finals
    if max_n == 0 or any(cu_host[s + 1] == cu_host[s] for s in range(S)):
        # Rare: sequences with no new tokens keep their initial state (or zeros).
        empty = [s for s in range(S) if cu_host[s + 1] == cu_host[s]]
        for s in empty:
            finals[s] = 0 if initial_states is None else initial_states[s].to(x.dtype)
    _conv1d_varlen_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        cu,
        init,
        out,
        finals,
        Dm,
        x.stride(0),
        weight.stride(0),
        init.stride(0),
        init.stride(1),
        init.stride(2),
        out.stride(0),
        finals.stride(0),
        finals.stride(1),
        finals.stride(2),
        K=K,
        BLOCK_T=BLOCK_T,
        BLOCK_D=BLOCK_D,
        HAS_BIAS=bias is not None,
        HAS_INIT=initial_states is not None,
        SILU=silu,
        num_warps=4,
    )
    return out, finals
