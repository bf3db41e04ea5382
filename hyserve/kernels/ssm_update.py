"""Decode-time SSM state update (one token per sequence), plain-torch reference.

Reads each sequence's state from `ssm_pool[src_slots]`, advances it one token, writes it to
`ssm_pool[dst_slots]` (src == dst for ordinary decode; pad rows of a CUDA graph point at pad slots).
The new state is stored with round-to-nearest, or, with `rounding`, stochastically rounded into a float16
pool at `positions` (the tokens in cache after this step: `ForwardMeta.seq_lens_t`; see
`stochastic_rounding.py`).

    state' = exp(dt * A) * state + dt * x (outer) B ;   y = C . state' + D * x
"""

from __future__ import annotations

import torch

from hyserve.kernels.ssd import process_dt
from hyserve.kernels.stochastic_rounding import StochasticRounding, stochastic_round_state


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
    rounding: StochasticRounding | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """ssm_pool: [num_slots, H, P, N]; x: [Bt, H, P]; dt: [Bt, H]; A, D, dt_bias: [H]; B, C: [Bt, G, N];
    positions: [Bt] integer (with `rounding` only).

    Computes in float32 (float64 for float64 x); the new state is stored in the pool's dtype (stochastic
    rounding: from float32). Returns y [Bt, H, P] in x.dtype.
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
    if rounding is None:
        ssm_pool[dst_slots] = h.to(ssm_pool.dtype)
    else:
        assert ssm_pool.dtype == torch.float16, (
            f"stochastic rounding needs a float16 pool, got {ssm_pool.dtype}"
        )
        assert positions is not None and positions.shape == src_slots.shape, "one position per row"
        ssm_pool[dst_slots] = stochastic_round_state(h, positions, rounding)
    y = torch.einsum("bhpn,bhn->bhp", h, Ch)
    if D is not None:
        y = y + D.to(cd)[:, None] * xf
    return y.to(x.dtype)
