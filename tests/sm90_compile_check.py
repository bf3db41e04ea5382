"""Compiles the Triton kernels a Nemotron Nano 9B v2-width model launches ahead of time for sm_90 (no GPU
needed) through their real launchers, at the GPU launch settings, and prints each kernel's largest shared
memory as one JSON line: {"dtype": ..., "kernels": {name: bytes}, "ptx": {name: ["e4m3", "wgmma.mma_async"]}}
(the second: which of those its PTX holds; "cvt.bf16.f16": a scalar float16 -> bf16 convert,
"ld.shared.b8": shared-memory loads of single bytes, "griddepcontrol.wait": the kernel waits for its
predecessor as a programmatic dependent launch; "ld.global before the wait": it loads from global memory
ahead of that wait; with --sass, "QGMMA" / "HGMMA": its SASS runs e4m3 / 16-bit warp-group MMAs).

    python tests/sm90_compile_check.py float32 [op ...] [--only kernel,...] [--no-pdl] [--sass]
                                            # ops: attention attention_fp8 ssd ssm_update conv1d norm
                                            #      moe sampling fp8 moe_fp8 moe_forms moe_a8 (default: all)

The launchers run on CPU tensors with a stand-in driver that reports an sm_90 device, and every launch
compiles (as `warmup=True`) instead of running, so the shared memory is what the compiler asks for on an
H100/H200 (232,448 bytes at most per block). Run by test_triton_kernels.py in a fresh process without
TRITON_INTERPRET (the interpreter never compiles).
"""

from __future__ import annotations

import json
import sys

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from tests.sass import sass_counts

# Nano 9B v2 widths: Mamba 128 heads x 80, state 128, 8 groups, conv 4 over 12288 channels, chunk 128;
# attention 40 / 8 heads of 128 in 64-token blocks; hidden 4480, gated-norm groups of 1280
H, P, N, G, K, CHUNK = 128, 80, 128, 8, 4, 128
HQ, HKV, HEAD_DIM, BLOCK = 40, 8, 128, 64
HIDDEN, D_INNER, GROUP = 4480, 10240, 1280
CONV_DIM = D_INNER + 2 * G * N


# PTX features reported per kernel
MARKERS = ("wgmma.mma_async", "e4m3", "cvt.bf16.f16", "ld.shared.b8", "griddepcontrol.wait")


class _Sm90:
    """Just enough of a Triton driver for the launchers to compile for sm_90 on a machine without one."""

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


def _gpu_settings() -> None:
    """Have the launchers pick their GPU launch settings (by their own rules) for the CPU tensors here, the
    programmatic-dependent-launch form included (an sm_90 device has it)."""
    import hyserve.kernels.launch_util as lu

    lu._pdl_on = lambda t: lu.pdl_enabled()
    import hyserve.kernels.triton_attention as ta
    import hyserve.kernels.triton_fp8_linear as t8
    import hyserve.kernels.triton_ssd as ts

    t8._gpu = lambda x: True
    import hyserve.kernels.triton_fused_linear as tfl

    tfl._gpu = lambda x: True
    t8._sm_count = lambda index: 132  # an H100 SXM / H200

    gpu_settings = ta._launch_settings
    ta._launch_settings = lambda on_gpu, ieee, d_pad: gpu_settings(True, ieee, d_pad)
    ts._cpu_config = ts._gpu_config
    import hyserve.kernels.triton_moe as tm

    gpu_router = tm.router_settings
    tm.router_settings = lambda on_gpu: gpu_router(True)


def _attention(dt: torch.dtype) -> None:
    from hyserve.kernels.triton_attention import paged_attention_triton, write_kv_triton

    kc = torch.randn(4, BLOCK, HKV, HEAD_DIM).to(dt)
    vc = kc.clone()
    tables = torch.arange(4, dtype=torch.int32).view(1, 4).repeat(3, 1)
    k = torch.randn(3, HKV, HEAD_DIM).to(dt)
    write_kv_triton(k, k.clone(), kc, vc, torch.arange(3))
    q = torch.randn(3, HQ, HEAD_DIM).to(dt)
    paged_attention_triton(q[:2], kc, vc, tables[:2], [10, 200], [0, 1, 2], HEAD_DIM**-0.5)  # decode
    paged_attention_triton(q, kc, vc, tables[:1], [200], [0, 3], HEAD_DIM**-0.5)  # prefill / extend


