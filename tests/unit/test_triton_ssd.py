"""The SSD chunked-scan Triton kernel (`triton_ssd.ssd_triton`) vs the float64 oracles, on fresh random
inputs.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set by
test_triton_kernels before triton is imported; its fixtures are reused here) at small sizes: several
chunks per sequence, partial last chunks, 1-token and 0-token sequences, with and without initial
states. With CUDA the same cases run compiled (plus bf16), and the `gpu` cases add the Nemotron Nano
9B v2 shapes (128 heads x 80, state 128, 8 groups, chunk 128) with bf16 inputs, and check that new
token / sequence / chunk counts compile nothing.

dt is realistic (softplus(dt + bias) ~ 0.02 .. 0.3 with A in -[0.05, 1.5]): states decay over tens of
tokens, so initial states and chunk-boundary states visibly reach later chunks, and neither vanish nor
explode. Every output buffer the launcher allocates is NaN-poisoned (torch.empty is patched).
"""

from __future__ import annotations

import pytest
import torch

from hyserve.kernels.ssd import chunk_offsets_for, ssd_chunked_ref, ssd_naive_ref
from hyserve.kernels.triton_ssd import ssd_triton
from tests.unit import test_triton_kernels as tk

TORCH_SEED = 1234  # conftest seeds torch before each test
pytestmark = tk.pytestmark

CUDA, DEV, F32, F16, BF16 = tk.CUDA, tk.DEV, tk.F32, tk.F16, tk.BF16
gpu, needs_cuda, rnd = tk.gpu, tk.needs_cuda, tk.rnd
# bf16 in tl.dot is wrong under the interpreter (triton 3.6): bf16 runs compiled only.
DTYPES = [F32, F16, BF16] if CUDA else [F32, F16]
# relative to the oracle's largest magnitude: the 16-bit kernels round their matmul operands
TOL = {F32: 1e-4, F16: 2e-3, BF16: 1.6e-2}


def _cu(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _inputs(lens, *, H, P, N, G, dtype, with_init, dt_dtype=F32, param_dtype=F32, init_mask=None, row_pad=8):
    """Random inputs laid out like the model's: x, B, C are views into one packed conv output row
    (row_pad extra columns make the row stride unaligned unless 0), dt a column slice of the in_proj
    output. init_mask zeroes the initial state of some sequences (the model passes zeros where a
    sequence has no cached state)."""
    T, S = sum(lens), len(lens)
    xbc = rnd(T, H * P + 2 * G * N + row_pad, dtype=dtype)
    x = xbc[:, : H * P].view(T, H, P)
    B = xbc[:, H * P : H * P + G * N].view(T, G, N)
    C = xbc[:, H * P + G * N : H * P + 2 * G * N].view(T, G, N)
    dt = (rnd(T, H + 3) * 0.7 - 2.5).to(dt_dtype)[:, :H]
    A = -(torch.rand(H, device=DEV) * 1.45 + 0.05)
    init = None
    if with_init:
        init = rnd(S, H, P, N)
        if init_mask is not None:
            init = torch.where(torch.tensor(init_mask, device=DEV)[:, None, None, None], init, 0.0)
    return dict(
        x=x,
        dt=dt,
        A=A,
        B=B,
        C=C,
        D=rnd(H, dtype=param_dtype),
        dt_bias=rnd(H, dtype=param_dtype, scale=0.5),
        init=init,
    )


def _run(fn, inp, cu, chunk, **kw):
    kw.setdefault("D", inp["D"])
    kw.setdefault("dt_bias", inp["dt_bias"])
    return fn(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, cu, initial_states=inp["init"], **kw)


def _as64(inp):
    return {k: None if v is None else v.to(torch.float64) for k, v in inp.items()}


def _close(actual, expected, tol, what):
    assert torch.isfinite(actual).all(), f"{what}: non-finite values (a missed write or a bad read)"
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}"
    )


