"""A toy model family, defined outside `hyserve/` on the model layer's seams only: a gated linear-attention
mixer whose per-sequence state is [heads, key_dim, value_dim] (gated DeltaNet's layout; its update is the
simpler additive one), beside the shared attention, gated MLP and decoder LM. It proves a family with its own
recurrent state plugs in with no change to the engine, the cache or the capacity plan: it describes its state
with its own `RecurrentCacheSpec`, writes its own snapshots, and registers itself.

    per head:  S_t = a_t S_{t-1} + k_t v_t^T   [key_dim, value_dim],  a_t = exp(-softplus(g_t))
               o_t = q_t S_t                    [value_dim]
    q, k, v:   silu of a short causal conv (width conv_kernel) over in_proj's [q | k | v] channels

`reference_logits` runs the whole model over a sequence from nothing, with no cache: every mixer's recurrence
from a zero state, attention as plain causal attention over the layer's own projections.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.model.attention import Attention
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.family import Family
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.gated_mlp import GatedMLP
from hyserve.model.hybrid_lm import DECODER_KERNEL_OPS, DecoderLayer, HybridDecoderLM, meta_weight_bytes
from hyserve.model.layer_specs import AttentionSpec, CacheLayout
from hyserve.model.norm import RMSNorm
from hyserve.model.quant_config import QuantConfig
from hyserve.model.weights import HubNames

RECURRENT, ATTENTION = "recurrent", "attention"


@dataclass(frozen=True, kw_only=True)
class ToyStateSpec:
    """The toy mixer's `RecurrentCacheSpec`: a conv window over [q | k | v] and a [heads, K, V] state."""

    num_heads: int
    key_dim: int
    value_dim: int
    conv_width: int
    conv_dtype: torch.dtype
    ssm_dtype: torch.dtype

    @property
    def conv_dim(self) -> int:
        return self.num_heads * (2 * self.key_dim + self.value_dim)

    @property
    def state_shape(self) -> tuple[int, ...]:
        return (self.num_heads, self.key_dim, self.value_dim)

    @property
    def bytes_per_sequence(self) -> int:
        return (
            self.conv_dim * self.conv_width * self.conv_dtype.itemsize
            + math.prod(self.state_shape) * self.ssm_dtype.itemsize
        )

    def for_rank(self, tp: int) -> ToyStateSpec:
        assert tp == 1, "the toy family runs at tp_size 1"
        return self


