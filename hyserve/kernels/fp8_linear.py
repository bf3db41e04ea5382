"""FP8 linear layers (plain-torch references: the CPU path and the oracle of `triton_fp8_linear.py`).

A weight is float8 e4m3fn `q` [N, K] with float32 dequantisation scales, w = q * scale:

    scale [N]                   one per output channel (a per-tensor scale is held as N copies of it)
    scale [ceil(N/B), ceil(K/B)] one per [B, B] block (B = 128, DeepSeek-V3's block-scaled format)

    fp8_linear_ref(x, q, scale, bias) = F.linear(x, dequantize(q, scale).to(x.dtype), bias)
    fp8_relu2_linear_ref(x, ...)      = fp8_linear_ref(relu2(x), ...)     (the MLP's down_proj)

i.e. dequantise in float32, round once to the activation dtype, then the ordinary matmul: exactly defined,
so the CPU path is the same function whatever the hardware. The CUDA kernel also quantises the activation
(per token, or per token and 128-column group for block weights: `quantize_rows_ref`) and runs an e4m3
dot with both scales in the epilogue; its contract is the float64 product of the dequantised operands.

Quantisation (`quantize_weight_ref`, the one rule for online quantisation and the tests): scale = amax /
448 over the scale's group (a group of zeros gets scale 1), q = round-to-nearest-even(w / scale) clamped
to +-448.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hyserve.kernels.activation import relu2_ref

E4M3 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128
ACT_GROUP = 128  # activation columns per scale with block-scaled weights
SCHEMES = ("tensor", "channel", "block")


def _group_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax (float32) -> scale = amax / 448, 1 where the group is all zeros (q is 0 there either way).
    The divisor is a tensor on amax's device: CUDA torch turns division by a Python number into a product with
    its rounded reciprocal (one ulp off the quotient for some amax), and the kernels divide correctly
    rounded."""
    return torch.where(amax > 0, amax / amax.new_tensor(FP8_MAX), torch.ones_like(amax))


def to_e4m3(v: torch.Tensor) -> torch.Tensor:
    """float32 already divided by its scale -> e4m3 (round to nearest even, clamped to +-448)."""
    return v.clamp(-FP8_MAX, FP8_MAX).to(E4M3)


def _pad_to_blocks(w: torch.Tensor, block: int) -> torch.Tensor:
    n, k = w.shape
    pn, pk = -n % block, -k % block
    return F.pad(w, (0, pk, 0, pn)) if pn or pk else w


def expand_block_scale(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """[ceil(n/B), ceil(k/B)] -> [n, k], each block's scale over its elements."""
    nb, kb = -(-n // block), -(-k // block)
    if tuple(scale.shape) != (nb, kb):
        raise ValueError(
            f"block scale has shape {list(scale.shape)}, expected {[nb, kb]} for a [{n}, {k}] weight"
        )
    return scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]


def quantize_weight_ref(
    w: torch.Tensor, scheme: str, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (any float dtype) -> (q e4m3 [N, K], scale float32): scheme tensor -> scale [] (0-d),
    channel -> [N], block -> [ceil(N/B), ceil(K/B)]."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight_ref: expected a 2-D weight, got shape {list(w.shape)}")
    wf = w.float()
    if scheme == "tensor":
        scale = _group_scale(wf.abs().amax())
        return to_e4m3(wf / scale), scale
    if scheme == "channel":
        scale = _group_scale(wf.abs().amax(dim=1))
        return to_e4m3(wf / scale[:, None]), scale
    if scheme == "block":
        n, k = wf.shape
        p = _pad_to_blocks(wf, block)
        nb, kb = p.shape[0] // block, p.shape[1] // block
        amax = p.abs().view(nb, block, kb, block).amax(dim=(1, 3))
        scale = _group_scale(amax)
        return to_e4m3(wf / expand_block_scale(scale, n, k, block)), scale
    raise ValueError(f"quantize_weight_ref: scheme {scheme!r} is not one of {list(SCHEMES)}")


def dequantize_weight_ref(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(q [N, K], scale [N] or [ceil(N/B), ceil(K/B)] or []) -> float32 [N, K]."""
    n, k = q.shape
    qf = q.float()
    if scale.dim() == 0:
        return qf * scale.float()
    if scale.dim() == 1:
        if scale.shape[0] != n:
            raise ValueError(f"per-channel scale has {scale.shape[0]} entries for a weight of {n} rows")
        return qf * scale.float()[:, None]
    return qf * expand_block_scale(scale.float(), n, k, block)


def fp8_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x [..., K] (16/32-bit); weight e4m3 [N, K]; weight_scale [N] or [ceil(N/128), ceil(K/128)] float32
    -> [..., N] in x.dtype: the weight dequantised in float32, rounded to x.dtype, then F.linear."""
    if weight.dtype != E4M3:
        raise ValueError(f"fp8_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    if weight_scale.dtype != torch.float32 or weight_scale.dim() not in (1, 2):
        raise ValueError(
            f"fp8_linear: weight_scale must be float32 [N] or [N/128, K/128], got "
            f"{weight_scale.dtype} {list(weight_scale.shape)}"
        )
    w = dequantize_weight_ref(weight, weight_scale).to(x.dtype)
    return F.linear(x, w, bias)


def fp8_relu2_linear_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """relu^2 (in x.dtype), then `fp8_linear_ref`: the MLP's down projection with FP8 weights."""
    return fp8_linear_ref(relu2_ref(x), weight, weight_scale, bias)


def quantize_rows_ref(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic activation quantisation: x [M, K] -> (q e4m3 [M, K], scale float32 [M] or, with `group`,
    [M, ceil(K/group)]): one scale per row (token), or per row and `group` consecutive columns."""
    xf = x.float()
    if group is None:
        scale = _group_scale(xf.abs().amax(dim=1))
        return to_e4m3(xf / scale[:, None]), scale
    m, k = xf.shape
    pk = -k % group
    p = F.pad(xf, (0, pk)) if pk else xf
    amax = p.abs().view(m, -1, group).amax(dim=2)
    scale = _group_scale(amax)
    full = scale.repeat_interleave(group, 1)[:, :k]
    return to_e4m3(xf / full), scale
