"""The fused small-batch linear kernels (`triton_fused_linear.py`) against float64 and their references.

Without CUDA the kernel runs under the Triton interpreter (TRITON_INTERPRET=1) at small sizes; the `gpu`
cases run the Nemotron Nano 9B v2 shapes compiled. Outputs are poisoned with NaN (`poison`), inputs are
fresh random views with row strides (as the model passes z and the MLP activations), and every case
covers the single row the fused kernel takes and row counts that fall back to the op's kernel + F.linear.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.triton_interpreter import IGNORE_INTERPRETER_WARNING, interpret_without_cuda

interpret_without_cuda()
pytestmark = IGNORE_INTERPRETER_WARNING

import hyserve.kernels.triton_fused_linear as tfl  # noqa: E402
from hyserve.kernels.fused_linear import gated_norm_linear_ref, linear_ref, relu2_linear_ref  # noqa: E402

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
    exact = torch.nn.functional.linear(
        _gated64(x, z, nw, 1e-5, group), w.double(), None if b is None else b.double()
    )
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
    exact = torch.nn.functional.linear(
        torch.relu(x.double()) ** 2, w.double(), None if b is None else b.double()
    )
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
    _linear_case(dtype, rows, bias, weight_view, 136, poison)


@pytest.mark.parametrize("prefetch", [1, 2])
@pytest.mark.parametrize("K", [20, 40, 136])
def test_linear_gemv_prefetch_forms(poison, monkeypatch, prefetch, K):
    """One or two weight tiles loaded before the PDL wait (PREFETCH_TILES), with K inside the first tile,
    ending in the second, and running past it (the interpreter's K tile is 32)."""
    monkeypatch.setattr(tfl, "PREFETCH_TILES", prefetch)
    for dtype in (F16, BF16):
        _linear_case(dtype, 1, True, False, K, poison)


def _linear_case(dtype, rows, bias, weight_view, K, poison):
    N = 41  # K % BLOCK_K != 0, N % BLOCK_N != 0
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
    for xx, ww, bb in (
        (rnd(2, 3, 64, dtype=BF16), w, None),  # six rows
        (rnd(1, 64), _weight(24, 64, F32), None),  # float32
        (rnd(1, 128, dtype=BF16)[:, ::2], w, None),  # a stride along K
        (rnd(1, 48, dtype=BF16), _weight(64, 48, BF16).t().contiguous().t()[:24], None),
        (rnd(1, 64, dtype=BF16), w, rnd(24, dtype=F16)),
    ):  # a bias of another dtype
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
        tfl.gated_norm_linear_triton(
            rnd(rows, 64, dtype=BF16), rnd(rows, 64, dtype=BF16), rnd(64, dtype=BF16), 1e-5, 32, w, None
        )
        tfl.linear_triton(rnd(rows, 64, dtype=BF16), w, None)
    assert launched == [1, 1, 1]


@gpu
@needs_cuda
def test_fused_linear_nano9b(poison):
    # Nano 9B v2: Mamba out_proj 10240 -> 4480 (gated norm, 8 groups of 1280), MLP down 15680 -> 4480;
    # then an N that is not a multiple of BLOCK_N, with a bias, compiled
    wb, bb, ub = _weight(4483, 15680, BF16), rnd(4483, dtype=BF16), rnd(1, 15680, dtype=BF16)
    with poison:
        out = tfl.relu2_linear_triton(ub, wb, bb)
    _close64(
        out,
        torch.nn.functional.linear(torch.relu(ub.double()) ** 2, wb.double(), bb.double()),
        BF16,
        "N 4483",
    )
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
@pytest.mark.parametrize(
    "n,k", [(22912, 4480), (10304, 2688), (4608, 2688), (2688, 4096), (131072 // 8, 2688)]
)
def test_linear_gemv_at_the_nemotron_shapes(poison, n, k):
    # Nano 9B in_proj; Nano 30B-A3B in_proj, QKV, O; a wide N: one row against float64, compiled
    x, w = rnd(1, k, dtype=BF16), _weight(n, k, BF16)
    with poison:
        out = tfl.linear_triton(x, w, None)
    _close64(out, torch.nn.functional.linear(x.double(), w.double()), BF16, f"linear {k}->{n}")


@pytest.mark.slow
@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="the dry run is the CPU form (the Triton interpreter); on a "
    "GPU `bench_kernels.py --only linear_sweep` runs the real sweep, and the GPU image's numpy 2.5 breaks "
    "the interpreter's scalar loop bounds",
)
def test_bench_kernels_linear_sweep_dry_run_checks_every_form_first(tmp_path):
    """`bench_kernels.py --only linear_sweep` (the launch settings of these GEMVs and of the FP8 one-row GEMV)
    runs on the CPU at tiny shapes and records each form only after its float64 check."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "ls.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_kernels",
            "--dry-run",
            "--only",
            "linear_sweep",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(root)},
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    names = [x["name"] for x in json.loads(out.read_text())["records"]]
    assert "in_proj 48->96, 1 row: GEMV" in names and "in_proj 48->96, 1 row: cuBLAS" in names
    assert any(n.startswith("fp8 channel GEMV") for n in names) and any(
        n.startswith("fp8 block GEMV") for n in names
    )
    assert not any(line.startswith("FAIL") for line in r.stdout.splitlines())
    # three 16-bit GEMV forms; per FP8 scale layout the current setting and one alternative
    assert r.stdout.count("matches its reference") == 7
    assert sum(n.endswith(" current") for n in names) == 2


def test_gpu_settings_narrow_outputs_take_narrow_programs():
    """The GPU launch settings by row length and output width: at least _MIN_PROGRAMS programs where a
    setting of the table gives them (the Nano 9B v2 and Nemotron 3 Nano 30B-A3B projections)."""
    pick = lambda k, n: tuple(tfl.gpu_settings(0, k, n)[key] for key in ("BLOCK_N", "BLOCK_K"))  # noqa: E731
    assert pick(4480, 22912) == (4, 512)  # 9B in_proj
    assert pick(10240, 4480) == (4, 512) and pick(15680, 4480) == (4, 512)  # 9B out_proj, down_proj
    assert pick(4096, 2688) == (2, 512)  # 30B-A3B out_proj and o_proj: 1344 programs, not 672
    assert pick(2688, 10304) == (8, 256)  # 30B-A3B in_proj
    assert pick(2688, 4096) == (1, 512) and pick(2688, 256) == (1, 512)  # 30B-A3B q, k, v
    for k, n in ((4480, 22912), (4096, 2688), (2688, 10304), (2688, 4096)):
        assert -(-n // tfl.gpu_settings(0, k, n)["BLOCK_N"]) >= tfl._MIN_PROGRAMS
    assert tfl.gpu_settings(1, 15680, 4480)["BLOCK_K"] == 2048  # e4m3, long rows


@pytest.mark.parametrize("K", [100, 128, 200])
def test_gemv_prefetch_of_a_second_tile_past_k_reads_no_block_scale(poison, monkeypatch, K):
    """Block-scaled e4m3 weights with 128-wide K tiles and two tiles before the PDL wait: where K ends in the
    first tile, the second tile's scale column would lie past the scale tensor's last one, so it is masked
    (the product matches the dequantised float64 one)."""
    from hyserve.kernels.fp8_linear import dequantize_weight_ref, quantize_weight_ref

    monkeypatch.setattr(tfl, "_CPU", dict(BLOCK_N=8, BLOCK_K=128, num_warps=1, num_stages=1))
    monkeypatch.setattr(tfl, "PREFETCH_TILES", 2)
    q, sc = quantize_weight_ref(_weight(20, K, F32), "block")
    x = rnd(1, K, dtype=BF16)
    with poison:
        out = tfl.gemv_fp8(x, q, sc, None, False)
    exact = x.double() @ dequantize_weight_ref(q, sc).double().T
    _close64(out, exact, BF16, f"block-scaled GEMV, K {K}, two tiles before the wait")


@pytest.fixture
def gpu_file(monkeypatch, tmp_path):
    """Write `linear_configs/<name>.json` with these entries into a scratch config dir; the table cache is
    cleared around each use."""
    monkeypatch.setattr(tfl, "CONFIG_DIR", tmp_path)

    def write(name: str, configs: dict) -> None:
        (tmp_path / f"{name}.json").write_text(json.dumps({"configs": configs}))
        tfl.device_table.cache_clear()

    yield write
    tfl.device_table.cache_clear()


def test_a_gpu_file_entry_sets_its_shape_on_that_gpu_alone(gpu_file):
    """`linear_configs/<GPU>.json` overrides the row-length tables for its shapes on the GPU it names; other
    shapes and other GPUs keep the tables."""
    setting = dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=4)
    gpu_file("Some_GPU_80GB", {"0,2688,4608": setting})
    assert tfl.gpu_settings(0, 2688, 4608, "Some GPU 80GB") == setting
    assert tfl.gpu_settings(0, 2688, 4608, "Other GPU") == tfl.gpu_settings(0, 2688, 4608)
    assert tfl.gpu_settings(0, 2688, 4608)["BLOCK_N"] == 1
    assert tfl.gpu_settings(0, 2688, 10304, "Some GPU 80GB") == tfl.gpu_settings(0, 2688, 10304)


_GOOD = dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=4)


@pytest.mark.parametrize(
    "key, entry, what",
    [
        (
            "0,2688,4608",
            {"BLOCK_N": 8, "BLOCK_K": 256, "num_warps": 4},
            r"\[0,2688,4608\]: .*exactly the keys",
        ),
        ("0,2688,4608", dict(_GOOD, BLOCK_N=6), "BLOCK_N must be a power of two"),
        ("0,2688,4608", dict(_GOOD, BLOCK_K=8), "BLOCK_K must be a power of two >= 16"),
        ("0,2688,4608", dict(_GOOD, num_warps=3), "num_warps must be 1, 2, 4 or 8"),
        ("0,2688,4608", dict(_GOOD, num_stages=0), "num_stages must be in 1..8"),
        ("0,2688,4608", dict(_GOOD, BLOCK_N=8.0), "BLOCK_N must be an integer"),
        # a block-scaled weight's K tile takes the one scale of its 128-wide block
        (
            "2,4480,22912",
            dict(_GOOD, BLOCK_K=256),
            r"\[2,4480,22912\]: a block-scaled weight needs BLOCK_K dividing 128, "
            "got 256",
        ),
        ("2688x4608", _GOOD, r"key '2688x4608' is not '<w_scale 0\|1\|2>,<K>,<N>'"),
    ],
)
def test_a_bad_gpu_file_entry_is_refused_with_what_is_wrong(gpu_file, key, entry, what):
    gpu_file("Bad_GPU", {key: entry})
    w_scale, k, n = (int(v) for v in key.split(",")) if "," in key else (0, 2688, 4608)
    with pytest.raises(ValueError, match=what) as e:
        tfl.gpu_settings(w_scale, k, n, "Bad GPU")
    assert str(e.value).startswith("Bad_GPU.json")


def test_the_shipped_gpu_files_are_valid():
    files = sorted(tfl.CONFIG_DIR.glob("*.json"))
    assert files, tfl.CONFIG_DIR
    for f in files:
        doc = json.loads(f.read_text())
        tfl.device_table.cache_clear()
        table = tfl.device_table(doc["device"])
        assert table and set(table) <= set(doc["source"]), f.name  # every entry cites its sweep
    tfl.device_table.cache_clear()


def test_the_fp8_gemv_sweep_writes_only_clear_winners_into_the_gpu_file(tmp_path):
    """`bench_kernels.py --write-linear-configs`: a swept shape whose fastest setting took at most 97% of the
    current one's time enters the GPU's file, citing both times; a closer race or a shape without a timed
    current setting does not; earlier entries stay; the file is one `gpu_settings` reads back."""
    from benchmarks import bench_kernels as bk

    old = dict(BLOCK_N=8, BLOCK_K=256, num_warps=4, num_stages=4)
    (tmp_path / "Some_GPU.json").write_text(
        json.dumps({"device": "Some GPU", "source": {"0,2688,4608": "x"}, "configs": {"0,2688,4608": old}})
    )
    b = bk.Bench(dry=True)
    b.gemv_best = {
        (1, 8192, 4096): {
            "label": "fp8 channel GEMV Super 8192->4096",
            "current": (0.020, (16, 512, 4, 3)),
            "best": (0.012, (4, 1024, 2, 4)),
        },
        (1, 4096, 4096): {
            "label": "close",
            "current": (0.010, (16, 512, 4, 3)),
            "best": (0.0098, (8, 512, 4, 4)),
        },
        (1, 4096, 256): {"label": "no current", "best": (0.001, (1, 1024, 1, 4))},
    }
    assert bk.write_linear_configs(b, tmp_path, "Some GPU", "kernels_x.md") == ["1,8192,4096"]
    doc = json.loads((tmp_path / "Some_GPU.json").read_text())
    assert doc["configs"]["0,2688,4608"] == old
    assert doc["configs"]["1,8192,4096"] == dict(BLOCK_N=4, BLOCK_K=1024, num_warps=2, num_stages=4)
    assert "12.0 us against 20.0 us" in doc["source"]["1,8192,4096"]
    assert "kernels_x.md" in doc["source"]["1,8192,4096"]
    tfl.device_table.cache_clear()
    saved = tfl.CONFIG_DIR
    try:
        tfl.CONFIG_DIR = tmp_path
        assert tfl.gpu_settings(1, 8192, 4096, "Some GPU") == doc["configs"]["1,8192,4096"]
    finally:
        tfl.CONFIG_DIR = saved
        tfl.device_table.cache_clear()
    empty = bk.Bench(dry=True)
    assert bk.write_linear_configs(empty, tmp_path / "none", "Other GPU", "k.md") == []
    assert not (tmp_path / "none").exists()
