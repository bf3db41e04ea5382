#!/usr/bin/env python
"""Train a small NemotronH-architecture checkpoint that finds the needle.

The model is a Mamba2 + NoPE-attention hybrid on the tiny byte-level tokenizer (hyserve/model/tokenizer.py)
with its chat template, trained on synthetic retrieval: a chat request in the long-prompt report's format
(the instruction, then "DOCUMENT:" and filler with "The secret code is <CODE>." at a random depth; sometimes
a question after the document too), the assistant's answer being <CODE><|im_end|>.

Trainable model: transformers' `NemotronHForCausalLM` in training mode. hyserve's layers are an inference
path (paged KV, state slots, no autograd through its kernels' bookkeeping); transformers' torch path is a
plain differentiable forward, and tests/engine/test_model_parity.py shows hyserve reproduces it to 1e-4 on the
same checkpoint, so a model trained here is served by hyserve as trained. The loss is computed here from
the logits (no reliance on a version's `labels` handling), and evaluation runs plain forwards (no cache
API), so the script works on transformers 5.17 (the GPU image) and 5.24 (the CPU venv) alike.

What makes copying emerge (and what this script does about each):
  * loss only on the answer tokens (the code and <|im_end|>): the whole gradient is retrieval;
  * curricula, gated on the loss: documents grow from 40 tokens (document-only format, no instruction) to
    --max-len, the share of the bench's instruction format from 0 to 80%, and codes from one part of 2-3
    letters to up to three parts of 2-8 letters plus digits; the curriculum advances only while the mean
    answer loss of the last 20 steps is below --gate-loss. Copying appears suddenly (a phase change) at a
    step that varies with the data stream: ungated, one CPU stream had it by step 300 and another not by
    step 1000, with the lengths and codes already grown past where it emerges fastest;
  * query / key projections initialised at std 1/sqrt(hidden) rather than 0.02: each one's gradient is
    proportional to the other, and at 0.02 the attention stays uniform for a long plateau;
  * no padding inside a sequence: batches are right-padded, and a causal model's positions never see a later
    token (causal conv, causal scan, causal attention), so pad tokens cannot leak into the Mamba state of a
    real token; they only carry -100 labels;
  * 8 NoPE attention heads per attention layer, each after a Mamba layer (its conv gives every token its
    predecessors, which is what an induction-style copy keys on);
  * AdamW with linear warm-up and cosine decay to 10%, gradient clipping at 1.

Deterministic given --seed and --steps: the data stream, the init and (on the CPU, bit for bit) every update;
on CUDA the deterministic-algorithms switch is set (cuBLAS workspace config included). --steps auto (the
CUDA default) times the first steps and fixes the count to fit --time-budget-s; the log says which count to
pass to reproduce the run.

Outputs under --out: config.json, model.safetensors, tokenizer files with the chat template,
generation_config.json, training_log.json; and under --results-dir: <tag>.json / .md with the accuracy
table by prompt length and needle depth (exact greedy match, see `exact_greedy_hits`).

    python scripts/train_needle.py --device cuda --out build/needle-h200      # the H200 run (< 10 min)
    python scripts/train_needle.py --device cpu --out models/hyserve-needle-tiny  # the shipped one (~9 min)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from hyserve.bench.needle import DEFAULT_NEEDLE, QUESTION, haystack_prompt
from hyserve.model.tokenizer import IM_END, Tokenizer, write_tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]

VOCAB_SIZE = 320  # the tiny tokenizer's size
NEEDLE_PREFIX = "The secret code is "
END_QUESTION = "\n\nWhat is the secret code?"
BARE_HEADER = "DOCUMENT:\n"  # the short format: the document alone (no instruction), for cheap early steps
IGNORE = -100

# ---- model shapes ------------------------------------------------------------------------------------------
PRESETS: dict[str, dict[str, Any]] = {
    # ~0.33M parameters, 1.3 MB in float32: trains on 1 CPU thread in minutes, small enough to ship
    "cpu": {"max_position_embeddings": 8192, "hidden_size": 96, "pattern": "M*M*", "mamba_num_heads": 6,
            "mamba_head_dim": 32, "ssm_state_size": 16, "n_groups": 1, "num_attention_heads": 8,
            "num_key_value_heads": 8, "head_dim": 24, "chunk_size": 64},
    # ~2.9M parameters (11.5 MB in float32): the H200 run; max_position_embeddings is hyserve's default
    # max_seq_len (1M)
    "h200": {"max_position_embeddings": 1 << 20, "hidden_size": 256, "pattern": "M*M*M*M*",
             "mamba_num_heads": 8, "mamba_head_dim": 64, "ssm_state_size": 32, "n_groups": 1,
             "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32, "chunk_size": 128},
}  # fmt: skip

_LAYER_NAMES = {"M": "linear_attention", "*": "full_attention", "-": "mlp"}


def model_config(preset: str) -> dict[str, Any]:
    """config.json contents of a preset (NemotronH, float32, tiny tokenizer ids)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    p = dict(PRESETS[preset])
    pattern = p.pop("pattern")
    max_position_embeddings = p.pop("max_position_embeddings")
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "dtype": "float32",
        "vocab_size": VOCAB_SIZE, "hidden_size": p["hidden_size"],
        "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "layer_norm_epsilon": 1e-5,
        "initializer_range": 0.02, "rescale_prenorm_residual": True, "residual_in_fp32": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "use_cache": True, "num_logits_to_keep": 1,
        "num_nextn_predict_layers": 0, "layers_block_type": [_LAYER_NAMES[c] for c in pattern],
        "mamba_num_heads": p["mamba_num_heads"], "mamba_head_dim": p["mamba_head_dim"], "expand": 2,
        "ssm_state_size": p["ssm_state_size"], "n_groups": p["n_groups"], "conv_kernel": 4,
        "chunk_size": p["chunk_size"], "use_conv_bias": True, "use_bias": False, "mamba_proj_bias": False,
        "mamba_hidden_act": "silu", "mamba_ssm_cache_dtype": "float32", "time_step_min": 0.001,
        "time_step_max": 0.1, "time_step_floor": 0.0001,
        # transformers' prefill clamps dt at time_step_min whatever this says; writing the same bound here
        # makes hyserve (which follows time_step_limit) compute what was trained
        "time_step_limit": [0.001, 1e30],
        "num_attention_heads": p["num_attention_heads"], "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["head_dim"], "attention_bias": False, "sliding_window": None,
        "intermediate_size": 4 * p["hidden_size"], "mlp_bias": False, "mlp_hidden_act": "relu2",
    }  # fmt: skip


