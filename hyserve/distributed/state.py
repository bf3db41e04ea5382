"""Process-group set-up for tensor and expert parallelism, and the rank layout as plain data.

Layout (TensorRT-LLM's): the world is the tensor-parallel group (`world_size == tp_size`); MoE layers
split that same world into `ep_size` expert shards, each expert tensor-parallel over
`moe_tp_size = tp_size // ep_size` ranks. Rank r has

    tp_rank = r,   ep_rank = r // moe_tp_size,   moe_tp_rank = r % moe_tp_size

so the ranks that share an expert shard are adjacent (one NVLink island on a multi-node launch).

With `tp_size == ep_size == 1` no process group is created at all and every group has size 1: the
collectives are identities and the single-device path pays nothing. NCCL on CUDA, gloo on CPU; every
group carries the timeout after which a collective raises instead of waiting for a lost rank.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from hyserve import envs
from hyserve.config import expert_split_problem

DEVICE_TYPES = ("cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class Group:
    """One communication group as this rank sees it. `pg` is None when `size == 1` (nothing to talk to)."""

    name: str  # "tp", "ep" or "moe_tp"
    rank: int  # this process's rank inside the group
    size: int
    ranks: tuple[int, ...]  # global ranks of the members, in group-rank order
    timeout_s: float
    pg: Any = field(default=None, compare=False, repr=False)  # torch.distributed.ProcessGroup

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size or len(self.ranks) != self.size:
            raise ValueError(f"group {self.name}: rank {self.rank} / size {self.size} / ranks {self.ranks}")


@dataclass(frozen=True, kw_only=True)
class ParallelInfo:
    """Where this process sits in the parallel layout (see the module docstring)."""

    world_size: int
    rank: int
    local_rank: int  # index among the ranks of this host (its GPU on CUDA)
    tp_size: int
    tp_rank: int
    ep_size: int
    ep_rank: int
    moe_tp_size: int
    moe_tp_rank: int
    backend: str | None  # "nccl" / "gloo"; None when world_size == 1 (no process group)
    timeout_s: float

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that schedules, owns the cache bookkeeping and serves HTTP."""
        return self.rank == 0


def _single(name: str, timeout_s: float) -> Group:
    return Group(name=name, rank=0, size=1, ranks=(0,), timeout_s=timeout_s)


@dataclass
class _State:
    info: ParallelInfo
    tp: Group
    ep: Group
    moe_tp: Group
    owns_pg: bool = False  # init_distributed created the default process group (destroy it on teardown)


def _single_state(timeout_s: float) -> _State:
    info = ParallelInfo(
        world_size=1,
        rank=0,
        local_rank=0,
        tp_size=1,
        tp_rank=0,
        ep_size=1,
        ep_rank=0,
        moe_tp_size=1,
        moe_tp_rank=0,
        backend=None,
        timeout_s=timeout_s,
    )
    return _State(
        info=info,
        tp=_single("tp", timeout_s),
        ep=_single("ep", timeout_s),
        moe_tp=_single("moe_tp", timeout_s),
    )


_STATE: _State = _single_state(envs.HYSERVE_DIST_TIMEOUT_S)


