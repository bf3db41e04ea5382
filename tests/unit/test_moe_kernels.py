"""The MoE kernels (`triton_moe.py`) against float64 and their references (`moe.py`).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1) at small sizes in float32
and float16; the `gpu` cases run bf16 at the Nemotron 3 Nano / Super shapes of benchmarks/configs, and
one captures a layer's routing and experts in a CUDA graph and replays it on new inputs (no host sync).
Outputs are poisoned with NaN; inputs are fresh random values. Every top-k / group setting of the
shipped MoE configs is routed, plus group-limited settings none of them uses yet.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.quick import quick_first
from tests.triton_interpreter import IGNORE_INTERPRETER_WARNING, interpret_without_cuda

interpret_without_cuda()
pytestmark = IGNORE_INTERPRETER_WARNING

import hyserve.kernels.triton_moe as tm  # noqa: E402
from hyserve.kernels import moe as ref  # noqa: E402
from hyserve.kernels.launch_util import same_arch_names  # noqa: E402
from hyserve.kernels.moe_silu import moe_experts_silu_ref  # noqa: E402
from tests.shipped_configs import ALL, config_dir  # noqa: E402
from tests.sm90 import HOPPER_SHARED_BYTES, compile_for_sm90  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64
gpu = pytest.mark.gpu
TORCH_SEED = 2323


def _moe_configs() -> dict[str, dict]:
    out = {}
    for name in ALL:
        raw = json.loads((config_dir(name) / "config.json").read_text())
        if "E" in raw.get("hybrid_override_pattern", "") or "moe" in raw.get("layers_block_type", []):
            out[name] = raw
    return out


MOE_CONFIGS = _moe_configs()
# (E, top_k, n_group, topk_group, norm, scale): the shipped ones, then group-limited ones
ROUTE_SETTINGS = sorted(
    {
        (
            c["n_routed_experts"],
            c["num_experts_per_tok"],
            c.get("n_group", 1),
            c.get("topk_group", 1),
            bool(c.get("norm_topk_prob", True)),
            float(c.get("routed_scaling_factor", 1.0)),
        )
        for c in MOE_CONFIGS.values()
    }
) + [(64, 4, 8, 3, True, 2.5), (16, 3, 4, 2, False, 1.0), (256, 8, 8, 4, True, 2.5)]


def _ids_with(
    T: int, k: int, E: int, experts: list[int] | None = None, always: int | None = None
) -> torch.Tensor:
    """[T, k] distinct ids per token drawn from `experts` (default all); `always` in every token's set."""
    pool = torch.tensor(experts if experts is not None else list(range(E)))
    rows = []
    for _ in range(T):
        pick = pool[torch.randperm(len(pool))]
        if always is not None:
            pick = torch.cat([torch.tensor([always]), pick[pick != always]])
        rows.append(pick[:k][torch.randperm(k)])
    return torch.stack(rows).to(torch.int32).to(DEV)


def _experts_inputs(T: int, E: int, d: int, inter: int, k: int, dtype, ids: torch.Tensor | None = None):
    x = torch.randn(T, d, device=DEV).to(dtype)
    w_up = (torch.randn(E, inter, d, device=DEV) * d**-0.5).to(dtype)
    w_down = (torch.randn(E, d, inter, device=DEV) * inter**-0.5).to(dtype)
    if ids is None:
        ids = _ids_with(T, k, E)
    w = torch.rand(T, k, device=DEV) * 2.5 + 0.05
    return x, w_up, w_down, w, ids


def _variant_config(variant: str, E: int, inter: int, d: int, k: int) -> dict:
    """The tile config of a kernel form: "gemm", its tiles formed transposed ("gemm-swap"), or the decode
    GEMVs with the down GEMV's flat ("gemv") or nested ("gemv-nested") loop, EARLY ("gemv-early") or split by
    slot ("gemv-split"); the GPU's heuristic settings on CUDA, small tiles under the interpreter."""
    gemm = variant.startswith("gemm")
    cfg = tm._INTERPRETER_GEMM if gemm else tm._INTERPRETER_GEMV
    if CUDA:
        cfg = tm.heuristic_config(E, inter, d, 64 if gemm else 1, k)
    if variant == "gemm-swap":
        cfg = dict(cfg, up=dict(cfg["up"], SWAP=1), down=dict(cfg["down"], SWAP=1))
    if variant.startswith("gemv"):
        cfg = dict(cfg, down=dict(cfg["down"], FLAT=int(variant != "gemv-nested")))
    if variant == "gemv-early":
        cfg = dict(cfg, up=dict(cfg["up"], EARLY=1), down=dict(cfg["down"], EARLY=1))
    if variant == "gemv-split":  # the down GEMV per slot, then the combine kernel
        cfg = dict(
            cfg, down={k: v for k, v in cfg["down"].items() if k not in ("FLAT", "EARLY")} | {"SPLIT": 1}
        )
    return cfg


def _rel_err(out: torch.Tensor, exact: torch.Tensor) -> float:
    return ((out.double() - exact).norm() / exact.norm().clamp_min(1e-30)).item()


