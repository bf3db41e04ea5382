# ruff: noqa: B023  (the timed lambdas run inside the loop iteration that defines them)
"""The batch-1 MoE decode GEMVs of Nemotron 3 Nano 30B-A3B as a decode step runs them, and a sweep of their
launch settings (docs/architecture.md, "MoE").

Each of the model's MoE layers (23, every one with its own weights, so nothing stays in L2) runs the chain of
a decode step: router GEMV -> route -> up GEMV (routed experts + the folded shared expert) -> down GEMV. All
layers are captured in one CUDA graph, with programmatic dependent launches where the GPU has them, and
replayed; a setting's time is the replay's per layer. `bench_moe.py --tune` times each GEMV alone and eager,
without the shared expert and without the kernels around it; this times the form that serving replays,
including the EARLY forms (work that does not depend on the kernel before runs ahead of its PDL wait).

Every setting is checked against the float64 reference (`moe_experts_ref` with the shared expert) before it
is timed, and what its graph replays leave in every layer's output against the late form's replays. The
ratio is bytes read (the 6 routed experts + the shared expert + the router weight per layer) over the
streaming-read ceiling measured in the same run.

    python -m benchmarks.bench_moe_decode [--write] [--layers 23]   # --write: the fastest setting
                                                                    # becomes the 1-token entry of
                                                                    # moe_configs/<GPU>.json
    python -m benchmarks.bench_moe_decode --dry-run                 # CPU, tiny shapes, interpreter
    ncu --clock-control none -k regex:"_(up|down)_gemv" --launch-skip 8 --launch-count 2 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats \
        --section WarpStateStats --section Occupancy python3 -m benchmarks.bench_moe_decode --profile-once
                                 # 4 layers' chains twice at the tuned 1-token settings, eager, then exit: the
                                 # profiler's view of the second chain's first up and down GEMV
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

import benchmarks.bench_moe as bm  # noqa: E402
import hyserve.kernels.triton_moe as tm  # noqa: E402
from benchmarks import invocation  # noqa: E402
from hyserve.bench.report import git_sha  # noqa: E402
from hyserve.kernels.fp8_linear import quantize_weight_ref  # noqa: E402
from hyserve.kernels.launch_util import device_arch  # noqa: E402
from hyserve.kernels.moe import dequantize_experts, moe_experts_ref  # noqa: E402

# (BLOCK_N, BLOCK_K, num_warps, num_stages); the first of each list is the 1-token entry tuned at 1a89c47
# (the H100 run of 1303d9a found short rows and few warps fastest: up 4 x 128 on 2 warps, down one row on one
# warp; the entries after those are their neighbours)
UP = [
    (4, 256, 4, 6),
    (8, 256, 4, 3),
    (8, 256, 4, 4),
    (4, 256, 4, 4),
    (4, 512, 4, 4),
    (16, 256, 8, 3),
    (2, 512, 2, 4),
    (8, 128, 4, 6),
    (4, 128, 2, 6),
    (2, 128, 1, 6),
    (4, 128, 2, 8),
    (8, 128, 2, 6),
    (2, 256, 1, 6),
]
DOWN = [
    (4, 512, 4, 4),
    (2, 512, 4, 4),
    (2, 1024, 4, 2),
    (1, 1024, 2, 4),
    (2, 256, 2, 6),
    (8, 256, 4, 3),
    (4, 256, 4, 6),
    (1, 512, 1, 6),
    (2, 512, 2, 4),
    (4, 128, 4, 8),
    (1, 512, 1, 4),
    (1, 256, 1, 8),
    (1, 1024, 1, 4),
    (2, 512, 1, 6),
]
NESTED = [(4, 512, 4, 4), (1, 512, 1, 6), (1, 1024, 2, 4)]  # down forms also tried with a K loop per slot
# one stage: no cp.async ring through shared memory, the tile loads straight into registers (Nsight Compute on
# the H100, b54b3d7: the up GEMV stalls a third of its cycles on the MIO queue, the down GEMV on the
# shared-memory scoreboard; shared memory also caps their occupancy)
UP += [(4, 512, 2, 1), (8, 512, 4, 1), (4, 1024, 4, 1), (8, 256, 2, 1), (2, 1024, 2, 1)]
DOWN += [(2, 1024, 2, 1), (4, 512, 2, 1), (1, 1024, 1, 1), (2, 512, 1, 1), (4, 1024, 4, 1)]
# the down GEMV split by slot (down.SPLIT; a combine kernel after it): laid out like the up GEMV, whose best
# read at 0.93-0.95 of the ceiling on both GPUs while the flat down GEMV read at 0.71 (H200) / 0.85 (H100)
SPLIT = [(4, 128, 2, 8), (4, 256, 4, 6), (8, 128, 4, 6), (2, 256, 1, 6), (4, 512, 2, 1), (8, 256, 2, 4)]
# e4m3 experts (--fp8): a tile holds half the bytes of the same 16-bit tile, so fewer loads are in flight per
# program, and Nemotron 3 Super's latent rows (K 1024 for up) leave an up program one or two K tiles; wider
# programs (more rows, whole rows a tile) keep bytes in flight and read the 16-bit activation row once per
# BLOCK_N weight rows (the H200's Super run, 1b0f1df: the down GEMV at 108 us a layer for 60.5 MB with the
# bf16-tuned one-row tiles, the up at 36 us)
UP_FP8 = [(8, 1024, 4, 1), (16, 1024, 8, 1), (16, 512, 4, 2), (8, 1024, 4, 2), (16, 512, 8, 3)]
DOWN_FP8 = [(8, 1024, 4, 2), (8, 512, 4, 3), (16, 512, 8, 2), (4, 1024, 4, 3), (16, 256, 4, 4)]
SPLIT_FP8 = [(8, 512, 4, 3), (16, 256, 4, 4), (8, 1024, 4, 2), (16, 512, 8, 2)]
DRY = [(32, 32, 1, 1)]


def _sub(t: tuple, early: int, flat: int | None = None) -> dict:
    d = dict(BLOCK_N=t[0], BLOCK_K=t[1], num_warps=t[2], num_stages=t[3], EARLY=early)
    if flat is not None:
        d["FLAT"] = flat
    return d


class Layers:
    """The MoE layers' weights and one token's input; `chain(cfg)` launches every layer's decode chain.

    As the model runs them: the router reads the hidden state (H wide) and the experts the latent one (d; the
    same tensor where there is no latent projection); the shared expert rides in the experts' GEMVs only for
    16-bit, non-latent MoE (Nano 30B-A3B), elsewhere it is the model's MLP and not part of this chain. fp8:
    e4m3 experts with per-expert channel scales, each expert quantised from its own float32 draw."""

    def __init__(self, s: dict, n: int, dev, dtype, fp8: bool = False) -> None:
        raw = s["raw"] or {}
        self.s, self.fp8 = s, fp8
        folded = not fp8 and not raw.get("moe_latent_size")
        self.S = (raw.get("moe_shared_expert_intermediate_size") or 2 * s["I"]) // s["I"] if folded else 0
        self.n_group, self.topk_group = raw.get("n_group", 1), raw.get("topk_group", 1)
        self.norm, self.scale = raw.get("norm_topk_prob", True), raw.get("routed_scaling_factor", 1.0)
        E, d, inter, H = s["E"], s["d"], s["I"], s.get("H", s["d"])
        g = torch.Generator(device=dev).manual_seed(0)

        def rnd(*shape, std):
            return (torch.randn(*shape, device=dev, generator=g) * std).to(dtype)

        def experts(N: int, K: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            if not fp8:
                return rnd(E, N, K, std=K**-0.5), None
            q = torch.empty(E, N, K, dtype=torch.float8_e4m3fn, device=dev)
            scale = torch.empty(E, N, dtype=torch.float32, device=dev)
            for e in range(E):  # one expert at a time: no float32 copy of the whole stack
                q[e], scale[e] = quantize_weight_ref(
                    torch.randn(N, K, device=dev, generator=g) * K**-0.5, "channel"
                )
            return q, scale

        self.layers = []
        for _ in range(n):
            (up, up_s), (down, down_s) = experts(inter, d), experts(d, inter)
            self.layers.append(
                dict(
                    router=torch.randn(E, H, device=dev, generator=g) * H**-0.5,
                    bias=torch.zeros(E, device=dev),
                    up=up,
                    down=down,
                    up_s=up_s,
                    down_s=down_s,
                    su=rnd(self.S * inter, d, std=d**-0.5) if self.S else None,
                    sd=rnd(d, self.S * inter, std=(self.S * inter) ** -0.5) if self.S else None,
                )
            )
        self.x = rnd(1, d, std=1.0)
        self.xh = self.x if H == d else rnd(1, H, std=1.0)
        self.outs = [torch.empty(1, d, dtype=dtype, device=dev) for _ in range(n)]

    def route(self, L: dict):
        logits = tm.router_logits_triton(self.xh, L["router"])
        return tm.moe_route_triton(
            logits, L["bias"], self.s["k"], self.n_group, self.topk_group, self.norm, self.scale
        )

    def route_up(self, L: dict, cfg: dict) -> tuple:
        """One layer's route and up GEMV: (routing weights, expert ids, h)."""
        w, ids = self.route(L)
        h = torch.empty(self.s["k"] + self.S, self.s["I"], dtype=self.x.dtype, device=self.x.device)
        tm.launch_up_gemv(self.x, L["up"], ids, h, cfg["up"], L["su"], L["up_s"])
        return w, ids, h

    def chain(self, cfg: dict) -> None:
        for L, out in zip(self.layers, self.outs):
            w, ids, h = self.route_up(L, cfg)
            tm.launch_down(h, L["down"], ids, w, out, cfg["down"], L["sd"], L["down_s"])

    def split_chains(self, cfg: dict) -> tuple:
        """The up GEMVs alone and the down GEMVs alone over every layer, with each layer's routing and h made
        once beforehand: what each kernel costs of the chain, bytes over time, with no route between them."""
        pre = [self.route_up(L, cfg) for L in self.layers]

        def ups() -> None:
            for L, (_, ids, h) in zip(self.layers, pre):
                tm.launch_up_gemv(self.x, L["up"], ids, h, cfg["up"], L["su"], L["up_s"])

        def downs() -> None:
            for L, (w, ids, h), out in zip(self.layers, pre, self.outs):
                tm.launch_down(h, L["down"], ids, w, out, cfg["down"], L["sd"], L["down_s"])

        return ups, downs

    def gemv_bytes(self, which: str) -> int:
        """Weight bytes the up or the down GEMV reads a layer: k routed experts + the shared expert, and FP8
        experts' float32 channel scales (the up GEMV's [I] per expert, the down GEMV's [d])."""
        s = self.s
        scales = s["k"] * (s["I"] if which == "up" else s["d"]) * 4 if self.fp8 else 0
        return (s["k"] + self.S) * s["I"] * s["d"] * self.layers[0]["up"].element_size() + scales

    def error(self, cfg: dict) -> float:
        """Relative error of layer 0 under `cfg` against the float64 reference (the shared expert folded in
        where it is; FP8 experts dequantised)."""
        L = self.layers[0]
        w, ids = self.route(L)
        got = tm.moe_experts_triton(
            self.x,
            L["up"],
            L["down"],
            w,
            ids,
            L["su"],
            L["sd"],
            up_scale=L["up_s"],
            down_scale=L["down_s"],
            config=cfg,
        )
        f64 = torch.float64
        if self.fp8:
            up, down = (
                dequantize_experts(L["up"], L["up_s"], f64),
                dequantize_experts(L["down"], L["down_s"], f64),
            )
        else:
            up, down = L["up"].double(), L["down"].double()
        want = moe_experts_ref(
            self.x.double(),
            up,
            down,
            w.double(),
            ids,
            None if L["su"] is None else L["su"].double(),
            None if L["sd"] is None else L["sd"].double(),
        )
        return bm._rel(got, want)

    def bytes_per_layer(self) -> int:
        s = self.s
        return self.gemv_bytes("up") + self.gemv_bytes("down") + s["E"] * s.get("H", s["d"]) * 4


