"""lm-eval 0.4's `local-completions` against a real `hyserve serve` (a `hyserve make-tiny` directory, CPU,
loopback), as the README documents: a loglikelihood task (multiple choice) and a generate_until task, both
from local JSON files. Random weights, so the check is the protocol: every request is answered, and the
loglikelihoods lm-eval computed equal the sums of the continuation tokens' logprobs from the server itself."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_fixtures import ServerProcess

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval test needs lm-eval (pip install lm-eval)")

MC = [
    {"question": "The sky is", "choices": [" blue", " green", " made of cheese"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Paris is in", "choices": [" France", " Peru", " space"], "answer": 0},
]
GEN = [{"question": "Say hi", "answer": "hi"}, {"question": "Count to three", "answer": "1 2 3"}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from hyserve.model.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("m") / "tiny-lm")


@pytest.fixture(scope="module")
def server(tiny: Path) -> Iterator[ServerProcess]:
    s = ServerProcess(args=[str(tiny), "--max_seq_len", "512", "--disable-log-requests"]).start()
    yield s
    assert s.stop() == 0, s.log()


def _tasks(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "mc.jsonl").write_text("".join(json.dumps(x) + "\n" for x in MC))
    (d / "gen.jsonl").write_text("".join(json.dumps(x) + "\n" for x in GEN))
    (d / "hyserve_mc.yaml").write_text(f"""task: hyserve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "mc.jsonl"}
test_split: test
output_type: multiple_choice
target_delimiter: ""
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (d / "hyserve_gen.yaml").write_text(f"""task: hyserve_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / "gen.jsonl"}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: answer
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return d


def test_local_completions_loglikelihood_and_generate_until(
    server: ServerProcess, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks = _tasks(tmp_path / "tasks")
    out = simple_evaluate(
        model="local-completions",
        model_args=f"base_url={server.url}/v1/completions,model={tiny.name},tokenizer={tiny},"
        "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1,timeout=60",
        tasks=["hyserve_mc", "hyserve_gen"],
        task_manager=TaskManager(include_path=str(tasks)),
        log_samples=True,
        limit=None,
    )
    assert out is not None
    res = out["results"]
    assert 0.0 <= res["hyserve_mc"]["acc,none"] <= 1.0
    assert 0.0 <= res["hyserve_gen"]["exact_match,none"] <= 1.0
    samples = out["samples"]
    assert len(samples["hyserve_mc"]) == len(MC) and len(samples["hyserve_gen"]) == len(GEN)
    for s in samples["hyserve_gen"]:
        assert isinstance(s["resps"][0][0], str)
    # each choice's loglikelihood is the sum of its tokens' logprobs as the server reports them
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    for s in samples["hyserve_mc"]:
        doc = s["doc"]
        for choice, resp in zip(doc["choices"], s["resps"]):
            ll = resp[0][0]
            # lm-eval's API models add no BOS unless model_args say add_bos_token=True
            ctx = tok(doc["question"], add_special_tokens=False)["input_ids"]
            cont = tok(doc["question"] + choice, add_special_tokens=False)["input_ids"][len(ctx) :]
            r = httpx.post(
                f"{server.url}/v1/completions",
                timeout=30,
                json={
                    "model": tiny.name,
                    "prompt": ctx + cont,
                    "max_tokens": 0,
                    "echo": True,
                    "logprobs": 0,
                    "temperature": 0,
                },
            )
            lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            assert math.isclose(ll, sum(lps[len(ctx) :]), rel_tol=1e-6, abs_tol=1e-6), (choice, ll)