def _check(
    poison,
    lens,
    *,
    chunk,
    dtype,
    with_init,
    H=4,
    P=24,
    N=32,
    G=2,
    chunk_states=True,
    oracle=ssd_naive_ref,
    **kw,
):
    cu = _cu(lens)
    T, S = cu[-1], len(lens)
    inp = _inputs(
        lens,
        H=H,
        P=P,
        N=N,
        G=G,
        dtype=dtype,
        with_init=with_init,
        init_mask=kw.pop("init_mask", None),
        dt_dtype=kw.pop("dt_dtype", F32),
        param_dtype=kw.pop("param_dtype", F32),
    )
    with poison:
        got = _run(ssd_triton, inp, cu, chunk, return_chunk_states=chunk_states, **kw)
    kw64 = {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    ref = _run(oracle, _as64(inp), cu, chunk, return_chunk_states=chunk_states, **kw64)

    n_chunks = sum((n + chunk - 1) // chunk for n in lens)
    assert got.y.shape == (T, H, P) and got.y.dtype == dtype
    assert got.final_states.shape == (S, H, P, N) and got.final_states.dtype == F32
    assert got.chunk_offsets == ref.chunk_offsets == chunk_offsets_for(cu, chunk)
    tol = TOL[dtype]
    _close(got.y, ref.y, tol, "y")
    _close(got.final_states, ref.final_states, tol, "final_states")
    if chunk_states:
        assert got.chunk_states is not None and got.chunk_states.shape == (n_chunks, H, P, N)
        assert got.chunk_states.dtype == F32
        _close(got.chunk_states, ref.chunk_states, tol, "chunk_states")
        for s in range(S):  # the last chunk state of a sequence is its final state
            if lens[s]:
                assert torch.equal(got.chunk_states[got.chunk_offsets[s + 1] - 1], got.final_states[s])
    else:
        assert got.chunk_states is None
    for s, n in enumerate(lens):  # a 0-length sequence passes its state through unchanged
        if n == 0:
            expect = torch.zeros(H, P, N, device=DEV) if inp["init"] is None else inp["init"][s]
            assert torch.equal(got.final_states[s], expect)
    return got, ref


# --------------------------------------------------------------------------- small (interpreter on CPU)

SMALL = [
    pytest.param([45], 16, id="1seq-partial-last-chunk"),
    pytest.param([64], 32, id="1seq-exact-multiple"),
    pytest.param([1], 16, id="1seq-1tok"),
    pytest.param([1, 0, 33, 16, 5], 16, id="5seq-1tok-empty-mixed"),
    pytest.param([20, 1, 47], 32, id="3seq-chunk32"),
    pytest.param([21, 1, 16], 8, id="3seq-chunk8-tiny-models"),  # chunk_size < the 16-row tiles
    pytest.param([13, 0, 31], 5, id="3seq-chunk5-not-power-of-2"),
]


@pytest.mark.parametrize(
    "with_init", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["no-init", "init"]
)
@pytest.mark.parametrize("lens,chunk", SMALL)
def test_ssd_small_f32(poison, lens, chunk, with_init):
    _check(poison, lens, chunk=chunk, dtype=F32, with_init=with_init)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != F32])
def test_ssd_small_16bit(poison, dtype):
    # the model's dtypes: x/B/C, dt, D and dt_bias in the activation dtype, A in float32
    _check(
        poison,
        [1, 37, 0, 16],
        chunk=16,
        dtype=dtype,
        with_init=True,
        init_mask=[True, False, True, True],
        dt_dtype=dtype,
        param_dtype=dtype,
    )


def test_ssd_small_without_chunk_states_or_d_or_bias(poison):
    _check(poison, [30, 2], chunk=16, dtype=F32, with_init=True, chunk_states=False, D=None, dt_bias=None)


def test_ssd_small_dt_limit_no_softplus_odd_shapes(poison):
    # P not a multiple of 16, N not a power of 2, one head per group; dt clamped without softplus
    _check(
        poison,
        [19, 40],
        chunk=16,
        dtype=F32,
        with_init=True,
        H=3,
        P=10,
        N=20,
        G=3,
        dt_softplus=False,
        dt_limit=(0.02, 0.2),
    )


def test_ssd_small_matches_chunked_reference_in_its_dtype(poison):
    # the CPU path (the reference at float32) and the kernel agree as closely as each with the oracle
    _check(poison, [50, 3], chunk=16, dtype=F32, with_init=True, oracle=ssd_chunked_ref)


@pytest.mark.parametrize("lens", [[0], [0, 0, 0]])
@pytest.mark.parametrize("with_init", [False, True], ids=["no-init", "init"])
def test_ssd_small_no_tokens(poison, lens, with_init):
    got, _ = _check(poison, lens, chunk=16, dtype=F32, with_init=with_init)
    assert got.y.shape[0] == 0 and got.chunk_states is not None and got.chunk_states.shape[0] == 0


def test_ssd_registered_for_cuda():
    from hyserve.kernels import ops

    names = ops.load_cuda_kernels()
    if CUDA:
        assert "ssd" in names and ops.ssd.get(on_cuda=True) is ssd_triton
    else:
        assert names == [] and ops.ssd.get(on_cuda=False) is ssd_chunked_ref


# --------------------------------------------------------------------------- Nemotron Nano 9B v2 shapes (GPU)

