"""The warm-up drives the engine through every kind of step before ready and leaves no trace; with
strict_warmup a Triton compilation after ready fails the step that caused it (the engine keeps serving).
On the CPU nothing compiles, so these tests check the driving, the bookkeeping and the strict mode
(with fake compilation events); the H200 run checks that no variant is left over."""

from __future__ import annotations

import pytest

from hyserve import LLM, SamplingParams
from hyserve.engine.lifecycle.warmup import SAMPLING_CASES, Warmup
from hyserve.engine.runner.jit_sentinel import use_kernel_cache_dir
from tests.unit.test_jit_sentinel import fake_event

KV = {
    "tokens_per_block": 8,
    "max_gpu_total_bytes": 64 * 2**20,
    "mamba_state_config": {"periodic_snapshot_interval": 16, "additional_snapshot_offsets_from_end": [0]},
}
OPTS = dict(device="cpu", max_batch_size=32, max_num_tokens=96, kv_cache_config=KV)
PROMPTS = [[1, 5, 9, 13, 200, 17, 4], [1, 77] * 20]


def _outputs(llm: LLM) -> list[list[int]]:
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)  # the engine's generator
    return [o.token_ids for o in llm.generate(PROMPTS, greedy) + llm.generate(PROMPTS, seeded)]


@pytest.fixture(scope="module")
def warm() -> LLM:
    return LLM(warmup="on", **OPTS)


def test_cases_cover_the_step_kinds(warm: LLM) -> None:
    names = [n for n, _ in Warmup(warm.engine).cases()]
    C = warm.engine.model_config.chunk_size
    assert "prefill 1 x 1 tokens" in names and f"prefill 1 x {C + 3} tokens" in names
    assert any(n.startswith("chunked prefill") for n in names)
    assert "prefix-cache hit" in names and "eager decode" in names
    assert [n for n in names if n.startswith("mixed step")] == [
        f"mixed step: {d} decodes + 1 prefill" for d in range(1, 17)
    ]
    assert sum(n.startswith("sampling:") for n in names) == len(SAMPLING_CASES) + 1


def test_warmup_runs_every_case_and_leaves_no_trace(warm: LLM) -> None:
    rep = warm.engine.warmup_report
    assert rep is not None and not rep.failed and len(rep.cases) == len(Warmup(warm.engine).cases())
    e = warm.engine
    assert e.jit.ready and not e.requests and not e.has_unfinished()
    s = e.stats()
    assert s["prompt_tokens_total"] == s["generation_tokens_total"] == s["requests_finished_total"] == 0
    assert s["prefix_cache_queries"] == 0 and s["num_preemptions"] == 0
    assert e.cache_usage()["live_slots_used"] == 0 and e.cache_usage()["snapshot_slots_used"] == 0
    assert _outputs(warm) == _outputs(LLM(warmup="off", **OPTS))


@pytest.mark.slow
@pytest.mark.parametrize(
    "opts",
    [
        dict(enable_chunked_prefill=False, max_num_tokens=12, max_batch_size=4),  # prompts must fit one step
        dict(max_batch_size=1, max_num_tokens=24),
        dict(kv_cache_config={"enable_block_reuse": False, "max_gpu_total_bytes": 64 * 2**20}),
    ],
)
def test_warmup_adapts_to_tight_configs(opts: dict) -> None:
    llm = LLM(device="cpu", warmup="on", **opts)
    rep = llm.engine.warmup_report
    assert rep is not None and not rep.failed, rep.summary()
    assert not llm.engine.requests and llm.engine.cache_usage()["live_slots_used"] == 0


def test_cpu_default_is_no_warmup() -> None:
    assert LLM(**OPTS).engine.warmup_report is None


def test_a_failing_case_is_reported_and_the_rest_run(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: Warmup) -> None:
        self._run([5, 5])
        raise MemoryError("pretend this shape does not fit")

    monkeypatch.setattr(Warmup, "_eager_decode", boom)
    llm = LLM(warmup="on", **OPTS)
    rep = llm.engine.warmup_report
    assert rep is not None and [c for c, _ in rep.failed] == ["eager decode"]
    assert "does not fit" in rep.failed[0][1] and "failed: eager decode" in rep.summary()
    assert len(rep.cases) == len(Warmup(llm.engine).cases()) - 1
    assert not llm.engine.requests and llm.engine.cache_usage()["live_slots_used"] == 0
    assert _outputs(llm)  # still serves


def test_strict_warmup_fails_the_step_that_compiled_and_keeps_serving() -> None:
    llm = LLM(warmup="off", strict_warmup=True, **OPTS)
    e = llm.engine
    assert e.jit.ready
    p = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    e.add_request("a", [1, 2, 3], p)
    fake_event(e.jit, "_ssd_chunk_scan_kernel")  # as if the next step compiled a new variant
    out = [d for d in e.step() if d.finished]
    assert [d.request_id for d in out] == ["a"] and "strict_warmup" in (out[0].error or "")
    assert "_ssd_chunk_scan_kernel" in (out[0].error or "")
    assert llm.generate([[1, 2, 3]], p)[0].token_ids  # the next request is served
    assert e.stats()["jit_compiles_after_ready"] == 1


def test_without_strict_a_late_compile_is_only_counted() -> None:
    llm = LLM(warmup="off", **OPTS)
    fake_event(llm.engine.jit, "_late_kernel")
    p = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    assert len(llm.generate([[1, 2, 3]], p)[0].token_ids) == 3
    assert llm.engine.stats()["jit_compiles_after_ready"] == 1


def test_kernel_cache_dir(tmp_path) -> None:
    triton = pytest.importorskip("triton")
    before = (triton.knobs.cache.dir, triton.knobs.autotuning.cache)
    try:
        d = use_kernel_cache_dir(tmp_path / "hs")
        assert d == tmp_path / "hs" / "triton" and d.is_dir()
        assert triton.knobs.cache.dir == str(d) and triton.knobs.autotuning.cache is True
    finally:
        triton.knobs.cache.dir, triton.knobs.autotuning.cache = before


@pytest.mark.parametrize(
    "opts, match", [({"warmup": "sometimes"}, "warmup"), ({"strict_warmup": "yes please"}, "strict_warmup")]
)
def test_bad_warmup_options(opts: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(**opts)


def test_mixed_steps_are_warmed_eagerly_too_where_steps_outgrow_the_piecewise_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With piecewise graphs up to 64 tokens and a budget of 96, steps of 65..96 tokens run eagerly: the
    warm-up also runs its mixed steps eagerly (the cores' inputs are then views, not the graphs' buffers);
    with the graphs covering the budget it does not."""
    from hyserve.engine.assembly import assemble as assembly

    monkeypatch.setattr(assembly, "graph_batch_sizes", lambda config, lm, log, most: [1, 2, 4, 8])
    sizes = [16, 64]
    monkeypatch.setattr(assembly, "piecewise_sizes", lambda config, graph_sizes, n: list(sizes))
    llm = LLM(warmup="on", **OPTS)
    rep = llm.engine.warmup_report
    assert rep is not None and not rep.failed
    eager = [n for n in rep.cases if n.startswith("eager mixed step")]
    assert eager == [f"eager mixed step: {d} decodes + 1 prefill" for d in range(1, 17)]
    assert _outputs(llm) == _outputs(LLM(warmup="off", **OPTS))
    sizes = [16, 96]
    names = [n for n, _ in Warmup(LLM(warmup="off", **OPTS).engine).cases()]
    assert not [n for n in names if n.startswith("eager mixed step")]
