"""Plain-torch reference kernels (hyserve.kernels.*) against independent oracles.

Every test draws fresh random inputs (never zeros) from a seeded generator and runs in float64 (tight
tolerances: the two sides differ only in summation order) and float32 (loose tolerances, compared with a
float64 oracle on the same values). Pools and caches are poisoned with NaN wherever a kernel must neither
read nor write, and checked bit-for-bit afterwards.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from hyserve.kernels.attention import paged_attention_ref, write_kv_ref
from hyserve.kernels.conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref, conv_state_at
from hyserve.kernels.rmsnorm import rms_norm_ref, rmsnorm_gated_ref
from hyserve.kernels.ssd import chunk_offsets_for, ssd_chunked_ref, ssd_naive_ref
from hyserve.kernels.ssm_update import selective_state_update_ref

torch.set_num_threads(1)

DTYPES = [torch.float64, torch.float32]
TOL = {
    torch.float64: {"atol": 1e-10, "rtol": 1e-9},
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(
    g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64, scale: float = 1.0
) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def cu_of(lens: list[int]) -> list[int]:
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, msg: str = "") -> None:
    torch.testing.assert_close(actual.to(torch.float64), expected.to(torch.float64), **TOL[dtype], msg=msg)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN == NaN), for 'must not have been written' checks."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


# ================================================================================================
# SSD chunked scan
# ================================================================================================
H, P, G, N = 4, 3, 2, 5  # odd sizes so a swapped axis cannot go unnoticed


def ssd_inputs(lens: list[int], dtype: torch.dtype, seed: int, with_init: bool) -> dict:
    g = gen(seed)
    T, S = sum(lens), len(lens)
    return {
        "x": randn(g, T, H, P, dtype=dtype),
        "dt": randn(g, T, H, dtype=dtype),  # raw; softplus(dt + dt_bias) ~ 0.1 .. 2
        "A": -(0.05 + torch.rand(H, generator=g, dtype=torch.float64)).to(torch.float32),  # mild decay
        "B": randn(g, T, G, N, dtype=dtype),
        "C": randn(g, T, G, N, dtype=dtype),
        "D": randn(g, H, dtype=torch.float32),
        "dt_bias": randn(g, H, dtype=torch.float32, scale=0.5),
        "init": randn(g, S, H, P, N, dtype=torch.float32) if with_init else None,
    }


def run_ssd(fn, inp: dict, lens: list[int], chunk: int, **kw):
    return fn(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, cu_of(lens),
        D=inp["D"], dt_bias=inp["dt_bias"], dt_softplus=True, initial_states=inp["init"], **kw,
    )  # fmt: skip


def as64(inp: dict) -> dict:
    return {k: (None if v is None else v.to(torch.float64)) for k, v in inp.items()}


SSD_MIXES = [
    pytest.param([37], 8, id="1seq-37-chunk8"),
    pytest.param([16], 8, id="1seq-exact-multiple"),
    pytest.param([1], 4, id="1seq-1tok"),
    pytest.param([5, 1, 0, 17, 8, 9, 24], 8, id="7seq-mixed-with-empty"),
    pytest.param([3, 0, 40], 16, id="3seq-chunk16"),
    pytest.param([5, 9], 64, id="chunk-larger-than-all"),
    pytest.param([0, 6, 0], 4, id="empty-first-and-last"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_init", [False, True], ids=["zero-init", "init"])
@pytest.mark.parametrize("lens,chunk", SSD_MIXES)
def test_ssd_chunked_matches_naive(lens, chunk, with_init, dtype):
    inp = ssd_inputs(lens, dtype, seed=len(lens) * 100 + chunk, with_init=with_init)
    got = run_ssd(ssd_chunked_ref, inp, lens, chunk)
    ref = run_ssd(ssd_naive_ref, as64(inp), lens, chunk)  # float64 oracle on the same values

    cd = torch.float64 if dtype == torch.float64 else torch.float32
    T, S = sum(lens), len(lens)
    assert got.y.shape == (T, H, P) and got.y.dtype == dtype
    assert got.final_states.shape == (S, H, P, N) and got.final_states.dtype == cd
    n_chunks = sum((n + chunk - 1) // chunk for n in lens)
    assert got.chunk_states is not None and got.chunk_states.shape == (n_chunks, H, P, N)
    assert got.chunk_offsets == ref.chunk_offsets == chunk_offsets_for(cu_of(lens), chunk)
    assert torch.isfinite(got.y).all()
    close(got.y, ref.y, dtype, "y")
    close(got.final_states, ref.final_states, dtype, "final_states")
    close(got.chunk_states, ref.chunk_states, dtype, "chunk_states")

    # a zero-length sequence passes its initial state (or zeros) through unchanged
    for s, n in enumerate(lens):
        if n == 0:
            expect = torch.zeros(H, P, N, dtype=cd) if inp["init"] is None else inp["init"][s].to(cd)
            assert torch.equal(got.final_states[s], expect)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    chunk=st.sampled_from([1, 2, 3, 4, 8, 32]),
    with_init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_ssd_chunked_matches_naive_property(lens, chunk, with_init, seed):
    """Arbitrary mixes (chunk_size 1 included) in float64."""
    inp = ssd_inputs(lens, torch.float64, seed=seed, with_init=with_init)
    got = run_ssd(ssd_chunked_ref, inp, lens, chunk)
    ref = run_ssd(ssd_naive_ref, inp, lens, chunk)
    close(got.y, ref.y, torch.float64)
    close(got.final_states, ref.final_states, torch.float64)
    close(got.chunk_states, ref.chunk_states, torch.float64)
    assert got.chunk_offsets == ref.chunk_offsets


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_chunk_states_equal_final_state_of_prefix_runs(dtype):
    """The state after chunk k of sequence s = the final state of a run over its first min(k*L, n) tokens."""
    lens, chunk = [19, 1, 0, 24, 7], 8
    inp = ssd_inputs(lens, dtype, seed=7, with_init=True)
    got = run_ssd(ssd_chunked_ref, inp, lens, chunk)
    cu = cu_of(lens)
    assert got.chunk_states is not None
    for s, n in enumerate(lens):
        rows = got.chunk_states[got.chunk_offsets[s] : got.chunk_offsets[s + 1]]
        assert rows.shape[0] == (n + chunk - 1) // chunk
        for k in range(rows.shape[0]):
            m = min((k + 1) * chunk, n)
            sl = slice(cu[s], cu[s] + m)
            sub = {
                "x": inp["x"][sl], "dt": inp["dt"][sl], "A": inp["A"], "B": inp["B"][sl], "C": inp["C"][sl],
                "D": inp["D"], "dt_bias": inp["dt_bias"], "init": inp["init"][s : s + 1],
            }  # fmt: skip
            ref = run_ssd(ssd_naive_ref, as64(sub), [m], chunk)
            close(rows[k], ref.final_states[0], dtype, f"seq {s} chunk {k}")
        if n:
            assert torch.equal(rows[-1], got.final_states[s])


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_matches_closed_form(dtype):
    """A third, independent formulation (quadratic 'attention' form with explicit decays):

    y[t] = sum_{s<=t} exp(cum[t]-cum[s]) (C[t].B[s]) dt[s] x[s] + exp(cum[t]) C[t].h0 + D x[t]
    """
    lens, chunk = [11, 4, 9], 4
    inp = ssd_inputs(lens, dtype, seed=11, with_init=True)
    got = run_ssd(ssd_chunked_ref, inp, lens, chunk)
    i64 = as64(inp)
    cu = cu_of(lens)
    rep = H // G
    dt = F.softplus(i64["dt"] + i64["dt_bias"])  # [T, H]
    expect = torch.empty(sum(lens), H, P, dtype=torch.float64)
    for s in range(len(lens)):
        sl = slice(cu[s], cu[s + 1])
        x, d = i64["x"][sl], dt[sl]
        Bh = i64["B"][sl].repeat_interleave(rep, dim=1)  # [n, H, N]
        Ch = i64["C"][sl].repeat_interleave(rep, dim=1)
        cum = torch.cumsum(d * i64["A"], dim=0)  # [n, H]
        n = x.shape[0]
        decay = torch.exp(cum[:, None, :] - cum[None, :, :])  # [t, s, H]
        causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
        decay = decay * causal[..., None]
        cb = torch.einsum("thn,shn->tsh", Ch, Bh)
        y = torch.einsum("tsh,sh,shp->thp", decay * cb, d, x)
        y = y + torch.exp(cum)[..., None] * torch.einsum("thn,hpn->thp", Ch, i64["init"][s])
        expect[sl] = y + i64["D"][:, None] * x
    close(got.y, expect, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_split_with_initial_state_equals_one_pass(dtype):
    """Running each sequence in two pieces (state carried through initial_states) = one pass."""
    lens, chunk = [23, 9, 2, 16], 8
    cuts = [13, 8, 1, 8]  # inside a chunk, at a chunk boundary, 1 token, ...
    inp = ssd_inputs(lens, dtype, seed=3, with_init=True)
    one = run_ssd(ssd_chunked_ref, inp, lens, chunk)
    cu = cu_of(lens)
    first_idx = torch.cat([torch.arange(cu[s], cu[s] + c) for s, c in enumerate(cuts)])
    second_idx = torch.cat([torch.arange(cu[s] + c, cu[s + 1]) for s, c in enumerate(cuts)])

    def sub(idx, init):
        return {
            "x": inp["x"][idx], "dt": inp["dt"][idx], "A": inp["A"], "B": inp["B"][idx], "C": inp["C"][idx],
            "D": inp["D"], "dt_bias": inp["dt_bias"], "init": init,
        }  # fmt: skip

    a = run_ssd(ssd_chunked_ref, sub(first_idx, inp["init"]), cuts, chunk)
    b = run_ssd(ssd_chunked_ref, sub(second_idx, a.final_states), [n - c for n, c in zip(lens, cuts)], chunk)
    close(a.y, one.y[first_idx], dtype)
    close(b.y, one.y[second_idx], dtype)
    close(b.final_states, one.final_states, dtype)


def test_ssd_all_sequences_empty():
    inp = ssd_inputs([0, 0], torch.float32, seed=5, with_init=True)
    for fn in (ssd_chunked_ref, ssd_naive_ref):
        out = run_ssd(fn, inp, [0, 0], 8)
        assert out.y.shape == (0, H, P)
        assert torch.equal(out.final_states, inp["init"])
        assert out.chunk_states is not None and out.chunk_states.shape[0] == 0
        assert out.chunk_offsets == [0, 0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_ssd_dt_limit_is_applied_after_softplus(dtype):
    """dt_limit clamps softplus(dt + bias): same result as feeding the clamped dt with no processing."""
    lens, chunk, lim = [14, 5], 4, (0.3, 0.9)
    inp = ssd_inputs(lens, dtype, seed=9, with_init=True)
    d = F.softplus(inp["dt"].to(torch.float64) + inp["dt_bias"].to(torch.float64))
    assert (d < lim[0]).any() and (d > lim[1]).any(), "inputs must exercise both sides of the clamp"
    got = run_ssd(ssd_chunked_ref, inp, lens, chunk, dt_limit=lim)
    pre = dict(as64(inp), dt=d.clamp(*lim), dt_bias=None)
    ref = ssd_naive_ref(
        pre["x"], pre["dt"], pre["A"], pre["B"], pre["C"], chunk, cu_of(lens),
        D=pre["D"], dt_bias=None, dt_softplus=False, initial_states=pre["init"],
    )  # fmt: skip
    close(got.y, ref.y, dtype)
    close(got.final_states, ref.final_states, dtype)
    unclamped = run_ssd(ssd_chunked_ref, inp, lens, chunk)
    assert not torch.allclose(unclamped.y.double(), got.y.double())


def test_ssd_without_chunk_states_and_without_D():
    lens, chunk = [10, 3], 4
    inp = ssd_inputs(lens, torch.float64, seed=13, with_init=False)
    got = ssd_chunked_ref(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        chunk,
        torch.tensor(cu_of(lens)),
        dt_bias=inp["dt_bias"],
        return_chunk_states=False,
    )
    ref = ssd_naive_ref(
        inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk, cu_of(lens), dt_bias=inp["dt_bias"]
    )
    assert got.chunk_states is None
    close(got.y, ref.y, torch.float64)
    close(got.final_states, ref.final_states, torch.float64)


def test_ssd_rejects_bad_shapes():
    inp = ssd_inputs([6], torch.float32, seed=1, with_init=False)
    with pytest.raises(ValueError, match="cu_seqlens"):
        ssd_chunked_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 4, [0, 5])
    with pytest.raises(ValueError, match="groups"):
        ssd_chunked_ref(inp["x"], inp["dt"], inp["A"], inp["B"][:, :1].expand(6, 3, N), inp["C"], 4, [0, 6])


# ================================================================================================
# causal conv1d
# ================================================================================================
DC = 6  # conv channels


def conv_oracle(x, weight, bias, lens, init, activation):
    """F.conv1d per sequence over [initial state | tokens] (valid convolution, no padding)."""
    K = weight.shape[1]
    cu = cu_of(lens)
    outs, finals = [], []
    for s, n in enumerate(lens):
        st = torch.zeros(DC, K - 1, dtype=torch.float64) if init is None else init[s].double()
        xs = torch.cat([st, x[cu[s] : cu[s + 1]].double().T], dim=1)  # [D, K-1+n]
        if n:
            b = None if bias is None else bias.double()
            y = F.conv1d(xs[None], weight.double()[:, None, :], b, groups=DC)[0]  # [D, n]
            outs.append((F.silu(y) if activation == "silu" else y).T)
        finals.append(xs[:, xs.shape[1] - (K - 1) :])
    return torch.cat(outs) if outs else torch.zeros(0, DC, dtype=torch.float64), torch.stack(finals)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("with_init", [False, True], ids=["zero-init", "init"])
@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("lens", [[17], [1], [0, 1, 2, 3, 7, 20, 0]], ids=["1seq", "1tok", "mixed"])
def test_conv1d_varlen_matches_per_sequence_conv(lens, activation, with_init, K, dtype):
    g = gen(sum(lens) + K)
    x = randn(g, sum(lens), DC, dtype=dtype)
    weight = randn(g, DC, K, dtype=dtype)
    bias = randn(g, DC, dtype=dtype)
    init = randn(g, len(lens), DC, K - 1, dtype=dtype) if with_init else None
    out, final = causal_conv1d_varlen_ref(x, weight, bias, cu_of(lens), init, activation=activation)
    exp_out, exp_final = conv_oracle(x, weight, bias, lens, init, activation)
    assert out.dtype == dtype and final.dtype == dtype
    assert out.shape == (sum(lens), DC) and final.shape == (len(lens), DC, K - 1)
    close(out, exp_out, dtype)
    assert torch.equal(final.double(), exp_final)  # a pure copy of inputs: exact


@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.integers(0, 9), min_size=1, max_size=5),
    K=st.integers(2, 5),
    with_init=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_conv1d_varlen_matches_per_sequence_conv_property(lens, K, with_init, seed):
    g = gen(seed)
    x, w, b = randn(g, sum(lens), DC), randn(g, DC, K), randn(g, DC)
    init = randn(g, len(lens), DC, K - 1) if with_init else None
    out, final = causal_conv1d_varlen_ref(x, w, b, cu_of(lens), init)
    exp_out, exp_final = conv_oracle(x, w, b, lens, init, "silu")
    close(out, exp_out, torch.float64)
    assert torch.equal(final, exp_final)


def test_conv1d_varlen_without_bias_and_tensor_cu():
    g = gen(2)
    lens = [5, 3]
    x, w = randn(g, 8, DC), randn(g, DC, 4)
    out, _ = causal_conv1d_varlen_ref(x, w, None, torch.tensor(cu_of(lens), dtype=torch.int32), None)
    close(out, conv_oracle(x, w, None, lens, None, "silu")[0], torch.float64)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_varlen_ref(x, w, None, cu_of(lens), None, activation="gelu")


@pytest.mark.parametrize("with_init", [False, True], ids=["zero-init", "init"])
def test_conv_state_at_equals_final_state_of_shorter_run(with_init):
    g = gen(21)
    K = 4
    lens = [2, 11, 5]
    x = randn(g, sum(lens), DC, dtype=torch.float32)
    w, b = randn(g, DC, K, dtype=torch.float32), randn(g, DC, dtype=torch.float32)
    init = randn(g, len(lens), DC, K - 1, dtype=torch.float32) if with_init else None
    cu = cu_of(lens)
    for s, n in enumerate(lens):
        for off in range(n + 1):
            got = conv_state_at(x, cu[s], off, None if init is None else init[s], K - 1)
            _, fin = causal_conv1d_varlen_ref(
                x[cu[s] : cu[s] + off], w, b, [0, off], None if init is None else init[s : s + 1]
            )
            assert got.shape == (DC, K - 1)
            assert torch.equal(got, fin[0]), (s, off)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv1d_update_matches_one_varlen_step(dtype):
    """Real rows read src slots and write different dst slots; two pad rows point at a pad slot; every
    other slot is NaN and must be neither read (outputs stay finite) nor written (bits unchanged)."""
    g = gen(31)
    K, num_slots = 4, 12
    src, dst = [2, 5, 7], [8, 1, 6]
    pad = 11
    pool = torch.full((num_slots, DC, K - 1), float("nan"), dtype=dtype)
    for s in src + [pad]:
        pool[s] = randn(g, DC, K - 1, dtype=dtype)
    before = pool.clone()
    x = randn(g, 5, DC, dtype=dtype)
    w, b = randn(g, DC, K, dtype=dtype), randn(g, DC, dtype=dtype)
    out = causal_conv1d_update_ref(
        x, pool, w, b, torch.tensor(src + [pad, pad]), torch.tensor(dst + [pad, pad])
    )
    assert out.shape == (5, DC) and out.dtype == dtype
    assert torch.isfinite(out).all()
    exp_out, exp_final = conv_oracle(x[:3], w, b, [1, 1, 1], before[src], "silu")
    close(out[:3], exp_out, dtype)
    for i, d in enumerate(dst):
        assert torch.equal(pool[d].double(), exp_final[i])
    untouched = [s for s in range(num_slots) if s not in dst and s != pad]
    for s in untouched:  # includes the src slots: src != dst must leave the source intact
        assert same_bits(pool[s], before[s]), f"slot {s} was written"


# ================================================================================================
# SSM single-step update
# ================================================================================================
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_D", [True, False], ids=["D", "noD"])
def test_ssm_update_matches_one_naive_step(dtype, with_D):
    g = gen(41)
    num_slots = 12
    src, dst = [3, 0, 9], [4, 10, 2]
    pad = 11
    pool = torch.full((num_slots, H, P, N), float("nan"), dtype=dtype)
    for s in src + [pad]:
        pool[s] = randn(g, H, P, N, dtype=dtype)
    before = pool.clone()
    Bt = 5
    x, dt = randn(g, Bt, H, P, dtype=dtype), randn(g, Bt, H, dtype=dtype)
    Bm, Cm = randn(g, Bt, G, N, dtype=dtype), randn(g, Bt, G, N, dtype=dtype)
    A = -(0.05 + torch.rand(H, generator=g, dtype=torch.float64)).float()
    D = randn(g, H, dtype=torch.float32) if with_D else None
    dt_bias = randn(g, H, dtype=torch.float32, scale=0.5)
    y = selective_state_update_ref(
        pool, x, dt, A, Bm, Cm, torch.tensor(src + [pad, pad]), torch.tensor(dst + [pad, pad]),
        D=D, dt_bias=dt_bias, dt_softplus=True,
    )  # fmt: skip
    assert y.shape == (Bt, H, P) and y.dtype == dtype and torch.isfinite(y).all()
    ref = ssd_naive_ref(
        x[:3].double(), dt[:3].double(), A, Bm[:3].double(), Cm[:3].double(), 8, [0, 1, 2, 3],
        D=D, dt_bias=dt_bias, initial_states=before[src].double(),
    )  # fmt: skip
    close(y[:3], ref.y, dtype)
    close(pool[dst], ref.final_states, dtype)
    for s in range(num_slots):
        if s not in dst and s != pad:
            assert same_bits(pool[s], before[s]), f"slot {s} was written"


def test_ssm_update_stores_in_pool_dtype():
    """A bfloat16 state pool: computed in float32, stored rounded to bfloat16."""
    g = gen(43)
    pool = randn(g, 4, H, P, N, dtype=torch.bfloat16)
    before = pool.clone()
    x, dt = randn(g, 2, H, P, dtype=torch.float32), randn(g, 2, H, dtype=torch.float32)
    Bm, Cm = randn(g, 2, G, N, dtype=torch.float32), randn(g, 2, G, N, dtype=torch.float32)
    A = -torch.rand(H, generator=g)
    y = selective_state_update_ref(
        pool, x, dt, A, Bm, Cm, torch.tensor([0, 1]), torch.tensor([2, 3]), dt_bias=torch.zeros(H)
    )
    ref = ssd_naive_ref(
        x.double(),
        dt.double(),
        A,
        Bm.double(),
        Cm.double(),
        4,
        [0, 1, 2],
        dt_bias=torch.zeros(H),
        initial_states=before[:2].double(),
    )
    assert pool.dtype == torch.bfloat16
    torch.testing.assert_close(
        pool[2:].double(), ref.final_states.to(torch.bfloat16).double(), atol=1e-2, rtol=1e-2
    )
    torch.testing.assert_close(
        y.double(), ref.y, atol=1e-2, rtol=1e-2
    )  # state read from bf16, y from fp32 math
    assert torch.equal(pool[:2], before[:2])


# ================================================================================================
# paged attention
# ================================================================================================
def dense_attention(q, k, v, scale):
    """q: [n, Hq, D] (the last n of L positions), k, v: [L, Hkv, D]; causal, float64, torch SDPA with GQA."""
    n, L = q.shape[0], k.shape[0]
    qpos = torch.arange(L - n, L)[:, None]
    mask = torch.arange(L)[None, :] <= qpos  # [n, L] True = may attend
    out = F.scaled_dot_product_attention(
        q.double().transpose(0, 1)[None], k.double().transpose(0, 1)[None], v.double().transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)  # [n, Hq, D]


class PagedScenario:
    """Random sequences over a shuffled block pool (non-contiguous tables). Block 0 is a poison block of
    NaN that pads every table; unwritten rows of every block are NaN too."""

    def __init__(self, specs, *, bs, hq, hkv, hd, dtype, seed, num_blocks=64):
        g = gen(seed)
        self.g, self.bs, self.hq, self.hkv, self.hd, self.dtype = g, bs, hq, hkv, hd, dtype
        self.k_cache = torch.full((num_blocks, bs, hkv, hd), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.specs = specs  # [(cached tokens, new tokens)]
        max_blocks = max((c + n + bs - 1) // bs for c, n in specs) + 2
        self.tables = torch.zeros(len(specs), max_blocks, dtype=torch.int32)  # padding -> poison block 0
        self.k_all, self.v_all = [], []
        for s, (c, n) in enumerate(specs):
            nb = (c + n + bs - 1) // bs
            self.tables[s, :nb] = torch.tensor([free.pop() for _ in range(nb)], dtype=torch.int32)
            self.k_all.append(randn(g, c + n, hkv, hd, dtype=dtype))
            self.v_all.append(randn(g, c + n, hkv, hd, dtype=dtype))

    def slot(self, s: int, pos: int) -> int:
        return int(self.tables[s, pos // self.bs]) * self.bs + pos % self.bs

    def write_cached(self) -> None:
        """Earlier steps wrote the cached context."""
        for s, (c, _) in enumerate(self.specs):
            if c:
                sm = torch.tensor([self.slot(s, p) for p in range(c)])
                write_kv_ref(self.k_all[s][:c], self.v_all[s][:c], self.k_cache, self.v_cache, sm)

    def new_tokens(self):
        """(k, v, slot_mapping, cu_q, seq_lens) for this step's new tokens, packed."""
        ks, vs, sm, cu, lens = [], [], [], [0], []
        for s, (c, n) in enumerate(self.specs):
            ks.append(self.k_all[s][c:])
            vs.append(self.v_all[s][c:])
            sm += [self.slot(s, p) for p in range(c, c + n)]
            cu.append(cu[-1] + n)
            lens.append(c + n)
        return torch.cat(ks), torch.cat(vs), torch.tensor(sm, dtype=torch.int64), cu, lens