def _exact(x, w_up, w_down, w, ids) -> torch.Tensor:
    return ref.moe_experts_ref(x.double(), w_up.double(), w_down.double(), w.double(), ids)


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("setting", ROUTE_SETTINGS, ids=lambda s: "E{}-k{}-g{}-tg{}-n{}-s{}".format(*s))
def test_route_matches_float64(poison, setting):
    E, k, G, TG, norm, scale = setting
    T = 3
    logits = torch.randn(T, E, device=DEV) * 2
    bias = torch.randn(E, device=DEV) * 0.2
    with poison:
        w, ids = tm.moe_route_triton(logits, bias, k, G, TG, norm, scale)
    w64, ids64 = ref.moe_route_ref(logits.double(), bias.double(), k, G, TG, norm, scale)
    assert ids.dtype == torch.int32 and w.dtype == F32 and ids.shape == (T, k)
    torch.testing.assert_close(ids, ids64)
    torch.testing.assert_close(w.double(), w64, rtol=1e-5, atol=1e-6)
    if G > 1 and TG < G:  # every token's experts lie in at most topk_group groups
        assert all(len(set(r)) <= TG for r in (ids // (E // G)).tolist())


def test_route_group_limit_changes_the_choice():
    # one group holds the largest single score, another the largest top-2 sum: group selection decides
    E, G = 16, 4
    logits = torch.full((1, E), -4.0)
    logits[0, 0] = 4.0  # group 0: one high expert, top-2 sum ~ 1.0
    logits[0, 4:6] = 2.0  # group 1: two good ones, top-2 sum ~ 1.76
    logits[0, 8:10] = 1.5  # group 2: top-2 sum ~ 1.64
    logits = logits.to(DEV)
    bias = torch.zeros(E, device=DEV)
    w, ids = tm.moe_route_triton(logits, bias, 3, G, 2, True, 1.0)
    assert sorted(ids[0].tolist()) == [4, 5, 8]
    w_all, ids_all = tm.moe_route_triton(logits, bias, 3, 1, 1, True, 1.0)
    assert sorted(ids_all[0].tolist()) == [0, 4, 5]


def test_route_bias_selects_but_does_not_weigh():
    E = 8
    logits = torch.zeros(1, E, device=DEV)
    bias = torch.zeros(E, device=DEV)
    bias[6] = 1.0
    w, ids = tm.moe_route_triton(logits, bias, 1, 1, 1, False, 2.0)
    assert ids[0, 0].item() == 6
    assert w[0, 0].item() == pytest.approx(2.0 * 0.5)  # sigmoid(0) x scale, without the bias


@pytest.mark.parametrize(
    "bad, what",
    [
        (dict(top_k=9), "top_k"),
        (dict(n_group=3), "n_group"),
        (dict(topk_group=5), "topk_group"),
        (dict(n_group=4, topk_group=1, top_k=3), "top_k"),
    ],
)
def test_route_rejects_bad_settings(bad, what):
    args = dict(top_k=2, n_group=1, topk_group=1)
    args.update(bad)
    logits, bias = torch.randn(2, 8, device=DEV), torch.zeros(8, device=DEV)
    for fn in (tm.moe_route_triton, ref.moe_route_ref):
        with pytest.raises(ValueError, match=what):
            fn(logits, bias, args["top_k"], args["n_group"], args["topk_group"], True, 1.0)


# --------------------------------------------------------------------------- align


def _check_align_layout(sorted_ids, expert_ids, npad, ids, E, bm):
    flat = ids.reshape(-1).long().cpu()
    n = flat.numel()
    s, eids, total = sorted_ids.cpu().long(), expert_ids.cpu().long(), int(npad.item())
    assert total % bm == 0 and total <= s.numel()
    real = s[:total][s[:total] < n]
    assert sorted(real.tolist()) == list(range(n)), "every pair exactly once"
    assert (s[total:] == n).all(), "only padding past num_tokens_post_pad"
    for b in range(eids.numel()):
        if b * bm >= total:
            assert eids[b] == -1
            continue
        rows = s[b * bm : (b + 1) * bm]
        rows = rows[rows < n]
        assert (flat[rows] == eids[b]).all(), f"block {b} holds pairs of another expert"
        assert (rows[1:] > rows[:-1]).all(), "pairs of an expert keep their order"
    counts = torch.bincount(flat, minlength=E)
    assert total == int(((counts + bm - 1) // bm * bm).sum())


ALIGN_CASES = {
    "one-token": (1, 2, 8, None, None),
    "many-to-one-expert": (40, 2, 8, None, 3),
    "empty-experts": (30, 3, 16, [1, 4, 5, 11], None),
    "several-chunks": (70, 6, 128, None, None),
}


@pytest.mark.parametrize("case", ALIGN_CASES)
@pytest.mark.parametrize("bm", [16, 32])
def test_align_matches_reference(case, bm):
    T, k, E, experts, always = ALIGN_CASES[case]
    ids = _ids_with(T, k, E, experts, always)
    got = tm.moe_align_triton(ids, E, bm)
    want = ref.moe_align_ref(ids, E, bm)
    _check_align_layout(*want, ids, E, bm)
    for g, w, name in zip(got, want, ("sorted_ids", "expert_ids", "num_tokens_post_pad")):
        torch.testing.assert_close(g, w, msg=lambda m, name=name: f"{name}: {m}")


def test_align_int64_ids_and_bad_block():
    ids = _ids_with(9, 2, 8).long()
    got = tm.moe_align_triton(ids, 8, 16)
    for g, w in zip(got, ref.moe_align_ref(ids, 8, 16)):
        torch.testing.assert_close(g, w)
    with pytest.raises(ValueError, match="block_m"):
        tm.moe_align_triton(ids, 8, 24)


def test_max_blocks_bound_is_tight():
    # every expert non-empty with one pair more than a multiple of block_m reaches the bound
    E, bm = 4, 16
    flat = torch.cat([torch.full((bm + 1,), e) for e in range(E)])
    n = flat.numel()
    nb_needed = int(((torch.bincount(flat) + bm - 1) // bm).sum())
    assert nb_needed <= ref.moe_max_blocks(n, E, bm) <= nb_needed + 1


# --------------------------------------------------------------------------- experts


VARIANTS = ("gemv", "gemv-nested", "gemv-early", "gemv-split", "gemm", "gemm-swap")
EXPERT_CASES = {  # T, k, E, d, I, experts, always
    "one-token": (1, 2, 8, 64, 32, None, None),
    "many-to-one-expert": (24, 2, 8, 64, 48, None, 5),
    "empty-experts": (12, 3, 16, 48, 32, [0, 2, 9, 15], None),
    "ragged": (37, 2, 4, 80, 40, None, None),
}


@pytest.mark.parametrize("variant", quick_first([*VARIANTS]))
@pytest.mark.parametrize("dtype", quick_first([F32, F16]))
@pytest.mark.parametrize("case", EXPERT_CASES)
def test_experts_match_float64(poison, variant, dtype, case):
    T, k, E, d, inter, experts, always = EXPERT_CASES[case]
    if variant.startswith("gemv") and not CUDA:
        T = min(T, 8)  # the decode path's token buckets (the interpreter at 37 tokens took ~6 s a case)
    ids = _ids_with(T, k, E, experts, always)
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, dtype, ids)
    cfg = _variant_config(variant, E, inter, d, k)
    with poison:
        out = tm.moe_experts_triton(x, w_up, w_down, w, ids, config=cfg)
    assert out.dtype == dtype and out.shape == (T, d)
    assert torch.isfinite(out).all(), "unwritten output"
    err = _rel_err(out, _exact(x, w_up, w_down, w, ids))
    assert err < (2e-5 if dtype == F32 else 4e-3), f"{variant} {case}: relative error {err:.2e}"
    # the CPU/reference path in the same dtype agrees too
    err_ref = _rel_err(out, ref.moe_experts_ref(x, w_up, w_down, w, ids).double())
    assert err_ref < (2e-5 if dtype == F32 else 6e-3)


@pytest.mark.parametrize("variant", quick_first([*VARIANTS]))
@pytest.mark.parametrize("dtype", quick_first([F32, F16]))
@pytest.mark.parametrize("case", ["one-token", "empty-experts", "ragged"])
def test_fp8_experts_match_float64_of_the_dequantised_experts(poison, variant, dtype, case):
    """FP8 experts (e4m3, per-expert channel scales) in every kernel form against float64 of the
    dequantised experts, and against the reference path in the same dtype."""
    T, k, E, d, inter, experts, always = EXPERT_CASES[case]
    if variant.startswith("gemv") and not CUDA:
        T = min(T, 8)  # the decode path's token buckets, as above
    ids = _ids_with(T, k, E, experts, always)
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, F32, ids)
    x = x.to(dtype)
    (qu, su), (qd, sd) = ref.quantize_experts_ref(w_up), ref.quantize_experts_ref(w_down)
    cfg = _variant_config(variant, E, inter, d, k)
    with poison:
        out = tm.moe_experts_triton(x, qu, qd, w, ids, up_scale=su, down_scale=sd, config=cfg)
    assert out.dtype == dtype and torch.isfinite(out).all()
    exact = _exact(x, ref.dequantize_experts(qu, su, F64), ref.dequantize_experts(qd, sd, F64), w, ids)
    err = _rel_err(out, exact)
    assert err < (2e-5 if dtype == F32 else 4e-3), f"{variant} {case}: relative error {err:.2e}"
    err_ref = _rel_err(out, ref.moe_experts_ref(x, qu, qd, w, ids, up_scale=su, down_scale=sd).double())
    assert err_ref < (2e-5 if dtype == F32 else 6e-3)


# the A8 (w8a8) form: T, k, E, d, I, experts, always; d and I not multiples of 128 (a short last scale group),
# of the K tile (a masked last K step) or of the up N tile (wrapped columns left out of the group amax)
A8_CASES = {
    "ragged": (37, 2, 4, 176, 192, None, None),
    "empty-experts": (12, 3, 16, 128, 136, [0, 2, 9, 15], None),
    "many-to-one-expert": (24, 2, 8, 96, 256, None, 5),
}


def _a8_config(gpu: bool) -> dict:
    """An A8 tile config: the up N tile a multiple of 128, both K tiles dividing 128."""
    if gpu:
        up = dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
        return {"variant": "gemm", "BLOCK_M": 64, "A8": 1, "up": up, "down": dict(up)}
    up = dict(BLOCK_N=128, BLOCK_K=32, GROUP_M=2, num_warps=1, num_stages=1)
    down = dict(BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=1, num_stages=1)
    return {"variant": "gemm", "BLOCK_M": 16, "A8": 1, "up": up, "down": down}


def _fp8_experts(w_up, w_down):
    (qu, su), (qd, sd) = ref.quantize_experts_ref(w_up), ref.quantize_experts_ref(w_down)
    return qu, qd, su, sd


@pytest.mark.parametrize("gated", quick_first([False, True]))
@pytest.mark.parametrize("case", A8_CASES)
def test_a8_experts_match_their_w8a8_contract(poison, gated, case):
    """The w8a8 form (activations quantised per row and 128 columns, e4m3 x e4m3 dots, h quantised in the
    up GEMM's epilogue) against `moe_experts_w8a8_ref`: the same quantisation in float64, so what is left
    is float32 accumulation (and, rarely, an activation code on the other side of a rounding tie). Against
    exact activations it is off by about what e4m3 rounding of x and h costs."""
    T, k, E, d, inter, experts, always = A8_CASES[case]
    ids = _ids_with(T, k, E, experts, always)
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, F32, ids)
    if gated:
        w_up = torch.cat([w_up, torch.randn_like(w_up) * d**-0.5], dim=1)
    qu, qd, su, sd = _fp8_experts(w_up, w_down)
    fn = tm.moe_experts_silu_triton if gated else tm.moe_experts_triton
    with poison:
        out = fn(x, qu, qd, w, ids, up_scale=su, down_scale=sd, config=_a8_config(False))
    assert out.dtype == F32 and torch.isfinite(out).all(), "unwritten output"
    contract = ref.moe_experts_w8a8_ref(x, qu, qd, w, ids, su, sd, gated=gated).double()
    err = _rel_err(out, contract)
    assert err < 1e-5, f"{case}: relative error {err:.2e} against the w8a8 contract"
    exact_fn = moe_experts_silu_ref if gated else ref.moe_experts_ref
    deq_up, deq_down = ref.dequantize_experts(qu, su, F64), ref.dequantize_experts(qd, sd, F64)
    exact = exact_fn(x.double(), deq_up, deq_down, w.double(), ids)
    assert 5e-3 < _rel_err(out, exact) < 0.08, _rel_err(out, exact)  # e4m3 activations: ~2-4%


def test_a8_needs_fp8_experts_and_its_own_tiles():
    x, w_up, w_down, w, ids = _experts_inputs(5, 4, 64, 128, 2, F32)
    with pytest.raises(ValueError, match="for FP8 experts"):
        tm.moe_experts_triton(x, w_up, w_down, w, ids, config=_a8_config(False))
    base = _a8_config(False)
    for cfg, what in (
        (dict(base, A8=2), "A8 must be 0 or 1"),
        (dict(base, up=dict(base["up"], BLOCK_N=64)), "up BLOCK_N that is a multiple of 128"),
        (dict(base, down=dict(base["down"], BLOCK_K=256)), "BLOCK_Ks that divide 128"),
        (dict(base, up=dict(base["up"], SWAP=1)), "SWAP = 0"),
        ({**tm._INTERPRETER_GEMV, "A8": 1}, "the gemm variant"),
    ):
        with pytest.raises(ValueError, match=what):
            tm.validate_config(cfg)


def test_fp8_experts_refuse_bad_scales():
    x, w_up, w_down, w, ids = _experts_inputs(3, 4, 32, 16, 2, F32)
    (qu, su), (qd, sd) = ref.quantize_experts_ref(w_up), ref.quantize_experts_ref(w_down)
    for fn in (ref.moe_experts_ref, tm.moe_experts_triton):
        with pytest.raises(ValueError, match="need both up_scale and down_scale"):
            fn(x, qu, qd, w, ids, up_scale=su)
        with pytest.raises(ValueError, match="expert weights must be float8_e4m3fn"):
            fn(x, w_up, w_down, w, ids, up_scale=su, down_scale=sd)
        with pytest.raises(ValueError, match=r"down_scale must be float32 \[4, 32\]"):
            fn(x, qu, qd, w, ids, up_scale=su, down_scale=sd[:, :5])


def test_experts_default_config_and_int64_ids(poison):
    x, w_up, w_down, w, ids = _experts_inputs(5, 8, 64, 32, 2, F32)
    with poison:
        out = tm.moe_experts_triton(x, w_up, w_down, w, ids.long())
    assert _rel_err(out, _exact(x, w_up, w_down, w, ids)) < 2e-5


def test_experts_zero_tokens():
    x, w_up, w_down, w, ids = _experts_inputs(0, 4, 32, 16, 2, F32, ids=torch.zeros(0, 2, dtype=torch.int32))
    assert tm.moe_experts_triton(x, w_up, w_down, w, ids).shape == (0, 32)


@pytest.mark.parametrize(
    "bad, what",
    [
        ("x3d", "x must be"),
        ("up", "up_proj"),
        ("down", "down_proj"),
        ("ids", "topk ids"),
        ("dtype", "dtypes differ"),
        ("float_ids", "integer ids"),
        ("topk", "top_k"),
    ],
)
def test_experts_reject_bad_inputs(bad, what):
    x, w_up, w_down, w, ids = _experts_inputs(3, 4, 32, 16, 2, F32)
    if bad == "x3d":
        x = x[None]
    elif bad == "up":
        w_up = w_up[:, :, :-1]
    elif bad == "down":
        w_down = w_down[:, :-1]
    elif bad == "ids":
        ids = ids[:2]
    elif bad == "dtype":
        w_up = w_up.half()
    elif bad == "float_ids":
        ids = ids.float()
    elif bad == "topk":
        ids, w = torch.zeros(3, 5, dtype=torch.int32), torch.ones(3, 5)
    for fn in (tm.moe_experts_triton, ref.moe_experts_ref):
        with pytest.raises(ValueError, match=what):
            fn(x, w_up, w_down, w, ids)


def _shared_weights(d: int, inter: int, S: int, dtype):
    su = (torch.randn(S * inter, d, device=DEV) * d**-0.5).to(dtype)
    sd = (torch.randn(d, S * inter, device=DEV) * (S * inter) ** -0.5).to(dtype)
    return su, sd


@pytest.mark.parametrize("variant", ["gemv", "gemv-nested", "gemv-early", "gemv-split", "gemm"])
@pytest.mark.parametrize("S", [1, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", ["one-token", "empty-experts", "ragged"])
def test_experts_with_the_shared_expert_match_float64(poison, variant, S, case):
    """The shared expert folded in (S chunks of the routed intermediate size, weight 1 for every token);
    "gemv-early": the decode GEMVs with EARLY = 1 (the shared up rows first in the grid, their loads ahead of
    the PDL wait; the down GEMV's first tile loaded ahead of it)."""
    T, k, E, d, inter, experts, always = EXPERT_CASES[case]
    if variant.startswith("gemv"):
        T = min(T, 2)  # the decode path's token counts
    ids = _ids_with(T, k, E, experts, always)
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, F32, ids)
    su, sd = _shared_weights(d, inter, S, F32)
    cfg = _variant_config(variant, E, inter, d, k)
    with poison:
        out = tm.moe_experts_triton(x, w_up, w_down, w, ids, su, sd, config=cfg)
    exact = ref.moe_experts_ref(
        x.double(), w_up.double(), w_down.double(), w.double(), ids, su.double(), sd.double()
    )
    # the shared expert's part is there: without it the result is far off
    assert _rel_err(_exact(x, w_up, w_down, w, ids), exact) > 1e-2
    assert _rel_err(out, exact) < 2e-5, f"{variant} S={S} {case}: relative error {_rel_err(out, exact):.2e}"
    err_ref = _rel_err(out, ref.moe_experts_ref(x, w_up, w_down, w, ids, su, sd).double())
    assert err_ref < 2e-5


@pytest.mark.parametrize(
    "bad, what",
    [
        ("only_up", "needs both"),
        ("not_multiple", "multiple of the routed"),
        ("down_shape", "shared_down must be"),
        ("dtype", "shared expert dtypes"),
        ("empty", "multiple of the routed"),
    ],
)
def test_experts_reject_bad_shared_weights(bad, what):
    x, w_up, w_down, w, ids = _experts_inputs(3, 4, 32, 16, 2, F32)
    su, sd = _shared_weights(32, 16, 2, F32)
    if bad == "only_up":
        sd = None
    elif bad == "not_multiple":
        su, sd = su[:-3], sd[:, :-3]
    elif bad == "down_shape":
        sd = sd[:, :-16]
    elif bad == "dtype":
        su, sd = su.half(), sd.half()
    elif bad == "empty":
        su, sd = su[:0], sd[:, :0]
    for fn in (tm.moe_experts_triton, ref.moe_experts_ref):
        with pytest.raises(ValueError, match=what):
            fn(x, w_up, w_down, w, ids, su, sd)


@pytest.mark.parametrize("T", [1, 3, 4, 9])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_router_logits_match_float64(poison, T, dtype):
    E, d = 12, 72  # E not a multiple of the expert block, d not of the K tile
    x = torch.randn(T, d, device=DEV).to(dtype)
    gate = torch.randn(E, d, device=DEV) * d**-0.5
    with poison:
        got = tm.router_logits_triton(x, gate)
    assert got.dtype == F32 and got.shape == (T, E)
    torch.testing.assert_close(got.double(), x.double() @ gate.double().T, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="router_logits"):
        ref.router_logits_ref(x, gate[:, :-1])


def test_stage_references_compose_to_the_experts_reference():
    # the block-wise stage contracts (what each GEMM kernel computes) give the per-expert loop's result
    T, k, E, d, inter = 11, 3, 8, 24, 20
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, F32)
    x, w_up, w_down, w = x.double(), w_up.double(), w_down.double(), w.double()
    s, e, _ = ref.moe_align_ref(ids, E, 16)
    y = ref.moe_down_ref(ref.moe_up_ref(x, w_up, s, e, k), w_down, w, s, e)
    torch.testing.assert_close(ref.moe_combine_ref(y, k), ref.moe_experts_ref(x, w_up, w_down, w, ids))


# --------------------------------------------------------------------------- configs


def test_token_buckets_cover_every_variant():
    assert tm.moe_token_buckets(1) == [1]
    assert tm.moe_token_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert tm.moe_token_buckets(8192)[-1] == 8192
    assert tm.moe_token_buckets(10000)[-2:] == [8192, 10000]
    for m in (3, 100, 5000, 20000):  # each count <= m maps to a bucket one of the listed counts is in
        listed = {tm.token_bucket(t) for t in tm.moe_token_buckets(m)}
        assert {tm.token_bucket(t) for t in range(1, m + 1, 7)} <= listed
    with pytest.raises(ValueError, match="max_num_tokens"):
        tm.moe_token_buckets(0)


def test_config_depends_on_the_bucket_only():
    dev = torch.device("cuda") if CUDA else torch.device("cpu")
    for raw in MOE_CONFIGS.values():
        E, inter, k = raw["n_routed_experts"], raw["moe_intermediate_size"], raw["num_experts_per_tok"]
        d = raw.get("moe_latent_size") or raw["hidden_size"]
        for T in range(1, 600, 13):
            assert tm.moe_config(E, inter, d, T, k, dev) == tm.moe_config(
                E, inter, d, tm.token_bucket(T), k, dev
            )


def test_a_bucket_the_tuned_file_lacks_takes_the_heuristic(monkeypatch: pytest.MonkeyPatch):
    """A device file with only the 1-token entry (bench_moe_decode.py --write on a GPU never fully tuned) sets
    that bucket alone: larger token counts keep the heuristic (the grouped GEMMs from 3 tokens), never the
    one-token GEMV settings of the nearest tuned bucket."""
    one = {
        "variant": "gemv",
        "up": dict(BLOCK_N=4, BLOCK_K=128, num_warps=2, num_stages=6),
        "down": dict(BLOCK_N=1, BLOCK_K=512, num_warps=1, num_stages=6, FLAT=1),
    }
    key = tm.shape_key(128, 1856, 2688)
    monkeypatch.setattr(tm, "device_name", lambda index: "Some GPU")
    monkeypatch.setattr(tm, "device_arch", lambda index: "sm_test")
    monkeypatch.setattr(tm, "_tuned_table", lambda name: {key: {"1": one}})
    _clear_lookup_caches()
    try:
        assert tm._bucket_config(128, 1856, 2688, 1, 6, "cuda", 0) == one
        for bucket in (2, 4, 64, 8192):
            got = tm._bucket_config(128, 1856, 2688, bucket, 6, "cuda", 0)
            assert got == tm.heuristic_config(128, 1856, 2688, bucket, 6), bucket
        assert tm._bucket_config(128, 1856, 2688, 8192, 6, "cuda", 0)["variant"] == "gemm"
    finally:
        _clear_lookup_caches()


def test_fp8_experts_take_their_own_entry_else_the_16_bit_one(monkeypatch: pytest.MonkeyPatch):
    """e4m3 experts look up the shape's ",w=fp8" entry first and fall back to the 16-bit entry of the bucket
    (then the heuristic); 16-bit experts never take an FP8 entry."""
    bf16 = {
        "variant": "gemv",
        "up": dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=3),
        "down": dict(BLOCK_N=1, BLOCK_K=1024, num_warps=2, num_stages=4, FLAT=1),
    }
    fp8 = {
        "variant": "gemv",
        "up": dict(BLOCK_N=4, BLOCK_K=256, num_warps=2, num_stages=8),
        "down": dict(BLOCK_N=4, BLOCK_K=256, num_warps=2, num_stages=8, SPLIT=1),
    }
    key, key8 = tm.shape_key(512, 2688, 1024), tm.shape_key(512, 2688, 1024, fp8=True)
    assert key8 == key + ",w=fp8"
    monkeypatch.setattr(tm, "device_name", lambda index: "Some GPU")
    monkeypatch.setattr(tm, "device_arch", lambda index: "sm_test")
    monkeypatch.setattr(tm, "_tuned_table", lambda name: {key: {"1": bf16, "2": bf16}, key8: {"1": fp8}})
    _clear_lookup_caches()
    try:
        assert tm._bucket_config(512, 2688, 1024, 1, 22, "cuda", 0, True) == fp8
        assert tm._bucket_config(512, 2688, 1024, 1, 22, "cuda", 0, False) == bf16
        assert tm._bucket_config(512, 2688, 1024, 2, 22, "cuda", 0, True) == bf16  # no FP8 entry for 2 tokens
        assert tm._bucket_config(512, 2688, 1024, 64, 22, "cuda", 0, True) == tm.heuristic_config(
            512, 2688, 1024, 64, 22
        )
    finally:
        _clear_lookup_caches()


def _clear_lookup_caches() -> None:
    getattr(tm._tuned_table, "cache_clear", lambda: None)()  # a test may have replaced it
    tm._chip_tables.cache_clear()
    tm._bucket_config.cache_clear()


_GEMM_A = {
    "variant": "gemm",
    "BLOCK_M": 64,
    "up": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    "down": dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
}
_GEMM_B = dict(_GEMM_A, BLOCK_M=128)
_GEMM_W8A8 = {
    "variant": "gemm",
    "BLOCK_M": 64,
    "A8": 1,
    "up": dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    "down": dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
}


def _config_file(folder: Path, device: str, arch: str | None, configs: dict) -> None:
    doc = {"device": device, **({"arch": arch} if arch is not None else {}), "configs": configs}
    (folder / (device.replace(" ", "_") + ".json")).write_text(json.dumps(doc))


def test_a_gpu_without_an_entry_takes_one_tuned_on_the_same_chip(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """Where a GPU's own file lacks a bucket, the entry of another file measured on the same chip (its
    "arch") serves before the heuristic: an FP8 entry of the chip before the 16-bit one of the GPU's own file,
    and never an entry of another chip or of a file that names no chip."""
    key, key8 = tm.shape_key(128, 1856, 2688), tm.shape_key(128, 1856, 2688, fp8=True)
    _config_file(tmp_path, "GPU A", "sm_90x132", {key8: {"1024": _GEMM_W8A8}, key: {"16": _GEMM_A}})
    _config_file(tmp_path, "GPU B", "sm_90x132", {key: {"1024": _GEMM_A, "8192": _GEMM_B}})
    _config_file(tmp_path, "GPU C", "sm_100x148", {key: {"4096": _GEMM_B, "16": _GEMM_B}})
    _config_file(tmp_path, "GPU D", None, {key: {"2048": _GEMM_B}})
    monkeypatch.setattr(tm, "CONFIG_DIR", tmp_path)
    names = {0: "GPU A", 1: "GPU B", 2: "GPU C"}
    monkeypatch.setattr(tm, "device_name", lambda index: names[index])
    monkeypatch.setattr(tm, "device_arch", lambda index: "sm_100x148" if index == 2 else "sm_90x132")
    _clear_lookup_caches()
    try:

        def cfg(bucket: int, dev: int, fp8: bool = False) -> dict:
            return tm._bucket_config(128, 1856, 2688, bucket, 6, "cuda", dev, fp8)

        assert cfg(1024, 1, fp8=True) == _GEMM_W8A8  # the chip's FP8 entry before B's own 16-bit one
        assert cfg(1024, 1) == _GEMM_A  # B's own
        assert cfg(16, 1) == _GEMM_A  # A's, B has none
        assert cfg(8192, 0, fp8=True) == _GEMM_B  # B's 16-bit entry, the chip has no FP8 one
        assert cfg(4096, 1) == tm.heuristic_config(128, 1856, 2688, 4096, 6)  # C is another chip
        assert cfg(2048, 1) == tm.heuristic_config(128, 1856, 2688, 2048, 6)  # D names no chip
        assert cfg(16, 2) == _GEMM_B and cfg(1024, 2) == tm.heuristic_config(128, 1856, 2688, 1024, 6)
    finally:
        _clear_lookup_caches()


def test_the_shipped_h100_and_h200_files_are_one_chip():
    """The H100 SXM and the H200 are the same chip (sm_90, 132 SMs): each file says so, and each GPU finds
    the other's entries, e.g. the H100's tuned w8a8 FP8 entry serves the H200's 1,024-token bucket."""
    docs = {p.stem: json.loads(p.read_text()) for p in tm.CONFIG_DIR.glob("*.json")}
    assert docs["NVIDIA_H100_80GB_HBM3"]["arch"] == docs["NVIDIA_H200"]["arch"] == "sm_90x132"
    assert same_arch_names(tm.CONFIG_DIR, "NVIDIA H200", "sm_90x132") == ("NVIDIA H100 80GB HBM3",)
    h100 = docs["NVIDIA_H100_80GB_HBM3"]["configs"][tm.shape_key(128, 1856, 2688, fp8=True)]["1024"]
    _clear_lookup_caches()
    try:
        tables = tm._chip_tables("NVIDIA H200", "sm_90x132")
        assert tables[1][tm.shape_key(128, 1856, 2688, fp8=True)]["1024"] == h100
    finally:
        _clear_lookup_caches()


def test_heuristic_configs_are_valid():
    for raw in MOE_CONFIGS.values():
        E, inter = raw["n_routed_experts"], raw["moe_intermediate_size"]
        d = raw.get("moe_latent_size") or raw["hidden_size"]
        for T in tm.moe_token_buckets(16384):
            tm.validate_config(tm.heuristic_config(E, inter, d, T, raw["num_experts_per_tok"]))


@pytest.mark.parametrize(
    "cfg, what",
    [
        ({"variant": "x"}, "variant"),
        ({"variant": "gemm", "BLOCK_M": 24}, "BLOCK_M"),
        ({"variant": "gemv", "up": {"BLOCK_N": 4}}, "up.BLOCK_K"),
        (
            {"variant": "gemv", "up": {"BLOCK_N": 3, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1}},
            "power of two",
        ),
        (
            {
                "variant": "gemv",
                "up": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1},
                "down": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1, "FLAT": 2},
            },
            "FLAT",
        ),
        (
            {
                "variant": "gemv",
                "up": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1, "EARLY": -1},
                "down": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1},
            },
            "up.EARLY",
        ),
        (
            {
                "variant": "gemv",
                "up": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1},
                "down": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1, "EARLY": 1},
            },
            "FLAT = 1",
        ),
        (
            {
                "variant": "gemv",
                "up": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1},
                "down": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1, "SPLIT": 1, "FLAT": 1},
            },
            "FLAT = 0",
        ),
        (
            {
                "variant": "gemv",
                "up": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1, "SPLIT": 1},
                "down": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1},
            },
            "up.SPLIT applies",
        ),
        (
            {
                "variant": "gemm",
                "BLOCK_M": 16,
                "up": {
                    "BLOCK_N": 16,
                    "BLOCK_K": 16,
                    "GROUP_M": 1,
                    "num_warps": 1,
                    "num_stages": 1,
                    "EARLY": 1,
                },
                "down": {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 1, "num_stages": 1},
            },
            "gemv variant only",
        ),
        (
            {
                "variant": "gemm",
                "BLOCK_M": 16,
                "up": {
                    "BLOCK_N": 16,
                    "BLOCK_K": 16,
                    "GROUP_M": 1,
                    "num_warps": 1,
                    "num_stages": 1,
                    "SWAP": 2,
                },
                "down": {"BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1, "num_warps": 1, "num_stages": 1},
            },
            "up.SWAP must be 0 or 1",
        ),
        (
            {
                "variant": "gemv",
                "up": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1},
                "down": {"BLOCK_N": 4, "BLOCK_K": 8, "num_warps": 1, "num_stages": 1, "SWAP": 1},
            },
            "down.SWAP applies to the gemm variant only",
        ),
    ],
)
def test_bad_configs_are_named(cfg, what):
    with pytest.raises(ValueError, match=what):
        tm.validate_config(cfg)


