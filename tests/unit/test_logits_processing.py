"""Penalties and logit bias (hyserve/engine/sampling/logits_processing.py) against a float64 loop written from
the OpenAI / vLLM definitions, then through the sampler and the engine."""

from __future__ import annotations

import random

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.engine.sampling.logits_processing import process_logits
from hyserve.engine.sampling.sampler import Sampler

TORCH_SEED = 77


def reference(logits: torch.Tensor, params, histories) -> torch.Tensor:
    x = logits.double().clone()
    for i, p in enumerate(params):
        if p.repetition_penalty != 1.0:
            for t in set(histories[i][0]) | set(histories[i][1]):
                x[i, t] = x[i, t] / p.repetition_penalty if x[i, t] > 0 else x[i, t] * p.repetition_penalty
        if p.frequency_penalty or p.presence_penalty:
            for t in set(histories[i][1]):
                c = histories[i][1].count(t)
                x[i, t] -= p.frequency_penalty * c + p.presence_penalty
        for t, b in p.logit_bias:
            x[i, t] += b
    return x


def test_matches_the_reference_on_random_rows() -> None:
    rng = random.Random(3)
    V = 50
    for _ in range(20):
        n = rng.randint(1, 6)
        logits = torch.randn(n, V) * 3
        params, hist = [], []
        for _ in range(n):
            kind = rng.random()
            p = SamplingParams(
                presence_penalty=rng.choice([0.0, 0.7, -1.0]) if kind < 0.8 else 0.0,
                frequency_penalty=rng.choice([0.0, 0.5, 2.0]) if kind < 0.8 else 0.0,
                repetition_penalty=rng.choice([1.0, 1.3, 0.8]) if kind < 0.8 else 1.0,
                logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(rng.randint(0, 3))},
            )
            params.append(p)
            hist.append(
                (
                    [rng.randrange(V) for _ in range(rng.randint(0, 8))],
                    [rng.randrange(V) for _ in range(rng.randint(0, 12))],
                )
            )
        got = process_logits(logits, params, hist)
        want = reference(logits, params, hist)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-5)
        for i, p in enumerate(params):  # untouched rows are bit-identical
            if not p.edits_logits:
                assert torch.equal(got[i], logits[i])


def test_nothing_to_do_returns_the_input_and_missing_history_is_an_error() -> None:
    logits = torch.randn(2, 10)
    assert process_logits(logits, [SamplingParams(), SamplingParams()], None) is logits
    with pytest.raises(ValueError, match="no token history"):
        process_logits(logits, [SamplingParams(frequency_penalty=1.0)], None)
    # a logit bias alone needs no history
    out = process_logits(logits[:1], [SamplingParams(logit_bias={3: 5.0})], None)
    assert out[0, 3] == logits[0, 3] + 5.0 and torch.equal(logits[0, :3], out[0, :3])


def test_sampler_uses_the_edited_logits_and_reports_raw_logprobs() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, -1.0]] * 3)
    s = Sampler(0)
    params = [
        SamplingParams(temperature=0, logit_bias={2: 100.0}, logprobs=0),
        SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0),
        SamplingParams(temperature=0.7, seed=1, logit_bias={0: -100.0, 1: -100.0, 2: -100.0}),
    ]
    hist = [None, ([], [0, 0]), None]
    toks, lps = s.sample(logits, params, [0, 2, 0], hist)
    assert toks == [2, 1, 3]  # biased up; penalised 5 - 4 - 2 = -1 < 1; everything else banned
    raw = torch.log_softmax(logits[0], dim=-1)[2].item()
    assert lps[0] is not None and abs(lps[0].logprob - raw) < 1e-6  # the raw distribution, not the biased one


def test_engine_feeds_the_output_history() -> None:
    """Two tokens lifted far above the rest by logit_bias; frequency + presence penalties then make the
    greedy choice alternate between them instead of repeating one."""
    llm = LLM(warmup="off", log=lambda s: None)
    a, b = 65, 66
    plain = llm.generate(
        [[1, 70, 71]],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logit_bias={a: 100, b: 100}),
    )[0].token_ids
    assert set(plain) <= {a, b}
    pen = llm.generate(
        [[1, 70, 71]],
        SamplingParams(
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            logit_bias={a: 100, b: 100},
            frequency_penalty=2.0,
            presence_penalty=2.0,
        ),
    )[0].token_ids
    assert set(pen) == {a, b} and abs(pen.count(a) - pen.count(b)) <= 2, pen
    rep = llm.generate(
        [[1, 70, 71]],
        SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True, logit_bias={a: 100}, repetition_penalty=10.0
        ),
    )[0].token_ids
    assert rep[0] == a  # 100+ / 10 is still far above the rest


def test_logit_bias_outside_the_vocabulary_is_rejected() -> None:
    from hyserve.engine.errors import RequestRejected

    llm = LLM(warmup="off", log=lambda s: None)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(RequestRejected, match="logit_bias token ids must be in"):
        llm.engine.validate_request([1, 2], SamplingParams(logit_bias={vocab: 1.0}))


def test_pending_token_counts_like_a_history_entry() -> None:
    """A row's newest token still on the device (`pending`, async scheduling) edits the logits exactly
    as the same token at the end of its host history; -1 means none."""
    import torch

    from hyserve.engine.sampling.logits_processing import process_logits
    from hyserve.engine.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    params = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(frequency_penalty=0.8, presence_penalty=0.3),
        SamplingParams(),
        SamplingParams(frequency_penalty=1.1, repetition_penalty=1.2),
    ]
    hist = [([1, 2], [5, 9]), ([3], [9, 9]), None, ([4], [])]
    pending = torch.tensor([9, 9, 17, 33])
    full = [([1, 2], [5, 9, 9]), ([3], [9, 9, 9]), None, ([4], [33])]
    torch.testing.assert_close(
        process_logits(logits, params, hist, pending), process_logits(logits, params, full), rtol=0, atol=0
    )
    none = torch.tensor([-1, -1, -1, -1])
    torch.testing.assert_close(
        process_logits(logits, params, hist, none), process_logits(logits, params, hist), rtol=0, atol=0
    )
