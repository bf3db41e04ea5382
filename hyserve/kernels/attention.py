"""Paged attention over a block pool: KV write and causal attention for prefill/extend and decode.

The KV of every sequence lives in fixed-size blocks of a shared pool; a block table lists, per sequence,
the blocks that hold its tokens in order:

    k_cache: [num_blocks, block_size, kv_heads, head_dim]
    block_tables[s] = [7, 2, 9, ...]   token t of seq s lives at block block_tables[s][t // bs], row t % bs
    slot_mapping[i] = block * bs + row  where new token i is written (-1: skip, e.g. padding)

A step's new tokens for sequence s are the last n_s = cu_q[s+1] - cu_q[s] of its seq_lens[s] tokens;
new token j sits at position seq_lens[s] - n_s + j and attends to positions <= its own (no RoPE in
NemotronH: attention has no positional encoding).

Quantised caches (float8 e4m3, vLLM's scheme): each layer has two float32 scalars k_scale and v_scale,
passed as 0-dim (or 1-element) device tensors so a CUDA graph can capture the call. The cache holds

    write: cache = clamp(k / k_scale, -448, 448).to(float8_e4m3fn)     (448: largest finite e4m3)
    read:  k     = cache.to(float32) * k_scale

and the same for V. Without scales (None) nothing is scaled; a float8 cache is still clamped, because
an e4m3 value past 448 would become NaN.
"""

from __future__ import annotations

import torch

from hyserve.kernels.host_index import host_list

_MAX_SCORE_ELEMENTS = 1 << 25  # 128 MiB of float32 scores per tile

FP8_KV_DTYPES = (torch.float8_e4m3fn,)
FP8_E4M3_MAX = 448.0


def check_kv_scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, device: torch.device) -> bool:
    """True when the call is scaled. Both scales or neither; each one float element on `device`
    (shape and device only: reading the value would sync and break graph capture)."""
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale: pass both or neither")
    if k_scale is None or v_scale is None:
        return False
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t.numel() != 1 or not t.dtype.is_floating_point or t.device != device:
            raise ValueError(
                f"{name}: expected one floating-point element on {device}, got shape {tuple(t.shape)} "
                f"{t.dtype} on {t.device}"
            )
    return True


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in float32 (clamped to the e4m3 range for a float8 cache), cast to the cache dtype."""
    if scale is None and dtype not in FP8_KV_DTYPES:
        return x.to(dtype)
    y = x.float()
    if scale is not None:
        y = y / scale.float().reshape(())
    if dtype in FP8_KV_DTYPES:
        y = y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The cache's values in `dtype`: x.to(float32) * scale (float32) when scaled."""
    if scale is None:
        return x.to(dtype)
    return (x.float() * scale.float().reshape(())).to(dtype)


def e4m3_query_rows_ref(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] as the QK8 prefill form (`gluon_attention._PREFILL_SM90_QK8`) multiplies it: each row
    quantised to e4m3 by its own scale amax / 448 (1 for an all-zero row), round to nearest even, and
    dequantised, in float32. Attention of these values against the cache is that form's reference."""
    qf = q.float()
    scale = qf.abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (qf / scale).to(torch.float8_e4m3fn).float() * scale


def write_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, kv_heads, head_dim]; writes them at slot_mapping ([T]) into the caches, quantised with
    k_scale / v_scale when given (see the module docstring)."""
    check_kv_scales(k_scale, v_scale, k.device)
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // bs, slots % bs] = quantize_kv(k[keep], k_scale, k_cache.dtype)
    v_cache[slots // bs, slots % bs] = quantize_kv(v[keep], v_scale, v_cache.dtype)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n tokens of one sequence from the pool: [n, kv_heads, head_dim]."""
    bs = cache.shape[1]
    nb = (n + bs - 1) // bs
    return cache[block_table[:nb].long()].reshape(nb * bs, *cache.shape[2:])[:n]


def paged_attention_ref(
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
    """q: [T, q_heads, head_dim] -> out [T, q_heads, head_dim] in q.dtype. GQA: q head h reads kv head
    h // (q_heads // kv_heads). Softmax in float32 (float64 for float64 q). With k_scale / v_scale the
    cache is dequantised in float32 (cache.float() * scale) before anything else."""
    check_kv_scales(k_scale, v_scale, q.device)
    lens, cu = host_list(seq_lens), host_list(cu_q)
    cd = torch.float64 if q.dtype == torch.float64 else torch.float32
    Hq = q.shape[1]
    Hkv = k_cache.shape[2]
    rep = Hq // Hkv
    out = torch.empty_like(q)
    for s in range(len(cu) - 1):
        n_new = cu[s + 1] - cu[s]
        if n_new == 0:
            continue
        total = lens[s]
        if n_new > total:
            raise ValueError(f"paged_attention: sequence {s} has {n_new} new tokens but seq_len {total}")
        k = dequantize_kv(gather_kv(k_cache, block_tables[s], total), k_scale, cd)  # [L, Hkv, D]
        v = dequantize_kv(gather_kv(v_cache, block_tables[s], total), v_scale, cd)
        k = k.repeat_interleave(rep, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(rep, dim=1)
        kpos = torch.arange(total, device=q.device)
        # query tiles keep the [heads, tile, total] score matrix bounded on long prompts
        tile = max(1, _MAX_SCORE_ELEMENTS // (Hq * total))
        for a in range(0, n_new, tile):
            b = min(a + tile, n_new)
            qs = q[cu[s] + a : cu[s] + b].to(cd)  # [tile, Hq, D]
            scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
            qpos = torch.arange(total - n_new + a, total - n_new + b, device=q.device)
            scores = scores.masked_fill((kpos[None, :] > qpos[:, None])[None], float("-inf"))
            p = torch.softmax(scores, dim=-1)
            out[cu[s] + a : cu[s] + b] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out