def test_shipped_config_files_parse():
    files = sorted(tm.CONFIG_DIR.glob("*.json"))
    for f in files:
        doc = json.loads(f.read_text())
        assert doc["configs"], f"{f.name}: no shapes"
        for shape, buckets in doc["configs"].items():
            assert shape.startswith("E=") and buckets
            for b, cfg in buckets.items():
                assert int(b) >= 1
                tm.validate_config(cfg, f"{f.name} {shape} {b}")


# --------------------------------------------------------------------------- model layer


@pytest.mark.parametrize("name", [n for n in MOE_CONFIGS if n.startswith("tiny")])
def test_moe_layer_kernels_match_reference_path(monkeypatch, name):
    from hyserve.kernels import ops
    from hyserve.model.moe import MoE
    from hyserve.model.nemotron_h.config import HybridModelConfig

    cfg = HybridModelConfig.from_dict(MOE_CONFIGS[name])
    layer = MoE(cfg.moe_spec(), device=DEV, dtype=F32)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    x = torch.randn(9, cfg.hidden_size, device=DEV)
    want = layer(x) if not CUDA else None
    if CUDA:  # the reference path on the GPU for comparison
        with ops.reference_on_cuda():
            want = layer(x)
    impls = (
        (ops.moe_route, tm.moe_route_triton),
        (ops.moe_experts, tm.moe_experts_triton),
        (ops.router_logits, tm.router_logits_triton),
    )
    for op, fn in impls:  # the kernels in place of the op on either device (the interpreter on the CPU)
        monkeypatch.setattr(op, "ref", fn)
        monkeypatch.setattr(op, "cuda", fn)
    for rows in (x, x[:1]):  # the grouped GEMMs, and the decode GEMVs with the router GEMV
        torch.testing.assert_close(layer(rows), want[: rows.shape[0]], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in MOE_CONFIGS if n.startswith("tiny")])
