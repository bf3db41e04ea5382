"""FalconH1ForCausalLM's module tree, named as its checkpoints are:

    model.embed_tokens, model.layers.{i}.{input_layernorm, mamba, self_attn, pre_ff_layernorm,
    feed_forward.{gate_proj, up_proj, down_proj}}, model.final_layernorm, lm_head

Each layer holds both a KV cache (its attention) and a Mamba state slot (its mixer), under the layer's index.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from hyserve.kernels import ops
from hyserve.kernels.ops import KernelOp
from hyserve.model.attention import Attention
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.falcon_h1.config import FalconH1Config
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.gated_mlp import GatedMLP
from hyserve.model.hybrid_lm import DECODER_KERNEL_OPS, DecoderLayer, HybridDecoderLM, RopeTables
from hyserve.model.layer_specs import MambaSpec
from hyserve.model.mamba2 import Mamba2Mixer
from hyserve.model.norm import RMSNorm
from hyserve.model.weights import HubNames

NAMES = HubNames(r"model\.layers\.(\d+)\.self_attn")

# rmsnorm_gated: the Mamba output normed before its gate (mamba_norm_before_gate)
KERNEL_OPS: tuple[KernelOp, ...] = (*DECODER_KERNEL_OPS, ops.rmsnorm_gated)


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba2 mixer with in_proj's z / x / B / C / dt rows scaled by `ssm_multipliers` (this rank's rows
    of each part)."""

    def __init__(
        self, spec: MambaSpec, multipliers: tuple[float, ...], *, layer_id: int, device=None, dtype=None
    ) -> None:
        super().__init__(spec, layer_id=layer_id, device=device, dtype=dtype)
        gn = self.n_groups * self.state_size
        sizes = (self.d_inner, self.d_inner, gn, gn, self.num_heads)
        self._row_multipliers = torch.cat(
            [torch.full((n,), m, device="cpu") for n, m in zip(sizes, multipliers)]
        )
        self._scaled = any(m != 1.0 for m in multipliers)
        self._mup: torch.Tensor | None = None

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        zxbcdt = self.in_proj(hidden)
        if not self._scaled:
            return zxbcdt
        mup = self._mup
        if mup is None or mup.device != zxbcdt.device or mup.dtype != zxbcdt.dtype:
            mup = self._mup = self._row_multipliers.to(zxbcdt.device, zxbcdt.dtype)
        return zxbcdt * mup


class FalconH1MLP(GatedMLP):
    """down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier."""

    def __init__(self, cfg: FalconH1Config, *, device=None, dtype=None) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, device=device, dtype=dtype)
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers

    def forward(self, x: torch.Tensor, meta: object = None, cache: object = None) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        y = self.down_proj(self.up_proj(x) * F.silu(gate))
        return y * self.down_multiplier if self.down_multiplier != 1.0 else y


def _scaled(x: torch.Tensor, m: float) -> torch.Tensor:
    return x * m if m != 1.0 else x


class FalconH1DecoderLayer(DecoderLayer):
    def __init__(self, cfg: FalconH1Config, i: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mamba = FalconH1Mixer(cfg.mamba, cfg.ssm_multipliers, layer_id=i, **kw)
        self.self_attn = Attention(cfg.attention, layer_id=i, **kw)
        self.feed_forward = FalconH1MLP(cfg, **kw)
        self.bind(norm1="input_layernorm", mixer="mamba", norm2="pre_ff_layernorm", ffn="feed_forward")
        self.multipliers = (
            cfg.ssm_in_multiplier,
            cfg.ssm_out_multiplier,
            cfg.attention_in_multiplier,
            cfg.attention_out_multiplier,
        )

    def attention(self) -> Attention:
        return self.self_attn

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: ForwardMeta,
        cache: CacheTensors,
        rope: RopeTables,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mamba2 and attention on the same normed input, their scaled outputs summed into the residual;
        then the MLP. Returns (the MLP's output, the residual stream before its add)."""
        y, h = self.input_layernorm.residual_forward(x, residual)
        ssm_in, ssm_out, attn_in, attn_out = self.multipliers
        m = _scaled(self.mamba(_scaled(y, ssm_in), meta, cache), ssm_out)
        a = _scaled(self.self_attn(_scaled(y, attn_in), meta, cache, rope), attn_out)
        y, h = self.pre_ff_layernorm.add_forward(m + a, h)
        return self.feed_forward(y), h


class FalconH1ForCausalLM(HybridDecoderLM):
    config: FalconH1Config

    def __init__(self, cfg: FalconH1Config, *, device=None, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or cfg.dtype
        cfg = cfg if dtype == cfg.dtype else dataclasses.replace(cfg, dtype=dtype)
        super().__init__(
            cfg,
            embedding_multiplier=cfg.embedding_multiplier,
            logits_multiplier=cfg.lm_head_multiplier,
            device=device,
            dtype=dtype,
        )
        layers = [FalconH1DecoderLayer(cfg, i, device=device, dtype=dtype) for i in range(cfg.num_layers)]
        self.set_layers(list(layers), "final_layernorm", device=device, dtype=dtype)

    @property
    def checkpoint_names(self) -> HubNames:
        return NAMES
