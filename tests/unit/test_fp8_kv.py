"""FP8 (float8 e4m3) paged KV cache with per-layer k_scale / v_scale, end to end.

    write: cache = clamp(k / k_scale, -448, 448).to(e4m3)        read: k = cache.float() * k_scale

Reference kernels against float64 math, the Triton kernels against the reference on the same fp8 cache
(under TRITON_INTERPRET=1 without CUDA, at small sizes; compiled on CUDA, plus the Nemotron Nano 9B v2
attention shapes), the model with an fp8 pool against a 16/32-bit pool, and the loader (CPU allowed,
scales from checkpoints, capacity). Where the scales come from (kv_cache_config.kv_scales) and their
start-up calibration: tests/engine/test_kv_calibration.py.

Poisoning as in test_triton_kernels.py: kernel-allocated buffers come back NaN, and pool rows past each
sequence's length are NaN (e4m3 0x7f; the interpreter decodes that byte as 480, which a stray read
still shows as a mismatch).
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.quick import quick_first
from tests.unit import test_triton_kernels as tk

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

from hyserve.kernels.attention import FP8_E4M3_MAX, paged_attention_ref, write_kv_ref  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
FP8 = torch.float8_e4m3fn
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

try:
    import triton  # noqa: F401

    _TRITON = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
except ImportError:  # pragma: no cover - depends on the install
    _TRITON = False
needs_triton = pytest.mark.skipif(
    not _TRITON, reason="needs triton (compiled on CUDA or TRITON_INTERPRET=1 before import)"
)
# the interpreter converts 1-element arrays to loop bounds, which numpy >= 1.25 warns about
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# bf16 in tl.dot is wrong under the interpreter (triton 3.6): bf16 queries run only compiled.
ATTN_DTYPES = [F32, F16, BF16] if CUDA else [F32, F16]
TOL = {F32: dict(rtol=1e-4, atol=1e-4), F16: dict(rtol=2e-3, atol=2e-3), BF16: dict(rtol=1.6e-2, atol=1.6e-2)}


TORCH_SEED = 4321  # conftest seeds torch before each test


@pytest.fixture
def exact_fp8_downcast(monkeypatch):
    """triton 3.6's interpreter rounds float32 -> e4m3 wrongly: a mantissa that rounds up does not carry
    into the exponent (7.93 becomes 4.0) and ties round away from zero. On a GPU the conversion is the
    hardware's round-to-nearest-even, as torch's. Under the interpreter this routes that one conversion
    through torch, so the write kernel can be compared bit for bit; everything else is the interpreter's."""
    if CUDA:
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    real = interpreter._convert_float

    def convert(data, src_ty, dst_ty, rounding_mode):
        if dst_ty == tl.float8e4nv and src_ty == tl.float32:
            x = torch.from_numpy(np.ascontiguousarray(data).view(np.float32).copy())
            return x.to(FP8).view(torch.uint8).numpy()
        return real(data, src_ty, dst_ty, rounding_mode)

    monkeypatch.setattr(interpreter, "_convert_float", convert)


def rnd(*shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def scalar(v: float) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=DEV)


