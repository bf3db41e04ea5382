"""The production crash behind this project (docs/architecture.md: a hybrid cache manager that segfaulted on a
256k-token prompt), scaled to the CPU: a tiny hybrid model served with max_seq_len = 1,048,576, avg_seq_len
unset, block reuse on with periodic snapshots, and a KV pool smaller than the longest allowed prompt."""

from __future__ import annotations

import random

import pytest

from hyserve import LLM, RequestRejected, SamplingParams

KV = {
    "tokens_per_block": 16,
    "enable_block_reuse": True,
    "max_tokens": 2048,  # the pool: 2,048 KV tokens, far below max_seq_len
    "max_gpu_total_bytes": 64 * 2**20,
    "allow_oversized_max_seq_len": True,
    "mamba_state_config": {"periodic_snapshot_interval": 64, "additional_snapshot_offsets_from_end": [0]},
}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_seq_len=1_048_576, max_batch_size=4, max_num_tokens=512, kv_cache_config=KV)


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 300) for _ in range(n - 1)]


def test_capacity_report_explains_the_limit(llm: LLM) -> None:
    plan = llm.engine.plan
    assert plan.max_request_tokens == 2048
    assert plan.inputs.avg_seq_len is None
    report = llm.engine.capacity_report()
    assert "2,048" in report and "1,048,576" in report


def test_oversized_prompt_is_refused_with_the_limit(llm: LLM) -> None:
    with pytest.raises(RequestRejected) as e:
        llm.generate([ids(256_000, 1)], SamplingParams(max_tokens=64))
    msg = str(e.value)
    assert "256064" in msg.replace(",", "") and "2048" in msg.replace(",", "")
    # the engine is untouched and still serves
    u = llm.cache_usage()
    assert u["kv_blocks_free"] == u["kv_blocks_total"]
    out = llm.generate([ids(40, 2)], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) >= 1


def test_prompt_that_fits_only_after_evicting_the_prefix_cache(llm: LLM) -> None:
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    # fill the prefix cache with two 900-token prompts (their blocks stay cached after they finish)
    for s in (10, 11):
        llm.generate([ids(900, s)], p)
    u = llm.cache_usage()
    assert u["prefix_cache_entries"] > 0
    free_before = u["kv_blocks_free"]
    assert free_before == u["kv_blocks_total"]  # cached blocks count as reclaimable
    # 1,900 tokens + 8 need 120 of the 128 blocks: only possible by evicting cached blocks
    big = llm.generate([ids(1900, 12)], p)[0]
    assert len(big.token_ids) == 8 and big.finish_reason == "length"
    # and the next normal request is served
    nxt = llm.generate([ids(50, 13)], p)[0]
    assert len(nxt.token_ids) == 8


def test_prompt_many_chunks_long(llm: LLM) -> None:
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompt = ids(2000, 20)  # 4 chunks of max_num_tokens=512 plus snapshot cuts
    first = llm.generate([prompt], p)[0]
    again = llm.generate([prompt], p)[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens >= 1920  # hit at a snapshot boundary deep in the prompt


def test_startup_refuses_a_max_seq_len_that_cannot_fit() -> None:
    kv = dict(KV, allow_oversized_max_seq_len=False)
    with pytest.raises(ValueError) as e:
        LLM(max_seq_len=1_048_576, max_batch_size=4, max_num_tokens=512, kv_cache_config=kv)
    msg = str(e.value)
    assert "max_seq_len" in msg
