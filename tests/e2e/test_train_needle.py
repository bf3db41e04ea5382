"""scripts/train_needle.py: the synthetic retrieval data (needle once, at its depth, in the server's exact
token ids; loss only on the answer) and training (a few steps on a fixed batch lower the loss)."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import torch

from hyserve.bench.needle import DEFAULT_NEEDLE, QUESTION
from scripts import train_needle as T

ROOT = Path(__file__).resolve().parents[2]


torch.set_num_threads(1)
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok():
    return T.tiny_tokenizer()


def _prompt_text(tok, ex: T.Example) -> str:
    return tok.decode(ex.ids[: ex.answer_start], skip_special_tokens=False)


@pytest.mark.parametrize("style", ["mixed", "repeat", "phrase"])
@pytest.mark.parametrize("instruction", [True, False])
def test_needle_once_at_its_depth_in_the_servers_ids(tok, style, instruction):
    rng = random.Random(7)
    for i in range(12):
        depth = i / 11
        code = T.random_code(rng, 1.0)
        ex = T.make_example(
            tok,
            rng,
            target_len=400,
            depth=depth,
            code=code,
            style=style,
            end_question=i % 3 == 0,
            instruction=instruction,
        )
        text = _prompt_text(tok, ex)
        # the ids are exactly what /v1/chat/completions builds from the message text
        user = text.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        rendered = tok.apply_chat_template([{"role": "user", "content": user}], enable_thinking=False)
        assert tok.encode(rendered, add_special_tokens=False) == ex.ids[: ex.answer_start]
        assert user.startswith(QUESTION if instruction else T.BARE_HEADER)
        # the needle sentence and the code occur exactly once in the prompt
        assert text.count(T.NEEDLE_PREFIX) == 1 and text.count(code) == 1, text
        assert re.fullmatch(r"[A-Z0-9]+(-[A-Z0-9]+)*", code)
        # the length is on target (filler counted piece by piece)
        assert abs(ex.answer_start - 400) <= 6, ex.answer_start
        # the needle starts at needle_token_pos, and its depth within the filler is the requested one
        at = tok.decode(ex.ids[ex.needle_token_pos : ex.needle_token_pos + 24], skip_special_tokens=False)
        assert at.lstrip().startswith(T.NEEDLE_PREFIX.strip()), at
        head = len(T.chat_ids(tok, QUESTION if instruction else T.BARE_HEADER)) - T._template_tail_len(tok)
        needle_len = len(tok.encode(f" {T.NEEDLE_PREFIX}{code}."))
        filler = ex.answer_start - head - needle_len - T._template_tail_len(tok)
        if ex.code and i % 3:  # no end question: everything between header and tail is filler + needle
            got = (ex.needle_token_pos - head) / filler
            assert abs(got - depth) <= 0.03 + 4 / filler, (got, depth)


def test_answer_tokens_alone_carry_the_loss(tok):
    rng = random.Random(3)
    exs = [
        T.make_example(tok, rng, target_len=n, depth=0.5, code=T.random_code(rng, 1.0), style="mixed")
        for n in (150, 180, 230)
    ]
    ids, labels = T.collate(exs)
    assert ids.shape == (3, max(len(e.ids) for e in exs))
    im_end = tok.token_to_id(T.IM_END)
    for i, e in enumerate(exs):
        answer = tok.encode(e.code) + [im_end]
        assert e.ids[e.answer_start :] == answer
        mask = labels[i] != T.IGNORE
        # exactly the positions that predict the answer tokens, and their targets are the answer
        assert mask.nonzero().flatten().tolist() == list(range(e.answer_start - 1, len(e.ids) - 1))
        assert labels[i][mask].tolist() == answer
        assert (ids[i, len(e.ids) :] == 0).all()  # right padding, never a label


def test_data_stream_is_deterministic_and_follows_the_curricula(tok):
    cur = T.Curriculum(160, 1024)
    a = T.sample_batch(tok, random.Random(5), cur, 0.3, 4096)
    b = T.sample_batch(tok, random.Random(5), cur, 0.3, 4096)
    assert [e.ids for e in a] == [e.ids for e in b]
    assert cur.length_cap(0.0) == cur.min_bare_len and cur.length_cap(cur.ramp) == 1024
    rng = random.Random(0)
    short = [T.random_code(rng, 0.0) for _ in range(200)]
    full = [T.random_code(rng, 1.0) for _ in range(200)]
    assert max(len(c) for c in short) <= 3 + 1 + 2 and max(c.count("-") for c in short) <= 1
    assert max(c.count("-") for c in full) == 3 and max(len(c) for c in full) > 12
    for progress in (0.0, 0.5, 1.0):
        batch = T.sample_batch(tok, random.Random(1), cur, progress, 4096)
        # a batch's prompts are within the cap (the instruction format has a floor of min_len), + the answer
        assert max(e.answer_start for e in batch) <= max(cur.min_len, cur.length_cap(progress)) + 6


def test_bench_prompt_is_the_clients(tok):
    ids = T.bench_prompt_ids(tok, 300, 0.5)
    text = tok.decode(ids, skip_special_tokens=False)
    assert DEFAULT_NEEDLE in text and "alphabet alphabet" in text and abs(len(ids) - 300) <= 6
    assert text.endswith("<|im_start|>assistant\n<think></think>")


def test_a_few_steps_on_a_fixed_batch_lower_the_loss(tok):
    cfg = T.model_config("cpu")
    model = T.build_model(cfg, seed=0, device="cpu")
    opt = T.make_optimizer(model, 3e-3)
    rng = random.Random(11)
    exs = [
        T.make_example(
            tok,
            rng,
            target_len=60,
            depth=rng.random(),
            code=T.random_code(rng, 0.3),
            style="mixed",
            instruction=False,
        )
        for _ in range(8)
    ]
    ids, labels = T.collate(exs)
    losses = [float(T.train_step(model, opt, ids, labels)) for _ in range(6)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses
    # training is deterministic given the seed
    model2 = T.build_model(cfg, seed=0, device="cpu")
    opt2 = T.make_optimizer(model2, 3e-3)
    assert [float(T.train_step(model2, opt2, ids, labels)) for _ in range(6)] == losses


def test_exact_greedy_hits_agree_with_greedy_decoding(tok):
    model = T.build_model(T.model_config("cpu"), seed=1, device="cpu")
    rng = random.Random(2)
    exs = [
        T.make_example(tok, rng, target_len=50, depth=0.5, code="AB", style="mixed", instruction=False)
        for _ in range(3)
    ]
    # make one answer what the (untrained) model greedily says, so both outcomes are exercised
    im_end = tok.token_to_id(T.IM_END)
    gen = T.greedy_decode(model, exs[0].ids[: exs[0].answer_start], im_end, 4, "cpu")
    forced = T.Example(
        ids=exs[0].ids[: exs[0].answer_start] + gen,
        answer_start=exs[0].answer_start,
        code="?",
        depth=0.5,
        needle_token_pos=exs[0].needle_token_pos,
    )
    hits = T.exact_greedy_hits(model, [forced, *exs], "cpu")
    assert hits[0] is True
    for e, h in zip(exs, hits[1:]):
        g = T.greedy_decode(model, e.ids[: e.answer_start], im_end, len(e.ids) - e.answer_start, "cpu")
        assert h == (g == e.ids[e.answer_start :])


@pytest.mark.parametrize("argv, msg", [
    (["--min-len", "20"], "--min-len"),
    (["--min-len", "400", "--max-len", "300"], "--max-len"),
    (["--steps", "0"], "--steps"),
    (["--lr", "2"], "--lr"),
    (["--preset", "huge"], "--preset"),
    (["--steps", "many"], "--steps"),
    (["--steps", "auto"], "--time-budget-s"),
    (["--time-budget-s", "-1"], "--time-budget-s"),
    (["--eval-lengths", "64,256"], "--eval-lengths"),
    (["--eval-lengths", "1k"], "--eval-lengths"),
    (["--warmup-steps", "0"], "--warmup-steps"),
    (["--steps", "auto", "--time-budget-s", "9", "--warmup-steps", "5"], "--warmup-steps"),
])  # fmt: skip
def test_bad_arguments_are_refused(argv, msg, capsys):
    with pytest.raises(SystemExit):
        T.parse_args(["--out", "/tmp/x", "--device", "cpu", *argv])
    assert msg in capsys.readouterr().err


def test_defaults_and_auto_steps():
    a = T.parse_args(["--out", "/tmp/x", "--device", "cpu"])
    assert (a.preset, a.steps, a.max_len, a.time_budget_s) == ("cpu", 1600, 320, 0.0)
    assert [int(x) for x in a.eval_lengths.split(",")] == [160, 256, 320, 512, 640]
    g = T.parse_args(["--out", "/tmp/x", "--device", "cuda"])
    assert (g.preset, g.steps, g.time_budget_s, g.max_len) == ("h200", "auto", 420.0, 2048)
    assert g.eval_lengths.split(",")[-1] == "16384"
    # 20 calibration steps in 5 s, then 0.1 s a step: 85% of 420 s -> 20 + 3520 steps, capped by --max-steps
    assert T._auto_steps(g, 5.0, 0.1) == 3540
    assert (
        T._auto_steps(T.parse_args(["--out", "x", "--device", "cuda", "--max-steps", "1000"]), 5.0, 0.1)
        == 1000
    )
    assert T._auto_steps(g, 400.0, 0.1) == T.CALIBRATION_STEPS + 1  # the budget is gone: one more step
    assert T.lr_at(0, 100, 1e-3, 10) == pytest.approx(1e-4) and T.lr_at(100, 100, 1e-3, 10) == pytest.approx(
        1e-4
    )
    assert T.lr_at(10, 100, 1e-3, 10) == pytest.approx(1e-3)


def test_bad_names_are_refused(tok):
    with pytest.raises(ValueError, match="unknown preset"):
        T.model_config("huge")
    with pytest.raises(ValueError, match="unknown filler style"):
        T.filler_pieces(random.Random(0), 4, "lorem")


def test_a_short_run_writes_a_checkpoint_hyserve_loads(tmp_path):
    from hyserve.model.nemotron_h.config import HybridModelConfig
    from hyserve.model.tokenizer import Tokenizer

    out, res = tmp_path / "ckpt", tmp_path / "res"
    argv = [
        "--device",
        "cpu",
        "--steps",
        "auto",
        "--time-budget-s",
        "30",
        "--max-steps",
        "22",
        "--tokens-per-batch",
        "400",
        "--max-len",
        "200",
        "--eval-lengths",
        "160",
        "--eval-per-cell",
        "2",
        "--out",
        str(out),
        "--results-dir",
        str(res),
        "--tag",
        "t",
        "--log-every",
        "5",
    ]
    assert T.main(argv) == 0
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "training_log.json",
    ):
        assert (out / f).is_file(), f
    cfg = HybridModelConfig.from_hf(out)
    assert cfg.vocab_size == T.VOCAB_SIZE and cfg.time_step_limit[0] == 0.001
    assert Tokenizer.from_dir(out).has_chat_template
    import json

    r = json.loads((res / "t.json").read_text())
    assert r["steps_planned"] == 22 and r["steps_done"] == 22 and not r["cut_by_time"]
    assert [(c["length"], c["depth"]) for c in r["eval"]["cells"]] == [
        (160, d) for d in (0, 0.25, 0.5, 0.75, 1)
    ]
    assert [rec["step"] for rec in r["log"]] == [0, 5, 10, 15, 20, 21]
    md = (res / "t.md").read_text()
    assert "| 160 |" in md and "bench HIT/MISS" in md
