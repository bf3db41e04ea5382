"""Decode-time SSM state update (one token per sequence), plain-torch reference.

Reads each sequence's state from `ssm_pool[src_slots]`, advances it one token, writes it to
`ssm_pool[dst_slots]` (src == dst for ordinary decode; pad rows of a CUDA graph point at pad slots).

    state' = exp(dt * A) * state + dt * x (outer) B ;   y = C . state' + D * x
"""

from __future__ import annotations

import torch

from hyserve.kernels.ssd import process_dt


def selective_state_update_ref(
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
) -> torch.Tensor:
    """ssm_pool: [num_slots, H, P, N]; x: [Bt, H, P]; dt: [Bt, H]; A, D, dt_bias: [H]; B, C: [Bt, G, N].

    Computes in float32 (float64 for float64 x); the new state is stored in the pool's dtype.
    Returns y [Bt, H, P] in x.dtype.
    """
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    H = x.shape[1]
    rep = H // B.shape[1]
    d = process_dt(dt, dt_bias, dt_softplus, dt_limit, cd)  # [Bt, H]
    h = ssm_pool[src_slots].to(cd)  # [Bt, H, P, N]
    Bh = B.to(cd).repeat_interleave(rep, dim=1)  # [Bt, H, N]
    Ch = C.to(cd).repeat_interleave(rep, dim=1)
    xf = x.to(cd)
    h = h * torch.exp(d * A.to(cd))[..., None, None] + (d[..., None] * xf)[..., None] * Bh[:, :, None, :]
    ssm_pool[dst_slots] = h.to(ssm_pool.dtype)
    y = torch.einsum("bhpn,bhn->bhp", h, Ch)
    if D is not None:
        y = y + D.to(cd)[:, None] * xf
    return y.to(x.dtype)
