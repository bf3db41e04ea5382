"""The offline API: shapes of outputs, sampling options, and clear errors for bad input."""

from __future__ import annotations

import pytest

from hyserve import LLM, RequestRejected, SamplingParams


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_batch_size=8, max_num_tokens=128, max_seq_len=512)


def test_text_and_token_prompts(llm: LLM) -> None:
    outs = llm.generate(["Hello there", [1, 50, 60, 70]], SamplingParams(max_tokens=5, temperature=0))
    assert len(outs) == 2
    a, b = outs
    assert a.prompt == "Hello there" and a.prompt_token_ids[0] == llm.tokenizer.bos_token_id
    assert b.prompt is None and b.prompt_token_ids == [1, 50, 60, 70]
    for o in outs:
        assert 1 <= len(o.token_ids) <= 5
        assert o.finish_reason in ("stop", "length")
        assert isinstance(o.text, str)


def test_logprobs_top_k(llm: LLM) -> None:
    o = llm.generate([[1, 5, 6]], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert o.logprobs is not None and len(o.logprobs) == 4
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        # greedy: the chosen token is the most likely one
        assert lp.logprob == pytest.approx(max(lp.top.values()), abs=1e-5)
        assert lp.logprob <= 0.0


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    p = SamplingParams(
        max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, seed=7, ignore_eos=True
    )
    alone = llm.generate([[1, 9, 9, 9]], p)[0].token_ids
    together = llm.generate([[1, 9, 9, 9], [1, 4, 4], [1, 2, 3, 4, 5]], p)[0].token_ids
    assert alone == together


def test_max_tokens_and_stop_token_ids(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = llm.generate([[1, 30, 31]], greedy)[0]
    assert len(ref.token_ids) == 6 and ref.finish_reason == "length"
    stop_tok = ref.token_ids[2]
    first = ref.token_ids.index(stop_tok)
    o = llm.generate(
        [[1, 30, 31]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok])
    )[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_tok
    assert o.token_ids == ref.token_ids[: first + 1]


def test_stop_string_trims_text(llm: LLM) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = llm.generate(["abc"], greedy)[0]
    if len(ref.text) < 4:
        pytest.skip("the random model produced too little text")
    stop = ref.text[2:4]
    o = llm.generate(["abc"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == ref.text[: ref.text.index(stop)]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": 100}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_rejections_name_the_limit(llm: LLM) -> None:
    with pytest.raises(RequestRejected, match="max_seq_len = 512"):
        llm.generate([[1] * 500], SamplingParams(max_tokens=20))
    with pytest.raises(RequestRejected, match="vocabulary"):
        llm.generate([[1, 99999]], SamplingParams(max_tokens=2))
    with pytest.raises(RequestRejected, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=2))
    # nothing leaked, and it keeps serving
    assert llm.cache_usage()["live_slots_used"] == 0
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids


def test_cache_usage_keys(llm: LLM) -> None:
    u = llm.cache_usage()
    for k in (
        "kv_blocks_total",
        "kv_blocks_free",
        "live_slots_total",
        "live_slots_used",
        "snapshot_slots_total",
        "snapshot_slots_used",
        "prefix_cache_entries",
    ):
        assert k in u


def test_dummy_config_only_model(tmp_path) -> None:
    import json
    import shutil

    from hyserve.model.tiny import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("moe")))
    with pytest.raises(ValueError, match="dummy"):
        LLM(str(tmp_path))
    llm = LLM(str(tmp_path), load_format="dummy", max_seq_len=256, max_batch_size=2, max_num_tokens=64)
    assert llm.tokenizer is None
    o = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(o.token_ids) == 3
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["text prompt"], SamplingParams(max_tokens=2))
    shutil.rmtree(tmp_path)
