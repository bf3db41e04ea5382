"""Paged attention over a block pool: KV write and causal attention for prefill/extend and decode.

The KV of every sequence lives in fixed-size blocks of a shared pool; a block table lists, per sequence,
the blocks that hold its tokens in order:

    k_cache: [num_blocks, block_size, kv_heads, head_dim]
    block_tables[s] = [7, 2, 9, ...]   token t of seq s lives at block block_tables[s][t // bs], row t % bs
    slot_mapping[i] = block * bs + row  where new token i is written (-1: skip, e.g. padding)

A step's new tokens for sequence s are the last n_s = cu_q[s+1] - cu_q[s] of its seq_lens[s] tokens;
new token j sits at position seq_lens[s] - n_s + j and attends to positions <= its own (no RoPE in
NemotronH: attention has no positional encoding).
"""

from __future__ import annotations

import torch

_MAX_SCORE_ELEMENTS = 1 << 25  # 128 MiB of float32 scores per tile


def write_kv_ref(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """k, v: [T, kv_heads, head_dim]; writes them at slot_mapping ([T]) into the caches."""
    bs = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache[slots // bs, slots % bs] = k[keep].to(k_cache.dtype)
    v_cache[slots // bs, slots % bs] = v[keep].to(v_cache.dtype)


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
) -> torch.Tensor:
    """q: [T, q_heads, head_dim] -> out [T, q_heads, head_dim] in q.dtype. GQA: q head h reads kv head
    h // (q_heads // kv_heads). Softmax in float32 (float64 for float64 q)."""
    lens = [int(v) for v in (seq_lens.tolist() if isinstance(seq_lens, torch.Tensor) else seq_lens)]
    cu = [int(v) for v in (cu_q.tolist() if isinstance(cu_q, torch.Tensor) else cu_q)]
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
        k = gather_kv(k_cache, block_tables[s], total).to(cd).repeat_interleave(rep, dim=1)  # [L, Hq, D]
        v = gather_kv(v_cache, block_tables[s], total).to(cd).repeat_interleave(rep, dim=1)
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
