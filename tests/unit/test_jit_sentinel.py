"""The JIT sentinel counts compilations after ready (exercised with fake Triton events on the CPU)."""

from __future__ import annotations

from types import SimpleNamespace

from hyserve.engine.runner.jit_sentinel import JitSentinel


def fake_event(s: JitSentinel, name: str, cache_hit: bool = False) -> None:
    src = SimpleNamespace(
        fn=SimpleNamespace(__name__=name), constants={"BLOCK": 64}, signature={"x": "*fp32"}
    )
    s.on_compile(src=src, metadata={"name": name}, metadata_group={}, times=None, cache_hit=cache_hit)


def test_counts_only_after_ready(caplog) -> None:
    s = JitSentinel()
    fake_event(s, "_warm_kernel")
    assert s.compiles_after_ready == 0 and len(s.events) == 1
    s.mark_ready()
    with caplog.at_level("WARNING", logger="hyserve"):
        fake_event(s, "_ssd_kernel")
        fake_event(s, "_ssd_kernel", cache_hit=True)
    assert s.compiles_after_ready == 2
    assert "_ssd_kernel" in caplog.text and "BLOCK" in caplog.text


def test_chains_a_previous_listener() -> None:
    seen = []
    s = JitSentinel()
    s._previous = lambda **kw: seen.append(kw["cache_hit"])
    fake_event(s, "k", cache_hit=True)
    assert seen == [True]


def test_a_new_sentinel_takes_over_from_an_old_one() -> None:
    triton = __import__("pytest").importorskip("triton")
    knobs = triton.knobs.compilation
    saved = knobs.listener
    seen = []
    try:
        knobs.listener = lambda **kw: seen.append(kw["cache_hit"])  # a foreign listener stays chained
        old, new = JitSentinel(), JitSentinel()
        assert old.install() and new.install()
        old.mark_ready()
        knobs.listener(src=None, metadata={"name": "k"}, metadata_group={}, times=None, cache_hit=False)
        assert len(new.events) == 1 and not old.events and old.compiles_after_ready == 0
        assert seen == [False]
    finally:
        knobs.listener = saved