def _attention_fp8(dt: torch.dtype) -> None:
    """The decode and prefill kernels over an e4m3 cache with per-layer scales, queries of dtype dt."""
    from hyserve.kernels.triton_attention import paged_attention_triton

    kc = torch.zeros(4, BLOCK, HKV, HEAD_DIM).to(torch.float8_e4m3fn)
    vc = kc.clone()
    tables = torch.arange(4, dtype=torch.int32).view(1, 4).repeat(3, 1)
    q = torch.randn(3, HQ, HEAD_DIM).to(dt)
    scales = dict(k_scale=torch.tensor(0.03), v_scale=torch.tensor(0.02))
    paged_attention_triton(
        q[:2], kc, vc, tables[:2], [10, 200], [0, 1, 2], HEAD_DIM**-0.5, **scales
    )  # decode
    paged_attention_triton(q, kc, vc, tables[:1], [200], [0, 3], HEAD_DIM**-0.5, **scales)  # prefill / extend


def _ssd(dt: torch.dtype) -> None:
    from hyserve.kernels.triton_ssd import ssd_triton

    T = 5
    x, B, C = torch.randn(T, H, P).to(dt), torch.randn(T, G, N).to(dt), torch.randn(T, G, N).to(dt)
    f = torch.randn(H).to(dt)
    ssd_triton(
        x,
        torch.randn(T, H).to(dt),
        -torch.rand(H),
        B,
        C,
        CHUNK,
        [0, T],
        D=f,
        dt_bias=f,
        initial_states=torch.zeros(1, H, P, N),
    )


def _ssm_update(dt: torch.dtype) -> None:
    from hyserve.kernels.triton_ssm_update import selective_state_update_triton

    pool = torch.zeros(3, H, P, N)  # the float32 SSM state (mamba_ssm_cache_dtype's default)
    f = torch.randn(H).to(dt)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    selective_state_update_triton(
        pool,
        torch.randn(2, H, P).to(dt),
        torch.randn(2, H).to(dt),
        -torch.rand(H),
        torch.randn(2, G, N).to(dt),
        torch.randn(2, G, N).to(dt),
        slots,
        slots + 1,
        D=f,
        dt_bias=f,
    )


def _conv1d(dt: torch.dtype) -> None:
    from hyserve.kernels.triton_conv1d import causal_conv1d_update_triton, causal_conv1d_varlen_triton

    w, b = torch.randn(CONV_DIM, K).to(dt), torch.randn(CONV_DIM).to(dt)
    causal_conv1d_varlen_triton(
        torch.randn(5, CONV_DIM).to(dt), w, b, [0, 5], initial_states=torch.zeros(1, CONV_DIM, K - 1).to(dt)
    )
    pool = torch.zeros(10, CONV_DIM, K - 1).to(dt)
    for batch in (1, 8):  # the launcher's two tile widths
        slots = torch.arange(batch, dtype=torch.int32)
        causal_conv1d_update_triton(torch.randn(batch, CONV_DIM).to(dt), pool, w, b, slots, slots + 1)


def _norm(dt: torch.dtype) -> None:
    from hyserve.kernels.triton_activation import relu2_triton
    from hyserve.kernels.triton_rmsnorm import add_rms_norm_triton, rms_norm_triton, rmsnorm_gated_triton

    x, w = torch.randn(2, HIDDEN).to(dt), torch.randn(HIDDEN).to(dt)
    rms_norm_triton(x, w, 1e-5)
    add_rms_norm_triton(x, x.clone(), w, 1e-5)
    z, wg = torch.randn(2, D_INNER).to(dt), torch.randn(D_INNER).to(dt)
    rmsnorm_gated_triton(z, z.clone(), wg, 1e-5, GROUP)
    relu2_triton(torch.randn(2, 15680).to(dt))


def _moe(dt: torch.dtype) -> None:
    """Nemotron 3 Nano 30B-A3B's MoE layer (128 experts, top-6, d 2688, I 1856, a shared expert of 2 x I):
    the router GEMV and routing, the decode GEMVs with the shared expert folded in at the H200's tuned 1- and
    2-token configs (at 1 token in both EARLY forms and with the down GEMV split by slot too), and the grouped
    GEMMs with the shared expert added in the combine at 64 tokens."""
    import hyserve.kernels.triton_moe as tm

    E, top_k, d, inter, S = 128, 6, 2688, 1856, 2
    tuned = tm._tuned_table("NVIDIA H200").get(tm.shape_key(E, inter, d), {})
    gate = torch.randn(E, d)
    w_up, w_down = torch.randn(E, inter, d).to(dt), torch.randn(E, d, inter).to(dt)
    su, sd = torch.randn(S * inter, d).to(dt), torch.randn(d, S * inter).to(dt)
    for T in (1, 2, 64):
        x = torch.randn(T, d).to(dt)
        tm.moe_route_triton(tm.router_logits_triton(x, gate), torch.zeros(E), top_k, 1, 1, True, 2.5)
        ids = torch.stack([torch.randperm(E)[:top_k] for _ in range(T)]).to(
            torch.int32
        )  # compile-only: unrun
        cfg = tuned.get(str(tm.token_bucket(T))) or tm.heuristic_config(E, inter, d, T, top_k)
        tm.moe_experts_triton(x, w_up, w_down, torch.rand(T, top_k), ids, su, sd, config=cfg)
        if cfg["variant"] == "gemv" and T == 1:  # both forms of the decode GEMVs (EARLY: see triton_moe.py)
            for early in (0, 1):
                flat = {k: v for k, v in cfg["down"].items() if k != "SPLIT"}  # (a tuned entry may be split)
                alt = dict(cfg, up=dict(cfg["up"], EARLY=early), down=dict(flat, FLAT=1, EARLY=early))
                tm.moe_experts_triton(x, w_up, w_down, torch.rand(T, top_k), ids, su, sd, config=alt)
            # and the down GEMV split by slot, with the combine after it
            split = dict(cfg, down=dict(BLOCK_N=4, BLOCK_K=128, num_warps=2, num_stages=8, SPLIT=1))
            tm.moe_experts_triton(x, w_up, w_down, torch.rand(T, top_k), ids, su, sd, config=split)


