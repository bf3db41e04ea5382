"""The NemotronH causal LM, built from the config's layer list, running on packed variable-length
batches over the paged KV pool and the Mamba state-slot pool.

Each block is pre-norm + mixer + residual; the mixer is one of Mamba2, attention, MLP or MoE:

    h = embed(ids);  for block: h = h + mixer(rmsnorm(h));  logits = lm_head(rmsnorm_f(h))

A block's residual add runs fused with the next norm (`add_rms_norm`: one kernel on CUDA), so a block
returns its mixer output and the residual stream it was given, and the next norm (or norm_f) adds them.

Tensor parallel (docs/architecture.md, "Parallelism"): the layers take their group from
`hyserve.distributed` when built (so `init_distributed` comes first); the embedding and lm_head are
vocab-parallel, every rank ends a step with the same residual stream and the whole vocabulary's logits,
and `allocate_cache` gives this rank's share of the pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from hyserve.distributed import tp_group
from hyserve.kernels import ops
from hyserve.model.attention import Attention
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.config import LAYER_ATTENTION, LAYER_MAMBA, LAYER_MLP, LAYER_MOE
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.fp8_weights import convert_linears
from hyserve.model.kernel_buckets import kernel_token_buckets
from hyserve.model.mamba2 import Mamba2Mixer
from hyserve.model.mlp import MLP
from hyserve.model.moe import MoE
from hyserve.model.nemotron_h.checkpoint import NAMES, NAMES_MTP, NemotronHNames
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.mtp import NemotronHMTP
from hyserve.model.norm import RMSNorm
from hyserve.model.parallel_embedding import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_logits

# every kernel op these layers may call (the family's `kernel_ops`): on CUDA, start-up fails naming any of
# them without a CUDA implementation; a test checks the list against the lookups of the tiny models' forwards
KERNEL_OPS: tuple[ops.Op[..., Any], ...] = (
    ops.rms_norm,
    ops.add_rms_norm,
    ops.rmsnorm_gated,
    ops.linear,
    ops.gated_norm_linear,
    ops.relu2_linear,
    ops.fp8_linear,
    ops.fp8_relu2_linear,
    ops.ssd,
    ops.conv1d_varlen,
    ops.conv1d_update,
    ops.ssm_update,
    ops.store_ssm_state,
    ops.write_kv,
    ops.paged_attention,
    ops.router_logits,
    ops.moe_route,
    ops.moe_experts,
)


def _mamba(cfg: HybridModelConfig, i: int, **kw) -> nn.Module:
    return Mamba2Mixer(cfg.mamba_spec(), layer_id=i, **kw)


def _attention(cfg: HybridModelConfig, i: int, **kw) -> nn.Module:
    return Attention(cfg.attention_spec(), layer_id=i, **kw)


def _mlp(cfg: HybridModelConfig, i: int, **kw) -> nn.Module:
    return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, **kw)


def _moe(cfg: HybridModelConfig, i: int, **kw) -> nn.Module:
    return MoE(cfg.moe_spec(), **kw)


# layer kind -> mixer builder; every mixer is called as mixer(x, meta, cache)
MIXERS: dict[str, Callable[..., nn.Module]] = {
    LAYER_MAMBA: _mamba,
    LAYER_ATTENTION: _attention,
    LAYER_MLP: _mlp,
    LAYER_MOE: _moe,
}


class HybridBlock(nn.Module):
    def __init__(self, cfg: HybridModelConfig, layer_id: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.kind = cfg.layer_types[layer_id]
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, device=device, dtype=dtype)
        if self.kind not in MIXERS:  # HybridModelConfig.validate rejects anything else
            raise ValueError(f"unknown layer type {self.kind!r}")
        self.mixer = MIXERS[self.kind](cfg, layer_id, device=device, dtype=dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: ForwardMeta, cache: CacheTensors
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous block's mixer output (or the embeddings when residual is None), residual: the
        stream before that block's add. Returns (this block's mixer output, its residual stream)."""
        y, h = self.norm.residual_forward(x, residual)
        return self.mixer(y, meta, cache), h


