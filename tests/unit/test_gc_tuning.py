"""The collector settings serving runs under (`engine/gc_tuning.py`): `hyserve serve` freezes the start-up
heap and raises the first-generation threshold; `LLM.generate` raises it only while its steps run and
restores the caller's; a higher threshold a user set is never lowered."""

from __future__ import annotations

import gc

import pytest

from hyserve import LLM, SamplingParams
from hyserve.engine import gc_tuning


@pytest.fixture
def restore_gc():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_settle_for_serving_freezes_and_raises_the_first_threshold(restore_gc) -> None:
    gc.set_threshold(700, 10, 10)
    n = gc_tuning.settle_for_serving()
    assert n == gc.get_freeze_count() > 1000
    assert gc.get_threshold() == (gc_tuning.SERVING_GEN0_THRESHOLD, 10, 10)


def test_a_higher_threshold_is_kept(restore_gc) -> None:
    gc.set_threshold(10 * gc_tuning.SERVING_GEN0_THRESHOLD, 7, 3)
    with gc_tuning.serving_gc():
        assert gc.get_threshold() == (10 * gc_tuning.SERVING_GEN0_THRESHOLD, 7, 3)


def test_generate_runs_under_the_serving_thresholds_and_restores_the_callers(
    restore_gc, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM(device="cpu", max_batch_size=2)
    seen: list[tuple[int, int, int]] = []
    step = llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (seen.append(gc.get_threshold()), step())[1])
    gc.set_threshold(700, 9, 8)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 3
    assert seen and all(t == (gc_tuning.SERVING_GEN0_THRESHOLD, 9, 8) for t in seen)
    assert gc.get_threshold() == (700, 9, 8)


def test_generate_restores_the_thresholds_when_a_request_fails(restore_gc, monkeypatch) -> None:
    llm = LLM(device="cpu", max_batch_size=2)

    def boom() -> None:
        raise RuntimeError("step failed")

    monkeypatch.setattr(llm.engine, "step", boom)
    gc.set_threshold(700, 10, 10)
    with pytest.raises(RuntimeError, match="step failed"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3))
    assert gc.get_threshold() == (700, 10, 10)
