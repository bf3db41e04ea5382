"""The causal LM shared by the (mixer + feed-forward) hybrid families (Bamba, Granite-4.0-H): a family builds
its module tree (names as its checkpoints spell them) from `DecoderLayer`s and hands the parts to this base:

    h = embed(ids) * embedding_multiplier
    for layer:  h = h + m * mixer(norm1(h));  h = h + m * ffn(norm2(h))        (m: residual multiplier)
    logits = lm_head(final_norm(h)) * logits_multiplier / logits_scaling

Residual adds run fused with the next norm (`add_rms_norm`), as in NemotronH. A RoPE model computes the
step's (cos, sin) once per forward and hands them to every attention layer. A family whose layers run
attention and Mamba2 side by side (Falcon-H1) overrides the layer's `forward` and `attention`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from hyserve.distributed import tp_group
from hyserve.kernels import ops
from hyserve.kernels.ops import KernelOp
from hyserve.model.attention import Attention
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.fp8_weights import convert_linears
from hyserve.model.hybrid_config import HybridDecoderConfig
from hyserve.model.kernel_buckets import kernel_token_buckets
from hyserve.model.norm import RMSNorm
from hyserve.model.parallel_embedding import ParallelLMHead, VocabParallelEmbedding, vocab_parallel_logits
from hyserve.model.rope import rope_cos_sin

RopeTables = tuple[torch.Tensor, torch.Tensor] | None

# the kernel ops that the norms, the Mamba2 and attention mixers and the 16-bit projections of every family
# built on this base call; a family adds those of its feed-forward block
DECODER_KERNEL_OPS: tuple[KernelOp, ...] = (
    ops.rms_norm,
    ops.add_rms_norm,
    ops.linear,
    ops.gated_norm_linear,
    ops.ssd,
    ops.conv1d_varlen,
    ops.conv1d_update,
    ops.ssm_update,
    ops.store_ssm_state,
    ops.write_kv,
    ops.paged_attention,
    ops.fp8_linear,  # projections with FP8 weights (`quantization: fp8` or an FP8 checkpoint)
)


class DecoderLayer(nn.Module):
    """norm1 -> mixer -> residual, norm2 -> ffn -> residual. The family names the attributes (they are its
    checkpoint names) through `bind`."""

    def __init__(self, residual_multiplier: float = 1.0) -> None:
        super().__init__()
        self.residual_multiplier = residual_multiplier

    def bind(self, *, norm1: str, mixer: str, norm2: str, ffn: str) -> None:
        self._names = (norm1, mixer, norm2, ffn)

    def parts(self) -> tuple[RMSNorm, nn.Module, RMSNorm, nn.Module]:
        n1, mixer, n2, ffn = (getattr(self, n) for n in self._names)
        return n1, mixer, n2, ffn

    def run_ffn(self, ffn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return ffn(x)

    def attention(self) -> Attention | None:
        """This layer's attention mixer, if it has one."""
        mixer = self.parts()[1]
        return mixer if isinstance(mixer, Attention) else None

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: ForwardMeta,
        cache: CacheTensors,
        rope: RopeTables,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's (scaled) output, or the embeddings when residual is None. Returns (this
        layer's scaled feed-forward output, the residual stream before its add)."""
        norm1, mixer, norm2, ffn = self.parts()
        y, h = norm1.residual_forward(x, residual)
        y = mixer(y, meta, cache, rope) if isinstance(mixer, Attention) else mixer(y, meta, cache)
        m = self.residual_multiplier
        y, h = norm2.add_forward(y * m if m != 1.0 else y, h)
        y = self.run_ffn(ffn, y)
        return (y * m if m != 1.0 else y), h


class DecoderStack(nn.Module):
    """`model.`: the embedding, the layers and (added under the family's name) the final norm."""

    def __init__(self, embed_tokens: VocabParallelEmbedding) -> None:
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList()


