"""Host-side helpers shared by the Triton/Gluon launchers."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

# Programmatic dependent launch (Hopper and newer): a decode step is a chain of ~300 small kernels, each
# waiting for the one before it. A kernel launched with `launch_pdl=True` may be scheduled while its
# predecessor still runs; it waits in `triton_common.pdl_enter` (griddepcontrol.wait) before it reads anything
# the predecessor wrote or writes anything at all (weights may load earlier), so its launch and block
# scheduling overlap the predecessor's tail instead of following it. On by default; `set_pdl(False)` (the
# engine's HYSERVE_PDL=0) turns it off for every launch after it.
_PDL = {"enabled": True}


def set_pdl(enabled: bool) -> None:
    """Launch the decode-path kernels with programmatic dependent launch (where the GPU has it) or not.
    Takes effect for launches after it: set it before a warm-up, as the variants differ."""
    _PDL["enabled"] = bool(enabled)


def pdl_enabled() -> bool:
    return _PDL["enabled"]


@functools.lru_cache(maxsize=16)
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def hopper_or_newer(device: torch.device) -> bool:
    """Whether `device` is a CUDA device of compute capability 9.0 or newer."""
    if device.type != "cuda":
        return False
    return _sm90_or_newer(device.index if device.index is not None else torch.cuda.current_device())


def pdl_active(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: enabled, and a GPU that has it."""
    return _PDL["enabled"] and hopper_or_newer(device)


def _pdl_on(t: torch.Tensor) -> bool:
    """Whether a kernel over `t` launches with PDL (tests/sm90_compile_check.py says yes for CPU tensors)."""
    return pdl_active(t.device)


def pdl(t: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel that takes `PDL: tl.constexpr` and calls `pdl_enter(PDL)` first: the
    constexpr and the launch attribute always agree (a PDL launch of a kernel that does not wait would race
    its predecessor). The Triton interpreter gets PDL=False and no launch option."""
    if _pdl_on(t):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


def device_index(values: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """An int32 index vector on `device` without a device sync: host lists go through pinned memory and
    an asynchronous copy on the current stream (a plain `torch.tensor(list, device=cuda)` copies from
    pageable memory and waits for the stream to drain, which stalled every eager prefill layer);
    device tensors pass through (cast/contiguous as needed)."""
    if isinstance(values, torch.Tensor):
        assert values.dim() == 1 and not values.dtype.is_floating_point
        if values.device == device and values.dtype == torch.int32 and values.is_contiguous():
            return values
        return values.to(device=device, dtype=torch.int32).contiguous()
    host = torch.tensor(values, dtype=torch.int32)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def tma_tiles_fit(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> bool:
    """Whether a paged pool's key tiles can load as tensor-memory-access boxes of block_n rows (the rule the
    Triton and the Gluon prefill kernels share): every box lies in one block (block_n divides the block size),
    each pool flattens to rows of kv_heads * head_dim (a power-of-two head dim of at least 16 bytes) with
    16-byte aligned base and row stride, the row count fits the descriptor's int32 coordinates, and the
    elements are 16- or 8-bit (float32 boxes of a 128-key tile would not fit shared memory in the pipelined
    stages)."""
    NB, BS, Hkv, Dh = k_cache.shape
    if BS % block_n or Dh & (Dh - 1) or NB * BS >= 2**31 or k_cache.element_size() > 2:
        return False
    if Dh * k_cache.element_size() < 16 or block_n < 16:
        return False
    # (a power-of-two head dim of >= 16 bytes makes the row stride a multiple of 16 bytes)
    return all(
        c.stride() == (BS * Hkv * Dh, Hkv * Dh, Dh, 1) and c.data_ptr() % 16 == 0 for c in (k_cache, v_cache)
    )


def split_kv_count(
    num_seqs: int,
    kv_heads: int,
    max_len: int | None,
    *,
    target_programs: int,
    max_splits: int,
    min_split_tokens: int,
) -> int:
    """Splits per sequence of a split-KV decode kernel (grid: sequences x kv heads x splits): enough programs
    to reach `target_programs`, at most `max_splits`; when the longest context is known (eager steps), no
    more splits than it has `min_split_tokens` pieces."""
    splits = max(1, min(target_programs // max(1, num_seqs * kv_heads), max_splits))
    if max_len is not None:
        splits = min(splits, -(-max(1, max_len) // min_split_tokens))
    return splits


def split_kv_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    lens_t: torch.Tensor,
    cu_t: torch.Tensor,
    po: torch.Tensor,
    plse: torch.Tensor,
    ks: torch.Tensor,
    vs: torch.Tensor,
    splits: int,
    qk_scale: float,
) -> tuple:
    """The positional arguments of a split-KV decode kernel over the decode sequences [0, nd) of a step, in
    the parameter order the decode kernels share (`triton_attention._decode_kernel`,
    `gluon_decode._decode_fp8_kernel`): pointers, then the sequence offset, split count and softmax scale,
    then the strides of q, the caches, the block table and the partial outputs / log-sum-exps."""
    return (
        q,
        k_cache,
        v_cache,
        block_tables,
        lens_t,
        cu_t,
        po,
        plse,
        ks,
        vs,
        0,
        splits,
        qk_scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        po.stride(0),
        po.stride(1),
        po.stride(2),
        plse.stride(0),
        plse.stride(1),
    )


@functools.lru_cache(maxsize=8)
def device_name(index: int | None) -> str:
    """The CUDA device's name (`torch.cuda.get_device_name`), looked up once per index."""
    return torch.cuda.get_device_name(index)


@functools.lru_cache(maxsize=8)
def device_arch(index: int | None) -> str:
    """The chip a tuned-settings file was measured on, as "sm_<major><minor>x<SMs>" ("sm_90x132" for the
    H100 SXM, the H200 and the GH200). GPUs with the same string run the same tiles at the same occupancy;
    they differ in memory bandwidth and size only."""
    props = torch.cuda.get_device_properties(index)
    return f"sm_{props.major}{props.minor}x{props.multi_processor_count}"


def same_arch_names(config_dir: Path, name: str, arch: str) -> tuple[str, ...]:
    """The device names of the other tuned-settings files in config_dir that were measured on a chip of
    this `arch` (their "arch" field), in file-name order: where a GPU's own file lacks an entry, a sibling
    chip's tuned entry is the nearest measured setting."""
    own = device_file(config_dir, name)
    names = []
    for path in sorted(config_dir.glob("*.json")):
        if path == own:
            continue
        doc = json.loads(path.read_text())
        if doc.get("arch") == arch and isinstance(doc.get("device"), str):
            names.append(doc["device"])
    return tuple(names)


def device_file(config_dir: Path, name: str) -> Path:
    """The per-device tuned-settings file for a GPU called `name` in config_dir ("NVIDIA H200" ->
    NVIDIA_H200.json), as the MoE and the GEMV launchers keep them."""
    return config_dir / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".json")


__all__ = [
    "device_arch",
    "device_file",
    "device_index",
    "device_name",
    "hopper_or_newer",
    "pdl",
    "pdl_active",
    "pdl_enabled",
    "same_arch_names",
    "set_pdl",
    "split_kv_args",
    "split_kv_count",
    "tma_tiles_fit",
]
