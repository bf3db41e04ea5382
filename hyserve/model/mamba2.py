"""Mamba2 mixer of NemotronH over the state-slot pool.

    x --in_proj--> [ z | xBC | dt ]
    xBC --causal depthwise conv1d + SiLU--> [ x | B | C ]
    (x, dt, B, C) --SSD scan (dt bias, softplus, dt limit, D skip)--> y
    y --grouped RMSNorm gated by z--> --out_proj--> out      (norm + out_proj: `gated_norm_linear`)

Falcon-H1's variants of the output (`MambaSpec.rms_norm` / `norm_before_gate`): norm(y) * silu(z), or
y * silu(z) with no norm; a family may scale zxbcdt by overriding `project`.

Decode sequences (the first `meta.num_decodes`, one token each) use the single-step conv and state
update kernels; prefill/extend sequences use the packed varlen conv and the chunked SSD scan. Both
read their starting state from `state_src` slots and write the final state to `state_dst` slots.

States are computed in float32 and stored in the SSM pool's dtype by round-to-nearest, or, when the config
asks for it, by stochastic rounding into a float16 pool (`kernels/stochastic_rounding.py`). Its random
stream is keyed by the engine seed and counts on (layer, position): decode rows use `seq_lens_t` (tokens
in cache after the step, a device tensor, so the decode step stays graph-capturable), a prefill's final
state the same, and a snapshot the tokens up to it.

Tensor parallel (docs/architecture.md, "Parallelism"): a rank holds mamba_num_heads / tp heads and the
B/C groups they read (split when tp divides n_groups, one replicated group per rank when n_groups < tp);
each of in_proj's z / x / B / C / dt parts, the conv1d channels [x | B | C], dt_bias / A_log / D and the
norm weight load their own rows; the grouped gated norm runs per local group (or, when a group spans
ranks, with its sum of squares all-reduced) and out_proj is row-parallel. The state pools of a rank hold
only its heads and groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hyserve.distributed import Group, all_reduce, tp_group
from hyserve.kernels import ops
from hyserve.kernels.stochastic_rounding import StochasticRounding
from hyserve.model.cache_tensors import CacheTensors
from hyserve.model.forward_meta import ForwardMeta
from hyserve.model.layer_specs import MambaSpec
from hyserve.model.mamba_snapshots import snapshot_plan
from hyserve.model.parallel_linear import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    ShardedPart,
    ShardLoading,
    SliceLike,
    load_parts,
)


class GatedRMSNorm(nn.Module):
    def __init__(self, size: int, group_size: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, device=device, dtype=dtype))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return ops.rmsnorm_gated.get(x.is_cuda)(x, z, self.weight, self.eps, self.group_size)


class Mamba2Mixer(ShardLoading):
    def __init__(
        self, spec: MambaSpec, *, layer_id: int = 0, group: Group | None = None, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.layer_id = layer_id
        # the stochastic-rounding stream of this layer's SSM pool (None: round-to-nearest)
        self.ssm_rounding: StochasticRounding | None = None
        if spec.ssm_stochastic_rounding:
            self.ssm_rounding = StochasticRounding(
                seed=spec.ssm_rounding_seed, layer=layer_id, rounds=spec.ssm_philox_rounds
            )
        self.group = group or tp_group()
        tp = self.group.size
        H, P, G, N = spec.num_heads, spec.head_dim, spec.n_groups, spec.state_size
        heads = ShardedPart(name="heads", units=H, unit_size=P)
        heads.check(tp, knob="tp_size", replicate=False)
        # B/C groups: split when tp divides them, else one group per rank, replicated (tp % G == 0)
        b_part, c_part = (
            ShardedPart(name="B", units=G, unit_size=N),
            ShardedPart(name="C", units=G, unit_size=N),
        )
        b_part.check(tp, knob="tp_size")
        # this rank's sizes
        self.num_heads = H // tp
        self.head_dim = P
        self.state_size = N
        self.n_groups = b_part.local_units(tp)
        self.chunk_size = spec.chunk_size
        self.conv_kernel = spec.conv_kernel
        self.d_inner = self.num_heads * P
        self.conv_dim = self.d_inner + 2 * self.n_groups * N
        self.dt_limit = spec.time_step_limit
        # a norm group spans several ranks when the groups are fewer than the ranks: its mean of squares
        # is summed over them (`_gated_norm_spanning`)
        self.norm_spans_ranks = G < tp
        self.group_of_rank = b_part.first_unit(self.group.rank, tp)
        self.norm_group_size_full = spec.d_inner // G
        self.n_groups_full = G
        h = spec.hidden_size
        x_part, dt_part = ShardedPart(name="x", units=H, unit_size=P), ShardedPart(name="dt", units=H)
        self.in_proj = MergedColumnParallelLinear(
            h,
            [ShardedPart(name="z", units=H, unit_size=P), x_part, b_part, c_part, dt_part],
            bias=spec.proj_bias,
            group=self.group,
            device=device,
            dtype=dtype,
        )
        # [conv_dim, 1, K] to match checkpoints (nn.Conv1d layout); used as [conv_dim, K];
        # channels [x | B | C]
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            self.conv_kernel,
            groups=self.conv_dim,
            bias=spec.use_conv_bias,
            device=device,
            dtype=dtype,
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads, device=device, dtype=dtype))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads, device=device, dtype=dtype))
        self.D = nn.Parameter(torch.ones(self.num_heads, device=device, dtype=dtype))
        self.norm: GatedRMSNorm | None = None
        if spec.rms_norm:
            self.norm = GatedRMSNorm(
                self.d_inner,
                min(self.norm_group_size_full, self.d_inner),
                spec.norm_eps,
                device=device,
                dtype=dtype,
            )
        self.norm_before_gate = spec.norm_before_gate
        self.out_proj = RowParallelLinear(
            spec.d_inner, h, bias=spec.has_out_bias, unit_size=P, group=self.group, device=device, dtype=dtype
        )
        self._conv_parts, self._head_parts, self._inner_parts = (
            (x_part, b_part, c_part),
            (dt_part,),
            (x_part,),
        )
        self.register_shard("conv1d.weight", self._load_conv, (spec.conv_dim, 1, spec.conv_kernel))
        if spec.use_conv_bias:
            self.register_shard("conv1d.bias", self._load_conv, (spec.conv_dim,))
        for name in ("dt_bias", "A_log", "D"):
            self.register_shard(name, self._load_per_head, (H,))
        if spec.rms_norm:
            self.register_shard("norm.weight", self._load_inner, (spec.d_inner,))
        self._A_cache: torch.Tensor | None = None
        self._A_version: tuple | None = None

    @torch.no_grad()
    def _load_conv(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        load_parts(param, loaded, self._conv_parts, self.group, what="conv1d")

    @torch.no_grad()
    def _load_per_head(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        load_parts(param, loaded, self._head_parts, self.group, what="per-head Mamba parameter")

    @torch.no_grad()
    def _load_inner(
        self, param: torch.Tensor, loaded: torch.Tensor | SliceLike, shard_id: str | None = None
    ) -> None:
        load_parts(param, loaded, self._inner_parts, self.group, what="norm")

    def _A(self) -> torch.Tensor:
        """A = -exp(A_log) in float32, computed once per value of A_log (its in-place version counter
        changes when weights load), so a decode step does not spend three kernels per layer on it."""
        if self.A_log.is_inference():  # built under inference_mode: no version counter to key on
            return -torch.exp(self.A_log.float())
        version = (self.A_log._version, self.A_log.device, self.A_log.data_ptr())
        if self._A_cache is None or self._A_version != version:
            with torch.no_grad(), torch.inference_mode(False):
                self._A_cache = -torch.exp(self.A_log.detach().float())
            self._A_version = version
        return self._A_cache

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gn = self.n_groups * self.state_size
        x, b, c = torch.split(xbc, [self.d_inner, gn, gn], dim=-1)
        n = xbc.shape[0]
        return (
            x.reshape(n, self.num_heads, self.head_dim),
            b.reshape(n, self.n_groups, self.state_size),
            c.reshape(n, self.n_groups, self.state_size),
        )

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> zxbcdt [T, in_proj rows of this rank]."""
        return self.in_proj(hidden)

    def forward(self, hidden: torch.Tensor, meta: ForwardMeta, cache: CacheTensors) -> torch.Tensor:
        T = hidden.shape[0]
        cuda = hidden.is_cuda
        zxbcdt = self.project(hidden)
        z, xbc, dt = torch.split(zxbcdt, [self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        y = meta.run_core(self.core, cache, xbc, dt)

        # gated norm + out_proj (on CUDA a one-row step runs the norm kernel and a Triton GEMV); under tensor
        # parallelism each rank's partial out_proj product is summed by one all-reduce
        norm, out = self.norm, self.out_proj
        y2 = y.view(T, self.d_inner)
        if norm is None or self.norm_before_gate:
            return out(self._gate_output(y2, z))
        if (
            out.quant is not None
        ):  # FP8 out_proj: the gated norm, then the FP8 linear (its reduce when sharded)
            spans = out.sharded and self.norm_spans_ranks
            normed = self._gated_norm_spanning(y2, z) if spans else norm(y2, z)
            return out(normed)
        fused = ops.gated_norm_linear.get(cuda)
        if not out.sharded:
            return fused(y2, z, norm.weight, norm.eps, norm.group_size, out.weight, out.bias)
        if self.norm_spans_ranks:
            return out.reduce(F.linear(self._gated_norm_spanning(y2, z), out.weight))
        return out.reduce(fused(y2, z, norm.weight, norm.eps, norm.group_size, out.weight, None))

    def core(
        self, meta: ForwardMeta, cache: CacheTensors, xbc: torch.Tensor, dt: torch.Tensor
    ) -> torch.Tensor:
        """The part that reads the step's sequences (`ForwardMeta.run_core`): the conv and the scan of every
        row from its state slots, the states written back. xbc [T, conv_dim], dt [T, heads] -> y [T, heads,
        head_dim]."""
        conv_pool, ssm_pool = cache.conv[self.layer_id], cache.ssm[self.layer_id]
        T = xbc.shape[0]
        A = self._A()
        w = self.conv1d.weight.view(self.conv_dim, self.conv_kernel)
        bias = self.conv1d.bias
        nd = meta.num_decodes
        y_d: torch.Tensor | None = None

        if nd > 0 and meta.decode_width == 1:
            y_d = self._decode(xbc[:nd], dt[:nd], A, w, bias, meta, slice(0, nd), conv_pool, ssm_pool)
        elif nd > 0:
            # speculative verification: position j of every sequence reads the state position j - 1 wrote
            q = meta.decode_width
            y_d = torch.empty(nd, self.num_heads, self.head_dim, dtype=xbc.dtype, device=xbc.device)
            for j in range(q):
                rows = slice(j, nd, q)
                y_d[rows] = self._decode(
                    xbc[rows].contiguous(), dt[rows], A, w, bias, meta, rows, conv_pool, ssm_pool
                )
        if T > nd:
            y_p = self._prefill(xbc[nd:], dt[nd:], A, w, bias, meta, conv_pool, ssm_pool)
            return y_p if y_d is None else torch.cat([y_d, y_p])
        assert y_d is not None
        return y_d  # a pure decode step: no packing copy

    def _decode(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        meta: ForwardMeta,
        rows: slice,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """One token of each of the decode rows `rows`: the conv and state updates from their `state_src`
        slots into their `state_dst` slots; returns y [rows, heads, head_dim]."""
        cuda = xbc.is_cuda
        # a verify step's rows are every q-th: the kernels take contiguous slot lists
        src, dst = meta.state_src[rows].contiguous(), meta.state_dst[rows].contiguous()
        xbc_d = ops.conv1d_update.get(cuda)(xbc, conv_pool, w, bias, src, dst)
        x, b, c = self._split_xbc(xbc_d)
        return ops.ssm_update.get(cuda)(
            ssm_pool,
            x,
            dt,
            A,
            b,
            c,
            src,
            dst,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=self.dt_limit,
            rounding=self.ssm_rounding,
            positions=None if self.ssm_rounding is None else meta.seq_lens_t[rows].contiguous(),
        )

    def _gate_output(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y * silu(z) (no norm), or the grouped norm of y times silu(z) (norm before the gate), the gate
        in float32."""
        norm = self.norm
        if norm is not None:
            y = ops.rmsnorm_gated.get(y.is_cuda)(y, None, norm.weight, norm.eps, norm.group_size)
        cd = torch.float64 if y.dtype == torch.float64 else torch.float32
        return (y.to(cd) * F.silu(z.to(cd))).to(y.dtype)

    def _gated_norm_spanning(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: [T, d_inner / tp], this rank's slice of a norm group that spans tp / n_groups ranks ->
        the grouped gated RMSNorm of the slice (as `rmsnorm_gated_ref`), with the group's sum of squares
        added up over its ranks: each rank puts its slice's sum in its group's column of a [T, n_groups]
        buffer and one all-reduce completes every column."""
        norm = self.norm
        assert norm is not None  # a model whose Mamba output has a norm
        cd = torch.float64 if y.dtype == torch.float64 else torch.float32
        h = y.to(cd) * F.silu(z.to(cd))
        sums = torch.zeros(y.shape[0], self.n_groups_full, dtype=cd, device=y.device)
        g = self.group_of_rank
        sums[:, g] = h.pow(2).sum(-1)
        all_reduce(sums, self.group)
        h = h * torch.rsqrt(sums[:, g : g + 1] / self.norm_group_size_full + norm.eps)
        w = norm.weight
        return (w.to(cd) * h).to(y.dtype) if y.dtype == torch.float64 else w * h.to(y.dtype)

    def _prefill(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        A: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        meta: ForwardMeta,
        conv_pool: torch.Tensor,
        ssm_pool: torch.Tensor,
    ) -> torch.Tensor:
        """The prefill sequences (after the decode rows): conv and scan from their initial states, final
        states and snapshots stored; returns their y [T - num_decodes, heads, head_dim]."""
        nd = meta.num_decodes
        cuda = xbc.is_cuda
        cu = meta.prefill_cu
        src, dst = meta.state_src[nd:], meta.state_dst[nd:]
        if meta.prefill_initial_states:
            has_init = meta.has_initial_state[nd:]
            # where() rather than a multiply: a reused slot may hold NaN/Inf, and 0 * NaN is NaN
            init_conv = torch.where(has_init[:, None, None], conv_pool[src], 0)
            init_ssm = torch.where(has_init[:, None, None, None], ssm_pool[src].float(), 0)
        else:  # every sequence starts fresh: zeros in the layout the gathers give (the same kernel variants)
            shape = (len(cu) - 1, *conv_pool.shape[1:])
            init_conv = conv_pool.new_empty_strided(shape, conv_pool.stride()).zero_()
            init_ssm = ssm_pool.new_zeros(len(cu) - 1, *ssm_pool.shape[1:], dtype=torch.float32)

        xbc_c, conv_final = ops.conv1d_varlen.get(cuda)(xbc, w, bias, cu, init_conv)
        x, b, c = self._split_xbc(xbc_c)
        snaps = any(sw.seq >= nd for sw in meta.snapshots)
        res = ops.ssd.get(cuda)(
            x,
            dt,
            A,
            b,
            c,
            self.chunk_size,
            cu,
            D=self.D,
            dt_bias=self.dt_bias,
            dt_softplus=True,
            dt_limit=self.dt_limit,
            initial_states=init_ssm,
            return_chunk_states=snaps,
        )
        conv_pool[dst] = conv_final.to(conv_pool.dtype)
        store = ops.store_ssm_state.get(cuda)
        sr = self.ssm_rounding
        store(
            ssm_pool,
            res.final_states,
            dst,
            rounding=sr,
            positions=None if sr is None else meta.seq_lens_t[nd:],
        )
        if not snaps:
            return res.y
        # every snapshot of this layer in one state store and one conv-window gather (the plan is the step's)
        plan = snapshot_plan(meta, self.chunk_size, self.conv_kernel - 1, ssm_pool.device, dst.dtype)
        store(
            ssm_pool,
            plan.states(res),
            plan.slots,
            rounding=sr,
            positions=None if sr is None else plan.positions,
        )
        plan.write_convs(conv_pool, xbc, cu, init_conv)
        return res.y
