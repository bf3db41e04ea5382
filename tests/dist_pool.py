"""A pool of CPU ranks joined in one gloo group over loopback, for tests of the parallel code.

`RankPool(2)` spawns two processes that call `hyserve.distributed.init_distributed` once; `pool.run(fn,
*args)` then runs the module-level function `fn(*args)` on every rank at the same time and returns the
per-rank results. Each rank's collectives are bounded by the group timeout, and each `run` by a deadline
after which the pool is killed and the test fails, so a hung rank costs seconds, not the CI run. One pool
per test module: spawning a rank (importing torch) is most of the cost.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, tp: int, ep: int, timeout_s: float, conn: Connection) -> None:
    import torch

    torch.set_num_threads(1)
    from hyserve.distributed import init_distributed

    try:
        init_distributed(
            tp_size=tp,
            ep_size=ep,
            device="cpu",
            rank=rank,
            world_size=world,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout_s=timeout_s,
        )
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        fn, args = msg
        try:
            conn.send(("ok", fn(*args)))
        except BaseException:
            conn.send(("err", traceback.format_exc()))


@dataclass(frozen=True)
class Outcome:
    """What one rank did with a task: "ok" (value), "err" (traceback text), "dead" or "late"."""

    status: str
    value: Any = None
    seconds: float = 0.0


class RankPool:
    def __init__(
        self,
        world: int = 2,
        *,
        tp_size: int | None = None,
        ep_size: int = 1,
        timeout_s: float = 10.0,
        start_deadline_s: float = 60.0,
    ) -> None:
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world = world
        self.timeout_s = timeout_s
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=_worker,
                args=(r, world, port, tp_size or world, ep_size, timeout_s, child),
                daemon=True,
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        started = self._collect(start_deadline_s)
        bad = [f"rank {r}: {o.status} {o.value or ''}" for r, o in enumerate(started) if o.status != "ok"]
        if bad:
            self.close()
            raise RuntimeError("RankPool did not start:\n" + "\n".join(bad))

    def _collect(self, deadline_s: float) -> list[Outcome]:
        t0 = time.monotonic()
        out: list[Outcome | None] = [None] * self.world
        while any(o is None for o in out):
            left = deadline_s - (time.monotonic() - t0)
            for r, c in enumerate(self.conns):
                if out[r] is not None:
                    continue
                try:
                    if c.poll(0.02):
                        status, value = c.recv()
                        out[r] = Outcome(status, value, time.monotonic() - t0)
                    elif not self.procs[r].is_alive():
                        out[r] = Outcome("dead", self.procs[r].exitcode, time.monotonic() - t0)
                except (EOFError, OSError):
                    out[r] = Outcome("dead", self.procs[r].exitcode, time.monotonic() - t0)
            if left <= 0:
                out = [o if o is not None else Outcome("late", None, deadline_s) for o in out]
        return [o for o in out if o is not None]

    def run_outcomes(self, fn: Callable[..., Any], *args: Any, deadline_s: float = 60.0) -> list[Outcome]:
        """Run fn(*args) on every rank; one Outcome per rank (a rank past the deadline is "late", and then
        the pool is closed, since that rank may still be inside a collective)."""
        for c in self.conns:
            c.send((fn, args))
        outs = self._collect(deadline_s)
        if any(o.status in ("late", "dead") for o in outs):
            self.close()
        return outs

    def run(self, fn: Callable[..., Any], *args: Any, deadline_s: float = 60.0) -> list[Any]:
        """Run fn(*args) on every rank and return the values in rank order; any failure raises with every
        rank's traceback."""
        outs = self.run_outcomes(fn, *args, deadline_s=deadline_s)
        bad = [f"--- rank {r}: {o.status}\n{o.value}" for r, o in enumerate(outs) if o.status != "ok"]
        if bad:
            raise AssertionError(f"{fn.__name__} failed on {len(bad)} rank(s):\n" + "\n".join(bad))
        return [o.value for o in outs]

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join(timeout=2)
        for c in self.conns:
            c.close()
        self.conns, self.procs = [], []
