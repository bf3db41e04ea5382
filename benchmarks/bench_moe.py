# ruff: noqa: B023  (the timed lambdas run inside the loop iteration that defines them)
"""One MoE layer of Nemotron 3 on the GPU: the fused Triton path (kernels/triton_moe.py) against
`torch._grouped_mm` over token-sorted experts and the per-expert loop, in the same run, each first checked
against the float64 reference; quoted against the bytes roofline (expert weights the routing touches +
activations, over the bytes-read ceiling measured here by benchmarks/roofline.py: the faster of a 4 GiB
streaming read and a 1 GiB GEMV) and the FLOP roofline (over a bf16 8192^3 matmul measured here).

    python -m benchmarks.bench_moe                       # Nano 30B-A3B experts + Super latent layer
    python -m benchmarks.bench_moe --tune                # first autotune every (E, N, K, bucket), write
                                                         # hyserve/kernels/moe_configs/<GPU>.json, then bench
    python -m benchmarks.bench_moe --dry-run --out /tmp/m.json   # CPU: tiny shapes, Triton interpreter

Timings: `eager` = do_bench (L2 flushed before each call, the launcher's host time included); `graph` = the
op captured in one CUDA graph over 8 input sets (new routing and activations each) and replayed, per call:
how a decode step runs it. Routing comes from the router kernel on random logits (near-uniform load).
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

import hyserve.kernels.triton_moe as tm  # noqa: E402
from benchmarks import invocation  # noqa: E402
from benchmarks.roofline import PUBLISHED_BW, PUBLISHED_FLOPS, measure_ceilings  # noqa: E402
from hyserve.bench.report import git_sha  # noqa: E402
from hyserve.kernels.launch_util import device_arch  # noqa: E402
from hyserve.kernels.moe import moe_experts_ref, moe_experts_w8a8_ref, quantize_experts_ref  # noqa: E402
from hyserve.kernels.triton_fp8_linear import quantize_rows_triton  # noqa: E402

CONFIGS = ROOT / "benchmarks" / "configs"
NANO = "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
SUPER = "NVIDIA-Nemotron-3-Super-120B-A12B-BF16"
SIZES = (1, 8, 64, 256, 1024, 8192)
GRAPH_SETS = 8  # input sets per captured graph (rotating routing keeps the weights out of L2)


def _shape(name: str) -> dict:
    raw = json.loads((CONFIGS / name / "config.json").read_text())
    return dict(
        name=name,
        E=raw["n_routed_experts"],
        k=raw["num_experts_per_tok"],
        d=raw.get("moe_latent_size") or raw["hidden_size"],
        I=raw["moe_intermediate_size"],
        H=raw["hidden_size"],
        raw=raw,
    )


def _dry_shape(name: str) -> dict:
    return dict(name=name + " (dry-run: tiny)", E=8, k=2, d=64, I=32, H=64, raw=None)


class Timer:
    def __init__(self, dry: bool) -> None:
        self.dry = dry

    def eager(self, fns: list, rep: int = 60) -> float:
        """Median ms of one call, cycling through fns (one per input set)."""
        it = iter(range(1 << 62))
        call = lambda: fns[next(it) % len(fns)]()
        if self.dry:
            call()
            t = time.perf_counter()
            call()
            return (time.perf_counter() - t) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(call, warmup=10, rep=rep, return_mode="median"))

    def graph(self, fns: list, replays: int = 15) -> float:
        """ms per call of fns captured back to back in one CUDA graph (median over replays)."""
        if self.dry:
            return self.eager(fns)
        for f in fns:
            f()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for f in fns:
                f()
        g.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / len(fns))
        del g
        return sorted(times)[len(times) // 2]


# --------------------------------------------------------------------------- command line


def parse_run_args(ap: argparse.ArgumentParser, stem: str) -> argparse.Namespace:
    """The options every MoE benchmark takes (--out, --dry-run, --git-sha), then the parsed arguments."""
    ap.add_argument("--out", default=None, help=f"JSON path (default benchmarks/results/{stem}_<sha>.json)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    ap.add_argument("--git-sha", default="")
    return ap.parse_args()


def run_device(dry: bool, script: str) -> tuple[torch.device, torch.dtype] | None:
    """The device and dtype a run measures in: the GPU in bf16, or for --dry-run the CPU interpreter in
    float32 (its bf16 dot is wrong); None, having said why, without a GPU."""
    if not dry and not torch.cuda.is_available():
        print(f"{script}: needs a CUDA device (or --dry-run)", file=sys.stderr)
        return None
    return (torch.device("cpu"), torch.float32) if dry else (torch.device("cuda"), torch.bfloat16)


# --------------------------------------------------------------------------- ceilings


def moe_ceilings(dev: torch.device, dry: bool) -> dict:
    """This device's bytes-read and bf16 matmul ceilings (benchmarks/roofline.py, one 8192^3 matmul shape);
    the dry run quotes the H200's published peaks instead."""
    if dry:
        return dict(
            read_bw=PUBLISHED_BW,
            matmul_flops=PUBLISHED_FLOPS,
            note="dry-run: the H200's published peaks, not measured",
        )
    c = measure_ceilings(dev, matmul_shapes=((8192, 8192, 8192),))
    print(c.summary())
    return c.to_dict()


