"""GQA self-attention over the paged KV pool, built from an `AttentionSpec`. NoPE (NemotronH, Granite-4.0-H:
the Mamba layers carry position, so a token's K/V never depends on where its block sits) or RoPE (Bamba):
queries and keys rotate by their token's position before K is written (`rope.py`).

With a float8 KV pool the layer quantises K and V with its two float32 scalars `k_scale` / `v_scale`
(vLLM's per-tensor scheme; see kernels/attention.py): cache = clamp(k / k_scale, +-448) as e4m3, read
back as cache * k_scale. The scales are non-persistent buffers: they are not weights (random init and
checkpoint saving skip them); the model loader fills them from the checkpoint's k_scale / v_scale
tensors or with 1.0, and the start-up calibration (engine/assembly/kv_calibration.py) those it is asked to
compute, as `kv_cache_config.kv_scales` says. They reach the kernels as device tensors, never host floats, so
a decode step stays capturable in a CUDA graph.

Under tensor parallelism a rank holds num_attention_heads / tp query heads and the KV heads they read
(its KV cache holds only those), and o_proj all-reduces the ranks' partial outputs.

q_proj, k_proj and v_proj stay three modules (each loads, quantises and is calibrated on its own), but once
the weights are in place `pack_qkv` puts their 16-bit weights (and biases) in one buffer, each parameter a
view of its rows, and the layer projects all three with one `linear` call: at batch 1 on CUDA one GEMV
launch instead of three, the narrow k and v ones no longer a kernel each (docs/architecture.md, "Packed
QKV").
"""

from __future__ import annotations

import torch
from torch import nn

from hyserve.distributed import Group
from hyserve.kernels import ops
from hyserve.kernels.attention import FP8_KV_DTYPES
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.layer_specs import AttentionSpec
from hyserve.model.parallel_linear import ColumnParallelLinear, RowParallelLinear
from hyserve.model.rope import apply_rope, rope_cos_sin


