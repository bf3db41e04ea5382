"""Synthetic benchmark prompts: `random` and `shared-prefix`, as token-id lists or as text.

    random:         [ common prefix (random_prefix_len) | random ids (input_len +- range) ]
    shared-prefix:  [ prefix k of num_prefixes (shared_prefix_len) | random ids (input_len +- range) ]

Lengths are drawn uniformly from [floor(L * (1 - r)), ceil(L * (1 + r))] (vLLM's --random-range-ratio),
never below 1. Token ids are uniform in [low, vocab_size). Everything comes from one `random.Random(seed)`,
so a seed gives the same prompts on every machine.

Token-id prompts go to /v1/completions (`prompt` as a list of ints). Chat endpoints need text: `as_text`
maps each id to a common English word, so shared prefixes stay shared and one word is about one token
for BPE tokenizers; the server's `usage.prompt_tokens` then says how many tokens it really saw.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

DATASETS = ("random", "shared-prefix", "sharegpt")  # sharegpt: hyserve/bench/sharegpt.py

# Short words that are single tokens for common BPE vocabularies (with the leading space).
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have "
    "an had they you were their one all we can her has there been if more when will would who so no "
    "time up out about into than them only other new some could these two may first then do any like "
    "my now over such our man me even most made after also did many before must through back years"
).split()


@dataclass(frozen=True)
class SampleRequest:
    prompt: list[int] | str
    prompt_len: int  # tokens (for text prompts: words, about one token each)
    output_len: int
    prefix_index: int | None = None  # which shared prefix (shared-prefix dataset)


def sample_lengths(rng: random.Random, mean: int, range_ratio: float, n: int) -> list[int]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    lo = max(1, math.floor(mean * (1 - range_ratio)))
    hi = max(lo, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_ids(rng: random.Random, n: int, low: int, vocab_size: int) -> list[int]:
    if not 0 <= low < vocab_size:
        raise ValueError(f"token ids are drawn from [low, vocab_size): need 0 <= {low} < {vocab_size}")
    return rng.choices(range(low, vocab_size), k=n)


def random_dataset(
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    vocab_size: int,
    low: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prompts` prompts: one common random prefix of `prefix_len` ids, then `input_len` (+- range)
    random ids each; output lengths `output_len` (+- range)."""
    rng = random.Random(seed)
    prefix = random_ids(rng, prefix_len, low, vocab_size)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    out = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + random_ids(rng, n_in, low, vocab_size)
        out.append(SampleRequest(prompt=ids, prompt_len=len(ids), output_len=n_out))
    return out


def shared_prefix_dataset(
    *,
    num_prompts: int,
    num_prefixes: int,
    prefix_len: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int,
    low: int = 0,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prefixes` random prefixes of `prefix_len` ids, each shared by about num_prompts/num_prefixes
    prompts (assigned round-robin, then shuffled), each followed by its own `input_len` (+- range) ids."""
    if num_prefixes < 1:
        raise ValueError(f"num_prefixes must be >= 1, got {num_prefixes}")
    rng = random.Random(seed)
    prefixes = [random_ids(rng, prefix_len, low, vocab_size) for _ in range(num_prefixes)]
    which = [i % num_prefixes for i in range(num_prompts)]
    rng.shuffle(which)
    in_lens = sample_lengths(rng, input_len, range_ratio, num_prompts)
    out_lens = sample_lengths(rng, output_len, range_ratio, num_prompts)
    out = []
    for k, n_in, n_out in zip(which, in_lens, out_lens):
        ids = prefixes[k] + random_ids(rng, n_in, low, vocab_size)
        out.append(SampleRequest(prompt=ids, prompt_len=len(ids), output_len=n_out, prefix_index=k))
    return out


def ids_to_text(ids: list[int]) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in ids)


def as_text(requests: list[SampleRequest]) -> list[SampleRequest]:
    """The same requests with text prompts (one word per token id), for chat endpoints."""
    return [replace(r, prompt=ids_to_text(r.prompt)) if isinstance(r.prompt, list) else r for r in requests]
