"""The Triton FP8 linear kernels (`triton_fp8_linear.py`) against float64 products of the dequantised
operands and against their references (`fp8_linear.py`).

Without CUDA they run under the Triton interpreter (TRITON_INTERPRET=1), which executes e4m3 dots, at small
sizes that still cover ragged N and K tiles, split K, block scales and both forms (w8a16 up to SMALL_M
rows, w8a8 above); the `gpu` cases run the Nemotron Nano 9B v2 shapes compiled for the device.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.quick import quick_first
from tests.triton_interpreter import IGNORE_INTERPRETER_WARNING, interpret_without_cuda

interpret_without_cuda()
pytestmark = IGNORE_INTERPRETER_WARNING

import hyserve.kernels.triton_fp8_linear as t8  # noqa: E402
from hyserve.kernels.fp8_linear import (  # noqa: E402
    E4M3,
    dequantize_weight_ref,
    fp8_linear_ref,
    quantize_rows_ref,
    quantize_weight_ref,
)

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
F64, BF16, F16 = torch.float64, torch.bfloat16, torch.float16
gpu = pytest.mark.gpu
TORCH_SEED = 8119
E4M3_REL = 2.0**-4


def _w8a8_rel(k: int) -> float:
    """Accumulation bound of the prefill (w8a8) form, relative to |a| @ |w|: float32 on the CPU path; on
    Hopper the e4m3 tensor-core product keeps only about 14 bits inside each K tile before the kernel
    promotes it to float32 (DeepSeek-V3 report, FP8 accumulation), so up to 2^-14 of each tile's |a| @ |w|,
    2^-13 with margin (measured on the H200: at most 5.7e-5 = 2^-14.1 at K = 300 for the Triton GEMM; the
    torch._scaled_mm form, CUTLASS with the same promotion, passes it at K = 15680)."""
    return max(2e-6 * k**0.5, 2.0**-13 if CUDA else 0.0)


def _weight(n: int, k: int, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device=DEV) * 0.05 * torch.logspace(-1, 1, n, device=DEV)[:, None]
    q, s = quantize_weight_ref(w, scheme)
    if scheme == "tensor":
        s = s.expand(n).contiguous()
    return q, s


def _x(m: int, k: int, dtype: torch.dtype, row_stride_pad: int = 0) -> torch.Tensor:
    """[m, k] with a row stride of k + pad (a column slice of a wider buffer), magnitudes varying by row."""
    buf = torch.randn(m, k + row_stride_pad, device=DEV) * torch.logspace(-2, 1, m, device=DEV)[:, None]
    return buf.to(dtype)[:, :k]


def _within(out: torch.Tensor, want: torch.Tensor, mag: torch.Tensor, rel: float) -> None:
    """|out - want| <= one rounding of out's dtype on |want| + rel * (|a| @ |b|^T), elementwise."""
    eps = torch.finfo(out.dtype).eps
    bound = eps * want.abs() + rel * mag + 1e-30
    err = (out.double() - want).abs()
    assert torch.isfinite(out).all()
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.3f} x the bound"


