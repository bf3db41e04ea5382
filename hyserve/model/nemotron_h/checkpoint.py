"""NemotronH's checkpoint names: how the Hub's tensor names map onto the module tree of `model.py`, the
shape of every parameter (tools build state dicts without the model class) and the weight bytes.

Canonical names are the module tree (`backbone.layers.{i}.mixer...`, `lm_head.weight`), with routed experts
stacked into 3-D parameters. Checkpoints on the Hub differ:

    checkpoint name                                      canonical name
    backbone.X / model.X                           ->    backbone.X
    ...mixer.experts.{e}.up_proj.weight   [I, d]   ->    ...mixer.experts.up_proj[e]    of [E, I, d]
    ...mixer.experts.{e}.down_proj.weight [d, I]   ->    ...mixer.experts.down_proj[e]  of [E, d, I]
    ...experts.{e}.up_proj.weight_scale            ->    ...experts.up_proj_scale[e]    (FP8)
    ...experts.{e}.up_proj.input_scale             ->    ignored: activations are scaled per token
    mtp.layers.{j}.X                               ->    mtp.layers.{j}.X (experts stacked as above) when
                                                         the MTP block is built, else ignored
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch

from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA, LAYER_MLP, LAYER_MOE
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.quant_config import fp8_scale_count
from hyserve.model.random_init import init_random_tensors
from hyserve.model.weights import SCALE_SUFFIX, keeps_fp32_scale

_LAYER = r"(?:backbone|mtp)\.layers\.\d+"
_PER_EXPERT_RE = re.compile(rf"^({_LAYER}\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
_STACKED_EXPERT_RE = re.compile(rf"^({_LAYER}\.mixer\.experts)\.(up_proj|down_proj)$")
_PER_EXPERT_SCALE_RE = re.compile(rf"^({_LAYER}\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight_scale$")
_PER_EXPERT_INPUT_SCALE_RE = re.compile(rf"^{_LAYER}\.mixer\.experts\.\d+\.(up_proj|down_proj)\.input_scale$")
# the router stays float32 whatever the model dtype: top-k routing is sensitive to rounding
_ROUTER_SUFFIXES = ("mixer.gate.weight", "mixer.gate.e_score_correction_bias")


class NemotronHNames:
    """The `weights.CheckpointNames` of NemotronH; `mtp`: the model has its MTP block (its tensors load),
    else they are ignored."""

    def __init__(self, *, mtp: bool = False) -> None:
        self.mtp = mtp

    # an attention layer's module path, the layer index its one group (FP8 KV-scale tensors hang off it)
    attention_prefix = r"backbone\.layers\.(\d+)\.mixer"

    def canonical(self, ckpt_name: str) -> tuple[str, int | None] | None:
        """(canonical name, expert index or None); None for ignored names (MTP, per-expert input scales).
        Names that are neither `backbone.*`, `model.*`, `lm_head.*` nor MTP come back unchanged, so the
        loader reports them as unexpected with the name the user sees in the file."""
        if ckpt_name.startswith("model."):
            ckpt_name = "backbone." + ckpt_name[len("model.") :]
        if ckpt_name.startswith("backbone.mtp."):
            ckpt_name = ckpt_name.removeprefix("backbone.")
        if (ckpt_name.startswith("mtp.") and not self.mtp) or _PER_EXPERT_INPUT_SCALE_RE.match(ckpt_name):
            return None
        if ckpt_name.endswith(".weight_scale_inv"):  # the block-scaled format's name for the same multiplier
            ckpt_name = ckpt_name.removesuffix("_inv")
        m = _PER_EXPERT_RE.match(ckpt_name) or _PER_EXPERT_SCALE_RE.match(ckpt_name)
        if m:
            scale = "_scale" if ckpt_name.endswith(SCALE_SUFFIX) else ""
            return f"{m.group(1)}.{m.group(3)}{scale}", int(m.group(2))
        return ckpt_name, None

    def per_expert_name(self, name: str, expert: int) -> str | None:
        """The Hub name of expert `expert`'s matrix of a stacked expert parameter (None: not one)."""
        m = _STACKED_EXPERT_RE.match(name)
        return f"{m.group(1)}.{expert}.{m.group(2)}.weight" if m else None

    def keeps_fp32(self, name: str) -> bool:
        return name.endswith(_ROUTER_SUFFIXES) or keeps_fp32_scale(name)


NAMES = NemotronHNames()
NAMES_MTP = NemotronHNames(mtp=True)


def canonical_name(ckpt_name: str) -> tuple[str, int | None] | None:
    """`NemotronHNames.canonical`."""
    return NAMES.canonical(ckpt_name)


def keeps_fp32(name: str) -> bool:
    """True for parameters that stay float32 in the model whatever its dtype (the MoE router, FP8 scales)."""
    return NAMES.keeps_fp32(name)


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
        _mixer_shapes(shapes, linear, f"backbone.layers.{i}.mixer", kind, cfg)
        shapes[f"backbone.layers.{i}.norm.weight"] = (h,)
    shapes["backbone.norm_f.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    if cfg.use_mtp:  # the MTP block (nemotron_h/mtp.py): fusion in the first sublayer, final norm in the last
        last = len(cfg.mtp_layer_types) - 1
        for j, kind in enumerate(cfg.mtp_layer_types):
            p = f"mtp.layers.{j}"
            if j == 0:
                shapes.update({f"{p}.enorm.weight": (h,), f"{p}.hnorm.weight": (h,)})
                shapes[f"{p}.eh_proj.weight"] = (h, 2 * h)
            shapes[f"{p}.norm.weight"] = (h,)
            _mixer_shapes(shapes, linear, f"{p}.mixer", kind, cfg)
            if j == last:
                shapes[f"{p}.final_layernorm.weight"] = (h,)
    return shapes


def _mixer_shapes(
    shapes: dict[str, tuple[int, ...]],
    linear: Callable[[str, int, int, bool], None],
    m: str,
    kind: str,
    cfg: HybridModelConfig,
) -> None:
    """The parameters of one mixer of `kind` under module path `m`."""
    h = cfg.hidden_size
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
        raise ValueError(f"{m}: unknown layer type {kind!r}")


def weight_bytes(cfg: HybridModelConfig, dtype: torch.dtype | None = None) -> int:
    """Bytes of every weight at tp_size 1, in `dtype` (default cfg.dtype; the router and scales float32),
    the projections `cfg.quant` covers at 1 byte a weight plus their float32 scales."""
    size = (dtype or cfg.dtype).itemsize
    total = 0
    for name, shape in canonical_shapes(cfg).items():
        n = math.prod(shape)
        stem = name.removesuffix(".weight")
        expert = _STACKED_EXPERT_RE.match(name)
        if name.startswith("mtp."):  # the MTP block stays 16-bit
            total += n * (4 if keeps_fp32(name) else size)
        elif cfg.quant is not None and expert and cfg.quant.quantizes_experts(expert.group(1)):
            total += n + 4 * shape[0] * shape[1]  # FP8 experts: a channel scale per expert and row
        elif cfg.quant is not None and name.endswith(".weight") and cfg.quant.quantizes(stem):
            total += n + 4 * fp8_scale_count(cfg.quant.scheme, shape)
        else:
            total += n * (4 if keeps_fp32(name) else size)
    return total


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
