"""Checkpoint I/O and random init for NemotronH models, keyed by hyserve's canonical parameter names.

Canonical names are the module tree of `hyserve.model.nemotron_h` (`backbone.layers.{i}.mixer...`,
`lm_head.weight`), with routed experts stacked into 3-D parameters. Checkpoints on the Hub differ:

    checkpoint name                                      canonical name
    backbone.X / model.X                           ->    backbone.X
    ...mixer.experts.{e}.up_proj.weight   [I, d]   ->    ...mixer.experts.up_proj[e]    of [E, I, d]
    ...mixer.experts.{e}.down_proj.weight [d, I]   ->    ...mixer.experts.down_proj[e]  of [E, d, I]
    mtp.*                                          ->    ignored (hyserve does not run MTP layers)

FP8 checkpoints (model/quant_config.py, model/fp8_weights.py) add, per projection:

    X.weight (F8_E4M3), X.weight_scale             ->    X.weight, X.weight_scale (float32)
    X.weight_scale_inv (block-scaled format)       ->    X.weight_scale
    ...experts.{e}.up_proj.weight_scale            ->    ...experts.up_proj_scale[e]
    X.input_scale (ModelOpt static activation)     ->    ignored: activations are scaled per token

A scale is required only where the checkpoint's weight is e4m3; a 16-bit weight for an FP8 parameter is
quantised by its loader (online quantisation), and an e4m3 tensor for a 16-bit parameter is an error.

Loading validates everything from the safetensors headers first (names, shapes, expert indices), so a
bad checkpoint raises one `ValueError` listing all problems before any parameter is touched, and then
streams one tensor at a time so a multi-shard checkpoint never sits in host memory at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA, LAYER_MLP, LAYER_MOE, HybridModelConfig
from hyserve.model.quant_config import fp8_scale_count

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 10

_PER_EXPERT_RE = re.compile(r"^(backbone\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_STACKED_EXPERT_RE = re.compile(r"^(backbone\.layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)$")
# Router tensors stay float32 whatever the model dtype: top-k routing is sensitive to rounding; so do the
# dequantisation scales of FP8 weights (model/fp8_weights.py).
_FP32_SUFFIXES = (
    "mixer.gate.weight",
    "mixer.gate.e_score_correction_bias",
    ".weight_scale",
    "experts.up_proj_scale",
    "experts.down_proj_scale",
)
_SCALE = ".weight_scale"
# per-expert scales of FP8 experts: ...experts.{e}.up_proj.weight_scale -> ...experts.up_proj_scale[e]
_PER_EXPERT_SCALE_RE = re.compile(
    r"^(backbone\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight_scale$"
)
_PER_EXPERT_INPUT_SCALE_RE = re.compile(
    r"^backbone\.layers\.\d+\.mixer\.experts\.\d+\.(up_proj|down_proj)\.input_scale$"
)
# ModelOpt's static activation scales: read past (the FP8 kernels scale activations per token)
_INPUT_SCALE = ".input_scale"
_FP8_DTYPES = ("F8_E4M3",)


# ---- names and shapes --------------------------------------------------------------------------------------
def canonical_name(ckpt_name: str) -> tuple[str, int | None] | None:
    """Map a checkpoint tensor name to (canonical name, expert index or None); None for ignored (MTP) names.

    Names that are neither `backbone.*`, `model.*`, `lm_head.*` nor MTP come back unchanged, so the caller
    reports them as unexpected with the name the user sees in the file.
    """
    if ckpt_name.startswith("model."):
        ckpt_name = "backbone." + ckpt_name[len("model.") :]
    if ckpt_name.startswith(("mtp.", "backbone.mtp.")):
        return None
    if ckpt_name.endswith(".weight_scale_inv"):  # the block-scaled format's name for the same multiplier
        ckpt_name = ckpt_name.removesuffix("_inv")
    m = _PER_EXPERT_RE.match(ckpt_name) or _PER_EXPERT_SCALE_RE.match(ckpt_name)
    if m:
        scale = "_scale" if ckpt_name.endswith(_SCALE) else ""
        return f"{m.group(1)}.{m.group(3)}{scale}", int(m.group(2))
    return ckpt_name, None


def scale_weight_name(name: str) -> str | None:
    """The FP8 weight a canonical scale name belongs to (`x.weight_scale` -> `x.weight`,
    `experts.up_proj_scale` -> `experts.up_proj`), or None for any other name."""
    if name.endswith(_SCALE):
        return name.removesuffix("_scale")
    if name.endswith(("experts.up_proj_scale", "experts.down_proj_scale")):
        return name.removesuffix("_scale")
    return None


def keeps_fp32(name: str) -> bool:
    """True for parameters that stay float32 in the model whatever its dtype (the MoE router)."""
    return name.endswith(_FP32_SUFFIXES)


def canonical_shapes(cfg: HybridModelConfig) -> dict[str, tuple[int, ...]]:
    """Every canonical parameter of a model built from `cfg`, in module order, with its shape.

    The same table the model class produces; it lets tools (make-tiny, tests) build state dicts without
    instantiating the model.
    """
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"backbone.embeddings.weight": (v, h)}

    def linear(prefix: str, out_f: int, in_f: int, bias: bool) -> None:
        shapes[f"{prefix}.weight"] = (out_f, in_f)
        if bias:
            shapes[f"{prefix}.bias"] = (out_f,)

    for i, kind in enumerate(cfg.layer_types):
        p = f"backbone.layers.{i}"
        m = f"{p}.mixer"
        if kind == LAYER_MAMBA:
            nh, inner = cfg.mamba_num_heads, cfg.mamba_intermediate_size
            linear(f"{m}.in_proj", cfg.in_proj_size, h, cfg.mamba_proj_bias)
            shapes[f"{m}.conv1d.weight"] = (cfg.conv_dim, 1, cfg.conv_kernel)
            if cfg.use_conv_bias:
                shapes[f"{m}.conv1d.bias"] = (cfg.conv_dim,)
            shapes[f"{m}.dt_bias"] = (nh,)
            shapes[f"{m}.A_log"] = (nh,)
            shapes[f"{m}.D"] = (nh,)
            shapes[f"{m}.norm.weight"] = (inner,)
            linear(f"{m}.out_proj", h, inner, cfg.mamba_proj_bias)
        elif kind == LAYER_ATTENTION:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            linear(f"{m}.q_proj", q, h, cfg.attention_bias)
            linear(f"{m}.k_proj", kv, h, cfg.attention_bias)
            linear(f"{m}.v_proj", kv, h, cfg.attention_bias)
            linear(f"{m}.o_proj", h, q, cfg.attention_bias)
        elif kind == LAYER_MLP:
            linear(f"{m}.up_proj", cfg.intermediate_size, h, cfg.mlp_bias)
            linear(f"{m}.down_proj", h, cfg.intermediate_size, cfg.mlp_bias)
        elif kind == LAYER_MOE:
            e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
            d = cfg.moe_latent_size or h
            shapes[f"{m}.gate.weight"] = (e, h)
            shapes[f"{m}.gate.e_score_correction_bias"] = (e,)
            shapes[f"{m}.experts.up_proj"] = (e, inter, d)
            shapes[f"{m}.experts.down_proj"] = (e, d, inter)
            s = cfg.moe_shared_expert_intermediate_size
            linear(f"{m}.shared_experts.up_proj", s, h, cfg.mlp_bias)
            linear(f"{m}.shared_experts.down_proj", h, s, cfg.mlp_bias)
            if cfg.moe_latent_size is not None:
                linear(f"{m}.fc1_latent_proj", cfg.moe_latent_size, h, cfg.mlp_bias)
                linear(f"{m}.fc2_latent_proj", h, cfg.moe_latent_size, cfg.mlp_bias)
        else:  # pragma: no cover - config validation rejects other kinds
            raise ValueError(f"layer {i}: unknown layer type {kind!r}")
        shapes[f"{p}.norm.weight"] = (h,)
    shapes["backbone.norm_f.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def weight_bytes(cfg: HybridModelConfig, dtype: torch.dtype | None = None) -> int:
    """Bytes of every weight at tp_size 1, in `dtype` (default cfg.dtype; the router and scales float32),
    the projections `cfg.quant` covers at 1 byte a weight plus their float32 scales."""
    size = (dtype or cfg.dtype).itemsize
    total = 0
    for name, shape in canonical_shapes(cfg).items():
        n = math.prod(shape)
        stem = name.removesuffix(".weight")
        expert = _STACKED_EXPERT_RE.match(name)
        if cfg.quant is not None and expert and cfg.quant.quantizes_experts(expert.group(1)):
            total += n + 4 * shape[0] * shape[1]  # FP8 experts: a channel scale per expert and row
        elif cfg.quant is not None and name.endswith(".weight") and cfg.quant.quantizes(stem):
            total += n + 4 * fp8_scale_count(cfg.quant.scheme, shape)
        else:
            total += n * (4 if keeps_fp32(name) else size)
    return total


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(unique state-dict tensors by name, alias name -> name it shares storage with).

    Tied weights (lm_head sharing the embedding) appear twice in `state_dict`; the second name is an alias
    that is neither required from a checkpoint nor written to one.
    """
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[int, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:
            aliases[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        tensors[name] = t
    return tensors, aliases


def _fmt_list(items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    more = len(items) - len(shown)
    lines = "".join(f"\n    {s}" for s in shown)
    return lines + (f"\n    ... and {more} more" if more else "")


# ---- locating the files ----------------------------------------------------------------------------------
def checkpoint_files(model_dir: str | Path) -> dict[Path, list[str] | None]:
    """Safetensors files of a checkpoint -> the tensor names to take from each (None: all of them).

    Order of preference (as transformers): `model.safetensors`, then `model.safetensors.index.json`, then any
    `*.safetensors` in the directory.
    """
    d = Path(model_dir)
    if not d.is_dir():
        raise ValueError(f"checkpoint directory {d} does not exist")
    single = d / SINGLE_FILE
    if single.is_file():
        return {single: None}
    index = d / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index}: not a valid safetensors index (needs a 'weight_map' object): {e}"
            ) from e
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name, fname in weight_map.items():
            by_file[d / fname].append(name)
        missing = sorted(str(p.name) for p in by_file if not p.is_file())
        if missing:
            raise ValueError(
                f"{index} points at {len(missing)} shard file(s) that do not exist in "
                f"{d}:{_fmt_list(missing)}"
            )
        return dict(sorted(by_file.items()))
    others = sorted(d.glob("*.safetensors"))
    if others:
        return {p: None for p in others}
    present = sorted(p.name for p in d.iterdir())
    has = (
        "only config.json"
        if present == ["config.json"]
        else f"{len(present)} file(s): {', '.join(present[:10])}"
    )
    raise ValueError(
        f"{d} holds no safetensors weights ({has}); to run this architecture with random weights use "
        f'load_format="dummy" (--load-format dummy)'
    )


# ---- loading -----------------------------------------------------------------------------------------------
# A tensor-parallel parameter (hyserve/model/parallel_linear.py) carries `weight_loader(param, loaded)`,
# which copies its own rows of a safetensors slice, and `checkpoint_shape`, the full shape the
# checkpoint holds; any other parameter is copied whole and has its own shape in the checkpoint.
_SHARD_ATTRS = ("weight_loader", "checkpoint_shape", "loads_by_row")


def checkpoint_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape `t` has in a checkpoint (bigger than `t` for a tensor-parallel shard)."""
    shape = getattr(t, "checkpoint_shape", None)  # () for a per-tensor FP8 scale
    return tuple(t.shape if shape is None else shape)


def is_shard(t: torch.Tensor) -> bool:
    """True when `t` holds only part of its checkpoint tensor (this rank's shard)."""
    return checkpoint_shape(t) != tuple(t.shape)


def _carry_shard_info(old: torch.Tensor, new: torch.Tensor) -> None:
    for a in _SHARD_ATTRS:
        if hasattr(old, a):
            setattr(new, a, getattr(old, a))


@dataclass
class _Plan:
    """What to copy from where, built from file headers only."""

    # (file, checkpoint name, canonical name, expert index or None)
    copies: list[tuple[Path, str, str, int | None]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_errors: list[str] = field(default_factory=list)
    missing_experts: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    not_in_shard: list[str] = field(default_factory=list)
    fp8_mismatch: list[str] = field(default_factory=list)
    fp8_weights: set[str] = field(default_factory=set)  # canonical weights the checkpoint holds in e4m3

    def error(self, model_dir: Path) -> str | None:
        parts = []
        for title, items in (
            ("missing tensors", self.missing),
            ("unexpected tensors", self.unexpected),
            ("shape mismatches (name: expected, got)", self.shape_errors),
            ("missing expert indices", self.missing_experts),
            ("tensors given more than once", self.duplicates),
            ("index.json entries absent from their shard", self.not_in_shard),
            (
                "float8 tensors for 16-bit parameters (not covered by the checkpoint's quantization config)",
                self.fp8_mismatch,
            ),
        ):
            if items:
                parts.append(f"  {title} ({len(items)}):{_fmt_list(items)}")
        if not parts:
            return None
        return f"checkpoint {model_dir} does not match the model:\n" + "\n".join(parts)


def _plan_load(model_dir: Path, targets: Mapping[str, torch.Tensor], aliases: Mapping[str, str]) -> _Plan:
    plan = _Plan()
    whole: dict[str, str] = {}  # canonical name -> checkpoint name it came from
    experts: dict[str, dict[int, str]] = defaultdict(dict)
    for path, names in checkpoint_files(model_dir).items():
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            wanted = sorted(keys) if names is None else names
            for ck in wanted:
                if ck not in keys:
                    plan.not_in_shard.append(f"{ck} (shard {path.name})")
                    continue
                mapped = canonical_name(ck)
                if mapped is None:
                    logger.debug("ignoring MTP tensor %s (hyserve does not run MTP layers)", ck)
                    continue
                name, expert = mapped
                if name in aliases or (name == "lm_head.weight" and name not in targets):
                    logger.debug("ignoring %s: the model ties it to the input embedding", ck)
                    continue
                if name.endswith(_INPUT_SCALE) and (
                    name.removesuffix(_INPUT_SCALE) + ".weight" in targets
                    or _PER_EXPERT_INPUT_SCALE_RE.match(name)
                ):
                    logger.debug("ignoring %s: activations are scaled per token, dynamically", ck)
                    continue
                target = targets.get(name)
                if target is None:
                    plan.unexpected.append(ck)
                    continue
                if not _fp8_fits(plan, f.get_slice(ck).get_dtype(), name, ck, target):
                    continue
                got = tuple(f.get_slice(ck).get_shape())
                if expert is None:
                    expected = checkpoint_shape(target)
                    if name in whole or name in experts:
                        plan.duplicates.append(ck)
                        continue
                    whole[name] = ck
                else:
                    full = checkpoint_shape(target)
                    if (target.dim() != 3 and scale_weight_name(name) is None) or expert >= full[0]:
                        plan.unexpected.append(ck)
                        continue
                    expected = full[1:]
                    if name in whole or expert in experts[name]:
                        plan.duplicates.append(ck)
                        continue
                    experts[name][expert] = ck
                lenient = scale_weight_name(name) is not None and _squeezed(got) == _squeezed(expected)
                if got != expected and not lenient:
                    plan.shape_errors.append(f"{ck}: expected {list(expected)}, got {list(got)}")
                    continue
                plan.copies.append((path, ck, name, expert))
    for name, target in targets.items():
        if name in whole:
            continue
        of = scale_weight_name(name)
        if of is not None and of not in plan.fp8_weights:
            continue  # its weight is 16-bit in the checkpoint: the weight's loader quantises and sets it
        if name in experts:
            n_experts = checkpoint_shape(target)[0]
            absent = sorted(set(range(n_experts)) - set(experts[name]))
            if absent:
                plan.missing_experts.append(f"{name}: {_ranges(absent)} of {n_experts}")
            continue
        plan.missing.append(name)
    return plan


def _fp8_fits(plan: _Plan, ck_dtype: str, name: str, ck: str, target: torch.Tensor) -> bool:
    """Record an e4m3 checkpoint weight; False (and the problem noted) for one whose parameter is 16-bit."""
    if ck_dtype not in _FP8_DTYPES:
        return True
    if target.dtype != torch.float8_e4m3fn:
        plan.fp8_mismatch.append(
            f"{ck} ({ck_dtype}; the model holds {str(target.dtype).removeprefix('torch.')})"
        )
        return False
    plan.fp8_weights.add(name)
    return True


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A shape without its 1s: a scale of [N, 1] or [1] loads as [N] or one value."""
    return tuple(d for d in shape if d != 1)


def _ranges(xs: list[int]) -> str:
    """[0, 1, 2, 5] -> '[0-2, 5]' (short messages for 512-expert layers)."""
    out: list[str] = []
    start = prev = xs[0]
    for x in [*xs[1:], None]:
        if x is not None and x == prev + 1:
            prev = x
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if x is not None:
            start = prev = x
    return "[" + ", ".join(out) + "]"


def _materialize(
    model: nn.Module, targets: dict[str, torch.Tensor], aliases: Mapping[str, str], device, dtype
) -> None:
    """Replace parameters/buffers still on the meta device by real (uninitialised) tensors."""
    metas = [n for n, t in targets.items() if t.is_meta]
    if not metas:
        return
    if device is None:
        raise ValueError(
            f"{len(metas)} model tensors are on the meta device (e.g. {metas[0]}); pass device= to "
            "load_checkpoint"
        )
    for name in metas:
        old = targets[name]
        want = old.dtype
        if (
            dtype is not None
            and old.dtype.is_floating_point
            and old.dtype.itemsize > 1
            and not keeps_fp32(name)
        ):
            want = dtype
        new = torch.empty(old.shape, device=device, dtype=want)
        targets[name] = _set_tensor(model, name, new)
    for alias, name in aliases.items():
        _set_tensor(model, alias, targets[name])  # keep tied weights tied


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> torch.Tensor:
    mod_name, _, attr = name.rpartition(".")
    mod = model.get_submodule(mod_name) if mod_name else model
    if attr in mod._parameters:
        old = mod._parameters[attr]
        assert old is not None  # a registered parameter, not a None placeholder
        p = value if isinstance(value, nn.Parameter) else nn.Parameter(value, requires_grad=old.requires_grad)
        _carry_shard_info(old, p)
        mod._parameters[attr] = p
        return p
    mod._buffers[attr] = value
    return value


@torch.no_grad()
def load_checkpoint(
    model: nn.Module,
    model_dir: str | Path,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Copy a Hub-layout safetensors checkpoint into `model` (canonical names), one tensor at a time.

    Each tensor is cast to the dtype of the parameter it lands in (so float32 router weights stay float32)
    and copied onto that parameter's device. `device`/`dtype` matter only for a model built on the meta
    device (to skip allocating and initialising weights that are about to be overwritten): its tensors are
    created on `device`, in `dtype` (the router stays float32), before the copy.

    Raises ValueError listing (at most 10 of each, with counts) missing, unexpected, wrong-shape,
    duplicated tensors and missing expert indices, before any parameter is modified.
    """
    model_dir = Path(model_dir)
    targets, aliases = _model_tensors(model)
    plan = _plan_load(model_dir, targets, aliases)
    msg = plan.error(model_dir)
    if msg:
        raise ValueError(msg)
    _materialize(model, targets, aliases, device, dtype)
    by_file: dict[Path, list[tuple[str, str, int | None]]] = defaultdict(list)
    for path, ck, name, expert in plan.copies:
        by_file[path].append((ck, name, expert))
    for path, items in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for ck, name, expert in items:
                loader = getattr(targets[name], "weight_loader", None)
                if loader is not None:  # reads this rank's rows (and experts) only
                    loader(targets[name], f.get_slice(ck), expert)
                    continue
                src = f.get_tensor(ck)
                dst = targets[name] if expert is None else targets[name][expert]
                dst.copy_(src)
                del src
    for (
        m
    ) in model.modules():  # loaders that pair tensors (block-scaled FP8 experts) check nothing is left over
        hook = getattr(m, "after_checkpoint_load", None)
        if hook is not None:
            hook()
    logger.info("loaded %d tensors from %s", len(plan.copies), model_dir)


# ---- saving ------------------------------------------------------------------------------------------------
def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _hub_tensors(model: nn.Module, per_expert: bool) -> Iterator[tuple[str, Callable[[], torch.Tensor], int]]:
    """(Hub name, thunk producing a contiguous CPU tensor, bytes) in module order; thunks defer the copy."""
    tensors, _ = _model_tensors(model)
    for name, t in tensors.items():
        if t.is_meta:
            raise ValueError(f"cannot save {name}: it is on the meta device (not loaded or initialised)")
        if is_shard(t):
            raise ValueError(
                f"cannot save {name}: this rank holds a {list(t.shape)} shard of {list(checkpoint_shape(t))} "
                "(save from a tp_size 1 model)"
            )
        m = _STACKED_EXPERT_RE.match(name)
        if per_expert and m and t.dim() == 3:
            for e in range(t.shape[0]):
                yield (
                    f"{m.group(1)}.{e}.{m.group(2)}.weight",
                    partial(_cpu_copy, t[e]),
                    t[e].numel() * t.element_size(),
                )
        else:
            yield name, partial(_cpu_copy, t), t.numel() * t.element_size()


def save_checkpoint(
    model: nn.Module, out_dir: str | Path, *, max_shard_bytes: int | None = None, per_expert: bool = True
) -> None:
    """Write `model` in the Hub layout transformers reads: `backbone.` names, per-expert tensors by default.

    One `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json`
    when the tensors exceed `max_shard_bytes`. Only one shard's tensors are in host memory at a time. Old
    `model*.safetensors` / index files in `out_dir` are removed first so a stale layout cannot win.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        if old.is_file():
            old.unlink()
    entries = list(_hub_tensors(model, per_expert))
    shards: list[list[tuple[str, Callable[[], torch.Tensor]]]] = [[]]
    size = 0
    for name, thunk, nbytes in entries:
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, thunk))
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file({n: th() for n, th in shards[0]}, str(out / SINGLE_FILE), metadata=meta)
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        data = {n: th() for n, th in shard}
        total += sum(t.numel() * t.element_size() for t in data.values())
        save_file(data, str(out / fname), metadata=meta)
        del data
        weight_map.update(dict.fromkeys((n for n, _ in shard), fname))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


# ---- random init -------------------------------------------------------------------------------------------
_CHUNK_ELEMS = 1 << 22  # 4M elements (16 MiB float32) per generated chunk
_DT_MAX = 0.1
_DT_FLOOR = 1e-4


def _seed_for(seed: int, name: str, chunk: int) -> int:
    """A stable 63-bit seed per (seed, parameter, chunk): independent of order, threads and device."""
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _init_rule(name: str, cfg: HybridModelConfig) -> tuple[str, float]:
    """(kind, std) for a canonical name; kinds: normal, ones, zeros, A_log, dt_bias."""
    residual_std = 0.02 / math.sqrt(2 * cfg.num_layers)  # NemotronH rescale_prenorm_residual
    if name.endswith("norm.weight") or name == "backbone.norm_f.weight":
        return "ones", 0.0
    if name.endswith(".A_log"):
        return "A_log", 0.0
    if name.endswith(".D"):
        return "ones", 0.0
    if name.endswith(".dt_bias"):
        return "dt_bias", 0.0
    if name.endswith("conv1d.weight"):
        return "normal", 1.0 / math.sqrt(cfg.conv_kernel)
    if name.endswith("conv1d.bias"):
        return "normal", 0.02
    if name.endswith("gate.e_score_correction_bias"):
        return "normal", 0.01  # breaks ties in grouped top-k
    if name.endswith(".bias"):
        return "zeros", 0.0
    if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "experts.down_proj")):
        return "normal", residual_std
    if name.endswith((".weight", "experts.up_proj")):
        return "normal", 0.02
    raise ValueError(f"init_random_weights: no init rule for parameter {name!r}")


def _small_init(kind: str, name: str, n: int, cfg: HybridModelConfig, seed: int) -> torch.Tensor:
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
    cfg: HybridModelConfig,
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
            kind, std = _init_rule(name, cfg)
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
    name: str, t: torch.Tensor, cfg: HybridModelConfig, seed: int, max_workers: int | None, on_device: bool
) -> None:
    """Random init of a parameter whose loader takes one dim-0 row at a time (`loads_by_row`: an expert's
    matrix): each chunk of the checkpoint tensor is drawn as `init_random_tensors` draws it (same seeds, so
    the same values) and its rows handed to the loader, instead of drawing the whole tensor on the host first
    (Nemotron 3 Super's expert tensors are 1.4G elements, 5.6 GB in float32, 80 of them). FP8 weights are
    drawn in float32 and quantised by the loader."""
    kind, std = _init_rule(name, cfg)
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
    cfg: HybridModelConfig,
    *,
    seed: int = 0,
    max_workers: int | None = None,
    on_device: bool = False,
) -> None:
    """Deterministic random weights for `load_format="dummy"`, the same on every device for a given seed
    (on_device=False, the engine's path: drawn on the host; on_device=True draws a CUDA model's normal
    weights on its GPU, many times faster but other values, the same only on the same kind of GPU).

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


def random_state_dict(
    cfg: HybridModelConfig, *, seed: int = 0, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """A CPU state dict with canonical names and `init_random_weights` values, built without the model class.

    Tensors are in `dtype` (default cfg.dtype) except the float32 router.
    """
    dtype = dtype or cfg.dtype
    sd = {
        n: torch.empty(s, dtype=torch.float32 if keeps_fp32(n) else dtype)
        for n, s in canonical_shapes(cfg).items()
    }
    init_random_tensors(sd, cfg, seed=seed)
    return sd


class StateDictModule(nn.Module):
    """An `nn.Module` whose state dict is exactly the given canonical tensors (saving without the model
    class)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in tensors.items():
            mod: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in mod._modules:
                    mod.add_module(part, nn.Module())
                mod = mod._modules[part]  # type: ignore[assignment]
            p = nn.Parameter(t, requires_grad=False)
            _carry_shard_info(t, p)  # a tensor-parallel shard still loads its own rows
            mod.register_parameter(leaf, p)
