"""Stochastic rounding of the float16 SSM state: the reference's rounding rule and Philox stream, the Triton
kernels bit for bit against it (under TRITON_INTERPRET=1 without CUDA; the `gpu` cases at the Nemotron
Nano 9B v2 shapes, 128 heads x 80 x 128 state), the model and engine with it switched on, and the reason
it exists: over many decode steps it tracks the float32 state better than round-to-nearest.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET could be set", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the reference tests still run
    triton = None

from hyserve import LLM, SamplingParams  # noqa: E402
from hyserve.config import MAX_PHILOX_ROUNDS, build_engine_config  # noqa: E402
from hyserve.kernels import ops  # noqa: E402
from hyserve.kernels import stochastic_rounding as sr_mod  # noqa: E402
from hyserve.kernels.ssm_update import selective_state_update_ref  # noqa: E402
from hyserve.kernels.stochastic_rounding import (  # noqa: E402
    StochasticRounding,
    philox4x32,
    state_random_bits,
    stochastic_round_fp16,
    stochastic_round_state,
    store_ssm_state_ref,
)
from hyserve.model.forward_meta import SnapshotWrite  # noqa: E402
from hyserve.model.nemotron_h.config import HybridModelConfig  # noqa: E402
from hyserve.model.nemotron_h.model import NemotronHForCausalLM  # noqa: E402
from hyserve.model.tiny import builtin_model_dir  # noqa: E402
from tests.model_harness import Harness, strong_random_weights  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
needs_triton = pytest.mark.skipif(triton is None, reason="triton is not installed")
F16 = torch.float16
U32 = 2**32


TORCH_SEED = 1234  # conftest seeds torch before each test


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def draws(*shape: int, device=None) -> torch.Tensor:
    return torch.randint(0, U32, shape, dtype=torch.int64, device=device)


def neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent oracle: the float16 grid points below and above float32 x (finite, |x| <= 65504), as
    float32."""
    _, e = torch.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
    ulp = torch.exp2((torch.clamp(e - 1, min=-14) - 10).float())
    lo = torch.floor(x / ulp) * ulp
    return lo, lo + ulp


# --------------------------------------------------------------------------- Philox


