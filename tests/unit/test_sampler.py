"""`Sampler`: greedy, temperature, top-k / top-p / min-p, per-request seeds and logprobs, batched on the
logits' device. Every random test uses fixed seeds, so the statistical bounds are checked on one
deterministic stream and cannot flake."""

from __future__ import annotations

import math

import pytest
import torch

from hyserve.engine.sampling.sampler import Sampler
from hyserve.engine.sampling_params import SamplingParams


def _logits(n: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def _reference_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution one row should be sampled from, computed the plain way (one row, float64)."""
    x = row.double() / p.temperature
    if 0 < p.top_k < x.numel():
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], -math.inf)
    if p.min_p > 0.0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), -math.inf)
    if p.top_p < 1.0:
        sx, idx = torch.sort(x, descending=True)
        sp = torch.softmax(sx, dim=-1)
        drop = sp.cumsum(-1) - sp >= p.top_p
        x = x.scatter(0, idx, sx.masked_fill(drop, -math.inf))
    return torch.softmax(x, dim=-1)


def _draw(sampler: Sampler, row: torch.Tensor, p: SamplingParams, draws: int) -> torch.Tensor:
    """`draws` unseeded samples of one row (one batch of identical rows) -> counts per token [V]."""
    tokens, _ = sampler.sample(row.expand(draws, -1).contiguous(), [p] * draws, [0] * draws)
    return torch.bincount(torch.tensor(tokens), minlength=row.numel()).double()


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token with zero probability was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_empty_batch() -> None:
    assert Sampler().sample(torch.empty(0, 50), [], []) == ([], [])


def test_greedy_is_argmax() -> None:
    x = _logits(9, 300, seed=1)
    tokens, lps = Sampler().sample(x, [SamplingParams(temperature=0)] * 9, list(range(9)))
    assert tokens == x.argmax(-1).tolist()
    assert lps == [None] * 9


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 9.9e-6])
def test_temperatures_too_small_to_sample_are_greedy(temperature: float) -> None:
    """Below 1e-5 a temperature samples as greedy: dividing by it would overflow the logits to inf (from
    ~1e-38 on) and draw arbitrary tokens instead of the argmax. 1e-5 itself still samples."""
    x = _logits(9, 300, seed=1)
    ps = [SamplingParams(temperature=temperature, seed=i) for i in range(9)]
    assert all(p.greedy for p in ps) and not SamplingParams(temperature=1e-5).greedy
    tokens, _ = Sampler(3).sample(x, ps, list(range(9)))
    assert tokens == x.argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0, 100.0])
def test_top_k_1_is_greedy(temperature: float) -> None:
    x = _logits(16, 500, seed=2)
    ps = [
        SamplingParams(
            temperature=temperature, top_k=1, top_p=0.9 if i % 2 else 1.0, seed=i if i % 3 else None
        )
        for i in range(16)
    ]
    tokens, _ = Sampler(5).sample(x, ps, [0] * 16)
    assert tokens == x.argmax(-1).tolist()


def test_top_k_never_picks_outside_the_top_k() -> None:
    vocab, draws = 200, 4000
    row = _logits(1, vocab, seed=3, scale=1.0)[0]  # fairly flat: the tail would be drawn often
    order = torch.argsort(row, descending=True)
    sampler = Sampler(7)
    for k in (1, 3, 17):
        counts = _draw(sampler, row, SamplingParams(temperature=1.5, top_k=k), draws)
        assert set(counts.nonzero().flatten().tolist()) == set(order[:k].tolist())


def test_top_k_per_row_in_one_batch() -> None:
    vocab = 100
    x = _logits(1, vocab, seed=4, scale=0.5).expand(6000, -1).contiguous()
    order = torch.argsort(x[0], descending=True)
    ks = [0, 2, 5, 40, vocab, 1000]  # 0, vocab and beyond: off
    ps = [SamplingParams(top_k=ks[i % len(ks)]) for i in range(6000)]
    tokens, _ = Sampler(8).sample(x, ps, [0] * 6000)
    seen: dict[int, set[int]] = {}
    for p, t in zip(ps, tokens):
        seen.setdefault(p.top_k, set()).add(t)
    for k in (2, 5, 40):
        assert seen[k] <= set(order[:k].tolist()) and len(seen[k]) == k
    assert any(t not in set(order[:40].tolist()) for t in seen[0] | seen[vocab] | seen[1000])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.1, then 0.1 spread over 97 tokens
    probs = torch.tensor([0.5, 0.3, 0.1] + [0.1 / 97] * 97, dtype=torch.float64)
    row = probs.log().float()[torch.randperm(100, generator=torch.Generator().manual_seed(0))]
    order = torch.argsort(row, descending=True).tolist()
    sampler = Sampler(9)
    for top_p, kept in ((0.45, 1), (0.7, 2), (0.85, 3), (0.95, 100)):
        counts = _draw(sampler, row, SamplingParams(top_p=top_p), 3000)
        allowed = set(order[:kept])
        assert set(counts.nonzero().flatten().tolist()) <= allowed
        assert len(counts.nonzero()) >= min(kept, 50)


def test_min_p_excludes_tokens_below_min_p_times_the_max() -> None:
    ratios = torch.tensor([1.0, 0.6, 0.25, 0.15, 0.09, 0.05, 0.01], dtype=torch.float64)
    row = ratios.log().float()
    sampler = Sampler(10)
    for min_p, kept in ((0.1, 4), (0.2, 3), (0.5, 2), (1.0, 1)):
        counts = _draw(sampler, row, SamplingParams(min_p=min_p, temperature=1.0), 4000)
        assert set(counts.nonzero().flatten().tolist()) == set(range(kept))


def test_temperature_sampling_matches_softmax() -> None:
    vocab, draws = 24, 40_000
    row = _logits(1, vocab, seed=11, scale=1.5)[0]
    sampler = Sampler(12)
    for t in (0.7, 1.0, 1.8):
        counts = _draw(sampler, row, SamplingParams(temperature=t), draws)
        probs = torch.softmax(row.double() / t, dim=-1)
        # chi-square with 23 degrees of freedom: mean 23, P(> 70) ~ 1e-6
        assert _chi2(counts, probs) < 70.0
        assert (counts / draws - probs).abs().max() < 0.012


@pytest.mark.parametrize(
    "p",
    [
        SamplingParams(temperature=0.8, top_k=6),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.05),
        SamplingParams(temperature=1.2, top_k=10, top_p=0.9, min_p=0.02),
    ],
)
def test_filtered_sampling_matches_the_filtered_distribution(p: SamplingParams) -> None:
    vocab, draws = 40, 30_000
    row = _logits(1, vocab, seed=13, scale=1.0)[0]
    probs = _reference_probs(row, p)
    counts = _draw(Sampler(14), row, p, draws)
    dof = int((probs > 0).sum()) - 1
    assert _chi2(counts, probs) < dof + 10 * math.sqrt(2 * dof) + 10
    assert (counts / draws - probs).abs().max() < 0.015


def test_rows_with_different_params_in_one_batch_each_follow_their_own_distribution() -> None:
    vocab, reps = 30, 8000
    rows = _logits(4, vocab, seed=15, scale=1.2)
    kinds = [
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=2.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.6),
        SamplingParams(temperature=1.0, min_p=0.2),
    ]
    x = rows.repeat(reps, 1)  # row r of the batch is rows[r % 4]
    tokens = torch.tensor(Sampler(16).sample(x, kinds * reps, [0] * (4 * reps))[0]).view(reps, 4)
    for j, p in enumerate(kinds):
        probs = _reference_probs(rows[j], p)
        counts = torch.bincount(tokens[:, j], minlength=vocab).double()
        dof = int((probs > 0).sum()) - 1
        assert _chi2(counts, probs) < dof + 10 * math.sqrt(2 * max(dof, 1)) + 10
        assert (counts / reps - probs).abs().max() < 0.025


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    vocab = 1000
    x = _logits(6, vocab, seed=17, scale=0.3)  # flat: different noise gives different tokens
    seeded = SamplingParams(temperature=1.0, top_p=0.95, top_k=500, min_p=0.001, seed=42)
    alone = [Sampler(1).sample(x[:1], [seeded], [i])[0][0] for i in range(20)]
    assert len(set(alone)) > 10  # the output index moves the stream
    for i in range(20):
        # other rows (greedy, unseeded, other seeds), in different positions, with another engine seed
        others = [
            SamplingParams(temperature=0),
            SamplingParams(temperature=0.7),
            SamplingParams(temperature=1.0, seed=43),
            SamplingParams(temperature=1.0, top_p=0.5),
        ]
        for pos in (0, 2, 4):
            ps = others[:pos] + [seeded] + others[pos:]
            batch = torch.cat([x[1 : 1 + pos], x[:1], x[1 + pos : 5]])
            out_idx = [7] * pos + [i] + [3] * (4 - pos)
            tokens, _ = Sampler(99 + pos).sample(batch, ps, out_idx)
            assert tokens[pos] == alone[i]


def test_same_seed_same_tokens_and_unseeded_stream_follows_engine_seed() -> None:
    x = _logits(32, 500, seed=18, scale=0.3)
    ps = [SamplingParams(temperature=1.0)] * 32
    a = Sampler(3).sample(x, ps, [0] * 32)[0]
    assert a == Sampler(3).sample(x, ps, [0] * 32)[0]
    assert a != Sampler(4).sample(x, ps, [0] * 32)[0]
    s = Sampler(3)
    assert s.sample(x, ps, [0] * 32)[0] != s.sample(x, ps, [0] * 32)[0]  # the stream advances


def test_logprobs_are_the_raw_distribution_with_sorted_alternatives() -> None:
    x = _logits(3, 400, seed=19)
    ps = [
        SamplingParams(temperature=0.5, top_k=3, logprobs=5),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=1.0, top_p=0.5, seed=1, logprobs=20),
    ]
    tokens, lps = Sampler().sample(x, ps, [0, 0, 0])
    ref = torch.log_softmax(x.double(), dim=-1)
    for i, (p, lp) in enumerate(zip(ps, lps)):
        assert lp is not None and lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(float(ref[i, tokens[i]]), abs=1e-5)
        assert len(lp.top) == p.logprobs
        vals = list(lp.top.values())
        assert vals == sorted(vals, reverse=True)
        want_ids = torch.topk(ref[i], p.logprobs or 1).indices.tolist()[: p.logprobs]
        assert list(lp.top) == want_ids
        for t, v in lp.top.items():
            assert v == pytest.approx(float(ref[i, t]), abs=1e-5)
    assert lps[1] is not None and lps[1].top == {}


def test_mixed_batch() -> None:
    vocab = 300
    x = _logits(8, vocab, seed=20, scale=0.5)
    ps = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=5),
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=1.1, top_k=4, seed=6, logprobs=1),
        SamplingParams(temperature=0.8, top_p=0.7, min_p=0.05),
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, logprobs=3),
    ]
    out_idx = [0, 3, 1, 2, 5, 0, 9, 4]
    before = x.clone()
    tokens, lps = Sampler(21).sample(x, ps, out_idx)
    assert torch.equal(x, before)  # the logits are not modified
    argmax = x.argmax(-1).tolist()
    for i in (0, 3, 6):
        assert tokens[i] == argmax[i]
    for i in (1, 4):  # seeded rows: the same as when sampled alone
        assert tokens[i] == Sampler(0).sample(x[i : i + 1], [ps[i]], [out_idx[i]])[0][0]
    assert tokens[4] in torch.topk(x[4], 4).indices.tolist()
    assert [lp is not None for lp in lps] == [p.logprobs is not None for p in ps]
    for i, lp in enumerate(lps):
        if lp is not None:
            assert lp.token_id == tokens[i] and len(lp.top) == ps[i].logprobs
    assert all(0 <= t < vocab for t in tokens)


def test_all_sampled_rows_and_half_precision_logits() -> None:
    x = _logits(5, 64, seed=22).to(torch.bfloat16)
    ps = [SamplingParams(temperature=0.7, top_k=1)] * 5
    tokens, _ = Sampler().sample(x, ps, [0] * 5)
    assert tokens == x.float().argmax(-1).tolist()
    greedy, _ = Sampler().sample(x, [SamplingParams(temperature=0)] * 5, [0] * 5)
    assert greedy == tokens