def _super_layers(s: dict, fp8: bool) -> int:
    """16 Super MoE layers, or as many as 0.7 of the GPU's free memory holds (an H100 holds 9 in bf16)."""
    per_layer = 2 * s["E"] * s["I"] * s["d"] * (1 if fp8 else 2)
    return max(2, min(16, int(0.7 * torch.cuda.mem_get_info()[0] // per_layer)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--shape",
        choices=("nano", "super"),
        default="nano",
        help="Nemotron 3 Nano 30B-A3B (128 experts, top-6, the shared expert folded in) or Super "
        "120B-A12B (512 experts, top-22, latent 1024, the shared expert outside the chain)",
    )
    ap.add_argument(
        "--fp8",
        action="store_true",
        help="e4m3 experts with channel scales; --write then sets the shape's ',w=fp8' entry",
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="MoE layers in the chain (default: Nano 30B-A3B's 23; Super 16 of its 40, fewer where the "
        "GPU's free memory holds fewer: 5.6 GB a layer in bf16, 2.8 GB in FP8; nothing stays in L2 "
        "either way)",
    )
    ap.add_argument(
        "--write", action="store_true", help="the fastest setting becomes the 1-token config entry"
    )
    ap.add_argument(
        "--profile-once",
        action="store_true",
        help="run 4 layers' chains twice at the tuned 1-token settings and exit (under ncu)",
    )
    args = bm.parse_run_args(ap, "moe_decode")
    dry = args.dry_run
    if (run := bm.run_device(dry, "bench_moe_decode")) is None:
        return 2
    dev, dtype = run
    sha = git_sha(args.git_sha)
    name = bm.NANO if args.shape == "nano" else bm.SUPER
    s = bm._dry_shape(name) if dry else bm._shape(name)
    if dry and args.shape == "super":  # the latent layout in small: the router reads a wider hidden state
        s = dict(s, H=2 * s["d"], raw={"moe_latent_size": s["d"]})
    n = 2 if dry else (args.layers or (23 if args.shape == "nano" else _super_layers(s, args.fp8)))
    timer = bm.Timer(dry)
    ceil = bm.moe_ceilings(dev, dry)
    if args.profile_once:
        net = Layers(s, min(n, 4), dev, dtype, args.fp8)
        cfg = tm.moe_config(s["E"], s["I"], s["d"], 1, s["k"], torch.device(dev), fp8=args.fp8)
        print(f"profiling the chain at {cfg}")
        for _ in range(2):
            net.chain(cfg)
        if not dry:
            torch.cuda.synchronize()
        return 0
    net = Layers(s, n, dev, dtype, args.fp8)
    per_layer_bytes = net.bytes_per_layer()
    ups, downs = (DRY, DRY) if dry else (UP + UP_FP8, DOWN + DOWN_FP8) if args.fp8 else (UP, DOWN)
    rows: list[dict] = []
    late_outs: list[torch.Tensor] = []  # the late form's replayed outputs, the first setting run

    def run(up: dict, down: dict, what: str) -> float:
        cfg = {"variant": "gemv", "up": up, "down": down}
        try:
            err = net.error(cfg)
            if not err < 1e-2:
                raise AssertionError(f"relative error {err:.2e} against float64")
            ms = timer.graph([lambda: net.chain(cfg)], replays=15) / n
            # what the replays left in every layer's output, against the late form's replays
            if late_outs:
                rerr = max(bm._rel(o, r) for o, r in zip(net.outs, late_outs))
                if not rerr < 1e-2:
                    raise AssertionError(f"replayed outputs differ from the late form's: {rerr:.2e}")
            else:
                late_outs.extend(o.clone() for o in net.outs)
        except Exception as e:  # noqa: BLE001 - a setting that does not compile or fit is recorded and skipped
            print(f"  skip {what} {up} {down}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
            rows.append(dict(what=what, up=up, down=down, error=f"{type(e).__name__}: {str(e)[:200]}"))
            return float("inf")
        frac = per_layer_bytes / (ms * 1e-3) / ceil["read_bw"]
        rows.append(
            dict(what=what, up=up, down=down, rel_err=err, us_per_layer=ms * 1e3, fraction_of_read_bw=frac)
        )
        print(
            f"  {what:9s} up {tuple(up.values())} down {tuple(down.values())}: {ms * 1e3:7.2f} us a layer, "
            f"{frac:.3f} of the read ceiling (err {err:.1e})"
        )
        return ms

    # the chain without the expert GEMVs: what the router and route cost between them
    def route_only() -> None:
        for L in net.layers:
            net.route(L)

    t_route = timer.graph([route_only], replays=15) / n
    print(f"router + route alone: {t_route * 1e3:.2f} us a layer")
    base_up, base_down = ups[0], downs[0]
    t_late = run(_sub(base_up, 0), _sub(base_down, 0, 1), "late")
    best = (run(_sub(base_up, 1), _sub(base_down, 1, 1), "early"), _sub(base_up, 1), _sub(base_down, 1, 1))
    for u in ups[1:]:
        for early in (1, 0):
            t = run(_sub(u, early), best[2], "up sweep")
            if t < best[0]:
                best = (t, _sub(u, early), best[2])
    # the down GEMV's forms at the best up setting: flat (both EARLY forms), nested (a K loop per slot; EARLY
    # needs FLAT), and split by slot with the combine kernel after it (no EARLY)
    down_forms = [(_sub(dn, early, 1), "down sweep") for dn in downs[1:] for early in (1, 0)]
    down_forms += [(_sub(dn, 0, 0), "down nested") for dn in (DRY if dry else NESTED)]
    down_forms += [
        ({**{k: v for k, v in _sub(dn, 0).items() if k != "EARLY"}, "SPLIT": 1}, "down split")
        for dn in (DRY if dry else SPLIT + SPLIT_FP8 if args.fp8 else SPLIT)
    ]
    for dn, what in down_forms:
        t = run(best[1], dn, what)
        if t < best[0]:
            best = (t, best[1], dn)
    t_best, up_best, down_best = best
    # each expert GEMV of the best setting alone: which of the two holds the chain back
    ups_only, downs_only = net.split_chains({"up": up_best, "down": down_best})
    t_up, t_down = (timer.graph([f], replays=15) / n for f in (ups_only, downs_only))
    gu, gd = net.gemv_bytes("up"), net.gemv_bytes("down")
    alone = dict(
        up_us=t_up * 1e3,
        down_us=t_down * 1e3,
        up_bytes=gu,
        down_bytes=gd,
        up_fraction=gu / (t_up * 1e-3) / ceil["read_bw"],
        down_fraction=gd / (t_down * 1e-3) / ceil["read_bw"],
    )
    print(
        f"best setting's GEMVs alone: up {t_up * 1e3:.2f} us ({alone['up_fraction']:.3f} of the read "
        f"ceiling), down {t_down * 1e3:.2f} us ({alone['down_fraction']:.3f}), {gu / 1e6:.1f} / "
        f"{gd / 1e6:.1f} MB a layer"
    )
    gpu = torch.cuda.get_device_name() if not dry else "cpu (interpreter)"
    doc = dict(
        date=_dt.date.today().isoformat(),
        git_sha=sha,
        gpu=gpu,
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        command=" ".join(invocation()),
        layer=s["name"],
        fp8=args.fp8,
        layers=n,
        shared_chunks=net.S,
        bytes_per_layer=per_layer_bytes,
        ceilings=ceil,
        router_route_us_per_layer=t_route * 1e3,
        late_us_per_layer=t_late * 1e3,
        best=dict(
            up=up_best,
            down=down_best,
            us_per_layer=t_best * 1e3,
            fraction_of_read_bw=per_layer_bytes / (t_best * 1e-3) / ceil["read_bw"],
        ),
        speedup_best_vs_late=t_late / t_best,
        gemvs_alone=alone,
        rows=rows,
    )
    print(
        f"best: {t_best * 1e3:.2f} us a layer ({doc['best']['fraction_of_read_bw']:.3f} of the read "
        f"ceiling), late form at the tuned settings {t_late * 1e3:.2f} us: {t_late / t_best:.3f}x"
    )
    if args.write and not dry:
        key = tm.shape_key(s["E"], s["I"], s["d"], fp8=args.fp8)
        table = {
            key: {
                "1": {
                    "variant": "gemv",
                    "up": up_best,
                    "down": down_best,
                    "stage_ms": round(t_best, 5),
                    "ms": round(t_best, 5),
                }
            }
        }
        path = bm.write_tuned(table, gpu, sha, merge=True, arch=device_arch(None))
        doc["wrote"] = str(path.relative_to(ROOT))
        print(f"wrote the 1-token entry of {key} into {path}")
    tag = ("" if args.shape == "nano" else "_super") + ("_fp8" if args.fp8 else "")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"moe_decode{tag}_{sha}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    md = [
        f"# MoE decode chain, batch 1 ({s['name']}{', e4m3 experts' if args.fp8 else ''}, {n} layers, {gpu}, "
        f"{sha}, {doc['date']})",
        "",
        f"`{doc['command']}`; read ceiling {ceil['read_bw'] / 1e12:.3f} TB/s (same run); "
        f"{per_layer_bytes / 1e6:.1f} MB a layer; router + route alone {t_route * 1e3:.2f} us a layer",
        "",
        "| what | up (BLOCK_N, BLOCK_K, warps, stages, EARLY) | down (..., EARLY, FLAT) | us / layer | of "
        "read ceiling |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if "us_per_layer" in r:
            md.append(
                f"| {r['what']} | {tuple(r['up'].values())} | {tuple(r['down'].values())} | "
                f"{r['us_per_layer']:.2f} | {r['fraction_of_read_bw']:.3f} |"
            )
    md += [
        "",
        f"best {t_best * 1e3:.2f} us ({doc['best']['fraction_of_read_bw']:.3f}); "
        f"late form at the tuned settings {t_late * 1e3:.2f} us; ratio {t_late / t_best:.3f}x",
        "",
        f"best setting's GEMVs alone, every layer in one graph: up {alone['up_us']:.2f} us "
        f"({alone['up_fraction']:.3f} of the read ceiling), down {alone['down_us']:.2f} us "
        f"({alone['down_fraction']:.3f}), {gu / 1e6:.1f} / {gd / 1e6:.1f} MB a layer",
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
