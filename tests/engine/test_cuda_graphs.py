"""Decode steps through the static buffers of `DecodeGraphs` (padding rows, pad state slot, partial
block tables) must give exactly the tokens of eager decode. On the CPU the buffers are run eagerly
(the CUDA graph is a recording of that same call); tests/gpu/test_gpu_model.py replays real graphs."""

from __future__ import annotations

import pytest

from hyserve import LLM, SamplingParams
from hyserve.engine.assembly import assemble as assembly
from hyserve.engine.runner import cuda_graphs
from hyserve.engine.runner.cuda_graphs import default_capture_sizes, pack_decode_rows
from hyserve.engine.scheduler.scheduler import ScheduledSeq
from tests.engine.test_engine_invariance import make_llm, prompts

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(1) == [1]
    assert default_capture_sizes(6) == [1, 2, 4, 6]
    assert default_capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    big = default_capture_sizes(300)
    assert big[-3:] == [272, 288, 300] and 256 in big and 264 not in big


def _seq(tok: int, pos: int, blocks: list[int], slot: int) -> ScheduledSeq:
    return ScheduledSeq(
        request_id="r",
        token_ids=[tok],
        start_pos=pos,
        block_ids=blocks,
        state_src=slot,
        state_dst=slot,
        sample=True,
        snapshots=[],
        params=SamplingParams(),
        num_output_tokens=0,
    )


def test_pack_decode_rows_pads_with_harmless_rows() -> None:
    rows = pack_decode_rows([_seq(7, 9, [3, 5], 2), _seq(8, 0, [4], 0)], 4, tokens_per_block=8, pad_slot=11)
    ids, slots, src, dst, lens, feed = (rows[i * 4 : (i + 1) * 4] for i in range(6))
    assert ids == [7, 8, 0, 0]
    assert slots == [5 * 8 + 1, 4 * 8 + 0, -1, -1]  # position 9 -> block 5, row 1; padding is not written
    assert src == dst == [2, 0, 11, 11]
    assert lens == [10, 1, 1, 1]
    assert feed == [0, 0, 0, 0]  # ids known on the host: no device feed
    rows = pack_decode_rows(
        [_seq(7, 9, [3, 5], 2), _seq(8, 0, [4], 0)], 4, tokens_per_block=8, pad_slot=11, feed_rows=[3, 1]
    )
    assert rows[20:24] == [3, 1, 0, 0]


@pytest.fixture()
def graphs_on_cpu(monkeypatch: pytest.MonkeyPatch):
    """Make the engine build its decode-graph buffers on the CPU too (run eagerly, not captured)."""

    def use(sizes: list[int]) -> None:
        monkeypatch.setattr(assembly, "graph_batch_sizes", lambda config, lm, log, most: list(sizes))

    return use


def _run(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


def test_graph_decode_equals_eager_with_padding(graphs_on_cpu) -> None:
    eager = _run(make_llm(device="cpu"))
    graphs_on_cpu([1, 2, 4, 8])
    llm = make_llm(device="cpu")
    runner = llm.engine.runner
    assert runner.graphs is not None and llm.engine.plan.num_pad_slots == 1
    used: list[int] = []
    orig = runner.graphs.execute
    runner.graphs.execute = lambda seqs, feed=None, width=1: used.append(len(seqs)) or orig(seqs, feed, width)  # type: ignore[method-assign]
    assert _run(llm) == eager
    # the 8 requests decode together, then fewer as they finish: padded sizes (3 -> 4, 5 -> 8) ran
    assert used and any(b not in (1, 2, 4, 8) for b in used)
    assert llm.engine.cache_usage()["live_slots_used"] == 0


def test_without_padding_other_sizes_run_eagerly(graphs_on_cpu) -> None:
    eager = _run(make_llm(device="cpu"))
    graphs_on_cpu([2])
    llm = make_llm(device="cpu", cuda_graph_config={"enable_padding": False})
    g = llm.engine.runner.graphs
    assert g is not None and g.size_for(1) is None and g.size_for(3) is None and g.size_for(2) == 2
    assert _run(llm) == eager


@pytest.mark.parametrize("ragged_above", [1, 10**9], ids=["ragged", "padded"])
def test_graph_decode_with_long_block_tables(graphs_on_cpu, monkeypatch, ragged_above: int) -> None:
    """Sequences whose tables are wider than others' leave stale columns behind in the buffer; the tables
    go either ragged and are filled on the device, or zero-padded to the longest."""
    monkeypatch.setattr(cuda_graphs, "RAGGED_TABLES_ABOVE", ragged_above)
    graphs_on_cpu([4])
    long_p = [1] + [5 + i % 200 for i in range(150)]
    short_p = [1, 9, 9, 9]
    eager = [o.token_ids for o in make_llm(device="cpu").generate([long_p, short_p], GREEDY)]
    llm = make_llm(device="cpu")
    assert [o.token_ids for o in llm.generate([long_p, short_p], GREEDY)] == eager
    assert [o.token_ids for o in llm.generate([short_p], GREEDY)] == eager[1:]
