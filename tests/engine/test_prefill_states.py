"""A Mamba2 layer's prefill hands its kernels initial states: gathered from the state pools when a sequence
resumes from one, zeros when every sequence of the step starts fresh (no gathers)."""

from __future__ import annotations

import pytest

from hyserve import SamplingParams
from hyserve.engine.runner.runner import ModelRunner
from tests.engine.test_engine_invariance import make_llm, prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def _tokens(llm, ps):  # type: ignore[no-untyped-def]
    return [list(o.token_ids) for o in llm.generate(ps, GREEDY)]


def test_fresh_prefills_skip_the_state_gathers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step whose prefill sequences all start fresh (`prefill_initial_states` False) hands the Mamba kernels
    zero initial states instead of gathering them from the pools: the same tokens as the gathering path, and
    initial-state tensors of the same layout (so the same kernel variants serve both)."""
    from hyserve.kernels import ops
    from hyserve.model import mamba2

    layouts: list[tuple[bool, tuple, tuple]] = []

    class Recorded:
        def __init__(self, op, index: int, key: str) -> None:
            self.op, self.index, self.key = op, index, key

        def get(self, cuda: bool):  # type: ignore[no-untyped-def]
            fn = self.op.get(cuda)

            def run(*args, **kw):  # type: ignore[no-untyped-def]
                t = kw.get(self.key, args[self.index] if len(args) > self.index else None)
                if t is not None:
                    layouts.append((forced, tuple(t.stride()), (t.dtype, tuple(t.shape[1:]))))
                return fn(*args, **kw)

            return run

    monkeypatch.setattr(mamba2.ops, "conv1d_varlen", Recorded(ops.conv1d_varlen, 4, "initial_states"))
    monkeypatch.setattr(mamba2.ops, "ssd", Recorded(ops.ssd, 99, "initial_states"))
    forced = False
    fresh = _tokens(make_llm(device="cpu"), prompts())
    build = ModelRunner.build_meta

    def gathering(self, batch):  # type: ignore[no-untyped-def]
        ids, meta = build(self, batch)
        meta.prefill_initial_states = True
        return ids, meta

    monkeypatch.setattr(ModelRunner, "build_meta", gathering)
    forced = True
    assert _tokens(make_llm(device="cpu"), prompts()) == fresh
    by_path = {f: {(s, k) for g, s, k in layouts if g == f} for f in (False, True)}
    assert by_path[False] and by_path[False] <= by_path[True]
