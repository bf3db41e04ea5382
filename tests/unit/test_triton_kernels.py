"""Triton kernels vs their plain-torch references (the oracles), on fresh random inputs.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported) at small sizes; with CUDA the same small cases run compiled, and the `gpu` cases add the
Nemotron Nano 9B v2 shapes (Mamba: 128 heads x 80, state 128, 8 groups; attention: 40 q / 8 kv heads,
head_dim 128).

Every output buffer a kernel allocates is poisoned with NaN (torch.empty is patched during the call),
pool slots a kernel is expected to write start as NaN, and KV cache rows past each sequence's length
are NaN, so a missed write or an out-of-range read shows up as a NaN.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hyserve.kernels.host_index import HostIndex
from tests.quick import quick_first
from tests.triton_interpreter import IGNORE_INTERPRETER_WARNING, interpret_without_cuda

interpret_without_cuda()
pytestmark = IGNORE_INTERPRETER_WARNING


from hyserve.kernels.activation import relu2_ref  # noqa: E402
from hyserve.kernels.attention import paged_attention_ref, write_kv_ref  # noqa: E402
from hyserve.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref  # noqa: E402
from hyserve.kernels.cuda_attention import paged_attention_cuda  # noqa: E402
from hyserve.kernels.launch_util import tma_tiles_fit  # noqa: E402
from hyserve.kernels.rmsnorm import add_rms_norm_ref, rms_norm_ref, rmsnorm_gated_ref  # noqa: E402
from hyserve.kernels.ssm_update import selective_state_update_ref  # noqa: E402
from hyserve.kernels.triton_activation import relu2_triton  # noqa: E402
from hyserve.kernels.triton_attention import paged_attention_triton, write_kv_triton  # noqa: E402
from hyserve.kernels.triton_conv1d import (  # noqa: E402
    causal_conv1d_update_triton,
    causal_conv1d_varlen_triton,
)
from hyserve.kernels.triton_rmsnorm import add_rms_norm_triton, rms_norm_triton, rmsnorm_gated_triton  # noqa: E402
from hyserve.kernels.triton_ssm_update import selective_state_update_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# bf16 in tl.dot is wrong under the interpreter (triton 3.6): attention runs bf16 only compiled.
ATTN_DTYPES = [F32, F16, BF16] if CUDA else [F32, F16]
TOL = {F32: dict(rtol=1e-4, atol=1e-4), F16: dict(rtol=2e-3, atol=2e-3), BF16: dict(rtol=1.6e-2, atol=1.6e-2)}


TORCH_SEED = 1234  # conftest seeds torch before each test


def rnd(*shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def close(actual, expected, dtype, what):
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} vs {expected.dtype}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (a missed write or a bad read)"
    torch.testing.assert_close(actual.float(), expected.float(), **TOL[dtype], msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- ssm_update


def _ssm_case(
    poison,
    *,
    Bt,
    H,
    P,
    N,
    G,
    state_dtype,
    x_dtype,
    n_pad=0,
    shared_src=False,
    limit=(0.0, float("inf")),
    use_d=True,
    use_bias=True,
):
    n_real = Bt - n_pad
    slots = 2 * Bt + 3
    pool = rnd(slots, H, P, N, dtype=state_dtype)
    perm = torch.randperm(slots - 1, device=DEV)
    pad_slot = slots - 1
    src = perm[:Bt].clone()
    dst = perm[Bt : 2 * Bt].clone()
    dst[: n_real // 2] = src[: n_real // 2]  # ordinary decode: in place
    if shared_src and n_real - 1 > n_real // 2:
        # copy-on-write: two out-of-place rows read one shared slot (which no row writes)
        src[n_real - 1] = src[n_real // 2]
    src[n_real:] = pad_slot
    dst[n_real:] = pad_slot
    pool[dst[n_real // 2 : n_real]] = float("nan")  # out-of-place destinations must be written
    # inputs are views with row strides, as the model passes them (split of the conv output)
    xbc = rnd(Bt, H * P + 2 * G * N + 5, dtype=x_dtype)
    x = xbc[:, : H * P].view(Bt, H, P)
    B = xbc[:, H * P : H * P + G * N].view(Bt, G, N)
    C = xbc[:, H * P + G * N : H * P + 2 * G * N].view(Bt, G, N)
    dt = rnd(Bt, H + 7, dtype=x_dtype)[:, :H]
    A = -torch.rand(H, device=DEV) * 4 - 0.1
    D = rnd(H, dtype=x_dtype) if use_d else None
    dt_bias = rnd(H, dtype=x_dtype) if use_bias else None
    kw = dict(D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=limit)
    p_ref, p_tri = pool.clone(), pool.clone()
    y_ref = selective_state_update_ref(p_ref, x, dt, A, B, C, src, dst, **kw)
    with poison:
        y_tri = selective_state_update_triton(p_tri, x, dt, A, B, C, src, dst, **kw)
    close(y_tri[:n_real], y_ref[:n_real], x_dtype, "y")
    real_dst = dst[:n_real]
    close(p_tri[real_dst], p_ref[real_dst], state_dtype, "new states")
    # slots nobody writes stay bit-identical (the pad slot is written by every pad row: skip it)
    untouched = torch.ones(slots, dtype=torch.bool, device=DEV)
    untouched[pad_slot] = False
    untouched[real_dst] = False
    assert torch.equal(p_tri[untouched].nan_to_num(7.0), pool[untouched].nan_to_num(7.0))


@pytest.mark.parametrize("state_dtype", quick_first([F32, BF16, F16]))
@pytest.mark.parametrize("Bt,n_pad", [(1, 0), (5, 2)])
def test_ssm_update_small(poison, state_dtype, Bt, n_pad):
    _ssm_case(
        poison,
        Bt=Bt,
        H=4,
        P=12,
        N=16,
        G=2,
        state_dtype=state_dtype,
        x_dtype=F32,
        n_pad=n_pad,
        shared_src=True,
    )


@pytest.mark.parametrize("x_dtype", [F16, BF16])
def test_ssm_update_small_16bit_inputs_limits(poison, x_dtype):
    _ssm_case(poison, Bt=3, H=4, P=8, N=16, G=1, state_dtype=F32, x_dtype=x_dtype, limit=(0.01, 0.5))


def test_ssm_update_small_no_d_no_bias(poison):
    _ssm_case(poison, Bt=3, H=6, P=8, N=8, G=3, state_dtype=F32, x_dtype=F32, use_d=False, use_bias=False)


@gpu
@needs_cuda
@pytest.mark.parametrize("state_dtype", [F32, BF16, F16])
@pytest.mark.parametrize("Bt,n_pad", [(1, 0), (64, 3)])
def test_ssm_update_nano9b(poison, state_dtype, Bt, n_pad):
    _ssm_case(
        poison,
        Bt=Bt,
        H=128,
        P=80,
        N=128,
        G=8,
        state_dtype=state_dtype,
        x_dtype=BF16,
        n_pad=n_pad,
        shared_src=True,
    )


# --------------------------------------------------------------------------- conv1d


def _conv_update_case(
    poison,
    *,
    Bt,
    Dm,
    K,
    dtype,
    pool_dtype,
    n_pad=0,
    bias=True,
    activation="silu",
    wide_pool=False,
    tiled=None,
    tap_major=False,
):
    n_real = Bt - n_pad
    slots = 2 * Bt + 2
    pad_slot = slots - 1
    # wide_pool: the pool is a view whose rows are K + 1 apart (the kernel takes its strides as given), and
    # the two columns past it must stay untouched; tap_major: each tap a contiguous run of channels, as the
    # cache allocates its conv pools (cache_tensors.conv_state_pool)
    width = K - 1 + (2 if wide_pool else 0)
    if tap_major:
        wide = rnd(slots, width, Dm, dtype=pool_dtype).transpose(1, 2)
    else:
        wide = rnd(slots, Dm, width, dtype=pool_dtype)
    pool = wide[:, :, : K - 1]
    perm = torch.randperm(slots - 1, device=DEV)
    src, dst = perm[:Bt].clone(), perm[Bt : 2 * Bt].clone()
    dst[: n_real // 2] = src[: n_real // 2]
    src[n_real:] = pad_slot
    dst[n_real:] = pad_slot
    pool[dst[n_real // 2 : n_real]] = float("nan")
    x = rnd(Bt, Dm + 9, dtype=dtype)[:, :Dm]  # a row-strided view, as after the in_proj split
    w = rnd(Dm, K, dtype=dtype, scale=0.5)
    b = rnd(Dm, dtype=dtype) if bias else None
    wide_tri = wide.clone()
    p_ref, p_tri = pool.clone(), wide_tri[:, :, : K - 1]
    assert p_tri.stride() == pool.stride()
    o_ref = causal_conv1d_update_ref(x, p_ref, w, b, src, dst, activation)
    with poison:
        o_tri = causal_conv1d_update_triton(x, p_tri, w, b, src, dst, activation, tiled=tiled)
    assert torch.equal(wide_tri[:, :, K - 1 :], wide[:, :, K - 1 :])
    close(o_tri[:n_real], o_ref[:n_real], dtype, "out")
    real_dst = dst[:n_real]
    if pool_dtype == dtype:
        assert torch.equal(p_tri[real_dst], p_ref[real_dst]), "conv state is a pure shift: must be exact"
    else:  # x is rounded into the pool's dtype
        close(p_tri[real_dst], p_ref[real_dst], pool_dtype, "conv states")
    untouched = torch.ones(slots, dtype=torch.bool, device=DEV)
    untouched[real_dst] = False
    untouched[pad_slot] = False
    assert torch.equal(p_tri[untouched].nan_to_num(7.0), pool[untouched].nan_to_num(7.0))


def _each_layout(poison, forms=(True, False), **case):
    """`case` over both pool layouts (tap-major, as the cache holds them, and channel-major), in each of the
    kernel forms `forms` (None: the one the pool's layout picks)."""
    for tap_major in (True, False):
        for tiled in forms:
            _conv_update_case(poison, tiled=tiled, tap_major=tap_major, **case)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("Bt,n_pad", [(1, 0), (6, 2)])
def test_conv1d_update_small(poison, dtype, Bt, n_pad):
    _each_layout(poison, (None, True, False), Bt=Bt, Dm=40, K=4, dtype=dtype, pool_dtype=dtype, n_pad=n_pad)


@pytest.mark.parametrize("K", [2, 3, 5])
def test_conv1d_update_small_kernel_sizes_no_bias_no_act(poison, K):
    _each_layout(poison, Bt=3, Dm=24, K=K, dtype=F32, pool_dtype=F32, bias=False, activation=None)


def test_conv1d_update_strided_pool_view(poison):
    _each_layout(poison, Bt=4, Dm=40, K=4, dtype=BF16, pool_dtype=BF16, wide_pool=True)


def test_conv1d_update_pool_dtype_differs(poison):
    _each_layout(poison, (None,), Bt=3, Dm=24, K=4, dtype=F32, pool_dtype=BF16)


def test_the_cache_holds_conv_states_tap_major():
    """What the decode update's column form is picked for: every tap of a slot one contiguous run."""
    from hyserve.model.cache_tensors import conv_state_pool

    pool = conv_state_pool(5, 40, 3, BF16, "cpu")
    assert pool.shape == (5, 40, 3) and pool.stride() == (120, 1, 40)
    assert not pool.any()


@gpu
@needs_cuda
@pytest.mark.parametrize("Bt,n_pad,Dm", [(1, 0, 12288), (64, 3, 12288), (1024, 5, 6144)])
def test_conv1d_update_real_widths(poison, Bt, n_pad, Dm):
    """Nano 9B v2's width at batch 1 and 64, Nano 30B-A3B's at batch 1,024; both pool layouts, both forms."""
    _each_layout(poison, Bt=Bt, Dm=Dm, K=4, dtype=BF16, pool_dtype=BF16, n_pad=n_pad)


def _conv_varlen_case(poison, *, lens, Dm, K, dtype, with_init, bias=True):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T, S = cu[-1], len(lens)
    x = rnd(T, Dm + 3, dtype=dtype)[:, :Dm]
    w = rnd(Dm, K, dtype=dtype, scale=0.5)
    b = rnd(Dm, dtype=dtype) if bias else None
    init = rnd(S, Dm, K - 1, dtype=dtype) if with_init else None
    o_ref, f_ref = causal_conv1d_varlen_ref(x, w, b, cu, init)
    with poison:
        o_tri, f_tri = causal_conv1d_varlen_triton(x, w, b, cu, init)
    close(o_tri, o_ref, dtype, "out")
    assert torch.equal(f_tri, f_ref), "final conv states are copies: must be exact"


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("with_init", [False, True])
@pytest.mark.parametrize("lens", [[7], [1, 2, 45, 1, 33]])
def test_conv1d_varlen_small(poison, dtype, with_init, lens):
    _conv_varlen_case(poison, lens=lens, Dm=20, K=4, dtype=dtype, with_init=with_init)


def test_conv1d_varlen_small_empty_sequence(poison):
    _conv_varlen_case(poison, lens=[3, 0, 5], Dm=8, K=4, dtype=F32, with_init=True)


@gpu
@needs_cuda
@pytest.mark.parametrize("lens", [[8192], [1, 1, 3000, 517, 129, 1]])
def test_conv1d_varlen_nano9b(poison, lens):
    _conv_varlen_case(poison, lens=lens, Dm=12288, K=4, dtype=BF16, with_init=True)


# --------------------------------------------------------------------------- rmsnorm


@pytest.mark.parametrize("dtype,wdtype", [(F32, F32), (F16, F16), (BF16, BF16), (BF16, F32)])
@pytest.mark.parametrize("rows", [1, 7])
def test_rmsnorm_gated_small(poison, dtype, wdtype, rows):
    D, g = 48, 12
    x = rnd(rows, D, dtype=dtype)
    z = rnd(rows, 2 * D + 1, dtype=dtype)[:, 1 : D + 1]
    w = rnd(D, dtype=wdtype)
    for zz, gs in ((z, g), (None, D), (z, D)):
        ref = rmsnorm_gated_ref(x, zz, w, 1e-5, gs)
        with poison:
            out = rmsnorm_gated_triton(x, zz, w, 1e-5, gs)
        close(out, ref, dtype, f"rmsnorm_gated z={zz is not None} group={gs}")


def test_rmsnorm_gated_small_3d_and_bad_group(poison):
    x, z, w = rnd(2, 3, 20), rnd(2, 3, 20), rnd(20)
    with poison:
        out = rmsnorm_gated_triton(x, z, w, 1e-6, 5)
    close(out, rmsnorm_gated_ref(x, z, w, 1e-6, 5), F32, "3d")
    zs = rnd(2, 3, 40)[..., ::2]  # a gate the launcher copies into rows (read after the PDL wait)
    with poison:
        out = rmsnorm_gated_triton(x, zs, w, 1e-6, 5)
    close(out, rmsnorm_gated_ref(x, zs, w, 1e-6, 5), F32, "3d, copied gate")
    with pytest.raises(ValueError):
        rmsnorm_gated_triton(x, z, w, 1e-6, 6)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("shape", [(1, 40), (5, 3, 33)])
def test_rms_norm_small(poison, dtype, shape):
    x, w = rnd(*shape, dtype=dtype), rnd(shape[-1], dtype=dtype)
    with poison:
        out = rms_norm_triton(x, w, 1e-5)
    close(out, rms_norm_ref(x, w, 1e-5), dtype, "rms_norm")


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("shape", [(1, 40), (5, 3, 33)])
@pytest.mark.parametrize("copied", [False, True])
def test_add_rms_norm_small(poison, dtype, shape, copied):
    """copied: a residual with a non-unit last stride, which the launcher copies into rows (then read after
    the PDL wait: the copy is the kernel just before)."""
    x, w = rnd(*shape, dtype=dtype), rnd(shape[-1], dtype=dtype)
    r = (
        rnd(*shape[:-1], 2 * shape[-1], dtype=dtype, scale=4.0)[..., ::2]
        if copied
        else rnd(*shape, dtype=dtype, scale=4.0)
    )
    with poison:
        out, total = add_rms_norm_triton(x, r, w, 1e-5)
    ref_out, ref_total = add_rms_norm_ref(x, r, w, 1e-5)
    # the residual stream is exactly the model's `h + x` (one rounding of the float32 sum); the
    # interpreter rounds float32 -> bf16 toward zero (compiled Triton rounds to nearest even, as torch)
    if CUDA or dtype != BF16:
        assert torch.equal(total, ref_total), "add_rms_norm: residual sum differs from residual + x"
    close(total, ref_total, dtype, "add_rms_norm residual sum")
    close(out, ref_out, dtype, "add_rms_norm")
    # and against float64 throughout (the norm of the rounded sum)
    out64 = rms_norm_ref(total.double(), w.double(), 1e-5)
    close(out.double(), out64, dtype if dtype != F32 else F32, "add_rms_norm vs float64")
    torch.testing.assert_close(total.double(), r.double() + x.double(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_relu2_small(poison, dtype):
    x = rnd(3, 1000, dtype=dtype, scale=3.0)
    for inp in (x, x[:, ::3], x[1, 17:18]):  # contiguous, strided, one element
        with poison:
            out = relu2_triton(inp)
        assert out.shape == inp.shape
        if CUDA or dtype != BF16:  # (the interpreter's bf16 rounding: see test_add_rms_norm_small)
            assert torch.equal(out, relu2_ref(inp)), "relu2: differs from square(relu(x))"
        torch.testing.assert_close(out.double(), torch.relu(inp.double()) ** 2, **TOL[dtype])


@gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 257, 4096])
def test_norms_nano9b(poison, rows):
    x = rnd(rows, 10240, dtype=BF16)
    z = rnd(rows, 20000, dtype=BF16)[:, 17 : 17 + 10240]
    w = rnd(10240, dtype=BF16)
    with poison:
        out = rmsnorm_gated_triton(x, z, w, 1e-5, 1280)
    close(out, rmsnorm_gated_ref(x, z, w, 1e-5, 1280), BF16, "rmsnorm_gated")
    h, wh = rnd(rows, 4480, dtype=BF16), rnd(4480, dtype=BF16)
    with poison:
        out = rms_norm_triton(h, wh, 1e-5)
    close(out, rms_norm_ref(h, wh, 1e-5), BF16, "rms_norm")
    x2 = rnd(rows, 4480, dtype=BF16)
    with poison:
        out, total = add_rms_norm_triton(x2, h, wh, 1e-5)
    ref_out, ref_total = add_rms_norm_ref(x2, h, wh, 1e-5)
    assert torch.equal(total, ref_total)
    close(out, ref_out, BF16, "add_rms_norm")
    u = rnd(rows, 15680, dtype=BF16, scale=2.0)
    assert torch.equal(relu2_triton(u), relu2_ref(u))


# --------------------------------------------------------------------------- attention


def _attn_case(
    poison, *, new, lens, Hq, Hkv, D, bs, dtype, tensors=False, scale=None, gluon=True, step_cu=False
):
    """Builds a pool whose blocks are shuffled, rows past each sequence's length NaN, writes the
    step's new K/V (with -1 pad slots) and compares write_kv and paged_attention with the refs.
    gluon: through the CUDA op (`cuda_attention`, the Gluon prefill on Hopper where it fits); False: the
    Triton kernels alone. step_cu: the offsets as a step's HostIndex, read by two calls (two layers of one
    step), which share one analysis of the step."""
    S = len(new)
    cu = [0]
    for n in new:
        cu.append(cu[-1] + n)
    T = cu[-1]
    pad_tokens = 2
    per_seq = [(L + bs - 1) // bs for L in lens]
    width = max(per_seq) + 1
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, device=DEV)
    # one spare row; entries past a sequence's blocks far out of range, so a kernel reading one faults
    tables = torch.full((S + 1, width), 2**30, dtype=torch.int32, device=DEV)
    k_cache = torch.full((num_blocks, bs, Hkv, D), float("nan"), device=DEV).to(dtype)
    v_cache = k_cache.clone()
    used = 0
    for s, L in enumerate(lens):
        blocks = order[used : used + per_seq[s]]
        used += per_seq[s]
        tables[s, : per_seq[s]] = blocks.int()
        ctx = L - new[s]  # cached tokens: already in the pool
        for t in range(ctx):
            k_cache[blocks[t // bs], t % bs] = rnd(Hkv, D, dtype=dtype)
            v_cache[blocks[t // bs], t % bs] = rnd(Hkv, D, dtype=dtype)
    slots = []
    for s in range(S):
        for j in range(new[s]):
            t = lens[s] - new[s] + j
            slots.append(int(tables[s, t // bs]) * bs + t % bs)
    slot_mapping = torch.tensor(slots + [-1] * pad_tokens, dtype=torch.int64, device=DEV)
    k = rnd(T + pad_tokens, Hkv, D, dtype=dtype)
    v = rnd(T + pad_tokens, Hkv, D, dtype=dtype)
    kr, vr = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, kr, vr, slot_mapping)
    with poison:
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache.nan_to_num(7.0), kr.nan_to_num(7.0)), "write_kv: K cache differs"
    assert torch.equal(v_cache.nan_to_num(7.0), vr.nan_to_num(7.0)), "write_kv: V cache differs"

    q = rnd(T, Hq, D, dtype=dtype)
    scale = D**-0.5 if scale is None else scale
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, scale)
    args = (
        (torch.tensor(lens, dtype=torch.int32, device=DEV), torch.tensor(cu, dtype=torch.int32, device=DEV))
        if tensors
        else (lens, cu)
    )
    attention = paged_attention_cuda if gluon else paged_attention_triton
    if step_cu:
        args = (lens, HostIndex(cu))
    with poison:
        out = attention(q, k_cache, v_cache, tables, *args, scale)
    close(out, ref, dtype, f"paged_attention new={new} lens={lens}")
    if step_cu:
        shared = dict(args[1]._on_device)
        assert len(shared) == 1  # the step's analysis and device offsets, built by the first call
        with poison:
            again = attention(q, k_cache, v_cache, tables, *args, scale)
        assert torch.equal(again, out) and args[1]._on_device == shared  # the second layer reused it


ATTN_SMALL = [
    ([1], [1]),  # one 1-token sequence, empty context
    ([1, 1, 1, 1], [5, 17, 40, 33]),  # decode batch, lengths not multiple of the block size
    ([1, 1], [300, 1000]),  # decode with several KV splits
    ([3], [3]),  # one short prefill
    ([37], [37]),  # prefill longer than a q block, not a multiple of it
    ([1, 20, 7], [9, 20, 30]),  # mixed: decode + prefill + extend over cached tokens
    ([1, 1, 0, 33, 1], [9, 20, 4, 50, 7]),  # 0-token sequence, 1-token extend after prefills
]


@pytest.mark.parametrize("dtype", quick_first(ATTN_DTYPES))
@pytest.mark.parametrize("new,lens", ATTN_SMALL)
def test_paged_attention_small(poison, dtype, new, lens):
    _attn_case(poison, new=new, lens=lens, Hq=6, Hkv=2, D=32, bs=8, dtype=dtype)


@pytest.mark.parametrize("new,lens", [([1, 20, 7], [9, 20, 30]), ([1, 1], [300, 1000]), ([37], [37])])
def test_paged_attention_step_offsets_shared_by_layers(poison, new, lens):
    _attn_case(poison, new=new, lens=lens, Hq=6, Hkv=2, D=32, bs=8, dtype=torch.float16, step_cu=True)


@pytest.mark.parametrize(
    "case",
    quick_first(
        [
            dict(new=[1, 1], lens=[300, 1000], Hq=6, Hkv=2, D=32, bs=8),  # several splits, one mostly empty
            dict(
                new=[1, 1, 1], lens=[4, 9, 70], Hq=3, Hkv=3, D=24, bs=16, tensors=True
            ),  # odd head dim: masked block
            dict(new=[1, 20, 7], lens=[9, 20, 30], Hq=6, Hkv=2, D=32, bs=8),  # decode beside prefills
        ]
    ),
)
def test_paged_attention_one_shot_merge(poison, monkeypatch, case):
    """`_combine_once_kernel` (every split's partials in one load, by head-dim blocks) merges the decode
    partials as `_combine_kernel` does: over NaN-filled pools, with empty splits and a head dim that is not a
    multiple of the block."""
    import hyserve.kernels.triton_attention as ta

    table = "_COMBINE_GPU" if CUDA else "_COMBINE_CPU"
    monkeypatch.setattr(ta, table, {**getattr(ta, table), "ONCE_MIN_SPLITS": 1, "D_BLOCK": 16})
    calls: list[tuple] = []
    real = ta._combine_once_kernel

    class Counted:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(ta, "_combine_once_kernel", Counted())
    _attn_case(poison, dtype=F32, **case)
    assert calls and all(g[2] == -(-case["D"] // 16) for g in calls), calls


@pytest.mark.parametrize("tensors", quick_first([False, True]))
def test_paged_attention_small_mha_odd_head_dim_tensors(poison, tensors):
    _attn_case(poison, new=[1, 1, 1], lens=[4, 9, 70], Hq=3, Hkv=3, D=24, bs=16, dtype=F32, tensors=tensors)


def test_paged_attention_small_prefill_tensors(poison):
    _attn_case(
        poison, new=[5, 1, 12], lens=[5, 3, 40], Hq=4, Hkv=1, D=16, bs=4, dtype=F16, tensors=True, scale=0.3
    )


@pytest.mark.parametrize(
    "variant", quick_first([dict(TMA=True), dict(TMA=True, BLOCK_N=32), dict(TMA=False)])
)
@pytest.mark.parametrize("dtype", quick_first(ATTN_DTYPES))
def test_paged_attention_small_prefill_variants(poison, monkeypatch, dtype, variant):
    """The prefill kernel's alternatives (key tiles through tensor descriptors, one box per tile (BLOCK_N 16)
    or two (BLOCK_N 32); pointer loads, also float32's fallback) on bs-16 blocks
    over a NaN-filled pool: extends over cached tokens, a prefill crossing several tiles, and lengths off
    the tile grid."""
    import hyserve.kernels.triton_attention as ta

    if CUDA:  # the GPU tables are the ones read there: small tiles so the cases cross several
        small = {**dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=2), **variant}
        monkeypatch.setitem(ta._PREFILL_GPU, 128, small)
        monkeypatch.setitem(ta._PREFILL_GPU_F32, 128, small)
    else:
        monkeypatch.setattr(ta, "_PREFILL_CPU", {**ta._PREFILL_CPU, **variant})
    boxes: list[list[int]] = []
    real = ta._pool_descriptor
    monkeypatch.setattr(
        ta, "_pool_descriptor", lambda c, n: boxes.append(list(real(c, n).block_shape)) or real(c, n)
    )
    _attn_case(
        poison, new=[1, 40, 9, 17], lens=[30, 40, 57, 80], Hq=4, Hkv=2, D=32, bs=16, dtype=dtype, gluon=False
    )
    # the path taken: descriptors (K and V) of one 16-row box per tile, for 16-bit queries only
    assert boxes == ([[16, 32]] * 2 if variant["TMA"] and dtype != F32 else [])


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan")])
def test_paged_attention_rejects_a_scale_that_is_not_positive(scale):
    """The online softmax takes its running max on scaled scores: a scale <= 0 (or NaN) is refused, named."""
    pool = torch.zeros(2, 16, 1, 16, dtype=F16, device=DEV)
    q = torch.zeros(3, 2, 16, dtype=F16, device=DEV)
    with pytest.raises(ValueError, match="softmax scale must be positive"):
        paged_attention_triton(
            q, pool, pool, torch.zeros(1, 2, dtype=torch.int32, device=DEV), [3], [0, 3], scale
        )


@pytest.mark.parametrize("S", [1, 2, 3, 4, 5, 8, 13])
def test_step_index_is_one_copy_with_aligned_starts(S):
    """cu and lens of a step reach the device in one copy, each 16-byte aligned whatever the batch size
    (Triton specialises pointers on alignment: a start that moved with S would compile new variants)."""
    from hyserve.kernels.triton_attention import step_index

    cu, lens = list(range(0, 3 * S + 1, 3)), [7 + s for s in range(S)]
    cu_t, lens_t = step_index(cu, lens, DEV)
    assert cu_t.tolist() == cu and lens_t.tolist() == lens
    assert cu_t.data_ptr() % 16 == 0 and lens_t.data_ptr() % 16 == 0
    assert cu_t.untyped_storage().data_ptr() == lens_t.untyped_storage().data_ptr()
    assert cu_t.dtype == lens_t.dtype == torch.int32 and cu_t.device.type == lens_t.device.type == DEV.type


def test_device_index_lists_and_tensors():
    """Host lists arrive as int32 on the device; an int32 device vector passes through as it is (a decode
    graph's buffers), others are cast; floating-point input is refused."""
    from hyserve.kernels.launch_util import device_index

    got = device_index([3, 1, 2], DEV)
    assert got.dtype == torch.int32 and got.device.type == DEV.type and got.tolist() == [3, 1, 2]
    same = torch.arange(5, dtype=torch.int32, device=DEV)
    assert device_index(same, DEV) is same
    cast = device_index(torch.arange(6, dtype=torch.int64, device=DEV)[::2], DEV)
    assert cast.dtype == torch.int32 and cast.is_contiguous() and cast.tolist() == [0, 2, 4]
    with pytest.raises(AssertionError):
        device_index(torch.zeros(3), DEV)


def test_paged_attention_tma_fit_rules():
    """Tensor-descriptor tiles only where every tile lies in one block of a flat, aligned pool."""
    pool = torch.zeros(4, 64, 2, 32, dtype=torch.float16)
    assert tma_tiles_fit(pool, pool, 64) and tma_tiles_fit(pool, pool, 32)
    assert not tma_tiles_fit(pool, pool, 128)  # a 128-key tile spans two blocks
    assert not tma_tiles_fit(pool.float(), pool.float(), 64)  # float32: pointer loads
    assert not tma_tiles_fit(pool, pool, 8)  # boxes narrower than a matrix-product operand
    odd = torch.zeros(4, 64, 2, 24, dtype=torch.float16)
    assert not tma_tiles_fit(odd, odd, 64)  # head dim not a power of two
    strided = torch.zeros(4, 2, 64, 2, 32, dtype=torch.float16)[:, 0]
    assert not tma_tiles_fit(strided, strided, 64)  # blocks of K and V interleaved: rows not uniform
    assert not tma_tiles_fit(pool, strided, 64)  # V is checked too
    shifted = torch.zeros(1 + pool.numel(), dtype=torch.float16)[1:].view(pool.shape)
    assert not tma_tiles_fit(shifted, shifted, 64)  # base 2 bytes off a 16-byte boundary
    huge = torch.empty(2**25, 64, 1, 16, dtype=torch.float16, device="meta")  # 2^31 rows
    assert not tma_tiles_fit(huge, huge, 64) and tma_tiles_fit(huge[:-1], huge[:-1], 64)


ATTN_NANO = [
    ([1], [131072]),  # 128k decode
    ([1] * 8, [1, 100, 4096, 4097, 20000, 65, 777, 31]),
    ([1] * 64, [2048 + 37 * i for i in range(64)]),
    ([4096], [4096]),
    ([1, 1, 3000, 517, 129, 1], [77, 12000, 3000, 1517, 129, 2]),
]


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("new,lens", ATTN_NANO)
def test_paged_attention_nano9b(poison, dtype, new, lens):
    _attn_case(poison, new=new, lens=lens, Hq=40, Hkv=8, D=128, bs=64, dtype=dtype)


@gpu
@needs_cuda
@pytest.mark.parametrize("variant", [dict(TMA=True), dict(BLOCK_N=64, TMA=True), dict(TMA=False)])
@pytest.mark.parametrize(
    "new,lens", [([4096], [4096]), ([1, 1, 3000, 517, 129, 1], [77, 12000, 3000, 1517, 129, 2])]
)
def test_paged_attention_nano9b_prefill_variants(poison, monkeypatch, new, lens, variant):
    import hyserve.kernels.triton_attention as ta

    monkeypatch.setitem(ta._PREFILL_GPU, 128, {**ta._PREFILL_GPU[128], **variant})
    _attn_case(poison, new=new, lens=lens, Hq=40, Hkv=8, D=128, bs=64, dtype=BF16, gluon=False)


@gpu
@needs_cuda
def test_paged_attention_nano9b_float32(poison):
    """float32 at Nano 9B v2 shapes through the float32 launch settings (`_PREFILL_GPU_F32`: the 16-bit
    tiles do not fit shared memory): decodes, a long prefill and an extend over cached tokens in one step."""
    _attn_case(
        poison, new=[1, 1, 3000, 517], lens=[77, 12000, 3000, 1517], Hq=40, Hkv=8, D=128, bs=64, dtype=F32
    )


def _gluon_or_skip():
    ga = pytest.importorskip("hyserve.kernels.gluon_attention", reason="this triton has no Gluon")
    return ga


@pytest.mark.slow
def test_gluon_prefill_compiles_for_hopper():
    """The Gluon prefill kernel (which the interpreter cannot run) compiles ahead of time for sm_90 at the
    launcher's settings, head dims 64 and 128, one box per key tile and several, 16-bit and fp8 caches: its
    shared memory fits an H100/H200 and the products are warp-group MMAs over TMA-loaded tiles
    (tests/gluon_compile_check.py, in a process without the interpreter)."""
    import json
    import subprocess
    from pathlib import Path

    _gluon_or_skip()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, str(root / "tests" / "gluon_compile_check.py")],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(root)},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cases = json.loads(run.stdout.strip().splitlines()[-1])
    decode = {name: cases.pop(name) for name in list(cases) if name.startswith("decode")}
    assert set(cases) == {
        "D128 bs64",
        "D64 bs16",
        "D128 bs64 fp8",
        "D64 bs16 fp8",
        "D128 bs64 fp8 qk8",
        "D64 bs16 fp8 qk8",
    }
    assert set(decode) == {
        "decode D128 bs64 rep5",
        "decode D64 bs16 rep16",
        "decode D128 bs16 rep1",
        "decode D32 bs16 rep1",
    }
    for name, c in decode.items():
        D = int(name.split()[1][1:])
        steps = 2  # the prefetched loop compiles the step's loads twice (before the loop and inside it)
        # fp8 decode (gluon_decode.py): no shared memory, no barriers, no spills; per SUB-key step the
        # m16n8k16 products of S = Q K^T (D / 16 k-steps x SUB / 8 n-tiles) and O += P V (SUB / 16 x D / 8),
        # two e4m3-pair converts for every 4 bytes of K and V, 16-byte loads where a thread's run of a row
        # has 16 bytes (D / 4 of K: D >= 64), the PDL wait
        sub = c["sub"]
        assert c["shared"] == 0 and c["shared_ops"] == 0 and c["spill_bytes"] == 0, (name, c)
        assert c["mma"] == (D // 16) * (sub // 8) + (sub // 16) * (D // 8), (name, c)
        assert c["e4m3_to_f16"] == 2 * 2 * (sub * D // 4) // 32, (name, c)  # K and V, 2 a word, 32 threads
        assert (c["ld_v4"] > 0) == (D >= 64) and c["ld_v4"] % steps == 0, (name, c)
        assert c["gdc_wait"] and c["regs"] <= 192, (name, c)
    for name, c in cases.items():
        assert 0 < c["shared"] <= 232448, (name, c)  # 227 KiB per block on sm_90
        assert c["wgmma"] and c["tma"], (name, c)
        # over an fp8 cache the converter upcasts with the paired e4m3 -> f16 instruction; nothing spills to
        # local memory
        assert c["e4m3_to_f16"] == ("fp8" in name) and not c["local"], (name, c)
        # the QK8 form: S as e4m3 x e4m3 warp-group MMAs, queries rounded to e4m3 as they load, and only V's
        # tiles upcast (half the converts of the converter form at the same head dim)
        qk8 = name.endswith("qk8")
        assert (c["wgmma_e4m3"] > 0) == qk8 and c["to_e4m3"] == qk8, (name, c)
        if qk8:
            assert 2 * c["cvt_e4m3_lines"] == cases[name.removesuffix(" qk8")]["cvt_e4m3_lines"], (name, c)
        if "fp8" in name:  # the e4m3 products run on Hopper's FP8 tensor cores (QGMMA), not an emulation
            assert (c["QGMMA"] > 0) == qk8 and c["HGMMA"] > 0, (name, c)


DECODE_KERNELS = (
    "_rms_norm_kernel,_add_rms_norm_kernel,_rmsnorm_gated_kernel,_relu2_kernel,_conv1d_update_kernel,"
    "_ssm_update_kernel,_write_kv_kernel,_decode_kernel,_combine_kernel"
)


@pytest.mark.slow
@pytest.mark.parametrize("pdl", [True, False])
def test_decode_kernels_wait_for_their_predecessor_under_pdl(pdl: bool):
    """Offline for sm_90 (tests/sm90_compile_check.py): the kernels of a decode step are launched as
    programmatic dependent launches, so each must wait (griddepcontrol.wait) before it touches memory; with
    HYSERVE_PDL=0 (`--no-pdl`) they compile without the wait. (The one-row GEMV, the MoE and the FP8 kernels:
    test_fp8_linear and test_moe_kernels.)"""
    from tests.sm90 import compile_for_sm90

    args = ["norm", "conv1d", "ssm_update", "attention", "--only", DECODE_KERNELS] + (
        [] if pdl else ["--no-pdl"]
    )
    ptx = compile_for_sm90("bfloat16", *args, timeout=300)["ptx"]
    assert set(ptx) == set(DECODE_KERNELS.split(","))
    for name, markers in ptx.items():
        assert ("griddepcontrol.wait" in markers) == pdl, (name, markers)


def test_pdl_launch_keywords():
    """`launch_util.pdl`: the kernel's PDL constexpr and the launch attribute go together, only for CUDA
    tensors on sm_90+ with PDL enabled; CPU tensors (the interpreter) get PDL=False and no launch option."""
    from hyserve.kernels import launch_util as lu

    x = torch.zeros(2)
    assert lu.pdl(x) == {"PDL": False}
    was = lu.pdl_enabled()
    try:
        lu.set_pdl(False)
        assert not lu.pdl_enabled() and lu.pdl(x) == {"PDL": False}
        lu.set_pdl(True)
        assert lu.pdl_enabled()
        if torch.cuda.is_available():
            want = torch.cuda.get_device_capability()[0] >= 9
            assert lu.pdl(x.cuda()) == ({"PDL": True, "launch_pdl": True} if want else {"PDL": False})
    finally:
        lu.set_pdl(was)


@pytest.mark.slow
def test_float32_kernels_fit_hopper_shared_memory():
    """The kernels whose shared memory grows with float32 operands (attention decode and prefill tiles, the
    SSD state walk) compile for sm_90 at the GPU launch settings the launchers pick for a Nano 9B v2-width
    float32 model within 227 KiB a block (tests/sm90_compile_check.py; the prefill's 16-bit 128 x 128 tile
    asked 262,656 bytes in float32)."""
    from tests.sm90 import HOPPER_SHARED_BYTES, compile_for_sm90

    kernels = "_prefill_kernel,_decode_kernel,_ssd_state_kernel"
    shared = compile_for_sm90("float32", "attention", "ssd", "--only", kernels)["kernels"]
    assert set(shared) == set(kernels.split(","))
    for name, nbytes in shared.items():
        assert 0 < nbytes <= HOPPER_SHARED_BYTES, (name, nbytes)


def test_gluon_prefill_box_rules():
    """Which steps the Gluon kernel takes: none off a GPU; the rest is checked on the GPU below."""
    ga = _gluon_or_skip()
    pool = torch.zeros(4, 64, 2, 128, dtype=BF16)
    assert ga.sm90_prefill_box(pool[0, :3], pool, pool, 128) == 0  # a CPU tensor


def test_cuda_attention_offers_the_prefill_to_gluon():
    """The choice lives in one dispatcher: the CUDA op hands the Triton launcher Gluon's prefill, which
    declines (writing nothing) what it cannot take."""
    import hyserve.kernels.cuda_attention as ca

    ga = _gluon_or_skip()
    assert ca._PREFILL is ga.prefill_sm90
    q = torch.full((3, 4, 128), float("nan"), dtype=BF16)
    pool = torch.zeros(4, 64, 2, 128, dtype=BF16)
    idx = torch.zeros(2, dtype=torch.int32)
    out = q.clone()
    assert not ga.prefill_sm90(q, pool, pool, idx.view(1, 2), idx, idx, out, 0, 1, 3, 1.0)
    assert out.isnan().all()


GLUON_CASES = [  # (new, lens, Hq, Hkv, D, bs, dtype)
    ([4096], [4096], 40, 8, 128, 64, BF16),
    ([1, 1, 3000, 517, 129, 1], [77, 12000, 3000, 1517, 129, 2], 40, 8, 128, 64, BF16),
    ([8192], [8192], 40, 8, 128, 64, F16),
    ([300, 1, 1000, 77], [5000, 9, 1000, 333], 40, 8, 128, 16, BF16),  # 16-token blocks: 8 boxes per tile
    ([2000, 129], [2600, 129], 8, 8, 128, 256, BF16),  # 256-token blocks: one 128-row box per tile
    ([1500, 40], [1500, 2100], 16, 2, 64, 64, BF16),  # head dim 64
    ([100, 3, 333], [100, 40, 700], 40, 8, 128, 32, BF16),  # 32-token blocks; one key tile for short ones
    ([777, 1, 5], [1300, 1, 5], 16, 4, 128, 128, F16),  # 128-token blocks: one box per tile
]


@gpu
@needs_cuda
@pytest.mark.parametrize("new,lens,Hq,Hkv,D,bs,dtype", GLUON_CASES)
def test_gluon_prefill_matches_reference(poison, monkeypatch, new, lens, Hq, Hkv, D, bs, dtype):
    """The Gluon kernel against the float64 reference over NaN-filled pools with shuffled blocks: prefills
    and extends over cached tokens, lengths off the tile grid, decodes in the same step, block sizes giving
    1, 2, 4 and 8 boxes per key tile, head dims 64 and 128; and that it, not the Triton kernel, ran."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper")
    ga = _gluon_or_skip()
    calls: list[int] = []
    real = ga.prefill_attention_sm90
    monkeypatch.setattr(
        ga, "prefill_attention_sm90", lambda *a, **kw: calls.append(kw["box"]) or real(*a, **kw)
    )
    _attn_case(poison, new=new, lens=lens, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype)
    assert calls == [min(bs, 128)]


@gpu
@needs_cuda
@pytest.mark.parametrize("settings", [dict(BLOCK_N=64, STAGES=4), dict(STAGES=2)])
@pytest.mark.parametrize("case", [GLUON_CASES[1], GLUON_CASES[3]])
def test_gluon_prefill_alternative_settings(poison, monkeypatch, settings, case):
    """The settings `bench_kernels.py --only attn_sweep` times against the default (64-key tiles, a
    2-slot ring) are correct too."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel is for Hopper")
    ga = _gluon_or_skip()
    monkeypatch.setattr(ga, "_PREFILL_SM90", {**ga._PREFILL_SM90, **settings})
    new, lens, Hq, Hkv, D, bs, dtype = case
    _attn_case(poison, new=new, lens=lens, Hq=Hq, Hkv=Hkv, D=D, bs=bs, dtype=dtype)


@gpu
@needs_cuda
def test_gluon_prefill_declines_what_it_cannot_take():
    ga = _gluon_or_skip()
    pool = torch.zeros(4, 64, 2, 128, dtype=BF16, device=DEV)
    q = torch.zeros(8, 4, 128, dtype=BF16, device=DEV)
    hopper = torch.cuda.get_device_capability()[0] == 9
    assert ga.sm90_prefill_box(q, pool, pool, 128) == (64 if hopper else 0)
    assert ga.sm90_prefill_box(q.float(), pool.float(), pool.float(), 128) == 0  # float32
    assert ga.sm90_prefill_box(q.half(), pool, pool, 128) == 0  # cache dtype differs
    f8 = pool.to(torch.float8_e4m3fn)
    assert ga.sm90_prefill_box(q, f8, f8, 128) == (64 if hopper else 0)  # the converter form
    assert ga.sm90_prefill_box(q, f8, pool, 128) == 0  # K and V of different dtypes
    assert ga.sm90_prefill_box(q.float(), f8, f8, 128) == 0  # float32 queries
    p256 = torch.zeros(4, 64, 2, 256, dtype=BF16, device=DEV)
    assert ga.sm90_prefill_box(torch.zeros(8, 4, 256, dtype=BF16, device=DEV), p256, p256, 128) == 0
    strided = torch.zeros(4, 2, 64, 2, 128, dtype=BF16, device=DEV)[:, 0]
    assert ga.sm90_prefill_box(q, strided, strided, 128) == 0
    # scales come only with a float8 cache: a scaled 16-bit one is declined (nothing written)
    one = torch.ones((), dtype=torch.float32, device=DEV)
    idx = torch.zeros(2, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    assert not ga.prefill_sm90(
        q, pool, pool, idx.view(1, 2), idx, idx, out, 0, 1, 8, 1.0, k_scale=one, v_scale=one
    )
    assert out.isnan().all()


@gpu
@needs_cuda
def test_paged_attention_decode_is_graph_capturable():
    """Tensor seq_lens/cu_q with T == S: no host sync, so the decode call can be captured."""
    S, Hq, Hkv, D, bs, width = 4, 40, 8, 128, 16, 64
    k_cache = rnd(S * width, bs, Hkv, D, dtype=BF16)
    v_cache = rnd(S * width, bs, Hkv, D, dtype=BF16)
    tables = torch.arange(S * width, device=DEV, dtype=torch.int32).view(S, width)
    lens = torch.tensor([5, 300, 1000, 17], dtype=torch.int32, device=DEV)
    cu = torch.arange(S + 1, dtype=torch.int32, device=DEV)
    q = rnd(S, Hq, D, dtype=BF16)
    paged_attention_triton(q, k_cache, v_cache, tables, lens, cu, D**-0.5)  # compile outside capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = paged_attention_triton(q, k_cache, v_cache, tables, lens, cu, D**-0.5)
    q.copy_(rnd(S, Hq, D, dtype=BF16))
    g.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens.tolist(), cu.tolist(), D**-0.5)
    close(out, ref, BF16, "graph replay")


@gpu
@needs_cuda
def test_paged_attention_fp8_cache(poison):
    """float8 e4m3 KV cache (scale 1): the kernels upcast after the load; the reference reads the same
    fp8 values, so the outputs agree to bf16 tolerance."""
    fp8 = torch.float8_e4m3fn
    Hq, Hkv, D, bs = 40, 8, 128, 16
    new, lens = [1, 1, 300], [50, 1000, 700]
    cu = [0, 1, 2, 302]
    width = max((L + bs - 1) // bs for L in lens)
    tables = torch.arange(len(lens) * width, device=DEV, dtype=torch.int32).view(len(lens), width)
    k_cache = rnd(len(lens) * width, bs, Hkv, D, dtype=BF16).to(fp8)
    v_cache = rnd(len(lens) * width, bs, Hkv, D, dtype=BF16).to(fp8)
    slots = []
    for s in range(len(lens)):
        for j in range(new[s]):
            t = lens[s] - new[s] + j
            slots.append(int(tables[s, t // bs]) * bs + t % bs)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=DEV)
    k, v = rnd(len(slots), Hkv, D, dtype=BF16), rnd(len(slots), Hkv, D, dtype=BF16)
    kr, vr = k_cache.clone(), v_cache.clone()
    write_kv_ref(k, v, kr, vr, slot_mapping)
    write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    torch.testing.assert_close(k_cache.float(), kr.float(), rtol=0.13, atol=0.02)
    torch.testing.assert_close(v_cache.float(), vr.float(), rtol=0.13, atol=0.02)
    q = rnd(cu[-1], Hq, D, dtype=BF16)
    ref = paged_attention_ref(q, k_cache, v_cache, tables, lens, cu, D**-0.5)
    with poison:
        out = paged_attention_triton(q, k_cache, v_cache, tables, lens, cu, D**-0.5)
    close(out, ref, BF16, "fp8 cache")


# --------------------------------------------------------------------------- registry


def test_registry_registers_only_with_cuda():
    from hyserve.kernels import ops

    names = ops.load_cuda_kernels()
    if not CUDA:
        assert names == []
        return
    assert set(names) >= {
        "rms_norm",
        "add_rms_norm",
        "relu2",
        "rmsnorm_gated",
        "conv1d_update",
        "ssm_update",
        "write_kv",
        "paged_attention",
        "linear",
        "gated_norm_linear",
        "relu2_linear",
    }
    assert names == [op.name for op in ops.ALL_OPS]  # every op has a CUDA implementation
    for op in ops.ALL_OPS:
        assert op.get(on_cuda=True) is not op.get(on_cuda=False)
    assert ops.paged_attention.get(on_cuda=True) is paged_attention_cuda
