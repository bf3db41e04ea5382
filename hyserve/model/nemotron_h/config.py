"""`HybridModelConfig`: the NemotronH architecture as hyserve needs it, read from a HF `config.json`.

Accepts both spellings of the layer list (the legacy `hybrid_override_pattern` string and the newer
`layers_block_type` list) and the legacy `mamba_*` key aliases. Everything is validated here, once, with
messages that name the offending field, so the model and cache code can trust the numbers.

It also derives the per-layer cache specs (the only place that knows what each layer kind stores):

    attention layer -> K + V bytes per token  = 2 * num_kv_heads * head_dim * kv_dtype_bytes
    mamba layer     -> bytes per sequence     = conv state  (conv_dim * (conv_kernel - 1) * dtype)
                                              + ssm state   (num_heads * head_dim * state_size * ssm_dtype)
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hyserve.config import MAX_PHILOX_ROUNDS, SSM_CACHE_DTYPES
from hyserve.model.config import (
    LAYER_ATTENTION,
    LAYER_MAMBA,
    LAYER_MLP,
    LAYER_MOE,
    Fields,
    checkpoint_dtype,
    dtype_name,
    eos_token_ids,
    number,
    parse_dtype,
    read_config_json,
)
from hyserve.model.config import (
    time_step_limit as parse_time_step_limit,
)
from hyserve.model.layer_specs import (
    AttentionCacheSpec,
    AttentionSpec,
    CacheLayout,
    MambaCacheSpec,
    MambaSpec,
    MoESpec,
)
from hyserve.model.nemotron_h.init_rules import init_rule
from hyserve.model.nemotron_h.sharding import sharding_problems
from hyserve.model.quant_config import QuantConfig

_PATTERN_CHARS = {"M": LAYER_MAMBA, "*": LAYER_ATTENTION, "-": LAYER_MLP, "E": LAYER_MOE}
_BLOCK_TYPE_NAMES = {
    "mamba": LAYER_MAMBA,
    "linear_attention": LAYER_MAMBA,
    "attention": LAYER_ATTENTION,
    "full_attention": LAYER_ATTENTION,
    "mlp": LAYER_MLP,
    "moe": LAYER_MOE,
}

# legacy key -> current key (same meaning)
_ALIASES = {
    "mamba_n_groups": "n_groups",
    "mamba_d_conv": "conv_kernel",
    "mamba_expand": "expand",
    "mamba_dt_min": "time_step_min",
    "mamba_dt_max": "time_step_max",
    "mamba_dt_limit": "time_step_limit",
    "mamba_dt_init_floor": "time_step_floor",
    "mamba_conv_bias": "use_conv_bias",
    "mamba_chunk_size": "chunk_size",
    "mamba_d_state": "ssm_state_size",
    "attention_head_dim": "head_dim",
    "rms_norm_eps": "layer_norm_epsilon",
    "norm_eps": "layer_norm_epsilon",
}


@dataclass(frozen=True, kw_only=True)
class HybridModelConfig:
    """The architecture of one NemotronH checkpoint (immutable; change with `dataclasses.replace`)."""

    layer_types: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    layer_norm_epsilon: float
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    max_position_embeddings: int
    dtype: torch.dtype  # checkpoint dtype ("torch_dtype"/"dtype"), bf16 when absent
    # mamba2
    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    mamba_proj_bias: bool
    time_step_limit: tuple[float, float]
    time_step_min: float
    mamba_hidden_act: str
    # attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    # mlp
    intermediate_size: int
    mlp_bias: bool
    mlp_hidden_act: str
    # moe
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    n_shared_experts: int
    moe_latent_size: int | None
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # cache dtypes (engine options folded in by `with_cache_dtypes`)
    ssm_cache_dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None  # None -> model dtype
    # stochastic rounding of the float16 SSM state (kernels/stochastic_rounding.py): on/off, Philox rounds,
    # and the seed of its random stream (the engine's seed)
    ssm_stochastic_rounding: bool = False
    ssm_philox_rounds: int = 10
    ssm_rounding_seed: int = 0
    # the projections' weight format (model/quant_config.py): None = 16-bit; folded in by `with_quant`
    quant: QuantConfig | None = None
    # the multi-token-prediction block the checkpoint ships (num_nextn_predict_layers 1): its sublayers' kinds
    # (mtp_hybrid_override_pattern "*E" / mtp_layers_block_type), empty without one; `use_mtp` (folded in by
    # `with_mtp` when speculative decoding drafts with it) builds and loads it, its attention with KV blocks
    mtp_layer_types: tuple[str, ...] = ()
    use_mtp: bool = False
    name: str = ""

    # ---- derived -------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_intermediate_size(self) -> int:
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.n_groups * self.ssm_state_size

    @property
    def in_proj_size(self) -> int:
        return self.mamba_intermediate_size + self.conv_dim + self.mamba_num_heads

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LAYER_MAMBA)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LAYER_ATTENTION)

    @property
    def mtp_layer_ids(self) -> tuple[int, ...]:
        """The cache layer ids of the MTP block's sublayers when it is built (after the backbone's layers)."""
        return (
            tuple(range(self.num_layers, self.num_layers + len(self.mtp_layer_types))) if self.use_mtp else ()
        )

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """Every layer with KV in the cache: the backbone's attention layers, then the MTP block's."""
        mtp = [i for i, t in zip(self.mtp_layer_ids, self.mtp_layer_types) if t == LAYER_ATTENTION]
        return (*self.attention_layer_ids, *mtp)

    @property
    def has_recurrent_state(self) -> bool:
        return LAYER_MAMBA in self.layer_types

    def describe(self) -> str:
        """One line for the start-up log."""
        fmt = f", {self.quant.describe()}" if self.quant is not None else ""
        return (
            f"{self.num_layers} layers ({len(self.mamba_layer_ids)} Mamba2, {len(self.attention_layer_ids)} "
            f"attention), {self.num_parameters() / 1e6:.1f}M params{fmt}"
        )

    def mamba_spec(self) -> MambaSpec:
        return MambaSpec(
            hidden_size=self.hidden_size,
            num_heads=self.mamba_num_heads,
            head_dim=self.mamba_head_dim,
            state_size=self.ssm_state_size,
            n_groups=self.n_groups,
            conv_kernel=self.conv_kernel,
            chunk_size=self.chunk_size,
            use_conv_bias=self.use_conv_bias,
            proj_bias=self.mamba_proj_bias,
            time_step_limit=self.time_step_limit,
            norm_eps=self.layer_norm_epsilon,
            ssm_stochastic_rounding=self.ssm_stochastic_rounding,
            ssm_philox_rounds=self.ssm_philox_rounds,
            ssm_rounding_seed=self.ssm_rounding_seed,
        )

    def attention_cache_spec(self) -> AttentionCacheSpec:
        return AttentionCacheSpec(
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            dtype=self.kv_cache_dtype or self.dtype,
        )

    def mamba_cache_spec(self) -> MambaCacheSpec:
        return self.mamba_spec().cache_spec(
            conv_dtype=self.dtype,
            ssm_dtype=self.ssm_cache_dtype,
            stochastic_rounding=self.ssm_stochastic_rounding,
        )

    def attention_spec(self) -> AttentionSpec:
        """NoPE GQA: the Mamba layers carry position."""
        return AttentionSpec(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            bias=self.attention_bias,
        )

    def moe_spec(self) -> MoESpec:
        return MoESpec(
            hidden_size=self.hidden_size,
            num_experts=self.n_routed_experts,
            top_k=self.num_experts_per_tok,
            intermediate_size=self.moe_intermediate_size,
            shared_intermediate_size=self.moe_shared_expert_intermediate_size,
            latent_size=self.moe_latent_size,
            n_group=self.n_group,
            topk_group=self.topk_group,
            norm_topk_prob=self.norm_topk_prob,
            routed_scaling_factor=self.routed_scaling_factor,
            bias=self.mlp_bias,
        )

    def cache_layout(self) -> CacheLayout:
        """What each attention and Mamba layer stores (the tensors `allocate_cache` creates)."""
        a, m = self.attention_cache_spec(), self.mamba_cache_spec()
        return CacheLayout(
            attention=dict.fromkeys(self.kv_layer_ids, a), recurrent=dict.fromkeys(self.mamba_layer_ids, m)
        )

    def sharding_problems(self, *, tp_size: int, ep_size: int) -> list[str]:
        """Every reason this model cannot run at tp_size / ep_size (nemotron_h/sharding.py)."""
        return sharding_problems(self, tp_size=tp_size, ep_size=ep_size)

    def init_rule(self, name: str) -> tuple[str, float]:
        """(kind, std) of a parameter's random init (nemotron_h/init_rules.py)."""
        return init_rule(name, self)

    @property
    def kv_bytes_per_token(self) -> int:
        """K+V bytes for one token across every attention layer."""
        return len(self.kv_layer_ids) * self.attention_cache_spec().bytes_per_token

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs of one query token against one context token across every attention layer (Q K^T and
        P V, a multiply-add each per head dimension): the context term of a step's cost."""
        return len(self.attention_layer_ids) * 4 * self.num_attention_heads * self.head_dim

    @property
    def state_bytes_per_sequence(self) -> int:
        """Conv + SSM state bytes for one sequence across every Mamba layer."""
        return len(self.mamba_layer_ids) * self.mamba_cache_spec().bytes_per_sequence

    def with_cache_dtypes(
        self,
        *,
        ssm_cache_dtype: str | torch.dtype | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        ssm_stochastic_rounding: bool | None = None,
        ssm_philox_rounds: int | None = None,
        ssm_rounding_seed: int | None = None,
    ) -> HybridModelConfig:
        """Fold the engine's cache options in (None keeps the current value)."""
        changes: dict[str, Any] = {}
        if ssm_cache_dtype is not None:
            changes["ssm_cache_dtype"] = parse_dtype(
                ssm_cache_dtype, field="kv_cache_config.mamba_ssm_cache_dtype", allowed=SSM_CACHE_DTYPES
            )
        if kv_cache_dtype is not None:
            changes["kv_cache_dtype"] = kv_cache_dtype
        if ssm_stochastic_rounding is not None:
            changes["ssm_stochastic_rounding"] = bool(ssm_stochastic_rounding)
        if ssm_philox_rounds is not None:
            changes["ssm_philox_rounds"] = int(ssm_philox_rounds)
        if ssm_rounding_seed is not None:
            changes["ssm_rounding_seed"] = int(ssm_rounding_seed)
        cfg = dataclasses.replace(self, **changes)
        cfg._validate_ssm_rounding()
        return cfg

    def with_mtp(self, use: bool = True) -> HybridModelConfig:
        """The same model with its MTP block built and loaded (`use`), for speculative decoding."""
        if use and not self.mtp_layer_types:
            raise ValueError(
                "speculative_config.method 'mtp': this checkpoint has no multi-token-prediction layer "
                "(num_nextn_predict_layers is 0); use method 'ngram'"
            )
        return dataclasses.replace(self, use_mtp=use)

    def with_quant(self, quant: QuantConfig | None) -> HybridModelConfig:
        """The same architecture with the projections in `quant`'s format (None: 16-bit)."""
        return dataclasses.replace(self, quant=quant)

    def _validate_ssm_rounding(self) -> None:
        if self.ssm_stochastic_rounding and self.ssm_cache_dtype != torch.float16:
            raise ValueError(
                "kv_cache_config.mamba_ssm_stochastic_rounding needs kv_cache_config.mamba_ssm_cache_dtype: "
                f"float16 (got {dtype_name(self.ssm_cache_dtype)})"
            )
        if not 1 <= self.ssm_philox_rounds <= MAX_PHILOX_ROUNDS:
            raise ValueError(
                f"kv_cache_config.mamba_ssm_philox_rounds must be in [1, {MAX_PHILOX_ROUNDS}], "
                f"got {self.ssm_philox_rounds}"
            )

    def num_parameters(self) -> int:
        """Parameter count (for rooflines and the start-up report)."""
        h = self.hidden_size
        n = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for t in self.layer_types:
            n += h  # pre-norm
            if t == LAYER_MAMBA:
                n += h * self.in_proj_size + self.conv_dim * self.conv_kernel
                n += self.conv_dim if self.use_conv_bias else 0
                n += 3 * self.mamba_num_heads + self.mamba_intermediate_size
                n += self.mamba_intermediate_size * h
            elif t == LAYER_ATTENTION:
                n += h * self.head_dim * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
            elif t == LAYER_MLP:
                n += 2 * h * self.intermediate_size
            else:
                d = self.moe_latent_size or h
                n += self.n_routed_experts * (h + 1)
                n += self.n_routed_experts * 2 * d * self.moe_intermediate_size
                n += 2 * h * self.moe_shared_expert_intermediate_size
                if self.moe_latent_size is not None:
                    n += 2 * h * self.moe_latent_size
        return n

    # ---- loading -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path: str | Path) -> HybridModelConfig:
        """Read a checkpoint directory (or a config.json path) of a NemotronH model."""
        raw, name = read_config_json(path)
        return cls.from_dict(raw, name=name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "") -> HybridModelConfig:
        d = dict(raw)
        for old, new in _ALIASES.items():
            if old in d and new not in d:
                d[new] = d[old]
        model_type = d.get("model_type")
        if model_type not in (None, "nemotron_h"):
            raise ValueError(
                f"model_type: {model_type!r} is not supported; hyserve serves 'nemotron_h' models"
            )

        layer_types = _parse_layer_types(d)
        mtp_layer_types = _parse_mtp_layer_types(d)
        fields = Fields(d)
        req, get = fields.req, fields.get

        hidden = req("hidden_size")
        n_heads = get("num_attention_heads", 1, int)
        head_dim = get("head_dim", hidden // n_heads if n_heads else 0, int)
        expand = get("expand", None)
        mamba_head_dim = get("mamba_head_dim", 0, int)
        if d.get("mamba_num_heads") is None and expand is not None and mamba_head_dim > 0:
            # older configs give expand instead of the head count
            mamba_heads = number("expand", expand, int) * hidden // mamba_head_dim
        else:
            mamba_heads = get("mamba_num_heads", 0, int)

        n_experts = get("n_routed_experts", 0, int)
        cfg = cls(
            layer_types=layer_types,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            layer_norm_epsilon=get("layer_norm_epsilon", 1e-5, float),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_token_ids(d),
            pad_token_id=d.get("pad_token_id"),
            max_position_embeddings=get("max_position_embeddings", 4096, int),
            dtype=checkpoint_dtype(d),
            mamba_num_heads=mamba_heads,
            mamba_head_dim=mamba_head_dim,
            ssm_state_size=get("ssm_state_size", 128, int),
            n_groups=get("n_groups", 1, int),
            conv_kernel=get("conv_kernel", 4, int),
            chunk_size=get("chunk_size", 128, int),
            use_conv_bias=bool(get("use_conv_bias", True)),
            mamba_proj_bias=bool(get("use_bias", get("mamba_proj_bias", False))),
            time_step_limit=parse_time_step_limit(fields),
            time_step_min=get("time_step_min", 0.001, float),
            mamba_hidden_act=str(get("mamba_hidden_act", "silu")),
            num_attention_heads=n_heads,
            num_key_value_heads=get("num_key_value_heads", n_heads, int),
            head_dim=head_dim,
            attention_bias=bool(get("attention_bias", False)),
            intermediate_size=get("intermediate_size", 0, int),
            mlp_bias=bool(get("mlp_bias", False)),
            mlp_hidden_act=str(get("mlp_hidden_act", "relu2")),
            n_routed_experts=n_experts,
            num_experts_per_tok=get("num_experts_per_tok", 0, int),
            moe_intermediate_size=get("moe_intermediate_size", 0, int),
            moe_shared_expert_intermediate_size=get("moe_shared_expert_intermediate_size", 0, int),
            n_shared_experts=get("n_shared_experts", 1, int),
            moe_latent_size=None if d.get("moe_latent_size") is None else int(d["moe_latent_size"]),
            n_group=get("n_group", 1, int),
            topk_group=get("topk_group", 1, int),
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            routed_scaling_factor=get("routed_scaling_factor", 1.0, float),
            ssm_cache_dtype=parse_dtype(
                get("mamba_ssm_cache_dtype", "float32"),
                field="mamba_ssm_cache_dtype",
                allowed=SSM_CACHE_DTYPES,
            ),
            mtp_layer_types=mtp_layer_types,
            name=name,
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ValueError naming the field for anything the model code could not run."""

        def positive(field: str, value: int) -> None:
            if value <= 0:
                raise ValueError(f"{field} must be positive, got {value}")

        positive("hidden_size", self.hidden_size)
        positive("vocab_size", self.vocab_size)
        if not self.layer_types:
            raise ValueError("layers_block_type / hybrid_override_pattern: the model has no layers")
        kinds = set(self.layer_types) | set(self.mtp_layer_types)
        if LAYER_MAMBA in kinds:
            for f in ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups", "chunk_size"):
                positive(f, getattr(self, f))
            if self.conv_kernel < 2:
                raise ValueError(f"conv_kernel must be >= 2, got {self.conv_kernel}")
            if self.mamba_num_heads % self.n_groups:
                raise ValueError(
                    f"mamba_num_heads ({self.mamba_num_heads}) must be divisible by n_groups "
                    f"({self.n_groups})"
                )
            if self.mamba_hidden_act != "silu":
                raise ValueError(f"mamba_hidden_act: only 'silu' is supported, got {self.mamba_hidden_act!r}")
            lo, hi = self.time_step_limit
            if not (0.0 <= lo < hi):
                raise ValueError(f"time_step_limit: need 0 <= min < max, got {self.time_step_limit}")
        if LAYER_ATTENTION in kinds:
            positive("num_attention_heads", self.num_attention_heads)
            positive("num_key_value_heads", self.num_key_value_heads)
            positive("head_dim", self.head_dim)
            if self.num_attention_heads % self.num_key_value_heads:
                raise ValueError(
                    f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                    f"num_key_value_heads ({self.num_key_value_heads})"
                )
        if LAYER_MLP in kinds:
            positive("intermediate_size", self.intermediate_size)
        for act_field in ("mlp_hidden_act",):
            if LAYER_MLP in kinds or LAYER_MOE in kinds:
                if getattr(self, act_field) != "relu2":
                    raise ValueError(
                        f"{act_field}: only 'relu2' is supported, got {getattr(self, act_field)!r}"
                    )
        if LAYER_MOE in kinds:
            positive("n_routed_experts", self.n_routed_experts)
            positive("num_experts_per_tok", self.num_experts_per_tok)
            positive("moe_intermediate_size", self.moe_intermediate_size)
            positive("moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size)
            if self.num_experts_per_tok > self.n_routed_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds n_routed_experts "
                    f"({self.n_routed_experts})"
                )
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_routed_experts ({self.n_routed_experts}) must be divisible by n_group")
            if not (1 <= self.topk_group <= self.n_group):
                raise ValueError(f"topk_group ({self.topk_group}) must be in [1, n_group={self.n_group}]")
            if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
                raise ValueError("n_group: each expert group needs at least 2 experts")
            if self.moe_latent_size is not None:
                positive("moe_latent_size", self.moe_latent_size)
        if not math.isfinite(self.layer_norm_epsilon) or self.layer_norm_epsilon <= 0:
            raise ValueError(f"layer_norm_epsilon must be positive, got {self.layer_norm_epsilon}")
        self._validate_ssm_rounding()


def _parse_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    lbt = d.get("layers_block_type")
    pattern = d.get("hybrid_override_pattern")
    if lbt is not None:
        if not isinstance(lbt, list) or not all(isinstance(x, str) for x in lbt):
            raise ValueError(f"layers_block_type: expected a list of strings, got {lbt!r}")
        bad = sorted({x for x in lbt if x not in _BLOCK_TYPE_NAMES})
        if bad:
            raise ValueError(
                f"layers_block_type: unknown layer types {bad}; allowed: {sorted(_BLOCK_TYPE_NAMES)}"
            )
        types = tuple(_BLOCK_TYPE_NAMES[x] for x in lbt)
    elif pattern is not None:
        if not isinstance(pattern, str):
            raise ValueError(f"hybrid_override_pattern: expected a string, got {pattern!r}")
        bad = sorted({c for c in pattern if c not in _PATTERN_CHARS})
        if bad:
            raise ValueError(
                f"hybrid_override_pattern: unknown characters {bad}; allowed: 'M' (Mamba2), '*' (attention), "
                "'-' (MLP), 'E' (MoE)"
            )
        types = tuple(_PATTERN_CHARS[c] for c in pattern)
    else:
        raise ValueError("config.json: needs either 'layers_block_type' or 'hybrid_override_pattern'")
    n = d.get("num_hidden_layers")
    if n is not None and lbt is None and int(n) != len(types):
        raise ValueError(
            f"num_hidden_layers ({n}) does not match hybrid_override_pattern length ({len(types)})"
        )
    return types


def _parse_mtp_layer_types(d: dict[str, Any]) -> tuple[str, ...]:
    """The MTP block's sublayer kinds: none when num_nextn_predict_layers is 0 (or absent); one block of
    mtp_layers_block_type (or the legacy mtp_hybrid_override_pattern string) otherwise."""
    n = d.get("num_nextn_predict_layers") or 0
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"num_nextn_predict_layers: expected an integer >= 0, got {n!r}")
    if n == 0:
        return ()
    if n > 1:
        raise ValueError(f"num_nextn_predict_layers: hyserve runs one MTP layer, the config has {n}")
    lbt, pattern = d.get("mtp_layers_block_type"), d.get("mtp_hybrid_override_pattern")
    if lbt is not None:
        if not isinstance(lbt, list) or any(x not in _BLOCK_TYPE_NAMES for x in lbt):
            raise ValueError(
                f"mtp_layers_block_type: expected a list of {sorted(_BLOCK_TYPE_NAMES)}, got {lbt!r}"
            )
        types = tuple(_BLOCK_TYPE_NAMES[x] for x in lbt)
    elif isinstance(pattern, str) and pattern and all(c in _PATTERN_CHARS for c in pattern):
        types = tuple(_PATTERN_CHARS[c] for c in pattern)
    else:
        raise ValueError(
            "num_nextn_predict_layers is 1 but the MTP block's layers are not given: set "
            f"mtp_hybrid_override_pattern (e.g. '*E') or mtp_layers_block_type, got {pattern!r}"
        )
    if LAYER_MAMBA in types:
        raise ValueError("mtp_hybrid_override_pattern: an MTP block of Mamba layers ('M') is not supported")
    return types
