"""The structured-outputs token mask as one Triton kernel (contract: `token_bitmask.py`).

The plain-torch rule expands the [n, V / 32] words into [n, V, 32]-shaped integer temporaries and a bool
mask before the masked fill: about 250 MB of traffic and six launches for 64 rows of a 131k vocabulary.
Here one program reads BLOCK logits of a row and the words that cover them, and writes the result:

    out[r, t] = logits[r, t] if (mask[r, t // 32] >> (t % 32)) & 1 else -inf      grid = (n, cdiv(V, BLOCK))
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hyserve.kernels.token_bitmask import check_bitmask_args


@triton.jit
def _apply_bitmask_kernel(x_ptr, m_ptr, out_ptr, V, s_x, s_m, s_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < V
    x = tl.load(x_ptr + row * s_x + offs, mask=inb, other=0.0)
    words = tl.load(m_ptr + row * s_m + offs // 32, mask=inb, other=0)
    keep = ((words >> (offs % 32)) & 1) != 0
    tl.store(out_ptr + row * s_o + offs, tl.where(keep, x, float("-inf")), mask=inb)


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [n, V] float, bitmask [n, ceil(V / 32)] int32 on the same device -> a new tensor with the
    disallowed logits at -inf (apply_token_bitmask_ref)."""
    check_bitmask_args(logits, bitmask)
    n, vocab = logits.shape
    out = torch.empty_like(logits)
    if n == 0 or vocab == 0:
        return out
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    m = bitmask if bitmask.stride(1) == 1 else bitmask.contiguous()
    block = 4096 if logits.is_cuda else 64
    _apply_bitmask_kernel[(n, triton.cdiv(vocab, block))](
        x,
        m,
        out,
        vocab,
        x.stride(0),
        m.stride(0),
        out.stride(0),
        BLOCK=block,
        num_warps=8 if logits.is_cuda else 1,
    )
    return out


__all__ = ["apply_token_bitmask_triton"]
