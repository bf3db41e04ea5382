"""The device-side block tables and KV write positions of a step (engine/runner/block_index.py) against
their host loops, on fresh random rows: prefill chunks, decodes, rows that write no KV and rows whose
tables are much shorter than the widest one."""

from __future__ import annotations

import random

import pytest
import torch

from hyserve.engine.runner.block_index import (
    block_tables_ref,
    fill_block_tables,
    slot_mapping,
    slot_mapping_ref,
)


def _rows(rng: random.Random, n: int, bs: int) -> tuple[list[list[int]], list[int], list[int], list[bool]]:
    blocks, lens, starts, writes = [], [], [], []
    for _ in range(n):
        start = rng.choice([0, rng.randrange(0, 5 * bs), rng.randrange(0, 40 * bs)])
        new = rng.choice([1, 1, rng.randrange(1, 3 * bs)])
        write = rng.random() > 0.15
        # a row that writes no KV may sit past its table (a verified draft position)
        covered = start + new if write else max(1, start + new - rng.randrange(0, 2 * bs))
        nb = -(-covered // bs)
        blocks.append(rng.sample(range(10_000), nb))
        lens.append(new)
        starts.append(start)
        writes.append(write)
    return blocks, lens, starts, writes


@pytest.mark.parametrize("seed", range(6))
def test_tables_and_slots_equal_the_host_loops(seed: int) -> None:
    rng = random.Random(seed)
    bs = rng.choice([16, 64])
    blocks, lens, starts, writes = _rows(rng, rng.randrange(1, 40), bs)
    width = max(len(b) for b in blocks)
    tables = torch.zeros(len(blocks), width, dtype=torch.int32)
    fill_block_tables(
        tables,
        torch.tensor([b for r in blocks for b in r], dtype=torch.int64),
        torch.tensor([len(b) for b in blocks], dtype=torch.int64),
    )
    assert tables.tolist() == block_tables_ref(blocks, width)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32)
    got = slot_mapping(tables, cu, torch.tensor(starts), torch.tensor(writes), bs, num_tokens=sum(lens))
    assert got.dtype == torch.int64
    assert got.tolist() == slot_mapping_ref(blocks, lens, starts, writes, bs)


def test_filling_keeps_the_columns_past_each_rows_count() -> None:
    """Decode graphs refill one buffer every step: a row's columns past its table stay as they were."""
    out = torch.full((3, 5), 7, dtype=torch.int32)
    fill_block_tables(out, torch.tensor([1, 2, 3, 4]), torch.tensor([2, 0, 2]))
    assert out.tolist() == [[1, 2, 7, 7, 7], [7, 7, 7, 7, 7], [3, 4, 7, 7, 7]]


def test_empty_steps() -> None:
    out = torch.zeros(2, 3, dtype=torch.int32)
    fill_block_tables(out, torch.empty(0, dtype=torch.int64), torch.zeros(2, dtype=torch.int64))
    assert out.abs().sum() == 0
    got = slot_mapping(out, torch.zeros(1, dtype=torch.int32), torch.empty(0), torch.empty(0), 16, 0)
    assert got.shape == (0,) and got.dtype == torch.int64


@pytest.mark.parametrize("seed", range(4))
def test_step_metadata_is_aligned_and_matches_the_host_loops(seed: int) -> None:
    """`ModelRunner.build_meta` over random decodes and prefill chunks: each per-row tensor starts 16 bytes
    into its buffer (Triton specialises kernels on pointer alignment, so an odd offset would be another
    variant to compile after warm-up), and the tables and slots equal the host loops."""
    from types import SimpleNamespace

    from hyserve.engine.runner.runner import ModelRunner
    from hyserve.engine.sampling_params import SamplingParams
    from hyserve.engine.scheduler.scheduler import ScheduledBatch, ScheduledSeq

    rng = random.Random(seed)
    bs = 16
    cache = SimpleNamespace(tokens_per_block=bs)
    runner = ModelRunner(None, cache, torch.device("cpu"))  # type: ignore[arg-type]
    seqs = []
    decodes = rng.randrange(0, 7)
    for i in range(decodes + rng.randrange(1, 4)):
        start = rng.randrange(0, 200)
        new = 1 if i < decodes else rng.randrange(1, 90)
        nb = -(-(start + new) // bs)
        blocks = rng.sample(range(1000), nb)
        seqs.append(ScheduledSeq(f"r{i}", [5] * new, start, blocks, i, i, True, [], SamplingParams(), 0))
    ids, meta = runner.build_meta(ScheduledBatch(seqs, decodes))
    tensors = [ids, meta.cu_seqlens_t, meta.seq_lens_t, meta.block_tables, meta.slot_mapping]
    tensors += [meta.state_src, meta.state_dst, meta.has_initial_state, meta.logits_indices]
    assert all(t.data_ptr() % 16 == 0 for t in tensors)
    blocks = [s.block_ids for s in seqs]
    lens = [len(s.token_ids) for s in seqs]
    starts = [s.start_pos for s in seqs]
    assert meta.block_tables.tolist() == block_tables_ref(blocks, max(len(b) for b in blocks))
    assert meta.slot_mapping.tolist() == slot_mapping_ref(blocks, lens, starts, [True] * len(seqs), bs)
