"""Vocab-parallel input embedding and lm_head (docs/architecture.md, "Parallelism").

The vocabulary is padded to a multiple of tp_size and split into equal row blocks: rank r holds ids
[r * V_pad/tp, (r+1) * V_pad/tp) (rows past the real vocabulary are zeros). The embedding looks up the
ids it holds, zeroes the others and all-reduces, so every rank gets every token's row; the lm_head
computes its block of logits and all-gathers them, so every rank holds the full [n, vocab] logits and
samples the same tokens. With one rank both are nn.Embedding / a plain linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.distributed import Group, all_gather, all_reduce, tp_group
from hyserve.model.parallel_linear import ShardLoading, SliceLike, loaded_shape, read_rows


def vocab_range(vocab_size: int, group: Group) -> tuple[int, int, int]:
    """(first id, end id, rows per rank) of this rank's vocabulary block; end - first may be < rows per
    rank on the last ranks (padding)."""
    per = -(-vocab_size // group.size)
    start = min(group.rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


class VocabParallelEmbedding(ShardLoading):
    """weight [V_pad / tp, dim]: this rank's block of the embedding table."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, group: Group | None = None, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.group = group or tp_group()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end, per = vocab_range(num_embeddings, self.group)
        self.weight = nn.Parameter(torch.empty(per, embedding_dim, device=device, dtype=dtype))
        self.register_shard("weight", self.weight_loader, (num_embeddings, embedding_dim))

    @torch.no_grad()
    def weight_loader(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        shape = loaded_shape(loaded)
        want = (self.num_embeddings, self.embedding_dim)
        if shape != want:
            raise ValueError(
                f"{type(self).__name__}: checkpoint tensor has shape {list(shape)}, expected {list(want)}"
            )
        n = self.vocab_end - self.vocab_start
        if n:
            param[:n].copy_(read_rows(loaded, 0, self.vocab_start, n))
        param[n:].zero_()  # padding rows: never looked up, their logits are cut off

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (global token ids) -> [T, dim]."""
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        local = torch.where(mine, ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight).masked_fill_(~mine.unsqueeze(-1), 0.0)
        return all_reduce(out, self.group)


def vocab_parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, group: Group
) -> torch.Tensor:
    """hidden [n, dim] @ this rank's vocab block weight [V_pad/tp, dim] -> full logits [n, vocab_size] on
    every rank (in the weight's dtype)."""
    local = F.linear(hidden, weight)  # [n, V_pad / tp]
    if group.size == 1:
        return local
    return all_gather(local, group, dim=-1)[..., :vocab_size]


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection, sharded like the embedding (a tied model uses the embedding's weight with
    `vocab_parallel_logits`)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """hidden [n, dim] -> logits [n, vocab]."""
        return vocab_parallel_logits(hidden, self.weight, self.num_embeddings, self.group)
