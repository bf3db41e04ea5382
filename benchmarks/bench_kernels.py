# ruff: noqa: B023  (the timed lambdas run inside the loop iteration that defines them)
"""Kernel benchmarks at Nemotron Nano 9B v2 shapes: every Triton kernel is first checked against its
plain-torch reference, then timed with `triton.testing.do_bench` and quoted against a roofline at the
ceilings measured in the same run (benchmarks/roofline.py; each record also carries the ratio at the
H200's published peaks) or a peer measured in the same run (torch SDPA; mamba_ssm's SSD scan when the
package is installed).

    python -m benchmarks.bench_kernels                       # on the GPU: writes
                                                             # benchmarks/results/kernels_<date>.json
    python -m benchmarks.bench_kernels --only ssm,attn       # a subset
    python -m benchmarks.bench_kernels --only ssd_sweep      # SSD block-size alternatives (not in the
                                                             # default run)
    python -m benchmarks.bench_kernels --only attn_sweep     # paged attention launch alternatives (idem)
    python -m benchmarks.bench_kernels --only linear_sweep   # fused small-batch linear alternatives (idem)
    python -m benchmarks.bench_kernels --only fp8_gemv_sweep # its channel-scaled FP8 GEMV settings alone
                                                             # (idem)
    python -m benchmarks.bench_kernels --only fp8_gemv_super_sweep --write-linear-configs
                                       # the same at Nemotron 3 Super's dense projections; the winners (3% or
                                       # more faster than today's setting) enter linear_configs/<GPU>.json
    python -m benchmarks.bench_kernels --only linear_30b_sweep  # its 16-bit settings at the 30B-A3B
                                                                # shapes alone
    python -m benchmarks.bench_kernels --only fp8_linear     # FP8 GEMM vs bf16 cuBLAS at M = 1, 64, 8192
    python -m benchmarks.bench_kernels --only quant          # FP8 activation quantisation, one pass vs two
    python -m benchmarks.bench_kernels --only attn_rounds --rounds 5   # 8k prefill attention settings and
                                                                     # SDPA in turn: the spread in one run
    python -m benchmarks.bench_kernels --dry-run --out /tmp/k.json   # CPU: tiny shapes, Triton interpreter,
                                                                     # wall-clock timing: a script check only

Shapes (one layer of Nano 9B v2): Mamba 128 heads x 80, state 128, 8 groups, conv kernel 4 over
conv_dim 12288, d_inner 10240 (gated norm groups of 1280), hidden 4480; attention 40 q / 8 kv heads,
head_dim 128.
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import torch  # noqa: E402

from benchmarks import invocation  # noqa: E402
from benchmarks.roofline import Ceilings, Peaks, ceiling_fields, measure_ceilings, measured_peaks  # noqa: E402
from hyserve.bench.profiling import device_kernel_times  # noqa: E402
from hyserve.kernels.attention import (  # noqa: E402
    dequantize_kv,
    e4m3_query_rows_ref,
    paged_attention_ref,
    write_kv_ref,
)
from hyserve.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref  # noqa: E402
from hyserve.kernels.rmsnorm import rms_norm_ref, rmsnorm_gated_ref  # noqa: E402
from hyserve.kernels.ssm_update import selective_state_update_ref  # noqa: E402

BF16, F32 = torch.bfloat16, torch.float32
_LIMIT_FIELD = {"read": "read_bw", "copy": "copy_bw", "matmul": "matmul_flops"}


class Bench:
    def __init__(self, dry: bool, rounds: int = 5) -> None:
        self.dry = dry
        self.dev = torch.device("cpu" if dry else "cuda")
        self.records: list[dict] = []
        self.failures: list[str] = []
        self.rounds = rounds  # of the attn_rounds suite
        self._ceilings: Ceilings | None = None
        # FP8 GEMV sweeps: (w_scale, K, N) -> {"label", "current": (ms, setting), "best": (ms, setting)}
        self.gemv_best: dict[tuple[int, int, int], dict] = {}

    @property
    def ceilings(self) -> Ceilings:
        """This device's ceilings, measured once, before the first record that needs them (tiny sizes in a
        dry run, where they only exercise the code)."""
        if self._ceilings is None:
            if self.dry:
                self._ceilings = measure_ceilings(
                    self.dev,
                    stream_read_bytes=1 << 22,
                    copy_bytes=1 << 22,
                    gemv_bytes=1 << 20,
                    matmul_shapes=((64, 64, 64),),
                    reps=3,
                )
            else:
                self._ceilings = measure_ceilings(self.dev)
            print(f"     {self._ceilings.summary()}")
        return self._ceilings

    def time_ms(self, fn) -> float:
        if self.dry:
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    def graph_ms(self, fn) -> float:
        """Device time of fn replayed from a CUDA graph (median): how a decode step runs it, without the
        launcher's host work between calls (on the CPU: time_ms)."""
        if self.dry:
            return self.time_ms(fn)
        import triton.testing

        return float(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median"))

    def check(
        self, name: str, actual: torch.Tensor, expected: torch.Tensor, rtol: float, atol: float
    ) -> bool:
        try:
            assert torch.isfinite(actual).all(), "non-finite values"
            torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)
        except AssertionError as e:
            msg = f"{name}: kernel disagrees with its reference: {str(e).splitlines()[0]}"
            print("FAIL", msg)
            self.failures.append(msg)
            return False
        print(f"ok   {name}: matches its reference")
        return True

    def record(
        self, name: str, value: float, unit: str, reference: str, reference_value: float, **extra
    ) -> None:
        ratio = value / reference_value if reference_value else float("nan")
        rec = dict(
            name=name,
            value=value,
            unit=unit,
            reference=reference,
            reference_value=reference_value,
            ratio=ratio,
            ceiling=None,
            **extra,
        )  # against a peer or the default settings: no ceiling
        self.records.append(rec)
        print(f"     {name}: {value:.4g} {unit} ({ratio:.1%} of {reference})")

    def roof(
        self, name: str, value: float, unit: str, limit: str, reference: str, reference_at=None, **extra
    ) -> None:
        """A record against a roofline at this run's measured ceiling(s) of `limit` (read, copy, matmul,
        copy+matmul), with the same at the H200's published peaks. reference_at(peaks): the roofline in the
        record's unit (default: the ceiling itself, for a rate at that limit)."""
        at = reference_at or (lambda p: getattr(p, _LIMIT_FIELD[limit]))
        f = ceiling_fields(limit, self.ceilings, value, at)
        rec = dict(name=name, value=value, unit=unit, reference=reference, **f, **extra)
        self.records.append(rec)
        print(
            f"     {name}: {value:.4g} {unit} ({f['ratio']:.1%} of {reference}; "
            f"{f['ratio_to_published']:.1%} of the published peak)"
        )

    def rnd(self, *shape, dtype=BF16, scale=1.0):
        return (torch.randn(*shape, device=self.dev) * scale).to(dtype)


# --------------------------------------------------------------------------- Mamba decode kernels


def bench_ssm(b: Bench) -> None:
    from hyserve.kernels.triton_ssm_update import selective_state_update_triton

    H, P, N, G = (128, 80, 128, 8) if not b.dry else (4, 16, 16, 2)
    for batch, sdt in ((64, F32), (1, F32), (64, BF16)) if not b.dry else ((4, F32), (1, BF16)):
        slots = batch + 8
        pool = b.rnd(slots, H, P, N, dtype=sdt)
        x, dt = b.rnd(batch, H, P), b.rnd(batch, H)
        A = -torch.rand(H, device=b.dev) * 4 - 0.1
        B, C = b.rnd(batch, G, N), b.rnd(batch, G, N)
        D, dt_bias = b.rnd(H), b.rnd(H)
        idx = torch.randperm(slots, device=b.dev)[:batch]
        kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, float("inf")))
        p_ref, p_tri = pool.clone(), pool.clone()
        y_ref = selective_state_update_ref(p_ref, x, dt, A, B, C, idx, idx, **kw)
        y_tri = selective_state_update_triton(p_tri, x, dt, A, B, C, idx, idx, **kw)
        tol = 1e-3 if sdt == F32 else 2e-2
        name = f"ssm_update batch {batch} {str(sdt).removeprefix('torch.')} state"
        ok = b.check(name, y_tri, y_ref, 2e-2, 2e-2) and b.check(
            name + " (states)", p_tri[idx], p_ref[idx], tol, tol
        )
        if not ok:
            continue
        ms = b.time_ms(lambda: selective_state_update_triton(pool, x, dt, A, B, C, idx, idx, **kw))
        state_bytes = 2 * batch * H * P * N * pool.element_size()
        io_bytes = (x.numel() * 2 + B.numel() * 2 + C.numel() * 2 + dt.numel()) * 2  # in + y out (bf16)
        b.roof(name, (state_bytes + io_bytes) / (ms * 1e-3), "B/s", "copy", "device copy ceiling", time_ms=ms)
        if batch == 64 and sdt == F32 and not b.dry:
            _bench_mamba_ssm_peer(b, pool, x, dt, A, B, C, D, dt_bias, idx, state_bytes + io_bytes, ms)


def _bench_mamba_ssm_peer(b, pool, x, dt, A, B, C, D, dt_bias, idx, nbytes, our_ms) -> None:
    """mamba_ssm's selective_state_update on the same input, when the package is importable."""
    try:
        import types

        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    except Exception as e:  # noqa: BLE001 - optional peer
        print(f"     (mamba_ssm peer skipped: {type(e).__name__}: {e})")
        return
    Bt, H, P = x.shape
    N = pool.shape[-1]
    state = pool[idx].contiguous()
    try:

        def run():
            selective_state_update(
                state,
                x,
                dt[:, :, None].expand(Bt, H, P),
                A[:, None, None].expand(H, P, N),
                B,
                C,
                D=D[:, None].expand(H, P),
                dt_bias=dt_bias[:, None].expand(H, P),
                dt_softplus=True,
            )

        run()
        ms = b.time_ms(run)
    except Exception as e:  # noqa: BLE001 - optional peer
        print(f"     (mamba_ssm peer failed: {type(e).__name__}: {e})")
        return
    b.record(
        "ssm_update batch 64 fp32 state: hyserve vs mamba_ssm selective_state_update",
        ms / our_ms,
        "x speedup",
        "mamba_ssm time / hyserve time (1.0 = parity)",
        1.0,
        time_ms=our_ms,
        peer_ms=ms,
    )