def test_shared_expert_folded_into_the_experts_gives_the_layer_output(name):
    """The MoE layer with its shared expert inside the experts op equals the routed experts + the MLP."""
    from hyserve.model.moe import MoE
    from hyserve.model.nemotron_h.config import HybridModelConfig

    cfg = HybridModelConfig.from_dict(MOE_CONFIGS[name])
    layer = MoE(cfg.moe_spec(), device=DEV, dtype=F32)
    assert layer.fold_shared == (
        cfg.moe_latent_size is None
    )  # latent MoE: the shared expert reads x, not the latent
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    x = torch.randn(5, cfg.hidden_size, device=DEV)
    folded = layer(x)
    layer.fold_shared = False
    torch.testing.assert_close(folded, layer(x), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- GPU: real shapes, bf16


def _real_shapes():
    out = {}
    for name, raw in MOE_CONFIGS.items():
        if name.startswith("tiny"):
            continue
        d = raw.get("moe_latent_size") or raw["hidden_size"]
        out[name] = (raw["n_routed_experts"], raw["num_experts_per_tok"], d, raw["moe_intermediate_size"])
    return out


REAL = _real_shapes()


@gpu
@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("T", [1, 2, 8, 64, 300, 1024])
def test_experts_bf16_real_shapes(poison, name, T):
    E, k, d, inter = REAL[name]
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, BF16)
    exact = _exact(x, w_up, w_down, w, ids)
    with poison:
        out = tm.moe_experts_triton(x, w_up, w_down, w, ids)  # the tuned / heuristic config
    assert torch.isfinite(out).all()
    assert _rel_err(out, exact) < 1e-2, f"{name} T={T}: relative error {_rel_err(out, exact):.2e}"
    gemv = tm.heuristic_config(E, inter, d, 1, k)
    for cfg in (
        gemv,
        dict(gemv, down=dict(gemv["down"], FLAT=1 - gemv["down"].get("FLAT", 0))),
        tm.heuristic_config(E, inter, d, 256, k),
    ):  # every variant at this T
        with poison:
            out = tm.moe_experts_triton(x, w_up, w_down, w, ids, config=cfg)
        assert _rel_err(out, exact) < 1e-2, f"{name} T={T} {cfg['variant']}: {_rel_err(out, exact):.2e}"


