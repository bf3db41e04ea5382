"""Rotary position embedding for the attention layers of RoPE families (Bamba; Granite configs that ask for
it), in the half-split form: a head's first `rotary_dim` channels are two halves (x1, x2) rotated together,

    x1' = x1 cos(p f) - x2 sin(p f)      x2' = x2 cos(p f) + x1 sin(p f)      f_i = theta^(-2i / rotary_dim)

and the channels past `rotary_dim` pass through (partial rotary). A token's position is where it sits in
its sequence: the tokens already cached plus its index among the step's new ones. A pure decode step reads
it from the device (`seq_lens_t - 1`), so the step stays capturable in a CUDA graph; other steps build it
from the host lists the step already carries.
"""

from __future__ import annotations

import torch

from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.layer_specs import RopeSpec


def token_positions(meta: ForwardMeta, num_tokens: int, device: torch.device) -> torch.Tensor:
    """[T] int64: each new token's position in its sequence.

    cu_seqlens  0    1    2              7
    seq_lens    9    4    12
    positions | 8 | 3 | 7 8 9 10 11 |       (a prefill chunk of 5 after 7 cached tokens)
    """
    if meta.num_decodes == num_tokens:
        return meta.seq_lens_t[:num_tokens].to(torch.int64) - 1
    cu = meta.cu_seqlens
    starts = [meta.seq_lens[s] - (cu[s + 1] - cu[s]) for s in range(len(cu) - 1)]
    pos = torch.cat(
        [torch.arange(start, start + cu[s + 1] - cu[s], dtype=torch.int64) for s, start in enumerate(starts)]
    )
    return pos.to(device, non_blocking=True)


def rope_cos_sin(spec: RopeSpec, meta: ForwardMeta, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [T, rotary_dim] in x's dtype, for the step's tokens (angles in float32)."""
    pos = token_positions(meta, x.shape[0], x.device)
    freqs = pos.float()[:, None] * spec.inv_freq(x.device)[None, :]  # [T, rotary_dim / 2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim] -> x with its first rotary_dim channels rotated."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    half = rd // 2
    swapped = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + swapped * sin[:, None, :]
    return out if rest.shape[-1] == 0 else torch.cat((out, rest), dim=-1)
