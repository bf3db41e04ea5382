"""Cache bookkeeping for hybrid Mamba2 + attention models: pure Python, no CUDA calls.

- :class:`BlockPool`: reference-counted attention-KV blocks with a hash index for prefix caching.
- :class:`StatePool`: Mamba state slots (live, CUDA-graph pad, prefix-cache snapshots).
- :func:`plan_capacity`: exact, validated sizing of both pools from a byte budget.
"""

from hyserve.cache.block_pool import BlockPool, NoFreeBlocks
from hyserve.cache.capacity import CapacityInputs, CapacityPlan, plan_capacity
from hyserve.cache.state_pool import NoFreeSlots, StatePool

__all__ = [
    "BlockPool",
    "CapacityInputs",
    "CapacityPlan",
    "NoFreeBlocks",
    "NoFreeSlots",
    "StatePool",
    "plan_capacity",
]