@gpu
@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("T", [1, 2, 64])
def test_experts_bf16_real_shapes_with_the_shared_expert(poison, name, T):
    E, k, d, inter = REAL[name]
    shared = MOE_CONFIGS[name]["moe_shared_expert_intermediate_size"]
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, BF16)
    su, sd = _shared_weights(d, inter, shared // inter, BF16)
    exact = ref.moe_experts_ref(
        x.double(), w_up.double(), w_down.double(), w.double(), ids, su.double(), sd.double()
    )
    gemv = tm.heuristic_config(E, inter, d, 1, k)
    early = dict(gemv, up=dict(gemv["up"], EARLY=1), down=dict(gemv["down"], FLAT=1, EARLY=1))
    for cfg in (None, gemv, dict(gemv, down=dict(gemv["down"], FLAT=1 - gemv["down"].get("FLAT", 0))), early):
        with poison:
            out = tm.moe_experts_triton(x, w_up, w_down, w, ids, su, sd, config=cfg)
        assert _rel_err(out, exact) < 1e-2, f"{name} T={T}: relative error {_rel_err(out, exact):.2e}"


@gpu
@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("T", [64, 300, 1024])
def test_a8_experts_bf16_real_shapes(poison, name, T):
    """The w8a8 form at the real shapes: within 1e-2 of its float64 contract, where the form before it (one
    e4m3 dot over all of K: Hopper's short accumulator) missed by 1.2-1.6%."""
    E, k, d, inter = REAL[name]
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, BF16)
    qu, qd, su, sd = _fp8_experts(w_up, w_down)
    with poison:
        out = tm.moe_experts_triton(x, qu, qd, w, ids, up_scale=su, down_scale=sd, config=_a8_config(True))
    assert torch.isfinite(out).all()
    err = _rel_err(out, ref.moe_experts_w8a8_ref(x, qu, qd, w, ids, su, sd).double())
    assert err < 1e-2, f"{name} T={T}: relative error {err:.2e} against the w8a8 contract"


