"""Compiles the Gluon prefill attention kernel ahead of time for sm_90 (no GPU needed) and prints, per
(head dim, block size) case, its shared memory and whether the PTX holds warp-group MMAs and TMA copies,
as one JSON line. Run by test_triton_kernels.py in a fresh process: a process where TRITON_INTERPRET=1
was set before triton was imported builds Gluon's library functions as interpreter functions, which the
compiler refuses."""

from __future__ import annotations

import json

import torch
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

import hyserve.kernels.gluon_attention as ga


def main() -> None:
    result = {}
    for D, bs, fp8 in ((128, 64, False), (64, 16, False), (128, 64, True), (64, 16, True)):
        cfg = ga._PREFILL_SM90_FP8 if fp8 else ga._PREFILL_SM90
        box = min(bs, cfg["BLOCK_N"])
        pool = torch.zeros(4, bs, 2, D, dtype=torch.bfloat16)
        cache = pool.to(torch.float8_e4m3fn) if fp8 else pool
        desc = ga._pool_descriptor(cache, box)
        idx = torch.zeros(2, dtype=torch.int32)
        scale = torch.ones(1, dtype=torch.float32)
        ptrs = dict(q_ptr=pool, kc_ptr=cache, vc_ptr=cache, kd=desc, vd=desc, bt_ptr=idx, lens_ptr=idx, cu_ptr=idx,
                    out_ptr=pool, ks_ptr=scale, vs_ptr=scale)
        kernel = ga._prefill_kernel_sm90
        const = dict(BS=bs, REP=5, HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BOX=box,
                     STAGES=cfg["STAGES"], STAGES8=cfg.get("STAGES8", 0), KV_SCALED=fp8, CONVERT_ROWS=cfg.get("CONVERT_ROWS", 32),
                     num_warps=cfg["num_warps"])
        # the signature in parameter order: tensors, descriptors, the float scale, int32 scalars, constants
        sig = {name: mangle_type(ptrs[name]) if name in ptrs else "constexpr" if name in const
               else "fp32" if name == "qk_scale" else "i32" for name in kernel.arg_names}
        src = GluonASTSource(kernel, sig, constexprs=const)
        options = dict(num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])  # as the launcher
        k = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = k.asm["ptx"]
        regs = sorted({int(line.split(".u32")[1].strip(" ;")) for line in ptx.splitlines() if "setmaxnreg" in line})
        result[f"D{D} bs{bs}" + (" fp8" if fp8 else "")] = dict(
            shared=k.metadata.shared, wgmma="wgmma.mma_async" in ptx, tma="cp.async.bulk.tensor" in ptx,
            e4m3_to_f16="cvt.rn.f16x2.e4m3x2" in ptx, setmaxnreg=regs, local="ld.local" in ptx or "st.local" in ptx)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
