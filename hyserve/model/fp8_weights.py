"""FP8 weights in the tensor-parallel linears: conversion, and loaders that read this rank's shard of
an e4m3 weight and its scales, or quantise a 16-bit weight as it loads (`model/quant_config.py` says which
modules and which scale layout).

`convert_linears(model, quant)` runs on the model built on the meta device (nothing allocated yet): each
projection `quant.quantizes` gets an e4m3 `weight` (same local shape) and a float32 `weight_scale`:

    scheme    weight_scale (this rank's)                 in the checkpoint
    tensor    [N_local]  the one scale, per output row   [] (0-d; [1] accepted)
    channel   [N_local]                                  [N] ([N, 1] accepted)
    block     [ceil(N_local/128), ceil(K_local/128)]     [ceil(N/128), ceil(K/128)] (`weight_scale_inv`;
                                                         ModelOpt's [ceil(N/128), 1, ceil(K/128), 1] accepted)

A per-tensor scale is held per output row so one kernel path serves both, and a merged column layer
whose parts carry their own scales needs no special case. Sharding follows the weight: a column-parallel
layer's scales split with its rows (part by part), a row-parallel layer's channel scales are whole on every
rank and its block scales split with the K blocks. Block scales split only along whole blocks: a part
whose share of rows (or a row-parallel share of columns) does not start and end on a 128 boundary is
refused when the model is built, with the numbers.

A 16-bit (or float32) tensor handed to an FP8 weight's loader is quantised on the parameter's device
(`kernels/fp8_linear.quantize_weight_ref`, the same rule as the tests): a column-parallel channel-scaled
layer from its own rows; otherwise from the whole checkpoint tensor, so every tp_size holds the same e4m3
values and scales, then sharded like a pre-quantised checkpoint. That is online quantisation
(`quantization: fp8`) and also how `load_format: dummy` fills an FP8 model: the random init draws each
weight whole in float32 and hands it to the loader.

Routed experts (`convert_experts`): e4m3 `up_proj` [E_local, I_local, d] / `down_proj` [E_local, d, I_local]
with float32 `up_proj_scale` [E_local, I_local] / `down_proj_scale` [E_local, d], one scale per expert and
output row (a ModelOpt per-expert per-tensor scale is held per row); each expert is quantised online from
its whole matrix, so every (ep, tp) split holds the same values. The MoE kernels take channel scales only,
so a block-scaled checkpoint's experts (e4m3 with [ceil(N/128), ceil(K/128)] scales each) are re-quantised
per channel as they load: each expert's matrix is dequantised in float32 once its weight and its scales
have both arrived, in either order, and quantised per output row, which rounds each weight once more to
e4m3 on its row's grid (at most half an e4m3 ulp of the row's scale, on top of the checkpoint's own
rounding). An expert still waiting for its other half when the checkpoint has been read, or block scales for
an expert whose weight came 16-bit, fail the load naming the expert. Up and down projections are FP8 together
or not at all (`QuantConfig.quantizes_experts`). The shared expert is an MLP (FP8 like the other projections),
not folded into the experts op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyserve.distributed import Group
from hyserve.kernels.fp8_linear import BLOCK, E4M3, dequantize_weight_ref, quantize_weight_ref
from hyserve.model.moe import Experts
from hyserve.model.parallel_linear import (
    LinearBase,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    ShardedPart,
    SliceLike,
    load_parts,
    load_whole,
    loaded_shape,
    read_block,
)
from hyserve.model.quant_config import QuantConfig, canonical_module_name

_SAFETENSORS_FP8 = ("F8_E4M3",)
_FLOAT_SOURCES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_SAFETENSORS_FLOATS = ("F16", "BF16", "F32", "F64")


def is_fp8_source(loaded: torch.Tensor | SliceLike) -> bool:
    """True for an e4m3 tensor (or safetensors slice); False for a 16/32/64-bit float one; else ValueError."""
    if isinstance(loaded, torch.Tensor):
        if loaded.dtype == E4M3:
            return True
        if loaded.dtype in _FLOAT_SOURCES:
            return False
        raise ValueError(f"FP8 linear: cannot load a {loaded.dtype} weight (e4m3 or a 16/32-bit float)")
    dt = loaded.get_dtype()
    if dt in _SAFETENSORS_FP8:
        return True
    if dt in _SAFETENSORS_FLOATS:
        return False
    raise ValueError(f"FP8 linear: cannot load a {dt} weight (F8_E4M3 or a 16/32-bit float)")


def _read_all(loaded: torch.Tensor | SliceLike) -> torch.Tensor:
    """The whole tensor (a 0-d safetensors slice reads with `[()]`, others with `[:]`)."""
    if isinstance(loaded, torch.Tensor):
        return loaded
    return torch.as_tensor(loaded[()] if len(loaded_shape(loaded)) == 0 else loaded[:])


def _group(layer: LinearBase) -> Group:
    """The tp group of a column- or row-parallel layer (a replicated one has none)."""
    assert isinstance(layer, MergedColumnParallelLinear | RowParallelLinear), type(layer).__name__
    return layer.group


def _layout(layer: LinearBase) -> tuple[str, tuple[ShardedPart, ...]]:
    """("column", row parts) | ("row", (the column part,)) | ("replicated", ())."""
    if isinstance(layer, MergedColumnParallelLinear):
        return "column", layer.parts
    if isinstance(layer, RowParallelLinear):
        return "row", (layer.part,)
    if isinstance(layer, ReplicatedLinear):
        return "replicated", ()
    raise TypeError(f"FP8 weights: no sharding rule for {type(layer).__name__}")


def _block_problem(parts: tuple[ShardedPart, ...], tp: int, what: str, axis: str) -> str | None:
    """Why the parts' per-rank shares do not fall on whole 128 blocks (for every rank), or None."""
    total = sum(p.size for p in parts)
    local_total = sum(p.local_size(tp) for p in parts)
    for rank in range(tp):
        src_off = dst_off = 0
        for p in parts:
            start, n = p.rows(rank, tp)
            s = src_off + start
            at_end = s + n == total and dst_off + n == local_total
            if s % BLOCK or dst_off % BLOCK or (n % BLOCK and not at_end):
                return (
                    f"{what}: rank {rank}'s share of part {p.name!r} is {axis} [{s}, {s + n}) of {total}, "
                    f"which does not fall on {BLOCK}-{axis} block boundaries: block-scaled FP8 weights split "
                    f"over tp_size {tp} only along whole blocks (use a tp_size that gives each part a "
                    f"multiple of {BLOCK} {axis}, or a per-channel FP8 / 16-bit checkpoint)"
                )
            src_off += p.size
            dst_off += p.local_size(tp)
    return None