@dataclass(frozen=True, kw_only=True)
class ToyRecurrentConfig:
    layer_types: tuple[str, ...]
    attention: AttentionSpec
    vocab_size: int = 300
    hidden_size: int = 32
    num_heads: int = 2
    key_dim: int = 6
    value_dim: int = 10
    conv_kernel: int = 4
    intermediate_size: int = 48
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (0,)
    max_position_embeddings: int = 4096
    chunk_size: int = 8
    dtype: torch.dtype = torch.float32
    ssm_cache_dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None
    quant: QuantConfig | None = None
    time_step_min: float = 0.001
    name: str = ""

    @classmethod
    def from_dict(cls, raw: dict[str, Any], *, name: str = "") -> ToyRecurrentConfig:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        head_dim = hidden // heads
        attention = AttentionSpec(
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(raw["num_key_value_heads"]),
            head_dim=head_dim,
            bias=False,
        )
        keys = (
            "vocab_size",
            "num_heads_recurrent",
            "key_dim",
            "value_dim",
            "conv_kernel",
            "intermediate_size",
        )
        got = {k: int(raw[k]) for k in keys if k in raw}
        got["num_heads"] = got.pop("num_heads_recurrent", 2)
        return cls(
            layer_types=tuple(raw["layer_types"]),
            attention=attention,
            hidden_size=hidden,
            name=name,
            **got,
        )

    # ---- ModelSpec ---------------------------------------------------------------------------------
    @property
    def num_attention_heads(self) -> int:
        return self.attention.num_heads

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == ATTENTION)

    @property
    def recurrent_layer_ids(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == RECURRENT)

    @property
    def has_recurrent_state(self) -> bool:
        return bool(self.recurrent_layer_ids)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.cache_layout().kv_bytes_per_token

    @property
    def state_bytes_per_sequence(self) -> int:
        return self.cache_layout().state_bytes_per_sequence

    @property
    def attention_flops_per_pair(self) -> int:
        return len(self.attention_layer_ids) * self.attention.flops_per_pair()

    def num_parameters(self) -> int:
        return meta_weight_bytes(ToyRecurrentForCausalLM(self, device="meta")) // self.dtype.itemsize

    def describe(self) -> str:
        return f"{len(self.layer_types)} layers (toy recurrent [heads, K, V] state)"

    # ---- what the shared machinery asks --------------------------------------------------------------
    def cache_layout(self) -> CacheLayout:
        state = ToyStateSpec(
            num_heads=self.num_heads,
            key_dim=self.key_dim,
            value_dim=self.value_dim,
            conv_width=self.conv_kernel - 1,
            conv_dtype=self.dtype,
            ssm_dtype=self.ssm_cache_dtype,
        )
        kv = self.attention.cache_spec(self.kv_cache_dtype or self.dtype)
        return CacheLayout(
            attention=dict.fromkeys(self.attention_layer_ids, kv),
            recurrent=dict.fromkeys(self.recurrent_layer_ids, state),
        )

    def init_rule(self, name: str) -> tuple[str, float]:
        if name.endswith(("norm.weight", "layernorm.weight")):
            return "ones", 0.0
        if name.endswith("conv1d.weight"):
            return "normal", 1.0 / math.sqrt(self.conv_kernel)
        if name.endswith(".weight"):
            return "normal", 0.2
        raise ValueError(f"no init rule for {name!r}")

    def sharding_problems(self, *, tp_size: int, ep_size: int) -> list[str]:
        return [] if tp_size == 1 and ep_size == 1 else ["the toy recurrent family runs at tp_size 1"]

    def with_quant(self, quant: QuantConfig | None) -> ToyRecurrentConfig:
        if quant is not None:
            raise ValueError("quantization: the toy recurrent family has 16-bit projections only")
        return self

    def with_cache_dtypes(
        self,
        *,
        ssm_cache_dtype: str | torch.dtype | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        ssm_stochastic_rounding: bool | None = None,
        ssm_philox_rounds: int | None = None,
        ssm_rounding_seed: int | None = None,
    ) -> ToyRecurrentConfig:
        if ssm_stochastic_rounding:
            raise ValueError("the toy recurrent family writes its state with round-to-nearest only")
        ssm = self.ssm_cache_dtype
        if isinstance(ssm_cache_dtype, torch.dtype):
            ssm = ssm_cache_dtype
        elif ssm_cache_dtype not in (None, "auto"):
            ssm = getattr(torch, str(ssm_cache_dtype))
        kv = self.kv_cache_dtype if kv_cache_dtype is None else kv_cache_dtype
        return dataclasses.replace(self, ssm_cache_dtype=ssm, kv_cache_dtype=kv)


