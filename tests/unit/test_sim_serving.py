"""benchmarks/sim_serving.py: the closed-loop serving simulation over hyserve's scheduler."""

from __future__ import annotations

import json

import pytest

from benchmarks import sim_serving
from benchmarks.sim_serving import DEVICES, Setting, Workload, simulate, summarize


def test_the_presets_reproduce_their_measured_decode_steps() -> None:
    assert DEVICES["h100-30b-fp8"].step_ms(512, 0) == pytest.approx(37.2)
    assert DEVICES["h200-30b-fp8"].step_ms(1024, 0) == pytest.approx(50.9)
    # the prefill line the engine's calibration fitted: 19.1 ms + 15.4 us a token
    assert DEVICES["h100-30b-fp8"].step_ms(0, 1000) == pytest.approx(19.1 + 15.4)


def test_a_closed_loop_serves_every_prompt_and_keeps_concurrency() -> None:
    work = Workload(concurrency=4, num_prompts=10, input_len=200, output_len=6)
    line, steps, total = simulate(Setting(8, 256, 150.0), work, DEVICES["h100-30b-fp8"])
    assert sorted(line.arrival) == sorted(f"r{i}" for i in range(10))
    assert all(len(ts) == 6 for ts in line.tokens.values())  # max_tokens exactly, ignore_eos
    assert [line.arrival[f"r{i}"] for i in range(4)] == [0.0] * 4  # the first `concurrency` at once
    finishes = sorted(ts[-1] for ts in line.tokens.values())
    # each later request arrives when an earlier one's last token is read: at most 4 in flight
    for i in range(4, 10):
        t = line.arrival[f"r{i}"]
        assert t in finishes
        in_flight = sum(1 for r, a in line.arrival.items() if a <= t < line.tokens[r][-1])
        assert in_flight <= 4
    assert total == pytest.approx(sum(steps) / 1e3)
    # 200-token prompts on a 256-token budget: at least one step per prompt beyond the decodes
    assert len(steps) >= 6 * 10 // 4


def test_a_step_time_target_holds_steps_the_token_budget_alone_would_not() -> None:
    """Prefill of 8 prompts at once: with the 150 ms target every step stays near it (the calibration
    underestimates decode rows until the feedback corrects it); without one, a step takes the whole
    token budget."""
    work = Workload(concurrency=8, num_prompts=8, input_len=4000, output_len=4)
    device = DEVICES["h100-30b-fp8"]
    _, timed, _ = simulate(Setting(8, 16384, 150.0), work, device)
    _, untimed, _ = simulate(Setting(8, 16384, None), work, device)
    assert max(untimed) > 250.0  # 16,384 prompt tokens: 19.1 + 252 ms
    assert max(timed) < 1.1 * 150.0


def test_summary_and_files(tmp_path, capsys) -> None:
    work = Workload(concurrency=2, num_prompts=3, input_len=64, output_len=3)
    rec = summarize(
        Setting(4, 128, None),
        work,
        "h100-30b-fp8",
        simulate(Setting(4, 128, None), work, DEVICES["h100-30b-fp8"]),
    )
    assert rec["name"] == "sim h100-30b-fp8 c2 n3 64/3" and rec["setting"].endswith("max_step_ms off")
    assert rec["ttft_ms_p50"] > 0 and rec["itl_ms_p99"] >= rec["itl_ms_p50"] > 0
    out = tmp_path / "sim.json"
    sim_serving.main(
        [
            "--concurrency",
            "2",
            "--num-prompts",
            "3",
            "--input-len",
            "64",
            "--output-len",
            "3",
            "--max-batch-size",
            "4",
            "--max-num-tokens",
            "128",
            "--max-step-ms",
            "off",
            "150",
            "--out",
            str(out),
        ]
    )
    doc = json.loads(out.read_text())
    assert [r["setting"][-3:] for r in doc["records"]] == ["off", "150"]
    assert "simulated device h200-30b-fp8" in doc["gpu"]
    assert "| batch 4, tokens 128, max_step_ms 150 |" in out.with_suffix(".md").read_text()


def test_what_if_sets_the_decode_step_and_the_prompt_token_cost() -> None:
    base = DEVICES["h200-30b-fp8"]
    dev = sim_serving.what_if(base, "1024:38", 10.0)
    assert dev.step_ms(1024, 0) == pytest.approx(38.0)
    assert dev.step_ms(0, 1000) == pytest.approx(base.overhead_ms + 10.0)
    assert sim_serving.what_if(base, None, None) == base


def test_steady_state_refills_start_within_a_few_steps() -> None:
    """The scheduler at 64 streams, five waves of 200-token prompts: a request arriving as another finishes
    gets its first token within a few steps (its prefill rides the next step), and streams keep their pace
    (refill steps add their prompt tokens' cost only). Guards the refill path the 1,024-stream TTFT bar
    rests on."""
    work = Workload(concurrency=64, num_prompts=320, input_len=200, output_len=100)
    device = DEVICES["h200-30b-fp8"]
    rec = summarize(
        Setting(64, 2048, 150.0), work, "h200-30b-fp8", simulate(Setting(64, 2048, 150.0), work, device)
    )
    step = device.step_ms(64, 0)  # a decode step of every stream
    assert rec["ttft_ms_p50"] < 4 * step  # 54 ms: ~2.5 steps
    assert rec["tpot_ms_p50"] < 1.25 * step  # 22.9 ms against 21.1


def test_one_token_outputs_have_no_gaps_to_rank() -> None:
    work = Workload(concurrency=2, num_prompts=3, input_len=16, output_len=1)
    setting = Setting(4, 64, None)
    rec = summarize(setting, work, "h100-30b-fp8", simulate(setting, work, DEVICES["h100-30b-fp8"]))
    assert rec["ttft_ms_p50"] > 0 and rec["tpot_ms_p50"] == rec["itl_ms_p99"] == 0.0
