"""Default sizes from memory: an unset max_batch_size / max_num_tokens, the snapshot slots an auto-sized plan
keeps, the step-time target's default, and the vLLM spellings of the same options."""

from __future__ import annotations

import dataclasses

import pytest

from hyserve.cache.batch_sizing import (
    AUTO_CONTEXT_TOKENS,
    AUTO_MAX_BATCH_SIZE_CPU,
    DEFAULT_MAX_NUM_TOKENS,
    size_batch,
)
from hyserve.cache.capacity import CapacityInputs, plan_capacity
from hyserve.config import DEFAULT_MAX_STEP_MS, build_engine_config

MIB, GIB = 2**20, 2**30
# Nemotron 3 Nano 30B-A3B's pools (float32 state, bf16 KV): 47 MiB a sequence, 6 KiB a token
NANO30 = dict(kv_bytes_per_token=6 * 1024, state_bytes_per_slot=47 * MIB, tokens_per_block=64)


def sized(budget: int, **kw):
    args = dict(
        budget_bytes=budget,
        **NANO30,
        max_seq_len=4096,
        num_pad_slots=1,
        enable_block_reuse=True,
        cap=1024,
        max_batch_size=None,
        max_num_tokens=None,
    )
    args.update(kw)
    return size_batch(**args)


def test_plenty_of_memory_gives_the_cap_and_a_token_budget_of_at_least_8192():
    s = sized(96 * GIB)
    assert (s.max_batch_size, s.max_num_tokens) == (1024, DEFAULT_MAX_NUM_TOKENS)
    assert s.auto_batch and s.auto_tokens and "cap of 1,024" in s.limit


