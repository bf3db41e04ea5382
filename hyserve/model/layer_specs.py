"""The small per-layer configs the shared layers are built from, and what each layer kind stores in the
cache. A family's config turns its `config.json` into these; the layers never see a family's config.

    attention layer -> K + V bytes per token  = 2 * num_kv_heads * head_dim * kv_dtype_bytes
    recurrent layer -> bytes per sequence     = conv state  (conv_dim * conv_width * dtype)
                                              + state       (prod(state_shape) * ssm_dtype)

A recurrent layer is any mixer whose memory of a sequence has a fixed size (`RecurrentCacheSpec`): a Mamba2
layer's state is [heads, head_dim, state_size] (`MambaCacheSpec`); another mixer (a gated-DeltaNet layer's
[heads, key_dim, value_dim]) describes its own, and the cache pools, the capacity plan, prefix-cache snapshots
and the engine's state copies treat every slot alike.

Under tensor parallelism a rank's cache holds only its KV heads and Mamba heads / groups (`for_rank`): heads
split over the ranks, KV heads and B/C groups split when the ranks divide them, else one replicated per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch


def local_units(units: int, tp: int) -> int:
    """Heads / groups one rank holds: units / tp, or 1 when replicated (tp % units == 0)."""
    return units // tp if units % tp == 0 else 1


@dataclass(frozen=True, kw_only=True)
class AttentionCacheSpec:
    """What one attention layer stores per token."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    def for_rank(self, tp: int) -> AttentionCacheSpec:
        return dataclasses.replace(self, num_kv_heads=local_units(self.num_kv_heads, tp))


class RecurrentCacheSpec(Protocol):
    """What one recurrent layer stores per sequence, whatever its mixer: a short conv's last `conv_width`
    inputs of `conv_dim` channels, and a state of `state_shape`, in a pool slot each
    (`cache_tensors.py`)."""

    @property
    def conv_dim(self) -> int: ...

    @property
    def conv_width(self) -> int: ...

    @property
    def conv_dtype(self) -> torch.dtype: ...

    @property
    def state_shape(self) -> tuple[int, ...]: ...

    @property
    def ssm_dtype(self) -> torch.dtype: ...

    @property
    def bytes_per_sequence(self) -> int: ...

    def for_rank(self, tp: int) -> RecurrentCacheSpec:
        """One rank's share under tensor parallelism."""
        ...


@dataclass(frozen=True, kw_only=True)
class MambaCacheSpec:
    """What one Mamba2 layer stores per sequence (independent of its length)."""

    n_groups: int
    conv_width: int  # conv_kernel - 1 columns of history
    conv_dtype: torch.dtype
    num_heads: int
    head_dim: int
    state_size: int
    ssm_dtype: torch.dtype
    # float16 SSM state written with stochastic rounding instead of round-to-nearest (same bytes)
    ssm_stochastic_rounding: bool = False

    @property
    def conv_dim(self) -> int:
        """Conv channels [x | B | C]."""
        return self.num_heads * self.head_dim + 2 * self.n_groups * self.state_size

    def for_rank(self, tp: int) -> MambaCacheSpec:
        return dataclasses.replace(
            self, num_heads=self.num_heads // tp, n_groups=local_units(self.n_groups, tp)
        )

    @property
    def conv_bytes(self) -> int:
        return self.conv_dim * self.conv_width * self.conv_dtype.itemsize

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.head_dim, self.state_size)

    @property
    def ssm_bytes(self) -> int:
        return self.num_heads * self.head_dim * self.state_size * self.ssm_dtype.itemsize

    @property
    def bytes_per_sequence(self) -> int:
        return self.conv_bytes + self.ssm_bytes


