"""Speculative decoding is exact: with drafts verified in the step, every request gets the tokens (and
logprobs) plain decoding gives it, whatever else the engine does. Random weights accept almost no n-gram
draft, so most tests draft with an oracle that knows plain decoding's answer and corrupts some of it:
that drives every acceptance length (none, some, all) through the Mamba state bookkeeping."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest

from hyserve import LLM, SamplingParams
from hyserve.engine.request import Request
from tests.engine.test_engine_invariance import PREFIX_CACHE_KV, make_llm, prompts

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


class OracleDrafter:
    """Drafts plain decoding's own continuation of each prompt, with a wrong token at some positions
    (seeded by the request's prompt and output count, so every run drafts the same)."""

    def __init__(
        self, answers: dict[tuple[int, ...], list[int]], wrong: float = 0.3, *, ragged: bool = False
    ) -> None:
        self.answers = answers
        self.wrong = wrong
        self.ragged = ragged  # drafts of random lengths up to k (a step pads the shorter ones)
        self.proposed = 0

    def propose(self, req: Request, k: int) -> list[int]:
        want = self.answers.get(tuple(req.prompt_token_ids), [])
        n = len(req.output_token_ids)
        draft = list(want[n : n + k])
        rng = random.Random(hash((tuple(req.prompt_token_ids[-8:]), n)))
        for i in range(len(draft)):
            if rng.random() < self.wrong:
                draft[i] = 3 + (draft[i] + 1) % 300  # a token other than the answer's
        if self.ragged:
            draft = draft[: rng.randint(0, k)]
        self.proposed += len(draft)
        return draft

    def remove(self, request_id: str) -> None:
        pass


def spec_llm(
    answers: dict, *, wrong: float = 0.3, k: int = 3, ragged: bool = False, **kw
) -> tuple[LLM, OracleDrafter]:
    spec = {"method": "ngram", "num_speculative_tokens": k, **kw.pop("spec", {})}
    llm = make_llm(speculative_config=spec, **kw)
    oracle = OracleDrafter(answers, wrong, ragged=ragged)
    assert llm.engine.spec is not None
    llm.engine.spec.drafter = oracle
    return llm, oracle


def answers_of(outs, ps) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): o.token_ids for p, o in zip(ps, outs)}


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return [o.token_ids for o in make_llm().generate(prompts(), GREEDY)]


def accepted_share(llm: LLM) -> float:
    s = llm.stats()
    return s["spec_decode_num_accepted_tokens"] / max(1, s["spec_decode_num_draft_tokens"])


@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_greedy_tokens_are_plain_decodings(plain: list[list[int]], wrong: float) -> None:
    ps = prompts()
    llm, oracle = spec_llm(answers_of_lists(plain, ps), wrong=wrong)
    outs = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == plain
    assert oracle.proposed > 0
    share = accepted_share(llm)
    if wrong == 0.0:
        assert share == 1.0
    elif wrong == 1.0:
        assert share == 0.0
    else:
        assert 0.2 < share < 0.9
    u = llm.cache_usage()
    assert u["kv_blocks_free"] == u["kv_blocks_total"] and u["live_slots_used"] == 0


def answers_of_lists(tokens: list[list[int]], ps: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p): t for p, t in zip(ps, tokens)}


@pytest.mark.parametrize(
    "opts",
    [
        pytest.param({"max_num_tokens": 13}, id="small-chunks"),
        pytest.param({"async_scheduling": False}, id="sync"),
        pytest.param({"k": 1}, id="k1"),
        pytest.param({"k": 7}, id="k7"),
        pytest.param({"ragged": True}, id="ragged-drafts"),
        pytest.param({"scheduling_policy": "priority"}, id="priority"),
    ],
)
def test_with_engine_settings(plain: list[list[int]], opts: dict) -> None:
    ps = prompts()
    opts = dict(opts)
    llm, _ = spec_llm(
        answers_of_lists(plain, ps), k=opts.pop("k", 3), ragged=opts.pop("ragged", False), **opts
    )
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_speculation_switches_on_as_the_batch_shrinks(plain: list[list[int]]) -> None:
    """Above disable_by_batch_size running requests the engine decodes plainly (async steps in flight);
    as requests finish it starts drafting, and back."""
    ps = prompts()
    llm, _ = spec_llm(answers_of_lists(plain, ps), spec={"disable_by_batch_size": 3})
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(ps))]
    outs = llm.generate(ps, params)
    assert [o.token_ids for o in outs] == [t[: p.max_tokens] for t, p in zip(plain, params)]
    s = llm.stats()
    assert s["spec_decode_num_accepted_tokens"] > 0 and s["overlapped_steps_total"] > 0


