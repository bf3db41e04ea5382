"""Mixture-of-experts ops of Nemotron 3 (plain-torch references: the CPU path and the oracle of
`triton_moe.py`). Layout and contracts are in docs/architecture.md (Kernels, MoE):

    route    scores = sigmoid(logits); choice = scores + e_score_correction_bias (selection only);
             with n_group > 1, only the topk_group groups with the largest top-2 sums of `choice` compete;
             ids = top-k of choice, w = scores[ids] (/ their sum when norm_topk_prob) * routed_scaling_factor
    align    the T*k (token, slot) pairs, flat index t*k + s, sorted by expert (stable) with each expert's
             run padded to a multiple of block_m: sorted_ids[P] (padding = T*k), expert_ids[P / block_m]
             (-1 past the end), num_tokens_post_pad[1]. P is fixed by T, k, E and block_m, never by counts
    logits   the router's scores before the sigmoid: x @ gate^T in float32 (the gate weight is float32)
    experts  out[t] = sum_s w[t, s] * down[e] @ relu(up[e] @ x[t])^2,  e = ids[t, s]
             (+ shared_down @ relu(shared_up @ x[t])^2 with the shared expert folded in, weight 1)
             FP8 experts: up / down in e4m3 with float32 scales per expert and output channel, up_scale [E, I]
             and down_scale [E, d]; the expert's matrix is up[e] * up_scale[e][:, None] (dequantised in
             float32, rounded to x.dtype), the rest as above (no folded shared expert: FP8 models run it
             as their FP8 MLP)

The block-wise stage references (`moe_up_ref`, `moe_down_ref`, `moe_combine_ref`) state what each GEMM
kernel computes over the align buffers; `moe_experts_ref` is the per-expert loop that the CPU runs (it
reads each expert's token count on the host, which on CUDA would be a device sync: CUDA runs the kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hyserve.kernels.fp8_linear import ACT_GROUP, quantize_rows_ref, quantize_weight_ref


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: [T, d]; weight: [E, d] (float32, as the checkpoints store the gate) -> logits [T, E] in float32
    (float64 for a float64 oracle)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"router_logits: x [T, d] and gate weight [E, d] expected, got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    ftype = torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)
    return F.linear(x.to(ftype), weight.to(ftype))


def moe_max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of block_m rows the align layout can need for num_pairs (token, slot) pairs: each non-empty
    expert pads its run by less than one block, so sum_e ceil(c_e / B) <= num_pairs // B + min(E, pairs)."""
    return num_pairs // block_m + min(num_experts, num_pairs)


def _check_route_args(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int
) -> None:
    if logits.dim() != 2:
        raise ValueError(f"moe_route: logits must be [T, E], got shape {tuple(logits.shape)}")
    E = logits.shape[1]
    if bias.shape != (E,):
        raise ValueError(f"moe_route: e_score_correction_bias must be [{E}], got {tuple(bias.shape)}")
    if n_group < 1 or E % n_group:
        raise ValueError(f"moe_route: n_group ({n_group}) must divide the {E} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"moe_route: topk_group ({topk_group}) must be in [1, n_group={n_group}]")
    grouped = n_group > 1 and topk_group < n_group
    if grouped and E // n_group < 2:
        raise ValueError(
            f"moe_route: each of the {n_group} groups needs at least 2 experts (top-2 group score)"
        )
    eligible = topk_group * (E // n_group) if grouped else E
    if not 1 <= top_k <= eligible:
        raise ValueError(
            f"moe_route: top_k ({top_k}) must be in [1, {eligible}] (experts in the kept groups)"
        )


def moe_route_ref(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] (the router's float32 output); bias: [E] -> (weights [T, k] float32 (float64 for float64
    logits), ids [T, k] int32), each token's ids in descending order of choice score."""
    _check_route_args(logits, bias, top_k, n_group, topk_group)
    ftype = torch.promote_types(logits.dtype, torch.float32)  # float32, or float64 as an oracle
    scores = logits.to(ftype).sigmoid()  # [T, E]
    choice = scores + bias.to(ftype)
    T, E = choice.shape
    if n_group > 1 and topk_group < n_group:
        per = E // n_group
        group_scores = choice.view(T, n_group, per).topk(2, dim=-1)[0].sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(topk_group, dim=-1)[1], 1.0)
        mask = keep[:, :, None].expand(T, n_group, per).reshape(T, E).bool()
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1)[1]  # [T, k], sorted
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, ids.to(torch.int32)