def close(actual, expected, dtype, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (a missed write or a bad read)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# --------------------------------------------------------------------------- reference kernels


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.05, 3.0), (0.37, 0.011)])
def test_ref_write_read_round_trip(k_scale, v_scale):
    """Round trip within e4m3 precision: relative 2^-4 (3 mantissa bits, round to nearest) for normal
    values, absolute 2^-10 * scale in the subnormal range, and saturation at +-448 * scale."""
    T, Hkv, D, bs, nb = 40, 2, 16, 8, 12
    ks, vs = scalar(k_scale), scalar(v_scale)
    k = rnd(T, Hkv, D, scale=60 * k_scale)  # some values past 448 * scale, many subnormal ones
    v = rnd(T, Hkv, D, scale=60 * v_scale)
    k[0, 0, :4] = torch.tensor([500.0, -1000.0, 448.0, 1e-6]) * k_scale
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[3] = -1  # skipped
    k_cache = torch.full((nb, bs, Hkv, D), float("nan"), device=DEV).to(FP8)
    v_cache = k_cache.clone()
    before = k_cache.clone()
    write_kv_ref(k, v, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        keep = slots >= 0
        got = cache.view(-1, Hkv, D)[slots[keep]].float() * s
        want = x[keep].float().clamp(-FP8_E4M3_MAX * s, FP8_E4M3_MAX * s)
        err = (got - want).abs()
        bound = torch.maximum(want.abs() * 2.0**-4, torch.full_like(want, 2.0**-10 * s))
        assert torch.isfinite(got).all()
        assert (err <= bound * (1 + 1e-6)).all(), (err / bound).max()
    assert k_cache.view(-1, Hkv, D)[slots[0], 0, :2].float().tolist() == [448.0, -448.0]  # saturated
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    untouched[slots[slots >= 0]] = False
    assert same_bytes(k_cache.view(-1, Hkv, D)[untouched], before.view(-1, Hkv, D)[untouched])


def test_ref_unscaled_fp8_write_saturates_and_16bit_unchanged():
    k = torch.tensor([[[1000.0, -3.3, 0.1]]], device=DEV)
    c = torch.zeros(1, 2, 1, 3, dtype=FP8, device=DEV)
    write_kv_ref(k, k, c, c.clone(), torch.tensor([1], device=DEV))
    assert c[0, 1, 0].float().tolist() == [448.0, -3.25, 0.1015625]
    b = torch.zeros(1, 2, 1, 3, dtype=BF16, device=DEV)
    write_kv_ref(k, k, b, b.clone(), torch.tensor([0], device=DEV))
    assert torch.equal(b[0, 0], k[0].to(BF16))


def _dense_attention_f64(q, k_deq, v_deq, tables, lens, cu, bs, scale):
    """Independent float64 oracle on dequantised caches: gather through the block table, causal mask."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    rep = q.shape[1] // k_deq.shape[2]
    for s in range(len(lens)):
        n, L = cu[s + 1] - cu[s], lens[s]
        if n == 0:
            continue
        rows = [int(tables[s, t // bs]) * bs + t % bs for t in range(L)]
        k = k_deq.reshape(-1, *k_deq.shape[2:])[rows].repeat_interleave(rep, dim=1)  # [L, Hq, D]
        v = v_deq.reshape(-1, *v_deq.shape[2:])[rows].repeat_interleave(rep, dim=1)
        for j in range(n):
            pos = L - n + j
            sc = torch.einsum("hd,lhd->hl", q[cu[s] + j].double(), k[: pos + 1]) * scale
            out[cu[s] + j] = torch.einsum("hl,lhd->hd", torch.softmax(sc, dim=-1), v[: pos + 1])
    return out


def _fp8_pool(lens, new, Hkv, D, bs, k_scale, v_scale, in_dtype=F32):
    """Shuffled blocks, NaN rows past each length, cached context quantised with the scales.
    Returns caches, block tables, the step's new K/V (+2 pad tokens), slot mapping and cu_q."""
    S = len(lens)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    per_seq = [(L + bs - 1) // bs for L in lens]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, device=DEV)
    tables = torch.zeros(S + 1, max(per_seq) + 1, dtype=torch.int32, device=DEV)
    k_cache = torch.full((num_blocks, bs, Hkv, D), float("nan"), device=DEV).to(FP8)
    v_cache = k_cache.clone()
    used = 0
    ctx_slots, slots = [], []
    for s, L in enumerate(lens):
        blocks = order[used : used + per_seq[s]]
        used += per_seq[s]
        tables[s, : per_seq[s]] = blocks.int()
        pos = torch.arange(L, device=DEV)
        seq_slots = blocks[pos // bs] * bs + pos % bs  # [L]
        ctx_slots.append(seq_slots[: L - new[s]])
        slots.append(seq_slots[L - new[s] :])
    ks, vs = scalar(k_scale), scalar(v_scale)
    ctx = torch.cat(ctx_slots)
    if len(ctx):
        write_kv_ref(
            rnd(len(ctx), Hkv, D), rnd(len(ctx), Hkv, D), k_cache, v_cache, ctx, k_scale=ks, v_scale=vs
        )
    slot_mapping = torch.cat([*slots, torch.full((2,), -1, device=DEV)]).long()  # + 2 pad tokens
    # unit-scale K/V (as the tolerances assume); the scales decide which e4m3 codes they land on
    k = rnd(len(slot_mapping), Hkv, D, dtype=in_dtype)
    v = rnd(len(slot_mapping), Hkv, D, dtype=in_dtype)
    k[0, 0, 0] = min(600 * k_scale, 30.0)  # saturates for k_scale < 0.067
    return k_cache, v_cache, tables, k, v, slot_mapping, cu, ks, vs


@pytest.mark.parametrize("new,lens", [([1, 1, 1], [5, 17, 40]), ([9, 1, 6], [9, 30, 20])])
def test_ref_attention_on_fp8_cache_matches_float64(new, lens):
    Hq, Hkv, D, bs, scale = 6, 2, 16, 8, 0.3
    k_cache, v_cache, tables, k, v, slots, cu, ks, vs = _fp8_pool(lens, new, Hkv, D, bs, 0.04, 2.5)
    write_kv_ref(k, v, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)
    q = rnd(cu[-1], Hq, D)
    out = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, scale, k_scale=ks, v_scale=vs)
    oracle = _dense_attention_f64(
        q, k_cache.double() * 0.04, v_cache.double() * 2.5, tables, lens, cu, bs, scale
    )
    assert out.dtype == F32 and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), oracle, rtol=1e-5, atol=1e-5)
    # the scales are really applied: reading the raw codes gives something else
    raw = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, scale)
    assert (raw - out).abs().max() > 0.1


def test_scale_arguments_are_checked():
    k = rnd(2, 1, 4)
    c = torch.zeros(1, 4, 1, 4, dtype=FP8, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="both or neither"):
        write_kv_ref(k, k, c, c.clone(), slots, k_scale=scalar(1.0))
    with pytest.raises(ValueError, match="v_scale"):
        write_kv_ref(k, k, c, c.clone(), slots, k_scale=scalar(1.0), v_scale=torch.ones(2, device=DEV))
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_ref(
            k,
            c,
            c,
            torch.zeros(1, 1, dtype=torch.int32),
            [2],
            [0, 2],
            1.0,
            k_scale=torch.tensor(1, device=DEV),
            v_scale=scalar(1.0),
        )


# --------------------------------------------------------------------------- Triton kernels