@gpu
@pytest.mark.parametrize("T", [1, 2, 4, 5, 64])
def test_router_logits_bf16_real_shapes(T):
    raw = next(c for n, c in sorted(MOE_CONFIGS.items()) if not n.startswith("tiny"))
    x = torch.randn(T, raw["hidden_size"], device=DEV).to(BF16)
    gate = torch.randn(raw["n_routed_experts"], raw["hidden_size"], device=DEV) * raw["hidden_size"] ** -0.5
    got = tm.router_logits_triton(x, gate)
    torch.testing.assert_close(got.double(), x.double() @ gate.double().T, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.parametrize("name", sorted(REAL))
def test_experts_bf16_skewed_routing(poison, name):
    E, k, d, inter = REAL[name]
    T = 512
    ids = _ids_with(
        T, k, E, experts=list(range(0, E, 7))[: max(k, 8)], always=0
    )  # one hot expert, many empty
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, BF16, ids)
    with poison:
        out = tm.moe_experts_triton(x, w_up, w_down, w, ids)
    assert _rel_err(out, _exact(x, w_up, w_down, w, ids)) < 1e-2


@gpu
@pytest.mark.parametrize("T", [1, 4096, 8192])
def test_align_real_sizes(T):
    for E, k, _, _ in REAL.values():
        ids = (
            torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)]).int()
            if T < 64
            else torch.argsort(torch.rand(T, E, device=DEV), dim=1)[:, :k].int()
        )
        for bm in (16, 64, 128):
            got = tm.moe_align_triton(ids, E, bm)
            for g, w in zip(got, ref.moe_align_ref(ids, E, bm)):
                torch.testing.assert_close(g, w)


