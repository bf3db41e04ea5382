"""A two-"node" torchrun launch on loopback (`--nnodes 2 --nproc-per-node 1`, c10d rendezvous): each agent
runs `python -m hyserve.cli serve MODEL --tp_size 2`; the process torchrun makes rank 0 serves HTTP, the other
runs headless, and a completion through the `openai` client equals tp_size 1's (docs/architecture.md,
"Parallelism")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hyserve import LLM, SamplingParams
from tests.e2e.test_tp_serve import FLAGS, YAML, tiny_checkpoint
from tests.server_fixtures import REPO_ROOT, free_port


def _agent(rdzv_port: int, http_port: int, ckpt: Path, yml: Path, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{rdzv_port}",
        "--max-restarts",
        "0",
        "-m",
        "hyserve.cli",
        "serve",
        str(ckpt),
        "--tp_size",
        "2",
        "--config",
        str(yml),
        *FLAGS,
        "--host",
        "127.0.0.1",
        "--port",
        str(http_port),
    ]
    env = {**os.environ, "HYSERVE_DIST_TIMEOUT_S": "20", "PYTHONUNBUFFERED": "1"}
    with open(log, "wb") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def test_two_node_torchrun_serves_a_request(tmp_path: Path) -> None:
    ckpt = tiny_checkpoint(tmp_path)
    yml = tmp_path / "cfg.yml"
    yml.write_text(YAML)
    want = (
        LLM(str(ckpt), device="cpu", max_seq_len=2048, kv_cache_config={"max_gpu_total_bytes": 16777216})
        .generate("Hello there, general", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        .text
    )
    rdzv, http = free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    agents = [_agent(rdzv, http, ckpt, yml, log) for log in logs]

    def output() -> str:
        return "\n".join(f"--- node {i}\n{p.read_text(errors='replace')}" for i, p in enumerate(logs))

    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert time.monotonic() < deadline, "no rank served /health in 120 s\n" + output()
            assert all(a.poll() is None for a in agents), "an agent exited\n" + output()
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(
            model=client.models.list().data[0].id,
            prompt="Hello there, general",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.choices[0].text == want and r.usage is not None and r.usage.completion_tokens == 12
        text = output()
        assert text.count("rank 0 of 2 (torchrun; gloo), tp_size 2") == 1, text  # one node serves ...
        assert text.count("ready: serving") == 1, text  # ... the other is headless
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
        for a in agents:
            try:
                a.wait(timeout=30)
            except subprocess.TimeoutExpired:
                a.kill()
                a.wait()
    if any("Traceback" in p.read_text(errors="replace").split("Received 15 death signal")[0] for p in logs):
        pytest.fail("a rank failed before shutdown\n" + output())
