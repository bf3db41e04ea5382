"""Mamba2 SSD (state-space duality) scan over packed variable-length sequences: plain-torch references.

Packed layout: the new tokens of S sequences are concatenated along dim 0; `cu_seqlens` ([S+1]) marks
where each sequence starts. Each sequence may start from its own initial SSM state (a prefix-cache hit
or the continuation of a chunked prefill), and chunks never straddle two sequences:

    tokens   | seq 0 (11 tok)              | seq 1 (5 tok)    |
    chunks   | c0 (L=4) | c1      | c2 (3) | c0      | c1 (1)|
    states   h0 -> [after c0] [after c1] [final]  h0' -> [after c0] [final]

For each sequence the scan returns the final state and the state at the end of every chunk (the last
one equals the final state). The prefix cache snapshots these, so a snapshot costs no extra pass.

The recurrence per head h, head channel p, state index n (dt already biased, softplus'd, clamped):

    state[t] = exp(dt[t] * A) * state[t-1] + dt[t] * x[t] * B[t]        (B, C shared by a head group)
    y[t]     = C[t] . state[t] + D * x[t]

`ssd_chunked_ref` evaluates it in the chunked (quadratic-within-chunk, linear-across-chunks) form the
GPU kernel uses; `ssd_naive_ref` evaluates it token by token and is the oracle for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hyserve.kernels.host_index import host_list


@dataclass(frozen=True)
class SSDOutput:
    y: torch.Tensor  # [T, H, P], x.dtype
    final_states: torch.Tensor  # [S, H, P, N], float32 (float64 for float64 inputs)
    chunk_states: torch.Tensor | None  # [total_chunks, H, P, N]: state after each chunk, sequence-major
    chunk_offsets: list[int]  # [S+1]: chunk_states rows of sequence s are chunk_offsets[s]:chunk_offsets[s+1]


def _cd(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def process_dt(
    dt: torch.Tensor,
    dt_bias: torch.Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
    dtype: torch.dtype,
) -> torch.Tensor:
    """dt -> clamp(softplus(dt + bias), *dt_limit), in `dtype`."""
    d = dt.to(dtype)
    if dt_bias is not None:
        d = d + dt_bias.to(dtype)
    if dt_softplus:
        d = F.softplus(d)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        d = d.clamp(min=lo, max=hi)
    return d


def chunk_offsets_for(cu_seqlens: list[int], chunk_size: int) -> list[int]:
    """Prefix sums of ceil(len_s / chunk_size): where each sequence's chunk states start."""
    out = [0]
    for s in range(len(cu_seqlens) - 1):
        n = cu_seqlens[s + 1] - cu_seqlens[s]
        out.append(out[-1] + (n + chunk_size - 1) // chunk_size)
    return out


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """a: [..., L] -> [..., L, L] with out[..., i, j] = sum(a[..., j+1 : i+1]) for j <= i, -inf above.

    Built from masked cumulative sums rather than differences of one cumsum, for accuracy.
    """
    L = a.shape[-1]
    x = a[..., None].expand(*a.shape, L)  # x[..., i, j] = a[..., i]
    strict = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=-1)
    x = x.masked_fill(~strict, 0)
    out = torch.cumsum(x, dim=-2)
    keep = torch.tril(torch.ones(L, L, dtype=torch.bool, device=a.device), diagonal=0)
    return out.masked_fill(~keep, float("-inf"))


