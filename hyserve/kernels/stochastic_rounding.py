"""Stochastic rounding (SR) of float32 SSM states into a float16 pool: the plain-torch reference (the
Triton kernels' bit-exact oracle) and the `store_ssm_state` op that writes states with the pool's policy.

Why: a decode step multiplies the state by exp(dt * A), often within 1e-3 of 1, and adds a small update;
stored with round-to-nearest in float16 an update under half an ulp is lost every step and the state
stagnates. Rounding up with probability proportional to proximity keeps every stored value an unbiased
estimate of the float32 one, so the errors average out over steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Philox-4x32 constants (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11)
PHILOX_M0 = 0xD2511F53  # multiplies counter word 0
PHILOX_M1 = 0xCD9E8D57  # multiplies counter word 2
PHILOX_W0 = 0x9E3779B9  # key word 0 increment per round (golden ratio)
PHILOX_W1 = 0xBB67AE85  # key word 1 increment per round (sqrt(3) - 1)
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
MAX_PHILOX_ROUNDS = 32

FP16_MAX_BITS = 0x7BFF  # 65504
FP16_INF_BITS = 0x7C00
FP16_NAN_BITS = 0x7E00


@dataclass(frozen=True, kw_only=True)
class StochasticRounding:
    """The random stream of one Mamba layer's float16 SSM pool: Philox-4x32 with `rounds` rounds (as
    `triton.language.philox`: Random123's philox4x32, the key raised after every round). For element
    (h, p, n) of one sequence's state [H, P, N]:

        key       = (seed mod 2**64) as (lo 32 bits, hi 32 bits)      seed: EngineConfig.seed
        counter   = ((h * P + p) * ceil(N / 4) + n // 4,              element group within the state
                     position mod 2**32,                              tokens the state has absorbed
                     layer, 0)
        r         = output word (n % 4) of Philox(counter, key)

    `position` is the sequence's token count after the tokens the state covers (`ForwardMeta.seq_lens_t` for
    decode rows and a prefill's final state; tokens before the step + tokens up to the snapshot for a
    snapshot). Everything is on the device at run time or fixed at start-up, so the decode kernel reads
    nothing from the host and replays from a CUDA graph. The slot is deliberately not in the counter: a
    sequence's bits do not depend on its slot or its batch, and a snapshot holds the live state's bits.
    Sequences at the same position and layer share draws (their rounding errors correlate across sequences;
    each stays unbiased and independent from step to step)."""

    seed: int  # any Python int; the Philox key is seed mod 2**64
    layer: int = 0
    rounds: int = 10

    def __post_init__(self) -> None:
        if not 1 <= self.rounds <= MAX_PHILOX_ROUNDS:
            raise ValueError(f"Philox rounds must be in [1, {MAX_PHILOX_ROUNDS}], got {self.rounds}")
        if not 0 <= self.layer <= _U32:
            raise ValueError(f"layer index must be in [0, 2**32), got {self.layer}")

    @property
    def key(self) -> int:
        """The 64-bit Philox key (what the Triton kernels get as `seed`)."""
        return self.seed & _U64


# ---- Philox-4x32 in int64 arithmetic -------------------------------------------------------------


def _mulhilo32(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a * m for int64 tensors a in [0, 2**32) and a constant m < 2**32,
    without overflowing int64: a * m = (a * m_hi + (a * m_lo >> 16)) * 2**16 + (a * m_lo & 0xFFFF)."""
    t = a * (m & 0xFFFF)  # < 2**48
    u = a * (m >> 16) + (t >> 16)  # < 2**49
    return u >> 16, ((u & 0xFFFF) << 16) | (t & 0xFFFF)


