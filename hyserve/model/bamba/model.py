"""BambaForCausalLM's module tree, named as its checkpoints are:

model.embed_tokens, model.layers.{i}.{input_layernorm, mamba | self_attn, pre_ff_layernorm, feed_forward},
model.final_layernorm, lm_head
"""

from __future__ import annotations

import dataclasses

import torch

from hyserve.kernels.ops import KernelOp
from hyserve.model.attention import Attention
from hyserve.model.bamba.config import BambaConfig
from hyserve.model.config import LAYER_MAMBA
from hyserve.model.gated_mlp import GatedMLP
from hyserve.model.hybrid_lm import DECODER_KERNEL_OPS, DecoderLayer, HybridDecoderLM
from hyserve.model.mamba2 import Mamba2Mixer
from hyserve.model.norm import RMSNorm
from hyserve.model.weights import HubNames

NAMES = HubNames(r"model\.layers\.(\d+)\.self_attn")

KERNEL_OPS: tuple[KernelOp, ...] = DECODER_KERNEL_OPS


class BambaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: BambaConfig, i: int, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        mixer = "mamba" if cfg.layer_types[i] == LAYER_MAMBA else "self_attn"
        if mixer == "mamba":
            self.mamba = Mamba2Mixer(cfg.mamba, layer_id=i, **kw)
        else:
            self.self_attn = Attention(cfg.attention, layer_id=i, **kw)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, **kw)
        self.bind(norm1="input_layernorm", mixer=mixer, norm2="pre_ff_layernorm", ffn="feed_forward")


class BambaForCausalLM(HybridDecoderLM):
    config: BambaConfig

    def __init__(self, cfg: BambaConfig, *, device=None, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or cfg.dtype
        cfg = cfg if dtype == cfg.dtype else dataclasses.replace(cfg, dtype=dtype)
        super().__init__(cfg, device=device, dtype=dtype)
        layers = [BambaDecoderLayer(cfg, i, device=device, dtype=dtype) for i in range(cfg.num_layers)]
        self.set_layers(list(layers), "final_layernorm", device=device, dtype=dtype)

    @property
    def checkpoint_names(self) -> HubNames:
        return NAMES