def _triton_case(
    poison, *, new, lens, Hq, Hkv, D, bs, dtype, k_scale, v_scale, tensors=False, cuda_op=False, q_ref=None
):
    """cuda_op: attention through the CUDA op (`cuda_attention`: on Hopper the Gluon prefill where it fits);
    otherwise the Triton kernels alone. q_ref: the values the reference takes for q (default q itself)."""
    from hyserve.kernels.triton_attention import paged_attention_triton, write_kv_triton

    k_cache, v_cache, tables, k, v, slots, cu, ks, vs = _fp8_pool(
        lens, new, Hkv, D, bs, k_scale, v_scale, dtype
    )
    kr, vr = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, kr, vr, slots, k_scale=ks, v_scale=vs)
    with poison:
        write_kv_triton(k, v, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)
    assert same_bytes(k_cache, kr), "write_kv: K cache differs"
    assert same_bytes(v_cache, vr), "write_kv: V cache differs"

    q = rnd(cu[-1], Hq, D, dtype=dtype)
    scale = D**-0.5
    if q_ref is None:
        ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, scale, k_scale=ks, v_scale=vs)
    else:  # in float64, rounded to the output's dtype once
        ref = paged_attention_ref(
            q_ref(q).double(), k_cache, v_cache, tables, lens, cu, scale, k_scale=ks, v_scale=vs
        ).to(dtype)
    args = (
        (torch.tensor(lens, dtype=torch.int32, device=DEV), torch.tensor(cu, dtype=torch.int32, device=DEV))
        if tensors
        else (lens, cu)
    )
    if cuda_op:
        from hyserve.kernels.cuda_attention import paged_attention_cuda as attention
    else:
        attention = paged_attention_triton
    with poison:
        out = attention(q, k_cache, v_cache, tables, *args, scale, k_scale=ks, v_scale=vs)
    close(out, ref, dtype, f"fp8 paged_attention new={new} lens={lens}")


FP8_SMALL = [
    ([1, 1, 1, 1], [5, 17, 40, 33]),  # decode only, lengths not multiples of the block size
    ([1, 1], [300, 1000]),  # decode over several KV splits
    ([37], [37]),  # prefill longer than a q block, no context
    ([12, 20], [60, 20]),  # extend over cached context + a fresh prefill
    ([1, 20, 7], [9, 20, 30]),  # mixed: decode + prefill + extend
    ([1, 1, 0, 33, 1], [9, 20, 4, 50, 7]),  # 0-token sequence, 1-token extend after prefills
]


@needs_triton
# bf16 queries over an fp8 cache run float16 products (triton_attention._f16_queries), which the interpreter
# executes too (its bf16 dots are what keeps BF16 out of ATTN_DTYPES without CUDA)
@pytest.mark.parametrize("dtype", quick_first([F32, F16, BF16]))
@pytest.mark.parametrize("new,lens", FP8_SMALL)
def test_triton_fp8_small(poison, exact_fp8_downcast, dtype, new, lens):
    _triton_case(poison, new=new, lens=lens, Hq=6, Hkv=2, D=32, bs=8, dtype=dtype, k_scale=0.05, v_scale=3.0)


@pytest.mark.slow
@needs_triton
def test_triton_fp8_small_decode_tensors_other_scales(poison, exact_fp8_downcast):
    """Pure decode with device seq_lens / cu_q (the graph-capturable path), MHA, odd head dim."""
    _triton_case(
        poison,
        new=[1, 1, 1],
        lens=[4, 9, 70],
        Hq=3,
        Hkv=3,
        D=24,
        bs=16,
        dtype=F32,
        k_scale=7.5,
        v_scale=0.002,
        tensors=True,
    )


@needs_triton
def test_triton_fp8_unscaled_cache_matches_reference(poison, exact_fp8_downcast):
    """An fp8 pool without scales (scale 1): clamped writes, plain upcast reads."""
    from hyserve.kernels.triton_attention import paged_attention_triton, write_kv_triton

    k_cache, v_cache, tables, k, v, slots, cu, _, _ = _fp8_pool([30, 8], [1, 8], 2, 16, 4, 1.0, 1.0, F16)
    kr, vr = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, kr, vr, slots)
    with poison:
        write_kv_triton(k, v, k_cache, v_cache, slots)
    assert same_bytes(k_cache, kr) and same_bytes(v_cache, vr)
    q = rnd(cu[-1], 4, 16, dtype=F16)
    with poison:
        out = paged_attention_triton(q, k_cache, v_cache, tables, [30, 8], cu, 0.25)
    close(out, paged_attention_ref(q, k_cache, v_cache, tables, [30, 8], cu, 0.25), F16, "unscaled fp8")


ATTN_NANO = tk.ATTN_NANO  # the bf16 kernel tests' Nano 9B v2 step mixes


@gpu
@needs_cuda
@pytest.mark.parametrize("new,lens", ATTN_NANO)
def test_triton_fp8_nano9b(poison, new, lens):
    _triton_case(
        poison, new=new, lens=lens, Hq=40, Hkv=8, D=128, bs=64, dtype=BF16, k_scale=0.03, v_scale=0.02
    )


GLUON_FP8_CASES = [  # (new, lens, Hq, Hkv, D, bs, dtype)
    ([4096], [4096], 40, 8, 128, 64, BF16),
    ([1, 1, 3000, 517, 129, 1], [77, 12000, 3000, 1517, 129, 2], 40, 8, 128, 64, BF16),
    ([300, 1, 1000, 77], [5000, 9, 1000, 333], 40, 8, 128, 16, BF16),  # 16-token blocks: 8 boxes per tile
    ([2000, 129], [2600, 129], 8, 8, 128, 256, F16),  # 256-token blocks: one 128-row box per tile
    ([1500, 40], [1500, 2100], 16, 2, 64, 64, BF16),  # head dim 64
    (
        [100, 3, 333],
        [100, 40, 700],
        32,
        2,
        128,
        32,
        BF16,
    ),  # 32-token blocks; 16 q heads per KV head (30B-A3B)
    ([2048], [20000], 40, 8, 128, 64, BF16),  # one chunk of a long prompt over 18k cached tokens
]