@dataclass(frozen=True, kw_only=True)
class MambaSpec:
    """What one Mamba2 mixer needs to know (a family's config builds it)."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    chunk_size: int
    use_conv_bias: bool
    proj_bias: bool
    time_step_limit: tuple[float, float]
    norm_eps: float
    # the output: a grouped RMSNorm of y gated by z (`norm_before_gate` off: norm(y * silu(z)), on:
    # norm(y) * silu(z)), or with `rms_norm` off y * silu(z) and no norm weight; out_proj's bias when it
    # differs from in_proj's
    rms_norm: bool = True
    norm_before_gate: bool = False
    out_bias: bool | None = None
    # stochastic rounding of a float16 SSM pool: on/off, Philox rounds, the stream's seed
    ssm_stochastic_rounding: bool = False
    ssm_philox_rounds: int = 10
    ssm_rounding_seed: int = 0

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_groups * self.state_size

    @property
    def in_proj_size(self) -> int:
        return self.d_inner + self.conv_dim + self.num_heads

    def cache_spec(
        self, *, conv_dtype: torch.dtype, ssm_dtype: torch.dtype, stochastic_rounding: bool = False
    ) -> MambaCacheSpec:
        return MambaCacheSpec(
            n_groups=self.n_groups,
            conv_width=self.conv_kernel - 1,
            conv_dtype=conv_dtype,
            num_heads=self.num_heads,
            head_dim=self.head_dim,
            state_size=self.state_size,
            ssm_dtype=ssm_dtype,
            ssm_stochastic_rounding=stochastic_rounding,
        )

    def sharding_problems(self, tp: int) -> list[str]:
        """Why this mixer cannot split over tp ranks (empty when it can)."""
        out = divides("mamba heads", self.num_heads, tp)
        if self.rms_norm and self.norm_before_gate and self.n_groups % tp:
            out.append(
                f"the Mamba norm before the gate runs per B/C group: mamba_n_groups ({self.n_groups}) "
                f"must be divisible by tp_size ({tp})"
            )
        return out + splits_or_replicates("Mamba B/C groups (n_groups)", self.n_groups, tp)

    @property
    def has_out_bias(self) -> bool:
        return self.proj_bias if self.out_bias is None else self.out_bias

    def num_parameters(self) -> int:
        h, inner, heads = self.hidden_size, self.d_inner, self.num_heads
        n = (
            h * self.in_proj_size
            + self.conv_dim * self.conv_kernel
            + (self.conv_dim if self.use_conv_bias else 0)
        )
        n += 3 * heads + (inner if self.rms_norm else 0) + inner * h
        return n + (self.in_proj_size if self.proj_bias else 0) + (h if self.has_out_bias else 0)


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """Rotary position embedding (the half-split form): the first `rotary_dim` channels of each query and key
    head rotate by position * theta^(-2i / rotary_dim); the rest pass through."""

    theta: float
    rotary_dim: int

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """[rotary_dim / 2] float32."""
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.int64, device=device).float() / self.rotary_dim
        return 1.0 / (self.theta**exps)


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """What one GQA attention layer needs to know. `scale` multiplies q.k (head_dim^-0.5 unless the family
    sets it: Granite's attention_multiplier); `rope` None is NoPE (positions come from the Mamba layers);
    `key_multiplier` scales the projected keys (Falcon-H1)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bias: bool = False
    out_bias: bool | None = None  # o_proj's bias when it differs from q/k/v's
    scale: float | None = None
    rope: RopeSpec | None = None
    key_multiplier: float = 1.0

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5 if self.scale is None else self.scale

    def cache_spec(self, dtype: torch.dtype) -> AttentionCacheSpec:
        return AttentionCacheSpec(num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=dtype)

    def flops_per_pair(self) -> int:
        """FLOPs of one query token against one context token (Q K^T and P V, a multiply-add each)."""
        return 4 * self.num_heads * self.head_dim

    def sharding_problems(self, tp: int) -> list[str]:
        out = divides("num_attention_heads", self.num_heads, tp)
        return out + splits_or_replicates("num_key_value_heads", self.num_kv_heads, tp)

    def num_parameters(self) -> int:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = self.hidden_size * (2 * q + 2 * kv)
        out_bias = self.bias if self.out_bias is None else self.out_bias
        return n + ((q + 2 * kv) if self.bias else 0) + (self.hidden_size if out_bias else 0)


@dataclass(frozen=True, kw_only=True)
class MoESpec:
    """A sigmoid-routed MoE layer with relu^2 experts (Nemotron 3): score-correction bias, grouped top-k,
    normalised top-k weights times `routed_scaling_factor`, a shared expert and optionally a latent
    projection that runs the routed experts in `latent_size` dimensions."""

    hidden_size: int
    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int
    latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    bias: bool = False


@dataclass(frozen=True)
class CacheLayout:
    """Every cache-holding layer of a model and what it stores: the tensors behind the pools
    (`cache_tensors.py`) and the byte counts the capacity plan sizes from."""

    attention: dict[int, AttentionCacheSpec] = field(default_factory=dict)
    recurrent: Mapping[int, RecurrentCacheSpec] = field(default_factory=dict)

    def for_rank(self, tp: int) -> CacheLayout:
        """One rank's share under tensor parallelism (tp 1: this layout)."""
        if tp == 1:
            return self
        return CacheLayout(
            attention={i: s.for_rank(tp) for i, s in self.attention.items()},
            recurrent={i: s.for_rank(tp) for i, s in self.recurrent.items()},
        )

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.attention.values())

    @property
    def state_bytes_per_sequence(self) -> int:
        return sum(s.bytes_per_sequence for s in self.recurrent.values())


def divides(what: str, value: int, tp: int, knob: str = "tp_size") -> list[str]:
    """[] when `tp` divides `value`, else the problem in words."""
    if value % tp:
        return [f"{what} ({value}) is not divisible by {knob} ({tp}): they are split over the ranks"]
    return []


def splits_or_replicates(what: str, value: int, tp: int) -> list[str]:
    """[] when `value` units split over tp ranks or divide tp (replicated), else the problem in words."""
    if value % tp and tp % value:
        return [
            f"{what} ({value}) and tp_size ({tp}) do not fit: they are split when tp_size divides them and "
            "replicated when they divide tp_size"
        ]
    return []