# ---- tokenizer ---------------------------------------------------------------------------------------------
def tiny_tokenizer() -> Tokenizer:
    """hyserve's tiny tokenizer with its chat template, as the engine will load it from the checkpoint."""
    with tempfile.TemporaryDirectory() as d:
        write_tiny_tokenizer(d)
        return Tokenizer.from_dir(d)


_SENTINEL = "\x00user-text\x00"
_TEMPLATE_PARTS: dict[int, tuple[str, str]] = {}


def chat_ids(tok: Tokenizer, user_text: str) -> list[int]:
    """Token ids of a one-message chat request, exactly as hyserve's /v1/chat/completions builds them
    (template with enable_thinking=False and the generation prompt, no added BOS). The template is rendered
    once around a sentinel and the message spliced in (the template inserts the text verbatim)."""
    parts = _TEMPLATE_PARTS.get(id(tok))
    if parts is None:
        text = tok.apply_chat_template([{"role": "user", "content": _SENTINEL}], enable_thinking=False)
        pre, sep, post = text.partition(_SENTINEL)
        if not sep or _SENTINEL in post:  # pragma: no cover - guards edits of the chat template
            raise ValueError("chat template does not insert the user message verbatim once")
        parts = _TEMPLATE_PARTS[id(tok)] = (pre, post)
    return tok.encode(parts[0] + user_text + parts[1], add_special_tokens=False)


def chat_ids_batch(tok: Tokenizer, user_texts: list[str]) -> list[list[int]]:
    """`chat_ids` of many messages at once (the tokenizer encodes them in parallel; same ids)."""
    chat_ids(tok, "")  # fills the template cache
    pre, post = _TEMPLATE_PARTS[id(tok)]
    return [
        e.ids
        for e in tok.backend.encode_batch([pre + t + post for t in user_texts], add_special_tokens=False)
    ]


# ---- synthetic documents -----------------------------------------------------------------------------------
WORDS = tuple(
    "the of and to in is was for on that with as by at from it an be this are or which have had not but "
    "all were when we there can one their has more will if about out up into them some time so these "
    "would other its than two may then only first new any very after most also made over such where "
    "through back years much before must right three well down because each just those how too many "
    "between never under while last might great old year off come since against go came around however "
    "small every found still own part place long house world hand high river stone garden window market "
    "letter morning island engine signal forest winter summer bridge paper table music harbor valley "
    "copper silver yellow purple quiet gentle rapid narrow hollow distant alphabet number answer system "
    "report station canal lantern orchard meadow ladder basket candle pencil ribbon thunder".split()
)
PUNCT = (",", ",", ".", ".", ";", ":", "!", "?", " -", " (", ")")
UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
DIGITS = "0123456789"


def random_code(rng: random.Random, level: float) -> str:
    """A code like ORANGE-MANGO-42: 1..3 upper-case parts and often a digit part. `level` (0..1) widens
    the distribution from one short part to the full one (the code-length curriculum)."""
    max_parts = 1 + round(2 * level)
    max_chars = 3 + round(5 * level)
    parts = [
        "".join(rng.choice(UPPER) for _ in range(rng.randint(2, max_chars)))
        for _ in range(rng.randint(1, max_parts))
    ]
    if rng.random() < 0.3 + 0.5 * level:
        parts.append("".join(rng.choice(DIGITS) for _ in range(rng.randint(1, 1 + round(3 * level)))))
    return "-".join(parts)


