"""Causal depthwise conv1d (+ SiLU) of the Mamba2 mixer: plain-torch references.

Each channel d of a sequence sees its last K inputs: out[t] = act(bias + sum_k w[d, k] * xs[t + k]) where
xs = [conv_state (K-1 columns), x of this step]. The conv state of a sequence is the last K-1 inputs it
has seen (zeros for a fresh sequence). Packed layout as in ssd.py:

    xs of seq s:  | state[:, 0] .. state[:, K-2] | x[cu[s]] ... x[cu[s+1]-1] |
    out[cu[s]+j] uses xs[j : j + K]; new state = the last K-1 columns of xs
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.host_index import host_list


def _cd(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def uses_silu(activation: str | None) -> bool:
    """The conv's activation: None (identity) or SiLU; anything else is an error."""
    if activation is None:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"conv1d: unsupported activation {activation!r}")


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    return F.silu(y) if uses_silu(activation) else y


def causal_conv1d_varlen_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor | list[int],
    initial_states: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, D]; weight: [D, K]; bias: [D]; initial_states: [S, D, K-1] or None (zeros).

    Returns (out [T, D] in x.dtype, final_states [S, D, K-1] in x.dtype).
    """
    cu = host_list(cu_seqlens)
    T, Dm = x.shape
    K = weight.shape[1]
    S = len(cu) - 1
    cd = _cd(x)
    w = weight.to(cd)
    out = torch.empty(T, Dm, dtype=x.dtype, device=x.device)
    finals = torch.empty(S, Dm, K - 1, dtype=x.dtype, device=x.device)
    for s in range(S):
        n = cu[s + 1] - cu[s]
        st = (
            torch.zeros(Dm, K - 1, dtype=cd, device=x.device)
            if initial_states is None
            else initial_states[s].to(cd)
        )
        xs = torch.cat([st, x[cu[s] : cu[s + 1]].to(cd).T], dim=1)  # [D, K-1+n]
        if n > 0:
            win = xs.unfold(1, K, 1)  # [D, n, K]
            y = (win * w[:, None, :]).sum(-1)
            if bias is not None:
                y = y + bias.to(cd)[:, None]
            out[cu[s] : cu[s + 1]] = _act(y, activation).T.to(x.dtype)
        finals[s] = xs[:, xs.shape[1] - (K - 1) :].to(x.dtype)
    return out, finals


def conv_state_at(
    x: torch.Tensor, start: int, offset: int, initial_state: torch.Tensor | None, width: int
) -> torch.Tensor:
    """Conv state of one sequence after its first `offset` new tokens (x packed, sequence starts at
    `start`): the last `width` inputs seen, taking columns from the initial state when offset < width.
    Returns [D, width] in x.dtype. Used to snapshot at chunk boundaries inside a prefill."""
    if offset >= width:  # only the last `width` inputs (a view: the caller stacks or copies it)
        return x[start + offset - width : start + offset].T
    Dm = x.shape[1]
    st = torch.zeros(Dm, width, dtype=x.dtype, device=x.device) if initial_state is None else initial_state
    return torch.cat([st[:, offset:].to(x.dtype), x[start : start + offset].T], dim=1)


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One decode token per sequence. x: [B, D]; conv_pool: [num_slots, D, K-1] (updated in place:
    conv_pool[dst] = shifted conv_pool[src]); src/dst_slots: [B]. Returns out [B, D] in x.dtype."""
    cd = _cd(x)
    st = conv_pool[src_slots].to(cd)  # [B, D, K-1]
    xs = torch.cat([st, x.to(cd)[:, :, None]], dim=2)  # [B, D, K]
    y = (xs * weight.to(cd)[None]).sum(-1)
    if bias is not None:
        y = y + bias.to(cd)
    conv_pool[dst_slots] = xs[:, :, 1:].to(conv_pool.dtype)
    return _act(y, activation).to(x.dtype)