def _load_block_parts(
    param: torch.Tensor,
    loaded: torch.Tensor | SliceLike,
    parts: tuple[ShardedPart, ...],
    tp: int,
    rank: int,
    dim: int,
    shard_id: str | None,
    what: str,
) -> None:
    """Block scales: the blocks of this rank's rows (dim 0) or columns (dim 1) of each part, whole blocks only
    (`_block_problem` checked the split when the layer was converted)."""
    full = _read_all(loaded).to(torch.float32)
    selected = [p for p in parts if shard_id is None or p.name == shard_id]
    if not selected:
        raise ValueError(f"{what}: unknown shard_id {shard_id!r}; parts are {[p.name for p in parts]}")
    src_off = dst_off = 0
    for p in parts:
        if p in selected:
            start, n = p.rows(rank, tp)
            if (src_off + start) % BLOCK or dst_off % BLOCK:
                raise ValueError(
                    f"{what}: part {p.name!r} starts at row {src_off + start} (this rank's row "
                    f"{dst_off}), not on a {BLOCK}-row block: its block scales cannot load on their own"
                )
            b0, nb = (src_off + start) // BLOCK, -(-n // BLOCK)
            param.narrow(dim, dst_off // BLOCK, nb).copy_(full.narrow(dim, b0, nb))
            src_off += p.size
        dst_off += p.local_size(tp)


class Fp8Loaders:
    """The loaders of one converted layer's `weight` and `weight_scale`."""

    def __init__(self, layer: LinearBase, quant: QuantConfig, loader_16: Any) -> None:
        self.layer, self.quant, self.loader_16 = layer, quant, loader_16
        self.kind, self.parts = _layout(layer)
        self.what = f"{type(layer).__name__} (FP8)"

    # ---- weight -------------------------------------------------------------------------------
    @torch.no_grad()
    def load_weight(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        if is_fp8_source(loaded):
            self.loader_16(param, loaded, shard_id)  # the layer's own shard copy, byte for byte
            return
        layer = self.layer
        if self.kind == "column" and self.quant.scheme == "channel":
            # each row's scale is its own: quantise this rank's rows only
            tmp = torch.empty(param.shape, dtype=torch.float32, device=param.device)
            self.loader_16(tmp, loaded, shard_id)
            q, scale = quantize_weight_ref(
                tmp if shard_id is None else self._part_rows(tmp, shard_id), "channel"
            )
            self._put_rows(param, q, shard_id)
            self._put_rows(layer.weight_scale, scale, shard_id)
            return
        whole = _read_all(loaded).to(device=param.device)
        q, scale = quantize_weight_ref(whole, self.quant.scheme)
        self.loader_16(param, q, shard_id)
        self.load_scale(layer.weight_scale, scale, shard_id)

    def _part_slice(self, shard_id: str) -> tuple[int, int]:
        off = 0
        tp = _group(self.layer).size
        for p in self.parts:
            if p.name == shard_id:
                return off, p.local_size(tp)
            off += p.local_size(tp)
        raise ValueError(
            f"{self.what}: unknown shard_id {shard_id!r}; parts are {[p.name for p in self.parts]}"
        )

    def _part_rows(self, t: torch.Tensor, shard_id: str) -> torch.Tensor:
        off, n = self._part_slice(shard_id)
        return t.narrow(0, off, n)

    def _put_rows(self, dst: torch.Tensor, src: torch.Tensor, shard_id: str | None) -> None:
        (dst if shard_id is None else self._part_rows(dst, shard_id)).copy_(src)

    # ---- scale --------------------------------------------------------------------------------
    @torch.no_grad()
    def load_scale(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        scheme = self.quant.scheme
        src = _read_all(loaded).to(torch.float32)
        if not torch.isfinite(src).all() or (src <= 0).any():
            raise ValueError(
                f"{self.what}: weight scales must be positive and finite (got min "
                f"{src.min().item():g}, max {src.max().item():g})"
            )
        if scheme == "block":
            self._load_block(param, src, shard_id)
            return
        if scheme == "tensor":
            if src.numel() != 1:
                raise ValueError(
                    f"{self.what}: a per-tensor weight_scale has one element, got shape {list(src.shape)}"
                )
            rows = self._full_rows(shard_id)
            src = src.reshape(()).expand(rows)
        src = src.reshape(-1)
        if self.kind == "column":
            load_parts(param, src, self.parts, _group(self.layer), dim=0, shard_id=shard_id, what=self.what)
        else:
            load_whole(param, src, self.what)

    def _full_rows(self, shard_id: str | None) -> int:
        if self.kind != "column":
            return self.layer.out_features
        return sum(p.size for p in self.parts if shard_id is None or p.name == shard_id)

    def _load_block(self, param: torch.Tensor, src: torch.Tensor, shard_id: str | None) -> None:
        src = _block_grid(src)
        want = tuple(self.layer.weight_scale.checkpoint_shape)  # type: ignore[attr-defined]
        if self.kind == "column" and shard_id is not None:
            part = next((p for p in self.parts if p.name == shard_id), None)
            want = (-(-part.size // BLOCK), want[1]) if part is not None else want
        if tuple(src.shape) != want:
            raise ValueError(
                f"{self.what}: block weight_scale has shape {list(src.shape)}, expected {list(want)}"
            )
        g = None if self.kind == "replicated" else _group(self.layer)
        if g is None or (g.size == 1 and shard_id is None):  # None: replicated
            load_whole(param, src, self.what)
            return
        dim = 0 if self.kind == "column" else 1
        _load_block_parts(param, src, self.parts, g.size, g.rank, dim, shard_id, self.what)


def _block_grid(src: torch.Tensor) -> torch.Tensor:
    """Block scales as their [N/128, K/128] grid: ModelOpt's FP8_PB_WO stores them [N/128, 1, K/128, 1]."""
    return src[:, 0, :, 0] if src.dim() == 4 and src.shape[1] == src.shape[3] == 1 else src


def _scale_shapes(
    local: tuple[int, ...], full: tuple[int, ...], scheme: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local shape, checkpoint shape) of the weight_scale of a weight of those local and full shapes."""
    (n_local, k_local), (n_full, k_full) = local, full
    if scheme == "block":
        return (-(-n_local // BLOCK), -(-k_local // BLOCK)), (-(-n_full // BLOCK), -(-k_full // BLOCK))
    return (n_local,), (() if scheme == "tensor" else (n_full,))


def convert_linear(layer: LinearBase, quant: QuantConfig, name: str = "") -> None:
    """Give `layer` an e4m3 weight and float32 scales (see the module docstring); on the meta device this
    allocates nothing. Raises ValueError when block scales cannot split over this tp group."""
    kind, parts = _layout(layer)
    what = f"{name or type(layer).__name__}"
    tp = 1 if kind == "replicated" else _group(layer).size
    if quant.scheme == "block" and tp > 1:  # one rank loads the whole tensor: any size
        problem = _block_problem(parts, tp, what, "rows" if kind == "column" else "columns")
        if problem:
            raise ValueError(problem)
    old = layer.weight
    ckpt_shape = tuple(old.checkpoint_shape)  # type: ignore[attr-defined]
    loaders = Fp8Loaders(layer, quant, layer.weight_loader)  # type: ignore[attr-defined]
    layer.weight = nn.Parameter(torch.empty(old.shape, dtype=E4M3, device=old.device), requires_grad=False)
    local, ckpt = _scale_shapes(tuple(old.shape), ckpt_shape, quant.scheme)
    layer.weight_scale = nn.Parameter(
        torch.ones(local, dtype=torch.float32, device=old.device), requires_grad=False
    )
    layer.register_shard("weight", loaders.load_weight, ckpt_shape)
    layer.register_shard("weight_scale", loaders.load_scale, ckpt)
    layer._fp8_loaders = loaders  # keeps the bound loaders alive beside the layer
    layer.quant = quant


def convert_linears(model: nn.Module, quant: QuantConfig | None) -> int:
    """Convert every projection `quant` covers (None: nothing); returns how many were converted."""
    if quant is None:
        return 0
    n = 0
    for name, mod in model.named_modules():
        if isinstance(mod, LinearBase) and quant.quantizes(canonical_module_name(name)):
            convert_linear(mod, quant, name)
            n += 1
        elif isinstance(mod, Experts) and convert_experts(mod, quant, name):
            n += 1
    return n


def fp8_layers(model: nn.Module) -> list[tuple[str, LinearBase]]:
    """The converted projections of `model`, by module name."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LinearBase) and m.quant is not None]


def tensor_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of every parameter and buffer this rank holds, tied weights once; of which the FP8 weights
    and their scales)."""
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t.numel() * t.element_size()
    fp8 = sum(t.numel() * t.element_size() for _, m in fp8_layers(model) for t in (m.weight, m.weight_scale))
    return sum(seen.values()), fp8


# ---- routed experts ------------------------------------------------------------------------------------
class Fp8ExpertLoaders:
    """Loaders of a converted `Experts` module's e4m3 `up_proj` / `down_proj` and their float32 channel
    scales `up_proj_scale` [E_local, I_local] / `down_proj_scale` [E_local, d]. `which` is "up" (the
    intermediate dimension is the matrix's rows, dim 0) or "down" (its columns, dim 1). A checkpoint's
    scale is per expert ([] each, [E] stacked: per-tensor) or per expert and channel ([N] each, [E, N])."""

    def __init__(
        self, experts: Any, quant: QuantConfig, which: str, loader_16: Any, name: str = "experts"
    ) -> None:
        self.m, self.quant, self.which, self.loader_16 = experts, quant, which, loader_16
        self.inter_dim = 0 if which == "up" else 1
        self.what = f"{name}.{which}_proj (FP8)"
        # block-scaled checkpoints: checkpoint expert -> {"weight": its whole e4m3 matrix, "block scales":
        # ...}, held until both have arrived (then re-quantised per channel, `_arrive`); experts whose weight
        # came 16-bit (quantised per channel on arrival: block scales for them are an error)
        self.pending: dict[int, dict[str, torch.Tensor]] = {}
        self.from_16_bit: set[int] = set()

    def _scale_param(self) -> torch.Tensor:
        return getattr(self.m, f"{self.which}_proj_scale")

    @torch.no_grad()
    def load_weight(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, expert: int | None = None
    ) -> None:
        block = self.quant.scheme == "block"
        if is_fp8_source(loaded) and not block:
            self.loader_16(param, loaded, expert)
            return
        full = param.checkpoint_shape  # type: ignore[attr-defined]
        want = full if expert is None else full[1:]
        if loaded_shape(loaded) != tuple(want):
            raise ValueError(
                f"experts: checkpoint tensor has shape {list(loaded_shape(loaded))}, expected {list(want)}"
            )
        for e, i in self.m.shard.local(expert):
            # one expert's whole matrix (all of its K): its channel scales are the same at every tp_size
            mat = read_block(loaded, {0: (e, 1)})[0] if expert is None else _read_all(loaded)
            if is_fp8_source(loaded):  # block-scaled e4m3: waits for its scales
                self._arrive(e, i, "weight", mat.to(device=param.device))
                continue
            if block:
                if e in self.pending:  # its block scales came first
                    raise ValueError(
                        f"{self.what}: expert {e} has block scales but a 16-bit weight in the checkpoint"
                    )
                self.from_16_bit.add(e)
            self._put(i, *quantize_weight_ref(mat.to(device=param.device), "channel"))

    def _put(self, i: int, q: torch.Tensor, s: torch.Tensor) -> None:
        """Local expert i's whole-matrix e4m3 codes and channel scales, cut to this rank's rows."""
        rows = (self.m.shard.inter_start, self.m.shard.inter_local)
        param = getattr(self.m, f"{self.which}_proj")
        if self.inter_dim == 0:
            param[i].copy_(q.narrow(0, *rows))
            self._scale_param()[i].copy_(s.narrow(0, *rows))
        else:
            param[i].copy_(q.narrow(1, *rows))
            self._scale_param()[i].copy_(s)

    def _block_scales(self, v: torch.Tensor) -> torch.Tensor:
        """One expert's block scales as [ceil(N/128), ceil(K/128)] (ModelOpt's [.., 1, .., 1] squeezed)."""
        n, k = getattr(self.m, f"{self.which}_proj").checkpoint_shape[1:]
        want = (-(-n // BLOCK), -(-k // BLOCK))
        v = _block_grid(v)
        if tuple(v.shape) != want:
            raise ValueError(
                f"{self.what}: a block-scaled expert's scales have shape {list(v.shape)}, expected "
                f"{list(want)}"
            )
        return v

    def _arrive(self, e: int, i: int, part: str, t: torch.Tensor) -> None:
        """A block-scaled expert's "weight" or "block scales"; with both, re-quantise it per channel."""
        if part == "block scales" and e in self.from_16_bit:
            raise ValueError(
                f"{self.what}: expert {e} has block scales but a 16-bit weight in the checkpoint"
            )
        got = self.pending.setdefault(e, {})
        if part in got:
            raise ValueError(f"{self.what}: expert {e}'s {part} given twice")
        got[part] = t
        if len(got) == 2:
            del self.pending[e]
            w = dequantize_weight_ref(got["weight"], got["block scales"].to(got["weight"].device))
            self._put(i, *quantize_weight_ref(w, "channel"))

    def check_complete(self) -> None:
        """After the checkpoint is read: no block-scaled expert may still wait for its weight or its
        scales."""
        if self.pending:
            waiting = ", ".join(
                f"expert {e} has only its {next(iter(got))}" for e, got in sorted(self.pending.items())
            )
            raise ValueError(
                f"{self.what}: the checkpoint ended with block-scaled experts incomplete: {waiting}"
            )

    @torch.no_grad()
    def load_scale(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, expert: int | None = None
    ) -> None:
        src = _read_all(loaded).to(torch.float32)
        if not torch.isfinite(src).all() or (src <= 0).any():
            raise ValueError(f"{self.what}: weight scales must be positive and finite")
        for e, i in self.m.shard.local(expert):
            v = src[e] if expert is None else src
            if self.quant.scheme == "block":
                self._arrive(e, i, "block scales", self._block_scales(v))
                continue
            if self.quant.scheme == "tensor":
                if v.numel() != 1:
                    raise ValueError(
                        f"{self.what}: a per-tensor expert scale has one element, got {list(v.shape)}"
                    )
                param[i].fill_(float(v.reshape(())))
                continue
            v = v.reshape(-1)
            if self.inter_dim == 0:
                param[i].copy_(v.narrow(0, self.m.shard.inter_start, self.m.shard.inter_local))
            else:
                param[i].copy_(v)


def convert_experts(experts: Any, quant: QuantConfig, name: str = "") -> bool:
    """Give an `Experts` module e4m3 expert weights with per-expert channel scales (per-tensor checkpoint
    scales held per channel, block scales re-quantised per channel as they load); returns whether it
    converted (False where `quant` does not cover the experts)."""
    if not quant.quantizes_experts(name or "experts"):
        return False
    for which in ("up", "down"):
        attr = f"{which}_proj"
        old = getattr(experts, attr)
        ckpt = tuple(old.checkpoint_shape)  # type: ignore[attr-defined]
        loaders = Fp8ExpertLoaders(
            experts, quant, which, getattr(experts, f"_load_{which}"), name or "experts"
        )
        setattr(
            experts,
            attr,
            nn.Parameter(torch.empty(old.shape, dtype=E4M3, device=old.device), requires_grad=False),
        )
        e_local, n_local = old.shape[0], old.shape[1]
        scale = nn.Parameter(
            torch.ones(e_local, n_local, dtype=torch.float32, device=old.device), requires_grad=False
        )
        setattr(experts, f"{attr}_scale", scale)
        experts.register_shard(attr, loaders.load_weight, ckpt, by_row=True)
        scale_ckpt = {
            "tensor": (ckpt[0],),
            "channel": (ckpt[0], ckpt[1]),
            "block": (ckpt[0], -(-ckpt[1] // BLOCK), -(-ckpt[2] // BLOCK)),
        }[quant.scheme]
        experts.register_shard(f"{attr}_scale", loaders.load_scale, scale_ckpt)
        setattr(experts, f"_fp8_{which}", loaders)
    experts.quant = quant
    experts.after_checkpoint_load = lambda: (
        experts._fp8_up.check_complete(),
        experts._fp8_down.check_complete(),
    )
    return True