class MissingDrafter:
    """Finds no draft for the first `misses` calls, then drafts like `then`."""

    def __init__(self, misses: int, then: OracleDrafter) -> None:
        self.misses, self.then, self.calls = misses, then, 0

    def propose(self, req: Request, k: int) -> list[int]:
        self.calls += 1
        return [] if self.calls <= self.misses else self.then.propose(req, k)

    def remove(self, request_id: str) -> None:
        pass


def test_a_request_without_drafts_rests_and_keeps_async_steps() -> None:
    """Four drafting steps in a row without a draft and a request rests 8 steps, then each fruitless probe
    doubles its rest (16, 32): those steps draft nothing, so they run with a step in flight (async). Once a
    probe finds a draft, it drafts every step again."""
    from hyserve.engine.speculative.speculation import FIRST_REST, MISSES_TO_REST

    ps = prompts()[:1]
    p = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    want = make_llm().generate(ps, p)[0].token_ids
    llm, oracle = spec_llm(answers_of_lists([want], ps), wrong=0.0)
    missing = MissingDrafter(MISSES_TO_REST + 2, oracle)  # 4 misses, rest 8, miss, rest 16, miss, rest 32
    llm.engine.spec.drafter = missing  # type: ignore[union-attr]
    out = llm.generate(ps, p)[0]
    assert out.token_ids == want
    s = llm.stats()
    assert s["overlapped_steps_total"] >= FIRST_REST + 2 * FIRST_REST + 4 * FIRST_REST - 3
    assert missing.calls > MISSES_TO_REST + 2 and s["spec_decode_num_accepted_tokens"] > 0


def test_prefix_cache_hits(plain: list[list[int]]) -> None:
    ps = prompts()
    llm, _ = spec_llm(answers_of_lists(plain, ps), kv_cache_config=PREFIX_CACHE_KV)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    second = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in second] == plain
    assert sum(o.num_cached_tokens for o in second) > 0


def test_preemption(plain: list[list[int]]) -> None:
    kv = {
        "tokens_per_block": 8,
        "enable_block_reuse": False,
        "max_tokens": 120,
        "max_gpu_total_bytes": 64 * 2**20,
        "mamba_state_config": {"periodic_snapshot_interval": None},
    }
    ps = prompts()
    llm, _ = spec_llm(answers_of_lists(plain, ps), kv_cache_config=kv, max_seq_len=120)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    assert llm.stats()["num_preemptions"] > 0


def test_fp8_kv_cache() -> None:
    kv = {
        "tokens_per_block": 8,
        "enable_block_reuse": False,
        "max_gpu_total_bytes": 64 * 2**20,
        "dtype": "fp8",
    }
    ps = prompts()
    want = [o.token_ids for o in make_llm(kv_cache_config=kv).generate(ps, GREEDY)]
    llm, _ = spec_llm(answers_of_lists(want, ps), kv_cache_config=kv)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_float16_state_with_stochastic_rounding() -> None:
    kv = {
        "tokens_per_block": 8,
        "enable_block_reuse": False,
        "max_gpu_total_bytes": 64 * 2**20,
        "mamba_ssm_cache_dtype": "float16",
        "mamba_ssm_stochastic_rounding": True,
    }
    ps = prompts()
    want = [o.token_ids for o in make_llm(kv_cache_config=kv).generate(ps, GREEDY)]
    llm, _ = spec_llm(answers_of_lists(want, ps), kv_cache_config=kv)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=11), id="seeded"),
        pytest.param(
            SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5),
            id="penalties",
        ),
        pytest.param(SamplingParams(max_tokens=20, temperature=0.0, logprobs=3), id="logprobs"),
        pytest.param(SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), id="max-tokens"),
    ],
)
def test_sampling_settings(params: SamplingParams) -> None:
    """Seeded sampling draws each output index's noise from its own key, so its tokens are plain decoding's;
    penalties see the draft tokens before each verified position; logprobs are the target's."""
    ps = prompts()
    want = make_llm().generate(ps, params)
    llm, _ = spec_llm(answers_of(want, ps))
    got = llm.generate(ps, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    if params.logprobs:
        for a, b in zip(got, want):
            assert [e.token_id for e in a.logprobs] == [e.token_id for e in b.logprobs]
            assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-5)
            assert [list(e.top) for e in a.logprobs] == [list(e.top) for e in b.logprobs]
    if params.max_tokens > 5:
        assert llm.stats()["spec_decode_num_accepted_tokens"] > 0