def moe_align_ref(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids: [T, k] -> (sorted_ids [P] int32, expert_ids [P / block_m] int32, num_tokens_post_pad [1]
    int32) with P = block_m * moe_max_blocks(T*k, E, block_m). Device ops only (no host sync)."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    nb = moe_max_blocks(n, num_experts, block_m)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)  # pair indices grouped by expert, in order
    sorted_e = flat[order]
    rank = torch.arange(n, device=dev) - (counts.cumsum(0) - counts)[sorted_e]
    sorted_ids = torch.full((nb * block_m,), n, dtype=torch.int32, device=dev)
    sorted_ids[starts[sorted_e] + rank] = order.to(torch.int32)
    block_start = torch.arange(nb, device=dev) * block_m
    total = ends[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=dev)
    expert_ids = torch.searchsorted(ends, block_start, right=True)  # experts whose run ends at or before
    expert_ids = torch.where(block_start < total, expert_ids, -1).to(torch.int32)
    return sorted_ids, expert_ids, total.to(torch.int32)


def _block_view(sorted_ids: torch.Tensor, expert_ids: torch.Tensor, num_pairs: int):
    nb = expert_ids.numel()
    rows = sorted_ids.view(nb, -1).long()  # [nb, B]
    valid = (rows < num_pairs) & (expert_ids[:, None] >= 0)
    return rows, valid, expert_ids.long().clamp(min=0)


def moe_up_ref(
    x: torch.Tensor, w_up: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor, top_k: int
) -> torch.Tensor:
    """The up GEMM over the align layout: x [T, K], w_up [E, N, K] -> h [P, N] with
    h[r] = relu(x[sorted_ids[r] // k] @ w_up[e]^T)^2 for real rows r and 0 for padding rows."""
    T = x.shape[0]
    rows, valid, e = _block_view(sorted_ids, expert_ids, T * top_k)
    a = x[(rows // top_k).clamp(max=max(T - 1, 0))] * valid[..., None]  # [nb, B, K]
    h = torch.relu(torch.bmm(a, w_up[e].transpose(1, 2))) ** 2  # [nb, B, N]
    return h.reshape(-1, w_up.shape[1])


def moe_down_ref(
    h: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    sorted_ids: torch.Tensor,
    expert_ids: torch.Tensor,
) -> torch.Tensor:
    """The down GEMM over the align layout: h [P, K], w_down [E, N, K], topk_w [T, k] -> y [T*k, N] with
    y[p] = topk_w.flat[p] * (h[r] @ w_down[e]^T) at the row r that holds pair p."""
    n = topk_w.numel()
    rows, valid, e = _block_view(sorted_ids, expert_ids, n)
    nb, B = rows.shape
    yb = torch.bmm(h.view(nb, B, -1), w_down[e].transpose(1, 2))  # [nb, B, N]
    wf = topk_w.reshape(-1).to(yb.dtype)
    yb = yb * wf[rows.clamp(max=n - 1)][..., None]
    y = torch.zeros(n, w_down.shape[1], dtype=yb.dtype, device=yb.device)
    y[rows[valid]] = yb[valid]
    return y


def moe_combine_ref(y: torch.Tensor, top_k: int) -> torch.Tensor:
    """y [T*k, N] -> [T, N]: each token's sum over its k weighted expert rows."""
    return y.view(-1, top_k, y.shape[1]).sum(1)


def _check_fp8_experts(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    up_scale: torch.Tensor | None,
    down_scale: torch.Tensor | None,
) -> None:
    if (up_scale is None) != (down_scale is None):
        raise ValueError("moe_experts: FP8 experts need both up_scale and down_scale")
    if w_up.dtype != torch.float8_e4m3fn or w_down.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"moe_experts: scales are given, so the expert weights must be float8_e4m3fn, got "
            f"{w_up.dtype}, {w_down.dtype}"
        )
    E, inter, d = w_up.shape
    for name, sc, want in (("up_scale", up_scale, (E, inter)), ("down_scale", down_scale, (E, d))):
        assert sc is not None  # called with scales, both given (checked above)
        if sc.dtype != torch.float32 or tuple(sc.shape) != want:
            raise ValueError(
                f"moe_experts: {name} must be float32 {list(want)} (per expert and output channel), "
                f"got {sc.dtype} {list(sc.shape)}"
            )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"moe_experts: FP8 experts take float32, float16 or bfloat16 activations, got {x.dtype}"
        )


def quantize_experts_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] (any float dtype) -> e4m3 [E, N, K] and float32 [E, N] scales: each expert's matrix quantised
    per output channel on its own (`quantize_weight_ref`), as FP8 experts are held."""
    qs = [quantize_weight_ref(w[e], "channel") for e in range(w.shape[0])]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [E, N, K] with float32 [E, N] scales -> [E, N, K] in dtype (dequantised in float32)."""
    return (w.float() * scale[:, :, None]).to(dtype)