class HybridDecoderLM(nn.Module):
    """The base of a family's model: `self.model` holds embed_tokens, layers and the final norm (named by the
    family), `self.lm_head` the output projection unless tied."""

    config: HybridDecoderConfig

    def __init__(
        self,
        cfg: HybridDecoderConfig,
        *,
        embedding_multiplier: float = 1.0,
        logits_multiplier: float = 1.0,
        logits_scaling: float = 1.0,
        device=None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = cfg
        self.embedding_multiplier = embedding_multiplier
        self.logits_multiplier = logits_multiplier
        self.logits_scaling = logits_scaling
        self.model = DecoderStack(
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        )
        self.lm_head: ParallelLMHead | None = None
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, device=device, dtype=dtype)
        self.tp = tp_group()
        self._final_norm: tuple[RMSNorm, ...] = ()  # a reference: the module is registered under its name

    def set_layers(self, layers: list[DecoderLayer], final_norm: str, device=None, dtype=None) -> None:
        cfg = self.config
        self.model.layers.extend(layers)
        norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device=device, dtype=dtype)
        self.model.add_module(final_norm, norm)
        self._final_norm = (norm,)
        # FP8 projections (cfg.quant): e4m3 weights + float32 scales in place of the 16-bit weights
        convert_linears(self, cfg.quant)

    def _layers(self) -> list[DecoderLayer]:
        return [m for m in self.model.layers if isinstance(m, DecoderLayer)]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: ForwardMeta, cache: CacheTensors) -> torch.Tensor:
        """input_ids: [T] packed new tokens -> final-normed hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        spec = self.config.attention.rope
        # (cos, sin) once per forward, unless the mixer cores run apart (piecewise graphs): then each
        # attention core computes its own from the step it is given
        once = self.config.attention_layer_ids and meta.cores is None
        rope = rope_cos_sin(spec, meta, x) if spec is not None and once else None
        residual: torch.Tensor | None = None
        for layer in self._layers():
            x, residual = layer(x, residual, meta, cache, rope)
        norm = self._final_norm[0]
        return norm(x) if residual is None else norm.add_forward(x, residual)[0]

    def attention_layers(self) -> Mapping[int, Attention]:
        out: dict[int, Attention] = {}
        for i, layer in enumerate(self._layers()):
            attention = layer.attention()
            if attention is not None:
                out[i] = attention
        return out

    def finish_load(self) -> None:
        for a in self.attention_layers().values():
            a.pack_qkv()

    @property
    def graph_capturable(self) -> bool:
        return True

    def kernel_token_buckets(self, max_num_tokens: int) -> list[int]:
        """Step token counts whose kernel variants differ (routed experts' tile configs, the FP8 linears'
        launch forms): the warm-up runs a step of each."""
        return kernel_token_buckets(
            max_num_tokens, moe=self.has_routed_experts, fp8=self.config.quant is not None
        )

    @property
    def has_routed_experts(self) -> bool:
        """Whether a layer runs routed experts (the grouped-GEMM kernels, by token bucket)."""
        return False

    def allocate_cache(
        self, *, num_blocks: int, tokens_per_block: int, num_slots: int, device: torch.device | str
    ) -> CacheTensors:
        return CacheTensors.allocate(
            self.config.cache_layout().for_rank(self.tp.size),
            num_blocks=num_blocks,
            tokens_per_block=tokens_per_block,
            num_slots=num_slots,
            device=device,
        )

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [n, H] -> logits [n, vocab] float32 (times logits_multiplier, divided by logits_scaling),
        into `out` when given."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = vocab_parallel_logits(hidden, w, self.config.vocab_size, self.tp)
        if self.logits_multiplier != 1.0:
            logits = logits * self.logits_multiplier
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        return logits.float() if out is None else out.copy_(logits)


def meta_weight_bytes(model: nn.Module) -> int:
    """Bytes of a model's parameters (build it on the meta device: nothing is allocated)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
