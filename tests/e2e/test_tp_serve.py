"""`hyserve serve --device cpu --tp_size 2` (rank 0 serving, rank 1 started by it, gloo) through the official
`openai` client: greedy completions, whole and streamed and concurrent, equal tp_size 1's text with
chosen-token logprobs within 1e-4; and a rank killed mid-stream: the stream ends, the server reports
unhealthy and exits non-zero within 60 s, nothing hangs (docs/architecture.md, "Parallelism")."""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from hyserve import LLM, SamplingParams
from hyserve.model.nemotron_h.checkpoint import NAMES
from hyserve.model.nemotron_h.config import HybridModelConfig
from hyserve.model.nemotron_h.model import NemotronHForCausalLM
from hyserve.model.tiny import make_tiny
from hyserve.model.weights import save_checkpoint
from tests.model_harness import strong_random_weights
from tests.server_fixtures import ServerProcess, wait_until

FLAGS = [
    "--device",
    "cpu",
    "--max_batch_size",
    "4",
    "--max_num_tokens",
    "32",
    "--max_seq_len",
    "2048",
    "--disable-log-requests",
]
YAML = "kv_cache_config:\n  max_gpu_total_bytes: 16777216\n  tokens_per_block: 16\n"
PROMPTS = [
    "Hello there, general",
    "The quick brown fox jumps over the lazy dog, then over the fence and away",
    "a b c d e f g",
]


def tiny_checkpoint(root: Path) -> Path:
    """make-tiny's dense model (with its tokenizer) and O(1)-logit weights, so greedy choices are clear."""
    d = make_tiny(root / "tiny")
    cfg = HybridModelConfig.from_hf(d)
    model = NemotronHForCausalLM(cfg, dtype=torch.float32)
    strong_random_weights(model, cfg, seed=3)
    save_checkpoint(model, d, names=NAMES)
    return d


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tp-serve")
    (root / "cfg.yml").write_text(YAML)
    return tiny_checkpoint(root), root / "cfg.yml"


def start(ckpt: Path, yml: Path, monkeypatch: pytest.MonkeyPatch) -> ServerProcess:
    monkeypatch.setenv("HYSERVE_DIST_TIMEOUT_S", "20")  # every collective of both ranks
    return ServerProcess(args=[str(ckpt), "--tp_size", "2", "--config", str(yml), *FLAGS]).start(timeout=120)


def worker_pid(server: ServerProcess) -> int:
    m = re.search(r"started rank 1 of 2 \(pid (\d+)\)", server.log())
    assert m, server.log()
    return int(m.group(1))


def test_openai_client_through_a_tp2_server(
    setup: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, yml = setup
    greedy = SamplingParams(max_tokens=16, temperature=0.0, logprobs=0, ignore_eos=True)
    want = LLM(
        str(ckpt),
        device="cpu",
        max_batch_size=4,
        max_num_tokens=32,
        max_seq_len=2048,
        kv_cache_config={"max_gpu_total_bytes": 16777216, "tokens_per_block": 16},
    ).generate(PROMPTS, greedy)
    server = start(ckpt, yml, monkeypatch)
    try:
        assert "2 ranks on this host (gloo), tp_size 2" in server.log()
        assert re.search(r"cache budget per rank: rank 0 .* rank 1 .*plans from the smallest", server.log())
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id

        def whole(prompt: str) -> tuple[str, list[float]]:
            r = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                logprobs=0,
                extra_body={"ignore_eos": True},
            )
            assert r.choices[0].logprobs is not None and r.choices[0].logprobs.token_logprobs is not None
            return r.choices[0].text, [float(x) for x in r.choices[0].logprobs.token_logprobs]

        def streamed(prompt: str) -> str:
            chunks = client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(4) as pool:  # concurrent: the steps batch them
            got = list(pool.map(whole, PROMPTS))
            got_streamed = list(pool.map(streamed, PROMPTS))
        for w, (text, lps), s in zip(want, got, got_streamed):
            assert text == w.text == s
            assert w.logprobs is not None and len(lps) == len(w.logprobs) == 16
            assert max(abs(a - b.logprob) for a, b in zip(lps, w.logprobs)) <= 1e-4
        assert wait_until(server.idle, 10)
    finally:
        rc = server.stop()
    assert rc == 0, server.log()
    assert "Traceback" not in server.log(), server.log()  # rank 1 too (its output is in the same log)


def test_a_killed_rank_stops_the_server_and_no_request_hangs(
    setup: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, yml = setup
    server = start(ckpt, yml, monkeypatch)
    assert server.proc is not None
    try:
        ended: dict[str, object] = {}
        first = threading.Event()

        def long_stream() -> None:
            body = {
                "model": "tiny",
                "prompt": "Once upon a time",
                "max_tokens": 1500,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            try:
                with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        first.set()
                        if line.startswith("data: {"):
                            ended["last"] = line
                ended["how"] = "closed"
            except httpx.HTTPError as e:
                ended["how"] = f"dropped: {type(e).__name__}"
            ended["t"] = time.monotonic()

        t = threading.Thread(target=long_stream, daemon=True)
        t.start()
        assert first.wait(30), server.log()
        time.sleep(0.3)
        pid = worker_pid(server)
        import os
        import signal

        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(timeout=60)
        assert not t.is_alive(), "the stream hung after rank 1 died"
        assert float(ended["t"]) - killed < 30, ended  # type: ignore[arg-type]
        if ended["how"] == "closed":  # the engine failed the stream in-band before the server went down
            err = json.loads(str(ended["last"]).removeprefix("data: "))["error"]
            assert err["code"] == "engine_error" and err["error_id"], ended
            # the client gets an error id; the detail is in the server's log under that id
            log = server.log()
            assert err["error_id"] in log and "lost contact with the other ranks" in log, log[-3000:]
        # a request arriving now is refused (unhealthy) or finds the port closed, at once
        try:
            r = httpx.post(
                f"{server.base_url}/completions",
                json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                timeout=10,
            )
            assert r.status_code >= 500, r.text
        except httpx.HTTPError:
            pass
        server.proc.wait(timeout=max(1.0, 60 - (time.monotonic() - killed)))
        assert time.monotonic() - killed < 60
    finally:
        rc = server.stop()
    assert rc not in (0, None), server.log()
    log = server.log()
    assert "rank 1" in log and "exit status 1" in log, log