@gpu
@needs_cuda
@pytest.mark.parametrize("new,lens,Hq,Hkv,D,bs,dtype", GLUON_FP8_CASES)
def test_gluon_fp8_prefill_matches_reference(poison, monkeypatch, new, lens, Hq, Hkv, D, bs, dtype):
    """On Hopper an fp8 cache's prefill/extend runs the Gluon kernel's converter form (8-bit staging ring,
    float16 products, scales folded in): against the reference over NaN-filled pools with shuffled blocks,
    decodes in the same step, 1 to 8 boxes per key tile, head dims 64 and 128, bf16 and float16 queries;
    and it, not the Triton kernel, ran."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper")
    ga = tk._gluon_or_skip()
    calls: list[tuple[int, int]] = []
    real = ga.prefill_attention_sm90
    monkeypatch.setattr(
        ga,
        "prefill_attention_sm90",
        lambda *a, **kw: calls.append((kw["box"], kw["STAGES8"])) or real(*a, **kw),
    )
    _triton_case(
        poison,
        new=new,
        lens=lens,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        bs=bs,
        dtype=dtype,
        k_scale=0.03,
        v_scale=0.02,
        cuda_op=True,
    )
    assert calls == [(min(bs, 128), ga._PREFILL_SM90_FP8["STAGES8"])]


@gpu
@needs_cuda
@pytest.mark.parametrize("settings", [dict(CONVERT_ROWS=16), dict(CONVERT_ROWS=8), dict(STAGES8=1)])
@pytest.mark.parametrize("case", [GLUON_FP8_CASES[1], GLUON_FP8_CASES[2]])
def test_gluon_fp8_prefill_alternative_settings(poison, monkeypatch, settings, case):
    """The converter form's settings `bench_kernels.py --only attn_sweep` times beside the default (16 or 8
    rows upcast at a time) are correct too, and so is a single staging slot (each refill waits for its
    conversion)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper")
    ga = tk._gluon_or_skip()
    monkeypatch.setattr(ga, "_PREFILL_SM90_FP8", {**ga._PREFILL_SM90_FP8, **settings})
    new, lens, Hq, Hkv, D, bs, dtype = case
    _triton_case(
        poison,
        new=new,
        lens=lens,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        bs=bs,
        dtype=dtype,
        k_scale=0.05,
        v_scale=3.0,
        cuda_op=True,
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("case", GLUON_FP8_CASES)
def test_gluon_fp8_prefill_qk8_form_matches_its_reference(poison, monkeypatch, case):
    """The QK8 form (e4m3 products for S over the cache's own K tiles, queries quantised per row): its prefill
    rows against the float64 attention of the per-row e4m3 queries (`e4m3_query_rows_ref`) over the same
    cache, the step's decode rows against the exact queries, every shape of the converter form's test; and
    it ran."""
    from hyserve.kernels.attention import e4m3_query_rows_ref

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper")
    ga = tk._gluon_or_skip()
    monkeypatch.setattr(ga, "_PREFILL_SM90_FP8", dict(ga._PREFILL_SM90_QK8))
    calls: list[bool] = []
    real = ga.prefill_attention_sm90
    monkeypatch.setattr(
        ga, "prefill_attention_sm90", lambda *a, **kw: calls.append(kw["QK8"]) or real(*a, **kw)
    )
    new, lens, Hq, Hkv, D, bs, dtype = case
    # the step's leading one-token sequences are decodes (the Gluon decode kernel, exact queries): only the
    # prefill rows after them take the e4m3 queries
    nd = next((i for i, m in enumerate(new) if m != 1), len(new))
    start = sum(new[:nd])

    def q_ref(q: torch.Tensor) -> torch.Tensor:
        out = q.double()
        out[start:] = e4m3_query_rows_ref(q[start:]).double()
        return out

    _triton_case(
        poison,
        new=new,
        lens=lens,
        Hq=Hq,
        Hkv=Hkv,
        D=D,
        bs=bs,
        dtype=dtype,
        k_scale=0.03,
        v_scale=0.02,
        cuda_op=True,
        q_ref=q_ref,
    )
    assert calls == [True]


def test_e4m3_query_rows_ref_quantises_each_row_by_its_own_amax():
    """The QK8 form's query contract: per row, scale = amax / 448, the largest element lands on +-448 exactly,
    every value within half an e4m3 ulp (2^-4 relative, or 2^-10 x scale below the normals), zero rows stay
    zero."""
    from hyserve.kernels.attention import e4m3_query_rows_ref

    g = torch.Generator().manual_seed(5)
    q = (
        torch.randn(7, 3, 64, generator=g, dtype=torch.float64)
        * torch.logspace(-3, 3, 7, dtype=torch.float64)[:, None, None]
    )
    q[2, 1] = 0
    got = e4m3_query_rows_ref(q.to(torch.bfloat16))
    qf = q.to(torch.bfloat16).double()
    scale = qf.abs().amax(-1, keepdim=True) / 448
    assert torch.equal(got[2, 1], torch.zeros(64))
    live = scale.squeeze(-1) > 0
    top = qf.abs().argmax(-1, keepdim=True)
    assert torch.allclose(got.double().gather(-1, top).abs()[live], (scale * 448)[live], rtol=1e-6)
    bound = torch.maximum(qf.abs() * 2.0**-4, scale * 2.0**-10) * (1 + 1e-6)
    assert ((got.double() - qf).abs() <= bound).all()


GLUON_DECODE_CASES = [  # (new, lens, Hq, Hkv, D, bs, dtype, scaled)
    ([1] * 6, [77, 12000, 3000, 1517, 129, 2], 40, 8, 128, 64, BF16, True),  # Nano 9B v2 shapes
    ([1] * 6, [5, 17, 40, 33, 300, 1000], 40, 8, 128, 16, BF16, True),  # 16-token blocks, short tails
    ([1], [131072], 40, 8, 128, 64, BF16, True),  # one long context: all 198 splits full
    ([1] * 3, [30, 500, 2049], 8, 8, 128, 32, F16, True),  # MHA (one q head per kv head), float16 queries
    ([1] * 4, [100, 40, 700, 3000], 32, 2, 64, 64, BF16, True),  # head dim 64, 16 q heads per kv head
    ([1] * 2, [7, 300], 8, 2, 32, 16, F16, False),  # head dim 32, an fp8 cache without scales
    ([1, 1, 3000, 517], [77, 12000, 3000, 1517], 40, 8, 128, 64, BF16, True),  # decodes + prefills in a step
]


def _gluon_decode_calls(monkeypatch) -> list[int]:
    """Counts the decode parts `cuda_attention` hands the Gluon fp8 decode kernel and it takes."""
    import hyserve.kernels.cuda_attention as ca

    if ca._DECODE is None:
        pytest.skip("this triton has no Gluon")
    calls: list[int] = []
    real = ca._DECODE

    def counted(*a, **kw):
        got = real(*a, **kw)
        if got is not None:
            calls.append(got[0].shape[0])  # its split count
        return got

    monkeypatch.setattr(ca, "_DECODE", counted)
    return calls


@gpu
@needs_cuda
@pytest.mark.parametrize("new,lens,Hq,Hkv,D,bs,dtype,scaled", GLUON_DECODE_CASES)
def test_gluon_fp8_decode_matches_float64(poison, monkeypatch, new, lens, Hq, Hkv, D, bs, dtype, scaled):
    """The one-warp MMA decode kernel (gluon_decode.py) takes every decode part over an e4m3 cache: against a
    float64 oracle on the dequantised cache (NaN-filled pools, shuffled blocks), block sizes 16..64, head
    dims 32..128, 1..16 q heads per kv head, splits from full to mostly empty, scaled and unscaled caches."""
    from hyserve.kernels.cuda_attention import paged_attention_cuda

    calls = _gluon_decode_calls(monkeypatch)
    k_scale, v_scale = (0.03, 0.02) if scaled else (1.0, 1.0)
    k_cache, v_cache, tables, k, v, slots, cu, ks, vs = _fp8_pool(
        lens, new, Hkv, D, bs, k_scale, v_scale, dtype
    )
    write_kv_ref(k, v, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)
    q = rnd(cu[-1], Hq, D, dtype=dtype)
    scale = D**-0.5
    kw = dict(k_scale=ks, v_scale=vs) if scaled else {}
    with poison:
        out = paged_attention_cuda(q, k_cache, v_cache, tables, lens, cu, scale, **kw)
    oracle = _dense_attention_f64(
        q, k_cache.double() * k_scale, v_cache.double() * v_scale, tables, lens, cu, bs, scale
    )
    close(out, oracle.to(dtype), dtype, f"gluon fp8 decode lens={lens}")
    assert len(calls) == 1


@gpu
@needs_cuda
@pytest.mark.parametrize("settings", [dict(PREFETCH=False), dict(SUB=32), dict(SUB=32, PREFETCH=False)])
def test_gluon_fp8_decode_alternative_settings(poison, monkeypatch, settings):
    """The settings `bench_kernels.py --only attn_sweep` times beside the default are correct too."""
    import hyserve.kernels.gluon_decode as gd

    calls = _gluon_decode_calls(monkeypatch)
    monkeypatch.setattr(gd, "_DECODE_FP8", {**gd._DECODE_FP8, **settings})
    _triton_case(
        poison,
        new=[1] * 5,
        lens=[33, 700, 4097, 12000, 1],
        Hq=40,
        Hkv=8,
        D=128,
        bs=64,
        dtype=BF16,
        k_scale=0.05,
        v_scale=3.0,
        cuda_op=True,
    )
    assert len(calls) == 1


def test_gluon_fp8_decode_shape_rule():
    """Which decode steps the Gluon fp8 kernel takes, device aside (CPU tensors): e4m3 K and V, 16-bit
    queries, head dims 32 / 64 / 128, at most 16 q heads per kv head, rows on 4-byte words."""
    gd = pytest.importorskip("hyserve.kernels.gluon_decode", reason="this triton has no Gluon")
    c = torch.zeros(4, 16, 2, 128, dtype=FP8)
    q = torch.zeros(2, 8, 128, dtype=BF16)
    assert gd.decode_fp8_shape_fits(q, c, c) and gd.decode_fp8_shape_fits(q.half(), c, c)
    assert not gd.decode_fp8_fits(q, c, c)  # not on a GPU
    assert not gd.decode_fp8_shape_fits(q.float(), c, c)
    assert not gd.decode_fp8_shape_fits(q, c.to(BF16), c.to(BF16))
    assert not gd.decode_fp8_shape_fits(q, c, c.to(BF16))
    assert not gd.decode_fp8_shape_fits(torch.zeros(2, 40, 128, dtype=BF16), c, c)  # 20 q heads per kv head
    assert gd.decode_fp8_shape_fits(torch.zeros(2, 32, 128, dtype=BF16), c, c)  # 16
    c256 = torch.zeros(4, 16, 2, 256, dtype=FP8)
    assert not gd.decode_fp8_shape_fits(torch.zeros(2, 8, 256, dtype=BF16), c256, c256)
    for D in (32, 64):
        cd = torch.zeros(4, 16, 2, D, dtype=FP8)
        assert gd.decode_fp8_shape_fits(torch.zeros(2, 8, D, dtype=BF16), cd, cd)
    wide = torch.zeros(4, 16, 2, 130, dtype=FP8)[..., 1:129]  # rows at odd byte offsets
    assert not gd.decode_fp8_shape_fits(q, wide, wide)


@gpu
@needs_cuda
def test_gluon_fp8_decode_declines_what_it_cannot_take(poison, monkeypatch):
    """Head dim 256, more than 16 q heads per kv head, float32 queries, a 16-bit cache, cache rows off 4-byte
    words: `decode_fp8` launches nothing and the Triton kernel serves the step, correctly."""
    import hyserve.kernels.gluon_decode as gd
    from hyserve.kernels.cuda_attention import paged_attention_cuda

    calls = _gluon_decode_calls(monkeypatch)
    lens, cu = [40, 900], [0, 1, 2]
    for Hq, Hkv, D, dtype in ((8, 2, 256, BF16), (40, 2, 128, BF16), (8, 2, 128, F32)):
        k_cache, v_cache, tables, k, v, slots, cu, ks, vs = _fp8_pool(
            lens, [1, 1], Hkv, D, 16, 0.03, 0.02, dtype
        )
        write_kv_ref(k, v, k_cache, v_cache, slots, k_scale=ks, v_scale=vs)
        q = rnd(2, Hq, D, dtype=dtype)
        assert not gd.decode_fp8_fits(q, k_cache, v_cache)
        with poison:
            out = paged_attention_cuda(q, k_cache, v_cache, tables, lens, cu, D**-0.5, k_scale=ks, v_scale=vs)
        ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, D**-0.5, k_scale=ks, v_scale=vs)
        close(out, ref, dtype, f"declined Hq={Hq} Hkv={Hkv} D={D} {dtype}")
    q = rnd(2, 8, 128, dtype=BF16)
    c16 = rnd(4, 16, 2, 128, dtype=BF16)
    assert not gd.decode_fp8_fits(q, c16, c16)
    wide = torch.zeros(4, 16, 2, 130, dtype=FP8, device=DEV)[..., 1:129]  # rows at odd byte offsets
    assert not gd.decode_fp8_fits(q, wide, wide)
    assert calls == []


