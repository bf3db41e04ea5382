"""Deterministic random weights (`load_format="dummy"`), keyed by parameter name, for every family: a
family's `InitRules` (its config) says how each of its parameters is drawn.

Kinds: normal (with a std), ones, zeros, and two per-head Mamba parameters: A_log = log(U[1, 16]) and dt_bias
= softplus^-1 of dt log-uniform in [time_step_min, 0.1].
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import torch
from torch import nn

from hyserve.model.weights import _model_tensors, checkpoint_shape, is_shard, scale_weight_name


class InitRules(Protocol):
    """How a family draws its parameters (its config provides these)."""

    @property
    def time_step_min(self) -> float: ...

    def init_rule(self, name: str) -> tuple[str, float]:
        """(kind, std) for a canonical parameter name; kinds: normal, ones, zeros, A_log, dt_bias. An unknown
        name raises ValueError (a new parameter needs a rule)."""
        ...


_CHUNK_ELEMS = 1 << 22  # 4M elements (16 MiB float32) per generated chunk
_DT_MAX = 0.1
_DT_FLOOR = 1e-4


def _seed_for(seed: int, name: str, chunk: int) -> int:
    """A stable 63-bit seed per (seed, parameter, chunk): independent of order, threads and device."""
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _small_init(kind: str, name: str, n: int, cfg: InitRules, seed: int) -> torch.Tensor:
    """Per-head Mamba parameters (tiny, 1-D), computed on CPU in float64 for device-independent results."""
    g = torch.Generator().manual_seed(_seed_for(seed, name, 0))
    u = torch.rand(n, generator=g, dtype=torch.float64)
    if kind == "A_log":
        return torch.log(1.0 + 15.0 * u)  # A in [1, 16]
    lo, hi = math.log(cfg.time_step_min), math.log(max(_DT_MAX, cfg.time_step_min * 1.0001))
    dt = torch.exp(lo + u * (hi - lo)).clamp(min=_DT_FLOOR)
    return dt + torch.log(-torch.expm1(-dt))  # inverse softplus


def _normal_chunk(
    name: str, chunk: int, shape: tuple[int, ...], std: float, seed: int, dtype: torch.dtype, pin: bool
) -> torch.Tensor:
    """One chunk, drawn in float32 and rounded to the destination dtype here (in the worker thread) so the
    host-to-device copy moves fewer bytes; pinned for an asynchronous copy when the destination is a GPU."""
    g = torch.Generator().manual_seed(_seed_for(seed, name, chunk))
    x = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=g)
    if not pin:
        return x if dtype == torch.float32 else x.to(dtype)
    staged = torch.empty(shape, dtype=dtype, pin_memory=True)
    return staged.copy_(x)


def _device_normal_chunk(
    dst: torch.Tensor, name: str, chunk: int, shape: tuple[int, ...], std: float, seed: int
) -> torch.Tensor:
    """One chunk drawn on dst's (CUDA) device by a generator seeded like `_normal_chunk`'s, in float32 (so the
    values do not depend on dst's dtype); deterministic per seed on one kind of GPU, not the host's values."""
    g = torch.Generator(device=dst.device).manual_seed(_seed_for(seed, name, chunk))
    return torch.empty(shape, dtype=torch.float32, device=dst.device).normal_(0.0, std, generator=g)


def init_random_tensors(
    tensors: Mapping[str, torch.Tensor],
    cfg: InitRules,
    *,
    seed: int = 0,
    max_workers: int | None = None,
    on_device: bool = False,
) -> None:
    """Fill canonical-named tensors in place, deterministically by name (see `init_random_weights`).

    Normal draws come from CPU generators seeded per (seed, name, chunk of rows), in a small thread pool, and
    are copied chunk by chunk onto each tensor's device/dtype (through pinned memory for a GPU): at most
    2 x workers chunks of 4M elements are alive at once. The draw is host-bound: ~0.16G parameters/s per
    core, so 10B bf16 parameters took 4.7 s on an H200 host (16 cores) and a 30B model takes ~15 s.
    on_device=True draws the normal chunks of CUDA tensors on their device instead (same chunks and seeds,
    the device's generator: other values than the host draw); CPU tensors are drawn on the host either way.
    """
    jobs: list[tuple[torch.Tensor, int, int, int, str, float]] = []  # (dst, chunk, row0, row1, name, std)
    with torch.no_grad():
        for name, t in tensors.items():
            kind, std = cfg.init_rule(name)
            if kind == "ones":
                t.fill_(1.0)
            elif kind == "zeros":
                t.zero_()
            elif kind in ("A_log", "dt_bias"):
                t.copy_(_small_init(kind, name, t.numel(), cfg, seed).view(t.shape))
            else:
                rows = t.shape[0] if t.dim() else 1
                for c, r0, r1 in _row_chunks(rows, t.numel() // max(rows, 1)):
                    jobs.append((t, c, r0, r1, name, std))
        if on_device:
            for t, c, r0, r1, name, std in [j for j in jobs if j[0].is_cuda]:
                dst = t[r0:r1] if t.dim() else t
                dst.copy_(_device_normal_chunk(t, name, c, tuple(dst.shape), std, seed))
            jobs = [j for j in jobs if not j[0].is_cuda]
        if not jobs:
            return
        specs = [
            (name, c, (r1 - r0, *t.shape[1:]) if t.dim() else (), std, t.dtype, t.is_cuda)
            for t, c, r0, r1, name, std in jobs
        ]
        for (t, _c, r0, r1, _name, _std), chunk in zip(
            jobs, _host_chunks(specs, seed, max_workers), strict=True
        ):
            if t.dim():
                t[r0:r1].copy_(chunk, non_blocking=True)
            else:
                t.copy_(chunk, non_blocking=True)
            del chunk  # the pinned block returns to torch's host cache once its copy has run
        for dev in {t.device for t, *_ in jobs if t.is_cuda}:
            torch.cuda.synchronize(dev)


_ChunkSpec = tuple[str, int, tuple[int, ...], float, torch.dtype, bool]  # name, chunk, shape, std, dtype, pin


def _host_chunks(specs: list[_ChunkSpec], seed: int, max_workers: int | None) -> Iterator[torch.Tensor]:
    """`_normal_chunk` of each spec, in order, drawn by a small thread pool at most 2 x workers chunks ahead
    of the consumer (which copies each chunk where it goes before asking for the next)."""
    workers = max_workers or min(16, os.cpu_count() or 1)
    window = 2 * workers
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hyserve-init") as pool:
        pending: deque[Future[torch.Tensor]] = deque()
        nxt = 0
        for i in range(len(specs)):
            while nxt < len(specs) and nxt < i + window:
                name, c, shape, std, dtype, pin = specs[nxt]
                pending.append(pool.submit(_normal_chunk, name, c, shape, std, seed, dtype, pin))
                nxt += 1
            yield pending.popleft().result()


def _row_chunks(rows: int, per_row: int) -> list[tuple[int, int, int]]:
    """(chunk, first row, end row) of a tensor of `rows` rows of `per_row` elements: whole rows, about
    _CHUNK_ELEMS elements a chunk (the chunk index seeds its draw)."""
    step = max(1, _CHUNK_ELEMS // max(per_row, 1))
    return [(c, r0, min(rows, r0 + step)) for c, r0 in enumerate(range(0, rows, step))]


def _draw_dtype(t: torch.Tensor) -> torch.dtype:
    """What a sharded or FP8 parameter's checkpoint tensor is drawn in: float32 for an e4m3 weight (its loader
    quantises it), else the parameter's dtype."""
    return torch.float32 if t.dtype == torch.float8_e4m3fn else t.dtype


def _stream_rows(
    name: str, t: torch.Tensor, cfg: InitRules, seed: int, max_workers: int | None, on_device: bool
) -> None:
    """Random init of a parameter whose loader takes one dim-0 row at a time (`loads_by_row`: an expert's
    matrix): each chunk of the checkpoint tensor is drawn as `init_random_tensors` draws it (same seeds, so
    the same values) and its rows handed to the loader, instead of drawing the whole tensor on the host first
    (Nemotron 3 Super's expert tensors are 1.4G elements, 5.6 GB in float32, 80 of them). FP8 weights are
    drawn in float32 and quantised by the loader."""
    kind, std = cfg.init_rule(name)
    if kind != "normal":
        raise ValueError(
            f"init_random_weights: {name!r} loads by row but its init rule is {kind!r}, not normal"
        )
    shape = checkpoint_shape(t)
    draw = _draw_dtype(t)
    chunks = _row_chunks(shape[0], math.prod(shape[1:]))
    if on_device and t.is_cuda:
        drawn: Iterable[torch.Tensor] = (
            _device_normal_chunk(t, name, c, (r1 - r0, *shape[1:]), std, seed).to(draw)
            for c, r0, r1 in chunks
        )
    else:
        drawn = _host_chunks(
            [(name, c, (r1 - r0, *shape[1:]), std, draw, t.is_cuda) for c, r0, r1 in chunks],
            seed,
            max_workers,
        )
    with torch.no_grad():
        for (_c, r0, r1), chunk in zip(chunks, drawn, strict=True):
            for r in range(r0, r1):
                t.weight_loader(t, chunk[r - r0], r)  # type: ignore[attr-defined]


def init_random_weights(
    model: nn.Module,
    cfg: InitRules,
    *,
    seed: int = 0,
    max_workers: int | None = None,
    on_device: bool = False,
) -> None:
    """Deterministic random weights for `load_format="dummy"`, the same on every device for a given seed
    (on_device=False, the engine's `dummy_init: host`: drawn on the host; on_device=True, its default, draws
    a CUDA model's normal weights on its GPU, many times faster but other values, the same only on the same
    kind of GPU).

    By name: linear/embedding/expert weights N(0, 0.02), with out_proj/o_proj/down_proj scaled by
    1/sqrt(2 * num_layers) (NemotronH's rescale_prenorm_residual); norms and D ones; A_log = log(U[1, 16]);
    dt_bias = softplus^-1 of dt log-uniform in [time_step_min, 0.1]; conv1d weight N(0, 1/sqrt(kernel)), its
    bias N(0, 0.02); router weight N(0, 0.02); score-correction bias N(0, 0.01) so grouped top-k has no ties;
    other biases zero. Streams chunk by chunk, so a model already allocated on a GPU needs no host copy of
    its weights. Unknown parameter names raise ValueError (a new parameter needs a rule here).
    """
    tensors, _ = _model_tensors(model)
    metas = [n for n, t in tensors.items() if t.is_meta]
    if metas:
        raise ValueError(
            f"init_random_weights: {len(metas)} tensors are on the meta device (e.g. {metas[0]})"
        )
    # an FP8 weight's scales come from its loader, which quantises the float32 draw (model/fp8_weights.py)
    tensors = {n: t for n, t in tensors.items() if not (scale_weight_name(n) and t.dtype == torch.float32)}
    shards = {n: t for n, t in tensors.items() if is_shard(t) or t.dtype == torch.float8_e4m3fn}
    init_random_tensors(
        {n: t for n, t in tensors.items() if n not in shards},
        cfg,
        seed=seed,
        max_workers=max_workers,
        on_device=on_device,
    )
    # a tensor-parallel shard or an FP8 weight: draw the whole tensor (host memory, or the device's with
    # on_device, one at a time) and hand it to its loader, which keeps this rank's rows (quantised, for FP8),
    # so every tp_size runs the same model for a given seed
    for n, t in shards.items():
        if getattr(t, "loads_by_row", False):
            _stream_rows(n, t, cfg, seed, max_workers, on_device)
            continue
        full = torch.empty(checkpoint_shape(t), dtype=_draw_dtype(t), device=t.device if on_device else "cpu")
        init_random_tensors({n: full}, cfg, seed=seed, max_workers=max_workers, on_device=on_device)
        with torch.no_grad():
            t.weight_loader(t, full)  # type: ignore[attr-defined]
        del full
