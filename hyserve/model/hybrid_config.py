"""`HybridDecoderConfig`: the part of a config shared by the families whose decoder layers are a mixer (Mamba2
or attention) then a feed-forward block (Bamba, Granite-4.0-H). A family's config subclasses it with its
feed-forward fields; the layers are built from the specs it holds (`layer_specs.py`).

Parsing helpers read the `mamba_*` keys those families' config.json files share.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Self

import torch

from hyserve.config import MAX_PHILOX_ROUNDS, SSM_CACHE_DTYPES
from hyserve.model.config import (
    LAYER_ATTENTION,
    LAYER_HYBRID,
    LAYER_MAMBA,
    Fields,
    checkpoint_dtype,
    dtype_name,
    eos_token_ids,
    parse_dtype,
    time_step_limit,
)
from hyserve.model.layer_specs import AttentionSpec, CacheLayout, MambaSpec
from hyserve.model.quant_config import QuantConfig

# config.json layer names -> hyserve's layer kinds
_LAYER_NAMES = {
    "mamba": LAYER_MAMBA,
    "linear_attention": LAYER_MAMBA,
    "attention": LAYER_ATTENTION,
    "full_attention": LAYER_ATTENTION,
}


def parse_layer_names(names: object, field: str) -> tuple[str, ...]:
    """A config.json list of layer names ("mamba" / "linear_attention", "attention" / "full_attention")."""
    if not isinstance(names, list) or not names or not all(isinstance(x, str) for x in names):
        raise ValueError(f"{field}: expected a non-empty list of layer names, got {names!r}")
    bad = sorted({x for x in names if x not in _LAYER_NAMES})
    if bad:
        raise ValueError(f"{field}: unknown layer types {bad}; allowed: {sorted(_LAYER_NAMES)}")
    return tuple(_LAYER_NAMES[x] for x in names)


def listed_layer_types(f: Fields) -> tuple[str, ...] | None:
    """The layer kinds that `layers_block_type` or `layer_types` lists; None when neither does."""
    for key in ("layers_block_type", "layer_types"):
        if f.d.get(key) is not None:
            return parse_layer_names(f.d[key], key)
    return None


def parse_mamba(
    f: Fields,
    hidden: int,
    eps: float,
    *,
    heads: int | None = None,
    head_dim: int | None = None,
    **options: bool,
) -> MambaSpec:
    """The Mamba2 mixer of the `mamba_*` keys (mamba_d_head "auto": expand * hidden / heads). A family that
    reads the heads or their width its own way passes `heads` / `head_dim`; `options` are MambaSpec's
    output choices (out_bias, rms_norm, norm_before_gate)."""
    if heads is None:
        heads = f.req("mamba_n_heads")
    if head_dim is None:
        expand = f.get("mamba_expand", 2, int)
        d_head = f.d.get("mamba_d_head")
        head_dim = expand * hidden // heads if d_head in (None, "auto") else f.req("mamba_d_head")
    return MambaSpec(
        hidden_size=hidden,
        num_heads=heads,
        head_dim=head_dim,
        state_size=f.get("mamba_d_state", 256, int),
        n_groups=f.get("mamba_n_groups", 1, int),
        conv_kernel=f.get("mamba_d_conv", 4, int),
        chunk_size=f.get("mamba_chunk_size", 256, int),
        use_conv_bias=bool(f.get("mamba_conv_bias", True)),
        proj_bias=bool(f.get("mamba_proj_bias", False)),
        time_step_limit=time_step_limit(f),
        norm_eps=eps,
        **options,
    )


def check_silu(f: Fields) -> None:
    act = f.d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: only 'silu' is supported, got {act!r}")


def decoder_fields(f: Fields, hidden: int, eps: float, max_position_embeddings: int) -> dict[str, Any]:
    """The `HybridDecoderConfig` fields every family reads alike from config.json (`max_position_embeddings`:
    the family's default)."""
    return dict(
        vocab_size=f.req("vocab_size"),
        hidden_size=hidden,
        rms_norm_eps=eps,
        tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
        eos_token_ids=eos_token_ids(f.d),
        max_position_embeddings=f.get("max_position_embeddings", max_position_embeddings, int),
        dtype=checkpoint_dtype(f.d),
    )


def rope_theta(f: Fields) -> float:
    """`rope_parameters.rope_theta` (transformers 5) or the older top-level `rope_theta`."""
    params = f.d.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return f.get("rope_theta", 10000.0, float)


def check_rope_type(f: Fields) -> None:
    params = f.d.get("rope_parameters") or f.d.get("rope_scaling")
    kind = params.get("rope_type", params.get("type", "default")) if isinstance(params, dict) else "default"
    if kind != "default":
        raise ValueError(f"rope_parameters.rope_type: only 'default' RoPE is supported, got {kind!r}")


@dataclass(frozen=True, kw_only=True)
class HybridDecoderConfig(ABC):
    """The architecture facts of a (mixer + feed-forward) hybrid; immutable, change with `replace`."""

    layer_types: tuple[str, ...]  # LAYER_MAMBA / LAYER_ATTENTION / LAYER_HYBRID (both) per layer
    vocab_size: int
    hidden_size: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    dtype: torch.dtype
    mamba: MambaSpec
    attention: AttentionSpec
    time_step_min: float = 0.001  # the smallest dt of random init
    ssm_cache_dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None  # None -> model dtype
    quant: QuantConfig | None = None  # the projections' weight format: None = 16-bit (`with_quant`)
    name: str = ""

    # ---- ModelSpec -----------------------------------------------------------------------------------
    @property
    def chunk_size(self) -> int:
        return self.mamba.chunk_size

    @property
    def num_attention_heads(self) -> int:
        return self.attention.num_heads

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in (LAYER_MAMBA, LAYER_HYBRID))

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in (LAYER_ATTENTION, LAYER_HYBRID))

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.mamba_layer_ids)

    def cache_layout(self) -> CacheLayout:
        a = self.attention.cache_spec(self.kv_cache_dtype or self.dtype)
        m = self.mamba.cache_spec(
            conv_dtype=self.dtype,
            ssm_dtype=self.ssm_cache_dtype,
            stochastic_rounding=self.mamba.ssm_stochastic_rounding,
        )
        return CacheLayout(
            attention=dict.fromkeys(self.attention_layer_ids, a),
            recurrent=dict.fromkeys(self.mamba_layer_ids, m),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cache_layout().kv_bytes_per_token

    @property
    def state_bytes_per_sequence(self) -> int:
        return self.cache_layout().state_bytes_per_sequence

    @property
    def attention_flops_per_pair(self) -> int:
        return len(self.attention_layer_ids) * self.attention.flops_per_pair()

    @abstractmethod
    def ffn_parameters(self) -> int:
        """Parameters of one layer's feed-forward block (the family's)."""

    def num_parameters(self) -> int:
        h = self.hidden_size
        n = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        n += len(self.mamba_layer_ids) * self.mamba.num_parameters()
        n += len(self.attention_layer_ids) * self.attention.num_parameters()
        return n + self.num_layers * (2 * h + self.ffn_parameters())

    def layer_summary(self) -> str:
        return f"{len(self.mamba_layer_ids)} Mamba2, {len(self.attention_layer_ids)} attention"

    def describe(self) -> str:
        fmt = f", {self.quant.describe()}" if self.quant is not None else ""
        params = f"{self.num_parameters() / 1e6:.1f}M params"
        return f"{self.num_layers} layers ({self.layer_summary()}), {params}{fmt}"

    # ---- what the shared machinery asks ----------------------------------------------------------------
    @abstractmethod
    def ffn_sharding_problems(self, tp_size: int, ep_size: int) -> list[str]:
        """Why the feed-forward blocks cannot split over tp_size / ep_size ranks (the family's rules)."""

    def sharding_problems(self, *, tp_size: int, ep_size: int) -> list[str]:
        out = self.attention.sharding_problems(tp_size) if self.attention_layer_ids else []
        if self.mamba_layer_ids:
            out += self.mamba.sharding_problems(tp_size)
        return out + self.ffn_sharding_problems(tp_size, ep_size)

    def init_rule(self, name: str) -> tuple[str, float]:
        """Norm weights and D ones, A_log / dt_bias per-head draws, conv N(0, 1/sqrt(kernel)), biases zero,
        projections into the residual stream N(0, 0.02 / sqrt(2 * layers)), other weights N(0, 0.02)."""
        if name.endswith(("norm.weight", "layernorm.weight", ".D")):
            return "ones", 0.0
        if name.endswith(".A_log"):
            return "A_log", 0.0
        if name.endswith(".dt_bias"):
            return "dt_bias", 0.0
        if name.endswith("conv1d.weight"):
            return "normal", 1.0 / math.sqrt(self.mamba.conv_kernel)
        if name.endswith(".bias"):
            return "zeros", 0.0
        if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight", "output_linear.weight")):
            return "normal", 0.02 / math.sqrt(2 * self.num_layers)
        if name.endswith(".weight"):
            return "normal", 0.02
        raise ValueError(f"init_random_weights: no init rule for parameter {name!r}")

    def with_quant(self, quant: QuantConfig | None) -> Self:
        """The same architecture with its projections (Mamba in / out, attention q / k / v / o, the MLPs'
        gate / up / down) in `quant`'s format (None: 16-bit); the family may refuse a format
        (`quant_problem`)."""
        if quant is not None and (problem := self.quant_problem(quant)):
            raise ValueError(f"quantization: {quant.describe()}: {problem}")
        return dataclasses.replace(self, quant=quant)

    def quant_problem(self, quant: QuantConfig) -> str | None:
        """Why this architecture cannot run `quant`'s format, or None (every projection can be FP8)."""
        return None

    def with_cache_dtypes(
        self,
        *,
        ssm_cache_dtype: str | torch.dtype | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        ssm_stochastic_rounding: bool | None = None,
        ssm_philox_rounds: int | None = None,
        ssm_rounding_seed: int | None = None,
    ) -> Self:
        ssm = self.ssm_cache_dtype
        if ssm_cache_dtype is not None:
            ssm = parse_dtype(
                ssm_cache_dtype, field="kv_cache_config.mamba_ssm_cache_dtype", allowed=SSM_CACHE_DTYPES
            )
        m = self.mamba
        rounding = (
            m.ssm_stochastic_rounding if ssm_stochastic_rounding is None else bool(ssm_stochastic_rounding)
        )
        if rounding and ssm != torch.float16:
            raise ValueError(
                "kv_cache_config.mamba_ssm_stochastic_rounding needs kv_cache_config.mamba_ssm_cache_dtype: "
                f"float16 (got {dtype_name(ssm)})"
            )
        rounds = m.ssm_philox_rounds if ssm_philox_rounds is None else int(ssm_philox_rounds)
        if not 1 <= rounds <= MAX_PHILOX_ROUNDS:
            raise ValueError(f"kv_cache_config.mamba_ssm_philox_rounds must be in [1, {MAX_PHILOX_ROUNDS}]")
        mamba = dataclasses.replace(
            m,
            ssm_stochastic_rounding=rounding,
            ssm_philox_rounds=rounds,
            ssm_rounding_seed=m.ssm_rounding_seed if ssm_rounding_seed is None else int(ssm_rounding_seed),
        )
        kv = self.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype
        return dataclasses.replace(self, ssm_cache_dtype=ssm, kv_cache_dtype=kv, mamba=mamba)

    def validate(self) -> None:
        """Raise ValueError naming the field for anything the model code could not run."""
        for field, v in (("hidden_size", self.hidden_size), ("vocab_size", self.vocab_size)):
            if v <= 0:
                raise ValueError(f"{field} must be positive, got {v}")
        m, a = self.mamba, self.attention
        if self.mamba_layer_ids:
            if m.num_heads * m.head_dim <= 0 or m.num_heads % m.n_groups:
                raise ValueError(
                    f"mamba_n_heads ({m.num_heads}) must be positive and divisible by mamba_n_groups "
                    f"({m.n_groups})"
                )
            if m.conv_kernel < 2 or m.chunk_size <= 0:
                raise ValueError("mamba_d_conv must be >= 2 and mamba_chunk_size positive")
            if not 0.0 <= m.time_step_limit[0] < m.time_step_limit[1]:
                raise ValueError(f"time_step_limit: need 0 <= min < max, got {m.time_step_limit}")
        if self.attention_layer_ids and (
            a.num_heads <= 0 or a.num_kv_heads <= 0 or a.num_heads % a.num_kv_heads
        ):
            raise ValueError(
                f"num_attention_heads ({a.num_heads}) must be a positive multiple of num_key_value_heads "
                f"({a.num_kv_heads})"
            )
        rd = a.rope.rotary_dim if a.rope is not None else 2
        if not 0 < rd <= a.head_dim or rd % 2:
            raise ValueError(f"the rotary dims ({rd}) must be even and at most head_dim ({a.head_dim})")
        if not math.isfinite(self.rms_norm_eps) or self.rms_norm_eps <= 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
