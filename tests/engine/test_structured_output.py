"""Structured outputs at the engine level (hyserve/engine/sampling/structured_output.py): the bitmask against
xgrammar's own kernel on fresh random logits, the sampler under a mask (greedy and sampled rows, penalties
first), grammar states driven token by token to outputs that parse and validate, the thinking section
left unconstrained, n independent states, the compile cache, and errors that name the problem."""

from __future__ import annotations

import json

import pytest
import torch

from hyserve.engine.sampling.sampler import Sampler
from hyserve.engine.sampling.structured_output import (
    GrammarCompiler,
    GrammarError,
    StructuredOutputs,
    apply_token_bitmask,
    bitmask_width,
    compiler_for,
)
from hyserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from hyserve.model.tokenizer import Tokenizer, build_tiny_tokenizer

xgr = pytest.importorskip("xgrammar")
torch.set_num_threads(1)

V = 320  # the tiny tokenizer's vocabulary
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(
        build_tiny_tokenizer(), config={"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    )


@pytest.fixture(scope="module")
def compiler(tok: Tokenizer) -> GrammarCompiler:
    return compiler_for(tok, V)


def test_bitmask_matches_xgrammar_kernel_on_random_logits() -> None:
    g = torch.Generator().manual_seed(0)
    for n, vocab in ((1, 320), (5, 1000), (3, 32 * 7)):
        logits = torch.randn(n, vocab, generator=g)
        bits = torch.randint(-(2**31), 2**31 - 1, (n, bitmask_width(vocab)), generator=g, dtype=torch.int64)
        mask = bits.to(torch.int32)
        mask[0] = -1  # one row allows everything
        ref = logits.clone()
        xgr.apply_token_bitmask_inplace(ref, mask, vocab_size=vocab)
        got = apply_token_bitmask(logits, mask)
        assert torch.equal(got, ref)
        assert torch.equal(got[0], logits[0])
        # float64 oracle of the bit rule
        allowed = torch.tensor(
            [[(int(mask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)] for r in range(n)]
        )
        want = torch.where(allowed.bool(), logits.double(), float("-inf"))
        assert torch.equal(got.double(), want)


def _draw(
    sampler: Sampler,
    states: StructuredOutputs,
    rids: list[str],
    params: list[SamplingParams],
    logits: torch.Tensor,
    outs: list[list[int]],
) -> list[int]:
    mask = states.fill_bitmask(rids)
    histories = [([], o) for o in outs]  # penalties: the output so far
    tokens = sampler.sample_tokens(logits, params, [len(o) for o in outs], histories, bitmask=mask).tolist()
    for r, t, o in zip(rids, tokens, outs):
        states.accept(r, t)
        o.append(t)
    return tokens


def _run(tok: Tokenizer, params: list[SamplingParams], steps: int = 80, seed: int = 0) -> list[str]:
    """Drive one constrained row per params on random logits until each emits EOS; their texts."""
    states = StructuredOutputs(tok, V)
    rids = [f"r{i}" for i in range(len(params))]
    for r, p in zip(rids, params):
        states.add(r, p)
    sampler = Sampler(seed)
    g = torch.Generator().manual_seed(seed)
    outs: list[list[int]] = [[] for _ in params]
    live = list(range(len(params)))
    for _ in range(steps):
        if not live:
            break
        logits = torch.randn(len(live), V, generator=g) * 3
        logits[:, EOS] -= 2.0  # random weights: do not let EOS dominate where it is allowed
        toks = _draw(
            sampler,
            states,
            [rids[i] for i in live],
            [params[i] for i in live],
            logits,
            [outs[i] for i in live],
        )
        live = [i for i, t in zip(live, toks) if t != EOS]
    assert not live, "a constrained row never finished"
    return [tok.decode([t for t in o if t != EOS]) for o in outs]


def test_json_schema_outputs_validate(tok: Tokenizer) -> None:
    import jsonschema_rs

    so = StructuredOutputsParams(json=SCHEMA)
    params = [
        SamplingParams(max_tokens=200, temperature=1.0, structured_outputs=so),
        SamplingParams(max_tokens=200, temperature=0.0, structured_outputs=so),
        SamplingParams(
            max_tokens=200, temperature=0.7, top_k=5, top_p=0.9, repetition_penalty=1.3, structured_outputs=so
        ),
    ]
    validator = jsonschema_rs.validator_for(SCHEMA)
    for seed in range(6):
        for text in _run(tok, params, seed=seed):
            assert "\ufffd" not in text  # only whole UTF-8 characters, no surrogates
            validator.validate(json.loads(text))


@pytest.mark.parametrize(
    ("so", "check"),
    [
        (StructuredOutputsParams(json_object=True), lambda s: isinstance(json.loads(s), dict)),
        (
            StructuredOutputsParams(regex=r"[a-c]{2,4}-[0-9]"),
            lambda s: __import__("re").fullmatch(r"[a-c]{2,4}-[0-9]", s),
        ),
        (StructuredOutputsParams(choice=("yes", "no", "maybe so")), lambda s: s in ("yes", "no", "maybe so")),
        (
            StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'),
            lambda s: __import__("re").fullmatch(r"\([0-9]+(\+[0-9]+)*\)", s),
        ),
    ],
)
def test_other_constraints(tok: Tokenizer, so: StructuredOutputsParams, check) -> None:  # noqa: ANN001
    for text in _run(tok, [SamplingParams(max_tokens=100, structured_outputs=so)] * 3, steps=300):
        assert check(text), text


def test_thinking_section_is_unconstrained(tok: Tokenizer) -> None:
    """With start_after="</think>", tokens before the marker are free (the mask is None) and the grammar
    starts right after it."""
    so = StructuredOutputsParams(choice=("yes", "no"), start_after="</think>")
    states = StructuredOutputs(tok, V)
    states.add("r", SamplingParams(structured_outputs=so))
    for t in tok.encode("I think <b> so"):
        assert states.fill_bitmask(["r"]) is None
        states.accept("r", t)
    end = tok.encode("</think>")
    for t in end:
        assert states.fill_bitmask(["r"]) is None
        states.accept("r", t)
    mask = states.fill_bitmask(["r"])
    assert mask is not None
    allowed = [t for t in range(V) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
    assert allowed and all(
        tok.decode([t]) and "yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t]))
        for t in allowed
    )
    # text right behind the marker goes to the grammar
    states.add("s", SamplingParams(structured_outputs=so))
    for t in tok.encode("ok</think>y"):
        states.accept("s", t)
    mask = states.fill_bitmask(["s"])
    allowed = {tok.decode([t]) for t in range(V) if (int(mask[0, t // 32]) >> (t % 32)) & 1}
    assert "e" in allowed and "n" not in allowed


def test_unconstrained_rows_are_untouched(tok: Tokenizer) -> None:
    states = StructuredOutputs(tok, V)
    states.add("c", SamplingParams(structured_outputs=StructuredOutputsParams(choice=("yes",))))
    assert states.fill_bitmask(["u", "v"]) is None and not states.constrains(["u", "v"])
    mask = states.fill_bitmask(["u", "c", "v"])
    assert mask is not None and states.constrains(["u", "c"])
    assert bool((mask[0] == -1).all()) and bool((mask[2] == -1).all()) and not bool((mask[1] == -1).all())
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    greedy = [SamplingParams(temperature=0.0)] * 3
    toks = Sampler(0).sample_tokens(logits, greedy, [0, 0, 0], bitmask=mask).tolist()
    assert toks[0] == int(logits[0].argmax()) and toks[2] == int(logits[2].argmax())
    assert tok.decode([toks[1]]) == "y"


def test_n_choices_have_independent_states(tok: Tokenizer) -> None:
    so = StructuredOutputsParams(choice=("aa", "bb"))
    states = StructuredOutputs(tok, V)
    states.add("k0", SamplingParams(structured_outputs=so))
    states.add("k1", SamplingParams(structured_outputs=so))
    states.accept("k0", tok.encode("a")[0])
    states.accept("k1", tok.encode("b")[0])
    mask = states.fill_bitmask(["k0", "k1"])
    allowed = [{tok.decode([t]) for t in range(V) if (int(mask[r, t // 32]) >> (t % 32)) & 1} for r in (0, 1)]
    assert allowed[0] == {"a"} and allowed[1] == {"b"}
    states.remove("k0")
    assert "k0" not in states and len(states) == 1


def test_compile_cache_and_errors(compiler: GrammarCompiler, tok: Tokenizer) -> None:
    a = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA, sort_keys=True))) is a
    assert compiler_for(tok, V) is compiler
    for so, words in (
        (StructuredOutputsParams(json={"type": "objectx"}), "Unsupported type"),
        (StructuredOutputsParams(json="{not json"), "not valid JSON"),
        (StructuredOutputsParams(regex="([a-z"), "Unclosed"),
        (StructuredOutputsParams(grammar='root ::= "a" |'), "EBNF"),
    ):
        with pytest.raises(GrammarError, match=words) as e:
            compiler.compile(so)
        assert ".cc:" not in str(e.value)  # xgrammar's source location is not for users


def test_params_validation() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("a",))
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=())
    p = SamplingParams(structured_outputs=StructuredOutputsParams(json={"b": 1, "a": 2}))
    assert p.structured_outputs.json == '{"a": 2, "b": 1}' and hash(p)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_llm_json_schema_outputs_validate(async_scheduling: bool) -> None:
    """The engine end to end (built-in tiny model, random weights): every output of a batch mixing
    constrained and free rows, sampled and greedy, parses and validates; the free rows are unchanged by
    their neighbours' grammars."""
    import jsonschema_rs

    from hyserve.engine.llm import LLM

    llm = LLM(device="cpu", max_seq_len=512, max_batch_size=8, async_scheduling=async_scheduling)
    so = StructuredOutputsParams(json=SCHEMA)
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["Hello", "Tell me", [5, 6, 7], "Name:"]
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=i, structured_outputs=so) for i in range(3)
    ]
    params += [SamplingParams(max_tokens=120, temperature=0.0, structured_outputs=so)]
    outs = llm.generate(prompts + ["free"], params + [free])
    validator = jsonschema_rs.validator_for(SCHEMA)
    for o in outs[:4]:
        assert o.finish_reason == "stop", o.text
        validator.validate(json.loads(o.text))
    alone = llm.generate(["free"], free)[0]
    assert outs[4].token_ids == alone.token_ids


def test_completed_grammar_stops_the_request_despite_ignore_eos() -> None:
    """`ignore_eos` lets a free row run past EOS, but a grammar that took its stop token is complete: the
    request stops there with finish_reason "stop" (it used to run on unconstrained: "yes\\x12..." or
    '{"a": 8775}in</tool_response>...')."""
    from hyserve.engine.llm import LLM

    llm = LLM(device="cpu", max_seq_len=512, max_batch_size=8)
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    }
    specs = [StructuredOutputsParams(choice=("yes", "no")), StructuredOutputsParams(json=schema)]
    params = [
        SamplingParams(max_tokens=40, temperature=1.0, seed=seed, ignore_eos=True, structured_outputs=so)
        for so in specs
        for seed in range(3)
    ]
    outs = llm.generate(["Hello"] * len(params), params)
    for o, p in zip(outs, params):
        assert o.finish_reason == "stop", o.text
        if p.structured_outputs is specs[0]:
            assert o.text in ("yes", "no")
        else:
            assert set(json.loads(o.text)) == {"a"}
    free = llm.generate(["Hello"], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 40