@gpu
@needs_cuda
@pytest.mark.parametrize("op", ["triton", "cuda"])
def test_triton_fp8_decode_graph_reads_scales_from_device(op):
    """Captured decode with scales: replaying after new q and new scale values gives the attention with
    the new values (the scales are device reads, not constants baked into the graph). op: the Triton
    kernel alone, or the CUDA op (on Hopper, gluon_decode's kernel)."""
    if op == "cuda":
        from hyserve.kernels.cuda_attention import paged_attention_cuda as paged_attention_triton
    else:
        from hyserve.kernels.triton_attention import paged_attention_triton

    S, Hq, Hkv, D, bs, width = 4, 40, 8, 128, 16, 64
    k_cache = rnd(S * width, bs, Hkv, D, scale=4).to(FP8)
    v_cache = rnd(S * width, bs, Hkv, D, scale=4).to(FP8)
    tables = torch.arange(S * width, device=DEV, dtype=torch.int32).view(S, width)
    lens = torch.tensor([5, 300, 1000, 17], dtype=torch.int32, device=DEV)
    cu = torch.arange(S + 1, dtype=torch.int32, device=DEV)
    q = rnd(S, Hq, D, dtype=BF16)
    ks, vs = scalar(0.1), scalar(0.5)
    paged_attention_triton(q, k_cache, v_cache, tables, lens, cu, D**-0.5, k_scale=ks, v_scale=vs)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = paged_attention_triton(q, k_cache, v_cache, tables, lens, cu, D**-0.5, k_scale=ks, v_scale=vs)
    q.copy_(rnd(S, Hq, D, dtype=BF16))
    ks.fill_(0.03)
    vs.fill_(2.0)
    g.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(
        q, k_cache, v_cache, tables, lens.tolist(), cu.tolist(), D**-0.5, k_scale=ks, v_scale=vs
    )
    assert torch.isfinite(out).all()
    # the kernel rounds the probabilities to bf16 before P @ V (flash-attention style): each output may be
    # off by up to 2^-9 of the largest dequantised value (here |v| * 2.0 reaches ~40); a stale scale
    # (0.5 instead of 2.0) would be off by 3/4 of every output
    v_max = float(v_cache.float().abs().max()) * 2.0
    torch.testing.assert_close(
        out.float(),
        ref.float(),
        rtol=1.6e-2,
        atol=v_max * 2**-9,
        msg=lambda m: f"graph replay with new scales: {m}",
    )
    assert (out.float() - ref.float()).abs().mean() < 1e-3 * v_max