# --------------------------------------------------------------------------- peers


def grouped_mm_moe(x, w_up, w_down, topk_w, topk_ids):
    """Stock torch._grouped_mm over token-sorted experts (no host sync: capturable)."""
    T, k = topk_ids.shape
    E = w_up.shape[0]
    flat = topk_ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // k
    h = torch._grouped_mm(x[tok], w_up.transpose(1, 2), offs=offs)  # [T*k, I]
    h = torch.square(F.relu(h))
    y = torch._grouped_mm(h, w_down.transpose(1, 2), offs=offs)  # [T*k, d]
    y = y.float() * topk_w.reshape(-1)[order, None]
    return torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, tok, y).to(x.dtype)


def loop_moe(x, w_up, w_down, topk_w, topk_ids):
    """The per-expert Python loop hyserve ran before (host counts: a device sync per layer)."""
    return moe_experts_ref(x, w_up, w_down, topk_w, topk_ids)


# --------------------------------------------------------------------------- helpers


def _inputs(s: dict, T: int, dev, dtype, sets: int):
    out = []
    for _ in range(sets):
        x = torch.randn(T, s["d"], device=dev).to(dtype)
        logits = torch.randn(T, s["E"], device=dev) * 2
        w, ids = tm.moe_route_triton(logits, torch.zeros(s["E"], device=dev), s["k"], 1, 1, True, 2.5)
        out.append((x, w, ids))
    return out


def _weights(s: dict, dev, dtype):
    w_up = (torch.randn(s["E"], s["I"], s["d"], device=dev) * s["d"] ** -0.5).to(dtype)
    w_down = (torch.randn(s["E"], s["d"], s["I"], device=dev) * s["I"] ** -0.5).to(dtype)
    return w_up, w_down


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _roofline(s: dict, ids: torch.Tensor, T: int, ceil: dict, elt: int = 2) -> dict:
    touched = int(torch.unique(ids).numel())
    wbytes = touched * 2 * s["I"] * s["d"] * elt
    abytes = 2 * T * s["d"] * elt  # x read, out written
    flops = 2 * ids.numel() * 2 * s["I"] * s["d"]
    t_bytes = (wbytes + abytes) / ceil["read_bw"] * 1e3
    t_flops = flops / ceil["matmul_flops"] * 1e3
    return dict(
        experts_touched=touched,
        bytes=wbytes + abytes,
        flops=flops,
        bytes_ms=t_bytes,
        flop_ms=t_flops,
        roofline_ms=max(t_bytes, t_flops),
        bound="bytes" if t_bytes >= t_flops else "flops",
    )


# --------------------------------------------------------------------------- tuning