def _sampling(dt: torch.dtype) -> None:
    """The structured-outputs token mask over a 131,072-token vocabulary (the sampler's float32 logits)."""
    from hyserve.kernels.triton_token_bitmask import apply_token_bitmask_triton

    apply_token_bitmask_triton(torch.zeros(4, 131072), torch.full((4, 4096), -1, dtype=torch.int32))


def _fp8(dt: torch.dtype) -> None:
    """The FP8 linear's kernels at a Nano 9B v2 projection (in_proj: 4480 -> 17504), both scale layouts, the
    decode form (1 and 16 rows) and both w8a8 tile settings (64 and 65 rows). float32 activations take the
    reference, so this op compiles 16-bit activations whatever `dt` is."""
    from hyserve.kernels.fp8_linear import quantize_weight_ref
    from hyserve.kernels.triton_fp8_linear import fp8_linear_triton

    act = dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16
    n, k = 17504, HIDDEN
    w = torch.empty(n, k).uniform_(-1, 1)
    for scheme in ("channel", "block"):
        q, s = quantize_weight_ref(w, scheme)
        for m in (1, 16, 64, 65):
            fp8_linear_triton(torch.randn(m, k).to(act), q, s, None)
        for m in (
            1,
            65,
        ):  # the MLP's down_proj: relu^2 in the decode tiles and in the activation quantisation
            fp8_linear_triton(torch.randn(m, k).to(act), q, s, None, relu2=True)


def _moe_fp8(dt: torch.dtype) -> None:
    """The fused-MoE kernels with FP8 experts at a Nemotron 3 Nano 30B-A3B layer (128 experts, top 6, hidden
    2688, intermediate 1856): the decode GEMVs (1 token, both EARLY forms) and the grouped GEMMs (a 64- and
    an 8192-token bucket), at the heuristic GPU settings."""
    from hyserve.kernels.triton_moe import heuristic_config, moe_experts_triton

    act = dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16
    E, k, d, inter = 128, 6, 2688, 1856
    up, down = (
        torch.zeros(E, inter, d, dtype=torch.float8_e4m3fn),
        torch.zeros(E, d, inter, dtype=torch.float8_e4m3fn),
    )
    su, sd = torch.ones(E, inter), torch.ones(E, d)
    for T in (1, 64, 8192):
        ids = (torch.arange(T * k, dtype=torch.int32) % E).view(T, k)
        cfg = heuristic_config(E, inter, d, T, k)
        forms = [cfg]
        if (
            cfg["variant"] == "gemv"
        ):  # and the EARLY form of the decode GEMVs, and the down GEMV split by slot
            forms.append(dict(cfg, up=dict(cfg["up"], EARLY=1), down=dict(cfg["down"], FLAT=1, EARLY=1)))
            forms.append(dict(cfg, down=dict(BLOCK_N=4, BLOCK_K=128, num_warps=2, num_stages=8, SPLIT=1)))
        for c in forms:
            moe_experts_triton(
                torch.randn(T, d).to(act),
                up,
                down,
                torch.rand(T, k),
                ids,
                up_scale=su,
                down_scale=sd,
                config=c,
            )