def philox4x32(
    c0: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, c3: torch.Tensor, key: int, rounds: int = 10
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Philox-4x32 of counters (c0, c1, c2, c3) under a 64-bit key (low word first). The counters are
    broadcastable int64 tensors holding values in [0, 2**32); so are the four outputs."""
    c0, c1, c2, c3 = torch.broadcast_tensors(*(c.to(torch.int64) & _U32 for c in (c0, c1, c2, c3)))
    k0, k1 = key & _U32, (key >> 32) & _U32
    for _ in range(rounds):
        hi0, lo0 = _mulhilo32(c0, PHILOX_M0)
        hi2, lo2 = _mulhilo32(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0 = (k0 + PHILOX_W0) & _U32
        k1 = (k1 + PHILOX_W1) & _U32
    return c0, c1, c2, c3


def state_random_bits(
    shape: tuple[int, int, int, int] | torch.Size,
    positions: torch.Tensor,
    rounding: StochasticRounding,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The uint32 draws (in int64) for R states of shape [H, P, N]: shape = (R, H, P, N), positions [R]."""
    R, H, P, N = shape
    assert positions.shape == (R,), f"positions {tuple(positions.shape)} vs {R} states"
    dev = positions.device if device is None else torch.device(device)
    groups = (N + 3) // 4
    # counter word 0 of element (h, p, n) is (h * P + p) * groups + n // 4: [H, P, groups]
    c0 = torch.arange(H * P * groups, dtype=torch.int64, device=dev).view(1, H, P, groups)
    c1 = positions.to(device=dev, dtype=torch.int64).view(R, 1, 1, 1)
    c2 = torch.full((1, 1, 1, 1), rounding.layer, dtype=torch.int64, device=dev)
    c3 = torch.zeros((1, 1, 1, 1), dtype=torch.int64, device=dev)
    words = philox4x32(c0, c1, c2, c3, rounding.key, rounding.rounds)
    # word j of group g is element n = 4 * g + j
    return torch.stack(words, dim=-1).reshape(R, H, P, groups * 4)[..., :N]


# ---- the rounding ---------------------------------------------------------------------------------


def stochastic_round_fp16(x: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """Round float32 `x` to float16 with uniform uint32 draws `rand` (int64 tensor, same shape), in integer
    arithmetic only, so the Triton kernels reproduce it bit for bit:

        lo, hi = the float16 neighbours of x with |lo| <= |x| < |hi| (lo = x when x is a float16)
        result = hi if r < 2**32 * (|x| - |lo|) / (|hi| - |lo|) else lo        (with x's sign)

    fp16-normal range (|x| >= 2**-14): the 13 dropped fp32 mantissa bits << 19 are the threshold, so P(hi)
    is exactly their fraction of an fp16 ulp. Subnormal range (fp32 subnormals included): spacing 2**-24,
    the discarded part taken at full fp32 precision and scaled to 32 bits (a bias under 2**-56). Exact
    float16 values and +-0 are unchanged (the sign of zero kept). A finite |x| above 65504 saturates to
    +-65504 (a state must never become inf: inf * decay stays inf and 0 * inf is NaN); +-inf stays; NaN
    becomes the quiet float16 NaN 0x7E00 with x's sign."""
    assert x.dtype == torch.float32, f"x must be float32, got {x.dtype}"
    assert rand.shape == x.shape, f"rand {tuple(rand.shape)} vs x {tuple(x.shape)}"
    r = rand.to(torch.int64) & _U32
    bits = x.contiguous().view(torch.int32).to(torch.int64) & _U32
    sign = (bits >> 16) & 0x8000
    mag = bits & 0x7FFFFFFF
    e = mag >> 23  # biased fp32 exponent; fp16-normal from 113 (2**-14) on

    # fp16-normal range: keep the top 13 magnitude bits' worth, drop 13; a carry moves into the exponent
    up_n = ((mag & 0x1FFF) << 19) > r
    h_norm = torch.clamp((mag >> 13) - (112 << 10) + up_n.to(torch.int64), max=FP16_MAX_BITS)

    # fp16-subnormal range: count in units of 2**-24; x = m * 2**(e - 150) = (m >> s) units + remainder
    ec = torch.clamp(e, 1, 112)  # fp32 subnormals (e == 0) have the scale of e == 1
    m = (mag & 0x7FFFFF) | torch.where(e > 0, 0x800000, 0)
    s = 126 - ec  # 14 .. 125 bits below the unit
    sc = torch.clamp(s, max=31)
    q = m >> sc  # 0 once s >= 24 (m < 2**24)
    rem = m - (q << sc)
    thr = torch.where(
        s <= 32,
        rem << (32 - torch.clamp(s, max=32)),  # rem < 2**s: fits in 32 bits
        rem >> torch.clamp(s - 32, 0, 31),
    )
    h_sub = q + (thr > r).to(torch.int64)  # q + 1 may be 0x400, the smallest normal: correct

    h = torch.where(e >= 113, h_norm, h_sub)
    h = torch.where(mag >= 0x7F800000, torch.where(mag == 0x7F800000, FP16_INF_BITS, FP16_NAN_BITS), h)
    return (h | sign).to(torch.int32).to(torch.int16).view(torch.float16)


def stochastic_round_state(
    states: torch.Tensor, positions: torch.Tensor, rounding: StochasticRounding
) -> torch.Tensor:
    """states [R, H, P, N] (float32; float64 is first rounded to float32) -> float16 with the stream of
    `rounding` at the given per-row positions ([R])."""
    assert states.dim() == 4, f"states must be [R, H, P, N], got {tuple(states.shape)}"
    rand = state_random_bits(states.shape, positions, rounding, states.device)
    return stochastic_round_fp16(states.to(torch.float32), rand)


# ---- the store op ---------------------------------------------------------------------------------


def store_ssm_state_ref(
    ssm_pool: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    *,
    rounding: StochasticRounding | None = None,
    positions: torch.Tensor | None = None,
) -> None:
    """ssm_pool[slots] = states in the pool's dtype: round-to-nearest, or stochastic rounding (float16
    pool only) with `rounding` at `positions` ([R], the tokens each state covers).

    ssm_pool: [num_slots, H, P, N]; states: [R, H, P, N] float32 (float64 on the CPU oracle paths);
    slots: [R] integer. Rows must not share a destination slot."""
    assert states.dim() == 4 and states.shape[1:] == ssm_pool.shape[1:], (
        f"states {tuple(states.shape)} vs pool {tuple(ssm_pool.shape)}"
    )
    assert slots.shape == (states.shape[0],) and not slots.dtype.is_floating_point
    if rounding is None:
        ssm_pool[slots] = states.to(ssm_pool.dtype)
        return
    assert ssm_pool.dtype == torch.float16, f"stochastic rounding needs a float16 pool, got {ssm_pool.dtype}"
    assert positions is not None, "stochastic rounding needs the per-row positions"
    ssm_pool[slots] = stochastic_round_state(states, positions, rounding)