_GEMV_CANDS = [
    dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=3),
    dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=3),
    dict(BLOCK_N=2, BLOCK_K=1024, num_warps=4, num_stages=2),
    dict(BLOCK_N=16, BLOCK_K=256, num_warps=8, num_stages=3),
    dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=4),
    dict(BLOCK_N=8, BLOCK_K=512, num_warps=8, num_stages=3),
]
_GEMV_DEEP = [
    dict(BLOCK_N=2, BLOCK_K=512, num_warps=4, num_stages=4),  # more loads in flight per SM
    dict(BLOCK_N=4, BLOCK_K=256, num_warps=4, num_stages=6),
    dict(BLOCK_N=4, BLOCK_K=512, num_warps=4, num_stages=6),
    dict(BLOCK_N=2, BLOCK_K=512, num_warps=2, num_stages=4),
    dict(BLOCK_N=1, BLOCK_K=1024, num_warps=2, num_stages=4),
]
_GEMV_DOWN = [dict(c, FLAT=f) for c in _GEMV_CANDS for f in (0, 1)] + [dict(c, FLAT=1) for c in _GEMV_DEEP]
_GEMV_CANDS = _GEMV_CANDS + _GEMV_DEEP
_SMALL_M = [
    dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=4),
    dict(BLOCK_N=32, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=4),
]
_LARGE_M = [
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
]
# the tile formed transposed (SWAP, triton_moe._expert_tile): BLOCK_N weight rows are the warp-group MMA's M
# (64 a warp group), BLOCK_M token rows its N; e4m3 weights go from registers into the MMA
_SWAP_SMALL_M = [
    dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SWAP=1),
    dict(BLOCK_N=64, BLOCK_K=256, GROUP_M=1, num_warps=4, num_stages=3, SWAP=1),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=4, SWAP=1),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=1, num_warps=8, num_stages=4, SWAP=1),
    dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=6, SWAP=1),
]
_SWAP_LARGE_M = [
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4, SWAP=1),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4, SWAP=1),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=4, SWAP=1),
    dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5, SWAP=1),
    dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, SWAP=1),
]
# the w8a8 form (A8, FP8 experts at BLOCK_M >= 64: e4m3 x e4m3 warp-group MMAs): the up N tile a multiple of
# 128 (its epilogue quantises h per 128 columns), every K tile dividing 128 (one activation scale a K step)
_A8 = [
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3),
    dict(BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5),
    dict(BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    dict(BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=5),
]
_DRY_A8 = [dict(BLOCK_N=128, BLOCK_K=32, GROUP_M=1, num_warps=1, num_stages=1)]
A8_MIN_BLOCK_M = 64  # below a warp group's 64 rows an e4m3 product has no tensor-core instruction on Hopper
_DRY_GEMM = [
    dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=1, num_stages=1),
    dict(BLOCK_N=32, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1),
]
_DRY_SWAP = [dict(BLOCK_N=16, BLOCK_K=32, GROUP_M=1, num_warps=1, num_stages=1, SWAP=1)]
_DRY_GEMV = [dict(BLOCK_N=32, BLOCK_K=32, num_warps=1, num_stages=1)]
_DRY_GEMV_DOWN = [dict(c, FLAT=f) for c in _DRY_GEMV for f in (0, 1)]


def _bm_cands(per_expert: float) -> list[int]:
    if per_expert <= 12:
        return [16]
    if per_expert <= 24:
        return [16, 32]
    if per_expert <= 64:
        return [32, 64]
    return [64, 128]