def check_shared_args(
    w_up: torch.Tensor, shared_up: torch.Tensor | None, shared_down: torch.Tensor | None
) -> int:
    """The shared expert folded into the routed ones: up [S*I, d], down [d, S*I] with I the routed experts'
    intermediate size, so it runs as S more experts of weight 1 per token. Returns S (0 without one)."""
    if shared_up is None and shared_down is None:
        return 0
    if shared_up is None or shared_down is None:
        raise ValueError("moe_experts: the shared expert needs both shared_up and shared_down")
    _, inter, d = w_up.shape
    si = shared_up.shape[0] if shared_up.dim() == 2 else -1
    if shared_up.dim() != 2 or shared_up.shape[1] != d or si % inter or si == 0:
        raise ValueError(
            f"moe_experts: shared_up must be [S * {inter}, {d}] (a multiple of the routed "
            f"intermediate size), got {tuple(shared_up.shape)}"
        )
    if shared_down.shape != (d, si):
        raise ValueError(f"moe_experts: shared_down must be [{d}, {si}], got {tuple(shared_down.shape)}")
    if not (shared_up.dtype == shared_down.dtype == w_up.dtype):
        raise ValueError(
            f"moe_experts: shared expert dtypes {shared_up.dtype}, {shared_down.dtype} differ from the "
            f"experts' {w_up.dtype}"
        )
    return si // inter


