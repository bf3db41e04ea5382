"""JIT sentinel: counts Triton compilations that happen after the engine said it was ready.

Every call into Triton's compiler after ready means a kernel variant the warm-up did not cover (a
stall in the middle of serving; docs/architecture.md). Triton reports each one to
`triton.knobs.compilation.listener`, including ones served from its on-disk cache (`cache_hit`),
which still cost a load; both are counted and logged with the kernel name and specialisation.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger("hyserve")


def use_kernel_cache_dir(path: Path) -> Path:
    """Point Triton's kernel cache (and its autotune results) at `path`/triton, so a restart loads
    the compiled variants instead of compiling them again. Returns the directory used."""
    import triton

    d = path.expanduser() / "triton"
    d.mkdir(parents=True, exist_ok=True)
    triton.knobs.cache.dir = str(d)
    triton.knobs.autotuning.cache = True
    return d


@dataclass(frozen=True)
class CompileEvent:
    kernel: str
    specialization: str
    cache_hit: bool
    after_ready: bool


class JitSentinel:
    def __init__(self) -> None:
        self.ready = False
        self.events: list[CompileEvent] = []
        self.compiles_after_ready = 0
        self._reported = 0  # compilations after ready that `unreported_after_ready` already returned
        self._lock = threading.Lock()
        self._previous: Any = None

    def install(self) -> bool:
        """Hook Triton's compilation listener (chaining any existing one). False without triton."""
        try:
            import triton
        except ImportError:
            return False
        knobs = triton.knobs.compilation
        prev = knobs.listener
        owner = getattr(prev, "__self__", None)
        if isinstance(owner, JitSentinel):
            # compilations are process-wide and cannot be told apart per engine: the newest engine's
            # sentinel takes over (an engine that is gone must not count the next one's warm-up)
            prev = owner._previous
        self._previous = prev
        knobs.listener = self.on_compile
        return True

    def mark_ready(self) -> None:
        self.ready = True

    def unreported_after_ready(self) -> list[str]:
        """The kernels compiled after ready since the last call (strict_warmup fails the step on them)."""
        with self._lock:
            if self.compiles_after_ready <= self._reported:
                return []
            new = [ev.kernel for ev in self.events if ev.after_ready][self._reported :]
            self._reported = self.compiles_after_ready
        return new

    def on_compile(
        self, *, src: Any, metadata: dict[str, Any], metadata_group: Any, times: Any, cache_hit: bool
    ) -> None:
        name = str(getattr(getattr(src, "fn", None), "__name__", None) or metadata.get("name", "?"))
        # constants (incl. ints specialised to 1), argument types, and attrs (16-divisible ints/pointers)
        spec = " ".join(str(getattr(src, a, "")) for a in ("constants", "signature", "attrs"))
        ev = CompileEvent(
            kernel=name, specialization=spec.strip(), cache_hit=cache_hit, after_ready=self.ready
        )
        with self._lock:
            self.events.append(ev)
            if self.ready:
                self.compiles_after_ready += 1
        if self.ready:
            logger.warning(
                "JIT after ready: Triton %s kernel %s (%s); warm-up did not cover this variant",
                "loaded" if cache_hit else "compiled",
                name,
                ev.specialization,
            )
        if self._previous is not None:
            self._previous(
                src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit
            )