def test_the_batch_shrinks_to_what_the_state_and_kv_of_its_requests_fit():
    budget = 20 * GIB
    s = sized(budget)
    assert 64 <= s.max_batch_size < 1024
    assert "Mamba state pool" in s.limit and "20.0 GiB" in s.limit
    # the chosen size fits its requests' state, snapshots and KV; the next candidate up would not
    for b, fits in ((s.max_batch_size, True), (s.max_batch_size + 64, False)):
        snaps = max(16, -(-b // 8))
        state = (b + 1 + snaps) * NANO30["state_bytes_per_slot"]
        kv = (4096 // 64 + b * AUTO_CONTEXT_TOKENS // 64) * 64 * NANO30["kv_bytes_per_token"]
        assert (state + kv <= budget) is fits


def test_a_long_max_seq_len_is_planned_for_before_the_batch():
    short = sized(20 * GIB)
    long = sized(20 * GIB, max_seq_len=1 << 20)  # one 1M-token request's KV (6 GiB) comes first
    assert long.max_batch_size < short.max_batch_size


def test_user_settings_are_kept_and_max_num_tokens_caps_the_batch():
    s = sized(96 * GIB, max_batch_size=48)
    assert (s.max_batch_size, s.max_num_tokens, s.auto_batch) == (48, DEFAULT_MAX_NUM_TOKENS, False)
    s = sized(96 * GIB, max_num_tokens=512)
    assert (s.max_batch_size, s.max_num_tokens, s.auto_tokens) == (512, 512, False)
    assert "max_num_tokens 512" in s.limit


def test_nothing_fits_plans_one_request_and_leaves_the_error_to_the_planner():
    s = sized(10 * MIB)
    assert s.max_batch_size == 1
    with pytest.raises(ValueError, match="cache budget .* is too small"):
        plan_capacity(inputs_for(s, 10 * MIB))


def inputs_for(s, budget: int) -> CapacityInputs:
    return CapacityInputs(
        budget_bytes=budget,
        kv_bytes_per_token=NANO30["kv_bytes_per_token"],
        state_bytes_per_slot=NANO30["state_bytes_per_slot"],
        max_batch_size=s.max_batch_size,
        max_seq_len=4096,
        max_num_tokens=s.max_num_tokens,
        tokens_per_block=64,
        enable_block_reuse=True,
        periodic_snapshot_interval=256,
        num_snapshot_offsets=1,
        avg_seq_len=None,
        num_pad_slots=1,
        min_snapshot_slots=s.min_snapshot_slots,
    )


def test_an_auto_sized_plan_keeps_mamba_snapshot_slots_at_batch_1024():
    budget = 70 * GIB  # the state of 1,024 requests (47 GiB) and their KV at avg_seq_len fill it
    s = sized(budget)
    assert s.max_batch_size == 1024
    plain = plan_capacity(dataclasses.replace(inputs_for(s, budget), min_snapshot_slots=0))
    kept = plan_capacity(inputs_for(s, budget))
    assert plain.num_snapshot_slots == 0  # KV for 1,024 requests of avg_seq_len took everything
    assert kept.num_snapshot_slots >= s.min_snapshot_slots >= 1024 // 8
    assert kept.num_live_slots == 1024 and kept.total_bytes <= budget
    assert kept.max_request_tokens == 4096  # the KV floor is untouched
    assert kept.kv_tokens >= 1024 * AUTO_CONTEXT_TOKENS  # and every running request has its context
    assert not any("snapshot" in w for w in kept.warnings)


def test_the_tiny_cpu_engine_sizes_itself_and_runs_more_than_64_requests_at_once():
    from hyserve import LLM, SamplingParams

    llm = LLM()
    eng = llm.engine
    sc = eng.config.scheduler
    assert (sc.max_batch_size, sc.max_num_tokens) == (AUTO_MAX_BATCH_SIZE_CPU, DEFAULT_MAX_NUM_TOKENS)
    assert eng.plan.num_snapshot_slots > 0 and "sized from memory" in eng.plan.report()
    sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    for i in range(160):
        eng.add_request(f"r{i}", [5 + i % 50] * 12, sp)
    eng.step()
    assert len(eng.scheduler.running) == 160
    while eng.has_unfinished():
        eng.step()
    llm.close()


@pytest.mark.parametrize(
    "value, expect",
    [("auto", "auto"), ("off", None), (None, None), (150, 150.0), ("75.5", 75.5)],
)
def test_max_step_ms_takes_auto_off_or_milliseconds(value, expect):
    sc = build_engine_config({"max_step_ms": value}).scheduler
    assert sc.max_step_ms == expect


def test_max_step_ms_defaults_to_a_target_on_cuda_only():
    sc = build_engine_config({}).scheduler
    assert sc.step_target_ms("cuda") == DEFAULT_MAX_STEP_MS
    assert sc.step_target_ms("cpu") is None
    assert build_engine_config({"max_step_ms": 80}).scheduler.step_target_ms("cpu") == 80.0


@pytest.mark.parametrize("bad", [0, -5, "fast", True, float("inf")])
def test_a_bad_max_step_ms_is_refused_naming_the_choices(bad):
    with pytest.raises(ValueError, match="max_step_ms: expected a positive number of milliseconds, 'auto'"):
        build_engine_config({"max_step_ms": bad})


def test_vllm_spellings_set_the_same_options():
    sc = build_engine_config({"max_num_seqs": 32, "max_num_batched_tokens": 2048}).scheduler
    assert (sc.max_batch_size, sc.max_num_tokens) == (32, 2048)
    with pytest.raises(ValueError, match="max_num_tokens=16 is smaller than max_batch_size=32"):
        build_engine_config({"max_batch_size": 32, "max_num_tokens": 16})


def test_serve_flags_reach_the_options():
    from hyserve.cli import build_parser, engine_options_from_args

    args = build_parser().parse_args(
        ["serve", "--max-num-seqs", "96", "--max-num-batched-tokens", "4096", "--max_step_ms", "off"]
    )
    opts = engine_options_from_args(args)[0]
    assert (opts["max_batch_size"], opts["max_num_tokens"], opts["max_step_ms"]) == (96, 4096, "off")
    assert build_engine_config(opts).scheduler.max_step_ms is None


def _chunks(max_step_ms: str, n: int = 2250) -> list[int]:
    """The chunk sizes the tiny CPU engine feeds an n-token prompt, step by step, with a 512-token budget."""
    from hyserve import LLM, SamplingParams

    llm = LLM(max_seq_len=4096, max_num_tokens=512, max_step_ms=max_step_ms)
    eng = llm.engine
    eng.add_request("long", [7 + i % 200 for i in range(n)], SamplingParams(max_tokens=1, ignore_eos=True))
    sizes = []
    while eng.has_unfinished():
        before = eng.requests["long"].num_computed if "long" in eng.requests else n
        eng.step()
        after = eng.requests["long"].num_computed if "long" in eng.requests else n
        sizes.append(after - before)
    llm.close()
    return [s for s in sizes if s]


def test_on_the_cpu_auto_counts_a_step_cost_so_late_chunks_of_a_long_prompt_shrink():
    auto, off = _chunks("auto"), _chunks("off")
    assert sum(auto) == sum(off) == 2250
    assert off[:4] == [512] * 4  # the token budget alone: every chunk as large as it may be
    assert auto[0] == 512  # the first chunk costs what the target allows
    assert all(b <= a for a, b in zip(auto, auto[1:]))  # later chunks pay attention over more context
    assert auto[-2] < 256 and len(auto) > len(off)


def test_the_analytic_cost_model_bounds_a_step_by_one_full_first_chunk():
    from hyserve.engine.scheduler.step_cost import analytic_step_cost

    m = analytic_step_cost(params=10**9, attention_flops_per_pair=4 * 32 * 128 * 8, max_num_tokens=8192)
    assert m.source == "analytic" and m.max_chunk(0, m.target_ms) == 8192
    for start in (8192, 65536, 1 << 20):
        n = m.max_chunk(start, m.target_ms)
        assert 0 < n < 8192 and m.chunk_ms(start, n) <= m.target_ms < m.chunk_ms(start, n + 1)
    assert "analytic" in m.describe()