def check_world(
    *,
    tp_size: int,
    ep_size: int,
    world_size: int,
    device: str,
    local_world_size: int | None = None,
    visible_gpus: int | None = None,
) -> None:
    """Raise ValueError (every problem, with the numbers and the knob) unless the sizes fit the world.

    `local_world_size`: ranks on this host (default: all of them); `visible_gpus`: CUDA devices this
    process can see (default: torch.cuda.device_count() when device is "cuda").
    """
    problems: list[str] = []
    if device not in DEVICE_TYPES:
        problems.append(f"device {device!r}: expected one of {', '.join(DEVICE_TYPES)}")
    for knob, v in (("tp_size", tp_size), ("ep_size", ep_size), ("world size", world_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            problems.append(f"{knob} must be an integer >= 1, got {v!r}")
    if problems:
        raise ValueError("parallel settings do not fit: " + "; ".join(problems))
    split = expert_split_problem(tp_size, ep_size)
    if split:
        problems.append(split)
    if tp_size != world_size:
        problems.append(
            f"tp_size ({tp_size}) must equal the number of ranks ({world_size}, torchrun's WORLD_SIZE or the "
            f"local launch): one model replica spans every rank (data-parallel replicas are separate servers)"
        )
    local = world_size if local_world_size is None else local_world_size
    if device == "cuda" and world_size > 1:
        gpus = torch.cuda.device_count() if visible_gpus is None else visible_gpus
        if gpus < local:
            problems.append(
                f"{local} ranks on this host need {local} visible GPUs, but {gpus} are visible "
                f"(tp_size {tp_size}; check CUDA_VISIBLE_DEVICES or torchrun's --nproc-per-node)"
            )
    if problems:
        raise ValueError("parallel settings do not fit: " + "; ".join(problems))


def expert_layout(rank: int, tp_size: int, ep_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(global ranks of `rank`'s ep group, of its moe_tp group), as the module docstring lays them out."""
    moe_tp = tp_size // ep_size
    ep_rank, moe_tp_rank = rank // moe_tp, rank % moe_tp
    return (
        tuple(i * moe_tp + moe_tp_rank for i in range(ep_size)),
        tuple(ep_rank * moe_tp + j for j in range(moe_tp)),
    )


def init_distributed(
    *,
    tp_size: int,
    ep_size: int = 1,
    device: str = "cpu",
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float | None = None,
) -> ParallelInfo:
    """Join (or, for one rank, skip) the process group and build the tp / ep / moe_tp groups.

    Rank and world size come from the arguments, else from torchrun (`hyserve.envs.RANK` ...), else this
    is a world of one. `init_method` defaults to torchrun's store ("env://"); a local launch passes
    "tcp://127.0.0.1:PORT". `timeout_s` (default `envs.HYSERVE_DIST_TIMEOUT_S`) bounds every collective.
    Calling it again without `destroy_distributed()` in between raises.
    """
    global _STATE
    if _STATE.info.world_size > 1 or (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "init_distributed: a process group is already set up (call destroy_distributed first)"
        )
    timeout = float(envs.HYSERVE_DIST_TIMEOUT_S if timeout_s is None else timeout_s)
    if not 0.0 < timeout < float("inf"):
        raise ValueError(f"timeout_s must be positive and finite, got {timeout_s}")
    world = world_size if world_size is not None else (envs.WORLD_SIZE or 1)
    me = rank if rank is not None else (envs.RANK or 0)
    local_world = local_world_size if local_world_size is not None else (envs.LOCAL_WORLD_SIZE or world)
    local = local_rank if local_rank is not None else (envs.LOCAL_RANK if envs.LOCAL_RANK is not None else me)
    check_world(
        tp_size=tp_size, ep_size=ep_size, world_size=world, device=device, local_world_size=local_world
    )
    if not 0 <= me < world:
        raise ValueError(f"rank {me} is outside the world of {world} ranks")
    if world == 1:
        _STATE = _single_state(timeout)
        return _STATE.info
    if not dist.is_available():
        raise RuntimeError("this torch build has no torch.distributed; tp_size > 1 needs it")
    backend = "nccl" if device == "cuda" else "gloo"
    td = datetime.timedelta(seconds=timeout)
    kwargs: dict[str, Any] = {}
    if device == "cuda":
        torch.cuda.set_device(local)
        kwargs["device_id"] = torch.device("cuda", local)
    dist.init_process_group(
        backend, init_method=init_method or "env://", world_size=world, rank=me, timeout=td, **kwargs
    )
    all_ranks = list(range(world))
    # every rank creates every group, in the same order (torch.distributed.new_group's contract)
    ep_pgs: dict[tuple[int, ...], Any] = {}
    moe_tp_pgs: dict[tuple[int, ...], Any] = {}
    for r in all_ranks:
        ep_ranks, moe_tp_ranks = expert_layout(r, tp_size, ep_size)
        for ranks, pgs in ((ep_ranks, ep_pgs), (moe_tp_ranks, moe_tp_pgs)):
            if len(ranks) > 1 and ranks not in pgs:
                pgs[ranks] = (
                    dist.group.WORLD if list(ranks) == all_ranks else dist.new_group(list(ranks), timeout=td)
                )
    my_ep, my_moe_tp = expert_layout(me, tp_size, ep_size)

    def group(name: str, ranks: tuple[int, ...], pg: Any) -> Group:
        return Group(name=name, rank=ranks.index(me), size=len(ranks), ranks=ranks, timeout_s=timeout, pg=pg)

    ep = group("ep", my_ep, ep_pgs.get(my_ep))
    moe_tp = group("moe_tp", my_moe_tp, moe_tp_pgs.get(my_moe_tp))
    info = ParallelInfo(
        world_size=world,
        rank=me,
        local_rank=local,
        tp_size=tp_size,
        tp_rank=me,
        ep_size=ep_size,
        ep_rank=ep.rank,
        moe_tp_size=moe_tp.size,
        moe_tp_rank=moe_tp.rank,
        backend=backend,
        timeout_s=timeout,
    )
    _STATE = _State(
        info=info, tp=group("tp", tuple(all_ranks), dist.group.WORLD), ep=ep, moe_tp=moe_tp, owns_pg=True
    )
    return info


def destroy_distributed() -> None:
    """Leave the process group (if init_distributed made one) and return to a world of one."""
    global _STATE
    owned = _STATE.owns_pg
    timeout = _STATE.info.timeout_s
    _STATE = _single_state(timeout)
    if owned and dist.is_initialized():
        dist.destroy_process_group()


def parallel_info() -> ParallelInfo:
    """This process's rank layout (a world of one until init_distributed says otherwise)."""
    return _STATE.info


def tp_group() -> Group:
    """The tensor-parallel group (attention, Mamba, dense MLP, embeddings and lm_head)."""
    return _STATE.tp


def ep_group() -> Group:
    """The ranks that hold different expert shards and the same slice of each expert."""
    return _STATE.ep


def moe_tp_group() -> Group:
    """The ranks that hold the same experts, each a slice of their intermediate dimension."""
    return _STATE.moe_tp