ATTN_CASES = [
    pytest.param([(0, 7), (5, 1), (13, 6), (0, 1), (9, 0), (30, 1), (3, 17)], id="mixed"),
    pytest.param([(12, 1), (1, 1), (40, 1), (7, 1)], id="decode-only"),
    pytest.param([(0, 23)], id="1seq-prefill"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("specs", ATTN_CASES)
def test_paged_attention_matches_dense_causal(specs, bs, hq, hkv, dtype):
    hd = 8
    sc = PagedScenario(specs, bs=bs, hq=hq, hkv=hkv, hd=hd, dtype=dtype, seed=bs * 10 + hq + hkv)
    sc.write_cached()
    k, v, sm, cu, lens = sc.new_tokens()
    write_kv_ref(k, v, sc.k_cache, sc.v_cache, sm)
    kc, vc = sc.k_cache.clone(), sc.v_cache.clone()
    q = randn(sc.g, cu[-1], hq, hd, dtype=dtype)
    scale = hd**-0.5
    out = paged_attention_ref(
        q, sc.k_cache, sc.v_cache, sc.tables, torch.tensor(lens), torch.tensor(cu), scale
    )
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "read a NaN row: an unwritten position or a padding block"
    for s, (c, n) in enumerate(specs):
        if n:
            exp = dense_attention(q[cu[s] : cu[s + 1]], sc.k_all[s], sc.v_all[s], scale)
            close(out[cu[s] : cu[s + 1]], exp, dtype, f"sequence {s} (cached {c}, new {n})")
    assert same_bits(sc.k_cache, kc) and same_bits(sc.v_cache, vc), "attention must not write the caches"


def test_paged_attention_rejects_more_new_tokens_than_seq_len():
    sc = PagedScenario([(0, 4)], bs=4, hq=2, hkv=1, hd=4, dtype=torch.float32, seed=1)
    q = randn(sc.g, 4, 2, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match="seq_len"):
        paged_attention_ref(q, sc.k_cache, sc.v_cache, sc.tables, [3], [0, 4], 0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_exactly_the_mapped_slots(dtype):
    """slot_mapping -1 (padding) is skipped; every other cache row keeps its bits."""
    g = gen(51)
    nb, bs, hkv, hd = 10, 4, 2, 3
    k_cache = torch.full((nb, bs, hkv, hd), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    slots = [13, -1, 2, 39, -1, 20, 21]
    k = randn(g, len(slots), hkv, hd, dtype=torch.float32)
    v = randn(g, len(slots), hkv, hd, dtype=torch.float32)
    write_kv_ref(k, v, k_cache, v_cache, torch.tensor(slots))
    written = set()
    for i, sl in enumerate(slots):
        if sl < 0:
            continue
        written.add(sl)
        assert torch.equal(k_cache[sl // bs, sl % bs], k[i].to(dtype))
        assert torch.equal(v_cache[sl // bs, sl % bs], v[i].to(dtype))
    for sl in range(nb * bs):
        if sl not in written:
            assert (
                torch.isnan(k_cache[sl // bs, sl % bs]).all()
                and torch.isnan(v_cache[sl // bs, sl % bs]).all()
            )


# ================================================================================================
# RMSNorm
# ================================================================================================
def gated_oracle(x, z, w, eps, gs):
    h = x.double()
    if z is not None:
        h = h * F.silu(z.double())
    hg = h.unflatten(-1, (h.shape[-1] // gs, gs))
    hg = hg / torch.sqrt(hg.pow(2).mean(-1, keepdim=True) + eps)
    return w.double() * hg.flatten(-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gs", [24, 12, 6])
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "ungated"])
@pytest.mark.parametrize("shape", [(7, 24), (2, 3, 24)], ids=["2d", "3d"])
def test_rmsnorm_gated_matches_formula(shape, gated, gs, dtype):
    g = gen(gs + len(shape))
    x = randn(g, *shape, dtype=dtype, scale=3.0)
    z = randn(g, *shape, dtype=dtype) if gated else None
    w = randn(g, shape[-1], dtype=dtype)
    out = rmsnorm_gated_ref(x, z, w, 1e-5, gs)
    assert out.shape == x.shape and out.dtype == dtype
    close(out, gated_oracle(x, z, w, 1e-5, gs), dtype)


def test_rmsnorm_gated_groups_are_independent():
    """Scaling one group of the input leaves the other groups' outputs unchanged."""
    g = gen(61)
    x, z, w = randn(g, 5, 16), randn(g, 5, 16), randn(g, 16)
    a = rmsnorm_gated_ref(x, z, w, 1e-6, 4)
    x2 = x.clone()
    x2[:, 4:8] *= 100.0
    b = rmsnorm_gated_ref(x2, z, w, 1e-6, 4)
    torch.testing.assert_close(a[:, :4], b[:, :4])
    torch.testing.assert_close(a[:, 8:], b[:, 8:])


def test_rmsnorm_gated_matches_transformers_in_low_precision():
    """bf16 semantics follow NemotronH's reference module (weight multiply after the cast)."""
    tr = pytest.importorskip("transformers.models.nemotron_h.modeling_nemotron_h")
    g = gen(62)
    x, z = randn(g, 9, 32, dtype=torch.bfloat16), randn(g, 9, 32, dtype=torch.bfloat16)
    mod = tr.NemotronHRMSNormGated(32, group_size=8, eps=1e-5).to(torch.bfloat16)
    with torch.no_grad():
        mod.weight.copy_(randn(g, 32, dtype=torch.bfloat16))
        assert torch.equal(rmsnorm_gated_ref(x, z, mod.weight, 1e-5, 8), mod(x, z))


def test_rmsnorm_gated_rejects_group_size_not_dividing():
    g = gen(63)
    with pytest.raises(ValueError, match="group_size"):
        rmsnorm_gated_ref(randn(g, 2, 10), None, randn(g, 10), 1e-5, 4)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.bfloat16])
def test_rms_norm_matches_formula(dtype):
    g = gen(71)
    x = randn(g, 3, 5, 40, dtype=dtype, scale=2.0)
    w = randn(g, 40, dtype=dtype)
    out = rms_norm_ref(x, w, 1e-6)
    exp = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    assert out.dtype == dtype
    tol = TOL.get(dtype, {"atol": 2e-2, "rtol": 2e-2})
    torch.testing.assert_close(out.double(), exp, **tol)
    assert math.isfinite(float(out.double().abs().max()))
