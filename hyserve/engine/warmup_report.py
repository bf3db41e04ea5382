"""What the warm-up did before ready: the cases it ran, those that failed and why, and the Triton kernel
variants compiled or loaded from the persistent cache (lifecycle/warmup.py fills it; the engine keeps it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class WarmupReport:
    seconds: float = 0.0
    cases: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (case, why)
    compiled: int = 0  # Triton compilations during the warm-up
    loaded: int = 0  # variants served from the persistent cache

    def summary(self) -> str:
        s = (
            f"hyserve: warm-up: {len(self.cases)} cases in {self.seconds:.1f}s; Triton variants before "
            f"ready: {self.compiled} compiled, {self.loaded} loaded from the cache"
        )
        if self.failed:
            s += "; failed: " + "; ".join(f"{c} ({why})" for c, why in self.failed)
        return s