@gpu
@pytest.mark.parametrize("name", sorted(REAL))
def test_route_real_sizes(name):
    raw = MOE_CONFIGS[name]
    E, k = raw["n_routed_experts"], raw["num_experts_per_tok"]
    logits, bias = torch.randn(777, E, device=DEV), torch.randn(E, device=DEV) * 0.1
    args = (k, raw["n_group"], raw["topk_group"], raw["norm_topk_prob"], raw["routed_scaling_factor"])
    w, ids = tm.moe_route_triton(logits, bias, *args)
    w64, ids64 = ref.moe_route_ref(logits.double(), bias.double(), *args)
    assert (ids == ids64).float().mean() > 0.999  # a float32 near-tie may swap two slots
    same = (ids == ids64).all(1)
    torch.testing.assert_close(w[same].double(), w64[same], rtol=1e-5, atol=1e-6)


@gpu
@pytest.mark.parametrize("name", sorted(REAL))
@pytest.mark.parametrize("T", [1, 8, 64])
def test_graph_replay_without_host_sync(name, T):
    raw = MOE_CONFIGS[name]
    E, k, d, inter = REAL[name]
    x, w_up, w_down, _, _ = _experts_inputs(T, E, d, inter, k, BF16)
    router = torch.randn(E, d, device=DEV) * d**-0.5
    bias = torch.randn(E, device=DEV) * 0.1
    args = (k, raw["n_group"], raw["topk_group"], raw["norm_topk_prob"], raw["routed_scaling_factor"])

    def layer(inp):
        w, ids = tm.moe_route_triton(inp.float() @ router.t(), bias, *args)
        return tm.moe_experts_triton(inp, w_up, w_down, w, ids)

    static_x = x.clone()
    layer(static_x)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = layer(static_x)
    for _ in range(2):
        static_x.copy_(torch.randn_like(static_x))
        g.replay()
        torch.testing.assert_close(static_out, layer(static_x), rtol=0, atol=0)


