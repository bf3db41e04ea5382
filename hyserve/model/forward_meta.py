"""`ForwardMeta`: everything one forward pass needs to find its sequences' caches.

The engine's model runner builds one per step from the scheduler's `ScheduledBatch`; the model reads
it explicitly (passed as an argument; no globals). Sequence order within a step: the `num_decodes`
single-token decode sequences first, then prefill/extend sequences.

    input_ids  | d0 | d1 | p0 p0 p0 p0 p0 | p1 p1 p1 |
    cu_seqlens   0    1    2              7          10

A speculative step verifies `decode_width` tokens of each decoding sequence (its last token and its draft):
each becomes that many consecutive one-token rows, sequence-major, every row with its own seq_len and
state slots. Row j reads the state row j - 1 wrote, so a Mamba layer runs the rows position by position
(the first reads the live slot, the others scratch slots, the last writes the live slot), and attention
sees each row as an ordinary decode row:

    input_ids  | a0 a1 a2 | b0 b1 b2 | p0 p0 ... |     decode_width 3, num_decodes 6

Mixer cores. The parts of a layer that read the step's sequences (a Mamba2 mixer's conv and scan, attention's
KV write and kernel) run through `meta.run_core(fn, cache, *inputs)`; everything else (projections, norms,
MoE) depends only on the token count. Without `cores` that is a plain call. The engine's piecewise CUDA
graphs (engine/runner/mixed_graphs.py) set `cores` to run each core eagerly between captured pieces: a core
must read the step only through its `meta` argument and its tensor inputs (token rows first), and return
one tensor with a row per token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hyserve.kernels.host_index import HostIndex
from hyserve.model.cache_tensors import CacheTensors


@dataclass(frozen=True)
class SnapshotWrite:
    """Copy sequence `seq`'s Mamba state after its first `num_tokens` new tokens into state slot `slot`.

    `num_tokens` must be a multiple of the model's chunk_size or equal the sequence's new-token count,
    because only those states come out of the SSD scan."""

    seq: int
    num_tokens: int
    slot: int


@dataclass
class ForwardMeta:
    num_decodes: int
    cu_seqlens: list[int]  # host copy, [S+1]
    seq_lens: list[int]  # host copy, [S]: tokens in cache after this step (cached + new)
    cu_seqlens_t: torch.Tensor  # [S+1] int32, device
    seq_lens_t: torch.Tensor  # [S] int32, device
    block_tables: torch.Tensor  # [S, max_blocks] int32, device (unused rows/cols are 0)
    slot_mapping: torch.Tensor  # [T] int64: KV write position per new token (block * bs + row), -1 = skip
    state_src: torch.Tensor  # [S] int64: state slot each sequence reads its initial state from
    state_dst: torch.Tensor  # [S] int64: state slot each sequence writes its final state to
    has_initial_state: torch.Tensor  # [S] bool, device; False -> start from zeros (src is ignored)
    logits_indices: torch.Tensor  # [n] int64: tokens whose logits the caller wants
    snapshots: list[SnapshotWrite] = field(default_factory=list)
    decode_width: int = 1  # consecutive decode rows per decoding sequence (speculative verification)
    # whether any prefill sequence starts from a stored state (host knowledge: when none does, a Mamba layer
    # skips gathering initial states and its kernels start from zeros)
    prefill_initial_states: bool = True
    cores: CoreCalls | None = None  # None: mixer cores are plain calls (see the module docstring)

    @functools.cached_property
    def prefill_cu(self) -> HostIndex:
        """The prefill sequences' offsets from the first prefill token ([S - num_decodes + 1]), one object per
        step: the launchers keep the device tensors they derive from it, so a step's layers share them."""
        first = self.cu_seqlens[self.num_decodes]
        return HostIndex(v - first for v in self.cu_seqlens[self.num_decodes :])

    @functools.cached_property
    def step_cu(self) -> HostIndex:
        """`cu_seqlens` as one object per step, for the attention launchers' per-step analysis and device
        copies (every attention layer of the step shares them)."""
        return HostIndex(self.cu_seqlens)

    def run_core(self, fn: CoreFn, cache: CacheTensors, *inputs: torch.Tensor) -> torch.Tensor:
        """fn(self, cache, *inputs): a mixer core (module docstring), called directly or through `cores`."""
        if self.cores is None:
            return fn(self, cache, *inputs)
        return self.cores(fn, self, cache, inputs)


# a mixer core: (meta, cache, *token-row tensors) -> a tensor with a row per token
CoreFn = Callable[..., torch.Tensor]


class CoreCalls(Protocol):
    """How a forward runs its mixer cores (engine/runner/mixed_graphs.py)."""

    def __call__(
        self, fn: CoreFn, meta: ForwardMeta, cache: CacheTensors, inputs: tuple[torch.Tensor, ...]
    ) -> torch.Tensor: ...
