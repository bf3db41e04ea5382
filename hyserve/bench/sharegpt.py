"""The ShareGPT dataset from a local JSON file (`--dataset-name sharegpt --dataset-path FILE`), read as
`vllm bench serve` reads it.

The file is a JSON list of conversations, each `{"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]}`; those with fewer than two turns are left out. A request is a
conversation's first turn as the prompt, with its second turn's length as max_tokens (or
`--sharegpt-output-len` for every request). Lengths are counted with the model's tokenizer (`--tokenizer DIR`
holding tokenizer.json, special tokens included as vLLM counts them) or, without one, as words (about a token
each in English). As in vLLM, the conversations are shuffled with the seed, then pairs with a prompt under 4
tokens or over 1,024, a reply under 4 (not checked with a fixed output length) or both together over 2,048
are passed over, and the first `num_prompts` that fit are sent, cycled when there are fewer.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from pathlib import Path

from hyserve.bench.datasets import SampleRequest

MIN_TOKENS = 4
MAX_PROMPT_TOKENS = 1024
MAX_TOTAL_TOKENS = 2048


def word_count(text: str) -> int:
    return len(text.split())


def tokenizer_counter(tokenizer_dir: str) -> Callable[[str], int]:
    """Token counts by the tokenizer.json in `tokenizer_dir` (a model directory)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer_dir).expanduser()
    path = path / "tokenizer.json" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--tokenizer {tokenizer_dir}: no tokenizer.json there")
    tok = Tokenizer.from_file(str(path))
    return lambda text: len(tok.encode(text).ids)


def read_conversations(path: str) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with two turns or more. The file is parsed once per
    version (its size and modification time), so the runs and warm-ups of one benchmark read it once."""
    p = Path(path).expanduser()
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ValueError(f"--dataset-path {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"--dataset-path {path}: not a readable JSON file ({e})") from None
    return list(_parse(str(p), path, st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=2)
def _parse(file: str, path: str, size: int, mtime_ns: int) -> tuple[tuple[str, str], ...]:
    try:
        data = json.loads(Path(file).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"--dataset-path {path}: not a readable JSON file ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations (ShareGPT's layout)")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        first, second = (t.get("value") if isinstance(t, dict) else None for t in turns[:2])
        if isinstance(first, str) and isinstance(second, str):
            pairs.append((first, second))
    return tuple(pairs)


def sharegpt_dataset(
    path: str,
    *,
    num_prompts: int,
    seed: int = 0,
    output_len: int | None = None,
    count: Callable[[str], int] = word_count,
) -> list[SampleRequest]:
    """`num_prompts` text requests from a ShareGPT file (see the module docstring)."""
    pairs = read_conversations(path)
    rng = random.Random(seed)
    rng.shuffle(pairs)
    usable: list[SampleRequest] = []
    for prompt, reply in pairs:
        n_in = count(prompt)
        n_out = output_len if output_len is not None else count(reply)
        if not _fits(n_in, n_out, fixed_output=output_len is not None):
            continue
        usable.append(SampleRequest(prompt=prompt, prompt_len=n_in, output_len=n_out))
        if len(usable) == num_prompts:
            break
    if not usable:
        raise ValueError(
            f"--dataset-path {path}: none of its {len(pairs)} two-turn conversations fits (a prompt of "
            f"{MIN_TOKENS} to {MAX_PROMPT_TOKENS} tokens, a reply of at least {MIN_TOKENS}, "
            f"{MAX_TOTAL_TOKENS} together)"
        )
    return [usable[i % len(usable)] for i in range(num_prompts)]


def _fits(n_in: int, n_out: int, *, fixed_output: bool) -> bool:
    if n_in < MIN_TOKENS or n_in > MAX_PROMPT_TOKENS or n_in + n_out > MAX_TOTAL_TOKENS:
        return False
    return fixed_output or n_out >= MIN_TOKENS
