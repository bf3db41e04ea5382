"""The CUDA paged-attention op: the one place that picks between the attention kernels.

`triton_attention` runs decode and prefill; on Hopper the prefill part of a step goes to `gluon_attention`'s
warp-specialised kernel wherever it can take it (`gluon_attention.sm90_prefill_box`), and the decode part of a
step over a float8 cache to `gluon_decode`'s one-warp MMA kernel (`gluon_decode.decode_fp8_fits`). No kernel
module imports another; `ops.load_cuda_kernels` binds this function as the CUDA `paged_attention`.
"""

from __future__ import annotations

import torch

from hyserve.kernels.triton_attention import DecodeKernel, PrefillKernel, paged_attention_triton

_PREFILL: PrefillKernel | None
_DECODE: DecodeKernel | None
try:  # Gluon shipped in triton 3.5; without it every step stays on the Triton kernels
    from hyserve.kernels.gluon_attention import prefill_sm90 as _PREFILL
    from hyserve.kernels.gluon_decode import decode_fp8 as _DECODE
except ImportError:  # pragma: no cover - depends on the triton install
    _PREFILL = _DECODE = None


def paged_attention_cuda(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor | list[int],
    cu_q: torch.Tensor | list[int],
    scale: float,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`attention.paged_attention_ref`'s contract on a GPU (or the Triton interpreter): q [T, q_heads,
    head_dim] -> out [T, q_heads, head_dim]; see `triton_attention.paged_attention_triton`."""
    return paged_attention_triton(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_q,
        scale,
        k_scale=k_scale,
        v_scale=v_scale,
        prefill=_PREFILL,
        decode=_DECODE,
    )


__all__ = ["paged_attention_cuda"]