def _best(timer: Timer, cands: list[dict], run, forms: dict[str, float] | None = None) -> tuple[dict, float]:
    """The fastest candidate and its ms; `forms` gets the fastest ms of each tile form ("swap" / "plain")."""
    best, best_ms = None, float("inf")
    for c in cands:
        try:
            ms = timer.eager([lambda: run(c)], rep=25)
        except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
            print(f"      skip {c}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
            continue
        if forms is not None:
            form = "swap" if c.get("SWAP", 0) else "plain"
            forms[form] = min(forms.get(form, float("inf")), ms)
        if ms < best_ms:
            best, best_ms = c, ms
    if best is None:
        raise RuntimeError(f"no candidate ran: {cands}")
    return best, best_ms


def _gemm_cands(bm: int, dry: bool) -> list[dict]:
    """The grouped GEMMs' candidates at BLOCK_M = bm: both tile forms."""
    if dry:
        return _DRY_GEMM + _DRY_SWAP
    return (_SMALL_M + _SWAP_SMALL_M) if bm <= 32 else (_LARGE_M + _SWAP_LARGE_M)


def _tune_a8(timer: Timer, x, w_up, w_down, su, sd, tw, ids, align, bm: int, dry: bool) -> tuple[float, dict]:
    """The w8a8 form's fastest tiles at BLOCK_M = bm: the ms of x's quantisation + up + down, and its
    config (A8 = 1)."""
    sid, eid, npad = align
    T, k = ids.shape
    inter, d = w_down.shape[2], w_down.shape[1]
    xq, xs = quantize_rows_triton(x, group=tm.A8_GROUP)
    t_q = timer.eager([lambda: quantize_rows_triton(x, group=tm.A8_GROUP)], rep=25)
    h = torch.empty(sid.numel(), inter, dtype=torch.float8_e4m3fn, device=x.device)
    hs = torch.empty(sid.numel(), -(-inter // tm.A8_GROUP), dtype=torch.float32, device=x.device)
    y = torch.empty(T * k, d, dtype=x.dtype, device=x.device)
    cands = _DRY_A8 if dry else _A8
    up, t_up = _best(
        timer,
        [c for c in cands if c["BLOCK_N"] % tm.A8_GROUP == 0],
        lambda c: tm.launch_up_gemm(xq, w_up, h, sid, eid, npad, T * k, k, bm, c, su, False, (xs, hs)),
    )
    dn, t_dn = _best(
        timer, cands, lambda c: tm.launch_down_gemm(h, w_down, y, tw, sid, eid, npad, bm, c, sd, hs)
    )
    print(
        f"    T={T} BM={bm} a8: quantise x {t_q:.4f} ms, up {t_up:.4f} ms ({up}), down {t_dn:.4f} ms ({dn})"
    )
    return t_q + t_up + t_dn, {"variant": "gemm", "BLOCK_M": bm, "A8": 1, "up": up, "down": dn}


def tune_shape(
    s: dict, sizes: list[int], dev, dtype, timer: Timer, dry: bool, fp8: bool = False
) -> tuple[dict[str, dict], dict[str, dict[str, float]]]:
    """Per token bucket: time each stage's candidates on its own, keep the fastest sum, then check the
    winner end to end against a float32 reference. fp8: e4m3 experts with channel scales
    (quantize_experts_ref). Returns the tuned table and, per bucket, the fastest stage time of each
    grouped-GEMM tile form (plain, SWAP)."""
    w_up, w_down = _weights(s, dev, dtype)
    su = sd = None
    if fp8:
        (w_up, su), (w_down, sd) = quantize_experts_ref(w_up), quantize_experts_ref(w_down)
    E, k, d, inter = s["E"], s["k"], s["d"], s["I"]
    table: dict[str, dict] = {}
    forms_seen: dict[str, dict[str, float]] = {}
    for T in sizes:
        ((x, w, ids),) = _inputs(s, T, dev, dtype, 1)
        tw = w.float().contiguous()
        options = []
        form_ms: dict[str, float] = {}
        if T <= 8:
            h = torch.empty(T * k, inter, dtype=dtype, device=dev)
            out = torch.empty(T, d, dtype=dtype, device=dev)
            gc, gd = (_DRY_GEMV, _DRY_GEMV_DOWN) if dry else (_GEMV_CANDS, _GEMV_DOWN)
            up, t_up = _best(timer, gc, lambda c: tm.launch_up_gemv(x, w_up, ids, h, c, scale=su))
            dn, t_dn = _best(timer, gd, lambda c: tm.launch_down_gemv(h, w_down, ids, tw, out, c, scale=sd))
            options.append((t_up + t_dn, {"variant": "gemv", "up": up, "down": dn}))
            print(f"    T={T} gemv: up {t_up:.4f} ms ({up}), down {t_dn:.4f} ms ({dn})")
        for bm in [16] if dry else _bm_cands(T * k / E):
            sid, eid, npad = tm.moe_align_triton(ids, E, bm)
            t_al = timer.eager([lambda: tm.moe_align_triton(ids, E, bm)], rep=25)
            h = torch.empty(sid.numel(), inter, dtype=dtype, device=dev)
            y = torch.empty(T * k, d, dtype=dtype, device=dev)
            out = torch.empty(T, d, dtype=dtype, device=dev)
            cands = _gemm_cands(bm, dry)
            f_up: dict[str, float] = {}
            f_dn: dict[str, float] = {}
            up, t_up = _best(
                timer,
                cands,
                lambda c: tm.launch_up_gemm(x, w_up, h, sid, eid, npad, T * k, k, bm, c, su),
                f_up,
            )
            dn, t_dn = _best(
                timer, cands, lambda c: tm.launch_down_gemm(h, w_down, y, tw, sid, eid, npad, bm, c, sd), f_dn
            )
            forms = {
                f"BM{bm} {stage} {form}": round(ms, 5)
                for stage, d in (("up", f_up), ("down", f_dn))
                for form, ms in d.items()
            }
            print(f"    T={T} BM={bm} fastest of each tile form (ms): {forms}")
            form_ms.update(forms)
            t_cb = timer.eager([lambda: tm.launch_combine(y, out, k)], rep=25)
            options.append(
                (t_al + t_up + t_dn + t_cb, {"variant": "gemm", "BLOCK_M": bm, "up": up, "down": dn})
            )
            if fp8 and (dry or bm >= A8_MIN_BLOCK_M):
                a8_ms, a8_cfg = _tune_a8(timer, x, w_up, w_down, su, sd, tw, ids, (sid, eid, npad), bm, dry)
                form_ms[f"BM{bm} a8 (up + down + quantise x)"] = round(a8_ms, 5)
                options.append((t_al + a8_ms + t_cb, a8_cfg))
        ms, cfg = min(options, key=lambda o: o[0])
        scales = dict(up_scale=su, down_scale=sd)
        got = tm.moe_experts_triton(x, w_up, w_down, w, ids, config=cfg, **scales)
        wu, wd = (w_up, w_down) if fp8 else (w_up.float(), w_down.float())
        if cfg.get("A8", 0):  # against its own contract: e4m3 activations
            want = moe_experts_w8a8_ref(x.float(), w_up, w_down, w, ids, su, sd)
        else:
            want = moe_experts_ref(x.float(), wu, wd, w, ids, **scales)
        err = _rel(got, want)
        if not err < 1e-2:
            raise AssertionError(f"tuned config {cfg} for T={T} disagrees with the reference: {err:.2e}")
        e2e = timer.eager(
            [lambda: tm.moe_experts_triton(x, w_up, w_down, w, ids, config=cfg, **scales)], rep=40
        )
        table[str(T)] = dict(cfg, stage_ms=round(ms, 5), ms=round(e2e, 5))
        if form_ms:
            forms_seen[str(T)] = form_ms
        print(
            f"  tune {s['name']}{' fp8' if fp8 else ''} T={T}: {cfg['variant']} BM={cfg.get('BLOCK_M', '-')} "
            f"up={cfg['up']} down={cfg['down']} stages {ms:.4f} ms, end to end {e2e:.4f} ms (err {err:.1e})"
        )
    return table, forms_seen


def write_tuned(
    tables: dict[str, dict], device_name: str, sha: str, merge: bool = False, arch: str = ""
) -> Path:
    """Write the config file; with merge, the tuned buckets replace theirs in the existing file. arch: the
    chip (`launch_util.device_arch`), by which a GPU of the same chip without its own entry finds these; ""
    keeps the file's."""
    path = tm._device_file(device_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    history = []
    prev = json.loads(path.read_text()) if path.exists() else None
    arch = arch or (prev or {}).get("arch", "")
    if merge and prev is not None:
        history = prev.get("history", []) + [prev.get("tuned_at", "?")]
        old = prev.get("configs", {})
        for shape, buckets in tables.items():
            merged = {**old.get(shape, {}), **buckets}
            old[shape] = dict(sorted(merged.items(), key=lambda kv: int(kv[0])))
        tables = old
    elif (
        prev is not None
    ):  # a whole tuning replaces the 16-bit shapes; the e4m3 experts' entries it never tunes stay
        kept = prev.get("configs", {})
        tables = {**{k: v for k, v in kept.items() if k.endswith(",w=fp8") and k not in tables}, **tables}
    doc = dict(
        device=device_name,
        arch=arch,
        triton=__import__("triton").__version__,
        torch=torch.__version__,
        tuned_at=sha,
        date=_dt.date.today().isoformat(),
        history=history,
        note="written by benchmarks/bench_moe.py --tune; keys E (experts), N (intermediate), K (hidden "
        "or latent), token bucket; ms = end to end eager at that token count; history = earlier "
        "tunings whose buckets a --tune-sizes run kept; arch = the chip, whose other GPUs take these "
        "entries where their own file has none",
        configs=tables,
    )
    path.write_text(json.dumps(doc, indent=1) + "\n")
    tm._tuned_table.cache_clear()
    tm._chip_tables.cache_clear()
    tm._bucket_config.cache_clear()
    return path


# --------------------------------------------------------------------------- benchmark


def bench_experts(s: dict, sizes: list[int], dev, dtype, timer: Timer, ceil: dict, dry: bool) -> list[dict]:
    w_up, w_down = _weights(s, dev, dtype)
    up64, down64 = w_up.double(), w_down.double()
    recs = []
    for T in sizes:
        sets = _inputs(s, T, dev, dtype, GRAPH_SETS)
        x, w, ids = sets[0]
        exact = moe_experts_ref(x.double(), up64, down64, w.double(), ids)
        fused = tm.moe_experts_triton(x, w_up, w_down, w, ids)
        err = _rel(fused, exact)
        try:
            peer = grouped_mm_moe(x, w_up, w_down, w, ids)
            err_peer = _rel(peer, exact)
        except Exception as e:  # noqa: BLE001 - recorded, the rest still runs
            peer, err_peer = None, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        err_loop = _rel(loop_moe(x, w_up, w_down, w, ids), exact)
        ok = err < 1e-2
        cfg = tm.moe_config(s["E"], s["I"], s["d"], T, s["k"], dev)
        rec = dict(
            layer=s["name"],
            T=T,
            E=s["E"],
            k=s["k"],
            N=s["I"],
            K=s["d"],
            config=cfg,
            rel_err=err,
            rel_err_grouped_mm=err_peer,
            rel_err_loop=err_loop,
            correct=ok,
        )
        rec.update(_roofline(s, ids, T, ceil))
        if not ok:
            print(f"FAIL {s['name']} T={T}: fused relative error {err:.2e}: not timed")
            recs.append(rec)
            continue
        fused_fns = [lambda a=a: tm.moe_experts_triton(a[0], w_up, w_down, a[1], a[2]) for a in sets]
        rec["fused_eager_ms"] = timer.eager(fused_fns)
        rec["fused_graph_ms"] = timer.graph(fused_fns)
        if peer is not None:
            peer_fns = [lambda a=a: grouped_mm_moe(a[0], w_up, w_down, a[1], a[2]) for a in sets]
            rec["grouped_mm_eager_ms"] = timer.eager(peer_fns)
            rec["grouped_mm_graph_ms"] = timer.graph(peer_fns)
        rec["loop_eager_ms"] = timer.eager(
            [lambda a=a: loop_moe(a[0], w_up, w_down, a[1], a[2]) for a in sets[:2]],
            rep=40 if T < 1024 else 150,
        )
        best = min(rec["fused_eager_ms"], rec["fused_graph_ms"])
        rec["fused_best_ms"] = best
        rec["ratio_to_roofline"] = best / rec["roofline_ms"]
        rec["achieved_TBps"] = rec["bytes"] / (best * 1e-3) / 1e12
        rec["fraction_of_read_bw"] = rec["bytes"] / (best * 1e-3) / ceil["read_bw"]
        if peer is not None:
            rec["speedup_vs_grouped_mm_eager"] = rec["grouped_mm_eager_ms"] / rec["fused_eager_ms"]
            rec["speedup_vs_grouped_mm_graph"] = rec["grouped_mm_graph_ms"] / rec["fused_graph_ms"]
        rec["speedup_vs_loop"] = rec["loop_eager_ms"] / rec["fused_eager_ms"]
        print(
            f"  {s['name'][:24]} T={T:5d}: fused {rec['fused_eager_ms']:.4f} eager / "
            f"{rec['fused_graph_ms']:.4f} graph ms | grouped_mm "
            f"{rec.get('grouped_mm_eager_ms', float('nan')):.4f} / "
            f"{rec.get('grouped_mm_graph_ms', float('nan')):.4f} | loop {rec['loop_eager_ms']:.3f} | "
            f"roofline {rec['roofline_ms']:.4f} ({rec['bound']}) x{rec['ratio_to_roofline']:.2f} | "
            f"{rec['achieved_TBps']:.2f} TB/s | err {err:.1e}"
        )
        recs.append(rec)
    return recs


def bench_fp8_experts(s: dict, sizes: list[int], dev, dtype, timer: Timer, ceil: dict) -> list[dict]:
    """e4m3 experts at each token count, replayed from a graph: the shape's 16-bit tile entry (what FP8
    experts run without an entry of their own) against the FP8 entry, each checked against the float32
    reference first, quoted against the bytes roofline of one-byte weights."""
    (w_up, su), (w_down, sd) = (quantize_experts_ref(w) for w in _weights(s, dev, dtype))
    scales = dict(up_scale=su, down_scale=sd)
    recs = []
    for T in sizes:
        sets = _inputs(s, T, dev, dtype, GRAPH_SETS)
        x, w, ids = sets[0]
        want = moe_experts_ref(x.float(), w_up, w_down, w, ids, **scales)
        rec = dict(layer=s["name"], T=T, weights="fp8", **_roofline(s, ids, T, ceil, elt=1))
        for tag, fp8_key in (("bf16_entry", False), ("fp8_entry", True)):
            cfg = tm.moe_config(s["E"], s["I"], s["d"], T, s["k"], dev, fp8=fp8_key)
            err = _rel(tm.moe_experts_triton(x, w_up, w_down, w, ids, config=cfg, **scales), want)
            rec[f"{tag}_config"], rec[f"{tag}_rel_err"] = cfg, err
            if err < 1e-2:
                fns = [
                    lambda a=a, c=cfg: tm.moe_experts_triton(
                        a[0], w_up, w_down, a[1], a[2], config=c, **scales
                    )
                    for a in sets
                ]
                rec[f"{tag}_graph_ms"] = timer.graph(fns)
        rec["correct"] = all(rec[f"{t}_rel_err"] < 1e-2 for t in ("bf16_entry", "fp8_entry"))
        if rec["correct"]:
            rec["speedup"] = rec["bf16_entry_graph_ms"] / rec["fp8_entry_graph_ms"]
            rec["fraction_of_bytes_roofline"] = rec["bytes_ms"] / rec["fp8_entry_graph_ms"]
        nan = float("nan")
        print(
            f"  {s['name'][:24]} fp8 T={T:5d}: 16-bit entry {rec.get('bf16_entry_graph_ms', nan):.4f} ms, "
            f"fp8 entry {rec.get('fp8_entry_graph_ms', nan):.4f} ms, bytes roofline {rec['bytes_ms']:.4f} ms "
            f"(errors {rec['bf16_entry_rel_err']:.1e} / {rec['fp8_entry_rel_err']:.1e})"
        )
        recs.append(rec)
    return recs


def bench_layer(s: dict, sizes: list[int], dev, dtype, timer: Timer, ceil: dict, dry: bool) -> list[dict]:
    """The whole MoE module (router, latent projections, routed experts, shared expert) via the model code."""
    from hyserve.kernels import ops
    from hyserve.model.moe import MoE
    from hyserve.model.nemotron_h.config import HybridModelConfig

    if s["raw"] is None:
        raw = json.loads(
            (ROOT / "tests" / "configs" / "tiny-nemotron-3-latent-moe" / "config.json").read_text()
        )
    else:
        raw = dict(s["raw"])
    raw.pop("auto_map", None)
    cfg = HybridModelConfig.from_dict(raw)
    layer = MoE(cfg.moe_spec(), device=dev, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_((torch.randn(p.shape, device=dev) * p.shape[-1] ** -0.5).to(p.dtype))
    H, L = cfg.hidden_size, cfg.moe_latent_size or cfg.hidden_size
    E, inter, sh = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_shared_expert_intermediate_size
    recs = []
    for T in sizes:
        xs = [torch.randn(T, H, device=dev).to(dtype) for _ in range(GRAPH_SETS)]
        with torch.no_grad():
            got = layer(xs[0])
            with ops.reference_on_cuda():  # the reference path on the same device, in float64
                layer64 = copy.deepcopy(layer).double()
                want = layer64(xs[0].double())
                del layer64
            _, ids = layer.gate(xs[0])
        err = _rel(got, want)
        touched = int(torch.unique(ids).numel())
        wbytes = (
            touched * 2 * inter * L + 2 * H * sh + (2 * H * L if cfg.moe_latent_size else 0)
        ) * 2 + E * H * 4
        flops = (
            2
            * T
            * (
                cfg.num_experts_per_tok * 2 * inter * L
                + 2 * H * sh
                + (2 * H * L if cfg.moe_latent_size else 0)
                + E * H
            )
        )
        roof = max((wbytes + 4 * T * H) / ceil["read_bw"], flops / ceil["matmul_flops"]) * 1e3
        rec = dict(
            layer=f"{s['name']} MoE module",
            T=T,
            rel_err=err,
            correct=err < 1e-2,
            roofline_ms=roof,
            bytes=wbytes + 4 * T * H,
            flops=flops,
            experts_touched=touched,
        )
        if rec["correct"]:
            fns = [lambda a=a: layer(a) for a in xs]
            with torch.no_grad():
                rec["eager_ms"] = timer.eager(fns)
                rec["graph_ms"] = timer.graph(fns)
            rec["ratio_to_roofline"] = min(rec["eager_ms"], rec["graph_ms"]) / roof
            print(
                f"  {rec['layer'][:40]} T={T:5d}: {rec['eager_ms']:.4f} eager / {rec['graph_ms']:.4f} graph "
                f"ms | roofline {roof:.4f} x{rec['ratio_to_roofline']:.2f} | err {err:.1e}"
            )
        else:
            print(f"FAIL {rec['layer']} T={T}: relative error {err:.2e}: not timed")
        recs.append(rec)
    return recs


def _fmt(v, f=".4f") -> str:
    return format(v, f) if isinstance(v, (int, float)) else "-"


def _table(doc: dict) -> str:
    c = doc["ceilings"]
    lines = [
        f"ceilings: bytes read {c['read_bw'] / 1e12:.2f} TB/s, bf16 matmul {c['matmul_flops'] / 1e12:.0f} "
        "TFLOP/s",
        "",
        "| layer | T | fused eager ms | fused graph ms | _grouped_mm eager / graph ms | loop ms | roofline "
        "ms (bound) | x roofline | TB/s | vs _grouped_mm (eager, graph) | config |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["experts"]:
        cfg = r["config"]
        cs = cfg["variant"] + (f" BM{cfg['BLOCK_M']}" if cfg["variant"] == "gemm" else "")
        lines.append(
            f"| {r['layer'].split('-BF16')[0]} | {r['T']} | {_fmt(r.get('fused_eager_ms'))} | "
            f"{_fmt(r.get('fused_graph_ms'))} | {_fmt(r.get('grouped_mm_eager_ms'))} / "
            f"{_fmt(r.get('grouped_mm_graph_ms'))} | {_fmt(r.get('loop_eager_ms'), '.3f')} | "
            f"{r['roofline_ms']:.4f} ({r['bound']}) | {_fmt(r.get('ratio_to_roofline'), '.2f')} | "
            f"{_fmt(r.get('achieved_TBps'), '.2f')} | {_fmt(r.get('speedup_vs_grouped_mm_eager'), '.2f')}x, "
            f"{_fmt(r.get('speedup_vs_grouped_mm_graph'), '.2f')}x | {cs} |"
        )
    if doc.get("layers"):
        lines += [
            "",
            "| MoE module | T | eager ms | graph ms | roofline ms | x roofline |",
            "|---|---|---|---|---|---|",
        ]
        for r in doc["layers"]:
            lines.append(
                f"| {r['layer'].split('-BF16')[0]} | {r['T']} | {_fmt(r.get('eager_ms'))} | "
                f"{_fmt(r.get('graph_ms'))} | {r['roofline_ms']:.4f} | "
                f"{_fmt(r.get('ratio_to_roofline'), '.2f')} |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--tune", action="store_true", help="autotune every bucket first and write the config file"
    )
    ap.add_argument("--tune-only", action="store_true", help="tune, write the config file, no benchmark")
    ap.add_argument("--tune-sizes", default="", help="tune only these buckets and merge them into the file")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--no-super", action="store_true", help="skip the Super latent layer")
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="e4m3 experts: tune their own entries (merged into the file under the ',w=fp8' key) and "
        "time them against the 16-bit entries",
    )
    args = parse_run_args(ap, "moe")
    dry = args.dry_run
    if (run := run_device(dry, "bench_moe")) is None:
        return 2
    torch.manual_seed(0)
    dev, dtype = run
    sha = git_sha(args.git_sha)
    timer = Timer(dry)
    sizes = [int(t) for t in args.sizes.split(",")]
    shapes = [_dry_shape(NANO), _dry_shape(SUPER)] if dry else [_shape(NANO), _shape(SUPER)]
    if args.no_super:
        shapes = shapes[:1]
    if not dry:
        from hyserve.kernels import ops

        ops.load_cuda_kernels()
    gpu = torch.cuda.get_device_name() if not dry else "cpu (interpreter)"
    doc: dict = dict(
        date=_dt.date.today().isoformat(),
        git_sha=sha,
        gpu=gpu,
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        command=" ".join(invocation()),
    )
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"moe_{sha}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.tune or args.tune_only or args.tune_sizes:
        t0 = time.time()
        buckets = [1, 2, 4, 8] if dry else list(tm.TOKEN_BUCKETS)
        if args.tune_sizes:
            buckets = [int(t) for t in args.tune_sizes.split(",")]
        tuned = {
            tm.shape_key(s["E"], s["I"], s["d"], args.fp8): tune_shape(
                s, buckets, dev, dtype, timer, dry, args.fp8
            )
            for s in shapes
        }
        tables = {key: table for key, (table, _) in tuned.items()}
        merge = bool(args.tune_sizes) or args.fp8
        path = write_tuned(tables, gpu, sha, merge=merge, arch=device_arch(None)) if not dry else None
        print(
            f"tuned in {time.time() - t0:.0f} s" + (f": wrote {path}" if path else " (dry-run: not written)")
        )
        doc["tuned"] = tables
        doc["tile_forms_ms"] = {key: forms for key, (_, forms) in tuned.items()}
        if args.tune_only:
            out.write_text(json.dumps(doc, indent=1) + "\n")
            return 0
    doc["ceilings"] = moe_ceilings(dev, dry)
    doc["experts"] = []
    doc["layers"] = []
    if args.fp8:
        if dry:
            print("--fp8 times the GPU kernels only: nothing to time under --dry-run")
            return 0
        doc["fp8_experts"] = [
            r for s in shapes for r in bench_fp8_experts(s, sizes, dev, dtype, timer, doc["ceilings"])
        ]
        out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out}")
        return 0 if all(r["correct"] for r in doc["fp8_experts"]) else 1
    for s in shapes:
        doc["experts"] += bench_experts(s, sizes, dev, dtype, timer, doc["ceilings"], dry)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        if not dry:
            torch.cuda.empty_cache()
    super_shape = shapes[-1] if len(shapes) > 1 else None
    if super_shape is not None:
        doc["layers"] += bench_layer(super_shape, sizes, dev, dtype, timer, doc["ceilings"], dry)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    table = _table(doc)
    out.with_suffix(".md").write_text(table + "\n")
    print()
    print(table)
    print(f"\nwrote {out}")
    bad = [r for r in doc["experts"] + doc["layers"] if not r["correct"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