def ssd_chunked_ref(
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
    """Chunked SSD over packed sequences.

    x: [T, H, P]; dt: [T, H] (raw); A: [H] (negative); B, C: [T, G, N]; D, dt_bias: [H];
    initial_states: [S, H, P, N] or None (zeros). Sequences of length 0 pass their state through.
    """
    cu = host_list(cu_seqlens)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = len(cu) - 1
    if H % G:
        raise ValueError(f"ssd: {H} heads not divisible into {G} groups")
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"ssd: cu_seqlens must run from 0 to {T}, got {cu[0]}..{cu[-1]}")
    cd = _cd(x)
    L = chunk_size
    lens = [cu[s + 1] - cu[s] for s in range(S)]
    nch = [(n + L - 1) // L for n in lens]
    cmax = max(nch, default=0)
    dev = x.device

    h0 = (
        torch.zeros(S, H, P, N, dtype=cd, device=dev)
        if initial_states is None
        else initial_states.to(cd).clone()
    )
    offsets = chunk_offsets_for(cu, L)
    if cmax == 0:
        return SSDOutput(
            y=torch.empty_like(x),
            final_states=h0,
            chunk_states=torch.empty(0, H, P, N, dtype=cd, device=dev) if return_chunk_states else None,
            chunk_offsets=offsets,
        )

    # Gather into a padded [S, cmax * L] grid. Padded positions get dt = 0 and x = B = C = 0, so they
    # neither decay nor feed the state: padding is exact, not approximate.
    idx = torch.full((S, cmax * L), -1, dtype=torch.long, device=dev)
    for s in range(S):
        idx[s, : lens[s]] = torch.arange(cu[s], cu[s + 1], device=dev)
    valid = idx >= 0
    safe = idx.clamp(min=0)

    dtp = process_dt(dt, dt_bias, dt_softplus, dt_limit, cd)[safe] * valid[..., None]  # [S, W, H]
    xp = x.to(cd)[safe] * valid[..., None, None]  # [S, W, H, P]
    rep = H // G
    Bp = B.to(cd)[safe].repeat_interleave(rep, dim=-2) * valid[..., None, None]  # [S, W, H, N]
    Cp = C.to(cd)[safe].repeat_interleave(rep, dim=-2) * valid[..., None, None]

    def chunks(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(S, cmax, L, *t.shape[2:])

    xdt = chunks(xp * dtp[..., None])  # [S, c, L, H, P]
    dA = chunks(dtp * A.to(cd))  # [S, c, L, H]
    Bc, Cc = chunks(Bp), chunks(Cp)  # [S, c, L, H, N]
    dA = dA.permute(0, 1, 3, 2)  # [S, c, H, L]
    dA_cs = torch.cumsum(dA, dim=-1)

    # 1. within-chunk (diagonal blocks): y[l] += sum_{m<=l} (C_l . B_m) exp(cs_l - cs_m) dt_m x_m
    decay = torch.exp(_segsum(dA))  # [S, c, H, L(l), L(m)]
    scores = torch.einsum("sclhn,scmhn->schlm", Cc, Bc) * decay
    y = torch.einsum("schlm,scmhp->sclhp", scores, xdt)

    # 2. each chunk's own contribution to the state at its end (starting from zero)
    to_end = torch.exp(dA_cs[..., -1:] - dA_cs)  # [S, c, H, L]
    chunk_contrib = torch.einsum("sclhn,schl,sclhp->schpn", Bc, to_end, xdt)

    # 3. across chunks: sequential, linear in the number of chunks
    chunk_decay = torch.exp(dA_cs[..., -1])  # [S, c, H]
    starts = []
    h = h0
    for c in range(cmax):
        starts.append(h)
        h = h * chunk_decay[:, c, :, None, None] + chunk_contrib[:, c]
    start_states = torch.stack(starts, dim=1)  # [S, c, H, P, N]

    # 4. the carried-in state's contribution: y[l] += exp(cs_l) * C_l . h_start
    y = (
        y
        + torch.einsum("sclhn,schpn->sclhp", Cc, start_states)
        * torch.exp(dA_cs).permute(0, 1, 3, 2)[..., None]
    )
    y = y.reshape(S, cmax * L, H, P)
    if D is not None:
        y = y + xp * D.to(cd)[:, None]

    out = torch.empty(T, H, P, dtype=x.dtype, device=dev)
    out[idx[valid]] = y[valid].to(x.dtype)

    chunk_states = None
    if return_chunk_states:
        ends = torch.cat([start_states[:, 1:], h[:, None]], dim=1)  # state after chunk c: [S, c, H, P, N]
        chunk_states = torch.cat([ends[s, : nch[s]] for s in range(S)], dim=0)
    return SSDOutput(y=out, final_states=h, chunk_states=chunk_states, chunk_offsets=offsets)


def ssd_naive_ref(
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
    """Token-by-token recurrence; the oracle. Same arguments and outputs as `ssd_chunked_ref`."""
    cu = host_list(cu_seqlens)
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = len(cu) - 1
    cd = _cd(x)
    rep = H // G
    dtv = process_dt(dt, dt_bias, dt_softplus, dt_limit, cd)
    Af = A.to(cd)
    out = torch.empty(T, H, P, dtype=x.dtype, device=x.device)
    finals, chunk_list = [], []
    for s in range(S):
        h = (
            torch.zeros(H, P, N, dtype=cd, device=x.device)
            if initial_states is None
            else initial_states[s].to(cd).clone()
        )
        for i, t in enumerate(range(cu[s], cu[s + 1])):
            bt = B[t].to(cd).repeat_interleave(rep, dim=0)  # [H, N]
            ct = C[t].to(cd).repeat_interleave(rep, dim=0)
            xt = x[t].to(cd)  # [H, P]
            h = h * torch.exp(dtv[t] * Af)[:, None, None] + (dtv[t][:, None] * xt)[..., None] * bt[:, None, :]
            yt = torch.einsum("hpn,hn->hp", h, ct)
            if D is not None:
                yt = yt + D.to(cd)[:, None] * xt
            out[t] = yt.to(x.dtype)
            n_done = i + 1
            if n_done % chunk_size == 0 or t == cu[s + 1] - 1:
                chunk_list.append(h.clone())
        finals.append(h)
    final_states = torch.stack(finals) if finals else torch.zeros(0, H, P, N, dtype=cd, device=x.device)
    chunk_states = None
    if return_chunk_states:
        chunk_states = (
            torch.stack(chunk_list) if chunk_list else torch.zeros(0, H, P, N, dtype=cd, device=x.device)
        )
    return SSDOutput(
        y=out,
        final_states=final_states,
        chunk_states=chunk_states,
        chunk_offsets=chunk_offsets_for(cu, chunk_size),
    )
