"""Tensor-parallel layers (hyserve/model/parallel_linear.py, parallel_embedding.py): each one at tp 2 over
two gloo ranks, float32, against its unsharded torch equivalent, with every shard loaded from a safetensors
file written here; the loaders must read only their rank's rows. Shard arithmetic for larger tp and the
refusals run in this process (docs/architecture.md, "Parallelism")."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from hyserve.distributed import Group, tp_group
from hyserve.model.parallel_embedding import ParallelLMHead, VocabParallelEmbedding, vocab_range
from hyserve.model.parallel_linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardedPart,
)
from tests.dist_pool import RankPool

H, P, G, N = 4, 3, 2, 5  # Mamba-like: heads, head dim, groups, state size
D_IN = 8
VOCAB = 11  # not a multiple of 2: the last rank's block is padded


def _mamba_parts(groups: int) -> list[ShardedPart]:
    return [
        ShardedPart(name="z", units=H, unit_size=P),
        ShardedPart(name="x", units=H, unit_size=P),
        ShardedPart(name="B", units=groups, unit_size=N),
        ShardedPart(name="C", units=groups, unit_size=N),
        ShardedPart(name="dt", units=H),
    ]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    in_proj = sum(p.size for p in _mamba_parts(G))
    in_proj1 = sum(p.size for p in _mamba_parts(1))
    return {
        "col.weight": r(6, D_IN),
        "col.bias": r(6),
        "in_proj.weight": r(in_proj, D_IN),
        "in_proj.bias": r(in_proj),
        "in_proj1.weight": r(in_proj1, D_IN),
        "q.weight": r(4 * P, D_IN),
        "k.weight": r(1 * P, D_IN),
        "v.weight": r(1 * P, D_IN),
        "row.weight": r(5, 4 * P),
        "row.bias": r(5),
        "rep.weight": r(3, D_IN),
        "rep.bias": r(3),
        "embed.weight": r(VOCAB, D_IN),
        "head.weight": r(VOCAB, D_IN),
        "x": r(7, D_IN),
        "x_row": r(7, 4 * P),
    }


class RecordingSlice:
    """A safetensors slice that counts the elements each read returns."""

    def __init__(self, inner: Any, log: list[int]) -> None:
        self.inner, self.log = inner, log

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self.inner[index]
        self.log.append(t.numel())
        return t


def _load(
    f: Any,
    module: torch.nn.Module,
    names: dict[str, str],
    reads: dict[str, int],
    shard_ids: dict[str, str] | None = None,
) -> None:
    """names: param attribute -> checkpoint name; loads through each param's weight_loader."""
    for attr, ck in names.items():
        param = getattr(module, attr)
        log: list[int] = []
        shard = (shard_ids or {}).get(ck)
        param.weight_loader(param, RecordingSlice(f.get_slice(ck), log), shard)
        reads[ck] = reads.get(ck, 0) + sum(log)


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a - b).abs().max().item()


