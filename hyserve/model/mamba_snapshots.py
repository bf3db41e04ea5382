"""`SnapshotPlan`: where a step's Mamba snapshots come from, worked out once per step for every Mamba layer.

A snapshot (prefix caching, `ForwardMeta.snapshots`) stores a sequence's SSM state and conv window after some
of its new tokens: the SSD scan's final state, or the state after one of its chunks, and the conv inputs just
before that point. Every Mamba layer of a step writes the same snapshots, so the plan (which scan rows, which
xbc rows, which slots, which positions) is built on the host once per step and kept on the step's meta; a
layer then writes all of them with a few gathers and one store each, whatever their number (a prompt of 8k
tokens with the default 256-token interval has 32; eight new 1k-token prompts have 32 between them).

A conv window that reaches back past the step's new tokens (a snapshot within the first K - 1 new tokens)
takes columns from the sequence's initial conv state; those few are built one by one (`conv_state_at`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hyserve.kernels.conv1d import conv_state_at
from hyserve.kernels.ssd import SSDOutput, chunk_offsets_for
from hyserve.model.forward_meta import ForwardMeta


@dataclass(frozen=True)
class SnapshotPlan:
    final_seqs: torch.Tensor  # [nf] prefill sequences whose final state a snapshot takes
    chunk_rows: torch.Tensor  # [nc] rows of SSDOutput.chunk_states (snapshots at a chunk boundary)
    slots: torch.Tensor  # [nf + nc] state slots, the final-state snapshots first
    positions: torch.Tensor  # [nf + nc] tokens each snapshot covers (stochastic rounding keys on it)
    window_rows: torch.Tensor  # [nw * width] xbc rows (of the prefill part) of the windows within new tokens
    window_slots: torch.Tensor  # [nw]
    # (prefill sequence, new tokens, slot) of the windows that reach into the initial conv state
    edge: tuple[tuple[int, int, int], ...]
    edge_slots: torch.Tensor  # [len(edge)]

    def states(self, res: SSDOutput) -> torch.Tensor:
        """The snapshots' SSM states [nf + nc, H, P, N] in `slots` order."""
        parts = []
        if len(self.final_seqs):
            parts.append(res.final_states.index_select(0, self.final_seqs))
        if len(self.chunk_rows):
            assert res.chunk_states is not None
            parts.append(res.chunk_states.index_select(0, self.chunk_rows))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def write_convs(
        self, conv_pool: torch.Tensor, xbc: torch.Tensor, cu: list[int], init_conv: torch.Tensor
    ) -> None:
        """Write every snapshot's conv window into conv_pool [slots, D, width]. xbc: the prefill rows' conv
        inputs [T, D]; cu: their offsets; init_conv: the prefill sequences' initial conv states."""
        width = conv_pool.shape[-1]
        nw = len(self.window_slots)
        if nw:
            win = xbc.index_select(0, self.window_rows).view(nw, width, xbc.shape[1]).transpose(1, 2)
            conv_pool[self.window_slots] = win.to(conv_pool.dtype)
        if self.edge:
            convs = [conv_state_at(xbc, cu[s], n, init_conv[s], width) for s, n, _ in self.edge]
            conv_pool[self.edge_slots] = torch.stack(convs).to(conv_pool.dtype)


def snapshot_plan(
    meta: ForwardMeta, chunk_size: int, width: int, device: torch.device, slot_dtype: torch.dtype
) -> SnapshotPlan:
    """The step's plan for layers with this scan chunk size and conv width (built at the first such layer,
    kept on `meta.prefill_cu`). Slots take `slot_dtype` (the final-state store's), positions the dtype of
    `meta.seq_lens_t`, so every store runs one kernel variant."""
    key = ("mamba-snapshots", chunk_size, width, slot_dtype)
    return meta.prefill_cu.on_device(key, device, lambda: _build(meta, chunk_size, width, device, slot_dtype))


def _build(
    meta: ForwardMeta, chunk_size: int, width: int, device: torch.device, slot_dtype: torch.dtype
) -> SnapshotPlan:
    nd = meta.num_decodes
    cu = meta.prefill_cu
    offsets = chunk_offsets_for(cu, chunk_size)
    final: list[tuple[int, int, int]] = []  # (sequence, slot, position)
    chunk: list[tuple[int, int, int]] = []  # (chunk_states row, slot, position)
    window_rows: list[int] = []
    window_slots: list[int] = []
    edge: list[tuple[int, int, int]] = []
    for sw in meta.snapshots:
        if sw.seq < nd:
            continue
        s = sw.seq - nd
        n_new = cu[s + 1] - cu[s]
        pos = meta.seq_lens[sw.seq] - n_new + sw.num_tokens  # tokens the snapshot covers
        if sw.num_tokens == n_new:
            final.append((s, sw.slot, pos))
        elif sw.num_tokens % chunk_size == 0 and 0 < sw.num_tokens < n_new:
            chunk.append((offsets[s] + sw.num_tokens // chunk_size - 1, sw.slot, pos))
        else:
            raise ValueError(
                f"snapshot after {sw.num_tokens} of {n_new} new tokens is not at a chunk boundary "
                f"(chunk_size {chunk_size})"
            )
        if sw.num_tokens >= width:
            end = cu[s] + sw.num_tokens
            window_rows.extend(range(end - width, end))
            window_slots.append(sw.slot)
        else:
            edge.append((s, sw.num_tokens, sw.slot))
    both = final + chunk

    def ids(values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return SnapshotPlan(
        final_seqs=ids([f[0] for f in final]),
        chunk_rows=ids([c[0] for c in chunk]),
        slots=ids([b[1] for b in both], slot_dtype),
        positions=ids([b[2] for b in both], meta.seq_lens_t.dtype),
        window_rows=ids(window_rows),
        window_slots=ids(window_slots, slot_dtype),
        edge=tuple(edge),
        edge_slots=ids([e[2] for e in edge], slot_dtype),
    )