# ---- activation quantisation ---------------------------------------------------------------------------
@pytest.mark.parametrize("tile", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("group", [None, 128])
def test_row_quantisation_is_torchs_rounding_bit_for_bit(group: int | None, tile: bool, poison) -> None:
    x = torch.randn(6, 300, device=DEV) * torch.tensor([1e-4, 1.0, 30.0, 0.0, 5.0, 1e3], device=DEV)[:, None]
    x[1, :8] = (
        torch.tensor([124.78, -124.73, 7.9714, 31.649, 0.0087, -0.0003, 447.9, 1.0], device=DEV)
        / 448.0
        * x[1].abs().max()
    )
    xs = torch.cat([x, x], 1)[:, :300]  # a row stride of 600
    with poison:
        q, s = t8.quantize_rows_triton(xs.to(torch.float32), group, tile=tile)
    rq, rs = quantize_rows_ref(xs, group)
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("tile", [True, False], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("group", [None, 128])
def test_row_quantisation_with_relu2_quantises_relu2_in_float32(group: int | None, tile: bool) -> None:
    x = (torch.randn(5, 260, device=DEV) * 3).to(BF16)
    q, s = t8.quantize_rows_triton(x, group, relu2=True, tile=tile)
    rq, rs = quantize_rows_ref(torch.relu(x.float()) ** 2, group)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("rows, cols", [(3, 100), (33, 64), (1, 2688), (2, 9000)])
@pytest.mark.parametrize("group", [None, 128])
def test_one_pass_quantisation_at_row_counts_and_widths_off_its_tiles(rows: int, cols: int, group) -> None:
    """Fewer columns than a group, a row count that is no multiple of the program's rows, a model width, and
    a row too wide for the one-pass tiles (the two-pass kernel takes it)."""
    x = torch.randn(rows, cols, device=DEV).to(BF16) * 7
    q, s = t8.quantize_rows_triton(x, group, tile=True)
    rq, rs = quantize_rows_ref(x, group)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def test_quantisation_takes_the_kernel_measured_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default rows quantised per 128 columns take the one-pass tiles, rows quantised per token the
    two-pass kernel (bench_kernels --only quant on an H100: the one-pass per-token form was the slower)."""
    launched: list[str] = []

    class Spy:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]

    monkeypatch.setattr(t8, "_quant_tile_kernel", Spy("one-pass", t8._quant_tile_kernel))
    monkeypatch.setattr(t8, "_quant_rows_kernel", Spy("two-pass", t8._quant_rows_kernel))
    x = torch.randn(4, 256, device=DEV).to(BF16)
    for group, kernel in ((128, "one-pass"), (None, "two-pass")):
        launched.clear()
        q, s = t8.quantize_rows_triton(x, group)
        rq, rs = quantize_rows_ref(x, group)
        assert launched == [kernel] and torch.equal(s, rs)


def test_row_quantisation_refuses_bad_input() -> None:
    with pytest.raises(AssertionError, match="group must be None or 128"):
        t8.quantize_rows_triton(torch.zeros(2, 8, device=DEV), 64)
    with pytest.raises(AssertionError):
        t8.quantize_rows_triton(torch.zeros(8, 2, device=DEV).T, None)


# ---- the linear --------------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["channel", "tensor", "block"])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m", quick_first([1, 5, 16]))
def test_decode_form_against_float64(scheme: str, dtype: torch.dtype, m: int, poison) -> None:
    n, k = 200, 328  # ragged N and K tiles; K split over programs
    q, s = _weight(n, k, "block" if scheme == "block" else scheme)
    x = _x(m, k, dtype, row_stride_pad=8)
    bias = torch.randn(n, device=DEV).to(dtype) if m != 5 else None
    with poison:
        out = t8.fp8_linear_triton(x, q, s, bias)
    assert out.dtype == dtype and out.shape == (m, n)
    w = dequantize_weight_ref(q, s).double()
    want = x.double() @ w.T + (0 if bias is None else bias.double())
    # x stays 16-bit: fp32 accumulation and one output rounding only
    _within(out, want, x.double().abs() @ w.abs().T, rel=2e-6 * k**0.5)


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("m", [17, pytest.param(40, marks=pytest.mark.slow)])
def test_prefill_form_against_float64(scheme: str, dtype: torch.dtype, m: int, poison) -> None:
    n, k = 160, 300
    q, s = _weight(n, k, scheme)
    x = _x(m, k, dtype, row_stride_pad=4)
    bias = torch.randn(n, device=DEV).to(dtype)
    with poison:
        out = t8.fp8_linear_triton(x, q, s, bias)
    w = dequantize_weight_ref(q, s).double()
    qa, sa = quantize_rows_ref(x.contiguous(), 128 if scheme == "block" else None)
    full = sa[:, None] if scheme == "channel" else sa.repeat_interleave(128, 1)[:, :k]
    a = qa.double() * full.double()  # the kernel's own activation codes (bit-identical, tested above)
    want = a @ w.T + bias.double()
    _within(out, want, a.abs() @ w.abs().T, rel=_w8a8_rel(k))
    # and against the exact activation: e4m3's own rounding, 2^-4 relative per element
    exact = x.double() @ w.T + bias.double()
    _within(out, exact, x.double().abs() @ w.abs().T, rel=E4M3_REL * 1.01)


@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 9, 30])
def test_relu2_linear_both_forms(scheme: str, m: int, poison) -> None:
    """The MLP's down_proj: relu^2 applied as the activation loads, in both forms, against float64 of
    relu(x)^2 (within one bf16 rounding of it, for the decode form; the kernel's own codes of relu(x)^2 in
    float32 for the prefill form) times the dequantised weight."""
    n, k = 72, 300
    q, s = _weight(n, k, scheme)
    x = _x(m, k, BF16, row_stride_pad=4)
    bias = torch.randn(n, device=DEV).to(BF16)
    with poison:
        out = t8.fp8_relu2_linear_triton(x, q, s, bias)
    w = dequantize_weight_ref(q, s).double()
    if m <= t8.SMALL_M:  # relu^2 rounded once to bf16 for the 16-bit dot: half an ulp per element
        a = torch.relu(x.double()) ** 2
        rel = 2.0**-8 * 1.01 + 2e-6 * k**0.5
    else:
        qa, sa = quantize_rows_ref(torch.relu(x.float()) ** 2, 128 if scheme == "block" else None)
        full = sa[:, None] if scheme == "channel" else sa.repeat_interleave(128, 1)[:, :k]
        a = qa.double() * full.double()
        rel = _w8a8_rel(k)
    _within(out, a @ w.T + bias.double(), a.abs() @ w.abs().T, rel=rel)
    ref = fp8_linear_ref(torch.relu(x) ** 2, q, s, bias)  # the reference path: relu^2 in bf16
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 0.04


def test_shapes_dtypes_and_empty_inputs() -> None:
    q, s = _weight(48, 64, "channel")
    x = torch.randn(2, 3, 64, device=DEV).to(BF16)
    out = t8.fp8_linear_triton(x, q, s, None)
    assert out.shape == (2, 3, 48)
    w = dequantize_weight_ref(q, s).double()
    _within(out, x.double() @ w.T, x.double().abs() @ w.abs().T, rel=2e-6 * 8)
    assert t8.fp8_linear_triton(x[:0], q, s, None).shape == (0, 3, 48)
    x32 = torch.randn(4, 64, device=DEV)
    assert torch.equal(t8.fp8_linear_triton(x32, q, s, None), fp8_linear_ref(x32, q, s, None))


def test_launcher_asserts_shapes() -> None:
    q, s = _weight(48, 64, "channel")
    x = torch.randn(2, 64, device=DEV).to(BF16)
    with pytest.raises(AssertionError, match="x has 63 features"):
        t8.fp8_linear_triton(x[:, :63], q, s, None)
    with pytest.raises(AssertionError, match=r"weight_scale \[47\], expected \[48\]"):
        t8.fp8_linear_triton(x, q, s[:47].contiguous(), None)
    with pytest.raises(AssertionError, match=r"weight_scale \[1, 2\], expected \[1, 1\]"):
        t8.fp8_linear_triton(x, q, torch.ones(1, 2, device=DEV), None)
    with pytest.raises(AssertionError):
        t8.fp8_linear_triton(x, q.to(BF16), s, None)
    with pytest.raises(AssertionError):
        t8.fp8_linear_triton(x, q, s, torch.zeros(47, device=DEV, dtype=BF16))


# ---- GPU: the Nano 9B v2 shapes --------------------------------------------------------------------------
NANO_SHAPES = [(4480, 17504), (4480, 15680), (15680, 4480), (5120, 4480)]  # in_proj, up, down, q


@gpu
@pytest.mark.parametrize("scheme", ["channel", "block"])
@pytest.mark.parametrize("m", [1, 8, 64, 1000])
@pytest.mark.parametrize("shape", NANO_SHAPES)
def test_gpu_nano_shapes(scheme: str, m: int, shape: tuple[int, int]) -> None:
    k, n = shape
    q, s = _weight(n, k, scheme)
    x = _x(m, k, BF16)
    out = t8.fp8_linear_triton(x, q, s, None)
    w = dequantize_weight_ref(q, s).double()
    if m <= t8.SMALL_M:
        _within(out, x.double() @ w.T, x.double().abs() @ w.abs().T, rel=2e-6 * k**0.5)
    else:
        qa, sa = quantize_rows_ref(x.contiguous(), 128 if scheme == "block" else None)
        full = sa[:, None] if scheme == "channel" else sa.repeat_interleave(128, 1)[:, :k]
        a = qa.double() * full.double()
        _within(out, a @ w.T, a.abs() @ w.abs().T, rel=_w8a8_rel(k))
    assert q.dtype == E4M3


@gpu
@pytest.mark.parametrize("form", ["auto", "triton"])
@pytest.mark.parametrize("relu2", [False, True])
def test_gpu_prefill_gemm_forms(form: str, relu2: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both GEMMs of the channel-scaled prefill form (torch._scaled_mm where it takes the call, the Triton
    GEMM) against the float64 product of the activation codes and the dequantised weight, with a bias, at the
    Nano 9B v2 down_proj (relu^2 as the activation quantises) and a ragged row count."""
    monkeypatch.setitem(t8.PREFILL_GEMM, "form", form)
    k, n, m = 15680, 4480, 777
    q, s = _weight(n, k, "channel")
    x = _x(m, k, BF16)
    bias = None if form == "auto" else torch.randn(n, device=DEV).to(BF16)  # a bias goes to the Triton GEMM
    assert t8._scaled_mm_takes(x, q, False) == (form == "auto" and torch.cuda.get_device_capability()[0] >= 9)
    out = t8.fp8_linear_triton(x, q, s, bias, relu2=relu2)
    w = dequantize_weight_ref(q, s).double()
    qa, sa = quantize_rows_ref(torch.relu(x.float()) ** 2 if relu2 else x, None)
    a = qa.double() * sa[:, None].double()
    _within(out, a @ w.T + (0 if bias is None else bias.double()), a.abs() @ w.abs().T, rel=_w8a8_rel(k))


def test_scaled_mm_takes_only_what_it_supports() -> None:
    """torch._scaled_mm runs only channel-scaled bf16 GEMMs of at least SCALED_MM_MIN_ROWS rows on CUDA sm_90+
    with N and K multiples of 16."""
    q, _ = _weight(48, 64, "channel")
    x = torch.randn(t8.SCALED_MM_MIN_ROWS, 64).to(BF16)
    assert not t8._scaled_mm_takes(x, q.cpu(), False)  # a CPU tensor
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        xc, qc = x.cuda(), q.cuda()
        assert t8._scaled_mm_takes(xc, qc, False)
        assert not t8._scaled_mm_takes(xc, qc, True)  # block scales
        assert not t8._scaled_mm_takes(xc.to(F16), qc, False)
        q40, _ = _weight(48, 40, "channel")  # K not a multiple of 16
        assert not t8._scaled_mm_takes(
            torch.randn(t8.SCALED_MM_MIN_ROWS, 40, device=DEV).to(BF16), q40, False
        )
        assert not t8._scaled_mm_takes(xc[: t8.SCALED_MM_MIN_ROWS - 1], qc, False)  # a decode step's rows


@pytest.mark.slow
def test_kernels_compile_for_hopper_with_e4m3_warp_group_mma():
    """Offline, no GPU needed (tests/sm90_compile_check.py): at the GPU launch settings every FP8 kernel (the
    linear's, and the fused MoE's with FP8 experts at a Nano 30B-A3B layer) compiles for sm_90 within 227 KiB
    of shared memory a block, and the prefill GEMM's PTX multiplies e4m3 operands with Hopper's warp-group
    MMA (wgmma), not a 16-bit fallback."""
    from tests.sm90 import HOPPER_SHARED_BYTES, compile_for_sm90

    out = compile_for_sm90("bfloat16", "fp8", "moe_fp8")
    fp8 = {"_gemv_kernel", "_w8a16_kernel", "_splitk_reduce_kernel", "_quant_tile_kernel", "_fp8_gemm_kernel"}
    moe = {"_up_gemv_kernel", "_down_gemv_kernel", "_up_gemm_kernel", "_down_gemm_kernel"}
    assert fp8 | moe <= set(out["kernels"])
    for name, nbytes in out["kernels"].items():
        assert nbytes <= HOPPER_SHARED_BYTES, (name, nbytes)
    assert out["ptx"]["_fp8_gemm_kernel"] == ["e4m3", "griddepcontrol.wait", "wgmma.mma_async"]
    for name in fp8 | moe:  # each waits for its predecessor when launched as a programmatic dependent launch
        assert "griddepcontrol.wait" in out["ptx"][name], name
    # the decode form and the FP8 experts read e4m3 weights and convert them in registers; the experts'
    # grouped GEMMs then run 16-bit warp-group MMAs
    for name in ("_gemv_kernel", "_w8a16_kernel", *moe):  # the one-row GEMV too (at its GPU settings)
        assert "e4m3" in out["ptx"][name], name
    assert (
        "wgmma.mma_async" in out["ptx"]["_up_gemm_kernel"]
        and "wgmma.mma_async" in out["ptx"]["_down_gemm_kernel"]
    )


@pytest.mark.slow
@pytest.mark.skipif(
    CUDA, reason="the interpreter's form of test_gpu_fp8_model_kernels_against_the_reference_path"
)
def test_model_runs_the_kernels_in_place_of_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tiny model in bfloat16 with FP8 projections, once on the reference op and once with the Triton
    kernels put in its place (the interpreter on CPU): a 24-token prefill (w8a8) and decode steps (w8a16)
    give the same logits within FP8 activation rounding, and the same greedy tokens."""
    from hyserve.config import build_engine_config
    from hyserve.engine.runner.model_loader import load_model
    from hyserve.kernels import ops
    from tests.model_harness import Harness

    lm = load_model(build_engine_config({"device": "cpu", "dtype": "bfloat16", "quantization": "fp8"}))
    prompt = list(range(4, 28))

    def run() -> torch.Tensor:
        h = Harness(lm.model, max_seqs=2, max_len=64)
        rows = [h.step([(0, prompt)], all_logits=True)]
        for t in (7, 9, 11):
            rows.append(h.step([(0, [t])]))
        return torch.cat(rows).float()

    ref = run()
    monkeypatch.setattr(ops.fp8_linear, "ref", t8.fp8_linear_triton)
    monkeypatch.setattr(ops.fp8_relu2_linear, "ref", t8.fp8_relu2_linear_triton)
    got = run()
    n = len(prompt)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    # the prefill quantises activations to e4m3 (a few per cent a layer); decode keeps them 16-bit
    print(f"prefill {rel(got[:n], ref[:n]):.4f}, decode {rel(got[n:], ref[n:]):.4f}")
    assert 0 < rel(got[:n], ref[:n]) < 0.12
    assert 0 < rel(got[n:], ref[n:]) < 0.12
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


@pytest.mark.slow
@pytest.mark.skipif(
    CUDA,
    reason="the dry run is the CPU form (the Triton interpreter); on a GPU "
    "scripts/gpu_fp8_check.sh runs the real suite, and the GPU image's numpy 2.5 breaks the interpreter's "
    "scalar loop bounds",
)
def test_bench_kernels_fp8_suite_runs_and_checks_first(tmp_path) -> None:
    """`bench_kernels.py --only fp8_linear` (dry run: interpreter, tiny shapes): every case passes its check
    against float64 before it is timed, and each record carries the bf16 time of the same run."""
    import json
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "k.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_kernels",
            "--dry-run",
            "--only",
            "fp8_linear",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,  # benchmarks.bench_kernels is found from the repository root
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert not doc["failures"] and len(doc["records"]) == 8
    for rec in doc["records"]:
        assert rec["name"].startswith("fp8 ") and rec["bf16_ms"] > 0 and rec["speedup_vs_bf16"] > 0


@gpu
@pytest.mark.parametrize("variant", ["dense", "latent-moe"])
def test_gpu_fp8_model_kernels_against_the_reference_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path, variant
) -> None:
    """On the GPU, a bf16 tiny model with FP8 projections (and FP8 experts): the Triton FP8 linear and MoE
    kernels against the same model on the reference ops (dequantise + matmul, the per-expert loop)."""
    from hyserve.config import build_engine_config
    from hyserve.engine.runner.model_loader import load_model
    from hyserve.kernels import ops
    from hyserve.model.tiny import make_tiny
    from tests.model_harness import Harness

    d = make_tiny(tmp_path / variant, variant=variant)
    lm = load_model(
        build_engine_config({"model": str(d), "device": "cuda", "dtype": "bfloat16", "quantization": "fp8"})
    )
    prompt = list(range(4, 40))

    def run() -> torch.Tensor:
        h = Harness(lm.model, max_seqs=2, max_len=64)
        rows = [h.step([(0, prompt)], all_logits=True)]
        rows += [h.step([(0, [t])]) for t in (7, 9, 11)]
        return torch.cat(rows).float()

    got = run()
    with ops.reference_on_cuda(ops.fp8_linear, ops.fp8_relu2_linear, ops.moe_experts):
        ref = run()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert 0 < rel < 0.12, rel
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.8


def test_one_row_takes_the_fma_gemv_and_more_rows_the_dot_forms(monkeypatch):
    """Batch-1 decode runs the one-row GEMV (the dot form padded M to 16 rows: 0.15 of the FP8 weight-read
    roofline on the H200); 2..SMALL_M rows the w8a16 form, more the w8a8 one."""
    taken: list[tuple[str, int]] = []
    for name in ("gemv_fp8", "_w8a16", "_w8a8"):
        real = getattr(t8, name)
        monkeypatch.setattr(
            t8, name, lambda x, *a, _n=name, _r=real, **k: taken.append((_n, x.shape[0])) or _r(x, *a, **k)
        )
    q, s = _weight(40, 64, "channel")
    for m in (1, 2, t8.SMALL_M, t8.SMALL_M + 1):
        t8.fp8_linear_triton(_x(m, 64, BF16), q, s, None)
    assert taken == [("gemv_fp8", 1), ("_w8a16", 2), ("_w8a16", t8.SMALL_M), ("_w8a8", t8.SMALL_M + 1)]
    assert t8.fp8_token_buckets(8192) == [1, 2, t8.SMALL_M + 1, 65]
