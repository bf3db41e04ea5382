"""Prefill and mixed steps through the piecewise graphs' static buffers (`MixedGraphs`, run eagerly on the
CPU: a captured piece is a recording of that same call) must give exactly the tokens of eager steps: padded
token counts, decode rows beside prefill chunks, chunked prefill, prefix-cache snapshots, speculative verify
rows, RoPE computed in each attention core, and two cores per layer sharing buffers (Falcon-H1).
tests/gpu/test_gpu_model.py replays real graphs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.engine.assembly import assemble as assembly
from hyserve.engine.runner.mixed_graphs import MixedGraphs, default_token_sizes
from hyserve.engine.runner.runner import ModelRunner
from tests.engine.test_engine_invariance import make_llm, prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SIZES = [16, 64, 128, 256]


def test_default_token_sizes() -> None:
    assert default_token_sizes(100) == [64, 100]
    sizes = default_token_sizes(8192)
    assert sizes[:4] == [64, 128, 256, 512] and sizes[-3:] == [6144, 7168, 8192]
    assert 2560 in sizes and 2304 not in sizes
    assert default_token_sizes(16384) == sizes  # larger steps run eagerly (bound by their device work)
    big = sizes
    # padding adds fewer than 256 rows up to 2,048 tokens, and at most a quarter above 1,024
    for n in range(129, 8193, 37):
        s = next(s for s in big if s >= n)
        assert (s - n < 256) if n <= 2048 else (s <= 1.25 * n), (n, s)


@pytest.fixture()
def piecewise_on_cpu(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[int]], list[tuple[int, int, int]]]:
    """Make the engine build decode graphs and piecewise graphs on the CPU too (run eagerly, not captured);
    returns the (tokens, padded size, decode width) of every step the piecewise graphs ran, filled as they
    run."""
    used: list[tuple[int, int, int]] = []
    execute = MixedGraphs.execute

    def counted(self: MixedGraphs, input_ids: torch.Tensor, meta):  # type: ignore[no-untyped-def]
        out = execute(self, input_ids, meta)
        if out is not None:
            n = input_ids.shape[0]
            used.append((n, self.size_for(n) or 0, meta.decode_width if meta.num_decodes else 0))
        return out

    monkeypatch.setattr(MixedGraphs, "execute", counted)

    def use(sizes: list[int]) -> list[tuple[int, int, int]]:
        monkeypatch.setattr(assembly, "graph_batch_sizes", lambda config, lm, log, most: [1, 2, 4, 8])
        monkeypatch.setattr(assembly, "piecewise_sizes", lambda config, graph_sizes, n: list(sizes))
        return used

    return use


def _tokens(llm: LLM, ps: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(ps, params)]


def test_mixed_steps_equal_eager_with_padding(piecewise_on_cpu) -> None:
    """8 prompts of 6..91 tokens, max_num_tokens 256: chunked prefill, then prompts finishing their prefill
    beside decoding ones; every step that prefills runs in a padded size."""
    eager = _tokens(make_llm(device="cpu"), prompts())
    used = piecewise_on_cpu(SIZES)
    llm = make_llm(device="cpu")
    assert isinstance(llm.engine.runner, ModelRunner) and llm.engine.runner.mixed_graphs is not None
    assert _tokens(llm, prompts()) == eager
    assert used and any(n < s for n, s, _ in used)  # padded
    # alone, each prompt after the others (its prefill step padded differently)
    assert [_tokens(llm, [p])[0] for p in prompts()[:3]] == eager[:3]
    assert llm.engine.cache_usage()["live_slots_used"] == 0


def test_prefix_hits_and_chunks_equal_eager(piecewise_on_cpu) -> None:
    """Snapshots written from the scan's chunk states, resumed from; prompts longer than a step."""
    kw = dict(
        device="cpu",
        max_num_tokens=64,
        kv_cache_config={
            "tokens_per_block": 8,
            "enable_block_reuse": True,
            "max_gpu_total_bytes": 64 * 2**20,
            "mamba_state_config": {"periodic_snapshot_interval": 16},
        },
    )
    shared = [1] + [7 + i % 50 for i in range(100)]
    ps = [shared + [3, 4, 5], shared + [9], [1, 2, 3]]

    def run(llm: LLM) -> list[list[int]]:
        return _tokens(llm, ps[:1]) + _tokens(llm, ps[1:])

    eager = run(make_llm(**kw))
    used = piecewise_on_cpu([16, 64])
    llm = make_llm(**kw)
    assert run(llm) == eager
    assert llm.stats()["prefix_cache_hits"] > 0 and used


def test_steps_above_the_largest_size_run_eagerly(piecewise_on_cpu) -> None:
    eager = _tokens(make_llm(device="cpu"), prompts())
    used = piecewise_on_cpu([16])
    llm = make_llm(device="cpu")
    g = llm.engine.runner.mixed_graphs
    assert g is not None and g.size_for(17) is None and g.size_for(3) == 16
    assert _tokens(llm, prompts()) == eager
    assert used and all(n <= 16 for n, _, _ in used)


def test_prompt_logprobs_read_their_own_copy(piecewise_on_cpu) -> None:
    """Prompt logprobs are read after the step: from a copy of the hidden states, not the graphs' buffer
    (which the next step overwrites)."""
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, ignore_eos=True)
    ps = prompts()[:3]
    want = make_llm(device="cpu").generate(ps, params)
    piecewise_on_cpu(SIZES)
    got = make_llm(device="cpu").generate(ps, params)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert a.prompt_logprobs is not None and b.prompt_logprobs is not None
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x is not None and y is not None
            assert abs(x.logprob - y.logprob) < 1e-5


def test_speculative_verify_rows_beside_prefills(piecewise_on_cpu) -> None:
    """n-gram drafts: verify rows (decode_width > 1) in steps that also prefill, through the same cores."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    rep = [[1] + [5, 6, 7, 8] * 12, [1] + [9, 10, 11] * 15, [1, 3, 4]]
    ps = rep + prompts()
    eager = _tokens(make_llm(device="cpu", speculative_config=spec, max_num_tokens=48), ps)
    used = piecewise_on_cpu(SIZES)
    llm = make_llm(device="cpu", speculative_config=spec, max_num_tokens=48)
    assert _tokens(llm, ps) == eager
    assert any(width > 1 for _, _, width in used)  # verify rows beside a prefill chunk


def test_family_with_two_cores_per_layer_and_rope(tmp_path: Path, piecewise_on_cpu) -> None:
    """Falcon-H1 runs Mamba2 and attention (RoPE) side by side on one input, here with outputs of one shape
    (8 heads of 16 each), so both cores write the same output buffer in turn. Through the piecewise buffers
    its greedy tokens and logprobs are transformers' (prefix caching and chunked prefill included)."""
    pytest.importorskip("transformers")
    from tests.families.hf_parity import check_parity
    from tests.families.test_falcon_h1 import _hf_model

    used = piecewise_on_cpu([8, 16, 32, 64, 128])
    hf = _hf_model("gated", num_attention_heads=8, head_dim=16)
    hf.save_pretrained(tmp_path)
    check_parity(str(tmp_path), hf)
    assert used and any(n < s for n, s, _ in used)
