"""Compiles the Gluon attention kernels ahead of time for sm_90 (no GPU needed) and prints, as one JSON line:
per prefill (head dim, block size) case, its shared memory and whether the PTX holds warp-group MMAs and TMA
copies; per fp8 decode case (head dim, block size, q heads per kv head), its shared memory, its MMA, e4m3
convert and 16-byte load counts, and the registers and spills ptxas reports. Run by test_triton_kernels.py in
a fresh process: a process where TRITON_INTERPRET=1 was set before triton was imported builds Gluon's library
functions as interpreter functions, which the compiler refuses."""

from __future__ import annotations

import json
import re
import subprocess
import tempfile

import torch
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type

import hyserve.kernels.gluon_attention as ga
import hyserve.kernels.gluon_decode as gd
from tests.sass import sass_counts


def _signature(kernel, ptrs: dict, const: dict) -> dict:
    """The signature in parameter order: tensors, descriptors, the float scale, int32 scalars, constants."""
    return {
        name: mangle_type(ptrs[name])
        if name in ptrs
        else "constexpr"
        if name in const
        else "fp32"
        if name == "qk_scale"
        else "i32"
        for name in kernel.arg_names
    }


def _ptxas(ptx: str) -> dict:
    """Registers and spill bytes of the sm_90a build of `ptx` (ptxas -v, the ptxas triton ships)."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        with open(f"{d}/k.ptx", "w") as f:
            f.write(ptx)
        run = subprocess.run(
            [get_ptxas(90).path, "-arch=sm_90a", "-v", f"{d}/k.ptx", "-o", f"{d}/k.cubin"],
            capture_output=True,
            text=True,
            check=True,
        )
    info = run.stderr + run.stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill", info))
    return dict(regs=regs, spill_bytes=spills)


def decode_cases() -> dict:
    """The fp8 decode kernel as the launcher compiles it (`gd._DECODE_FP8`), integer strides and pointers
    16-divisible as the JIT specialises them (the cache strides and q's are, for the models we serve)."""
    result = {}
    cfg = dict(gd._DECODE_FP8)
    sub, maxnreg = cfg.pop("SUB"), cfg.pop("maxnreg")
    kernel = gd._decode_fp8_kernel
    unspecialised = {"s_bt_s", "s_po_sp", "s_pl_sp", "seq_offset", "num_splits"}
    for D, bs, rep, scaled in (
        (128, 64, 5, True),
        (64, 16, 16, False),
        (128, 16, 1, False),
        (32, 16, 1, True),
    ):
        cache = torch.zeros(4, bs, 2, D, dtype=torch.float8_e4m3fn)
        q = torch.zeros(2, 2 * rep, D, dtype=torch.bfloat16)
        idx = torch.zeros(2, dtype=torch.int32)
        f32 = torch.zeros(1, dtype=torch.float32)
        ptrs = dict(
            q_ptr=q,
            kc_ptr=cache,
            vc_ptr=cache,
            bt_ptr=idx,
            lens_ptr=idx,
            cu_ptr=idx,
            po_ptr=f32,
            plse_ptr=f32,
            ks_ptr=f32,
            vs_ptr=f32,
        )
        const = dict(BS=bs, REP=rep, D=D, SUB=sub, MIN_SPLIT=256, KV_SCALED=scaled, PDL=True, **cfg)
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, name in enumerate(kernel.arg_names)
            if name in ptrs or (name.startswith("s_") and name not in unspecialised)
        }
        src = GluonASTSource(kernel, _signature(kernel, ptrs, const), constexprs=const, attrs=attrs)
        k = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1, maxnreg=maxnreg))
        ptx = k.asm["ptx"]
        result[f"decode D{D} bs{bs} rep{rep}"] = dict(
            shared=k.metadata.shared,
            mma=ptx.count("mma.sync.aligned.m16n8k16"),
            e4m3_to_f16=ptx.count("cvt.rn.f16x2.e4m3x2"),
            ld_v4=ptx.count("ld.global.v4"),
            shared_ops=len(re.findall(r"(ld|st)\.shared|bar\.sync", ptx)),
            gdc_wait="griddepcontrol.wait" in ptx,
            sub=sub,
            **_ptxas(ptx),
        )
    return result


def main() -> None:
    result = decode_cases()
    for D, bs, fp8, qk8 in (
        (128, 64, False, False),
        (64, 16, False, False),
        (128, 64, True, False),
        (64, 16, True, False),
        (128, 64, True, True),
        (64, 16, True, True),
    ):
        cfg = ga._PREFILL_SM90_QK8 if qk8 else ga._PREFILL_SM90_FP8 if fp8 else ga._PREFILL_SM90
        box = min(bs, cfg["BLOCK_N"])
        pool = torch.zeros(4, bs, 2, D, dtype=torch.bfloat16)
        cache = pool.to(torch.float8_e4m3fn) if fp8 else pool
        desc = ga._pool_descriptor(cache, box)
        idx = torch.zeros(2, dtype=torch.int32)
        scale = torch.ones(1, dtype=torch.float32)
        ptrs = dict(
            q_ptr=pool,
            kc_ptr=cache,
            vc_ptr=cache,
            kd=desc,
            vd=desc,
            bt_ptr=idx,
            lens_ptr=idx,
            cu_ptr=idx,
            out_ptr=pool,
            ks_ptr=scale,
            vs_ptr=scale,
        )
        kernel = ga._prefill_kernel_sm90
        const = dict(
            BS=bs,
            REP=5,
            HEAD_DIM=D,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            BOX=box,
            STAGES=cfg["STAGES"],
            STAGES8=cfg.get("STAGES8", 0),
            KV_SCALED=fp8,
            CONVERT_ROWS=cfg.get("CONVERT_ROWS", 32),
            QK8=qk8,
            num_warps=cfg["num_warps"],
        )
        src = GluonASTSource(kernel, _signature(kernel, ptrs, const), constexprs=const)
        options = dict(num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])  # as the launcher
        k = triton_compile(src, target=GPUTarget("cuda", 90, 32), options=options)
        ptx = k.asm["ptx"]
        regs = sorted(
            {int(line.split(".u32")[1].strip(" ;")) for line in ptx.splitlines() if "setmaxnreg" in line}
        )
        result[f"D{D} bs{bs}" + (" fp8" if fp8 else "") + (" qk8" if qk8 else "")] = dict(
            shared=k.metadata.shared,
            wgmma="wgmma.mma_async" in ptx,
            tma="cp.async.bulk.tensor" in ptx,
            e4m3_to_f16="cvt.rn.f16x2.e4m3x2" in ptx,
            setmaxnreg=regs,
            local="ld.local" in ptx or "st.local" in ptx,
            wgmma_e4m3=len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
            to_e4m3="cvt.rn.satfinite.e4m3x2.f32" in ptx,
            cvt_e4m3_lines=len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx)),
            **(sass_counts(k.asm["cubin"], ("QGMMA", "HGMMA")) if fp8 else {}),
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
