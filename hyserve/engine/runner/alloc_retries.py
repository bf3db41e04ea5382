"""torch's count of CUDA allocations that failed, freed the caching allocator's blocks and retried: each one
synchronises the device, a sign the activation headroom is too small (`LLMEngine.stats`)."""

from __future__ import annotations

import time

import torch


class AllocRetries:
    """The retries on one device since `reset`, read from `torch.cuda.memory_stats` at most once a second
    (it builds a large dict)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._base = 0
        self._read: tuple[float, int] = (0.0, 0)  # (when read, num_alloc_retries)

    def reset(self) -> None:
        """Count from now on."""
        self._base = self._count(max_age=0.0)

    def since_reset(self) -> int:
        return self._count() - self._base

    def _count(self, max_age: float = 1.0) -> int:
        now = time.monotonic()
        if now - self._read[0] >= max_age:
            self._read = (now, int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)))
        return self._read[1]
