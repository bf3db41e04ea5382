"""Shared helpers for the server tests: a real `hyserve serve` subprocess, an in-thread uvicorn for
apps over a scripted fake engine, and Prometheus text parsing.

Kept out of conftest.py (owned by the lead); test modules import what they need from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from hyserve.engine.errors import RequestRejected
from hyserve.engine.outputs import StreamDelta, TokenLogprob
from hyserve.engine.sampling_params import SamplingParams

REPO_ROOT = Path(__file__).resolve().parents[1]

# The report's extra-llm-api-config.yml, shrunk to the tiny model on CPU. TRT-LLM-only keys stay in, to
# check they are accepted (with one warning). The KV pool is capped below max_seq_len (allowed with
# allow_oversized_max_seq_len) so the "can never fit the pools" 400 can be exercised.
REPORT_STYLE_YAML = """\
backend: pytorch
enable_chunked_prefill: true
disable_overlap_scheduler: true
enable_attention_dp: false
max_batch_size: 32
max_num_tokens: 1024
trust_remote_code: true
cuda_graph_config:
  enable_padding: true
  max_batch_size: 8
kv_cache_config:
  free_gpu_memory_fraction: 0.8
  enable_block_reuse: true
  tokens_per_block: 64
  max_tokens: 3072
  allow_oversized_max_seq_len: true
  mamba_state_config:
    periodic_snapshot_interval: 256
    additional_snapshot_offsets_from_end:
      - 0
moe_config:
  backend: TRTLLM
