"""hyserve.distributed: the rank layout, the world checks, and every collective over two gloo ranks on
loopback (docs/architecture.md, "Parallelism"). A lost rank must make the survivor's collective raise
within the group timeout: a rank that exits, and a rank that hangs."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from hyserve.distributed import (
    CollectiveError,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast_object,
    check_world,
    destroy_distributed,
    ep_group,
    init_distributed,
    moe_tp_group,
    parallel_info,
    reduce_scatter,
    tp_group,
)
from hyserve.distributed.state import expert_layout
from tests.dist_pool import RankPool


# ---- one process ---------------------------------------------------------------------------------------
def test_world_of_one_has_no_process_group_and_identity_collectives() -> None:
    info = init_distributed(tp_size=1, ep_size=1, device="cpu", world_size=1, rank=0, timeout_s=5)
    try:
        assert not dist.is_initialized()
        assert (info.world_size, info.tp_size, info.ep_size, info.backend) == (1, 1, 1, None)
        assert parallel_info() == info and info.is_driver
        x = torch.randn(3, 4)
        for g in (tp_group(), ep_group(), moe_tp_group()):
            assert g.size == 1 and g.pg is None
            assert all_reduce(x, g) is x
            assert all_gather(x, g, dim=1) is x
            assert reduce_scatter(x, g) is x
            assert all_to_all(x, g) is x
            obj = {"step": 3}
            assert broadcast_object(obj, g) is obj
            barrier(g)
    finally:
        destroy_distributed()


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        ({"tp_size": 2, "ep_size": 1, "world_size": 4}, ["tp_size (2)", "(4,", "WORLD_SIZE"]),
        ({"tp_size": 4, "ep_size": 3, "world_size": 4}, ["ep_size (3) must divide tp_size (4)"]),
        ({"tp_size": 2, "ep_size": 4, "world_size": 2}, ["ep_size (4) must divide tp_size (2)"]),
        (
            {"tp_size": 4, "ep_size": 1, "world_size": 4, "device": "cuda", "visible_gpus": 2},
            ["4 ranks on this host need 4 visible GPUs, but 2 are visible", "CUDA_VISIBLE_DEVICES"],
        ),
        (
            {
                "tp_size": 8,
                "ep_size": 1,
                "world_size": 8,
                "device": "cuda",
                "local_world_size": 4,
                "visible_gpus": 2,
            },
            ["4 ranks on this host need 4 visible GPUs, but 2"],
        ),
        ({"tp_size": 0, "ep_size": 1, "world_size": 1}, ["tp_size must be an integer >= 1, got 0"]),
        ({"tp_size": 2, "ep_size": 1, "world_size": 2, "device": "tpu"}, ["device 'tpu'"]),
    ],
)
def test_check_world_names_the_numbers(kwargs: dict, needles: list[str]) -> None:
    kwargs = {"device": "cpu", **kwargs}
    with pytest.raises(ValueError) as e:
        check_world(**kwargs)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_check_world_accepts_fitting_layouts() -> None:
    check_world(tp_size=4, ep_size=4, world_size=4, device="cpu")
    check_world(tp_size=4, ep_size=2, world_size=4, device="cuda", local_world_size=2, visible_gpus=2)
    check_world(tp_size=1, ep_size=1, world_size=1, device="cuda", visible_gpus=0)  # one rank: no GPU check


def test_init_refuses_a_rank_outside_the_world() -> None:
    with pytest.raises(ValueError, match="rank 2 is outside the world of 2"):
        init_distributed(tp_size=2, device="cpu", rank=2, world_size=2, init_method="tcp://127.0.0.1:1")


@pytest.mark.parametrize(("tp", "ep"), [(8, 4), (8, 1), (8, 8), (4, 2)])
def test_expert_layout_partitions_the_world(tp: int, ep: int) -> None:
    moe_tp = tp // ep
    eps, moe_tps = set(), set()
    for r in range(tp):
        e, m = expert_layout(r, tp, ep)
        assert len(e) == ep and len(m) == moe_tp and r in e and r in m
        assert set(e) & set(m) == {r}  # the two groups cross at this rank only
        assert list(m) == list(range(m[0], m[0] + moe_tp))  # expert slices on adjacent ranks
        eps.add(e)
        moe_tps.add(m)
    for groups, count in ((eps, moe_tp), (moe_tps, ep)):
        assert len(groups) == count and sorted(r for g in groups for r in g) == list(range(tp))


# ---- two gloo ranks -----------------------------------------------------------------------------------
def _layout() -> tuple:
    i, t, e, m = parallel_info(), tp_group(), ep_group(), moe_tp_group()
    return (
        i.rank,
        i.world_size,
        i.backend,
        i.tp_rank,
        t.size,
        t.ranks,
        e.size,
        m.size,
        m.ranks,
        dist.is_initialized(),
    )


def _collectives() -> dict[str, float]:
    g = tp_group()
    r = g.rank
    errs: dict[str, float] = {}
    gen = torch.Generator().manual_seed(100 + r)
    mine = torch.randn(4, 6, generator=gen, dtype=torch.float64)
    others = [
        torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + k), dtype=torch.float64)
        for k in range(g.size)
    ]
    total = sum(others)

    x = mine.clone()
    assert all_reduce(x, g) is x
    errs["all_reduce"] = (x - total).abs().max().item()
    errs["all_gather0"] = (all_gather(mine, g, dim=0) - torch.cat(others, 0)).abs().max().item()
    errs["all_gather1"] = (all_gather(mine, g, dim=-1) - torch.cat(others, 1)).abs().max().item()
    errs["reduce_scatter0"] = (reduce_scatter(mine, g, dim=0) - total.chunk(g.size, 0)[r]).abs().max().item()
    errs["reduce_scatter1"] = (reduce_scatter(mine, g, dim=1) - total.chunk(g.size, 1)[r]).abs().max().item()
    # equal all_to_all: rank r receives chunk r of every rank's rows, in rank order
    want = torch.cat([o.chunk(g.size, 0)[r] for o in others], 0)
    errs["all_to_all"] = (all_to_all(mine, g) - want).abs().max().item()

    # uneven: rank k sends (k + j + 1) rows to rank j
    def counts(k: int) -> list[int]:
        return [k + j + 1 for j in range(g.size)]

    rows = [torch.arange(sum(counts(k)), dtype=torch.float32)[:, None] * 10 + k for k in range(g.size)]
    got = all_to_all(rows[r], g, send_counts=counts(r), recv_counts=[counts(k)[r] for k in range(g.size)])
    want_u = torch.cat([rows[k].split(counts(k))[r] for k in range(g.size)], 0)
    errs["all_to_all_uneven"] = (
        (got - want_u).abs().max().item() if got.shape == want_u.shape else float("inf")
    )
    # broadcast: a plain-data object made on rank 0 only
    obj = {"step": 7, "ids": [1, 2, 3], "meta": ("a", 1.5)} if r == 0 else None
    got_obj = broadcast_object(obj, g, src=0)
    errs["broadcast_object"] = 0.0 if got_obj == {"step": 7, "ids": [1, 2, 3], "meta": ("a", 1.5)} else 1.0
    barrier(g)
    return errs


def _bad_arguments() -> list[str]:
    g = tp_group()
    msgs = []
    for call in (
        lambda: reduce_scatter(torch.zeros(3, 2), g),
        lambda: all_to_all(torch.zeros(3, 2), g),
        lambda: all_to_all(torch.zeros(4, 2), g, send_counts=[1, 3]),
        lambda: all_to_all(torch.zeros(4, 2), g, send_counts=[1, 2], recv_counts=[2, 2]),
        lambda: broadcast_object(1, g, src=5),
    ):
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    barrier(g)  # the group still works: the checks ran before any rank waited on the other
    return msgs


@pytest.fixture(scope="module")
def pool():
    p = RankPool(2, timeout_s=10.0)
    yield p
    p.close()


def test_two_rank_layout(pool: RankPool) -> None:
    got = pool.run(_layout)
    for r, (rank, world, backend, tp_rank, tps, tp_ranks, eps, mts, mt_ranks, inited) in enumerate(got):
        assert (rank, world, backend, tp_rank, tps, tp_ranks) == (r, 2, "gloo", r, 2, (0, 1))
        assert (eps, mts, mt_ranks, inited) == (1, 2, (0, 1), True)  # ep_size 1: experts whole, moe tp = tp


def test_two_rank_collectives(pool: RankPool) -> None:
    for errs in pool.run(_collectives):
        assert errs and all(v <= 1e-12 for v in errs.values()), errs


def test_bad_collective_arguments_fail_before_waiting(pool: RankPool) -> None:
    for msgs in pool.run(_bad_arguments):
        assert "not a multiple of the tp group size 2" in msgs[0]
        assert "3 rows do not split evenly" in msgs[1]
        assert "give both send_counts and recv_counts" in msgs[2]
        assert "send_counts sum to 3 but x has 4 rows" in msgs[3]
        assert "src 5 is not a rank" in msgs[4]


def _die_or_reduce() -> tuple[str, float]:
    g = tp_group()
    barrier(g)
    if g.rank == 1:
        import os

        os._exit(3)
    t0 = time.monotonic()
    try:
        all_reduce(torch.ones(8), g)
    except CollectiveError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def _hang_or_reduce(hang_s: float) -> tuple[str, float]:
    g = tp_group()
    barrier(g)
    t0 = time.monotonic()
    if g.rank == 1:
        time.sleep(hang_s)  # alive, but never joins the collective
        return "slept", time.monotonic() - t0
    try:
        all_reduce(torch.ones(8), g)
    except CollectiveError as e:
        return str(e), time.monotonic() - t0
    return "no error", time.monotonic() - t0


def test_a_rank_that_exits_makes_the_other_raise() -> None:
    p = RankPool(2, timeout_s=3.0)
    try:
        outs = p.run_outcomes(_die_or_reduce, deadline_s=20)
    finally:
        p.close()
    assert outs[1].status == "dead", outs
    assert outs[0].status == "ok", outs
    msg, seconds = outs[0].value
    assert "all_reduce over the tp group (rank 0 of 2" in msg, msg
    assert seconds < 3.0 + 2.0, seconds


def test_a_rank_that_hangs_makes_the_other_raise_at_the_timeout() -> None:
    p = RankPool(2, timeout_s=1.5)
    try:
        outs = p.run_outcomes(_hang_or_reduce, 3.5, deadline_s=20)
    finally:
        p.close()
    assert outs[0].status == "ok", outs
    msg, seconds = outs[0].value
    assert "all_reduce over the tp group" in msg and "timeout 1.5 s" in msg, msg
    assert 1.0 <= seconds < 3.0, seconds  # the timeout, not the 3.5 s the other rank sleeps


def test_parallel_info_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        parallel_info().rank = 3  # type: ignore[misc]