def test_stop_strings_trim_an_accepted_run() -> None:
    """A stop string met inside an accepted run ends the request there: the tokens after it are dropped."""
    ps = prompts()
    free = make_llm().generate(ps, GREEDY)
    stops = [o.text[6:9] for o in free if len(o.text) > 12]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stops)
    want = make_llm().generate(ps, params)
    llm, _ = spec_llm(answers_of(free, ps), wrong=0.0, k=7)
    got = llm.generate(ps, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in want
    ]
    assert any(o.finish_reason == "stop" for o in got)


def test_ngram_drafting_on_the_builtin_model(plain: list[list[int]]) -> None:
    llm = make_llm(speculative_config=NGRAM)
    assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == plain
    s = llm.stats()
    assert s["spec_decode_num_drafts"] > 0 and s["spec_decode_num_draft_tokens"] > 0


def test_repeating_text_is_drafted_and_accepted() -> None:
    """A prompt that repeats one phrase: a random model's greedy continuation of such a loop tends to loop,
    and n-gram drafting then accepts runs of it."""
    phrase = [11, 42, 97, 5, 230, 18]
    ps = [[1] + phrase * 12]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    want = make_llm().generate(ps, params)
    llm = make_llm(speculative_config=NGRAM)
    assert llm.generate(ps, params)[0].token_ids == want[0].token_ids


def test_counters_and_per_position_acceptance(plain: list[list[int]]) -> None:
    ps = prompts()
    llm, _ = spec_llm(answers_of_lists(plain, ps), wrong=0.0)
    llm.generate(ps, GREEDY)
    spec = llm.engine.spec
    assert spec is not None
    s = llm.stats()
    assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"] > 0
    assert spec.accepted_per_position[0] == s["spec_decode_num_drafts"]
    assert sum(spec.accepted_per_position) == s["spec_decode_num_accepted_tokens"]
    # every verified step emits its accepted tokens and one more: fewer steps than tokens
    assert s["steps_total"] < s["generation_tokens_total"]


class GreedyAfterFirst:
    """Drafts, once a request has its first token x, the greedy continuation of prompt + [x]."""

    def __init__(self, greedy: dict[int, list[int]]) -> None:
        self.greedy = greedy

    def propose(self, req: Request, k: int) -> list[int]:
        out = req.output_token_ids
        return self.greedy.get(out[0], [])[:k] if len(out) == 1 else []

    def remove(self, request_id: str) -> None:
        pass


