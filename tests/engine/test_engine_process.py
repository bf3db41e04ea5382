"""`ProcessEngine` (engine/engine_process.py): the engine loop in its own process behind the `AsyncEngine`
interface. It gives the tokens the in-thread engine gives, refuses bad requests in the server's process with
the engine's messages, survives a failure outside a step as the thread does, and when the engine process
dies every stream ends with an error and the engine is marked dead (so the server exits non-zero)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from hyserve import SamplingParams
from hyserve.config import build_engine_config
from hyserve.engine.async_engine import AsyncEngine
from hyserve.engine.engine_process import ProcessEngine
from hyserve.engine.errors import RequestRejected
from hyserve.engine.faults import FaultInjector
from tests.engine.test_supervision import PROMPT, _collect

SHORT = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
# on a GPU each engine of these tests (two run at once) takes a tenth of the free memory, not nine tenths
CONFIG = build_engine_config({"warmup": "off", "kv_cache_config": {"free_gpu_memory_fraction": 0.1}})


def _inject_faults(engine) -> None:  # type: ignore[no-untyped-def]  # runs in the engine process
    engine.faults = FaultInjector.parse("engine:bad")  # escapes step() once "bad..." is scheduled


def _fail_start(engine) -> None:  # type: ignore[no-untyped-def]
    raise ValueError("kv_cache_config: this engine was made to fail its start")


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    eng = ProcessEngine(CONFIG, log=lambda s: None)
    eng.start()
    yield eng
    eng.shutdown()
    eng.close()
    assert eng.pid is not None and not _alive(eng.pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_same_tokens_as_the_engine_thread_and_stats_follow(engine: ProcessEngine) -> None:
    thread = AsyncEngine(CONFIG, log=lambda s: None)
    thread.start()
    try:

        async def run(eng):  # type: ignore[no-untyped-def]
            return await asyncio.gather(*(_collect(eng, f"r{i}", SHORT) for i in range(5)))

        ref = asyncio.run(run(thread))
        got = asyncio.run(run(engine))
    finally:
        thread.shutdown()
    assert got == ref and all(r == "length" and len(t) == 6 for t, r, _ in got)
    assert engine.model_name == thread.model_name and engine.max_seq_len == thread.max_seq_len
    assert engine.max_batch_size == thread.max_batch_size
    assert engine.capacity_report() == thread.capacity_report()
    assert engine.tokenizer.decode(got[0][0]) == thread.tokenizer.decode(ref[0][0])
    assert engine.stats()["generation_tokens_total"] >= 30
    engine.reset_stats()
    assert engine.stats()["generation_tokens_total"] == 0


def test_bad_requests_are_refused_with_the_engines_messages(engine: ProcessEngine) -> None:
    too_long = [1] * (engine.max_seq_len + 1)
    with pytest.raises(RequestRejected, match="max_seq_len") as got:
        engine.validate_request(too_long, SHORT)
    thread = AsyncEngine(CONFIG, log=lambda s: None)
    with pytest.raises(RequestRejected) as want:
        thread.validate_request(too_long, SHORT)
    assert str(got.value) == str(want.value)
    with pytest.raises(RequestRejected, match="vocabulary"):
        asyncio.run(_collect_ids(engine, [10**9]))
    assert asyncio.run(_collect(engine, "after-bad", SHORT))[1] == "length"  # it serves on


async def _collect_ids(eng: ProcessEngine, ids: list[int]) -> None:
    async for _ in eng.generate("bad-ids", ids, SHORT):
        pass


def test_an_aborted_stream_frees_its_request_in_the_engine_process(engine: ProcessEngine) -> None:
    async def cut() -> int:
        n = 0
        async for d in engine.generate("cut", PROMPT, LONG):
            n += len(d.token_ids)
            if n >= 3:
                break  # the reader stops: the request is aborted
        return n

    assert asyncio.run(cut()) >= 3
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and engine.stats()["num_running"]:
        time.sleep(0.05)
    assert engine.stats()["num_running"] == 0 and engine.open_stream_ids() == []


def test_a_failure_outside_a_step_is_survived_in_the_engine_process() -> None:
    eng = ProcessEngine(CONFIG.replace(engine_failure_limit=3), log=lambda s: None, prepare=_inject_faults)
    eng.start()
    try:

        async def main():  # type: ignore[no-untyped-def]
            inflight = [asyncio.create_task(_collect(eng, f"long{i}", LONG)) for i in range(2)]
            await asyncio.sleep(0.2)
            bad = await _collect(eng, "bad", SHORT)
            lost = await asyncio.gather(*inflight)
            after = await _collect(eng, "after", SHORT)
            return bad, lost, after

        bad, lost, after = asyncio.run(main())
        assert bad[1] == "error" and "injected fault" in (bad[2] or "")
        assert all(r == "error" and "engine was reset" in (e or "") for _, r, e in lost)
        assert after[1] == "length" and eng.healthy and not eng.fatal
        assert eng.stats()["engine_restarts_total"] == 1
    finally:
        eng.shutdown()
        eng.close()


def test_a_dead_engine_process_ends_every_stream_and_marks_the_engine_dead() -> None:
    eng = ProcessEngine(CONFIG, log=lambda s: None)
    fatal: list[str] = []
    eng.on_fatal = fatal.append
    eng.start()
    try:

        async def main():  # type: ignore[no-untyped-def]
            task = asyncio.create_task(_collect(eng, "doomed", LONG))
            await asyncio.sleep(0.3)
            assert eng.pid is not None
            os.kill(eng.pid, signal.SIGKILL)  # the out-of-memory killer, a segfault
            return await asyncio.wait_for(task, 20)

        toks, reason, error = asyncio.run(main())
        assert reason == "error" and "engine process exited" in (error or "")
        assert not eng.healthy and eng.fatal and len(fatal) == 1 and "exit code -9" in fatal[0]
        with pytest.raises(RuntimeError, match="not running"):
            asyncio.run(_collect(eng, "late", SHORT))
    finally:
        eng.shutdown()
        eng.close()


def test_a_start_up_failure_is_raised_as_the_engine_raised_it() -> None:
    t = time.monotonic()
    with pytest.raises(ValueError, match="^kv_cache_config: this engine was made to fail its start$"):
        ProcessEngine(CONFIG, log=lambda s: None, prepare=_fail_start)
    assert time.monotonic() - t < 120


def test_a_process_that_exits_without_shutdown_ends_its_engine_process(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    script = tmp_path / "leave.py"
    script.write_text(
        "from hyserve.config import EngineConfig\n"
        "from hyserve.engine.engine_process import ProcessEngine\n"
        "if __name__ == '__main__':\n"
        "    eng = ProcessEngine(EngineConfig(warmup='off'), log=lambda s: None)\n"
        "    eng.start()\n"
        "    print(eng.pid, flush=True)\n"  # then exit without shutdown()
    )
    t = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert time.monotonic() - t < 60
    assert not _alive(int(out.stdout.split()[0]))


def test_ctrl_c_while_the_engine_starts_ends_both_processes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    script = tmp_path / "interrupt.py"
    script.write_text(
        "import os, time\n"
        "from hyserve.config import EngineConfig\n"
        "from hyserve.engine.engine_process import ProcessEngine\n"
        "def slow(engine):\n"
        "    print(os.getpid(), flush=True)\n"
        "    time.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    ProcessEngine(EngineConfig(warmup='off'), log=lambda s: None, prepare=slow)\n"
    )
    # a test worker may ignore SIGINT, and an ignored SIGINT stays ignored in its children: restore it
    p = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert p.stdout is not None
    child = int(p.stdout.readline())  # the engine process is up and loading
    t = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.wait(timeout=30)
    assert time.monotonic() - t < 15 and not _alive(child)