"""
KV_TOKEN_CAP = 3072


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], bool], timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} (labels kept verbatim; unlabelled -> 'name')."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out


# ---- a real `hyserve serve` process ----------------------------------------------------------------------


class PortTaken(RuntimeError):
    """The server's port was taken between `free_port` and the server's bind."""


@dataclass
class ServerProcess:
    """`python -m hyserve.cli serve ...` on a free loopback port, with its output in a log file."""

    args: list[str]
    api_key: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = 180.0) -> ServerProcess:
        """Start and wait for /health. `free_port` only finds a port free a moment ago: if another process
        took it before the server bound it, the server exits naming the port and starts again on another."""
        for _ in range(3):
            try:
                return self._start(timeout)
            except PortTaken:
                self.port = free_port()
        return self._start(timeout)

    def _start(self, timeout: float) -> ServerProcess:
        fd, name = tempfile.mkstemp(prefix="hyserve-serve-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        cmd = [
            sys.executable,
            "-m",
            "hyserve.cli",
            "serve",
            *self.args,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
        ]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = dict(os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log()
                if "cannot listen there: it is already in use" in log:
                    self.log_path.unlink()
                    raise PortTaken(self.port)
                raise RuntimeError(f"hyserve serve exited with {self.proc.returncode}:\n{log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"hyserve serve did not become healthy in {timeout}s:\n{self.log()}")

    def log(self) -> str:
        if self.log_path is not None and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return self._final_log

    _final_log: str = ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log_path is not None and self.log_path.exists():
            self._final_log = self.log_path.read_text(errors="replace")
            self.log_path.unlink()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.url}/metrics", timeout=10).text)

    def idle(self) -> bool:
        """No request running or waiting, every KV block and state slot back in the pool."""
        m = self.metrics()
        return (
            m.get("hyserve_num_requests_running") == 0
            and m.get("hyserve_num_requests_waiting") == 0
            and m.get("hyserve_kv_cache_blocks_free") == m.get("hyserve_kv_cache_blocks_total")
            and m.get("hyserve_state_slots_used", 0) == 0
        )


# ---- a scripted fake engine, for app-level tests --------------------------------------------------------


@dataclass
class FakeEngine:
    """The `AsyncEngine` interface with scripted output, so the HTTP layer's behaviour (parsers, error
    paths, disconnects) can be tested exactly and fast.

    `script(prompt_ids, params)` returns the output as a list of text pieces (one token each), or
    raises. The special piece `FAIL` ends the request with finish_reason "error" at that point; `HANG`
    blocks until aborted (for disconnect tests)."""

    tokenizer: Any = None
    model_name: str = "fake-model"
    max_seq_len: int = 256
    vocab_size: int = 320
    script: Callable[[list[int], SamplingParams], list[str]] = lambda ids, p: ["Hello", " world"]
    healthy: bool = True
    dead_reason: str | None = None
    running: dict[str, asyncio.Event] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    logprob_ids: tuple[int, ...] = (7, 8, 9)  # the token of each output logprob, then its top alternatives
    priorities: dict[str, int] = field(
        default_factory=dict
    )  # the `priority` each request id was generated with

    FAIL = "\x00FAIL"
    HANG = "\x00HANG"

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        if not prompt_token_ids:
            raise RequestRejected("the prompt is empty", param="prompt", code="empty_prompt")
        if any(t >= self.vocab_size for t in prompt_token_ids):
            raise RequestRejected(
                f"token ids must be < {self.vocab_size}", param="prompt", code="invalid_token_id"
            )
        n = len(prompt_token_ids) + params.max_tokens
        if n > self.max_seq_len:
            raise RequestRejected(
                f"this request needs {n} tokens, more than max_seq_len = {self.max_seq_len}",
                param="prompt",
                code="context_length_exceeded",
            )

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        ev = self.running.get(request_id)
        if ev is not None:
            ev.set()

    def stats(self) -> dict[str, float]:
        return {
            "num_running": len(self.running),
            "num_waiting": 0,
            "kv_blocks_total": 10,
            "kv_blocks_free": 10 - len(self.running),
            "healthy": int(self.healthy),
            "jit_compiles_after_ready": 0,
            "cuda_alloc_retries": 0,
        }

    def _delta(
        self,
        rid: str,
        n_prompt: int,
        toks: list[int],
        text: str,
        n_out: int,
        *,
        finished: bool = False,
        reason: str | None = None,
        error: str | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> StreamDelta:
        return StreamDelta(
            request_id=rid,
            token_ids=toks,
            text=text,
            logprobs=logprobs,
            finished=finished,
            finish_reason=reason,
            num_prompt_tokens=n_prompt,
            num_cached_tokens=self.cached_tokens,
            num_output_tokens=n_out,
            error=error,
        )

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *, priority: int = 0
    ) -> AsyncIterator[StreamDelta]:
        self.validate_request(prompt_token_ids, params, priority)
        self.priorities[request_id] = priority
        pieces = self.script(list(prompt_token_ids), params)
        ev = asyncio.Event()
        self.running[request_id] = ev
        n = len(prompt_token_ids)
        done = False
        try:
            out = 0
            reason = "stop"
            for piece in pieces:
                await asyncio.sleep(0)
                if ev.is_set():
                    reason = "abort"
                    break
                if piece == self.FAIL:
                    done = True
                    yield self._delta(
                        request_id,
                        n,
                        [],
                        "",
                        out,
                        finished=True,
                        reason="error",
                        error="RuntimeError: injected failure",
                    )
                    return
                if piece == self.HANG:
                    await ev.wait()
                    reason = "abort"
                    break
                out += 1
                lps = None
                if params.logprobs is not None:
                    a, b, c = self.logprob_ids
                    lps = [TokenLogprob(token_id=a, logprob=-0.5, top={a: -0.5, b: -1.5, c: float("-inf")})]
                yield self._delta(request_id, n, [7], piece, out, logprobs=lps)
                if out >= params.max_tokens:
                    reason = "length"
                    break
            done = True
            yield self._delta(request_id, n, [], "", out, finished=True, reason=reason)
        finally:
            self.running.pop(request_id, None)
            (self.finished if done else self.aborted).append(request_id)


@contextlib.contextmanager
def serve_app_in_thread(app: Any) -> Iterator[str]:
    """Run an ASGI app with uvicorn on a free loopback port in a background thread; yields its URL."""
    import uvicorn

    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        if not wait_until(lambda: server.started, 20):
            raise RuntimeError("uvicorn did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(timeout=20)
