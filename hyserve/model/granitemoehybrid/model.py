"""GraniteMoeHybridForCausalLM's module tree, named as its checkpoints are:

    model.embed_tokens, model.layers.{i}.{input_layernorm, mamba | self_attn, post_attention_layernorm,
    shared_mlp.{input_linear, output_linear}, block_sparse_moe.{router.layer, input_linear, output_linear}},
    model.norm, lm_head

Newer exporters spell the MoE tensors block_sparse_moe.experts.gate_up_proj / .down_proj and
block_sparse_moe.router.weight; they load as the same tensors.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hyserve.kernels import ops
from hyserve.kernels.ops import KernelOp
from hyserve.model.attention import Attention
from hyserve.model.config import LAYER_MAMBA
from hyserve.model.gated_mlp import MergedGatedMLP
from hyserve.model.granitemoehybrid.config import GraniteMoeHybridConfig
from hyserve.model.hybrid_lm import DECODER_KERNEL_OPS, DecoderLayer, HybridDecoderLM
from hyserve.model.mamba2 import Mamba2Mixer
from hyserve.model.norm import RMSNorm
from hyserve.model.softmax_moe import SoftmaxTopkMoE
from hyserve.model.weights import HubNames

NAMES = HubNames(
    r"model\.layers\.(\d+)\.self_attn",
    aliases={
        "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
        "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight",
        "block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
    },
)

KERNEL_OPS: tuple[KernelOp, ...] = (*DECODER_KERNEL_OPS, ops.router_logits, ops.moe_experts_silu)


class GraniteMoeHybridDecoderLayer(DecoderLayer):
    def __init__(self, cfg: GraniteMoeHybridConfig, i: int, *, device=None, dtype=None) -> None:
        super().__init__(cfg.residual_multiplier)
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        mixer = "mamba" if cfg.layer_types[i] == LAYER_MAMBA else "self_attn"
        if mixer == "mamba":
            self.mamba = Mamba2Mixer(cfg.mamba, layer_id=i, **kw)
        else:
            self.self_attn = Attention(cfg.attention, layer_id=i, **kw)
        self.shared_mlp = MergedGatedMLP(cfg.hidden_size, cfg.shared_intermediate_size, **kw)
        self.block_sparse_moe: SoftmaxTopkMoE | None = None
        if cfg.num_local_experts:
            self.block_sparse_moe = SoftmaxTopkMoE(
                cfg.hidden_size, cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size, **kw
            )
        self.bind(norm1="input_layernorm", mixer=mixer, norm2="post_attention_layernorm", ffn="shared_mlp")

    def run_ffn(self, ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = ffn(x)
        return y if self.block_sparse_moe is None else self.block_sparse_moe(x) + y


class GraniteMoeHybridForCausalLM(HybridDecoderLM):
    config: GraniteMoeHybridConfig

    def __init__(self, cfg: GraniteMoeHybridConfig, *, device=None, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or cfg.dtype
        cfg = cfg if dtype == cfg.dtype else dataclasses.replace(cfg, dtype=dtype)
        super().__init__(
            cfg,
            embedding_multiplier=cfg.embedding_multiplier,
            logits_scaling=cfg.logits_scaling,
            device=device,
            dtype=dtype,
        )
        layers = [
            GraniteMoeHybridDecoderLayer(cfg, i, device=device, dtype=dtype) for i in range(cfg.num_layers)
        ]
        self.set_layers(list(layers), "norm", device=device, dtype=dtype)
        if cfg.quant is not None and not cfg.quant.from_checkpoint:  # FP8 at load: the routed experts too
            for layer in layers:
                if layer.block_sparse_moe is not None:
                    layer.block_sparse_moe.to_fp8()

    @property
    def has_routed_experts(self) -> bool:
        return self.config.num_local_experts > 0

    @property
    def checkpoint_names(self) -> HubNames:
        return NAMES