@torch.inference_mode()
def _case_layers(path: str) -> dict[str, Any]:
    g = tp_group()
    r, tp = g.rank, g.size
    errs: dict[str, float] = {}
    reads: dict[str, int] = {}
    numels: dict[str, int] = {}
    with safe_open(path, framework="pt") as f:
        full = {k: f.get_tensor(k) for k in f.keys()}
        x, x_row = full["x"], full["x_row"]

        for gather in (False, True):
            col = ColumnParallelLinear(D_IN, 6, bias=True, gather_output=gather)
            _load(f, col, {"weight": "col.weight", "bias": "col.bias"}, reads)
            want = F.linear(x, full["col.weight"], full["col.bias"])
            errs[f"column gather={gather}"] = _err(col(x), want if gather else want.chunk(tp, -1)[r])
        numels["col.weight"], numels["col.bias"] = 2 * col.weight.numel(), 2 * col.bias.numel()

        # Mamba2 in_proj: [z | x | B | C | dt], every part sharded on its own
        for groups, name, bias in ((G, "in_proj", True), (1, "in_proj1", False)):
            parts = _mamba_parts(groups)
            mp = MergedColumnParallelLinear(D_IN, parts, bias=bias)
            attrs = {"weight": f"{name}.weight"} | ({"bias": f"{name}.bias"} if bias else {})
            _load(f, mp, attrs, reads)
            numels[f"{name}.weight"] = mp.weight.numel()
            if bias:
                numels[f"{name}.bias"] = mp.bias.numel()  # type: ignore[union-attr]
            want = F.linear(x, full[f"{name}.weight"], full.get(f"{name}.bias") if bias else None)
            want_parts = torch.split(want, [p.size for p in parts], dim=-1)
            for p, got, ref in zip(parts, mp.split(mp(x)), want_parts):
                # groups < tp: each rank holds the group its heads read (group r // (tp / groups))
                start, n = (r * p.units // tp, p.units // tp) if p.units % tp == 0 else (r * p.units // tp, 1)
                expect = ref[:, start * p.unit_size : (start + n) * p.unit_size]
                errs[f"{name}.{p.name}"] = _err(got, expect)

        # attention q | k | v from three checkpoint tensors, one KV head replicated on both ranks
        qkv_parts = [
            ShardedPart(name="q", units=4, unit_size=P),
            ShardedPart(name="k", units=1, unit_size=P),
            ShardedPart(name="v", units=1, unit_size=P),
        ]
        qkv = MergedColumnParallelLinear(D_IN, qkv_parts)
        for sid in ("q", "k", "v"):
            log: list[int] = []
            qkv.weight.weight_loader(qkv.weight, RecordingSlice(f.get_slice(f"{sid}.weight"), log), sid)
            reads[f"{sid}.weight"] = sum(log)
        numels |= {"q.weight": 2 * P * D_IN, "k.weight": P * D_IN, "v.weight": P * D_IN}
        q, k, v = qkv.split(qkv(x))
        errs["qkv.q"] = _err(q, F.linear(x, full["q.weight"]).chunk(tp, -1)[r])
        errs["qkv.k"] = _err(k, F.linear(x, full["k.weight"]))
        errs["qkv.v"] = _err(v, F.linear(x, full["v.weight"]))

        row = RowParallelLinear(4 * P, 5, bias=True, unit_size=P)
        _load(f, row, {"weight": "row.weight", "bias": "row.bias"}, reads)
        numels["row.weight"], numels["row.bias"] = row.weight.numel(), row.bias.numel()  # type: ignore[union-attr]
        errs["row"] = _err(row(x_row.chunk(tp, -1)[r]), F.linear(x_row, full["row.weight"], full["row.bias"]))

        rep = ReplicatedLinear(D_IN, 3, bias=True)
        _load(f, rep, {"weight": "rep.weight", "bias": "rep.bias"}, reads)
        numels["rep.weight"], numels["rep.bias"] = 3 * D_IN, 3
        errs["replicated"] = _err(rep(x), F.linear(x, full["rep.weight"], full["rep.bias"]))

        emb = VocabParallelEmbedding(VOCAB, D_IN)
        _load(f, emb, {"weight": "embed.weight"}, reads)
        numels["embed.weight"] = (emb.vocab_end - emb.vocab_start) * D_IN
        ids = torch.tensor([0, 10, 5, 6, 3, 10, 1, 9])  # both blocks, the last real id of the padded one
        errs["embedding"] = _err(emb(ids), F.embedding(ids, full["embed.weight"]))
        errs["embedding padding rows are zero"] = (
            emb.weight[emb.vocab_end - emb.vocab_start :].abs().sum().item()
        )

        head = ParallelLMHead(VOCAB, D_IN)
        _load(f, head, {"weight": "head.weight"}, reads)
        numels["head.weight"] = (head.vocab_end - head.vocab_start) * D_IN
        errs["lm_head"] = _err(head(x), F.linear(x, full["head.weight"]))
    return {"errs": errs, "reads": reads, "numels": numels, "vocab": (emb.vocab_start, emb.vocab_end)}


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, timeout_s=10.0)
    yield p
    p.close()


