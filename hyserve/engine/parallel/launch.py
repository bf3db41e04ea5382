"""Starting, joining and watching the ranks of one engine that spans several (docs/architecture.md,
"Parallelism").

    one host   `hyserve serve MODEL --tp_size N` / `LLM(model, tp_size=N)`: rank 0 is this process; ranks
               1 .. N-1 are `python -m hyserve.engine.lifecycle.worker` children (the config pickled on
               their stdin), joined over a loopback TCP rendezvous; on CUDA rank r drives GPU r
    torchrun   `torchrun --nnodes ... -m hyserve.cli serve MODEL --tp_size N` on each node: torchrun's RANK,
               WORLD_SIZE, LOCAL_RANK (hyserve.envs) place each process; rank 0 serves, the others run
               `worker.run_worker` headless; LOCAL_RANK picks the GPU

Gloo on CPU, NCCL on CUDA. The settings are checked against the world and the model before any process
starts, every problem with its numbers. `RankWatch` turns a lost rank into an unhealthy server that exits
non-zero within a bounded time.
"""

from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hyserve import envs
from hyserve.config import EngineConfig
from hyserve.distributed import ParallelInfo, destroy_distributed, init_distributed, parallel_info
from hyserve.engine.runner.model_loader import model_source, resolve_device
from hyserve.model.registry import read_config
from hyserve.model.sharding import check_parallel

WORKER_MODULE = "hyserve.engine.lifecycle.worker"


def launched_by_torchrun() -> bool:
    return envs.WORLD_SIZE is not None


def is_headless_rank() -> bool:
    """A torchrun process other than rank 0: it runs `worker.run_worker`, not the server or `LLM`."""
    return launched_by_torchrun() and (envs.RANK or 0) > 0


def spans_ranks(config: EngineConfig) -> bool:
    """Whether this engine has more than one rank (False: the single-device path, no process group)."""
    p = config.parallel
    return p.tp_size > 1 or p.ep_size > 1 or (envs.WORLD_SIZE or 1) > 1


def check_layout(config: EngineConfig, *, world_size: int, local_world_size: int, device: str) -> None:
    """Raise ValueError unless tp_size / ep_size fit the world, the visible GPUs and the model's heads,
    groups and experts (`model.sharding.check_parallel`). A model directory that is not there is left to
    the loader's error."""
    d = model_source(config).path
    if not (d / "config.json").is_file():
        return
    _family, spec = read_config(d)
    p = config.parallel
    check_parallel(
        spec,
        tp_size=p.tp_size,
        ep_size=p.ep_size,
        world_size=world_size,  # type: ignore[arg-type]
        device=device,
        local_world_size=local_world_size,
    )


