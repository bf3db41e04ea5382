"""The fused small-batch linear kernels (`triton_fused_linear.py`) against float64 and their references.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1) at small sizes; the `gpu`
cases run the Nemotron Nano 9B v2 shapes compiled. Outputs are poisoned with NaN (`poison`), inputs are
fresh random views with row strides (as the model passes z and the MLP activations), and every case
covers the single row the fused kernel takes and row counts that fall back to the op's kernel + F.linear.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import IGNORE_INTERPRETER_WARNING, interpret_without_cuda

interpret_without_cuda()
pytestmark = IGNORE_INTERPRETER_WARNING

import hyserve.kernels.triton_fused_linear as tfl  # noqa: E402
from hyserve.kernels.fused_linear import (  # noqa: E402
    gated_norm_linear_ref,
    linear_conv1d_update_ref,
    linear_ref,
    relu2_linear_ref,
)
from hyserve.kernels.launch_util import arrival_counters  # noqa: E402
from hyserve.kernels.rmsnorm import AddNorm, add_rms_norm_ref  # noqa: E402
from hyserve.kernels.triton_conv1d import causal_conv1d_update_triton  # noqa: E402
from hyserve.kernels.triton_rmsnorm import add_rms_norm_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
TORCH_SEED = 4321  # conftest seeds torch before each test


def rnd(*shape, dtype=F32, scale=1.0):
    return (torch.randn(*shape, device=DEV) * scale).to(dtype)


def _strided(rows: int, k: int, dtype, scale=1.0) -> torch.Tensor:
    """[rows, k] view with a row stride larger than k (a column slice of a wider tensor)."""
    return rnd(rows, k + 24, dtype=dtype, scale=scale)[:, 5 : 5 + k]


def _weight(n: int, k: int, dtype) -> torch.Tensor:
    return rnd(n, k, dtype=dtype, scale=k**-0.5)  # outputs O(1)


def _close64(out: torch.Tensor, exact: torch.Tensor, dtype, what: str, rounded_input: bool = False) -> None:
    """out (in dtype) against the float64 value: one rounding of the output plus float32 accumulation, and
    with `rounded_input` (the fallback rounds the op's output to dtype before F.linear) one more."""
    assert out.dtype == dtype, f"{what}: dtype {out.dtype}"
    assert torch.isfinite(out).all(), f"{what}: non-finite values (a missed write)"
    tol = (1.6e-2 if dtype == BF16 else 2e-3) * (2 if rounded_input else 1)
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _gated64(x, z, nw, eps, group):
    h = x.double() * torch.nn.functional.silu(z.double())
    hg = h.view(h.shape[0], -1, group)
    hg = hg * torch.rsqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return hg.view(h.shape) * nw.double()


ROWS = [1, 2, 5]  # more than one row: the fallback


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_gated_norm_linear(poison, dtype, rows, bias):
    K, group, N = 144, 48, 37  # 3 norm groups, K % BLOCK_K != 0, N % BLOCK_N != 0
    x, z = _strided(rows, K, dtype), _strided(rows, K, dtype, scale=2.0)
    nw, w = rnd(K, dtype=dtype), _weight(N, K, dtype)
    b = rnd(N, dtype=dtype) if bias else None
    with poison:
        out = tfl.gated_norm_linear_triton(x, z, nw, 1e-5, group, w, b)
    exact = torch.nn.functional.linear(_gated64(x, z, nw, 1e-5, group), w.double(), None if b is None else b.double())
    # both paths round the normed activations once (the norm is its own kernel)
    _close64(out, exact, dtype, "gated_norm_linear vs float64", rounded_input=True)
    ref = gated_norm_linear_ref(x, z, nw, 1e-5, group, w, b)
    tol = 3e-2 if dtype == BF16 else 4e-3  # the reference rounds the normed activations once more
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_view", [False, True])
def test_relu2_linear(poison, dtype, rows, bias, weight_view):
    K, N = 100, 45  # K % BLOCK_K != 0
    x = _strided(rows, K, dtype)
    # a column slice of a wider weight: row stride != K
    w = _weight(N, K + 13, dtype)[:, 7 : 7 + K] if weight_view else _weight(N, K, dtype)
    b = rnd(N, dtype=dtype) if bias else None
    with poison:
        out = tfl.relu2_linear_triton(x, w, b)
    exact = torch.nn.functional.linear(torch.relu(x.double()) ** 2, w.double(), None if b is None else b.double())
    _close64(out, exact, dtype, "relu2_linear vs float64", rounded_input=rows > 1)
    ref = relu2_linear_ref(x, w, b)
    tol = 3e-2 if dtype == BF16 else 4e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_view", [False, True])
def test_linear(poison, dtype, rows, bias, weight_view):
    """Every other projection (in_proj, QKV, O, up, latent): the GEMV for one row, F.linear otherwise."""
    K, N = 136, 41  # K % BLOCK_K != 0, N % BLOCK_N != 0
    x = _strided(rows, K, dtype)
    w = _weight(N, K + 13, dtype)[:, 7 : 7 + K] if weight_view else _weight(N, K, dtype)
    b = rnd(N, dtype=dtype) if bias else None
    with poison:
        out = tfl.linear_triton(x, w, b)
    assert out.shape == (rows, N)
    exact = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    _close64(out, exact, dtype, "linear vs float64")
    torch.testing.assert_close(out.float(), linear_ref(x, w, b).float(), rtol=2e-2, atol=2e-2)


def test_linear_keeps_leading_dims_and_falls_back_for_what_it_does_not_take(monkeypatch):
    x, w = rnd(1, 1, 64, dtype=BF16), _weight(24, 64, BF16)
    out = tfl.linear_triton(x, w, None)  # [1, 1, K]: one row, the GEMV
    assert out.shape == (1, 1, 24)
    torch.testing.assert_close(out.float(), linear_ref(x, w, None).float(), rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(tfl, "_gemv", lambda *a, **k: pytest.fail("the GEMV took a call it does not handle"))
    for xx, ww, bb in ((rnd(2, 3, 64, dtype=BF16), w, None),  # six rows
                       (rnd(1, 64), _weight(24, 64, F32), None),  # float32
                       (rnd(1, 128, dtype=BF16)[:, ::2], w, None),  # a stride along K
                       (rnd(1, 48, dtype=BF16), _weight(64, 48, BF16).t().contiguous().t()[:24], None),
                       (rnd(1, 64, dtype=BF16), w, rnd(24, dtype=F16))):  # a bias of another dtype
        try:
            want = linear_ref(xx, ww, bb)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                tfl.linear_triton(xx, ww, bb)
            continue
        torch.testing.assert_close(tfl.linear_triton(xx, ww, bb), want)
    assert tfl.linear_triton(rnd(0, 64, dtype=BF16), w, None).shape == (0, 24)


def test_float32_takes_the_reference_contract():
    # the GEMV handles 16-bit activations; float32 runs the op's kernel + F.linear
    x, z, nw, w = rnd(2, 64), rnd(2, 64), rnd(64), _weight(16, 64, F32)
    out = tfl.gated_norm_linear_triton(x, z, nw, 1e-5, 32, w, None)
    torch.testing.assert_close(out, gated_norm_linear_ref(x, z, nw, 1e-5, 32, w, None), rtol=1e-4, atol=1e-4)


def test_layouts_and_dtypes_the_gemv_does_not_take_fall_back(monkeypatch):
    # a transposed weight, x with a stride along K, a float32 bias: the op's kernel + F.linear, as before
    monkeypatch.setattr(tfl, "_gemv", lambda *a, **k: pytest.fail("the GEMV took a call it does not handle"))
    x = rnd(1, 128, dtype=BF16)
    w = _weight(64, 48, BF16).t()  # [48, 64]: stride along K is 48
    tol = dict(rtol=3e-2, atol=3e-2)  # (the interpreter rounds bf16 toward zero in the relu2 kernel)
    out = tfl.relu2_linear_triton(x[:, ::2], w, None)
    torch.testing.assert_close(out, relu2_linear_ref(x[:, ::2], w, None), **tol)
    w2 = _weight(16, 64, BF16)
    out = tfl.relu2_linear_triton(x[:, ::2], w2, None)
    torch.testing.assert_close(out, relu2_linear_ref(x[:, ::2], w2, None), **tol)
    with pytest.raises(RuntimeError):  # F.linear refuses a bias of another dtype; the GEMV must not accept it
        tfl.relu2_linear_triton(x[:, :64], w2, torch.zeros(16))


def test_fused_path_is_taken_for_one_row(monkeypatch):
    launched: list[int] = []
    real = tfl._gemv
    monkeypatch.setattr(tfl, "_gemv", lambda x, *a, **k: launched.append(x.shape[0]) or real(x, *a, **k))
    w = _weight(16, 64, BF16)
    for rows in (1, 2, 3):
        tfl.relu2_linear_triton(rnd(rows, 64, dtype=BF16), w, None)
        tfl.gated_norm_linear_triton(rnd(rows, 64, dtype=BF16), rnd(rows, 64, dtype=BF16), rnd(64, dtype=BF16),
                                     1e-5, 32, w, None)
        tfl.linear_triton(rnd(rows, 64, dtype=BF16), w, None)
    assert launched == [1, 1, 1]


def _post_ops(K: int, N: int, dtype):
    """(name, op(x, post) on the Triton path, reference op(x, post), input rows) of the three ops that take
    `post` (a block's residual add and the next norm)."""
    w, nw = _weight(N, K, dtype), rnd(K, dtype=dtype)
    group = K // 2

    def inputs(rows):
        return _strided(rows, K, dtype), _strided(rows, K, dtype, scale=2.0)

    return [
        ("linear", lambda x, z, p: tfl.linear_triton(x, w, None, p), lambda x, z, p: linear_ref(x, w, None, p), inputs),
        ("relu2_linear", lambda x, z, p: tfl.relu2_linear_triton(x, w, None, p),
         lambda x, z, p: relu2_linear_ref(x, w, None, p), inputs),
        ("gated_norm_linear", lambda x, z, p: tfl.gated_norm_linear_triton(x, z, nw, 1e-5, group, w, None, p),
         lambda x, z, p: gated_norm_linear_ref(x, z, nw, 1e-5, group, w, None, p), inputs),
    ]


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("rows", [1, 3])
def test_post_runs_the_residual_add_and_next_norm(poison, dtype, rows):
    """With `post` each op returns add_rms_norm(out, residual, w, eps): at one row from the GEMV's last program,
    bit for bit what the add_rms_norm kernel gives on the op's own output; twice in a row (the arrival counter
    is back at 0 after each launch, or the second call's normed output would stay NaN)."""
    K, N = 136, 200  # N over several GEMV programs and not a multiple of BLOCK_N
    for name, op, ref, inputs in _post_ops(K, N, dtype):
        for _ in range(2):
            x, z = inputs(rows)
            res, nw2 = rnd(rows, N, dtype=dtype), rnd(N, dtype=dtype)
            post = AddNorm(res, nw2, 1e-5)
            with poison:
                normed, total = op(x, z, post)
                out = op(x, z, None)
            want_n, want_s = add_rms_norm_triton(out, res, nw2, 1e-5)
            assert torch.equal(total, want_s), f"{name}: the residual sum"
            # the same arithmetic; on a GPU the sum of squares reduces over the GEMV's warps, not the norm
            # kernel's, so a value may differ by one rounding step
            torch.testing.assert_close(normed, want_n, rtol=2**-7 if dtype == BF16 else 2**-10, atol=1e-3,
                                       msg=lambda m, name=name: f"{name}: the normed next input: {m}")
            rn, rs = ref(x, z, post)
            want_rn, want_rs = add_rms_norm_ref(ref(x, z, None), res, nw2, 1e-5)
            assert torch.equal(rn, want_rn) and torch.equal(rs, want_rs), f"{name}: the reference's post"
            tol = 4e-2 if dtype == BF16 else 6e-3
            torch.testing.assert_close(normed.float(), rn.float(), rtol=tol, atol=tol)
            assert int(arrival_counters(DEV, 1).abs().sum()) == 0, f"{name}: an arrival counter left nonzero"


def test_post_the_gemv_cannot_run_goes_to_the_add_rms_norm_kernel(poison):
    """A residual of another dtype or a strided one, and a norm weight of another length, are refused by the
    GEMV's last program and run by the add_rms_norm kernel after it; more rows than one take F.linear + it."""
    K, N = 64, 24
    x, w = rnd(1, K, dtype=BF16), _weight(N, K, BF16)
    out = tfl.linear_triton(x, w, None)
    for res, nw in ((rnd(1, N, dtype=F16), rnd(N, dtype=BF16)),  # residual dtype differs (the kernel casts)
                    (rnd(1, 2 * N, dtype=BF16)[:, ::2], rnd(N, dtype=BF16))):  # residual with a stride
        assert not tfl._post_fits(BF16, N, AddNorm(res, nw, 1e-5))
    res, nw = rnd(1, 2 * N, dtype=BF16)[:, ::2], rnd(N, dtype=BF16)
    with poison:
        normed, total = tfl.linear_triton(x, w, None, AddNorm(res, nw, 1e-5))
    want_n, want_s = add_rms_norm_triton(out, res, nw, 1e-5)
    assert torch.equal(normed, want_n) and torch.equal(total, want_s)  # the add_rms_norm kernel itself ran


@pytest.mark.parametrize("dtype", [F16, BF16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("conv_bias", [False, True])
@pytest.mark.parametrize("pool_dtype", ["model", F32])
@pytest.mark.parametrize("same_slot", [True, False])
def test_linear_conv1d_update(poison, dtype, rows, conv_bias, pool_dtype, same_slot):
    """Mamba in_proj with the decode conv of its conv channels: at one row the conv runs in the GEMV's epilogue,
    bit for bit the GEMV then the conv kernel (output and conv state); more rows take F.linear + the conv kernel.
    Both against the reference (F.linear + conv1d_update_ref)."""
    K, N, start, D, Kc = 72, 61, 13, 40, 4  # channels [13, 53) of 61 outputs are the conv's, over several programs
    pdt = dtype if pool_dtype == "model" else pool_dtype
    x, w, b = _strided(rows, K, dtype), _weight(N, K, dtype), rnd(N, dtype=dtype)
    cw, cb = rnd(D, Kc, dtype=dtype), (rnd(D, dtype=dtype) if conv_bias else None)
    pool = rnd(2 * rows + 1, D, Kc - 1, dtype=pdt)
    src = torch.arange(rows, dtype=torch.int32, device=DEV)
    dst = src if same_slot else src + rows
    pools = [pool.clone() for _ in range(3)]
    with poison:
        out = tfl.linear_conv1d_update_triton(x, w, b, pools[0], cw, cb, src, dst, start)
        two = tfl.linear_triton(x, w, b)
        two[:, start : start + D] = causal_conv1d_update_triton(two[:, start : start + D], pools[1], cw, cb, src, dst)
    assert torch.isfinite(out).all()
    assert torch.equal(out, two) and torch.equal(pools[0], pools[1]), "fused epilogue vs GEMV + conv kernel"
    ref = linear_conv1d_update_ref(x, w, b, pools[2], cw, cb, src, dst, start)
    tol = 4e-2 if dtype == BF16 else 6e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(pools[0].float(), pools[2].float(), rtol=tol, atol=tol)
    if not same_slot:  # the source slots are read, not written
        assert torch.equal(pools[0][src.long()], pool[src.long()])


@gpu
@needs_cuda
def test_fused_linear_nano9b(poison):
    # Nano 9B v2: Mamba out_proj 10240 -> 4480 (gated norm, 8 groups of 1280), MLP down 15680 -> 4480;
    # then an N that is not a multiple of BLOCK_N, with a bias, compiled
    wb, bb, ub = _weight(4483, 15680, BF16), rnd(4483, dtype=BF16), rnd(1, 15680, dtype=BF16)
    with poison:
        out = tfl.relu2_linear_triton(ub, wb, bb)
    _close64(out, torch.nn.functional.linear(torch.relu(ub.double()) ** 2, wb.double(), bb.double()), BF16, "N 4483")
    for rows in (1, 2):
        zxbcdt = rnd(rows, 22912 + 17, dtype=BF16)
        y, z = rnd(rows, 10240, dtype=BF16), zxbcdt[:, :10240]
        nw, w = rnd(10240, dtype=BF16), _weight(4480, 10240, BF16)
        with poison:
            out = tfl.gated_norm_linear_triton(y, z, nw, 1e-5, 1280, w, None)
        exact = torch.nn.functional.linear(_gated64(y, z, nw, 1e-5, 1280), w.double())
        _close64(out, exact, BF16, "out_proj", rounded_input=True)
        u, wd = rnd(rows, 15680, dtype=BF16), _weight(4480, 15680, BF16)
        with poison:
            out = tfl.relu2_linear_triton(u, wd, None)
        exact = torch.nn.functional.linear(torch.relu(u.double()) ** 2, wd.double())
        _close64(out, exact, BF16, "down_proj", rounded_input=rows > 1)


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", [(22912, 4480), (10304, 2688), (4608, 2688), (2688, 4096), (131072 // 8, 2688)])
def test_linear_gemv_at_the_nemotron_shapes(poison, n, k):
    # Nano 9B in_proj; Nano 30B-A3B in_proj, QKV, O; a wide N: one row against float64, compiled
    x, w = rnd(1, k, dtype=BF16), _weight(n, k, BF16)
    with poison:
        out = tfl.linear_triton(x, w, None)
    _close64(out, torch.nn.functional.linear(x.double(), w.double()), BF16, f"linear {k}->{n}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is the CPU form (the Triton interpreter); on a "
                    "GPU `bench_kernels.py --only linear_sweep` runs the real sweep, and the GPU image's numpy 2.5 breaks "
                    "the interpreter's scalar loop bounds")
def test_bench_kernels_linear_sweep_dry_run_checks_every_form_first(tmp_path):
    """`bench_kernels.py --only linear_sweep` (the launch settings of these GEMVs and of the FP8 one-row GEMV)
    runs on the CPU at tiny shapes and records each form only after its float64 check."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "ls.json"
    r = subprocess.run([sys.executable, str(root / "benchmarks/bench_kernels.py"), "--dry-run", "--only", "linear_sweep",
                        "--out", str(out)], capture_output=True, text=True, env={**env, "PYTHONPATH": str(root)},
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    names = [x["name"] for x in json.loads(out.read_text())["records"]]
    assert "in_proj 48->96, 1 row: GEMV" in names and "in_proj 48->96, 1 row: cuBLAS" in names
    assert any(n.startswith("fp8 channel GEMV") for n in names) and any(n.startswith("fp8 block GEMV") for n in names)
    assert not any(line.startswith("FAIL") for line in r.stdout.splitlines())
    assert r.stdout.count("matches its reference") == 5  # three 16-bit GEMV forms, two FP8 scale layouts