# --------------------------------------------------------------------------- model and engine


def _tiny_dir(tmp_path: Path) -> Path:
    from hyserve.model.tiny import make_tiny

    return make_tiny(tmp_path / "tiny", variant="dense")


def _greedy(llm, prompts, n=12):
    from hyserve import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1))


PROMPTS = [[1, 5, 9, 13, 200, 17, 4], [1, 77] * 20, [1, 3]]


def _assert_close_generations(ref, got, max_logprob_diff):
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        diffs = [abs(x.logprob - y.logprob) for x, y in zip(a.logprobs or [], b.logprobs or [])]
        assert diffs and max(diffs) < max_logprob_diff, max(diffs)


def test_tiny_model_fp8_kv_cpu_matches_float32_kv(tmp_path):
    """CPU reference path: the same greedy tokens as a float32 pool, chosen-token logprobs within 5e-3
    (measured ~1e-3: e4m3 keeps 3 mantissa bits of K and V)."""
    from hyserve import LLM

    d = _tiny_dir(tmp_path)
    kw = dict(device="cpu", dtype="float32", max_seq_len=256, log=lambda s: None)
    ref = _greedy(LLM(str(d), **kw), PROMPTS)
    llm = LLM(str(d), kv_cache_config={"dtype": "fp8"}, **kw)
    assert all(t.dtype == FP8 for t in llm.engine.cache_tensors.k.values())
    _assert_close_generations(ref, _greedy(llm, PROMPTS), 5e-3)