def _check_experts_args(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
    *,
    gated: bool = False,
) -> None:
    """The experts ops' inputs (`gated`: w_up holds [gate | up] rows, [E, 2I, d])."""
    if x.dim() != 2:
        raise ValueError(f"moe_experts: x must be [T, d], got shape {tuple(x.shape)}")
    T, d = x.shape
    rows = "2I" if gated else "I"
    if w_up.dim() != 3 or w_up.shape[2] != d or (gated and w_up.shape[1] % 2):
        raise ValueError(f"moe_experts: up_proj must be [E, {rows}, {d}], got {tuple(w_up.shape)}")
    E, inter = w_up.shape[0], w_up.shape[1] // (2 if gated else 1)
    if w_down.shape != (E, d, inter):
        raise ValueError(f"moe_experts: down_proj must be [{E}, {d}, {inter}], got {tuple(w_down.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != T or topk_w.shape != topk_ids.shape:
        raise ValueError(
            f"moe_experts: topk ids and weights must both be [{T}, k], got {tuple(topk_ids.shape)} and "
            f"{tuple(topk_w.shape)}"
        )
    if topk_ids.dtype.is_floating_point or not topk_w.dtype.is_floating_point:
        raise ValueError(
            f"moe_experts: integer ids and float weights expected, got {topk_ids.dtype}, {topk_w.dtype}"
        )
    if topk_ids.shape[1] > E:
        raise ValueError(f"moe_experts: top_k ({topk_ids.shape[1]}) exceeds the {E} experts")
    if up_scale is not None or down_scale is not None:
        _check_fp8_experts(x, w_up, w_down, up_scale, down_scale)
    elif not (x.dtype == w_up.dtype == w_down.dtype):
        raise ValueError(
            f"moe_experts: x, up_proj, down_proj dtypes differ: {x.dtype}, {w_up.dtype}, {w_down.dtype}"
        )


def moe_experts_ref(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
    shared_up: torch.Tensor | None = None,
    shared_down: torch.Tensor | None = None,
    up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x: [T, d]; w_up: [E, I, d]; w_down: [E, d, I]; topk_w: [T, k] float32; topk_ids: [T, k] -> [T, d] in
    x.dtype. transformers' NemotronH order of rounding: each expert's GEMMs in x.dtype, weighted and summed
    in float32, rounded once at the end. shared_up / shared_down (`check_shared_args`): the shared expert's
    output, its GEMMs in x.dtype too, joins that float32 sum. FP8 experts (e4m3 weights, up_scale [E, I],
    down_scale [E, d]): each expert used is dequantised to x.dtype first, the rest the same."""
    _check_experts_args(x, w_up, w_down, topk_w, topk_ids, up_scale, down_scale)
    fp8 = up_scale is not None
    if fp8 and (shared_up is not None or shared_down is not None):
        raise ValueError(
            "moe_experts: FP8 experts take no folded shared expert (an FP8 model runs it as its MLP)"
        )
    with_shared = check_shared_args(w_up, shared_up, shared_down) > 0

    def expert(e: int, xt: torch.Tensor) -> torch.Tensor:
        up, down = w_up[e], w_down[e]
        if fp8:
            up = dequantize_experts(up[None], up_scale[e][None], x.dtype)[0]  # type: ignore[index]
            down = dequantize_experts(down[None], down_scale[e][None], x.dtype)[0]  # type: ignore[index]
        return F.linear(torch.square(F.relu(F.linear(xt, up))), down)

    out = weighted_expert_sum(x, topk_w, topk_ids, w_up.shape[0], expert)
    if with_shared:
        assert shared_up is not None and shared_down is not None  # check_shared_args: both or neither
        out += F.linear(torch.square(F.relu(F.linear(x, shared_up))), shared_down).to(out.dtype)
    return out.to(x.dtype)


def _dequantize_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x quantised by `quantize_rows_ref(x, group)` and read back in float64."""
    q, scale = quantize_rows_ref(x, group)
    full = scale.to(torch.float64).repeat_interleave(group, 1)[:, : x.shape[1]]
    return q.to(torch.float64) * full


def moe_experts_w8a8_ref(
    x: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    gated: bool = False,
) -> torch.Tensor:
    """The w8a8 form of FP8 experts (the A8 tile configs of `triton_moe`): x quantised to e4m3 with one
    scale per token and 128 columns (`quantize_rows_ref`), each expert's activation (relu(x @ up^T)^2, or
    gated: silu(gate) * up of w_up's [gate | up] rows) quantised the same way from its float32 value, every
    GEMM over the dequantised values in float64, the weighted sum in float64, rounded once to x.dtype. The
    contract the kernels are tested against; `moe_experts_ref` (and `moe_silu`'s) keep exact activations."""
    _check_experts_args(x, w_up, w_down, topk_w, topk_ids, up_scale, down_scale, gated=gated)
    f64 = torch.float64

    def expert(e: int, xt: torch.Tensor) -> torch.Tensor:
        up = dequantize_experts(w_up[e][None], up_scale[e][None], f64)[0]
        down = dequantize_experts(w_down[e][None], down_scale[e][None], f64)[0]
        a = F.linear(xt, up)
        if gated:
            gate, u = a.chunk(2, dim=-1)
            h = F.silu(gate) * u
        else:
            h = torch.square(F.relu(a))
        return F.linear(_dequantize_rows(h.float(), ACT_GROUP), down)

    xd = _dequantize_rows(x, ACT_GROUP)
    return weighted_expert_sum(xd, topk_w, topk_ids, w_up.shape[0], expert).to(x.dtype)


def weighted_expert_sum(
    x: torch.Tensor,
    topk_w: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The experts references' per-expert loop: out[t] = sum_s topk_w[t, s] * expert(e, x[t]) with
    e = topk_ids[t, s], each expert called once on all its tokens (in x.dtype), the weighted outputs summed in
    float32 (float64 for a float64 oracle) -> [T, d] in that accumulation dtype. Reads each expert's token
    count on the host: the CPU path."""
    T, k = topk_ids.shape
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.zeros(T, x.shape[1], dtype=acc, device=x.device)
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    tok = order // k
    wf = topk_w.reshape(-1).to(acc)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel, t = order[start : start + n], tok[start : start + n]
        out.index_add_(0, t, expert(e, x[t]).to(acc) * wf[sel, None])
        start += n
    return out


__all__ = [
    "check_shared_args",
    "dequantize_experts",
    "moe_align_ref",
    "moe_combine_ref",
    "moe_down_ref",
    "moe_experts_ref",
    "moe_experts_w8a8_ref",
    "moe_max_blocks",
    "moe_route_ref",
    "moe_up_ref",
    "router_logits_ref",
    "weighted_expert_sum",
]