@pytest.mark.slow
def test_parallel_layers_match_unsharded_torch_at_tp2(pool: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "layers.safetensors"
    save_file(_tensors(), str(path))
    results = pool.run(_case_layers, str(path))
    assert [r["vocab"] for r in results] == [(0, 6), (6, 11)]
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errs"].items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: {bad}"
        assert len(res["errs"]) == 20
        # each loader read exactly its shard's elements from the file, never the whole tensor
        assert res["reads"] == res["numels"], (
            f"rank {rank}: read {res['reads']} vs shard sizes {res['numels']}"
        )


# ---- in one process: shard arithmetic and refusals -----------------------------------------------------
def _group(rank: int, size: int) -> Group:
    return Group(name="tp", rank=rank, size=size, ranks=tuple(range(size)), timeout_s=1.0)


@pytest.mark.parametrize(
    ("units", "tp", "want"),
    [
        (8, 4, [(0, 2), (2, 2), (4, 2), (6, 2)]),  # split
        (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),  # 2 KV heads / groups over 4 ranks: replicated pairs
        (1, 8, [(0, 1)] * 8),  # one Mamba group everywhere
        (8, 1, [(0, 8)]),
    ],
)
def test_sharded_part_rows(units: int, tp: int, want: list[tuple[int, int]]) -> None:
    p = ShardedPart(name="k", units=units, unit_size=16)
    got = [(p.first_unit(r, tp), p.local_units(tp)) for r in range(tp)]
    assert got == want
    assert [p.rows(r, tp) for r in range(tp)] == [(u * 16, n * 16) for u, n in want]


def test_replicated_kv_heads_follow_their_query_heads() -> None:
    """40 query heads / 8 KV heads (Nano 9B's attention) at tp 8 and 16 KV-head groups: rank r's query
    heads read KV head (first query head) // (40 / 8), the one its shard holds."""
    q, kv = ShardedPart(name="q", units=40), ShardedPart(name="k", units=8)
    for tp in (2, 4, 8):
        for r in range(tp):
            assert q.first_unit(r, tp) // 5 == kv.first_unit(r, tp)
    q, kv = ShardedPart(name="q", units=32), ShardedPart(name="k", units=2)  # Super: 2 KV heads
    for tp in (4, 8):
        for r in range(tp):
            heads = range(q.first_unit(r, tp), q.first_unit(r, tp) + q.local_units(tp))
            assert {h // 16 for h in heads} == {kv.first_unit(r, tp)}


def test_loader_shards_for_four_simulated_ranks() -> None:
    w = torch.randn(4 * P + 2 * P + 2 * P, D_IN, dtype=torch.float64)  # q 4 heads, k/v 2 heads
    parts = [
        ShardedPart(name="q", units=4, unit_size=P),
        ShardedPart(name="k", units=2, unit_size=P),
        ShardedPart(name="v", units=2, unit_size=P),
    ]
    q, k, v = w.split([4 * P, 2 * P, 2 * P])
    for r in range(4):
        m = MergedColumnParallelLinear(D_IN, parts, group=_group(r, 4), dtype=torch.float64)
        m.weight.weight_loader(m.weight, w)  # the merged tensor, shard_id None
        kv = r // 2
        want = torch.cat([q[r * P : (r + 1) * P], k[kv * P : (kv + 1) * P], v[kv * P : (kv + 1) * P]])
        assert torch.equal(m.weight.data, want)
        assert m.weight.checkpoint_shape == tuple(w.shape)


@torch.inference_mode()
def test_one_rank_layers_are_the_plain_torch_layers() -> None:
    g1 = _group(0, 1)
    x = torch.randn(5, D_IN)
    w, b = torch.randn(6, D_IN), torch.randn(6)
    for layer in (
        ColumnParallelLinear(D_IN, 6, bias=True, gather_output=True, group=g1),
        RowParallelLinear(D_IN, 6, bias=True, group=g1),
        ReplicatedLinear(D_IN, 6, bias=True),
    ):
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        assert torch.equal(layer(x), F.linear(x, w, b))  # bit-exact: the same call
    emb = VocabParallelEmbedding(VOCAB, D_IN, group=g1)
    e = torch.randn(VOCAB, D_IN)
    emb.weight.weight_loader(emb.weight, e)
    ids = torch.arange(VOCAB)
    assert emb.weight.shape == (VOCAB, D_IN) and torch.equal(emb(ids), F.embedding(ids, e))
    head = ParallelLMHead(VOCAB, D_IN, group=g1)
    head.weight.weight_loader(head.weight, e)
    assert torch.equal(head(x), F.linear(x, e))


def test_vocab_blocks_cover_the_vocabulary() -> None:
    for v, tp in ((11, 2), (131072, 8), (5, 4), (3, 4)):
        blocks = [vocab_range(v, _group(r, tp)) for r in range(tp)]
        assert all(per == -(-v // tp) for *_, per in blocks)
        assert [i for s, e, _ in blocks for i in range(s, e)] == list(range(v))


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda g: ColumnParallelLinear(8, 6, gather_output=True, group=g),
            "6 units do not split over tp_size 4",
        ),
        (lambda g: ColumnParallelLinear(8, 6, unit_size=4, group=g), "not a multiple of unit_size 4"),
        (
            lambda g: RowParallelLinear(6, 8, group=g),
            "in: 6 units do not split over tp_size 4; need a multiple of 4",
        ),
        (
            lambda g: MergedColumnParallelLinear(8, [ShardedPart(name="q", units=6, unit_size=2)], group=g),
            "q: 6 units do not split over tp_size 4; need a multiple of 4 (or a divisor of it, replicated",
        ),
        (
            lambda g: MergedColumnParallelLinear(
                8, [ShardedPart(name="q", units=4), ShardedPart(name="q", units=4)], group=g
            ),
            "distinct names",
        ),
    ],
)
def test_layers_refuse_shapes_that_do_not_split(make: Any, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        make(_group(0, 4))
    assert needle in str(e.value), str(e.value)


def test_loaders_refuse_wrong_checkpoint_shapes() -> None:
    g = _group(1, 2)
    m = MergedColumnParallelLinear(D_IN, _mamba_parts(G), group=g)
    with pytest.raises(ValueError, match=r"checkpoint tensor has shape \[10, 8\], expected \[48, 8\]"):
        m.weight.weight_loader(m.weight, torch.zeros(10, D_IN))
    with pytest.raises(ValueError, match="unknown shard_id 'q'"):
        m.weight.weight_loader(m.weight, torch.zeros(10, D_IN), "q")
    row = RowParallelLinear(4 * P, 5, group=g)
    with pytest.raises(ValueError, match=r"shape \[5, 6\], expected \[5, 12\]"):
        row.weight.weight_loader(row.weight, torch.zeros(5, 6))
    emb = VocabParallelEmbedding(VOCAB, D_IN, group=g)
    with pytest.raises(ValueError, match=r"shape \[12, 8\], expected \[11, 8\]"):
        emb.weight.weight_loader(emb.weight, torch.zeros(12, D_IN))


def test_loaders_survive_meta_build_to_empty_and_casts() -> None:
    """The engine builds on the meta device and moves with to_empty: the parameters are new objects
    afterwards, and must still carry their loader and checkpoint shape."""
    g = _group(1, 2)
    with torch.device("meta"):
        layers = [
            MergedColumnParallelLinear(D_IN, _mamba_parts(G), bias=True, group=g),
            RowParallelLinear(4 * P, 5, bias=True, unit_size=P, group=g),
            ParallelLMHead(VOCAB, D_IN, group=g),
        ]
    for layer in layers:
        before = {n: p.checkpoint_shape for n, p in layer.named_parameters()}
        moved = layer.to_empty(device="cpu").to(torch.float64)
        for n, p in moved.named_parameters():
            assert p.device.type == "cpu" and p.dtype == torch.float64
            assert p.checkpoint_shape == before[n] and callable(p.weight_loader)
    w = torch.randn(5, 4 * P, dtype=torch.float64)
    row = layers[1]
    row.weight.weight_loader(row.weight, w)
    assert torch.equal(row.weight.data, w[:, 2 * P :])