@gpu
@needs_cuda
def test_tiny_model_fp8_kv_cuda_matches_bf16_kv(tmp_path):
    """Triton path, bf16 model: fp8 pool vs bf16 pool, same greedy tokens, logprobs within 2e-2."""
    from hyserve import LLM

    d = _tiny_dir(tmp_path)
    kw = dict(device="cuda", dtype="bfloat16", max_seq_len=256, log=lambda s: None)
    ref = _greedy(LLM(str(d), **kw), PROMPTS)
    llm = LLM(str(d), kv_cache_config={"dtype": "fp8"}, **kw)
    assert all(t.dtype == FP8 and t.is_cuda for t in llm.engine.cache_tensors.k.values())
    _assert_close_generations(ref, _greedy(llm, PROMPTS), 2e-2)


def test_fp8_kv_dtype_resolves_on_cpu_and_halves_bytes_per_token():
    from hyserve.engine.runner.model_loader import resolve_kv_dtype
    from hyserve.model.nemotron_h.config import HybridModelConfig
    from hyserve.model.tiny import tiny_config

    assert resolve_kv_dtype("fp8", F32, torch.device("cpu")) == FP8
    cfg = HybridModelConfig.from_dict(tiny_config("dense"))
    bf16 = cfg.with_cache_dtypes(kv_cache_dtype=BF16)
    fp8 = cfg.with_cache_dtypes(kv_cache_dtype=FP8)
    assert fp8.attention_cache_spec().dtype == FP8
    assert (
        2 * fp8.kv_bytes_per_token == bf16.kv_bytes_per_token == 2 * 2 * 2 * 16 * 2
    )  # layers*K+V*heads*dim*2B


def test_capacity_fp8_gives_twice_the_kv_tokens(tmp_path):
    from hyserve import LLM

    d = _tiny_dir(tmp_path)
    plans = {}
    for kv in ("bfloat16", "fp8"):
        llm = LLM(
            str(d),
            device="cpu",
            max_seq_len=256,
            max_batch_size=64,  # the same state slots either way: the KV pool's bytes are what differ
            log=lambda s: None,
            kv_cache_config={"dtype": kv, "max_gpu_total_bytes": 16 << 20},
        )
        plans[kv] = llm.engine.plan
    b, f = plans["bfloat16"], plans["fp8"]
    assert f.inputs.kv_bytes_per_token * 2 == b.inputs.kv_bytes_per_token
    assert 1.95 < f.kv_tokens / b.kv_tokens < 2.05, (f.kv_tokens, b.kv_tokens)
    assert f"{f.kv_tokens:,} tokens" in f.report()


def _checkpoint_with_scales(tmp_path: Path, extra: dict[str, torch.Tensor]) -> Path:
    """The tiny dense model's directory with its weights rewritten by hyserve's save helpers, plus `extra`
    tensors (KV scales) under their checkpoint names."""
    from hyserve.model.nemotron_h.checkpoint import NAMES, random_state_dict
    from hyserve.model.nemotron_h.config import HybridModelConfig
    from hyserve.model.weights import StateDictModule, save_checkpoint

    d = _tiny_dir(tmp_path)
    cfg = HybridModelConfig.from_hf(d)
    sd = random_state_dict(cfg, seed=3)
    sd.update(extra)
    save_checkpoint(StateDictModule(sd), d, names=NAMES)
    return d


def _layer_scales(llm) -> dict[int, tuple[float, float]]:
    model = llm.engine.loaded.model
    return {
        i: (float(model.backbone.layers[i].mixer.k_scale), float(model.backbone.layers[i].mixer.v_scale))
        for i in model.config.attention_layer_ids
    }


def test_kv_scales_load_from_checkpoint_in_common_spellings(tmp_path, caplog):
    from hyserve import LLM

    # tiny dense: attention layers 1 and 5
    d = _checkpoint_with_scales(
        tmp_path,
        {
            "model.layers.1.mixer.k_proj.k_scale": torch.tensor(0.02),  # ModelOpt spelling, model. prefix
            "backbone.layers.1.mixer.v_proj.v_scale": torch.tensor([0.5]),  # shape [1]
            "backbone.layers.5.mixer.kv_scale": torch.tensor(0.25),  # deprecated: one for K and V
            "backbone.layers.5.mixer.q_scale": torch.tensor(0.1),  # ignored
        },
    )
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = LLM(str(d), device="cpu", max_seq_len=128, kv_cache_config={"dtype": "fp8"}, log=lambda s: None)
    assert _layer_scales(llm) == {1: (float(torch.tensor(0.02)), 0.5), 5: (0.25, 0.25)}  # float32 0.02
    assert "from the checkpoint for all 2 attention layers" in caplog.text
    out = _greedy(llm, [[1, 5, 9, 13]], n=4)[0]
    assert len(out.token_ids) == 4 and all(math.isfinite(x.logprob) for x in out.logprobs)

    # the same checkpoint with a 16-bit pool loads too; the scales are there but unused
    bf = LLM(str(d), device="cpu", max_seq_len=128, kv_cache_config={"dtype": "bfloat16"}, log=lambda s: None)
    assert _layer_scales(bf)[5] == (0.25, 0.25)


