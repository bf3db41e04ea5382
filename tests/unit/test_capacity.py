"""CapacityPlan: the seed scenario, every validation error, and properties over random inputs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hyserve.cache import CapacityInputs, CapacityPlan, plan_capacity

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# The long-prompt crash report behind the planner: Nemotron-class hybrid, 1M max_seq_len.
SEED = CapacityInputs(
    budget_bytes=100 * GiB,
    kv_bytes_per_token=16 * KiB,
    state_bytes_per_slot=137 * MiB + 512 * KiB,  # 137.5 MiB
    max_batch_size=8,
    max_seq_len=1_048_576,
    max_num_tokens=16_384,
    tokens_per_block=64,
    enable_block_reuse=True,
    periodic_snapshot_interval=256,
    num_snapshot_offsets=1,
    avg_seq_len=None,
    num_pad_slots=0,
)


def _check_plan(plan: CapacityPlan) -> None:
    """Identities every plan must satisfy."""
    inp = plan.inputs
    block_bytes = inp.kv_bytes_per_token * inp.tokens_per_block
    assert plan.total_bytes <= inp.budget_bytes
    assert plan.kv_tokens == plan.num_kv_blocks * inp.tokens_per_block
    assert plan.kv_bytes == plan.num_kv_blocks * block_bytes
    assert plan.num_live_slots == inp.max_batch_size
    assert plan.num_pad_slots == inp.num_pad_slots
    slots = plan.num_live_slots + plan.num_pad_slots + plan.num_snapshot_slots
    assert plan.state_bytes == slots * inp.state_bytes_per_slot
    assert plan.total_bytes == plan.kv_bytes + plan.state_bytes
    assert plan.num_kv_blocks >= 1
    assert 0 <= plan.num_snapshot_slots <= plan.desired_snapshot_slots
    if not inp.enable_block_reuse or inp.state_bytes_per_slot == 0:
        assert plan.num_snapshot_slots == 0
    if inp.kv_bytes_per_token == 0:
        assert plan.max_request_tokens == inp.max_seq_len
    else:
        assert plan.max_request_tokens == min(inp.max_seq_len, plan.kv_tokens)
    if not inp.allow_oversized_max_seq_len:
        assert plan.max_request_tokens == inp.max_seq_len
    assert 0 < plan.concurrency_at_avg <= inp.max_batch_size
    assert 1 <= plan.avg_seq_len <= inp.max_seq_len


# ----------------------------------------------------------------------------- seed scenario


def test_seed_scenario_fits_one_million_tokens() -> None:
    plan = plan_capacity(SEED)
    _check_plan(plan)
    assert plan.max_request_tokens == 1_048_576
    assert plan.kv_tokens >= 1_048_576 + 7 * 64
    # avg derived from max_num_tokens: 16384 tokens -> 64 periodic + 1 offset snapshot per request.
    assert plan.avg_seq_len == 16_384 and "derived" in plan.avg_seq_len_source
    assert plan.desired_snapshot_slots == 8 * (16_384 // 256) + 8 == 520
    assert plan.num_snapshot_slots == 520
    assert plan.num_live_slots == 8 and plan.num_pad_slots == 0
    assert plan.concurrency_at_avg == 8.0
    # Everything left after state goes to KV: less than one block of the budget is unused.
    assert SEED.budget_bytes - plan.total_bytes < SEED.kv_bytes_per_token * SEED.tokens_per_block
    report = plan.report()
    for text in ("1,048,576", "snapshot slots", "520", "live slots", "avg_seq_len", "GiB", "concurrency"):
        assert text in report
    json.dumps(plan.to_dict())


def test_seed_scenario_user_avg_only_moves_the_split() -> None:
    base = plan_capacity(SEED)
    for avg in (1, 9000, 524_288, 1_048_576):
        plan = plan_capacity(dataclasses.replace(SEED, avg_seq_len=avg))
        _check_plan(plan)
        assert plan.avg_seq_len_source == "set by user"
        assert plan.max_request_tokens == base.max_request_tokens == 1_048_576
    # With avg = max_seq_len / 2 the snapshots want 8 * 2049 slots; they only get what is left
    # after the 1M-token floor, never the floor itself.
    plan = plan_capacity(dataclasses.replace(SEED, avg_seq_len=524_288))
    assert plan.num_snapshot_slots < plan.desired_snapshot_slots
    assert plan.num_kv_blocks >= plan.kv_floor_blocks == 1_048_576 // 64 + 7
    assert any("snapshot" in w for w in plan.warnings)


def test_kv_for_the_batch_at_avg_seq_len_comes_before_snapshots() -> None:
    """Nano 9B v2 serving 128 requests (the H200 run that prompted this): snapshots wanted 4,224 slots
    of 137 MiB and used to squeeze KV to the floor (44k tokens: 5.4 requests at avg_seq_len). KV for
    max_batch_size requests of avg_seq_len is now reserved first; snapshots get what is left."""
    inp = dataclasses.replace(
        SEED,
        budget_bytes=106 * GiB,
        max_batch_size=128,
        max_seq_len=32_768,
        max_num_tokens=8192,
        num_pad_slots=1,
    )
    plan = plan_capacity(inp)
    _check_plan(plan)
    assert plan.avg_seq_len == 8192 and plan.concurrency_at_avg == 128.0
    assert plan.kv_tokens >= 128 * 8192
    assert 0 < plan.num_snapshot_slots < plan.desired_snapshot_slots
    # the rest of the budget is still used: snapshots, then KV, leave less than a slot unused
    assert inp.budget_bytes - plan.total_bytes < inp.state_bytes_per_slot
    # a budget that cannot hold the batch's KV at avg_seq_len leaves nothing for snapshots
    small = plan_capacity(dataclasses.replace(inp, budget_bytes=30 * GiB))
    _check_plan(small)
    assert small.num_snapshot_slots == 0 and small.concurrency_at_avg < 128


def test_seed_scenario_budget_too_small_names_max_seq_len() -> None:
    with pytest.raises(ValueError) as exc:
        plan_capacity(dataclasses.replace(SEED, budget_bytes=10 * GiB))
    msg = str(exc.value)
    assert "max_seq_len=1,048,576" in msg
    assert "584,960 tokens" in msg  # what fits: (10 GiB - 8 x 137.5 MiB) // (64 x 16 KiB) blocks
    assert "16,391 blocks" in msg  # what is needed: 16384 + 7
    assert "free_gpu_memory_fraction" in msg and "max_gpu_total_bytes" in msg
    assert "max_batch_size" in msg and "allow_oversized_max_seq_len" in msg


def test_seed_scenario_oversized_allowed_caps_requests() -> None:
    plan = plan_capacity(dataclasses.replace(SEED, budget_bytes=10 * GiB, allow_oversized_max_seq_len=True))
    _check_plan(plan)
    assert plan.max_request_tokens < SEED.max_seq_len
    assert plan.max_request_tokens == plan.kv_tokens == 9140 * 64
    assert any("refused at admission" in w for w in plan.warnings)
    assert "WARNING" in plan.report()


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("change", "knob"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"max_num_tokens": 0}, "max_num_tokens"),
        ({"max_num_tokens": 4}, "max_num_tokens"),  # < max_batch_size
        ({"tokens_per_block": 0}, "kv_cache_config.tokens_per_block"),
        ({"avg_seq_len": 0}, "kv_cache_config.avg_seq_len"),
        ({"avg_seq_len": 2_000_000}, "kv_cache_config.avg_seq_len"),
        ({"periodic_snapshot_interval": 0}, "periodic_snapshot_interval"),
        ({"periodic_snapshot_interval": 100}, "periodic_snapshot_interval"),  # not a multiple of 64
        ({"max_kv_tokens": 0}, "kv_cache_config.max_tokens"),
        ({"max_kv_tokens": 500_000}, "kv_cache_config.max_tokens"),  # < max_seq_len
        ({"budget_bytes": -1}, "free_gpu_memory_fraction"),
        ({"budget_bytes": 1 * GiB}, "max_batch_size"),  # not even the live state fits
        ({"max_batch_size": 8.0}, "max_batch_size"),
        ({"max_seq_len": True}, "max_seq_len"),
        ({"num_snapshot_offsets": -1}, "additional_snapshot_offsets_from_end"),
        ({"num_pad_slots": -1}, "num_pad_slots"),
        ({"kv_bytes_per_token": -1}, "kv_bytes_per_token"),
        ({"enable_block_reuse": 1}, "kv_cache_config.enable_block_reuse"),
    ],
)
def test_bad_inputs_name_the_knob(change: dict, knob: str) -> None:
    with pytest.raises(ValueError, match=knob.replace(".", r"\.")):
        plan_capacity(dataclasses.replace(SEED, **change))


def test_state_budget_error_says_bytes_needed() -> None:
    with pytest.raises(ValueError) as exc:
        plan_capacity(dataclasses.replace(SEED, budget_bytes=1 * GiB))
    msg = str(exc.value)
    need = 8 * SEED.state_bytes_per_slot + 64 * 16 * KiB
    assert f"{need:,} bytes" in msg and "lower max_batch_size" in msg.lower()


def test_interval_error_suggests_a_multiple() -> None:
    with pytest.raises(ValueError, match="Try 128"):
        plan_capacity(dataclasses.replace(SEED, periodic_snapshot_interval=100))


# ----------------------------------------------------------------------------- special cases


def test_max_kv_tokens_caps_kv() -> None:
    plan = plan_capacity(dataclasses.replace(SEED, max_kv_tokens=1_200_000))
    _check_plan(plan)
    assert plan.num_kv_blocks == -(-1_200_000 // 64)
    assert plan.num_snapshot_slots == plan.desired_snapshot_slots == 520
    assert plan.total_bytes < SEED.budget_bytes


def test_memory_freed_by_kv_cap_goes_to_snapshots() -> None:
    # Snapshots are memory-bound (avg = max_seq_len / 2 wants 16,392 of them); a KV cap below the
    # floor (allowed by the flag) hands the freed bytes back to snapshot slots.
    inp = dataclasses.replace(SEED, avg_seq_len=524_288, allow_oversized_max_seq_len=True)
    uncapped = plan_capacity(inp)
    capped = plan_capacity(dataclasses.replace(inp, max_kv_tokens=1000))
    _check_plan(capped)
    assert capped.num_kv_blocks == 16 and capped.max_request_tokens == 1024
    freed = (uncapped.num_kv_blocks - capped.num_kv_blocks) * 64 * 16 * KiB
    assert capped.num_snapshot_slots > uncapped.num_snapshot_slots
    assert capped.num_snapshot_slots - uncapped.num_snapshot_slots == (
        (SEED.budget_bytes - uncapped.total_bytes + freed) // SEED.state_bytes_per_slot
    )


def test_max_kv_tokens_between_max_seq_len_and_floor_is_raised_to_floor() -> None:
    plan = plan_capacity(dataclasses.replace(SEED, max_kv_tokens=1_048_576))
    _check_plan(plan)
    assert plan.num_kv_blocks == plan.kv_floor_blocks == 16_384 + 7
    assert any("raised" in w for w in plan.warnings)


def test_max_kv_tokens_below_max_seq_len_with_flag() -> None:
    plan = plan_capacity(dataclasses.replace(SEED, max_kv_tokens=1000, allow_oversized_max_seq_len=True))
    _check_plan(plan)
    assert plan.num_kv_blocks == 16 and plan.max_request_tokens == 1024


def test_pure_mamba_blocks_cost_nothing() -> None:
    inp = dataclasses.replace(SEED, kv_bytes_per_token=0, budget_bytes=10 * GiB, max_kv_tokens=5)
    plan = plan_capacity(inp)
    _check_plan(plan)
    assert plan.kv_bytes == 0 and plan.num_kv_blocks == 16_384 + 7
    assert plan.max_request_tokens == SEED.max_seq_len
    assert plan.num_snapshot_slots == (10 * GiB) // SEED.state_bytes_per_slot - 8


def test_pure_attention_has_no_state() -> None:
    plan = plan_capacity(dataclasses.replace(SEED, state_bytes_per_slot=0, budget_bytes=20 * GiB))
    _check_plan(plan)
    assert plan.state_bytes == 0 and plan.num_snapshot_slots == 0
    assert plan.num_kv_blocks == (20 * GiB) // (64 * 16 * KiB)


def test_reuse_off_means_no_snapshots_and_pad_slots_are_charged() -> None:
    plan = plan_capacity(dataclasses.replace(SEED, enable_block_reuse=False, num_pad_slots=2))
    _check_plan(plan)
    assert plan.num_snapshot_slots == 0 and plan.desired_snapshot_slots == 0
    assert plan.state_bytes == 10 * SEED.state_bytes_per_slot


def test_snapshots_at_least_one_per_running_request() -> None:
    plan = plan_capacity(dataclasses.replace(SEED, periodic_snapshot_interval=None, num_snapshot_offsets=0))
    assert plan.desired_snapshot_slots == 8 and plan.num_snapshot_slots == 8


# ----------------------------------------------------------------------------- properties


@st.composite
def capacity_inputs(draw: st.DrawFn) -> CapacityInputs:
    tpb = draw(st.sampled_from([1, 16, 32, 64, 128]))
    max_seq_len = draw(st.integers(min_value=1, max_value=2_000_000))
    max_batch_size = draw(st.integers(min_value=1, max_value=256))
    kv = draw(st.sampled_from([0, 1, 3, 2048, 16 * KiB, 200_000]))
    state = draw(st.sampled_from([0, 1, 7, 1 * MiB, 69 * MiB, 137 * MiB + 512 * KiB]))
    pad = draw(st.integers(min_value=0, max_value=8))
    # Aim the budget around what the floor needs so both outcomes are common.
    need = (max_batch_size + pad) * state + (-(-max_seq_len // tpb) + max_batch_size - 1) * kv * tpb
    per_mille = draw(st.integers(min_value=0, max_value=3000))  # hypothesis favours small ints:
    budget = need * per_mille // 1000 + draw(st.integers(min_value=0, max_value=GiB))  # scale them
    interval = draw(st.none() | st.integers(min_value=1, max_value=64).map(lambda k: k * tpb))
    return CapacityInputs(
        budget_bytes=budget,
        kv_bytes_per_token=kv,
        state_bytes_per_slot=state,
        max_batch_size=max_batch_size,
        max_seq_len=max_seq_len,
        max_num_tokens=draw(st.integers(min_value=max_batch_size, max_value=65_536)),
        tokens_per_block=tpb,
        enable_block_reuse=draw(st.booleans()),
        periodic_snapshot_interval=interval,
        num_snapshot_offsets=draw(st.integers(min_value=0, max_value=3)),
        avg_seq_len=draw(st.none() | st.integers(min_value=1, max_value=max_seq_len)),
        num_pad_slots=pad,
        max_kv_tokens=draw(st.none() | st.integers(min_value=1, max_value=4_000_000)),
        allow_oversized_max_seq_len=draw(st.booleans()),
    )


def _plan_or_error(inp: CapacityInputs) -> CapacityPlan | str:
    try:
        return plan_capacity(inp)
    except ValueError as e:
        return str(e)


@settings(max_examples=400, deadline=None)
@given(inp=capacity_inputs(), data=st.data())
def test_plan_properties(inp: CapacityInputs, data: st.DataObject) -> None:
    result = _plan_or_error(inp)
    other_avg = data.draw(st.none() | st.integers(min_value=1, max_value=inp.max_seq_len), label="other_avg")
    other = _plan_or_error(dataclasses.replace(inp, avg_seq_len=other_avg))
    if isinstance(result, str):
        # Whether settings are legal must not depend on avg_seq_len, and the error is exact:
        # it happens only when the state + KV floor or the user's KV cap really cannot hold it.
        assert isinstance(other, str)
        block_bytes = inp.kv_bytes_per_token * inp.tokens_per_block
        fixed = (inp.max_batch_size + inp.num_pad_slots) * inp.state_bytes_per_slot
        floor = -(-inp.max_seq_len // inp.tokens_per_block) + inp.max_batch_size - 1
        kv_cap_too_small = (
            block_bytes > 0 and inp.max_kv_tokens is not None and inp.max_kv_tokens < inp.max_seq_len
        )
        if inp.allow_oversized_max_seq_len:
            assert inp.budget_bytes < fixed + block_bytes
        else:
            assert inp.budget_bytes < fixed + floor * block_bytes or kv_cap_too_small
        return
    assert isinstance(other, CapacityPlan)
    _check_plan(result)
    _check_plan(other)
    assert other.max_request_tokens == result.max_request_tokens
    if not inp.allow_oversized_max_seq_len:
        assert result.max_request_tokens == inp.max_seq_len
    # More budget never shortens the longest request.
    bigger = plan_capacity(dataclasses.replace(inp, budget_bytes=inp.budget_bytes * 2 + 12345))
    assert bigger.max_request_tokens >= result.max_request_tokens
    assert result.report() and json.dumps(result.to_dict())


@settings(max_examples=200, deadline=None)
@given(inp=capacity_inputs())
def test_oversized_flag_never_fails_when_state_fits(inp: CapacityInputs) -> None:
    inp = dataclasses.replace(inp, allow_oversized_max_seq_len=True)
    block_bytes = inp.kv_bytes_per_token * inp.tokens_per_block
    assume(
        inp.budget_bytes >= (inp.max_batch_size + inp.num_pad_slots) * inp.state_bytes_per_slot + block_bytes
    )
    plan = plan_capacity(inp)
    _check_plan(plan)
    assert 1 <= plan.max_request_tokens <= inp.max_seq_len
