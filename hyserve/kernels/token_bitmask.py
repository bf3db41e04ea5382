"""The structured-outputs token mask applied to logits (plain-torch reference; the CPU path and the oracle of
`triton_token_bitmask.py`).

    bitmask  [n, ceil(V / 32)] int32: bit t % 32 of word t // 32 set = token t allowed (xgrammar's layout)
    apply    out[r, t] = logits[r, t] if allowed else -inf    (a new tensor; a row of all ones is
                                                               unchanged)
"""

from __future__ import annotations

import torch


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def check_bitmask_args(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(
            f"apply_token_bitmask: logits must be a float [n, V] tensor, got {tuple(logits.shape)} "
            f"{logits.dtype}"
        )
    n, vocab = logits.shape
    if bitmask.shape != (n, bitmask_width(vocab)) or bitmask.dtype != torch.int32:
        raise ValueError(
            f"apply_token_bitmask: bitmask must be int32 [{n}, {bitmask_width(vocab)}] for {vocab} "
            f"tokens, got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if bitmask.device != logits.device:
        raise ValueError(f"apply_token_bitmask: bitmask on {bitmask.device}, logits on {logits.device}")


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] float, bitmask [n, ceil(V / 32)] int32 on the same device -> a new tensor with the
    disallowed logits at -inf."""
    check_bitmask_args(logits, bitmask)
    n, vocab = logits.shape
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)  # [32]
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(n, -1)[:, :vocab]  # [n, V]
    return logits.masked_fill(~allowed, float("-inf"))


__all__ = ["apply_token_bitmask_ref", "bitmask_width", "check_bitmask_args"]
