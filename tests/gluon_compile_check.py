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
    cfg, result = ga._PREFILL_SM90, {}
    for D, bs in ((128, 64), (64, 16)):
        box = min(bs, cfg["BLOCK_N"])
        pool = torch.zeros(4, bs, 2, D, dtype=torch.bfloat16)
        desc = ga._pool_descriptor(pool, box)
        idx = torch.zeros(2, dtype=torch.int32)
        ptrs = dict(q_ptr=pool, kc_ptr=pool, vc_ptr=pool, kd=desc, vd=desc, bt_ptr=idx, lens_ptr=idx, cu_ptr=idx,
                    out_ptr=pool)
        kernel = ga._prefill_kernel_sm90
        const = dict(BS=bs, REP=5, HEAD_DIM=D, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BOX=box,
                     STAGES=cfg["STAGES"], num_warps=cfg["num_warps"])
        # the signature in parameter order: tensors, descriptors, the float scale, int32 scalars, constants
        sig = {name: mangle_type(ptrs[name]) if name in ptrs else "constexpr" if name in const
               else "fp32" if name == "qk_scale" else "i32" for name in kernel.arg_names}
        src = GluonASTSource(kernel, sig, constexprs=const)
        options = dict(num_warps=cfg["num_warps"], maxnreg=168)  # as the launcher
        k = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = k.asm["ptx"]
        result[f"D{D} bs{bs}"] = dict(shared=k.metadata.shared, wgmma="wgmma.mma_async" in ptx,
                                      tma="cp.async.bulk.tensor" in ptx)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