class Backbone(nn.Module):
    def __init__(self, cfg: HybridModelConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            HybridBlock(cfg, i, device=device, dtype=dtype) for i in range(cfg.num_layers)
        )
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, device=device, dtype=dtype)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, cfg: HybridModelConfig, *, device=None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = dtype or cfg.dtype
        # the config records the dtype the model actually runs in (cache sizing reads it)
        self.config = cfg if dtype == cfg.dtype else dataclasses.replace(cfg, dtype=dtype)
        self.backbone = Backbone(cfg, device=device, dtype=dtype)
        self.lm_head: ParallelLMHead | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.tp = tp_group()
        # FP8 projections (cfg.quant): e4m3 weights + float32 scales in place of the 16-bit weights
        convert_linears(self, cfg.quant)
        # the MTP block, when speculative decoding drafts with it: built after the conversion above, so it
        # stays 16-bit (as NVIDIA's FP8 checkpoints ship it)
        self.mtp: NemotronHMTP | None = None
        if cfg.use_mtp:
            self.mtp = NemotronHMTP(self.config, MIXERS, device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta, cache: CacheTensors) -> torch.Tensor:
        """input_ids: [T] packed new tokens -> final-normed hidden states [T, hidden]."""
        x = self.backbone.embeddings(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.backbone.layers:
            x, residual = layer(x, residual, meta, cache)
        if residual is None:  # no layers
            return self.backbone.norm_f(x)
        return self.backbone.norm_f.add_forward(x, residual)[0]

    @torch.inference_mode()
    def mtp_forward(
        self, next_ids: torch.Tensor, hidden: torch.Tensor, meta: ForwardMeta, cache: CacheTensors
    ) -> torch.Tensor:
        """One pass of the MTP block (nemotron_h/mtp.py): next_ids [T] the token after each position, hidden
        [T, d] the final-normed hidden states at those positions -> the block's output [T, d], whose logits
        (`compute_logits`) predict the token after next."""
        if self.mtp is None:
            raise RuntimeError("this model was built without its MTP block (config.use_mtp is off)")
        return self.mtp(self.backbone.embeddings(next_ids), hidden, meta, cache)

    @property
    def checkpoint_names(self) -> NemotronHNames:
        return NAMES_MTP if self.mtp is not None else NAMES

    def attention_layers(self) -> Mapping[int, Attention]:
        """Every attention layer by its cache layer id: the backbone's, then the MTP block's."""
        out = {i: m.mixer for i, m in enumerate(self.backbone.layers) if isinstance(m.mixer, Attention)}
        if self.mtp is not None:
            ids = self.config.mtp_layer_ids
            out.update(
                {ids[j]: m.mixer for j, m in enumerate(self.mtp.layers) if isinstance(m.mixer, Attention)}
            )
        return out

    def finish_load(self) -> None:
        self.pack_weights()

    def pack_weights(self) -> int:
        """Layouts for serving, once the weights are in place on their device: each attention layer's q, k and
        v weights in one buffer (`Attention.pack_qkv`). Returns how many layers were packed."""
        return sum(m.pack_qkv() for m in self.modules() if isinstance(m, Attention))

    @property
    def graph_capturable(self) -> bool:
        """A decode step's kernels and shapes do not depend on host values on CUDA (the MoE layers route,
        sort and run their experts on the device into fixed-size buffers)."""
        return True

    def kernel_token_buckets(self, max_num_tokens: int) -> list[int]:
        """Step token counts whose kernel variants differ (MoE tile configs per token bucket, the FP8
        linears' launch forms): the warm-up runs a step of each."""
        return kernel_token_buckets(
            max_num_tokens, moe=LAYER_MOE in self.config.layer_types, fp8=self.config.quant is not None
        )

    def allocate_cache(
        self, *, num_blocks: int, tokens_per_block: int, num_slots: int, device: torch.device | str
    ) -> CacheTensors:
        """This rank's pools: under tensor parallelism they hold only its KV heads and Mamba heads /
        groups."""
        return CacheTensors.allocate(
            self.config.cache_layout().for_rank(self.tp.size),
            num_blocks=num_blocks,
            tokens_per_block=tokens_per_block,
            num_slots=num_slots,
            device=device,
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, H] -> logits [n, vocab] in float32 (the whole vocabulary on every rank); written into
        `out` ([n, vocab] float32) when given, so every decode graph shares one logits buffer."""
        w = self.backbone.embeddings.weight if self.lm_head is None else self.lm_head.weight
        logits = vocab_parallel_logits(hidden, w, self.config.vocab_size, self.tp)
        return logits.float() if out is None else out.copy_(logits)