def test_philox_known_answers() -> None:
    """Random123's philox4x32-10 known-answer vectors (counter, key -> output)."""
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((U32 - 1,) * 4, (U32 - 1, U32 - 1), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for ctr, (k0, k1), want in cases:
        got = philox4x32(*(torch.tensor([c]) for c in ctr), key=k0 | (k1 << 32), rounds=10)
        assert tuple(int(w) for w in got) == want


if triton is not None:

    @triton.jit(do_not_specialize=["seed"])
    def _randint4x_kernel(out_ptr, offs_ptr, seed, n, ROUNDS: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        m = i < n
        off = tl.load(offs_ptr + i, mask=m, other=0)
        r0, r1, r2, r3 = tl.randint4x(seed, off, ROUNDS)
        tl.store(out_ptr + i * 4, r0.to(tl.int64), mask=m)
        tl.store(out_ptr + i * 4 + 1, r1.to(tl.int64), mask=m)
        tl.store(out_ptr + i * 4 + 2, r2.to(tl.int64), mask=m)
        tl.store(out_ptr + i * 4 + 3, r3.to(tl.int64), mask=m)


@needs_triton
@pytest.mark.parametrize("rounds", [3, 10])
@pytest.mark.parametrize("seed", [0, 2**40 + 7])
def test_philox_matches_triton_randint4x(rounds: int, seed: int) -> None:
    """tl.randint4x(seed, offset) is Philox with counter (offset lo, offset hi, 0, 0) and key seed."""
    offs = torch.tensor([0, 1, 5, 2**31 + 3, 2**32 + 9, 2**45 + 2**33 + 17], dtype=torch.int64, device=DEV)
    out = torch.empty(len(offs), 4, dtype=torch.int64, device=DEV)
    _randint4x_kernel[(1,)](out, offs, seed, len(offs), ROUNDS=rounds, BLOCK=8)
    zero = torch.zeros_like(offs)
    want = philox4x32(offs & (U32 - 1), offs >> 32, zero, zero, key=seed, rounds=rounds)
    assert torch.equal(out, torch.stack(want, dim=1))


def test_stream_depends_on_seed_layer_position_rounds_only() -> None:
    shape = (2, 3, 5, 7)
    pos = torch.tensor([11, 12])
    base = StochasticRounding(seed=5, layer=2, rounds=10)
    r = state_random_bits(shape, pos, base)
    assert r.shape == shape and r.dtype == torch.int64
    assert int(r.min()) >= 0 and int(r.max()) < U32
    assert torch.equal(
        r, state_random_bits(shape, pos.clone(), StochasticRounding(seed=5, layer=2, rounds=10))
    )
    # the key is the seed mod 2**64 (negative seeds are fine)
    assert torch.equal(r, state_random_bits(shape, pos, StochasticRounding(seed=5 + 2**64, layer=2)))
    assert StochasticRounding(seed=-1).key == 2**64 - 1
    # every element of both rows draws its own number
    assert r.unique().numel() == r.numel()
    for other in (
        state_random_bits(shape, pos + 1, base),
        state_random_bits(shape, pos, StochasticRounding(seed=6, layer=2)),
        state_random_bits(shape, pos, StochasticRounding(seed=5, layer=3)),
        state_random_bits(shape, pos, StochasticRounding(seed=5, layer=2, rounds=7)),
    ):
        assert (other == r).float().mean() < 0.01
    # a row's draws depend on its own position only (not on the other rows or the row order)
    assert torch.equal(state_random_bits((1, 3, 5, 7), pos[1:], base)[0], r[1])
    # element (h, p, n) is word n % 4 of counter group (h * P + p) * ceil(N / 4) + n // 4
    h, p, n = 2, 4, 6
    g = (h * 5 + p) * 2 + n // 4
    words = philox4x32(torch.tensor([g]), torch.tensor([12]), torch.tensor([2]), torch.tensor([0]), key=5)
    assert int(r[1, h, p, n]) == int(words[n % 4])


def test_rounding_config_is_validated() -> None:
    with pytest.raises(ValueError, match="rounds"):
        StochasticRounding(seed=0, rounds=0)
    with pytest.raises(ValueError, match="rounds"):
        StochasticRounding(seed=0, rounds=sr_mod.MAX_PHILOX_ROUNDS + 1)
    assert sr_mod.MAX_PHILOX_ROUNDS == MAX_PHILOX_ROUNDS
    for rounds in (0, MAX_PHILOX_ROUNDS + 1):
        with pytest.raises(ValueError, match="mamba_ssm_philox_rounds"):
            build_engine_config(
                kv_cache_config={
                    "mamba_ssm_cache_dtype": "float16",
                    "mamba_ssm_stochastic_rounding": True,
                    "mamba_ssm_philox_rounds": rounds,
                }
            )
    cfg = build_engine_config(
        kv_cache_config={
            "mamba_ssm_cache_dtype": "float16",
            "mamba_ssm_stochastic_rounding": True,
            "mamba_ssm_philox_rounds": 4,
        }
    )
    assert cfg.cache.mamba_ssm_philox_rounds == 4 and cfg.ignored_keys == ()
    model_cfg = HybridModelConfig.from_hf(builtin_model_dir())
    with pytest.raises(ValueError, match="float16"):
        model_cfg.with_cache_dtypes(ssm_cache_dtype="bfloat16", ssm_stochastic_rounding=True)
    on = model_cfg.with_cache_dtypes(
        ssm_cache_dtype="float16", ssm_stochastic_rounding=True, ssm_rounding_seed=3
    )
    assert on.mamba_cache_spec().ssm_stochastic_rounding and on.ssm_rounding_seed == 3
    assert on.mamba_cache_spec().ssm_bytes * 2 == model_cfg.mamba_cache_spec().ssm_bytes


# --------------------------------------------------------------------------- the rounding rule


def test_float16_values_are_unchanged() -> None:
    h = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(F16)
    finite = ~torch.isnan(h)
    x = h[finite].float()
    for r in (draws(x.numel()), torch.zeros(x.numel(), dtype=torch.int64), torch.full((x.numel(),), U32 - 1)):
        assert torch.equal(bits(stochastic_round_fp16(x, r)), bits(h[finite]))


def test_threshold_is_exact() -> None:
    """Round away from zero iff r < 2**32 * (fraction of the spacing beyond the lower neighbour)."""
    spacing = 2.0**-10
    for k in (1, 1000, 8191):  # k / 2**13 of an ulp above 1.0
        x = torch.tensor([1.0 + k * spacing / 2**13, -(1.0 + k * spacing / 2**13)])
        t = k << 19
        assert stochastic_round_fp16(x, torch.full((2,), t - 1)).tolist() == [1 + spacing, -(1 + spacing)]
        assert stochastic_round_fp16(x, torch.full((2,), t)).tolist() == [1.0, -1.0]
    # subnormal range: 5.25 units of 2**-24 -> 6 units iff r < 2**30
    x = torch.tensor([5.25 * 2.0**-24])
    assert stochastic_round_fp16(x, torch.tensor([2**30 - 1])).item() == 6 * 2.0**-24
    assert stochastic_round_fp16(x, torch.tensor([2**30])).item() == 5 * 2.0**-24


def test_special_values() -> None:
    nan = float("nan")
    x = torch.tensor(
        [
            nan,
            -nan,
            float("inf"),
            -float("inf"),
            65504.0,
            65519.0,
            65520.0,
            1e5,
            3e38,
            -3e38,
            -65535.9,
            0.0,
            -0.0,
            1e-45,
            -1e-45,
        ]
    )
    for r in (torch.zeros(x.numel(), dtype=torch.int64), torch.full((x.numel(),), U32 - 1), draws(x.numel())):
        out = stochastic_round_fp16(x, r)
        b = bits(out).tolist()
        assert b[0] == 0x7E00 and b[1] == -0x200  # quiet NaN, sign kept (0xFE00)
        assert out[2:4].tolist() == [float("inf"), -float("inf")]
        assert out[4:11].tolist() == [65504.0] * 5 + [-65504.0] * 2  # saturating, never inf
        assert b[11:13] == [0, -0x8000]  # +0, -0
    # fp32 subnormals: 0 or the smallest fp16 subnormal, with their (tiny) probability
    tiny = stochastic_round_fp16(torch.tensor([1e-45, 2.0**-25]), torch.zeros(2, dtype=torch.int64))
    assert tiny.tolist() == [0.0, 2.0**-24]
    # the largest subnormal rounds up into the smallest normal
    x = torch.tensor([2.0**-14 - 2.0**-26])
    assert stochastic_round_fp16(x, torch.zeros(1, dtype=torch.int64)).item() == 2.0**-14
    assert stochastic_round_fp16(x, torch.full((1,), U32 - 1)).item() == 1023 * 2.0**-24


def _values() -> torch.Tensor:
    """Values across the whole float16 range, normal and subnormal, both signs, none of them on the grid."""
    g = torch.Generator().manual_seed(7)
    mags = torch.exp2(torch.empty(40).uniform_(-30, 15.9, generator=g))
    x = torch.cat([mags, -mags, torch.tensor([1 + 0.3 * 2.0**-10, 0.3 * 2.0**-24, 1000.7, 2.0**-14 * 0.999])])
    lo, hi = neighbours(x)
    return x[(x != lo) & (x != hi)]


def test_only_the_two_neighbours_and_unbiased() -> None:
    x = _values()
    n = 4000
    xs = x[:, None].expand(-1, n).contiguous()
    out = stochastic_round_fp16(xs, draws(*xs.shape)).float()
    lo, hi = neighbours(xs)
    assert ((out == lo) | (out == hi)).all(), "a value other than the two float16 neighbours"
    p = ((x - lo[:, 0]) / (hi[:, 0] - lo[:, 0])).double()
    mean_frac = ((out - lo) / (hi - lo)).double().mean(dim=1)
    sigma = torch.sqrt(p * (1 - p) / n)
    assert ((mean_frac - p).abs() <= 5 * sigma + 1e-9).all(), (mean_frac - p).abs().max()


def test_the_philox_stream_is_unbiased_too() -> None:
    """The mean of a constant state rounded with the real stream (many elements and positions) is the
    value."""
    for v in (1 + 0.3 * 2.0**-10, -(0.7 + 0.01 * 2.0**-11), 3.3 * 2.0**-24):
        states = torch.full((8, 4, 16, 32), v)
        pos = torch.arange(8) * 1000 + 3
        out = stochastic_round_state(states, pos, StochasticRounding(seed=9, layer=1)).float()
        lo, hi = neighbours(torch.tensor([v]))
        p = (v - lo.item()) / (hi.item() - lo.item())
        frac = ((out - lo) / (hi - lo)).double().mean().item()
        assert abs(frac - p) <= 5 * math.sqrt(p * (1 - p) / out.numel()), (v, frac, p)


# --------------------------------------------------------------------------- reference ops


def _decode_inputs(Bt: int, H: int, P: int, N: int, G: int, device=DEV, dtype=torch.float32):
    x = torch.randn(Bt, H, P, device=device).to(dtype)
    dt = torch.randn(Bt, H, device=device).to(dtype)
    A = -torch.rand(H, device=device) * 4 - 0.1
    B = torch.randn(Bt, G, N, device=device).to(dtype)
    C = torch.randn(Bt, G, N, device=device).to(dtype)
    kw = dict(
        D=torch.randn(H, device=device).to(dtype),
        dt_bias=torch.randn(H, device=device).to(dtype),
        dt_softplus=True,
    )
    return x, dt, A, B, C, kw


def test_store_op_reference() -> None:
    pool = torch.randn(6, 2, 3, 5).half()
    states = torch.randn(2, 2, 3, 5) * 100
    slots = torch.tensor([4, 1])
    pos = torch.tensor([17, 3])
    rne = pool.clone()
    store_ssm_state_ref(rne, states, slots)
    assert torch.equal(bits(rne[slots]), bits(states.half()))
    sr = StochasticRounding(seed=1, layer=4)
    a = pool.clone()
    store_ssm_state_ref(a, states, slots, rounding=sr, positions=pos)
    assert torch.equal(bits(a[slots]), bits(stochastic_round_state(states, pos, sr)))
    assert not torch.equal(bits(a[slots]), bits(rne[slots]))
    others = torch.tensor([0, 2, 3, 5])
    assert torch.equal(bits(a[others]), bits(pool[others]))
    with pytest.raises(AssertionError, match="float16"):
        store_ssm_state_ref(pool.float(), states, slots, rounding=sr, positions=pos)


def test_state_update_reference_rounds_its_fp32_state() -> None:
    Bt, H, P, N, G = 3, 4, 6, 8, 2
    x, dt, A, B, C, kw = _decode_inputs(Bt, H, P, N, G, device="cpu")
    pool = torch.randn(5, H, P, N).half()
    src, dst, pos = (
        torch.tensor([0, 1, 2]),
        torch.tensor([0, 3, 4]),
        torch.tensor([9, 40, 2], dtype=torch.int32),
    )
    sr = StochasticRounding(seed=2, layer=1, rounds=6)
    f32 = pool.float()
    y32 = selective_state_update_ref(f32, x, dt, A, B, C, src, dst, **kw)
    a = pool.clone()
    y = selective_state_update_ref(a, x, dt, A, B, C, src, dst, **kw, rounding=sr, positions=pos)
    assert torch.equal(y, y32), "y comes from the float32 state, whatever the storage"
    assert torch.equal(bits(a[dst]), bits(stochastic_round_state(f32[dst], pos, sr)))


# --------------------------------------------------------------------------- Triton kernels


@pytest.fixture
def tri():
    if triton is None:
        pytest.skip("triton is not installed")
    from hyserve.kernels import triton_ssm_update, triton_stochastic_rounding

    return triton_ssm_update, triton_stochastic_rounding


def _special_states(R: int, H: int, P: int, N: int, device=DEV) -> torch.Tensor:
    """Random states over many magnitudes, with NaN/inf/overflow/subnormal/zero entries mixed in."""
    states = torch.randn(R, H, P, N, device=device) * torch.exp2(
        torch.randint(-30, 17, (R, H, P, N), device=device)
    )
    flat = states.view(-1)
    specials = torch.tensor(
        [
            float("nan"),
            float("inf"),
            -float("inf"),
            1e9,
            -70000.0,
            65519.0,
            0.0,
            -0.0,
            1e-40,
            3e-8,
            -(2.0**-14),
        ],
        device=device,
    )
    idx = torch.randperm(flat.numel(), device=device)[: specials.numel()]
    flat[idx] = specials
    return states


def _store_case(tri, *, R, H, P, N, seed, layer, rounds, pos_dtype=torch.int32, strided=False):
    _, trs = tri
    slots_n = 2 * R + 2
    pool = torch.randn(slots_n, H, P, N, device=DEV).half()
    big = _special_states(R + 1, H, P + 3 if strided else P, N)
    states = big[1:, :, :P] if strided else big[1:]  # a view with gaps between rows / heads
    slots = torch.randperm(slots_n, device=DEV)[:R]
    pos = torch.randint(0, 2**31, (R,), device=DEV).to(pos_dtype)
    sr = StochasticRounding(seed=seed, layer=layer, rounds=rounds)
    ref, out = pool.clone(), pool.clone()
    store_ssm_state_ref(ref, states, slots, rounding=sr, positions=pos)
    trs.store_ssm_state_triton(out, states, slots, rounding=sr, positions=pos)
    assert torch.equal(bits(out), bits(ref)), f"{(bits(out) != bits(ref)).sum().item()} elements differ"


@pytest.mark.parametrize(
    "R,H,P,N,seed,layer,rounds",
    [
        (3, 2, 5, 16, 0, 0, 10),
        (2, 3, 4, 7, 2**40 + 5, 17, 7),
        (1, 1, 3, 2, -3, 1, 1),
        (2, 2, 3, 12, 2**64 - 1, 5, 10),
    ],
)
def test_triton_store_matches_reference(tri, R, H, P, N, seed, layer, rounds) -> None:
    _store_case(tri, R=R, H=H, P=P, N=N, seed=seed, layer=layer, rounds=rounds)


def test_triton_store_strided_states_int64_positions(tri) -> None:
    _store_case(tri, R=2, H=2, P=6, N=16, seed=11, layer=3, rounds=10, pos_dtype=torch.int64, strided=True)


def test_triton_store_without_rounding_is_the_indexed_copy(tri) -> None:
    _, trs = tri
    pool = torch.randn(5, 2, 3, 8, device=DEV).half()
    states = torch.randn(2, 2, 3, 8, device=DEV) * 1000
    slots = torch.tensor([3, 0], device=DEV)
    ref, out = pool.clone(), pool.clone()
    store_ssm_state_ref(ref, states, slots)
    trs.store_ssm_state_triton(out, states, slots)
    assert torch.equal(bits(out), bits(ref))


def _update_case(tri, *, Bt, H, P, N, G, n_pad=0, x_dtype=torch.float32, seed=3, layer=2, rounds=10):
    """The SR kernel stores exactly the reference's rounding of the kernel's own float32 state (taken from a
    float32-pool run of the same kernel); against the all-reference path the float32 states may differ in
    the last bits (exp, FMA), so there a rare element may sit one float16 step away."""
    tsu, _ = tri
    n_real = Bt - n_pad
    slots_n = 2 * Bt + 3
    pad_slot = slots_n - 1
    pool = (torch.randn(slots_n, H, P, N, device=DEV) * 3).half()
    perm = torch.randperm(slots_n - 1, device=DEV)
    src, dst = perm[:Bt].clone(), perm[Bt : 2 * Bt].clone()
    dst[: n_real // 2] = src[: n_real // 2]
    src[n_real:] = pad_slot
    dst[n_real:] = pad_slot
    pos = torch.randint(1, 100000, (Bt,), device=DEV, dtype=torch.int32)
    x, dt, A, B, C, kw = _decode_inputs(Bt, H, P, N, G, dtype=x_dtype)
    sr = StochasticRounding(seed=seed, layer=layer, rounds=rounds)

    f32 = pool.float()
    y32 = tsu.selective_state_update_triton(f32, x, dt, A, B, C, src, dst, **kw)
    out = pool.clone()
    y = tsu.selective_state_update_triton(out, x, dt, A, B, C, src, dst, **kw, rounding=sr, positions=pos)
    real = dst[:n_real]
    want = stochastic_round_state(f32[real], pos[:n_real], sr)
    assert torch.equal(bits(out[real]), bits(want)), f"{(bits(out[real]) != bits(want)).sum().item()} differ"
    # y sums over N in the kernel: the float16-pool variant is a different compiled program and may sum in
    # another order, so a bf16 y may land one bf16 step away; a float32 y agrees to float32 rounding
    ytol = dict(rtol=1e-5, atol=1e-5) if y.dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
    torch.testing.assert_close(y[:n_real], y32[:n_real], **ytol)
    untouched = torch.ones(slots_n, dtype=torch.bool, device=DEV)
    untouched[real] = False
    untouched[pad_slot] = False
    assert torch.equal(bits(out[untouched]), bits(pool[untouched]))

    ref = pool.clone()
    selective_state_update_ref(ref, x, dt, A, B, C, src, dst, **kw, rounding=sr, positions=pos)
    diff = bits(out[real]) != bits(ref[real])
    assert diff.float().mean() < 0.01
    # the two float32 states differ by float32 rounding of the update's terms (exp, FMA); where the terms
    # cancel, that is more than a float16 step of the small result, so the bound is one float16 step of
    # the value plus float32 rounding of the largest term (|state * dA| or |dt * B * x|)
    terms = torch.maximum(pool[src[:n_real]].float().abs().amax(), (f32[real].abs().amax()))
    lo, hi = neighbours(ref[real].float().clamp(-65504, 65504))
    slack = (hi - lo) + 2**-20 * terms
    ok = (out[real].float() >= lo - slack) & (out[real].float() <= hi + slack)
    assert ok.all(), f"{(~ok).sum().item()} elements beyond one float16 step"


@pytest.mark.parametrize("Bt,n_pad", [(1, 0), (5, 2)])
def test_triton_state_update_matches_reference(tri, Bt, n_pad) -> None:
    _update_case(tri, Bt=Bt, H=4, P=12, N=16, G=2, n_pad=n_pad)


def test_triton_state_update_odd_sizes_16bit_inputs(tri) -> None:
    _update_case(tri, Bt=3, H=3, P=5, N=6, G=1, x_dtype=torch.float16, seed=-8, layer=40, rounds=4)


@gpu
@needs_cuda
def test_triton_store_nano9b(tri) -> None:
    _store_case(tri, R=3, H=128, P=80, N=128, seed=2**33 + 1, layer=27, rounds=10)


@gpu
@needs_cuda
@pytest.mark.parametrize("Bt,n_pad", [(1, 0), (16, 3)])
def test_triton_state_update_nano9b(tri, Bt, n_pad) -> None:
    _update_case(tri, Bt=Bt, H=128, P=80, N=128, G=8, n_pad=n_pad, x_dtype=torch.bfloat16)


@gpu
@needs_cuda
def test_triton_state_update_sr_is_graph_capturable(tri) -> None:
    """Positions come from device memory: one captured launch replays with each step's positions."""
    tsu, _ = tri
    Bt, H, P, N, G = 4, 128, 80, 128, 8
    pool = torch.randn(Bt + 1, H, P, N, device=DEV).half()
    slots = torch.arange(Bt, device=DEV)
    pos = torch.tensor([5, 300, 1000, 17], dtype=torch.int32, device=DEV)
    x, dt, A, B, C, kw = _decode_inputs(Bt, H, P, N, G, dtype=torch.bfloat16)
    sr = StochasticRounding(seed=123, layer=9)
    work = pool.clone()
    tsu.selective_state_update_triton(work, x, dt, A, B, C, slots, slots, **kw, rounding=sr, positions=pos)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = tsu.selective_state_update_triton(
            work, x, dt, A, B, C, slots, slots, **kw, rounding=sr, positions=pos
        )
    for step in range(3):
        pos.add_(1)
        before = work.clone()
        g.replay()
        torch.cuda.synchronize()
        eager = before.clone()
        y_e = tsu.selective_state_update_triton(
            eager, x, dt, A, B, C, slots, slots, **kw, rounding=sr, positions=pos.clone()
        )
        assert torch.equal(bits(work), bits(eager)), f"replay {step}"
        assert torch.equal(y, y_e)


# --------------------------------------------------------------------------- why: error accumulation


def _accumulated_errors(update, *, steps, Bt, H, P, N, G, device, seed=0) -> dict[str, float]:
    """Mean |state - fp32 state| after `steps` decode steps, for float16 round-to-nearest and stochastic
    rounding. The regime where rounding matters: slow heads (decay exp(dt * A) within 1e-3..1e-5 of 1) with
    small inputs, so the per-step change is often below half a float16 ulp and round-to-nearest loses it;
    the state starts from a float16 state carried over from a prefill."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    A = -torch.exp(torch.empty(H).uniform_(math.log(0.01), math.log(0.1), generator=g)).to(device)
    dt = torch.exp(torch.empty(H).uniform_(math.log(1e-3), math.log(1e-2), generator=g))
    dt = dt.expand(Bt, H).contiguous().to(device)
    init = torch.randn(Bt, H, P, N, generator=g).half().to(device)
    pools = {"f32": init.float(), "rne": init.clone(), "sr": init.clone()}
    slots = torch.arange(Bt, device=device)
    sr = StochasticRounding(seed=seed, layer=0)
    for step in range(steps):
        x = (0.1 * torch.randn(Bt, H, P, generator=g)).to(device)
        B = torch.randn(Bt, G, N, generator=g).to(device)
        C = torch.randn(Bt, G, N, generator=g).to(device)
        pos = torch.full((Bt,), step + 1, dtype=torch.int32, device=device)
        for name, pool in pools.items():
            kw = dict(rounding=sr, positions=pos) if name == "sr" else {}
            update(pool, x, dt, A, B, C, slots, slots, dt_softplus=False, **kw)
    ref = pools["f32"]
    return {k: (pools[k].float() - ref).abs().mean().item() for k in ("rne", "sr")}


def test_stochastic_rounding_tracks_the_fp32_state_better() -> None:
    err = _accumulated_errors(selective_state_update_ref, steps=1000, Bt=2, H=4, P=8, N=16, G=1, device="cpu")
    assert err["sr"] < err["rne"] / 2, err


@gpu
@needs_cuda
def test_stochastic_rounding_tracks_better_nano9b(tri) -> None:
    tsu, _ = tri
    err = _accumulated_errors(
        tsu.selective_state_update_triton, steps=1000, Bt=2, H=128, P=80, N=128, G=8, device=DEV
    )
    assert err["sr"] < err["rne"] / 2, err


# --------------------------------------------------------------------------- model and engine


def _tiny_model(**cache) -> NemotronHForCausalLM:
    cfg = HybridModelConfig.from_hf(builtin_model_dir()).with_cache_dtypes(**cache)
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    strong_random_weights(model, cfg, seed=3)
    return model.eval()


def test_model_snapshot_and_slot_invariance_with_rounding() -> None:
    """The stream has no slot in it: the same tokens in two slots get the same bits, and a snapshot holds
    the bits of the live state at its position (at the end of a prefill and at a chunk boundary in it)."""
    model = _tiny_model(ssm_cache_dtype="float16", ssm_stochastic_rounding=True, ssm_rounding_seed=5)
    cfg = model.config
    assert cfg.ssm_stochastic_rounding and cfg.ssm_cache_dtype == F16
    h = Harness(model, max_seqs=4, max_len=64, bs=4)
    toks = [1, 40, 41, 42, 7, 8, 9, 10, 11, 12, 13]
    snap_slot, mid_slot, mid = 6, 7, cfg.chunk_size
    assert mid < len(toks)
    h.step(
        [(0, toks), (2, toks)],
        snapshots=[
            SnapshotWrite(seq=0, num_tokens=len(toks), slot=snap_slot),
            SnapshotWrite(seq=1, num_tokens=mid, slot=mid_slot),
        ],
    )
    for i in cfg.mamba_layer_ids:  # the end-of-prefill snapshot holds the live state's bits
        assert torch.equal(bits(h.cache.ssm[i][snap_slot]), bits(h.cache.ssm[i][0]))
    h.step([(0, [50]), (2, [50])])  # a decode step
    # the same prompt alone in two slots (one sequence per batch, so the float32 math is the same; two
    # rows of one CPU batch may differ in the last float32 bits, seen with torch 2.11): the same bits
    h2, h3 = Harness(model, max_seqs=4, max_len=64, bs=4), Harness(model, max_seqs=4, max_len=64, bs=4)
    for sid, hh in ((1, h2), (2, h3)):
        hh.step([(sid, toks)])
        hh.step([(sid, [50])])
    for i in cfg.mamba_layer_ids:
        assert h.cache.ssm[i].dtype == F16
        assert torch.equal(bits(h2.cache.ssm[i][1]), bits(h3.cache.ssm[i][2]))
    h2 = Harness(model, max_seqs=4, max_len=64, bs=4)
    h2.step([(1, toks)])
    h2.step([(3, toks[:mid])])
    for i in cfg.mamba_layer_ids:
        # the same prompt alone in a batch: float32 matmuls over a different batch may differ in the last
        # bits (seen with torch 2.11's CPU kernels), so a rare element sits on the other float16 neighbour
        alone = h2.cache.ssm[i][1]
        assert (bits(h.cache.ssm[i][snap_slot]) != bits(alone)).float().mean() < 0.02
        torch.testing.assert_close(h.cache.ssm[i][snap_slot].float(), alone.float(), rtol=2e-3, atol=1e-5)
        # a chunk-boundary state of an 11-token pass and the final state of an 8-token pass differ in the
        # last float32 bits after the first layer, so a rare element lands on the other float16 neighbour
        # (a wrong position would redraw every element: about a third of them would differ)
        mid_snap, live = h.cache.ssm[i][mid_slot], h2.cache.ssm[i][3]
        assert (bits(mid_snap) != bits(live)).float().mean() < 0.02
        torch.testing.assert_close(mid_snap.float(), live.float(), rtol=2e-3, atol=1e-5)
    # and it really is stochastic rounding: round-to-nearest stores other bits
    rne = Harness(_tiny_model(ssm_cache_dtype="float16"), max_seqs=4, max_len=64, bs=4)
    rne.step([(1, toks)])
    assert any(
        not torch.equal(bits(rne.cache.ssm[i][1]), bits(h2.cache.ssm[i][1])) for i in cfg.mamba_layer_ids
    )


SR_KV = {
    "mamba_ssm_cache_dtype": "float16",
    "mamba_ssm_stochastic_rounding": True,
    "mamba_ssm_philox_rounds": 7,
    "tokens_per_block": 8,
    "max_gpu_total_bytes": 64 * 2**20,
    "mamba_state_config": {"periodic_snapshot_interval": 16, "additional_snapshot_offsets_from_end": [0]},
}


def test_llm_with_fp16_stochastic_rounding_is_deterministic(monkeypatch) -> None:
    calls = {"ssm_update": 0, "store_ssm_state": 0}
    for name in calls:
        real = getattr(ops, name).ref

        def spy(*a, _real=real, _name=name, **k):
            if k.get("rounding") is not None:
                assert k["rounding"].rounds == 7 and k["positions"] is not None
                calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(getattr(ops, name), "ref", spy)

    prompts = [[1] + [(7 * i + j) % 300 + 3 for j in range(n)] for i, n in enumerate((5, 23, 40))]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    runs = []
    for _ in range(2):
        llm = LLM(device="cpu", max_batch_size=4, max_num_tokens=32, seed=11, kv_cache_config=SR_KV)
        assert llm.engine.model_config.ssm_stochastic_rounding
        assert all(t.dtype == F16 for t in llm.engine.cache_tensors.ssm.values())
        runs.append([o.token_ids for o in llm.generate(prompts, greedy)])
    assert runs[0] == runs[1]
    assert all(len(t) == 12 for t in runs[0])
    assert calls["ssm_update"] > 0 and calls["store_ssm_state"] > 0


def test_each_mamba_layer_has_its_own_stream() -> None:
    model = _tiny_model(ssm_cache_dtype="float16", ssm_stochastic_rounding=True)
    pairs = [
        (blk.layer_id, blk.mixer.ssm_rounding.layer) for blk in model.backbone.layers if blk.kind == "mamba"
    ]
    assert len(pairs) > 1 and all(i == layer for i, layer in pairs), pairs