def test_kv_scales_load_from_compressed_tensors_output_scales(tmp_path):
    """compressed-tensors' (and Quark's) older exports keep the KV scales as the k / v projections'
    output quantiser scales; the q one is ignored like q_scale."""
    from hyserve import LLM

    d = _checkpoint_with_scales(
        tmp_path,
        {
            "model.layers.1.mixer.k_proj.output_scale": torch.tensor([0.5]),
            "model.layers.1.mixer.v_proj.output_scale": torch.tensor([0.25]),
            "model.layers.5.mixer.k_proj.output_scale": torch.tensor(2.0),
            "model.layers.5.mixer.v_proj.output_scale": torch.tensor(4.0),
            "model.layers.5.mixer.q_proj.output_scale": torch.tensor(8.0),
        },
    )
    llm = LLM(
        str(d),
        device="cpu",
        max_seq_len=128,
        kv_cache_config={"dtype": "fp8", "kv_scales": "checkpoint"},
        log=lambda s: None,
    )
    assert _layer_scales(llm) == {1: (0.5, 0.25), 5: (2.0, 4.0)}


def test_kv_scales_vllm_spelling_partial_layers_calibrate_the_rest(tmp_path, caplog):
    """kv_scales auto (the default): the checkpoint's scales where it has them, the other layers calibrated
    at start-up (tests/engine/test_kv_calibration.py); no warning about saturation any more."""
    from hyserve import LLM

    d = _checkpoint_with_scales(
        tmp_path,
        {
            "backbone.layers.5.mixer.k_scale": torch.tensor(0.125),
            "backbone.layers.5.mixer.attn.v_scale": torch.tensor(4.0),
        },
    )
    lines: list[str] = []
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = LLM(str(d), device="cpu", max_seq_len=128, kv_cache_config={"dtype": "fp8"}, log=lines.append)
    got = _layer_scales(llm)
    assert got[5] == (0.125, 4.0) and all(0 < s < 1.0 for s in got[1]), got
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [s for s in lines if "calibrated in 1 of 2 attention layers; the other 1 from the checkpoint" in s]


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"backbone.layers.0.mixer.k_scale": torch.tensor(1.0)}, "layer 0 is not an attention layer"),
        ({"backbone.layers.1.mixer.k_scale": torch.ones(2)}, "per-tensor"),
        ({"backbone.layers.1.mixer.v_scale": torch.tensor(-1.0)}, "positive and finite"),
        (
            {
                "backbone.layers.1.mixer.kv_scale": torch.tensor(1.0),
                "backbone.layers.1.mixer.k_scale": torch.tensor(2.0),
            },
            "k_scale is given more than once",
        ),
    ],
)
def test_bad_kv_scales_are_refused(tmp_path, extra, needle):
    from hyserve import LLM

    d = _checkpoint_with_scales(tmp_path, extra)
    with pytest.raises(ValueError, match=needle):
        LLM(str(d), device="cpu", max_seq_len=128, kv_cache_config={"dtype": "fp8"}, log=lambda s: None)


def test_dummy_weights_with_unit_scales(tmp_path, caplog):
    from hyserve import LLM
    from hyserve.model.tiny import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("dense")))
    with caplog.at_level(logging.INFO, logger="hyserve"):
        llm = LLM(
            str(tmp_path),
            load_format="dummy",
            device="cpu",
            max_seq_len=128,
            kv_cache_config={"dtype": "fp8", "kv_scales": "unit"},
            log=lambda s: None,
        )
    assert _layer_scales(llm) == {1: (1.0, 1.0), 5: (1.0, 1.0)}
    assert caplog.text.count("kv_scales unit, k_scale = v_scale = 1.0 in all 2 attention layers") == 1


@pytest.mark.slow
def test_fp8_attention_kernels_upcast_e4m3_tiles_to_float16_for_bf16_queries():
    """Offline, no GPU needed (tests/sm90_compile_check.py): compiled for sm_90 at the GPU launch settings,
    the decode and prefill kernels over an e4m3 cache with bf16 queries convert the tiles with the paired
    e4m3 -> f16 instruction and no scalar f16 -> bf16 convert per element (e4m3 -> bf16 took both: 906
    converts in the decode kernel's PTX against 256 now), convert V before its shared-memory transpose (no
    single-byte shared loads: the decode kernel had 256), and fit in shared memory."""
    from tests.sm90 import HOPPER_SHARED_BYTES, compile_for_sm90

    kernels = "_prefill_kernel,_decode_kernel"
    doc = compile_for_sm90("bfloat16", "attention_fp8", "--only", kernels)
    assert set(doc["kernels"]) == set(kernels.split(","))
    for name in kernels.split(","):
        assert 0 < doc["kernels"][name] <= HOPPER_SHARED_BYTES, (name, doc["kernels"][name])
        ptx = doc["ptx"][name]
        assert "e4m3" in ptx and "cvt.bf16.f16" not in ptx and "ld.shared.b8" not in ptx, (name, ptx)