def bench_conv(b: Bench) -> None:
    from hyserve.kernels.triton_conv1d import causal_conv1d_update_triton, causal_conv1d_varlen_triton
    from hyserve.model.cache_tensors import conv_state_pool

    K = 4
    # Nano 9B v2's width at batch 64; Nano 30B-A3B's at batch 1,024 (a large decode step)
    for batch, Dm in ((64, 12288), (1024, 6144)) if not b.dry else ((4, 64),):
        # the cache's tap-major pool (cache_tensors.conv_state_pool); the same states channel-major
        pool = conv_state_pool(batch + 4, Dm, K - 1, BF16, b.dev)
        pool.copy_(b.rnd(batch + 4, Dm, K - 1))
        rows = pool.contiguous()
        x, w, bias = b.rnd(batch, Dm), b.rnd(Dm, K, scale=0.5), b.rnd(Dm)
        idx = torch.randperm(batch + 4, device=b.dev)[:batch]
        p_ref, p_tri = pool.clone(), pool.clone()
        assert p_tri.stride() == pool.stride()
        o_ref = causal_conv1d_update_ref(x, p_ref, w, bias, idx, idx)
        o_tri = causal_conv1d_update_triton(x, p_tri, w, bias, idx, idx)
        name = f"conv1d_update batch {batch}" + (f" width {Dm}" if batch != 64 else "")
        states_ok = b.check(name + " (states)", p_tri[idx], p_ref[idx], 0, 0)
        if b.check(name, o_tri, o_ref, 2e-2, 2e-2) and states_ok:
            ms = b.time_ms(lambda: causal_conv1d_update_triton(x, pool, w, bias, idx, idx))
            nbytes = (2 * batch * Dm * (K - 1) + 2 * batch * Dm + Dm * K) * 2
            b.roof(name, nbytes / (ms * 1e-3), "B/s", "copy", "device copy ceiling", time_ms=ms)
            # in the same run: a channel-major pool (the layout before), tiled and a column at a time, each
            # over the tap-major pool's time
            for form, tiled in (("tiled", True), ("column", False)):
                other = b.time_ms(
                    lambda: causal_conv1d_update_triton(x, rows, w, bias, idx, idx, tiled=tiled)
                )
                b.record(f"{name}: channel-major pool, {form} form / tap-major", other, "ms", "tap-major", ms)

    T = 8192 if not b.dry else 70
    Dm = 12288 if not b.dry else 64
    w, bias = b.rnd(Dm, K, scale=0.5), b.rnd(Dm)
    cu = [0, T // 4 + 3, T] if not b.dry else [0, 1, 33, T]
    S = len(cu) - 1
    xv = b.rnd(T, Dm)
    init = b.rnd(S, Dm, K - 1)
    o_ref, f_ref = causal_conv1d_varlen_ref(xv, w, bias, cu, init)
    o_tri, f_tri = causal_conv1d_varlen_triton(xv, w, bias, cu, init)
    name = f"conv1d_varlen {T} tokens"
    if b.check(name, o_tri, o_ref, 2e-2, 2e-2) and b.check(name + " (states)", f_tri, f_ref, 0, 0):
        ms = b.time_ms(lambda: causal_conv1d_varlen_triton(xv, w, bias, cu, init))
        nbytes = 2 * T * Dm * 2
        b.roof(name, nbytes / (ms * 1e-3), "B/s", "copy", "device copy ceiling", time_ms=ms)


def bench_quant(b: Bench) -> None:
    """FP8 activation quantisation (per token, and per token and 128 columns) at Nano 30B-A3B's hidden width:
    a decode step's 512 and 1,024 rows and a refill step's 8,512, one-pass tiles against the two-pass row
    kernel in the same run, each checked bit for bit against `quantize_rows_ref` first."""
    from hyserve.kernels.fp8_linear import quantize_rows_ref
    from hyserve.kernels.triton_fp8_linear import quantize_rows_triton

    K = 2688 if not b.dry else 300
    for M in (512, 1024, 8512) if not b.dry else (5,):
        x = b.rnd(M, K, scale=3.0)
        for group in (None, 128):
            name = f"quantize_rows {M} x {K}" + (" per 128 columns" if group else " per token")
            rq, rs = quantize_rows_ref(x, group)
            ok = True
            for tile in (True, False):
                q, sc = quantize_rows_triton(x, group, tile=tile)
                same = torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(sc, rs)
                ok = b.check(f"{name} ({'one' if tile else 'two'}-pass)", sc, rs, 0, 0) and same and ok
            if not ok:
                continue
            ms = b.graph_ms(lambda: quantize_rows_triton(x, group, tile=True))
            nbytes = M * K * 3 + M * (K // 128 + 1) * 4  # bf16 in, e4m3 out, scales
            bw = nbytes / (ms * 1e-3)
            b.roof(f"{name}, one-pass", bw, "B/s", "copy", "device copy ceiling", time_ms=ms)
            two = b.graph_ms(lambda: quantize_rows_triton(x, group, tile=False))
            b.record(f"{name}: two-pass row kernel / one-pass tiles", two, "ms", "one-pass", ms)


def bench_norms(b: Bench) -> None:
    from hyserve.kernels.triton_rmsnorm import rms_norm_triton, rmsnorm_gated_triton

    d_inner, group, hidden = (10240, 1280, 4480) if not b.dry else (64, 16, 48)
    for T in (64, 8192) if not b.dry else (5,):
        x, z, w = b.rnd(T, d_inner), b.rnd(T, d_inner), b.rnd(d_inner)
        name = f"rmsnorm_gated {T} tokens"
        if b.check(
            name,
            rmsnorm_gated_triton(x, z, w, 1e-5, group),
            rmsnorm_gated_ref(x, z, w, 1e-5, group),
            2e-2,
            2e-2,
        ):
            ms = b.time_ms(lambda: rmsnorm_gated_triton(x, z, w, 1e-5, group))
            b.roof(name, 3 * T * d_inner * 2 / (ms * 1e-3), "B/s", "copy", "device copy ceiling", time_ms=ms)
        h, wh = b.rnd(T, hidden), b.rnd(hidden)
        name = f"rms_norm {T} tokens"
        if b.check(name, rms_norm_triton(h, wh, 1e-5), rms_norm_ref(h, wh, 1e-5), 2e-2, 2e-2):
            ms = b.time_ms(lambda: rms_norm_triton(h, wh, 1e-5))
            b.roof(name, 2 * T * hidden * 2 / (ms * 1e-3), "B/s", "copy", "device copy ceiling", time_ms=ms)


# --------------------------------------------------------------------------- fused small-batch linears

# Alternative launch settings for `triton_fused_linear`, timed by `--only linear_sweep` (the first entry
# is the default): (BLOCK_N, BLOCK_K, num_warps, num_stages).
_LINEAR_SWEEP: list[tuple[int, int, int, int]] = [
    (4, 512, 4, 3),
    (8, 512, 4, 4),
    (8, 512, 4, 3),
    (16, 256, 4, 3),
    (16, 256, 4, 4),
    (8, 256, 4, 4),
    (8, 256, 4, 3),
    (4, 512, 4, 4),
    (16, 512, 4, 2),
    (4, 1024, 4, 2),
    (16, 512, 4, 3),
    # short tiles on few warps, more programs in flight (the MoE decode GEMVs' best on the H100, 1303d9a)
    (4, 128, 2, 6),
    (2, 256, 1, 6),
    (1, 512, 1, 6),
    (2, 512, 2, 4),
    (4, 256, 2, 6),
    (8, 128, 4, 6),
    # one stage: the tile straight into registers, no cp.async ring (the MoE GEMVs' Nsight Compute profile on
    # the H100 showed MIO-queue and shared-memory stalls and occupancy capped by shared memory)
    (4, 512, 2, 1),
    (8, 512, 4, 1),
    (2, 1024, 2, 1),
    (8, 256, 2, 1),
]


def _linear_cases(b: Bench):
    """(name, weight, what the fused path runs, its call, the unfused call (the op's kernel + cuBLAS), the
    float64 reference) at the Nano 9B v2 projections, one row."""
    import torch.nn.functional as F

    import hyserve.kernels.triton_fused_linear as tfl
    from hyserve.kernels.triton_activation import relu2_triton
    from hyserve.kernels.triton_rmsnorm import rmsnorm_gated_triton

    d_inner, group, hidden, inter, in_proj = (
        (10240, 1280, 4480, 15680, 22912) if not b.dry else (64, 16, 48, 80, 96)
    )
    zx = b.rnd(1, in_proj + d_inner)
    y, z = b.rnd(1, d_inner), zx[:, :d_inner]
    nw = b.rnd(d_inner)
    w_out, w_down = b.rnd(hidden, d_inner, scale=d_inner**-0.5), b.rnd(hidden, inter, scale=inter**-0.5)
    u = b.rnd(1, inter)

    def gated64():
        h = y.double() * F.silu(z.double())
        hg = h.view(1, -1, group)
        hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + 1e-5)
        return F.linear(hg.view(1, -1) * nw.double(), w_out.double())

    # plain projections (the `linear` op) at the Nano 9B v2 in_proj and the Nemotron 3 Nano 30B-A3B in_proj,
    # QKV and out_proj / o_proj (one GEMV shape), against cuBLAS (split-K with a reduce at the last ones on
    # the H200)
    plain = []
    for pname, n, k in (
        (
            ("in_proj", in_proj, hidden),
            ("30B-A3B in_proj", 10304, 2688),
            ("30B-A3B qkv", 4608, 2688),
            ("30B-A3B out_proj / o_proj", 2688, 4096),
        )
        if not b.dry
        else (("in_proj", in_proj, hidden),)
    ):
        # a weight L2 could hold is one of several, read in turn (each once per replay), as a decode step
        # reads its layers' weights: replaying one small weight would time L2, not HBM
        copies = _copies_past_l2(b, n * k * 2)
        ws, xp = [b.rnd(n, k, scale=k**-0.5) for _ in range(copies)], b.rnd(1, k)
        plain.append(
            (
                pname,
                ws[-1],
                "GEMV",
                lambda xp=xp, ws=ws: [tfl.linear_triton(xp, w, None) for w in ws][-1],
                lambda xp=xp, ws=ws: [F.linear(xp, w) for w in ws][-1],
                lambda xp=xp, wp=ws[-1]: F.linear(xp.double(), wp.double()),
                copies,
            )
        )
    return plain + [
        (
            "out_proj + gated norm",
            w_out,
            "norm kernel + GEMV",
            lambda: tfl.gated_norm_linear_triton(y, z, nw, 1e-5, group, w_out, None),
            lambda: F.linear(rmsnorm_gated_triton(y, z, nw, 1e-5, group), w_out),
            gated64,
            1,
        ),
        (
            "down_proj + relu2",
            w_down,
            "relu2 in the GEMV",
            lambda: tfl.relu2_linear_triton(u, w_down, None),
            lambda: F.linear(relu2_triton(u), w_down),
            lambda: F.linear(torch.relu(u.double()) ** 2, w_down.double()),
            1,
        ),
    ]


# bytes of weight copies a small one-row GEMV case cycles through (the H100's and H200's L2 hold 50 MB)
_L2_DEFEAT_BYTES = 256 * 2**20


def _copies_past_l2(b: Bench, weight_bytes: int) -> int:
    """How many copies of a weight of `weight_bytes` a GEMV case reads in turn, so L2 holds none (1 dry)."""
    return 1 if b.dry else -(-_L2_DEFEAT_BYTES // weight_bytes)


def _fixed_gemv_setting(cfg: tuple[int, int, int, int]):
    """A stand-in for `triton_fused_linear.gpu_settings` that gives every GEMV the setting (BLOCK_N, BLOCK_K,
    num_warps, num_stages), whatever the weight, shape or GPU."""
    setting = dict(BLOCK_N=cfg[0], BLOCK_K=cfg[1], num_warps=cfg[2], num_stages=cfg[3])
    return lambda w_scale, k, n, device="": setting


def _bench_linear(b: Bench, sweep: bool, only: str = "") -> None:
    """`only`: the cases whose name holds it (all when empty)."""
    import hyserve.kernels.triton_fused_linear as tfl

    configs = _LINEAR_SWEEP if sweep and not b.dry else [None]
    for name, w, variant, fused, unfused, exact, copies in _linear_cases(b):
        if only not in name:
            continue
        nbytes = w.numel() * w.element_size() * copies  # a replay reads each of `copies` weights once
        label = f"{name} {w.shape[1]}->{w.shape[0]}, 1 row" + (
            f" ({copies} weights in turn)" if copies > 1 else ""
        )
        ref = exact()
        base_ms = b.graph_ms(unfused)
        base = (
            "cuBLAS" if variant == "GEMV" else "op kernel + cuBLAS"
        )  # a plain projection has no op before it
        b.roof(
            f"{label}: {base}",
            nbytes / (base_ms * 1e-3),
            "B/s",
            "read",
            "bytes-read ceiling",
            time_ms=base_ms,
        )
        saved = tfl.gpu_settings
        for cfg in configs:
            tag = "" if cfg is None else " [N{} K{} w{} s{}]".format(*cfg)
            try:
                if cfg is not None:
                    tfl.gpu_settings = _fixed_gemv_setting(cfg)
                if not b.check(f"{label}: {variant}{tag}", fused(), ref, 2e-2, 2e-2):
                    continue
                ms = b.graph_ms(fused)
                b.roof(
                    f"{label}: {variant}{tag}",
                    nbytes / (ms * 1e-3),
                    "B/s",
                    "read",
                    "bytes-read ceiling",
                    time_ms=ms,
                    unfused_ms=base_ms,
                    speedup_vs_unfused=base_ms / ms,
                )
                print(f"     ({ms * 1e3:.1f} us vs {base_ms * 1e3:.1f} us unfused: {base_ms / ms:.3f}x)")
            except Exception as e:  # noqa: BLE001 - a setting may not compile; report and go on
                print(f"     (fused linear config {tag} failed: {type(e).__name__}: {e})")
            finally:
                tfl.gpu_settings = saved
        del ref


def bench_linear(b: Bench) -> None:
    _bench_linear(b, sweep=False)


# The FP8 linear's one-row GEMV (e4m3 weights), timed by `--only linear_sweep` (the first entry of each is the
# default in triton_fused_linear.py): channel scales, then block scales (BLOCK_K divides 128).
_FP8_GEMV_SWEEP = {
    "channel": [
        (4, 1024, 4, 3),
        (8, 1024, 4, 3),
        (8, 512, 4, 4),
        (16, 512, 4, 3),
        (4, 2048, 4, 2),
        (8, 1024, 8, 3),
        (2, 2048, 4, 3),
        (16, 256, 4, 4),
        # long rows, few output columns (down_proj, out_proj): more programs, shorter tiles, fewer warps
        (1, 2048, 2, 3),
        (1, 4096, 4, 2),
        (1, 1024, 1, 4),
        (2, 1024, 2, 4),
        (2, 2048, 2, 3),
        (2, 4096, 4, 2),
        (4, 1024, 2, 4),
        (4, 512, 2, 6),
        (8, 512, 2, 4),
    ],
    "block": [
        (16, 128, 4, 4),
        (32, 128, 4, 4),
        (16, 128, 4, 6),
        (32, 128, 8, 4),
        (8, 128, 4, 6),
        (64, 128, 8, 3),
    ],
}


# Nemotron 3 Super 120B-A12B's dense FP8 GEMVs at batch 1, (N, K): Mamba in_proj / out_proj, q (and o) /
# k (and v) unpacked, the shared expert's up / down, the latent projections (fc1 / fc2). A decode step
# launches 272 of them, 6.77 GB; with the row-length tables most get 16 to 336 programs.
_SUPER_FP8_GEMVS = (
    (18560, 4096),
    (4096, 8192),
    (4096, 4096),
    (256, 4096),
    (5376, 4096),
    (4096, 5376),
    (1024, 4096),
    (4096, 1024),
)
_W_SCALE = {"channel": 1, "block": 2}  # triton_fused_linear's weight kinds
_WRITE_MARGIN = (
    0.97  # a sweep's best enters the GPU's file only when it takes at most this of the current time
)


def _bench_fp8_gemv_sweep(
    b: Bench, schemes: tuple[str, ...] = ("channel", "block"), shapes=None, what: str = ""
) -> None:
    """One row through the FP8 GEMV (default: at the Nano 9B v2 in_proj, down_proj and out_proj), per launch
    setting, bytes read (e4m3 weight + float32 scales) against the read ceiling, checked first against the
    float64 product of x and the dequantised weight; bf16 cuBLAS on the dequantised weight beside it. A replay
    reads several copies of the weight in turn (256 MB in all), so a 46 MB weight is not served from L2. The
    setting the launcher picks today (this GPU's file entry, else the tables) is timed first, labelled
    "current"; each shape's current and fastest times go to `b.gemv_best` for `--write-linear-configs`."""
    import torch.nn.functional as F

    import hyserve.kernels.triton_fused_linear as tfl
    from hyserve.kernels.fp8_linear import dequantize_weight_ref, quantize_weight_ref

    if shapes is None:
        shapes = ((22912, 4480), (4480, 15680), (4480, 10240))
    if b.dry:
        shapes = ((72, 96),)
    gpu = "" if b.dry else torch.cuda.get_device_name()
    for n, k in shapes:
        w16, x = b.rnd(n, k, scale=k**-0.5), b.rnd(1, k)
        copies = _copies_past_l2(b, n * k)
        for scheme in schemes:
            cur = tfl.gpu_settings(_W_SCALE[scheme], k, n, gpu)
            current = tuple(cur[key] for key in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
            settings = [current] + [c for c in _FP8_GEMV_SWEEP[scheme] if c != current]
            if scheme == "block":  # a block-scaled K tile stays inside one 128-wide scale block
                settings = [c for c in settings if 128 % c[1] == 0]
            q, sc = quantize_weight_ref(w16, scheme)
            qs = [q] + [q.clone() for _ in range(copies - 1)]
            wd = dequantize_weight_ref(q, sc)
            want = x.double() @ wd.double().T
            w16d = wd.to(x.dtype)
            base_ms = b.graph_ms(lambda w16d=w16d: F.linear(x, w16d))
            nbytes = (q.numel() + sc.numel() * 4) * copies
            saved = tfl.gpu_settings
            key = (_W_SCALE[scheme], k, n)
            for cfg in settings if not b.dry else settings[:2]:
                tag = "[N{} K{} w{} s{}]".format(*cfg) + (" current" if cfg == current else "")
                label = (
                    f"fp8 {scheme} GEMV {what}{k}->{n}, 1 row"
                    + (f" ({copies} weights in turn)" if copies > 1 else "")
                    + f" {tag}"
                )
                try:
                    tfl.gpu_settings = _fixed_gemv_setting(cfg)
                    fn = lambda qs=qs, sc=sc: [tfl.gemv_fp8(x, qi, sc, None, False) for qi in qs][-1]  # noqa: E731
                    if not b.check(label, fn(), want, 1e-2, 1e-2):
                        continue
                    ms = b.graph_ms(fn)
                    b.roof(
                        label,
                        nbytes / (ms * 1e-3),
                        "B/s",
                        "read",
                        "FP8 weight-read roofline: bytes-read ceiling",
                        time_ms=ms,
                        bf16_ms=base_ms,
                        speedup_vs_bf16=base_ms / ms,
                    )
                    got = b.gemv_best.setdefault(key, {"label": f"fp8 {scheme} GEMV {what}{k}->{n}"})
                    if cfg == current:
                        got["current"] = (ms, cfg)
                    if ms < got.get("best", (float("inf"),))[0]:
                        got["best"] = (ms, cfg)
                except Exception as e:  # noqa: BLE001 - a setting may not compile; report and go on
                    print(f"     (fp8 GEMV config {tag} failed: {type(e).__name__}: {e})")
                finally:
                    tfl.gpu_settings = saved


def bench_linear_sweep(b: Bench) -> None:
    _bench_linear(b, sweep=True)
    _bench_fp8_gemv_sweep(b)


def bench_linear_30b_sweep(b: Bench) -> None:
    """The 16-bit sweep at the Nemotron 3 Nano 30B-A3B projections alone (`--only linear_30b_sweep`; the dry
    run's tiny cases hold none)."""
    _bench_linear(b, sweep=True, only="30B-A3B")


def bench_fp8_gemv_sweep(b: Bench) -> None:
    """The FP8 GEMV's channel-scaled settings alone (`--only fp8_gemv_sweep`)."""
    _bench_fp8_gemv_sweep(b, ("channel",))


def bench_fp8_gemv_super_sweep(b: Bench) -> None:
    """The channel-scaled FP8 GEMV settings at Nemotron 3 Super's dense projections
    (`--only fp8_gemv_super_sweep`; with `--write-linear-configs` the winners go to this GPU's file)."""
    _bench_fp8_gemv_sweep(b, ("channel",), _SUPER_FP8_GEMVS, "Super ")


def write_linear_configs(b: Bench, config_dir: Path, device: str, source: str) -> list[str]:
    """Enter each swept shape whose fastest setting took at most _WRITE_MARGIN of the current one's time into
    `config_dir`'s file for `device` (`linear_configs/<GPU>.json`, read by triton_fused_linear.gpu_settings),
    each entry's "source" citing `source` and both times; other entries are kept. Returns the keys written."""
    import hyserve.kernels.triton_fused_linear as tfl
    from hyserve.kernels.launch_util import device_file

    path = device_file(config_dir, device)
    doc = (
        json.loads(path.read_text())
        if path.exists()
        else {
            "device": device,
            "triton": __import__("triton").__version__,
            "note": "one-row GEMV launch settings for shapes where this GPU's sweep disagrees with the "
            "row-length tables of triton_fused_linear.py; keys '<w_scale>,<K>,<N>' (w_scale 0: 16-bit "
            "weight, 1: e4m3 channel scales, 2: e4m3 block scales)",
            "source": {},
            "configs": {},
        }
    )
    written = []
    for (w_scale, k, n), got in sorted(b.gemv_best.items()):
        if "current" not in got or "best" not in got or got["best"][0] > _WRITE_MARGIN * got["current"][0]:
            continue
        (t_cur, c_cur), (t_best, c_best) = got["current"], got["best"]
        key = tfl.shape_key(w_scale, k, n)
        doc["configs"][key] = tfl.validate_setting(
            dict(zip(("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), c_best, strict=True)), key
        )
        doc.setdefault("source", {})[key] = (
            f"{source}: {got['label']}, {c_best[0]} x {c_best[1]} on {c_best[2]} warps, {c_best[3]} stages "
            f"{t_best * 1e3:.1f} us against {t_cur * 1e3:.1f} us for the setting it replaces "
            f"({c_cur[0]} x {c_cur[1]} on {c_cur[2]} warps, {c_cur[3]} stages)"
        )
        written.append(key)
    if written:
        path.write_text(json.dumps(doc, indent=1) + "\n")
        tfl.device_table.cache_clear()
    return written


# --------------------------------------------------------------------------- FP8 linear


def _fp8_shapes(b: Bench) -> list[tuple[str, int, int]]:
    """(projection, N, K) of one Nano 9B v2 layer of each kind."""
    if b.dry:
        return [("in_proj", 200, 96), ("down_proj", 48, 160)]
    return [
        ("in_proj", 22656, 4480),
        ("out_proj", 4480, 10240),
        ("up_proj", 15680, 4480),
        ("down_proj", 4480, 15680),
        ("q_proj", 5120, 4480),
    ]


def bench_fp8_linear(b: Bench) -> None:
    """FP8 weights (e4m3, per-channel and [128, 128]-block scales) against bf16 cuBLAS on the same
    (dequantised) weight, in the same run, at M = 1 and 64 (decode: bytes read against the read ceiling,
    timed as a CUDA graph replay) and M = 8192 (prefill: FLOP/s against twice the bf16 matmul ceiling, the
    e4m3 tensor-core rate). Each is checked first against the float64 product of its dequantised operands."""
    import torch.nn.functional as F

    from hyserve.kernels import triton_fp8_linear as t8
    from hyserve.kernels.fp8_linear import dequantize_weight_ref, quantize_rows_ref, quantize_weight_ref
    from hyserve.kernels.triton_fp8_linear import SMALL_M, fp8_linear_triton

    rows = (1, 64, 8192) if not b.dry else (1, 20)
    for proj, n, k in _fp8_shapes(b):
        w16 = b.rnd(n, k, scale=k**-0.5)
        for scheme in ("channel", "block"):
            q, s = quantize_weight_ref(w16, scheme)
            wd = dequantize_weight_ref(q, s).to(BF16)
            fp8_bytes = q.numel() + s.numel() * 4
            for m in rows:
                x = b.rnd(m, k)
                # the prefill form twice where torch._scaled_mm serves it: as served and on the Triton GEMM
                # (PREFILL_GEMM "triton"); every other case once
                t8.PREFILL_GEMM["form"] = "auto"
                scaled_mm = m > SMALL_M and t8._scaled_mm_takes(x, q, scheme == "block")
                for form in ("auto", "triton") if scaled_mm else ("auto",):
                    t8.PREFILL_GEMM["form"] = form
                    gemm = ""
                    if m > SMALL_M:
                        gemm = " [torch._scaled_mm]" if scaled_mm and form == "auto" else " [Triton GEMM]"
                    label = f"fp8 {scheme} {proj} {k}->{n}, {m} rows{gemm}"
                    if m <= SMALL_M:
                        want = x.double() @ dequantize_weight_ref(q, s).double().T
                    else:
                        qa, sa = quantize_rows_ref(x, 128 if scheme == "block" else None)
                        full = sa[:, None] if scheme == "channel" else sa.repeat_interleave(128, 1)[:, :k]
                        want = (qa.double() * full.double()) @ dequantize_weight_ref(q, s).double().T
                    if not b.check(label, fp8_linear_triton(x, q, s, None), want, 1e-2, 1e-2):
                        continue
                    ours = lambda: fp8_linear_triton(x, q, s, None)  # noqa: E731
                    base = lambda: F.linear(x, wd)  # noqa: E731
                    if m < 8192:
                        ms, base_ms = b.graph_ms(ours), b.graph_ms(base)
                        b.roof(
                            label,
                            fp8_bytes / (ms * 1e-3),
                            "B/s",
                            "read",
                            "FP8 weight-read roofline: bytes-read ceiling",
                            time_ms=ms,
                            bf16_ms=base_ms,
                            speedup_vs_bf16=base_ms / ms,
                            timing="CUDA graph replay",
                        )
                    else:
                        ms, base_ms = b.time_ms(ours), b.time_ms(base)
                        flops = 2 * m * n * k
                        b.roof(
                            label,
                            flops / (ms * 1e-3),
                            "FLOP/s",
                            "matmul",
                            "2 x the bf16 matmul ceiling (e4m3 tensor-core rate)",
                            reference_at=lambda p: 2 * p.matmul_flops,
                            time_ms=ms,
                            bf16_ms=base_ms,
                            speedup_vs_bf16=base_ms / ms,
                        )
                    print(
                        f"     ({ms * 1e3:.1f} us vs {base_ms * 1e3:.1f} us bf16 cuBLAS: {base_ms / ms:.3f}x)"
                    )
    t8.PREFILL_GEMM["form"] = "auto"


# --------------------------------------------------------------------------- attention


def _paged_pool(b: Bench, lens: list[int], Hkv: int, D: int, bs: int, dtype):
    """A pool holding every sequence's KV in shuffled blocks, and the block tables."""
    per = [(L + bs - 1) // bs for L in lens]
    nblocks = sum(per) + 1
    order = torch.randperm(nblocks, device=b.dev).int()
    tables = torch.zeros(len(lens), max(per), dtype=torch.int32, device=b.dev)
    used = 0
    for s, n in enumerate(per):
        tables[s, :n] = order[used : used + n]
        used += n
    k_cache, v_cache = b.rnd(nblocks, bs, Hkv, D, dtype=dtype), b.rnd(nblocks, bs, Hkv, D, dtype=dtype)
    return k_cache, v_cache, tables


def bench_attn(b: Bench) -> None:
    from hyserve.kernels.cuda_attention import paged_attention_cuda
    from hyserve.kernels.triton_attention import attention_flops, write_kv_triton

    Hq, Hkv, D, bs = (40, 8, 128, 64) if not b.dry else (4, 2, 32, 16)
    dtype = BF16 if not b.dry else torch.float16  # bf16 tl.dot is wrong in the interpreter
    tol = 2e-2
    scale = D**-0.5

    # KV write: 8k new tokens
    T = 8192 if not b.dry else 40
    k_cache, v_cache, tables = _paged_pool(b, [T], Hkv, D, bs, dtype)
    k, v = b.rnd(T, Hkv, D, dtype=dtype), b.rnd(T, Hkv, D, dtype=dtype)
    pos = torch.arange(T, device=b.dev)
    slots = (tables[0, pos // bs].long() * bs + pos % bs).contiguous()
    kr, vr = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, kr, vr, slots)
    write_kv_triton(k, v, k_cache, v_cache, slots)
    name = f"write_kv {T} tokens"
    if b.check(name, k_cache, kr, 0, 0) and b.check(name + " (V)", v_cache, vr, 0, 0):
        ms = b.time_ms(lambda: write_kv_triton(k, v, k_cache, v_cache, slots))
        b.roof(
            name,
            2 * 2 * k.numel() * k.element_size() / (ms * 1e-3),
            "B/s",
            "copy",
            "device copy ceiling",
            time_ms=ms,
        )

    # decode: one sequence at 128k context, and batch 64 at 8k
    for batch, L in ((1, 131072), (64, 8192)) if not b.dry else ((1, 700), (3, 100)):
        lens = [L] * batch
        kc, vc, tb = _paged_pool(b, lens, Hkv, D, bs, dtype)
        q = b.rnd(batch, Hq, D, dtype=dtype)
        cu = list(range(batch + 1))
        name = f"paged decode attention batch {batch} x {L} context"
        # the engine's decode path: device tensors for lengths and offsets (nothing read on the host),
        # the call replayed from a CUDA graph as a decode step runs it
        lens_t = torch.tensor(lens, dtype=torch.int32, device=b.dev)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=b.dev)
        if b.check(
            name,
            paged_attention_cuda(q, kc, vc, tb, lens_t, cu_t, scale),
            paged_attention_ref(q, kc, vc, tb, lens, cu, scale),
            tol,
            tol,
        ):
            ms = b.graph_ms(lambda: paged_attention_cuda(q, kc, vc, tb, lens_t, cu_t, scale))
            eager_ms = b.time_ms(lambda: paged_attention_cuda(q, kc, vc, tb, lens, cu, scale))
            kv_bytes = 2 * batch * L * Hkv * D * kc.element_size()
            b.roof(
                name,
                kv_bytes / (ms * 1e-3),
                "B/s",
                "read",
                "KV-read roofline: bytes-read ceiling",
                time_ms=ms,
                timing="CUDA graph replay, device-tensor lengths",
                eager_host_lists_ms=eager_ms,
            )

    # prefill: one 8k sequence (no cache) and an extend of 2k new tokens over 6k cached
    for n_new, L in ((8192, 8192), (2048, 8192)) if not b.dry else ((37, 37), (20, 50)):
        kc, vc, tb = _paged_pool(b, [L], Hkv, D, bs, dtype)
        q = b.rnd(n_new, Hq, D, dtype=dtype)
        cu = [0, n_new]
        flops = attention_flops([n_new], [L], Hq, D)
        name = f"paged prefill attention {n_new} new / {L} total tokens"
        if not b.check(
            name,
            paged_attention_cuda(q, kc, vc, tb, [L], cu, scale),
            paged_attention_ref(q, kc, vc, tb, [L], cu, scale),
            tol,
            tol,
        ):
            continue
        ours_fn = lambda: paged_attention_cuda(q, kc, vc, tb, [L], cu, scale)  # noqa: E731
        ms = b.time_ms(ours_fn)
        ours = flops / (ms * 1e-3)
        if n_new == L and not b.dry:
            best_name, best_ms = _sdpa_best(b, q, kc, vc, tb, L)
            peer = flops / (best_ms * 1e-3)
            # beside the event timing (which counts launcher host time beyond do_bench's cache flush), the
            # device time of both from the profiler (`attn_rounds` has both over several rounds)
            dev: dict[str, float] = {}
            if best_name != "none":
                dev["device_ms"] = _device_ms(b, ours_fn)
                dev["peer_device_ms"] = _device_ms(b, _sdpa_fn(q, kc, vc, tb, L, best_name))
                dev["device_time_ratio"] = dev["peer_device_ms"] / dev["device_ms"]
            b.record(
                name,
                ours,
                "FLOP/s",
                f"torch SDPA ({best_name}) on the same shapes, same run",
                peer,
                time_ms=ms,
                peer_ms=best_ms,
                **dev,
            )
        else:
            b.roof(name, ours, "FLOP/s", "matmul", "bf16 matmul ceiling", time_ms=ms)

    _bench_decode_fp8(b, Hq, Hkv, D, bs, dtype, tol, scale)
    _bench_prefill_fp8(b, Hq, Hkv, D, bs, dtype, tol, scale)


def _fp8_pool(b: Bench, lens: list[int], Hkv: int, D: int, bs: int, dtype):
    """An e4m3 pool of shuffled blocks with per-layer scales (unit-variance K/V land on codes of std 64 and
    48): (k_cache, v_cache, block tables, k_scale, v_scale)."""
    from hyserve.kernels.attention import quantize_kv

    fp8 = torch.float8_e4m3fn
    ks = torch.tensor(1 / 64, device=b.dev)
    vs = torch.tensor(1 / 48, device=b.dev)
    k16, v16, tb = _paged_pool(b, lens, Hkv, D, bs, dtype)
    kc, vc = quantize_kv(k16, ks, fp8), quantize_kv(v16, vs, fp8)
    del k16, v16
    return kc, vc, tb, ks, vs


def _bench_prefill_fp8(b: Bench, Hq: int, Hkv: int, D: int, bs: int, dtype, tol: float, scale: float) -> None:
    """Prefill / extend over a float8 e4m3 pool: the CUDA op (on Hopper the Gluon kernel's converter form)
    against the 16-bit CUDA op on the same (dequantised) values in the same run (the bar: no slower),
    and the Triton kernel alone over fp8 (the path before the converter form). The 131k case is one late
    chunk of a long prompt; its last 512 queries are checked against the reference (they attend to the same
    keys whatever else the step holds)."""
    from hyserve.kernels.cuda_attention import paged_attention_cuda
    from hyserve.kernels.triton_attention import attention_flops, paged_attention_triton

    cases = ((8192, 8192), (16384, 131072)) if not b.dry else ((37, 37), (20, 90))
    for n_new, L in cases:
        kc, vc, tb, ks, vs = _fp8_pool(b, [L], Hkv, D, bs, dtype)
        q = b.rnd(n_new, Hq, D, dtype=dtype)
        kw = dict(k_scale=ks, v_scale=vs)
        name = f"paged prefill attention fp8 KV {n_new} new / {L} total tokens"
        out = paged_attention_cuda(q, kc, vc, tb, [L], [0, n_new], scale, **kw)
        tail = min(512, n_new)
        want = paged_attention_ref(q[-tail:], kc, vc, tb, [L], [0, tail], scale, **kw)
        if not b.check(name, out[-tail:], want, tol, tol):
            continue
        old = paged_attention_triton(q, kc, vc, tb, [L], [0, n_new], scale, **kw)
        if not b.check(name + " [Triton kernel]", old[-tail:], want, tol, tol):
            continue
        del out, old, want
        ms = b.time_ms(lambda: paged_attention_cuda(q, kc, vc, tb, [L], [0, n_new], scale, **kw))
        triton_ms = b.time_ms(lambda: paged_attention_triton(q, kc, vc, tb, [L], [0, n_new], scale, **kw))
        kd, vd = dequantize_kv(kc, ks, dtype), dequantize_kv(vc, vs, dtype)  # the same values in 16 bits
        ms16 = b.time_ms(lambda kd=kd, vd=vd: paged_attention_cuda(q, kd, vd, tb, [L], [0, n_new], scale))
        del kd, vd
        flops = attention_flops([n_new], [L], Hq, D)
        b.record(
            name,
            flops / (ms * 1e-3),
            "FLOP/s",
            "the 16-bit KV cache's prefill on the same values, same run",
            flops / (ms16 * 1e-3),
            time_ms=ms,
            bf16_kv_ms=ms16,
            triton_fp8_ms=triton_ms,
            speedup_vs_triton_fp8=triton_ms / ms,
        )


def _bench_decode_fp8(b: Bench, Hq: int, Hkv: int, D: int, bs: int, dtype, tol: float, scale: float) -> None:
    """Decode over a float8 e4m3 KV pool with per-layer scales: half the bytes of bf16, so the roofline
    time halves too; the bf16 kernel on the same (dequantised) values is timed beside it, and the Triton
    kernel alone over fp8 (the path before `gluon_decode`)."""
    from hyserve.kernels.cuda_attention import paged_attention_cuda
    from hyserve.kernels.triton_attention import paged_attention_triton

    for batch, L in ((64, 8192), (1, 131072)) if not b.dry else ((3, 100), (1, 700)):
        lens = [L] * batch
        kc, vc, tb, ks, vs = _fp8_pool(b, lens, Hkv, D, bs, dtype)
        q = b.rnd(batch, Hq, D, dtype=dtype)
        cu = list(range(batch + 1))
        kw = dict(k_scale=ks, v_scale=vs)
        name = f"paged decode attention fp8 KV batch {batch} x {L} context"
        if not b.check(
            name,
            paged_attention_cuda(q, kc, vc, tb, lens, cu, scale, **kw),
            paged_attention_ref(q, kc, vc, tb, lens, cu, scale, **kw),
            tol,
            tol,
        ):
            continue
        lens_t = torch.tensor(lens, dtype=torch.int32, device=b.dev)  # the decode path, as bench_attn
        cu_t = torch.tensor(cu, dtype=torch.int32, device=b.dev)
        ms = b.graph_ms(lambda: paged_attention_cuda(q, kc, vc, tb, lens_t, cu_t, scale, **kw))
        kd, vd = dequantize_kv(kc, ks, dtype), dequantize_kv(vc, vs, dtype)  # the same values in 16 bits
        ms16 = b.graph_ms(lambda: paged_attention_cuda(q, kd, vd, tb, lens_t, cu_t, scale))
        triton_ms = b.graph_ms(lambda: paged_attention_triton(q, kc, vc, tb, lens_t, cu_t, scale, **kw))
        kv_bytes = 2 * batch * L * Hkv * D * kc.element_size()  # 1 byte per element
        b.roof(
            name,
            kv_bytes / (ms * 1e-3),
            "B/s",
            "read",
            "KV-read roofline (1-byte KV): bytes-read ceiling",
            time_ms=ms,
            bf16_kv_ms=ms16,
            speedup_vs_bf16_kv=ms16 / ms,
            triton_fp8_ms=triton_ms,
            speedup_vs_triton_fp8=triton_ms / ms,
        )


def _sdpa_fn(q, kc, vc, tables, L: int, backend: str):
    """torch SDPA with one backend (an SDPBackend name), causal GQA over contiguous K/V of the same tokens."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from hyserve.kernels.attention import gather_kv

    k = gather_kv(kc, tables[0], L).transpose(0, 1)[None].contiguous()  # [1, Hkv, L, D]
    v = gather_kv(vc, tables[0], L).transpose(0, 1)[None].contiguous()
    qq = q.transpose(0, 1)[None].contiguous()  # [1, Hq, L, D]

    def fn():
        with sdpa_kernel(getattr(SDPBackend, backend)):
            return F.scaled_dot_product_attention(qq, k, v, is_causal=True, enable_gqa=True)

    return fn


def _sdpa_best(b: Bench, q, kc, vc, tables, L: int) -> tuple[str, float]:
    """Fastest torch SDPA backend for causal GQA over contiguous K/V of the same tokens."""
    best = ("none", float("inf"))
    for backend in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            fn = _sdpa_fn(q, kc, vc, tables, L, backend)
            fn()
            ms = b.time_ms(fn)
        except Exception as e:  # noqa: BLE001 - a backend may not support the shape
            print(f"     (SDPA {backend} unavailable: {type(e).__name__})")
            continue
        print(f"     SDPA {backend}: {ms:.3f} ms")
        if ms < best[1]:
            best = (backend, ms)
    return best


# --------------------------------------------------------------------------- Mamba prefill: SSD chunked scan


def _ssd_inputs(b: Bench, lens: list[int], H: int, P: int, N: int, G: int, dtype, with_init: bool):
    """x, B, C are views of one packed row, as the model splits its conv output; dt, A, D, dt_bias in
    float32 (mamba_ssm's convention); realistic dt: softplus(dt + bias) ~ 0.02 .. 0.3, A in -[0.05, 1.5]."""
    T = sum(lens)
    xbc = b.rnd(T, H * P + 2 * G * N, dtype=dtype)
    x = xbc[:, : H * P].view(T, H, P)
    B = xbc[:, H * P : H * P + G * N].view(T, G, N)
    C = xbc[:, H * P + G * N :].view(T, G, N)
    dt = b.rnd(T, H, dtype=F32) * 0.7 - 2.5
    A = -(torch.rand(H, device=b.dev) * 1.45 + 0.05)
    D, dt_bias = b.rnd(H, dtype=F32), b.rnd(H, dtype=F32, scale=0.5)
    init = b.rnd(len(lens), H, P, N, dtype=F32) if with_init else None
    return x, dt, A, B, C, D, dt_bias, init


def _ssd_floor_s(
    T: int, S: int, H: int, P: int, N: int, G: int, L: int, xbytes: int, with_init: bool, peaks: Peaks
) -> float:
    """Byte/FLOP floor of one scan without chunk states: max(bytes at the copy ceiling, FLOPs at the
    matmul ceiling). Bytes: x in, y out, B and C in, dt in, final states out (+ initial states in).
    FLOPs per token: chunk-state contribution and carried-state output (2 x 2HPN), causal within-chunk
    C.B (G N L/2 MACs) and scores @ x (H P L/2 MACs)."""
    nbytes = (
        2 * T * H * P * xbytes
        + 2 * T * G * N * xbytes
        + T * H * 4
        + S * H * P * N * 4 * (2 if with_init else 1)
    )
    flops = T * (4 * H * P * N + G * N * L + H * P * L)
    return max(nbytes / peaks.copy_bw, flops / peaks.matmul_flops)


def _ssd_kernel_times(fn) -> dict[str, float]:
    """Mean device time (ms) of each SSD kernel over 10 calls, from the torch profiler."""
    try:
        return {k: us / n / 1e3 for k, (us, n) in device_kernel_times(fn, 10).items() if "_ssd_" in k}
    except Exception as e:  # noqa: BLE001 - profiling is a diagnostic only
        print(f"     (kernel breakdown unavailable: {type(e).__name__}: {e})")
        return {}


def _ssd_cases(b: Bench) -> tuple[tuple[int, int, int, int, int], object, list[list[int]]]:
    shape = (128, 80, 128, 8, 128) if not b.dry else (4, 24, 16, 2, 16)  # H, P, N, G, chunk
    dtype = BF16 if not b.dry else torch.float16  # bf16 tl.dot is wrong in the interpreter
    cases = [[2048], [8192], [1024] * 8] if not b.dry else [[40], [70], [9] * 4]
    return shape, dtype, cases


def _ssd_check_and_time(
    b: Bench, lens: list[int], shape, dtype, label: str = ""
) -> tuple[float, tuple] | None:
    """Checks ssd_triton against the float32 reference on fresh inputs, then times it (without chunk
    states, as a prefill without snapshots runs). Returns (ms, inputs) or None when it disagrees."""
    from hyserve.kernels.ssd import ssd_chunked_ref
    from hyserve.kernels.triton_ssd import ssd_triton

    H, P, N, G, L = shape
    S, T = len(lens), sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    inp = _ssd_inputs(b, lens, H, P, N, G, dtype, with_init=S > 1)
    x, dt, A, B, C, D, dt_bias, init = inp
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, initial_states=init)
    name = (f"ssd {T} tokens" if S == 1 else f"ssd {S} x {lens[0]} tokens, initial states") + label
    got = ssd_triton(x, dt, A, B, C, L, cu, **kw, return_chunk_states=True)
    ref = ssd_chunked_ref(x, dt, A, B, C, L, cu, **kw, return_chunk_states=True)
    tol = 2e-2  # bf16 matmul operands; relative to the largest magnitude
    ok = True
    for what, a, r in (
        ("y", got.y, ref.y),
        ("final states", got.final_states, ref.final_states),
        ("chunk states", got.chunk_states, ref.chunk_states),
    ):
        ok = ok and b.check(f"{name} ({what})", a, r, tol, tol * max(1.0, float(r.abs().max())))
    del got, ref
    if not ok:
        return None
    ms = b.time_ms(lambda: ssd_triton(x, dt, A, B, C, L, cu, **kw, return_chunk_states=False))
    return ms, inp


def bench_ssd(b: Bench) -> None:
    from hyserve.kernels.triton_ssd import ssd_triton

    shape, dtype, cases = _ssd_cases(b)
    H, P, N, G, L = shape
    for lens in cases:
        res = _ssd_check_and_time(b, lens, shape, dtype)
        if res is None:
            continue
        ms, (x, dt, A, B, C, D, dt_bias, init) = res
        S, T = len(lens), sum(lens)
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        name = f"ssd {T} tokens" if S == 1 else f"ssd {S} x {lens[0]} tokens, initial states"

        def floor_s(peaks: Peaks) -> float:
            return _ssd_floor_s(T, S, H, P, N, G, L, x.element_size(), init is not None, peaks)

        kernels = {}
        if not b.dry:
            kernels = _ssd_kernel_times(
                lambda: ssd_triton(
                    x,
                    dt,
                    A,
                    B,
                    C,
                    L,
                    cu,
                    D=D,
                    dt_bias=dt_bias,
                    initial_states=init,
                    return_chunk_states=False,
                )
            )
            print("     kernels (ms): " + ", ".join(f"{k} {v:.4f}" for k, v in kernels.items()))
        b.roof(
            name,
            T / (ms * 1e-3),
            "tok/s",
            "copy+matmul",
            "byte/FLOP floor: max(min bytes at the copy ceiling, FLOPs at the matmul ceiling)",
            lambda p: T / floor_s(p),
            time_ms=ms,
            floor_ms=floor_s(measured_peaks(b.ceilings)) * 1e3,
            kernels_ms=kernels,
        )
        if S == 1 and not b.dry:
            _bench_mamba_ssm_ssd_peer(b, name, x, dt, A, B, C, L, D, dt_bias, ms)


def _bench_mamba_ssm_ssd_peer(b: Bench, name: str, x, dt, A, B, C, L: int, D, dt_bias, our_ms: float) -> None:
    """mamba_ssm's mamba_chunk_scan_combined (batch 1, no initial state) on the same input, when
    importable."""
    try:
        import types

        sys.modules.setdefault("selective_scan_cuda", types.ModuleType("selective_scan_cuda"))
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception as e:  # noqa: BLE001 - optional peer
        print(f"     (mamba_ssm peer skipped: {type(e).__name__}: {e})")
        return
    from hyserve.kernels.ssd import ssd_chunked_ref

    xs, dts, Bs, Cs = x[None], dt[None], B[None], C[None]

    def run():
        with torch.inference_mode():
            return mamba_chunk_scan_combined(
                xs, dts, A, Bs, Cs, L, D=D, dt_bias=dt_bias, dt_softplus=True, return_final_states=True
            )

    try:
        y_peer, _ = run()
        ref = ssd_chunked_ref(
            x, dt, A, B, C, L, [0, x.shape[0]], D=D, dt_bias=dt_bias, return_chunk_states=False
        )
        err = float((y_peer[0].float() - ref.y.float()).abs().max()) / max(1.0, float(ref.y.abs().max()))
        print(f"     mamba_ssm output vs reference: max error {err:.2e} of the largest magnitude")
        del ref, y_peer
        ms = b.time_ms(run)
    except Exception as e:  # noqa: BLE001 - optional peer
        print(f"     (mamba_ssm peer failed: {type(e).__name__}: {e})")
        return
    b.record(
        f"{name}: hyserve vs mamba_ssm mamba_chunk_scan_combined",
        ms / our_ms,
        "x speedup",
        "mamba_ssm mamba_chunk_scan_combined, same run",
        1.0,
        time_ms=our_ms,
        peer_ms=ms,
    )


# Alternative block sizes for the two heavy SSD kernels (one kernel changed per entry), timed against
# the default by `--only ssd_sweep`: the data to retune `triton_ssd._gpu_config` from.
_SSD_SWEEP: list[tuple[str, dict, dict]] = [
    ("default", {}, {}),
    ("state P64 N64 w4 s4", dict(BLOCK_P=64, BLOCK_N=64, num_warps=4, num_stages=4), {}),
    ("state P64 N32 w4 s3", dict(BLOCK_P=64, BLOCK_N=32, num_warps=4, num_stages=3), {}),
    ("state P32 N64 w4 s3", dict(BLOCK_P=32, BLOCK_N=64, num_warps=4, num_stages=3), {}),
    ("state P128 N64 w8 s3", dict(BLOCK_P=128, BLOCK_N=64, num_warps=8, num_stages=3), {}),
    ("state P64 N128 w8 s3", dict(BLOCK_P=64, BLOCK_N=128, num_warps=8, num_stages=3), {}),
    ("out K64 KN64 s3", {}, dict(BLOCK_K=64, BLOCK_KN=64, num_stages=3)),
    ("out K32 KN64 s3", {}, dict(BLOCK_K=32, BLOCK_KN=64, num_stages=3)),
    ("out K32 KN32 s4", {}, dict(BLOCK_K=32, BLOCK_KN=32, num_stages=4)),
    ("out M32 K32 KN32 s3", {}, dict(BLOCK_M=32, BLOCK_K=32, BLOCK_KN=32, num_stages=3)),
    ("out M64 K32 KN32 P64 s3", {}, dict(BLOCK_P=64, num_stages=3)),
]


def bench_ssd_sweep(b: Bench) -> None:
    import hyserve.kernels.triton_ssd as ts

    shape, dtype, cases = _ssd_cases(b)
    attr = "_cpu_config" if b.dry else "_gpu_config"
    base = getattr(ts, attr)
    default_ms: dict[int, float] = {}
    for label, state, out in _SSD_SWEEP:

        def cfg(L: int, P: int, N: int, state=state, out=out) -> dict:
            c = base(L, P, N)
            c["state"].update(state)
            c["out"].update(out)
            c["out"]["BLOCK_M"] = min(c["out"]["BLOCK_M"], L)  # tiny dry-run chunks
            c["out"]["BLOCK_K"] = min(c["out"]["BLOCK_K"], c["out"]["BLOCK_M"])
            return c

        setattr(ts, attr, cfg)
        try:
            for lens in cases[:2]:
                res = _ssd_check_and_time(b, lens, shape, dtype, label=f" [{label}]")
                if res is not None:
                    T = sum(lens)
                    default_ms.setdefault(T, res[0])  # the first entry is the default
                    b.record(
                        f"ssd {T} tokens [{label}]",
                        res[0],
                        "ms",
                        "default config, same sweep",
                        default_ms[T],
                        time_ms=res[0],
                    )
        except Exception as e:  # noqa: BLE001 - a config may not compile; report and go on
            print(f"     (ssd config {label} failed: {type(e).__name__}: {e})")
        finally:
            setattr(ts, attr, base)


# Alternative launch settings for paged attention, timed against the default by `--only attn_sweep`:
# the data to retune `triton_attention._DECODE_GPU` / `_PREFILL_GPU` / `_TARGET_PROGRAMS` from.
# (label, decode settings, target programs, max splits) and (label, prefill settings for head dim 128).
_DECODE_SWEEP: list[tuple[str, dict, int, int]] = [
    ("default", {}, 0, 0),
    ("N64 w4 s2", dict(BLOCK_N=64, num_stages=2), 0, 0),
    ("N128 w4 s2", dict(num_stages=2), 0, 0),
    ("N128 w4 s3, 2x programs", {}, 132 * 8, 256),
    ("N128 w4 s3, half the programs", {}, 132 * 2, 128),
    ("N64 w4 s3, 2x programs", dict(BLOCK_N=64), 132 * 8, 256),
    ("N128 w4 s3, one-shot merge", dict(combine=dict(ONCE_MIN_SPLITS=1)), 0, 0),
    ("N128 w4 s3, 2x programs, one-shot merge", dict(combine=dict(ONCE_MIN_SPLITS=1)), 132 * 8, 256),
]
# Decode over a float8 pool: on Hopper the Gluon one-warp MMA kernel (`gluon_decode._DECODE_FP8`; "programs"
# changes its `_TARGET_PROGRAMS`), and the Triton kernel alone (GLUON=False, the path before it; its settings
# are the `_DECODE_GPU` table's, whose own sweep over fp8 found nothing faster: attn_sweep_3c7fa65).
# "combine" entries (in both decode sweeps) change the merge of the split partials
# (`triton_attention._COMBINE_GPU`; ONCE_MIN_SPLITS 1: every split in one load, at every split count; 0: the
# loop merge at every split count).
_DECODE_SWEEP_FP8: list[tuple[str, dict]] = [
    ("default", {}),
    ("Gluon SUB 16, no prefetch", dict(gluon=dict(PREFETCH=False))),
    ("Gluon SUB 32", dict(gluon=dict(SUB=32))),
    ("Gluon SUB 16, 8 warps a SM", dict(programs=132 * 8)),
    ("Gluon SUB 16, 16 warps a SM", dict(programs=132 * 16)),
    ("Gluon SUB 16, 4 warps a SM", dict(programs=132 * 4)),
    ("Gluon SUB 32, 8 warps a SM", dict(gluon=dict(SUB=32), programs=132 * 8)),
    ("Triton N128 w4 s3", dict(GLUON=False)),
    ("Gluon SUB 16, loop merge", dict(combine=dict(ONCE_MIN_SPLITS=0))),
    ("Gluon SUB 16, one-shot merge", dict(combine=dict(ONCE_MIN_SPLITS=1))),
    ("Gluon SUB 16, one-shot merge D 64", dict(combine=dict(ONCE_MIN_SPLITS=1, D_BLOCK=64))),
    ("Gluon SUB 16, 16 warps a SM, one-shot merge", dict(combine=dict(ONCE_MIN_SPLITS=1), programs=132 * 16)),
    ("Gluon SUB 16, 8 warps a SM, one-shot merge", dict(combine=dict(ONCE_MIN_SPLITS=1), programs=132 * 8)),
]
# The default on Hopper is the Gluon kernel (gluon_attention.py; "sm90" entries change its settings,
# `gluon_attention._PREFILL_SM90`; a lock-step Gluon version measured 1.2x slower, attn_sweep_b308941, and
# the consumers' own S(j+1) issued before the softmax of S(j) 1.1-1.6x slower, attn_sweep_d90941e/_5b50b28,
# the consumers without turns 1.05x slower, attn_sweep_dded3dc: benchmarks/results records in git history);
# GLUON=False entries time the Triton kernel instead: key tiles through tensor descriptors, one box or two
# per tile (each box within one of the pool's 64-token blocks; the folded-scale softmax). Earlier sweeps
# (benchmarks/README.md) also timed pointer loads, 2 stages, 64-key tiles, compiler warp specialisation, a
# query block split in two halves, exponentials on the multiply-add pipes and an interleaved PV: dropped.
_PREFILL_SWEEP: list[tuple[str, dict]] = [
    ("default", {}),
    ("Gluon M128 N128 2 stages", dict(sm90=dict(STAGES=2))),
    ("Gluon M128 N64 4 stages", dict(sm90=dict(BLOCK_N=64, STAGES=4))),
    ("Triton M128 N128 w8 s3 TMA", dict(GLUON=False)),
]


# Prefill over a float8 pool (`gluon_attention._PREFILL_SM90_FP8`, the converter form): the converter's rows
# per step, and the Triton kernel alone (the path before the converter form).
_PREFILL_SWEEP_FP8: list[tuple[str, dict]] = [
    ("default", {}),
    ("Gluon, 16 rows converted at a time", dict(sm90=dict(CONVERT_ROWS=16))),
    ("Gluon, one staging slot per pool", dict(sm90=dict(STAGES8=1))),
    # K read by e4m3 MMAs straight from its TMA ring, queries quantised per row, V alone converted (what
    # gluon_attention._PREFILL_SM90_QK8 changes; checked against the attention of the e4m3 queries)
    ("Gluon QK8: e4m3 S, 3 stages", dict(sm90=dict(QK8=True, STAGES=3))),
    ("Gluon QK8: e4m3 S, 2 stages", dict(sm90=dict(QK8=True, STAGES=2))),
    ("Triton M128 N128 w8 s3 TMA", dict(GLUON=False)),
]


def bench_attn_sweep(b: Bench) -> None:
    import hyserve.kernels.gluon_attention as ga
    import hyserve.kernels.gluon_decode as gd
    import hyserve.kernels.triton_attention as ta
    from hyserve.kernels.cuda_attention import paged_attention_cuda

    Hq, Hkv, D, bs = (40, 8, 128, 64) if not b.dry else (4, 2, 32, 16)
    dtype = BF16 if not b.dry else torch.float16
    scale, tol = D**-0.5, 2e-2
    tables = [
        (ta, name)
        for name in (
            "_DECODE_GPU",
            "_PREFILL_GPU",
            "_TARGET_PROGRAMS",
            "_MAX_SPLITS",
            "_DECODE_CPU",
            "_PREFILL_CPU",
            "_COMBINE_GPU",
            "_COMBINE_CPU",
        )
    ] + [(ga, "_PREFILL_SM90"), (ga, "_PREFILL_SM90_FP8")]
    tables += [(gd, "_DECODE_FP8"), (gd, "_TARGET_PROGRAMS")]
    saved = [(mod, name, copy.deepcopy(getattr(mod, name))) for mod, name in tables]
    attention = [
        paged_attention_cuda
    ]  # what the entry being timed calls (apply_prefill may pick Triton alone)

    def restore() -> None:
        for mod, name, value in saved:
            setattr(mod, name, copy.deepcopy(value))
        attention[0] = paged_attention_cuda

    def run_case(
        name: str,
        q,
        kc,
        vc,
        tb,
        lens,
        cu,
        nbytes_or_flops: float,
        unit: str,
        configs,
        apply,
        graph: bool = False,
        **kw,
    ) -> float:
        """graph: time the decode step as a captured step runs it (device seq_lens / cu_q, CUDA graph replay,
        no launcher host time); else eager with host lists."""
        refs = {False: paged_attention_ref(q, kc, vc, tb, lens, cu, scale, **kw)}
        lens_t = torch.tensor(lens, dtype=torch.int32, device=b.dev)
        cu_t = torch.tensor(cu, dtype=torch.int32, device=b.dev)
        base_ms = None
        for label, *cfg in configs:
            # the QK8 prefill form multiplies per-row e4m3 queries: its reference takes those (a dry run keeps
            # the interpreter's own kernel whatever the entry says)
            qk8 = not b.dry and isinstance(cfg[0], dict) and bool(cfg[0].get("sm90", {}).get("QK8"))
            if qk8 not in refs:
                refs[qk8] = paged_attention_ref(
                    e4m3_query_rows_ref(q).double(), kc, vc, tb, lens, cu, scale, **kw
                ).to(q.dtype)
            ref = refs[qk8]
            try:
                apply(*cfg)
                fn = attention[0]
                got = fn(q, kc, vc, tb, lens, cu, scale, **kw)
                if not b.check(f"{name} [{label}]", got, ref, tol, tol):
                    continue
                if graph:
                    ms = b.graph_ms(lambda: fn(q, kc, vc, tb, lens_t, cu_t, scale, **kw))
                else:
                    ms = b.time_ms(lambda: fn(q, kc, vc, tb, lens, cu, scale, **kw))
                base_ms = base_ms if base_ms is not None else ms  # the first entry is the default
                b.record(
                    f"{name} [{label}]",
                    ms,
                    "ms",
                    "default settings, same sweep",
                    base_ms,
                    time_ms=ms,
                    rate=nbytes_or_flops / (ms * 1e-3),
                    rate_unit=unit,
                )
            except Exception as e:  # noqa: BLE001 - a setting may not compile; report and go on
                print(f"     (attention config {label} failed: {type(e).__name__}: {e})")
            finally:
                restore()
        del refs
        return base_ms if base_ms is not None else float("nan")

    def apply_combine(over: dict) -> dict:
        over = dict(over)
        (ta._COMBINE_CPU if b.dry else ta._COMBINE_GPU).update(over.pop("combine", {}))
        return over

    def apply_decode(over: dict, programs: int, max_splits: int) -> None:
        over = apply_combine(over)
        target = ta._DECODE_CPU if b.dry else ta._DECODE_GPU
        target.update(over if not b.dry else {k: v for k, v in over.items() if k != "BLOCK_N"})
        if programs:
            ta._TARGET_PROGRAMS, ta._MAX_SPLITS = programs, max_splits

    def apply_decode_fp8(over: dict) -> None:
        over = apply_combine(over)
        if not over.pop("GLUON", True):
            attention[0] = ta.paged_attention_triton
        gd._DECODE_FP8.update(over.pop("gluon", {}))
        if "programs" in over:
            gd._TARGET_PROGRAMS = over.pop("programs")

    def apply_prefill(over: dict, table: str = "_PREFILL_SM90") -> None:
        if b.dry:
            return  # the interpreter runs its own small tiles
        over = dict(over)
        getattr(ga, table).update(over.pop("sm90", {}))
        if not over.pop("GLUON", True):
            attention[0] = ta.paged_attention_triton
        ta._PREFILL_GPU[128].update(over)

    for batch, L in ((1, 131072), (64, 8192)) if not b.dry else ((1, 700), (3, 100)):
        lens = [L] * batch
        kc, vc, tb = _paged_pool(b, lens, Hkv, D, bs, dtype)
        q = b.rnd(batch, Hq, D, dtype=dtype)
        run_case(
            f"decode attention {batch} x {L}",
            q,
            kc,
            vc,
            tb,
            lens,
            list(range(batch + 1)),
            2 * batch * L * Hkv * D * kc.element_size(),
            "B/s",
            _DECODE_SWEEP,
            apply_decode,
        )
        del kc, vc
        kc, vc, tb, ks, vs = _fp8_pool(b, lens, Hkv, D, bs, dtype)
        run_case(
            f"decode attention fp8 KV {batch} x {L} (graph)",
            q,
            kc,
            vc,
            tb,
            lens,
            list(range(batch + 1)),
            2 * batch * L * Hkv * D,
            "B/s",
            _DECODE_SWEEP_FP8,
            apply_decode_fp8,
            graph=True,
            k_scale=ks,
            v_scale=vs,
        )
        del kc, vc
    for n_new, L in ((8192, 8192), (2048, 8192)) if not b.dry else ((37, 37), (20, 50)):
        kc, vc, tb = _paged_pool(b, [L], Hkv, D, bs, dtype)
        q = b.rnd(n_new, Hq, D, dtype=dtype)
        flops = ta.attention_flops([n_new], [L], Hq, D)
        default_ms = run_case(
            f"prefill attention {n_new} new / {L}",
            q,
            kc,
            vc,
            tb,
            [L],
            [0, n_new],
            flops,
            "FLOP/s",
            _PREFILL_SWEEP,
            apply_prefill,
        )
        kc8, vc8, tb8, ks, vs = _fp8_pool(b, [L], Hkv, D, bs, dtype)
        run_case(
            f"prefill attention fp8 KV {n_new} new / {L}",
            q,
            kc8,
            vc8,
            tb8,
            [L],
            [0, n_new],
            flops,
            "FLOP/s",
            _PREFILL_SWEEP_FP8,
            lambda over: apply_prefill(over, "_PREFILL_SM90_FP8"),
            k_scale=ks,
            v_scale=vs,
        )
        del kc8, vc8
        if n_new == L and not b.dry:  # the peer the default is judged against, timed in the same sweep
            best_name, best_ms = _sdpa_best(b, q, kc, vc, tb, L)
            b.record(
                f"prefill attention {n_new} new / {L} [torch SDPA {best_name}]",
                best_ms,
                "ms",
                "default settings, same sweep",
                default_ms,
                time_ms=best_ms,
                rate=flops / (best_ms * 1e-3),
                rate_unit="FLOP/s",
            )


def bench_attn_rounds(b: Bench) -> None:
    """8k causal prefill attention: the default kernel and torch SDPA timed in turn for b.rounds rounds, so
    the spread within one run is on record beside the ratio (H200s differ from one another by more
    than one run's spread). Ours is checked against the reference first: `ncu -c 1` profiles that call.
    (The Gluon consumers without turns ran here at fd3554c-f73cf84, 4-6% slower in device time, before that
    form was dropped.)"""
    import statistics

    from hyserve.kernels.cuda_attention import paged_attention_cuda
    from hyserve.kernels.triton_attention import attention_flops

    Hq, Hkv, D, bs, L = (40, 8, 128, 64, 8192) if not b.dry else (4, 2, 32, 16, 37)
    dtype = BF16 if not b.dry else torch.float16
    scale, tol = D**-0.5, 2e-2
    kc, vc, tb = _paged_pool(b, [L], Hkv, D, bs, dtype)
    q = b.rnd(L, Hq, D, dtype=dtype)
    flops = attention_flops([L], [L], Hq, D)
    runs = {"default": lambda: paged_attention_cuda(q, kc, vc, tb, [L], [0, L], scale)}
    if not b.check(
        f"prefill attention {L} [default]",
        runs["default"](),
        paged_attention_ref(q, kc, vc, tb, [L], [0, L], scale),
        tol,
        tol,
    ):
        return
    if not b.dry:
        peer_name, _ = _sdpa_best(b, q, kc, vc, tb, L)
        runs[f"torch SDPA {peer_name}"] = _sdpa_fn(q, kc, vc, tb, L, peer_name)
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(b.rounds):
        for label, fn in runs.items():
            times[label].append(b.time_ms(fn))
    base = statistics.median(times["default"])
    # Event timing includes the launcher's host work whenever that outlasts the cache flush do_bench queues
    # before each call; the profiler's device time (every kernel and copy of one call, 10 calls) does not,
    # and host time per call (50 calls queued behind a busy GPU, no sync) is the launcher's own cost.
    dev_ms = {label: _device_ms(b, fn) for label, fn in runs.items()}
    host_ms = {label: _host_ms(b, fn) for label, fn in runs.items()}
    for label, ts in times.items():
        med = statistics.median(ts)
        b.record(
            f"prefill attention {L} new / {L} [{label}], median of {len(ts)} rounds",
            med,
            "ms",
            "default settings, same rounds",
            base,
            time_ms=med,
            min_ms=min(ts),
            max_ms=max(ts),
            rate=flops / (med * 1e-3),
            rate_unit="FLOP/s",
        )
    for label in runs:
        b.record(
            f"prefill attention {L} new / {L} [{label}], device time",
            dev_ms[label],
            "ms",
            "default settings, device time",
            dev_ms["default"],
            host_ms=host_ms[label],
            rate=flops / (dev_ms[label] * 1e-3),
            rate_unit="FLOP/s",
        )


def _device_ms(b: Bench, fn, reps: int = 10) -> float:
    """Device time of one call of fn: the sum over every kernel and copy it launches (torch profiler)."""
    if b.dry:
        return b.time_ms(fn)
    fn()
    torch.cuda.synchronize()
    return sum(us for us, _ in device_kernel_times(fn, reps).values()) / reps / 1e3


def _host_ms(b: Bench, fn, calls: int = 50) -> float:
    """Host time of one call of fn with the GPU kept busy (queued launches, no synchronisation)."""
    if b.dry:
        calls = 1
    else:
        torch.cuda.synchronize()
        torch.cuda._sleep(50_000_000)  # keep the GPU busy so every call only queues its work
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) * 1e3 / calls
    if not b.dry:
        torch.cuda.synchronize()
    return host


# --------------------------------------------------------------------------- main

SUITES = {
    "ssm": bench_ssm,
    "conv": bench_conv,
    "norm": bench_norms,
    "quant": bench_quant,
    "linear": bench_linear,
    "attn": bench_attn,
    "ssd": bench_ssd,
    "ssd_sweep": bench_ssd_sweep,
    "attn_sweep": bench_attn_sweep,
    "linear_sweep": bench_linear_sweep,
    "fp8_gemv_sweep": bench_fp8_gemv_sweep,
    "fp8_gemv_super_sweep": bench_fp8_gemv_super_sweep,
    "linear_30b_sweep": bench_linear_30b_sweep,
    "attn_rounds": bench_attn_rounds,
    "fp8_linear": bench_fp8_linear,
}
DEFAULT_SUITES = [
    k for k in SUITES if not k.endswith(("_sweep", "_rounds"))
]  # sweeps retune launch settings: on request


def _git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        ).stdout.strip()
    except Exception:  # noqa: BLE001 - a copy without .git
        return "unknown"


def _table(records: list[dict]) -> str:
    lines = ["| kernel | value | unit | reference | reference value | ratio |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(
            f"| {r['name']} | {r['value']:.4g} | {r['unit']} | {r['reference']} | "
            f"{r['reference_value']:.4g} | {r['ratio']:.1%} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", default=",".join(DEFAULT_SUITES), help=f"comma-separated subset of {sorted(SUITES)}"
    )
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/kernels_<date>.json)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    ap.add_argument("--git-sha", default="", help="commit of the tree, when it is run without .git")
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the attn_rounds suite")
    ap.add_argument(
        "--write-linear-configs",
        action="store_true",
        help="after the FP8 GEMV sweeps: enter each shape's fastest setting, where it beats the current "
        f"one by {1 - _WRITE_MARGIN:.0%}% or more, into this GPU's linear_configs file",
    )
    ap.add_argument(
        "--linear-configs-dir",
        default=None,
        help="where that file lies (default hyserve/kernels/linear_configs)",
    )
    args = ap.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device (or --dry-run)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    b = Bench(args.dry_run, args.rounds)
    for name in args.only.split(","):
        SUITES[name.strip()](b)
        if not args.dry_run:
            torch.cuda.empty_cache()
    date = _dt.date.today().isoformat()
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / f"kernels_{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = dict(
        date=date,
        git_sha=args.git_sha or _git_sha(),
        gpu=torch.cuda.get_device_name()
        if torch.cuda.is_available() and not args.dry_run
        else "cpu (interpreter)",
        command=" ".join(invocation()),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        failures=b.failures,
        ceilings=b._ceilings.to_dict() if b._ceilings is not None else None,
        records=b.records,
    )
    out.write_text(json.dumps(doc, indent=2) + "\n")
    if args.write_linear_configs:
        import hyserve.kernels.triton_fused_linear as tfl

        cfg_dir = Path(args.linear_configs_dir) if args.linear_configs_dir else tfl.CONFIG_DIR
        device = "cpu" if args.dry_run else torch.cuda.get_device_name()
        src = f"benchmarks/results/{out.with_suffix('.md').name} ({doc['git_sha'][:7]}, {date})"
        keys = write_linear_configs(b, cfg_dir, device, src)
        print(
            f"linear configs for {device}: "
            f"{', '.join(keys) if keys else 'no shape beats its current setting'}"
        )
    table = _table(b.records)
    out.with_suffix(".md").write_text(table + "\n")
    print()
    print(table)
    print(f"\nwrote {out}")
    if b.failures:
        print(f"{len(b.failures)} kernel(s) disagree with their references:", *b.failures, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