def _moe_forms(dt: torch.dtype) -> None:
    """The grouped GEMMs' other forms at a Nemotron 3 Nano 30B-A3B layer, 1,024 tokens: the SWAP tiles over
    e4m3 experts (w @ x^T, the weight the MMA's register operand), and the SiLU-gated form (Granite-4.0-H's
    experts, [gate | up] rows) in both tile forms."""
    from hyserve.kernels.triton_moe import moe_experts_silu_triton, moe_experts_triton

    act = dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16
    E, k, d, inter, T = 128, 6, 2688, 1856, 1024
    ids = (torch.arange(T * k, dtype=torch.int32) % E).view(T, k)
    x, w = torch.randn(T, d).to(act), torch.rand(T, k)
    tiles = dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    for swap in (0, 1):
        cfg = {"variant": "gemm", "BLOCK_M": 64, "up": dict(tiles, SWAP=swap), "down": dict(tiles, SWAP=swap)}
        if swap:
            up8 = torch.zeros(E, inter, d, dtype=torch.float8_e4m3fn)
            down8 = torch.zeros(E, d, inter, dtype=torch.float8_e4m3fn)
            moe_experts_triton(
                x, up8, down8, w, ids, up_scale=torch.ones(E, inter), down_scale=torch.ones(E, d), config=cfg
            )
        gate_up, down = torch.randn(E, 2 * inter, d).to(act), torch.randn(E, d, inter).to(act)
        moe_experts_silu_triton(x, gate_up, down, w, ids, config=cfg)


def _moe_a8(dt: torch.dtype) -> None:
    """The grouped GEMMs' w8a8 form (A8) over e4m3 experts at a Nemotron 3 Nano 30B-A3B layer, 1,024
    tokens, relu^2 and SiLU-gated: the activation quantisation, then e4m3 x e4m3 products."""
    from hyserve.kernels.triton_moe import moe_experts_silu_triton, moe_experts_triton

    act = dt if dt in (torch.bfloat16, torch.float16) else torch.bfloat16
    E, k, d, inter, T = 128, 6, 2688, 1856, 1024
    ids = (torch.arange(T * k, dtype=torch.int32) % E).view(T, k)
    x, w = torch.randn(T, d).to(act), torch.rand(T, k)
    tiles = dict(BLOCK_N=128, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    cfg = {"variant": "gemm", "BLOCK_M": 64, "A8": 1, "up": tiles, "down": tiles}
    down8 = torch.zeros(E, d, inter, dtype=torch.float8_e4m3fn)
    for gated in (False, True):
        up8 = torch.zeros(E, (1 + gated) * inter, d, dtype=torch.float8_e4m3fn)
        fn = moe_experts_silu_triton if gated else moe_experts_triton
        scales = dict(up_scale=torch.ones(E, (1 + gated) * inter), down_scale=torch.ones(E, d))
        fn(x, up8, down8, w, ids, **scales, config=cfg)


OPS = {
    "attention": _attention,
    "attention_fp8": _attention_fp8,
    "ssd": _ssd,
    "ssm_update": _ssm_update,
    "conv1d": _conv1d,
    "norm": _norm,
    "moe": _moe,
    "sampling": _sampling,
    "fp8": _fp8,
    "moe_fp8": _moe_fp8,
    "moe_forms": _moe_forms,
    "moe_a8": _moe_a8,
}


def main(argv: list[str]) -> None:
    only: set[str] | None = None
    if "--no-pdl" in argv:  # the ordinary launch form (HYSERVE_PDL=0)
        from hyserve.kernels.launch_util import set_pdl

        set_pdl(False)
        argv = [a for a in argv if a != "--no-pdl"]
    sass = "--sass" in argv  # and SASS opcode counts (cuobjdump)
    argv = [a for a in argv if a != "--sass"]
    if "--only" in argv:  # compile just these kernels (the launchers' other launches are skipped)
        i = argv.index("--only")
        only = set(argv[i + 1].split(","))
        argv = argv[:i] + argv[i + 2 :]
    dt = getattr(torch, argv[0])
    ops = argv[1:] or list(OPS)
    shared: dict[str, int] = {}
    mma: dict[str, set[str]] = {}  # kernel -> which of warp-group MMAs / e4m3 operands its PTX holds
    real_run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN202 - Triton's own signature
        name = self.fn.__name__
        if only is not None and name not in only:
            return None
        kernel = real_run(self, *args, grid=grid, warmup=True, **kwargs)
        shared[name] = max(shared.get(name, 0), kernel.metadata.shared)
        ptx = kernel.asm.get("ptx", "")
        mma.setdefault(name, set()).update(k for k in MARKERS if k in ptx)
        if sass:  # which tensor-core instructions the kernel runs (SASS: QGMMA is Hopper's e4m3 one)
            for op, n in sass_counts(kernel.asm["cubin"], ("QGMMA", "HGMMA")).items():
                if n:
                    mma[name].add(op)
        wait = ptx.find("griddepcontrol.wait")
        if wait > 0 and "ld.global" in ptx[:wait]:
            mma[name].add("ld.global before the wait")
        return kernel

    driver.set_active(_Sm90())
    JITFunction.run = compile_only  # type: ignore[method-assign]
    _gpu_settings()
    for op in ops:
        OPS[op](dt)
    print(json.dumps({"dtype": argv[0], "kernels": shared, "ptx": {k: sorted(v) for k, v in mma.items()}}))


if __name__ == "__main__":
    main(sys.argv[1:])
