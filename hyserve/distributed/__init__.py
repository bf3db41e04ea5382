"""Tensor / expert parallelism on torch.distributed: the rank layout and groups (`state`) and the
collectives over them (`collectives`). Model code asks here for its group and calls these functions;
it never reads environment variables or creates groups itself (docs/architecture.md)."""

from hyserve.distributed.collectives import (
    CollectiveError,
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast_object,
    reduce_scatter,
)
from hyserve.distributed.state import (
    Group,
    ParallelInfo,
    check_world,
    destroy_distributed,
    ep_group,
    init_distributed,
    moe_tp_group,
    parallel_info,
    tp_group,
)

__all__ = [
    "CollectiveError",
    "Group",
    "ParallelInfo",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast_object",
    "check_world",
    "destroy_distributed",
    "ep_group",
    "init_distributed",
    "moe_tp_group",
    "parallel_info",
    "reduce_scatter",
    "tp_group",
]
