"""Checkpoint I/O keyed by canonical parameter names (a model's own module tree), for every family.

A family's `CheckpointNames` maps the Hub's tensor names onto its module tree (renames, per-expert tensors
stacked into 3-D parameters, names to ignore); see e.g. `model/nemotron_h/checkpoint.py`.

FP8 checkpoints (model/quant_config.py, model/fp8_weights.py) add, per projection:

    X.weight (F8_E4M3), X.weight_scale             ->    X.weight, X.weight_scale (float32)
    X.weight_scale_inv (block-scaled format)       ->    X.weight_scale
    X.input_scale (ModelOpt static activation)     ->    ignored: activations are scaled per token

A scale is required only where the checkpoint's weight is e4m3; a 16-bit weight for an FP8 parameter is
quantised by its loader (online quantisation), and an e4m3 tensor for a 16-bit parameter is an error.

Loading validates everything from the safetensors headers first (names, shapes, expert indices), so a
bad checkpoint raises one `ValueError` listing all problems before any parameter is touched, and then
streams one tensor at a time so a multi-shard checkpoint never sits in host memory at once.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_LISTED = 10

SCALE_SUFFIX = ".weight_scale"
# dequantisation scales of FP8 weights stay float32 (model/fp8_weights.py)
_FP32_SCALE_SUFFIXES = (SCALE_SUFFIX, "experts.up_proj_scale", "experts.down_proj_scale")
# ModelOpt's static activation scales: read past (the FP8 kernels scale activations per token)
_INPUT_SCALE = ".input_scale"
_FP8_DTYPES = ("F8_E4M3",)


class CheckpointNames(Protocol):
    """A family's checkpoint naming (one object per family)."""

    @property
    def attention_prefix(self) -> str:
        """A regex of an attention layer's module path with the layer index as its one group: FP8 KV-scale
        tensors hang off it (kv_scales.py)."""
        ...

    def canonical(self, ckpt_name: str) -> tuple[str, int | None] | None:
        """A checkpoint tensor name -> (canonical name, expert index or None); None for a name to ignore.
        An unknown name comes back unchanged, so the loader reports it as the user sees it."""
        ...

    def per_expert_name(self, name: str, expert: int) -> str | None:
        """Saving: the Hub name of one expert's matrix of a stacked parameter (None: saved whole)."""
        ...

    def keeps_fp32(self, name: str) -> bool:
        """Parameters that stay float32 whatever the model dtype (routers, FP8 scales)."""
        ...


def scale_weight_name(name: str) -> str | None:
    """The FP8 weight a canonical scale name belongs to (`x.weight_scale` -> `x.weight`,
    `experts.up_proj_scale` -> `experts.up_proj`), or None for any other name."""
    if name.endswith(SCALE_SUFFIX):
        return name.removesuffix("_scale")
    if name.endswith(("experts.up_proj_scale", "experts.down_proj_scale")):
        return name.removesuffix("_scale")
    return None


def keeps_fp32_scale(name: str) -> bool:
    """True for the float32 dequantisation scales of FP8 weights."""
    return name.endswith(_FP32_SCALE_SUFFIXES)


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


def _plan_load(
    model_dir: Path, targets: Mapping[str, torch.Tensor], aliases: Mapping[str, str], names: CheckpointNames
) -> _Plan:
    plan = _Plan()
    whole: dict[str, str] = {}  # canonical name -> checkpoint name it came from
    experts: dict[str, dict[int, str]] = defaultdict(dict)
    for path, listed in checkpoint_files(model_dir).items():
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            wanted = sorted(keys) if listed is None else listed
            for ck in wanted:
                if ck not in keys:
                    plan.not_in_shard.append(f"{ck} (shard {path.name})")
                    continue
                mapped = names.canonical(ck)
                if mapped is None:
                    logger.debug("ignoring %s (not a tensor hyserve runs)", ck)
                    continue
                name, expert = mapped
                if name in aliases or (name == "lm_head.weight" and name not in targets):
                    logger.debug("ignoring %s: the model ties it to the input embedding", ck)
                    continue
                if name.endswith(_INPUT_SCALE) and name.removesuffix(_INPUT_SCALE) + ".weight" in targets:
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
    model: nn.Module,
    targets: dict[str, torch.Tensor],
    aliases: Mapping[str, str],
    names: CheckpointNames,
    device,
    dtype,
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
            and not names.keeps_fp32(name)
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
    names: CheckpointNames,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Copy a Hub-layout safetensors checkpoint into `model` (canonical names, `names` mapping the
    checkpoint's onto them), one tensor at a time.

    Each tensor is cast to the dtype of the parameter it lands in (so float32 router weights stay float32)
    and copied onto that parameter's device. `device`/`dtype` matter only for a model built on the meta
    device (to skip allocating and initialising weights that are about to be overwritten): its tensors are
    created on `device`, in `dtype` (the router stays float32), before the copy.

    Raises ValueError listing (at most 10 of each, with counts) missing, unexpected, wrong-shape,
    duplicated tensors and missing expert indices, before any parameter is modified.
    """
    model_dir = Path(model_dir)
    targets, aliases = _model_tensors(model)
    plan = _plan_load(model_dir, targets, aliases, names)
    msg = plan.error(model_dir)
    if msg:
        raise ValueError(msg)
    _materialize(model, targets, aliases, names, device, dtype)
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


def _hub_tensors(
    model: nn.Module, names: CheckpointNames, per_expert: bool
) -> Iterator[tuple[str, Callable[[], torch.Tensor], int]]:
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
        if per_expert and t.dim() == 3 and names.per_expert_name(name, 0) is not None:
            for e in range(t.shape[0]):
                yield (
                    names.per_expert_name(name, e) or name,
                    partial(_cpu_copy, t[e]),
                    t[e].numel() * t.element_size(),
                )
        else:
            yield name, partial(_cpu_copy, t), t.numel() * t.element_size()


def save_checkpoint(
    model: nn.Module,
    out_dir: str | Path,
    *,
    names: CheckpointNames,
    max_shard_bytes: int | None = None,
    per_expert: bool = True,
) -> None:
    """Write `model` in the Hub layout transformers reads: canonical names, per-expert tensors by default
    (where `names` splits a stacked parameter).

    One `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards plus `model.safetensors.index.json`
    when the tensors exceed `max_shard_bytes`. Only one shard's tensors are in host memory at a time. Old
    `model*.safetensors` / index files in `out_dir` are removed first so a stale layout cannot win.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("model*.safetensors"), out / INDEX_FILE]:
        if old.is_file():
            old.unlink()
    entries = list(_hub_tensors(model, names, per_expert))
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


class HubNames:
    """`CheckpointNames` of a family whose module tree spells the Hub's names (Bamba, Granite-4.0-H): every
    name maps to itself except the `aliases` (other spellings of the same tensor, e.g. a newer exporter's);
    nothing is stored per expert."""

    def __init__(self, attention_prefix: str, aliases: Mapping[str, str] | None = None) -> None:
        self.attention_prefix = attention_prefix
        self._aliases = dict(aliases or {})

    def canonical(self, ckpt_name: str) -> tuple[str, int | None] | None:
        if ckpt_name.endswith(".weight_scale_inv"):
            ckpt_name = ckpt_name.removesuffix("_inv")
        for old, new in self._aliases.items():
            if ckpt_name.endswith(old):
                return ckpt_name.removesuffix(old) + new, None
        return ckpt_name, None

    def per_expert_name(self, name: str, expert: int) -> str | None:
        return None

    def keeps_fp32(self, name: str) -> bool:
        return keeps_fp32_scale(name)