@pytest.mark.slow
def test_sampled_tokens_keep_the_target_distribution() -> None:
    """Temperature sampling with drafts: 20,000 requests of 3 tokens, top-k 2, so each position has two
    outcomes and the laws below at most 16, few enough for 20,000 samples to pin them within 0.02. The first
    token comes from the prompt's prefill; the second and third are verified in one step against the greedy
    continuation as a draft. The empirical laws of the second token, the third, and the pair are within
    0.02 total variation of the model's own (from its logprobs, mixed over what came before)."""
    n, k = 20_000, 2
    prompt = [1, 17, 92, 5, 240, 33, 8, 71]
    ref = LLM(seed=0, warmup="off")
    lp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, ignore_eos=True)

    def law(p: list[int]) -> dict[int, float]:
        top = ref.generate([p], lp)[0].logprobs[0].top  # raw logprobs of the k likeliest tokens
        z = sum(math.exp(v) for v in top.values())
        return {t: math.exp(v) / z for t, v in top.items()}

    def mode(d: dict[int, float]) -> int:
        return max(d, key=d.__getitem__)

    first = law(prompt)
    second = {x: law(prompt + [x]) for x in first}
    pair: dict[tuple[int, int], float] = {}  # law of (second, third), mixed over the first
    for x, px in first.items():
        for y, py in second[x].items():
            for z, pz in law(prompt + [x, y]).items():
                pair[(y, z)] = pair.get((y, z), 0.0) + px * py * pz
    greedy = {x: [mode(second[x]), mode(law(prompt + [x, mode(second[x])]))] for x in first}

    spec = {**NGRAM, "disable_by_batch_size": 256}  # every step drafts
    llm = LLM(seed=1, warmup="off", max_batch_size=256, max_num_tokens=4096, speculative_config=spec)
    assert llm.engine.spec is not None
    llm.engine.spec.drafter = GreedyAfterFirst(greedy)
    outs = llm.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, top_k=k, ignore_eos=True))
    got = Counter(tuple(o.token_ids[1:]) for o in outs)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0.3 * n

    def tv(emp: Counter, exact: dict) -> float:
        return 0.5 * sum(abs(emp[t] / n - exact.get(t, 0.0)) for t in set(emp) | set(exact))

    def marginal(d, i):
        out = Counter() if isinstance(d, Counter) else {}
        for key, v in d.items():
            out[key[i]] = out.get(key[i], 0) + v
        return out

    tvs = [tv(marginal(got, i), marginal(pair, i)) for i in (0, 1)] + [tv(got, pair)]
    assert max(tvs) <= 0.02, tvs


def test_verify_steps_replay_the_decode_graphs(plain: list[list[int]]) -> None:
    """Verify steps run from the decode graphs' static buffers (captured on CUDA, run eagerly here) for each
    width up to k + 1, padded drafts included, with the tokens of plain decoding."""
    ps = prompts()
    llm, _ = spec_llm(answers_of_lists(plain, ps), wrong=0.4, k=3, ragged=True)
    runner = llm.engine.runner
    g = runner.capture_graphs(
        list(range(1, 9)), max_blocks_per_seq=16, pad_slot=0, enable_padding=False, spec_widths=range(2, 5),
        spec_max_batch=16,
    )  # fmt: skip
    assert {q for _, q in g.keys} == {1, 2, 3, 4}
    widths: list[int] = []
    execute = g.execute

    def counted(seqs, feed=None, width=1):
        out = execute(seqs, feed, width)
        if out is not None:
            widths.append(width)
        return out

    g.execute = counted  # type: ignore[method-assign]
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == plain
    assert {2, 3, 4} <= set(widths) and 1 in widths


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_structured_outputs_with_drafts(async_scheduling: bool) -> None:
    """Grammar-constrained requests draft too: each verified position is masked as the grammar stands after
    the draft tokens before it (taken in and rolled back), so greedy and seeded outputs are plain decoding's,
    and valid; a draft token the grammar refuses ends the accepted run."""
    pytest.importorskip("xgrammar")
    import json

    from hyserve.engine.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    specs = [StructuredOutputsParams(json=schema), StructuredOutputsParams(regex=r"[a-c]{2,6}-[0-9]{1,3}")]
    params = [
        SamplingParams(max_tokens=60, temperature=t, seed=7, structured_outputs=so)
        for so in specs
        for t in (0.0, 0.9)
    ]
    prompts = ["Hello", "Tell me", [5, 6, 7], "Name:"]
    opts = dict(device="cpu", max_seq_len=512, max_batch_size=8, async_scheduling=async_scheduling)
    want = LLM(**opts).generate(prompts, params)
    llm = LLM(**opts, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert llm.engine.spec is not None
    oracle = OracleDrafter({tuple(o.prompt_token_ids): o.token_ids for o in want}, wrong=0.3)
    llm.engine.spec.drafter = oracle
    got = llm.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.finish_reason for o in got] == ["stop"] * 4
    json.loads(got[0].text), json.loads(got[1].text)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0