class Attention(nn.Module):
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(
        self,
        spec: AttentionSpec,
        *,
        layer_id: int = 0,
        group: Group | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        h, d = spec.hidden_size, spec.head_dim
        self.head_dim = d
        self.scale = spec.softmax_scale
        self.rope = spec.rope
        self.key_multiplier = spec.key_multiplier
        kw = {"bias": spec.bias, "unit_size": d, "group": group, "device": device, "dtype": dtype}
        # tensor parallel: this rank's query heads, and the KV heads they read (replicated when the KV heads
        # are fewer than the ranks); o_proj sums the ranks' partial outputs
        self.q_proj = ColumnParallelLinear(h, spec.num_heads * d, replicate=False, **kw)
        self.k_proj = ColumnParallelLinear(h, spec.num_kv_heads * d, **kw)
        self.v_proj = ColumnParallelLinear(h, spec.num_kv_heads * d, **kw)
        kw["bias"] = spec.bias if spec.out_bias is None else spec.out_bias
        self.o_proj = RowParallelLinear(spec.num_heads * d, h, **kw)
        self.num_heads = self.q_proj.out_features // d  # this rank's
        self.num_kv_heads = self.k_proj.out_features // d
        # (weight, bias) of q, k and v in one buffer once `pack_qkv` ran; plain attributes, not parameters
        # (the modules' parameters are views of them). `use_packed_qkv` off: three calls (the KV calibration's
        # hooks on k_proj / v_proj see their outputs; kv_scales.record_kv_amax)
        self.packed_qkv: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.use_packed_qkv = True
        # float32 whatever the model dtype; used only with a float8 KV pool
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32, device=device), persistent=False)

    @torch.no_grad()
    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        """Set the float8 KV quantisation scales (positive, finite). A model built on the meta device
        and moved with `to_empty` has undefined scales until this is called (the loader always does)."""
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            if not (0.0 < float(s) < float("inf")):
                raise ValueError(f"{name} must be positive and finite, got {s}")
        self.k_scale.fill_(float(k_scale))
        self.v_scale.fill_(float(v_scale))

    @torch.no_grad()
    def pack_qkv(self) -> bool:
        """Move the q, k and v weights (and biases) into one buffer of their rows in that order, each module's
        parameter becoming a view of its rows (loaders and in-place updates keep writing where the packed
        projection reads). Call once the weights are loaded and the model is on its device. FP8 or mixed
        weights stay three projections. Returns whether the layer is packed."""
        projs = (self.q_proj, self.k_proj, self.v_proj)
        w0 = self.q_proj.weight
        if any(
            p.quant is not None or p.weight.dtype != w0.dtype or p.weight.device != w0.device for p in projs
        ):
            return False
        if len({p.bias is None for p in projs}) != 1:
            return False
        if self.packed_qkv is None:
            w = torch.cat([p.weight for p in projs])
            b = torch.cat([p.bias for p in projs]) if self.q_proj.bias is not None else None  # type: ignore[misc]
            sizes = [p.weight.shape[0] for p in projs]
            for p, rows in zip(projs, w.split(sizes)):
                p.weight.data = rows
            if b is not None:
                for p, rows in zip(projs, b.split(sizes)):
                    p.bias.data = rows  # type: ignore[union-attr]
            self.packed_qkv = (w, b)
        return True

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def, override]
        """`to()`, `float()`, ... give each parameter its own new tensor: pack those again, so the packed
        projection never reads the old ones."""
        out = super()._apply(fn, recurse)
        if self.packed_qkv is not None:
            self.packed_qkv = None
            self.pack_qkv()
        return out

    def _project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        T = x.shape[0]
        if self.packed_qkv is not None and self.use_packed_qkv:
            w, b = self.packed_qkv
            qkv = ops.linear.get(x.is_cuda)(x, w, b)
            q, k, v = qkv.split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features], -1
            )
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        return (
            q.view(T, self.num_heads, self.head_dim),
            k.view(T, self.num_kv_heads, self.head_dim),
            v.view(T, self.num_kv_heads, self.head_dim),
        )

    def forward(
        self,
        x: torch.Tensor,
        meta: ForwardMeta,
        cache: CacheTensors,
        rope_cos_sin_t: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden]. A RoPE layer rotates q and k by `rope_cos_sin_t` (`rope.rope_cos_sin` of the step's
        positions, computed once per forward by the model), or computes it in its core when not given."""
        T = x.shape[0]
        q, k, v = self._project_qkv(x)
        o = meta.run_core(self.core, cache, q, k, v, *(rope_cos_sin_t or ()))
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))

    def core(
        self,
        meta: ForwardMeta,
        cache: CacheTensors,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *rope_tables: torch.Tensor,
    ) -> torch.Tensor:
        """The part that reads the step's sequences (`ForwardMeta.run_core`): RoPE by position, the KV write
        and the attention kernel. q [T, heads, head_dim], k / v [T, kv heads, head_dim], optionally the
        step's (cos, sin) -> o [T, heads, head_dim]."""
        k_cache, v_cache = cache.k[self.layer_id], cache.v[self.layer_id]
        T = q.shape[0]
        if self.rope is not None:
            cos, sin = rope_tables if rope_tables else rope_cos_sin(self.rope, meta, q)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cuda = q.is_cuda
        # the scales only mean something for a quantised pool; 16/32-bit pools hold K/V as they are
        kv_scales = (
            {"k_scale": self.k_scale, "v_scale": self.v_scale} if k_cache.dtype in FP8_KV_DTYPES else {}
        )
        ops.write_kv.get(cuda)(k, v, k_cache, v_cache, meta.slot_mapping, **kv_scales)
        # A pure decode step hands the kernels device tensors only (graph-capturable, no host reads);
        # other steps pass the host lists the launcher sizes its grid from.
        decode_only = meta.num_decodes == T
        return ops.paged_attention.get(cuda)(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens_t if decode_only else meta.seq_lens,
            meta.cu_seqlens_t if decode_only else meta.step_cu,
            self.scale,
            **kv_scales,
        )