def _mixed_filler(rng: random.Random, n: int) -> list[str]:
    """n pieces of varied prose: words, some capitalised, numbers, punctuation, line breaks."""
    out: list[str] = []
    start = True
    for _ in range(n):
        r = rng.random()
        if r < 0.08 and not start:
            out.append(rng.choice(PUNCT))
            start = out[-1] in (".", "!", "?")
        elif r < 0.12:
            out.append(" " + str(rng.randint(0, 10 ** rng.randint(1, 5))))
        elif r < 0.14 and not start:
            out.append("\n")
            start = True
        else:
            w = rng.choice(WORDS)
            out.append(" " + (w.capitalize() if start else w))
            start = False
    return out


def filler_pieces(rng: random.Random, n: int, style: str) -> list[str]:
    """n filler pieces (each a word with its leading space, a number or a punctuation mark)."""
    if style == "mixed":
        return _mixed_filler(rng, n)
    if style == "repeat":  # the report's client: one word over and over ("alphabet alphabet ...")
        w = "alphabet" if rng.random() < 0.3 else rng.choice(WORDS)
        return [" " + w] * n
    if style == "phrase":
        phrase = [" " + rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        return [phrase[i % len(phrase)] for i in range(n)]
    raise ValueError(f"unknown filler style {style!r}; choose mixed, repeat or phrase")


FILLER_STYLES = ("mixed", "mixed", "repeat", "phrase")


@dataclass(frozen=True)
class Example:
    ids: list[int]  # prompt + answer
    answer_start: int  # ids[answer_start:] is the answer (the code's tokens, then <|im_end|>)
    code: str
    depth: float  # fraction of the filler before the needle
    needle_token_pos: int  # index in ids of the first token of the needle sentence


def _document(pieces: list[str], depth: float, code: str, end_question: bool, header: str) -> tuple[str, str]:
    """(text before the needle, the rest) of the user message."""
    k = round(depth * len(pieces))
    before = header + "".join(pieces[:k]).lstrip(" ")
    sep = " " if before and not before.endswith("\n") else ""
    rest = f"{sep}{NEEDLE_PREFIX}{code}." + "".join(pieces[k:]) + (END_QUESTION if end_question else "")
    return before, rest


def make_example(
    tok: Tokenizer,
    rng: random.Random,
    *,
    target_len: int,
    depth: float,
    code: str,
    style: str,
    end_question: bool = False,
    instruction: bool = True,
) -> Example:
    """One training / evaluation sequence of about `target_len` prompt tokens (within a few tokens:
    filler pieces are counted one by one, and only a merge across two pieces, such as two line breaks,
    makes the whole differ from the sum). `instruction`: the bench's instruction heads the document;
    without it the message is "DOCUMENT:" and the document alone."""
    text = example_text(
        tok,
        rng,
        target_len=target_len,
        depth=depth,
        code=code,
        style=style,
        end_question=end_question,
        instruction=instruction,
    )
    return finish_example(tok, chat_ids(tok, text), code, depth)


def example_text(
    tok: Tokenizer,
    rng: random.Random,
    *,
    target_len: int,
    depth: float,
    code: str,
    style: str,
    end_question: bool,
    instruction: bool,
) -> str:
    """The user message of `make_example` (the part that draws from `rng`)."""
    header = QUESTION if instruction else BARE_HEADER
    base = _base_len(tok, header, end_question) + len(tok.encode(code))
    pieces = _filler_to_budget(tok, rng, target_len - base, style)
    before, rest = _document(pieces, depth, code, end_question, header)
    return before + rest


def finish_example(tok: Tokenizer, prompt: list[int], code: str, depth: float) -> Example:
    answer = tok.encode(code, add_special_tokens=False) + [tok.token_to_id(IM_END)]
    return Example(
        ids=prompt + answer,
        answer_start=len(prompt),
        code=code,
        depth=depth,
        needle_token_pos=_find_needle(tok, prompt),
    )


_BASE_LEN: dict[tuple[int, str, bool], int] = {}


def _base_len(tok: Tokenizer, header: str, end_question: bool) -> int:
    """Tokens of the request with no filler and an empty code."""
    key = (id(tok), header, end_question)
    if key not in _BASE_LEN:
        _BASE_LEN[key] = len(
            chat_ids(tok, header + NEEDLE_PREFIX + "." + (END_QUESTION if end_question else ""))
        )
    return _BASE_LEN[key]


def _filler_to_budget(tok: Tokenizer, rng: random.Random, budget: int, style: str) -> list[str]:
    """Filler pieces whose token counts add up to `budget` (or one piece more)."""
    pieces: list[str] = []
    used = 0
    while used < budget:
        # every piece is at least one token, so `budget` pieces always suffice; mixed prose averages ~3
        # tokens a piece and is drawn in smaller rounds
        more = filler_pieces(rng, max(8, (budget - used) // 2 if style == "mixed" else budget), style)
        for piece in more:
            if used >= budget:
                break
            pieces.append(piece)
            used += _piece_tokens(tok, piece)
    return pieces


_NEEDLE_IDS: dict[int, tuple[list[int], int]] = {}


def _find_needle(tok: Tokenizer, ids: list[int]) -> int:
    """Index of the needle sentence's first token ('T' of 'The secret code is') in `ids`."""
    if id(tok) not in _NEEDLE_IDS:
        _NEEDLE_IDS[id(tok)] = (tok.encode(" secret code is"), len(tok.encode("The")))
    key, back = _NEEDLE_IDS[id(tok)]
    first, n = key[0], len(key)
    i = ids.index(first)
    while ids[i : i + n] != key:
        i = ids.index(first, i + 1)
    return i - back


_PIECE_TOKENS: dict[str, int] = {}


def _piece_tokens(tok: Tokenizer, piece: str) -> int:
    n = _PIECE_TOKENS.get(piece)
    if n is None:
        n = _PIECE_TOKENS[piece] = len(tok.encode(piece))
    return n


def _template_tail_len(tok: Tokenizer) -> int:
    """Number of template tokens after the user message's text (end of turn + generation prompt)."""
    with_x, empty = chat_ids(tok, "x"), chat_ids(tok, "")
    head = 0
    while head < len(empty) and with_x[head] == empty[head]:
        head += 1
    return len(empty) - head


# ---- curriculum and batches --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Curriculum:
    min_len: int
    max_len: int
    min_bare_len: int = 40
    ramp: float = 0.7  # fraction of training over which length and code length reach their maximum

    def level(self, progress: float) -> float:
        return min(1.0, max(0.0, progress / self.ramp))

    def length_cap(self, progress: float) -> int:
        lv = self.level(progress)  # geometric growth: as many steps at 128 -> 256 as at 1k -> 2k
        return round(self.min_bare_len * (self.max_len / self.min_bare_len) ** lv)


def sample_batch(
    tok: Tokenizer, rng: random.Random, cur: Curriculum, progress: float, tokens_per_batch: int
) -> list[Example]:
    """Examples of one step, all of one format and about one length: the bench's instruction format with
    probability 0.8 x the curriculum level (else the short document-only format: cheap steps that teach the
    same copy, and the only format until copying has emerged), a length drawn log-uniformly in [shortest for
    the format, the curriculum's cap], as many rows as fit in `tokens_per_batch`."""
    level = cur.level(progress)
    instruction = rng.random() < 0.8 * level
    lo = cur.min_len if instruction else cur.min_bare_len
    cap = max(lo, cur.length_cap(progress))
    length = round(math.exp(rng.uniform(math.log(lo), math.log(cap))))
    rows = max(1, tokens_per_batch // length)
    codes = [random_code(rng, level) for _ in range(rows)]
    depths = [rng.random() for _ in range(rows)]
    texts = [
        example_text(
            tok,
            rng,
            target_len=length,
            depth=d,
            code=c,
            style=rng.choice(FILLER_STYLES),
            end_question=rng.random() < 0.25,
            instruction=instruction,
        )
        for c, d in zip(codes, depths)
    ]
    return [finish_example(tok, ids, c, d) for ids, c, d in zip(chat_ids_batch(tok, texts), codes, depths)]


def collate(examples: list[Example], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), right-padded; labels are the next token at answer positions and -100 elsewhere
    (prompt and padding), so the loss is on the answer only."""
    width = max(len(e.ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        ids[i, : len(e.ids)] = torch.tensor(e.ids)
        # logits at position p predict token p + 1: positions answer_start-1 .. len-2 predict the answer
        labels[i, e.answer_start - 1 : len(e.ids) - 1] = torch.tensor(e.ids[e.answer_start :])
    return ids, labels


def answer_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE
    )


# ---- model and training ------------------------------------------------------------------------------------
def build_model(config: dict[str, Any], seed: int, device: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    kwargs = {k: v for k, v in config.items() if k != "architectures"}
    # the legacy spelling too, for a transformers that predates layers_block_type (newer ones drop it)
    inverse = {v: k for k, v in _LAYER_NAMES.items()}
    kwargs["hybrid_override_pattern"] = "".join(inverse[t] for t in config["layers_block_type"])
    kwargs["num_hidden_layers"] = len(config["layers_block_type"])
    hf_cfg = transformers.NemotronHConfig(**kwargs)
    try:
        model = transformers.NemotronHForCausalLM._from_config(hf_cfg, attn_implementation="sdpa")
    except (TypeError, ValueError):  # a version without sdpa for this model: its eager attention
        model = transformers.NemotronHForCausalLM(hf_cfg)
    _scale_attention_init(model, config["hidden_size"])
    model = model.to(device=device, dtype=torch.float32)
    _patch_dt_limit(model, tuple(config["time_step_limit"]))
    return model


@torch.no_grad()
def _scale_attention_init(model: torch.nn.Module, hidden: int) -> None:
    """Query and key projections at std 1/sqrt(hidden) instead of the 0.02 of `initializer_range`: the
    gradient of one is proportional to the other, so at 0.02 both start near zero and the attention that
    must find the needle stays uniform for a long plateau."""
    std = hidden**-0.5
    for name, p in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            p.normal_(0.0, std)


def _patch_dt_limit(model: torch.nn.Module, limit: tuple[float, float]) -> None:
    """Give every Mamba mixer the config's dt limit (transformers hard-codes (time_step_min, inf) in some
    versions; both are a clamp at time_step_min here, this only makes it explicit)."""
    for mod in model.modules():
        if hasattr(mod, "time_step_limit") and hasattr(mod, "A_log"):
            mod.time_step_limit = limit


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps (a count, not a fraction: the first steps' LR does not depend on
    the run's length), then cosine decay to 10% of the peak at `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def train_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    labels: torch.Tensor,
    clip: float = 1.0,
) -> torch.Tensor:
    """One update; returns the loss as a (detached) tensor, so on CUDA nothing waits for the device here
    and the next batch is built while this step runs."""
    model.train()
    logits = model(input_ids=ids).logits
    loss = answer_loss(logits, labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float = 0.05) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


# ---- evaluation --------------------------------------------------------------------------------------------
@torch.no_grad()
def exact_greedy_hits(model: torch.nn.Module, examples: list[Example], device: str) -> list[bool]:
    """Per example: would greedy decoding produce exactly the answer (code, then <|im_end|>)?

    One forward over prompt + answer decides it: greedy decoding reproduces the answer iff at every answer
    step the argmax, given the answer so far, is the answer's next token (the first wrong argmax is where
    greedy decoding would leave it). Rows are right-padded, which a causal model never sees."""
    model.eval()
    ids, labels = collate(examples)
    logits = model(input_ids=ids.to(device)).logits
    pred = logits.argmax(-1).cpu()
    mask = labels != IGNORE
    return [bool((pred[i][mask[i]] == labels[i][mask[i]]).all()) for i in range(len(examples))]


@torch.no_grad()
def greedy_decode(
    model: torch.nn.Module, prompt: list[int], stop: int, max_new: int, device: str
) -> list[int]:
    """Plain greedy decoding (a full forward per token, no cache API), for the report's sample answers."""
    model.eval()
    ids = list(prompt)
    out: list[int] = []
    for _ in range(max_new):
        nxt = int(model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].argmax())
        out.append(nxt)
        if nxt == stop:
            break
        ids.append(nxt)
    return out


def bench_prompt_ids(tok: Tokenizer, target_len: int, depth: float) -> list[int]:
    """The ids `hyserve bench needle` sends (its default needle and 'alphabet ' filler) near `target_len`."""
    a = len(chat_ids(tok, haystack_prompt(0, needle=DEFAULT_NEEDLE, filler="alphabet ", position=depth)))
    b = len(chat_ids(tok, haystack_prompt(100, needle=DEFAULT_NEEDLE, filler="alphabet ", position=depth)))
    n = max(0, round((target_len - a) * 100 / (b - a)))
    return chat_ids(tok, haystack_prompt(n, needle=DEFAULT_NEEDLE, filler="alphabet ", position=depth))


@dataclass
class EvalSpec:
    lengths: tuple[int, ...]
    depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    per_cell: int = 8
    seed: int = 12345
    max_batch_tokens: int = 16384


def evaluate(model: torch.nn.Module, tok: Tokenizer, spec: EvalSpec, device: str) -> dict[str, Any]:
    """Accuracy by prompt length x needle depth on fresh random codes and mixed filler (held-out seed), plus
    the bench's own prompt (ORANGE-MANGO-42 in 'alphabet ' filler) at every cell."""
    rng = random.Random(spec.seed)
    im_end = tok.token_to_id(IM_END)
    cells: list[dict[str, Any]] = []
    for length in spec.lengths:
        for depth in spec.depths:
            exs = [
                make_example(
                    tok, rng, target_len=length, depth=depth, code=random_code(rng, 1.0), style="mixed"
                )
                for _ in range(spec.per_cell)
            ]
            hits: list[bool] = []
            step = max(1, spec.max_batch_tokens // (length + 32))
            for i in range(0, len(exs), step):
                hits += exact_greedy_hits(model, exs[i : i + step], device)
            bench = bench_prompt_ids(tok, length, depth)
            code = DEFAULT_NEEDLE.rstrip(".").split()[-1]
            bench_ex = Example(
                ids=bench + tok.encode(code) + [im_end],
                answer_start=len(bench),
                code=code,
                depth=depth,
                needle_token_pos=-1,
            )
            bench_hit = exact_greedy_hits(model, [bench_ex], device)[0]
            cells.append(
                {
                    "length": length,
                    "depth": depth,
                    "n": len(hits),
                    "accuracy": sum(hits) / len(hits),
                    "mean_prompt_tokens": sum(e.answer_start for e in exs) / len(exs),
                    "bench_prompt_tokens": len(bench),
                    "bench_hit": bench_hit,
                }
            )
    return {"cells": cells, "method": "exact greedy match (teacher-forced argmax over the answer)"}


def sample_answers(
    model: torch.nn.Module, tok: Tokenizer, lengths: tuple[int, ...], device: str
) -> list[dict]:
    """Greedy-decoded text of the bench prompt at each length (depth 0.5), as hyserve would answer."""
    out = []
    im_end = tok.token_to_id(IM_END)
    for length in lengths:
        ids = bench_prompt_ids(tok, length, 0.5)
        gen = greedy_decode(model, ids, im_end, 24, device)
        out.append({"length": length, "prompt_tokens": len(ids), "answer": tok.decode(gen)})
    return out


# ---- reports and checkpoint --------------------------------------------------------------------------------
def accuracy_markdown(result: dict[str, Any]) -> str:
    ev = result["eval"]
    depths = sorted({c["depth"] for c in ev["cells"]})
    lengths = sorted({c["length"] for c in ev["cells"]})
    by = {(c["length"], c["depth"]): c for c in ev["cells"]}
    a = result["args"]
    lines = [
        f"# Needle retrieval after training ({result['tag']})",
        "",
        f"preset `{a['preset']}`, {result['parameters']:,} parameters, {result['steps_done']} steps in "
        f"{result['train_seconds']:.0f} s on {a['device']}, trained at {a['min_len']}..{a['max_len']} "
        f"tokens, seed {a['seed']}, final answer loss {result['final_loss']:.4f}; curriculum reached "
        f"{result['curriculum_progress']:.2f} (held back by the loss gate for {result['gated_steps']} "
        "steps).",
        "",
        f"Accuracy: {ev['method']}, {ev['cells'][0]['n']} fresh random codes in mixed filler per cell; "
        "`bench` is the `hyserve bench needle` prompt (ORANGE-MANGO-42 in 'alphabet ' filler): HIT / MISS.",
        "",
        "| prompt tokens | " + " | ".join(f"depth {d:g}" for d in depths) + " | bench HIT/MISS by depth |",
        "|---|" + "---|" * len(depths) + "---|",
    ]
    for L in lengths:
        row = [f"{by[L, d]['accuracy']:.2f}" for d in depths]
        bench = " ".join("HIT" if by[L, d]["bench_hit"] else "MISS" for d in depths)
        lines.append(f"| {L} | " + " | ".join(row) + f" | {bench} |")
    lines += ["", "Greedy answers to the bench prompt (depth 0.5):", ""]
    lines += [f"- {s['prompt_tokens']} tokens: `{s['answer']!r}`" for s in result["samples"]]
    return "\n".join(lines) + "\n"


def save_checkpoint_dir(model: torch.nn.Module, config: dict[str, Any], out: Path) -> None:
    """The Hugging Face layout hyserve and transformers load: config.json, model.safetensors (transformers'
    own tensor names), tokenizer files with the chat template, generation_config.json."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok = write_tiny_tokenizer(out, model_max_length=config["max_position_embeddings"])
    gen = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": [config["eos_token_id"], tok.token_to_id(IM_END)],
        "pad_token_id": config["pad_token_id"],
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes it owner-only


# ---- main --------------------------------------------------------------------------------------------------
CALIBRATION_STEPS = 20  # steps at curriculum progress 0 whose timing sizes an automatic --steps
_TIMED_FROM = 5  # the first steps pay start-up costs (CUDA context, cuBLAS handles, allocator growth)


@dataclass
class RunState:
    steps: int
    log: list[dict[str, Any]] = field(default_factory=list)
    steps_done: int = 0
    train_seconds: float = 0.0
    final_loss: float = float("nan")
    cut_by_time: bool = False
    recent: list[float] = field(default_factory=list)
    progress: float = 0.0  # curriculum position, advanced by 1 / steps on every step the gate is open
    gated_steps: int = 0  # steps the gate held the curriculum back


def _gate_open(st: RunState, args: argparse.Namespace) -> bool:
    """The curriculum advances only while the recent answer loss is below --gate-loss: copying emerges
    suddenly and at a step that varies with the data, and it emerges fastest on short documents and codes,
    so lengths and codes grow only once the current ones are being copied."""
    window = st.recent[-20:]
    if sum(window) / len(window) < args.gate_loss:
        return True
    st.gated_steps += 1
    return False


def _auto_steps(args: argparse.Namespace, elapsed: float, per_step: float) -> int:
    """Steps that fit the time budget: the CALIBRATION_STEPS done in `elapsed` seconds, then the rest at
    `per_step` (timed past the first steps' start-up costs) with 15% kept back, as later steps are longer."""
    more = int((0.85 * args.time_budget_s - elapsed) / per_step)
    return max(CALIBRATION_STEPS + 1, min(args.max_steps, CALIBRATION_STEPS + more))


def _record(
    st: RunState, args: argparse.Namespace, step: int, loss: torch.Tensor, info: dict[str, Any], t0: float
) -> None:
    value = float(loss)  # waits for that step (the next batch was built meanwhile)
    st.recent = (st.recent + [value])[-50:]
    if step % args.log_every == 0 or step == st.steps - 1:
        rec = {
            "step": step,
            "seconds": round(time.perf_counter() - t0, 2),
            "loss": value,
            "loss_avg50": sum(st.recent) / len(st.recent),
            **info,
        }
        st.log.append(rec)
        print(json.dumps(rec), flush=True)


def train(model: torch.nn.Module, tok: Tokenizer, args: argparse.Namespace) -> RunState:
    """The training loop. Curriculum progress starts at 0 (kept there for the first CALIBRATION_STEPS) and
    advances by 1 / steps per step while the loss gate is open, so a run is deterministic given --seed and
    --steps (on the CPU; on CUDA up to the device's float non-determinism); with --steps auto the count is
    fixed after those steps from their pace and logged, and rerunning with that --steps reproduces the run."""
    rng = random.Random(args.seed)
    cur = Curriculum(args.min_len, args.max_len)
    opt = make_optimizer(model, args.lr)
    st = RunState(steps=args.max_steps if args.steps == "auto" else int(args.steps))
    t0 = t_timed = time.perf_counter()
    pending: tuple[int, torch.Tensor, dict[str, Any]] | None = None
    step = 0
    while step < st.steps:
        if args.time_budget_s and time.perf_counter() - t0 > args.time_budget_s:
            st.cut_by_time = True
            print(
                f"train_needle: time budget {args.time_budget_s:.0f} s reached at step {step} of {st.steps}"
            )
            break
        if step >= CALIBRATION_STEPS and st.recent and _gate_open(st, args):
            st.progress = min(1.0, st.progress + 1.0 / (st.steps - CALIBRATION_STEPS))
        progress = st.progress
        ids, labels = collate(sample_batch(tok, rng, cur, progress, args.tokens_per_batch))
        lr = lr_at(step, st.steps, args.lr, args.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = train_step(model, opt, ids.to(args.device), labels.to(args.device))
        if pending is not None:
            _record(st, args, *pending, t0)
        pending = (
            step,
            loss,
            {
                "lr": lr,
                "length": int(ids.shape[1]),
                "rows": int(ids.shape[0]),
                "progress": round(progress, 4),
            },
        )
        if step == _TIMED_FROM:
            t_timed = time.perf_counter()
        if args.steps == "auto" and step == CALIBRATION_STEPS - 1:
            _record(st, args, *pending, t0)  # waits for this step: the timing covers the device work
            pending = None
            now = time.perf_counter()
            st.steps = _auto_steps(args, now - t0, (now - t_timed) / (CALIBRATION_STEPS - 1 - _TIMED_FROM))
            print(f"train_needle: --steps auto -> {st.steps} (rerun with --steps {st.steps} to reproduce)")
        step += 1
    if pending is not None:
        _record(st, args, *pending, t0)
    st.steps_done = step
    st.train_seconds = time.perf_counter() - t0
    st.final_loss = sum(st.recent) / max(1, len(st.recent))
    return st


def _steps(s: str) -> int | str:
    if s == "auto":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {s!r}") from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="model size (default: h200 on cuda, cpu on the CPU)",
    )
    p.add_argument(
        "--steps",
        type=_steps,
        default=None,
        help="optimizer steps, or 'auto': as many as fit "
        "--time-budget-s at the pace of the first steps (default auto on cuda, 1600 on cpu)",
    )
    p.add_argument("--max-steps", type=int, default=20000, help="most steps --steps auto may choose")
    p.add_argument(
        "--min-len",
        type=int,
        default=160,
        help="shortest training prompt of the instruction "
        "format (tokens; the request without filler is ~125 tokens of the tiny tokenizer)",
    )
    p.add_argument("--max-len", type=int, default=None, help="longest training prompt (default 2048 / 320)")
    p.add_argument(
        "--tokens-per-batch",
        type=int,
        default=None,
        help="tokens per step (default 16384 / 2048; 65536 ran out of the H200's memory in the torch Mamba2 "
        "path)",
    )
    p.add_argument(
        "--lr", type=float, default=None, help="peak LR (default 3e-3 for the cpu preset, 1e-3 for h200)"
    )
    p.add_argument("--warmup-steps", type=int, default=80)
    p.add_argument(
        "--gate-loss",
        type=float,
        default=0.6,
        help="the curriculum advances only while the mean "
        "answer loss of the last 20 steps is below this (default 0.6; a large value: never gated)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--time-budget-s",
        type=float,
        default=None,
        help="stop training after this many seconds "
        "(default 420 on cuda, so training + evaluation + saving stay under 10 minutes; none on cpu)",
    )
    p.add_argument(
        "--eval-lengths", default=None, help="comma-separated prompt lengths for the accuracy table"
    )
    p.add_argument("--eval-per-cell", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--tag", default=None, help="results file tag (default needle_train_<preset>_seed<seed>)")
    args = p.parse_args(argv)
    return _defaults(args, p)


def _defaults(args: argparse.Namespace, p: argparse.ArgumentParser) -> argparse.Namespace:
    gpu = args.device.startswith("cuda")

    def default(name: str, value: Any) -> None:
        if getattr(args, name) is None:
            setattr(args, name, value)

    default("preset", "h200" if gpu else "cpu")
    default("steps", "auto" if gpu else 1600)
    default("max_len", 2048 if gpu else 320)
    default("tokens_per_batch", 16384 if gpu else 2048)
    default("lr", 3e-3 if args.preset == "cpu" else 1e-3)
    default("time_budget_s", 420.0 if gpu else 0.0)
    default("eval_per_cell", 16 if gpu else 8)
    if args.eval_lengths is None:
        top = args.max_len * (8 if gpu else 2)  # how far past the training lengths it generalises
        lens = sorted({args.min_len, args.max_len, top, *(1 << k for k in range(8, 25) if 1 << k <= top)})
        args.eval_lengths = ",".join(str(x) for x in lens if x >= args.min_len)
    _check(args, p)
    args.tag = args.tag or f"needle_train_{args.preset}_seed{args.seed}"
    return args


def _check(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    ints = ["max_steps", "min_len", "max_len", "tokens_per_batch", "eval_per_cell", "warmup_steps"]
    for name in ints + ([] if args.steps == "auto" else ["steps"]):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.min_len < 128 or args.max_len < args.min_len:
        p.error(
            f"need 128 <= --min-len <= --max-len (the chat request alone is ~125 tokens), got "
            f"{args.min_len}, {args.max_len}"
        )
    if not args.gate_loss > 0:
        p.error(f"--gate-loss must be > 0, got {args.gate_loss}")
    if not 0 < args.lr < 1:
        p.error(f"--lr must be in (0, 1), got {args.lr}")
    if args.time_budget_s < 0 or (args.steps == "auto" and not args.time_budget_s):
        p.error(f"--time-budget-s must be >= 0, and > 0 with --steps auto; got {args.time_budget_s}")
    if args.steps == "auto" and args.warmup_steps < CALIBRATION_STEPS:
        p.error(
            f"--steps auto needs --warmup-steps >= {CALIBRATION_STEPS} (the timed steps' LR must not "
            f"depend on the step count chosen after them), got {args.warmup_steps}"
        )
    try:
        lens = [int(x) for x in args.eval_lengths.split(",")]
    except ValueError:
        p.error(f"--eval-lengths: expected comma-separated integers, got {args.eval_lengths!r}")
    if not lens or min(lens) < 128:
        p.error(f"--eval-lengths: every length must be >= 128 (the request alone is ~125 tokens), got {lens}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = True
    tok = tiny_tokenizer()
    config = model_config(args.preset)
    model = build_model(config, args.seed, args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train_needle: preset {args.preset}, {n_params:,} parameters, device {args.device}", flush=True)
    st = train(model, tok, args)
    spec = EvalSpec(lengths=tuple(int(x) for x in args.eval_lengths.split(",")), per_cell=args.eval_per_cell)
    t_eval = time.perf_counter()
    ev = evaluate(model, tok, spec, args.device)
    samples = sample_answers(model, tok, spec.lengths[:3], args.device)
    out = Path(args.out)
    save_checkpoint_dir(model, config, out)
    (out / "training_log.json").write_text(json.dumps(st.log, indent=1) + "\n")
    result = {
        "tag": args.tag,
        "args": vars(args),
        "parameters": n_params,
        "steps_done": st.steps_done,
        "steps_planned": st.steps,
        "cut_by_time": st.cut_by_time,
        "curriculum_progress": st.progress,
        "gated_steps": st.gated_steps,
        "train_seconds": st.train_seconds,
        "eval_seconds": time.perf_counter() - t_eval,
        "final_loss": st.final_loss,
        "eval": ev,
        "samples": samples,
        "log": st.log,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
    }
    res = Path(args.results_dir)
    res.mkdir(parents=True, exist_ok=True)
    (res / f"{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")
    (res / f"{args.tag}.md").write_text(accuracy_markdown(result))
    print(accuracy_markdown(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