@pytest.mark.parametrize("S", [0, 2])
def test_early_decode_gemvs_equal_the_late_form_bit_for_bit(S):
    """EARLY moves loads, never arithmetic: both forms give the same bits (with and without the shared
    expert; on the CPU the interpreter, where PDL is off, checks the grid order and the peeled first tile)."""
    T, k, E, d, inter = 2, 3, 6, 40, 24  # 40 and 24: tiles with and without masked tails
    x, w_up, w_down, w, ids = _experts_inputs(T, E, d, inter, k, F32)
    su, sd = _shared_weights(d, inter, S, F32) if S else (None, None)
    outs = []
    for early in (0, 1):
        cfg = dict(_variant_config("gemv", E, inter, d, k))
        cfg = dict(cfg, up=dict(cfg["up"], EARLY=early), down=dict(cfg["down"], FLAT=1, EARLY=early))
        outs.append(tm.moe_experts_triton(x, w_up, w_down, w, ids, su, sd, config=cfg))
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@gpu
def test_early_decode_gemvs_replay_bit_identical_under_pdl():
    """The EARLY forms in the chain a decode step replays under PDL: a norm kernel writes x, then the router
    GEMV, the route and the experts with the shared expert folded in, three layers in a row (the caching
    allocator hands the route's freed logits to the next tensors), captured in CUDA graphs and replayed
    with new inputs each time: every replay equals the EARLY = 0 form's bit for bit (each output element is
    computed the same way in both forms), and that form matches the eager layer."""
    from hyserve.kernels.triton_rmsnorm import rms_norm_triton

    name = "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
    raw = MOE_CONFIGS[name]
    E, k, d, inter = REAL[name]
    S = raw["moe_shared_expert_intermediate_size"] // inter
    _, w_up, w_down, _, _ = _experts_inputs(1, E, d, inter, k, BF16)
    su, sd = _shared_weights(d, inter, S, BF16)
    norm_w = torch.ones(d, device=DEV, dtype=BF16)
    router = torch.randn(E, d, device=DEV) * d**-0.5
    bias = torch.zeros(E, device=DEV)
    args = (k, raw["n_group"], raw["topk_group"], raw["norm_topk_prob"], raw["routed_scaling_factor"])
    base = tm.moe_config(E, inter, d, 1, k, DEV)
    assert base["variant"] == "gemv"
    plain_down = {key: v for key, v in base["down"].items() if key != "SPLIT"}  # the flat loop has no split
    forms = {
        early: dict(base, up=dict(base["up"], EARLY=early), down=dict(plain_down, FLAT=1, EARLY=early))
        for early in (0, 1)
    }

    def chain(inp, cfg):
        h = inp
        for _ in range(3):
            x = rms_norm_triton(h, norm_w, 1e-5)
            w, ids = tm.moe_route_triton(tm.router_logits_triton(x, router), bias, *args)
            h = tm.moe_experts_triton(x, w_up, w_down, w, ids, su, sd, config=cfg)
        return h

    static = torch.randn(1, d, device=DEV).to(BF16)
    graphs = {}
    for early, cfg in forms.items():
        chain(static, cfg)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = chain(static, cfg)
        graphs[early] = (g, out)
    for i in range(20):
        static.copy_(torch.randn(1, d, device=DEV).to(BF16))
        got = {}
        for early, (g, out) in graphs.items():
            g.replay()
            got[early] = out.clone()
        torch.testing.assert_close(got[1], got[0], rtol=0, atol=0, msg=f"replay {i}: EARLY differs")
        if i % 5 == 0:
            torch.testing.assert_close(got[0], chain(static, forms[0]), rtol=0, atol=0)


@pytest.mark.slow
def test_moe_kernels_compile_for_sm90_at_the_tuned_configs():
    """The MoE kernels a Nano 30B-A3B layer launches (router GEMV, routing, decode GEMVs with the shared
    expert folded in, align + grouped GEMMs + combine with the shared expert) compile ahead of time for
    sm_90 at the H200's tuned settings, within its shared memory (tests/sm90_compile_check.py: no GPU)."""
    doc = compile_for_sm90("bfloat16", "moe")
    shared = doc["kernels"]
    want = {
        "_router_gemv_kernel",
        "_route_kernel",
        "_up_gemv_kernel",
        "_down_gemv_kernel",
        "_up_gemm_kernel",
        "_down_gemm_kernel",
        "_combine_kernel",
        "_align_count_kernel",
        "_align_offsets_kernel",
        "_align_scatter_kernel",
        "_down_split_kernel",
    }
    assert want <= set(shared), sorted(shared)
    assert all(0 <= b <= HOPPER_SHARED_BYTES for b in shared.values()), shared
    # every MoE kernel of a decode step is a programmatic dependent launch that waits for its predecessor
    assert all("griddepcontrol.wait" in doc["ptx"][name] for name in want), doc["ptx"]
    # the EARLY form of the down GEMV issues its first expert tile's loads before it waits
    assert "ld.global before the wait" in doc["ptx"]["_down_gemv_kernel"], doc["ptx"]["_down_gemv_kernel"]


@pytest.mark.slow
def test_swap_and_gated_gemms_compile_for_sm90():
    """The grouped GEMMs' SWAP form over e4m3 experts and the SiLU-gated form (both tile forms) compile for
    sm_90 to warp-group MMAs within its shared memory (tests/sm90_compile_check.py moe_forms: no GPU)."""
    doc = compile_for_sm90("bfloat16", "moe_forms")
    for name in ("_up_gemm_kernel", "_down_gemm_kernel"):
        assert 0 < doc["kernels"][name] <= HOPPER_SHARED_BYTES, doc["kernels"]
        assert "wgmma.mma_async" in doc["ptx"][name], doc["ptx"][name]


@pytest.mark.slow
def test_a8_gemms_run_e4m3_tensor_cores_on_sm90():
    """The w8a8 form's grouped GEMMs compile for sm_90 to Hopper's e4m3 warp-group MMAs (QGMMA in the
    SASS) and no 16-bit ones, within its shared memory (tests/sm90_compile_check.py moe_a8: no GPU)."""
    doc = compile_for_sm90("bfloat16", "moe_a8", "--sass")
    for name in ("_up_gemm_kernel", "_down_gemm_kernel"):
        assert 0 < doc["kernels"][name] <= HOPPER_SHARED_BYTES, doc["kernels"]
        assert "QGMMA" in doc["ptx"][name] and "HGMMA" not in doc["ptx"][name], doc["ptx"][name]