class ToyDeltaMixer(nn.Module):
    """The gated linear-attention mixer (module docstring), on the step's state slots."""

    def __init__(self, cfg: ToyRecurrentConfig, layer_id: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.h, self.k, self.v = cfg.num_heads, cfg.key_dim, cfg.value_dim
        self.conv_dim = self.h * (2 * self.k + self.v)
        kw = {"device": device, "dtype": dtype}
        self.in_proj = nn.Linear(cfg.hidden_size, self.conv_dim + self.h, bias=False, **kw)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, cfg.conv_kernel, **kw))
        self.out_proj = nn.Linear(self.h * self.v, cfg.hidden_size, bias=False, **kw)

    def _token(
        self, x: torch.Tensor, g: torch.Tensor, conv: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token: x [conv_dim], g [heads], conv [conv_dim, width], state [heads, K, V] (float32) ->
        (o [heads * V], the new conv window, the new state)."""
        window = torch.cat([conv, x[:, None]], dim=1)
        c = F.silu((window * self.conv1d.weight).sum(-1))
        q, k, v = c.split([self.h * self.k, self.h * self.k, self.h * self.v])
        q, k, v = q.view(self.h, self.k), k.view(self.h, self.k), v.view(self.h, self.v)
        decay = torch.exp(-F.softplus(g.float()))
        state = decay[:, None, None] * state + k.float()[:, :, None] * v.float()[:, None, :]
        o = torch.einsum("hk,hkv->hv", q.float(), state)
        return o.reshape(-1).to(x.dtype), window[:, 1:], state

    def forward(self, hidden: torch.Tensor, meta: ForwardMeta, cache: CacheTensors) -> torch.Tensor:
        proj = self.in_proj(hidden)
        xs, g = proj.split([self.conv_dim, self.h], dim=-1)
        return self.out_proj(meta.run_core(self.core, cache, xs, g))

    def core(self, meta: ForwardMeta, cache: CacheTensors, xs: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if meta.decode_width != 1:
            raise NotImplementedError("the toy mixer has no speculative verification")
        conv_pool, state_pool = cache.conv[self.layer_id], cache.ssm[self.layer_id]
        out = torch.empty(xs.shape[0], self.h * self.v, dtype=xs.dtype, device=xs.device)
        cu = meta.cu_seqlens
        fresh = (~meta.has_initial_state).tolist()
        src, dst = meta.state_src.tolist(), meta.state_dst.tolist()
        for s in range(len(cu) - 1):
            conv = conv_pool[src[s]].clone() if not fresh[s] else conv_pool.new_zeros(conv_pool.shape[1:])
            state = state_pool[src[s]].float() if not fresh[s] else torch.zeros(state_pool.shape[1:])
            snaps = {sw.num_tokens: sw.slot for sw in meta.snapshots if sw.seq == s}
            for j in range(cu[s + 1] - cu[s]):
                r = cu[s] + j
                out[r], conv, state = self._token(xs[r], g[r], conv, state)
                if j + 1 in snaps:
                    conv_pool[snaps[j + 1]] = conv
                    state_pool[snaps[j + 1]] = state.to(state_pool.dtype)
            conv_pool[dst[s]] = conv
            state_pool[dst[s]] = state.to(state_pool.dtype)
        return out

    def reference(self, hidden: torch.Tensor) -> torch.Tensor:
        """The whole sequence from a zero state, no cache: [n, hidden] -> [n, hidden]."""
        proj = self.in_proj(hidden)
        xs, g = proj.split([self.conv_dim, self.h], dim=-1)
        conv = torch.zeros(self.conv_dim, self.conv1d.weight.shape[1] - 1, dtype=xs.dtype)
        state = torch.zeros(self.h, self.k, self.v)
        outs = []
        for r in range(xs.shape[0]):
            o, conv, state = self._token(xs[r], g[r], conv, state)
            outs.append(o)
        return self.out_proj(torch.stack(outs))


def attention_reference(attn: Attention, hidden: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention over the layer's own projections (NoPE), no cache."""
    n = hidden.shape[0]
    q = attn.q_proj(hidden).view(n, attn.num_heads, attn.head_dim).transpose(0, 1)
    k = attn.k_proj(hidden).view(n, attn.num_kv_heads, attn.head_dim).transpose(0, 1)
    v = attn.v_proj(hidden).view(n, attn.num_kv_heads, attn.head_dim).transpose(0, 1)
    rep = attn.num_heads // attn.num_kv_heads
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
    return attn.o_proj(o.transpose(0, 1).reshape(n, -1))


class ToyLayer(DecoderLayer):
    def __init__(self, cfg: ToyRecurrentConfig, i: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.layer_types[i] == RECURRENT:
            self.mixer = ToyDeltaMixer(cfg, i, **kw)
        else:
            self.mixer = Attention(cfg.attention, layer_id=i, **kw)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, False, **kw)
        self.bind(norm1="input_layernorm", mixer="mixer", norm2="post_layernorm", ffn="mlp")


class ToyRecurrentForCausalLM(HybridDecoderLM):
    config: ToyRecurrentConfig  # type: ignore[assignment]

    def __init__(self, cfg: ToyRecurrentConfig, *, device=None, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or cfg.dtype
        cfg = cfg if dtype == cfg.dtype else dataclasses.replace(cfg, dtype=dtype)
        super().__init__(cfg, device=device, dtype=dtype)  # type: ignore[arg-type]
        layers = [ToyLayer(cfg, i, device=device, dtype=dtype) for i in range(len(cfg.layer_types))]
        self.set_layers(list(layers), "norm", device=device, dtype=dtype)

    @property
    def checkpoint_names(self) -> HubNames:
        return HubNames(r"model\.layers\.(\d+)\.mixer")

    @torch.no_grad()
    def reference_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits of every position of `ids` from nothing (module docstring)."""
        x = self.model.embed_tokens(torch.tensor(ids))
        for layer in self._layers():
            norm1, mixer, norm2, ffn = layer.parts()
            y = norm1(x)
            y = attention_reference(mixer, y) if isinstance(mixer, Attention) else mixer.reference(y)
            x = x + y
            x = x + ffn(norm2(x))
        return self.compute_logits(self._final_norm[0](x))


TOY_RECURRENT = Family(
    name="toy_recurrent",
    model_types=("toy_recurrent",),
    architectures=("ToyRecurrentForCausalLM",),
    config_type=ToyRecurrentConfig,
    model_type=ToyRecurrentForCausalLM,
    parse=lambda raw, name: ToyRecurrentConfig.from_dict(raw, name=name),
    build_model=lambda cfg, dtype: ToyRecurrentForCausalLM(cfg, dtype=dtype),
    weight_bytes_of=lambda cfg, dtype: meta_weight_bytes(
        ToyRecurrentForCausalLM(cfg, device="meta", dtype=dtype)
    ),
    kernel_ops=DECODER_KERNEL_OPS,
)
