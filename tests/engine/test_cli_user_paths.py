"""What a new user types first: `hyserve generate "Hello"` says to use -p, and
the directory `hyserve make-tiny DIR` writes (the built-in model's files) is a tokenizer path transformers
(and so lm-eval's `tokenizer=`) loads, tokenizing exactly as the server does."""

from __future__ import annotations

from pathlib import Path

import pytest

from hyserve.cli import main
from hyserve.model.tokenizer import Tokenizer


def test_generate_with_the_prompt_as_model_names_dash_p(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "Hello"]) == 2
    err = capsys.readouterr().err
    assert "'Hello' is not a local directory" in err and '-p "Hello"' in err and "MODEL" in err


def test_make_tiny_dir_is_a_transformers_tokenizer_path(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    assert main(["make-tiny", str(tmp_path)]) == 0
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = Tokenizer.from_dir(tmp_path)
    for text in ("Hello, my name is", " the cat sat\n\non the mat", "héllo wörld 日本 \u00e9"):
        assert hf(text)["input_ids"] == ours.encode(text, add_special_tokens=True)  # what completions sends
        assert hf(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
        ids = ours.encode(text, add_special_tokens=True)
        assert hf.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert hf.eos_token_id == ours.eos_token_ids[0] and hf.bos_token_id == ours.bos_token_id
