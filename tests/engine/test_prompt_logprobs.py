"""Prompt logprobs: every prompt token after the first gets the logprob the model gives it from the
tokens before it (and the top-k alternatives), whatever the chunking, with no prefix-cache hit and
once only after a preemption; through the server, completions with echo + logprobs report them."""

from __future__ import annotations

import random

import pytest

from hyserve import LLM, SamplingParams


def test_prompt_logprobs_match_a_whole_prompt_pass_and_ignore_chunking() -> None:
    rng = random.Random(5)
    prompt = [1] + [rng.randrange(3, 250) for _ in range(150)]
    p = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=2, ignore_eos=True)
    whole = LLM(warmup="off", log=lambda s: None, max_num_tokens=1024).generate([prompt], p)[0]
    chunked = LLM(warmup="off", log=lambda s: None, max_num_tokens=16, max_batch_size=4).generate(
        [prompt], p
    )[0]
    a, b = whole.prompt_logprobs, chunked.prompt_logprobs
    assert a is not None and b is not None and len(a) == len(b) == len(prompt)
    assert a[0] is None and b[0] is None
    for i, (x, y) in enumerate(zip(a[1:], b[1:]), start=1):
        assert x.token_id == y.token_id == prompt[i]
        assert abs(x.logprob - y.logprob) < 1e-4
        assert len(x.top) == 2 and set(x.top) == set(y.top)
        assert x.logprob <= max(x.top.values()) + 1e-6
    assert whole.token_ids == chunked.token_ids


def test_prompt_logprobs_against_the_models_own_logits() -> None:
    """The logprob at position i equals log_softmax of the logits the model gives after tokens[:i]:
    the last-token logits of a prefill of exactly tokens[:i] (the sampler's logprobs of output 0)."""
    rng = random.Random(9)
    prompt = [1] + [rng.randrange(3, 250) for _ in range(20)]
    llm = LLM(warmup="off", log=lambda s: None, kv_cache_config={"enable_block_reuse": False})
    got = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[
        0
    ].prompt_logprobs
    assert got is not None
    for i in (1, 7, 20):
        # a logit bias makes prompt[i] the sampled token; its reported logprob is the raw model's
        forced = llm.generate(
            [prompt[:i]], SamplingParams(max_tokens=1, temperature=0, logprobs=0, logit_bias={prompt[i]: 100})
        )[0]
        assert forced.token_ids == [prompt[i]]
        assert abs(forced.logprobs[0].logprob - got[i].logprob) < 1e-4, i


def test_prompt_logprobs_once_after_preemption() -> None:
    """A KV pool too small for all requests at once: decode preempts and recomputes; the prompt logprobs
    are reported once and equal those of a roomy run."""
    rng = random.Random(4)
    prompts = [[1] + [rng.randrange(3, 250) for _ in range(40)] for _ in range(4)]
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, prompt_logprobs=1)
    kv = {"tokens_per_block": 8, "enable_block_reuse": False, "max_gpu_total_bytes": 64 * 2**20}
    roomy = LLM(warmup="off", log=lambda s: None, max_batch_size=8, max_num_tokens=256, kv_cache_config=kv)
    tight = LLM(
        warmup="off",
        log=lambda s: None,
        max_batch_size=8,
        max_num_tokens=256,
        max_seq_len=96,
        kv_cache_config={**kv, "max_tokens": 112},
    )
    want = roomy.generate(prompts, p)
    got = tight.generate(prompts, p)
    assert tight.stats()["num_preemptions"] > 0
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == 41
        assert all(
            abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])
        )


def test_prompt_logprobs_skip_the_prefix_cache() -> None:
    llm = LLM(
        warmup="off",
        log=lambda s: None,
        kv_cache_config={"tokens_per_block": 8, "mamba_state_config": {"periodic_snapshot_interval": 16}},
    )
    rng = random.Random(2)
    prompt = [1] + [rng.randrange(3, 250) for _ in range(60)]
    plain = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    llm.generate([prompt], plain)
    assert llm.generate([prompt], plain)[0].num_cached_tokens > 0
    with_lp = llm.generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)
    )[0]
    assert with_lp.num_cached_tokens == 0 and len(with_lp.prompt_logprobs) == len(prompt)


def test_prompt_logprobs_bad_value() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be an integer in"):
        SamplingParams(prompt_logprobs=21)