def join_group(
    config: EngineConfig,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
) -> ParallelInfo:
    """Check the layout and join the process group: as `rank` of a local launch over `init_method`, or as
    torchrun placed this process (both None)."""
    device = resolve_device(config.device).type
    p = config.parallel
    local = init_method is not None
    if local:
        if rank is None or world_size is None:
            raise ValueError("join_group: a local launch (init_method) names the rank and the world size")
        world, local_world = world_size, world_size
    else:
        world = envs.WORLD_SIZE or 1
        local_world = envs.LOCAL_WORLD_SIZE or world
    check_layout(config, world_size=world, local_world_size=local_world, device=device)
    info = init_distributed(
        tp_size=p.tp_size,
        ep_size=p.ep_size,
        device=device,
        rank=rank,
        world_size=world if local else None,
        local_rank=rank if local else None,
        local_world_size=local_world if local else None,
        init_method=init_method,
    )
    if device == "cpu" and torch.get_num_threads() > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // info.world_size))  # the ranks share the cores
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Ranks:
    """The ranks rank 0 started on this host (none under torchrun), and the group's teardown."""

    def __init__(self, procs: list[subprocess.Popen[bytes]]) -> None:
        self.procs = procs
        self._closed = False
        atexit.register(self.close, timeout_s=2.0)

    def lost(self) -> str | None:
        """Why a local rank is gone (it exited), or None."""
        for r, p in enumerate(self.procs, 1):
            rc = p.poll()
            if rc is not None:
                return f"rank {r} (pid {p.pid}) exited with status {rc}"
        return None

    def close(self, timeout_s: float = 10.0, *, leave_group: bool = True) -> None:
        """Wait up to `timeout_s` for the local ranks to exit (they were told to), kill any still running,
        leave the group (so this process can form another)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if leave_group:
            destroy_distributed()


def start_ranks(config: EngineConfig, log: Callable[[str], None]) -> Ranks | None:
    """Rank 0's side of start-up: join torchrun's world, or start the local ranks and join them. None for
    an engine of one rank (nothing happens)."""
    here = parallel_info()
    if here.world_size > 1:  # the model's layers would take that group's shards
        raise RuntimeError(
            f"this process is already rank {here.rank} of an engine over {here.world_size} ranks: close() it "
            "before building another engine here"
        )
    if not spans_ranks(config):
        return None
    if launched_by_torchrun():
        if is_headless_rank():
            raise RuntimeError(
                f"this is rank {envs.RANK} of a torchrun launch: ranks > 0 run headless "
                "(hyserve.engine.lifecycle.worker.run_worker; `hyserve serve` does this itself), only rank 0 "
                "builds the engine"
            )
        info = join_group(config)
        log(
            f"hyserve: rank 0 of {info.world_size} (torchrun; {info.backend}), tp_size {info.tp_size}, "
            f"ep_size {info.ep_size}"
        )
        return Ranks([])
    tp = config.parallel.tp_size
    device = resolve_device(config.device).type
    check_layout(config, world_size=tp, local_world_size=tp, device=device)  # before starting anything
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])  # the directory holding the hyserve package
    env["PYTHONPATH"] = os.pathsep.join([src, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    payload = pickle.dumps(config)
    procs: list[subprocess.Popen[bytes]] = []
    for r in range(1, tp):
        cmd = [
            sys.executable,
            "-m",
            WORKER_MODULE,
            "--rank",
            str(r),
            "--world-size",
            str(tp),
            "--init-method",
            init,
        ]
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
        assert p.stdin is not None
        p.stdin.write(payload)
        p.stdin.close()
        procs.append(p)
        log(f"hyserve: started rank {r} of {tp} (pid {p.pid})")
    ranks = Ranks(procs)
    try:
        info = join_group(config, rank=0, world_size=tp, init_method=init)
    except BaseException as e:
        why = ranks.lost()
        ranks.close(timeout_s=0.0, leave_group=False)
        if why is not None:
            raise RuntimeError(f"the ranks did not join ({why}; see its output above): {e}") from e
        raise
    log(f"hyserve: {tp} ranks on this host ({info.backend}), tp_size {info.tp_size}, ep_size {info.ep_size}")
    return ranks


class RankWatch:
    """For the server: polls `probe` (a reason the ranks are lost, or None); on the first reason it calls
    `on_fatal(reason)` (mark unhealthy, stop serving) and, should the process still be alive
    `exit_after_s` later (an engine thread stuck in a collective), exits it with status 1."""

    def __init__(
        self,
        probe: Callable[[], str | None],
        on_fatal: Callable[[str], None],
        *,
        poll_s: float = 0.2,
        exit_after_s: float = 25.0,
        log: Callable[[str], None] = print,
    ) -> None:
        self.probe = probe
        self.on_fatal = on_fatal
        self.poll_s = poll_s
        self.exit_after_s = exit_after_s
        self.log = log
        self.reason: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyserve-rank-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            reason = self.probe()
            if reason is None:
                continue
            self.reason = reason
            self.log(f"hyserve: fatal: {reason}; stopping (exit status 1)")
            self.on_fatal(reason)
            time.sleep(self.exit_after_s)  # the process normally ends before this
            self.log("hyserve: the server did not stop in time after losing a rank; exiting now")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def stop(self) -> None:
        """Shutting down: no more polling (the ranks are about to exit on purpose). Once a rank was lost
        the exit deadline stands."""
        self._stop.set()


def watch_server(
    async_engine: Any, stop_server: Callable[[], None], log: Callable[[str], None]
) -> RankWatch | None:
    """`hyserve serve`: a RankWatch over an AsyncEngine whose engine spans ranks (None otherwise). A lost
    rank, a broken group or a dead engine loop marks the engine unhealthy and stops the server."""
    engine = getattr(async_engine, "engine", None)  # None: the engine runs in its own process, watched there
    health = getattr(getattr(engine, "runner", None), "health", None)
    if health is None:
        return None

    def probe() -> str | None:
        if not async_engine.healthy:
            return str(async_engine.dead_reason or "the engine loop stopped")
        return health()

    def on_fatal(reason: str) -> None:
        if async_engine.healthy:
            async_engine.dead_reason = reason
            async_engine.healthy = False
        stop_server()

    return RankWatch(probe, on_fatal, log=log)