NANO = dict(H=128, P=80, N=128, G=8)


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "lens,with_init,init_mask",
    [
        pytest.param([8192], False, None, id="1x8192"),
        pytest.param([2048], True, None, id="1x2048-init"),
        pytest.param(
            [1, 3000, 517, 129, 0, 1, 2048, 300], True, [1, 1, 0, 1, 1, 0, 1, 1], id="8seq-mixed-init"
        ),
    ],
)
def test_ssd_nano9b_bf16(poison, lens, with_init, init_mask):
    mask = None if init_mask is None else [bool(v) for v in init_mask]
    # the oracle is the chunked reference in float64 (itself checked against the token-by-token one)
    _check(
        poison,
        lens,
        chunk=128,
        dtype=BF16,
        with_init=with_init,
        init_mask=mask,
        oracle=ssd_chunked_ref,
        dt_dtype=BF16,
        param_dtype=BF16,
        **NANO,
    )


@gpu
@needs_cuda
def test_ssd_nano9b_fp32_params(poison):
    # the benchmark's dtypes (and mamba_ssm's): bf16 x/B/C, float32 dt/A/D/dt_bias
    _check(poison, [1000, 77], chunk=128, dtype=BF16, with_init=True, oracle=ssd_chunked_ref, **NANO)


@gpu
@needs_cuda
def test_ssd_new_token_and_sequence_counts_compile_nothing():
    """Once a model shape has run, other token / chunk / sequence counts reuse the same 3 kernels.

    The conv output row is laid out as in the model (row_pad=0: conv_dim = 12288, a multiple of 16
    elements, as in every config in benchmarks/configs). A 1-token input is a view whose row stride torch
    collapses to H*P; with an unaligned row (row_pad > 0) that changes Triton's divisibility
    specialisation, which is a different variant (the warm-up's 1-token prefill case compiles it)."""
    import triton

    def call(lens, chunk_states):
        inp = _inputs(lens, dtype=BF16, with_init=True, dt_dtype=BF16, param_dtype=BF16, row_pad=0, **NANO)
        _run(ssd_triton, inp, _cu(lens), 128, return_chunk_states=chunk_states)

    call([300, 1], True)  # compile
    torch.cuda.synchronize()
    events: list[str] = []
    case: list[object] = [None]
    knobs = triton.knobs.compilation
    previous = knobs.listener
    knobs.listener = lambda *, src, **_: events.append(
        f"{getattr(getattr(src, 'fn', None), '__name__', src)} for {case[0]}"
    )
    try:
        for lens, cs in (
            ([1], False),
            ([16], True),
            ([17, 32, 0, 1], False),
            ([4096, 129, 1, 1, 1], True),
            ([128] * 16, True),
            ([1] * 64, False),
        ):
            case[0] = (lens, cs)
            call(lens, cs)
        torch.cuda.synchronize()
    finally:
        knobs.listener = previous
    assert events == [], f"recompiled for new counts: {events}"


def test_a_steps_host_index_is_copied_once_for_its_layers() -> None:
    """A step's offsets as one `HostIndex` (ForwardMeta.prefill_cu): the scan (and the varlen conv) build
    their device tables at the first layer's launch and reuse them at the next; the results are those of a
    plain list."""
    from hyserve.kernels.host_index import HostIndex
    from hyserve.kernels.triton_conv1d import causal_conv1d_varlen_triton

    lens = [5, 17, 9]
    inp = _inputs(lens, H=4, P=24, N=32, G=2, dtype=F32, with_init=True)
    plain = _run(ssd_triton, inp, _cu(lens), 8)
    cu = HostIndex(_cu(lens))
    first = _run(ssd_triton, inp, cu, 8)
    table = cu.on_device(("ssd chunks", 8), torch.device(DEV), lambda: pytest.fail("not kept"))
    second = _run(ssd_triton, inp, cu, 8)
    assert cu.on_device(("ssd chunks", 8), torch.device(DEV), lambda: pytest.fail("rebuilt")) is table
    for got in (first, second):
        torch.testing.assert_close(got.y, plain.y, rtol=0, atol=0)
        torch.testing.assert_close(got.final_states, plain.final_states, rtol=0, atol=0)
    x = rnd(sum(lens), 40)
    w, b = rnd(40, 4), rnd(40)
    want = causal_conv1d_varlen_triton(x, w, b, _cu(lens))
    got = causal_conv1d_varlen_triton(x, w, b, cu)
    assert cu.on_device("cu", torch.device(DEV), lambda: pytest.fail("not kept")).tolist() == _cu(lens)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
