"""Where a large decode step's host time goes on a GPU, and which calls make the host wait for the device.

With async scheduling the engine launches step t+1 before it reads step t's tokens, so its host work is free
as long as nothing in it waits for the GPU. This runs `--batch` requests of a model's architecture (random
weights) through `LLMEngine.step()` and reports, over the decode steps:

- the step time (wall time per decode step) beside the decode graph's replay alone;
- every call that synchronised the host with the device, from torch's sync debug mode
  (`torch.cuda.set_sync_debug_mode("warn")`: device-to-host copies into pageable memory, `.item()`,
  `.tolist()`, `nonzero`, ...), with the Python stack of each site and how often it ran per step;
- the host time of each `step()` phase (scheduler, metadata, launch, read of the previous step).

    python -m benchmarks.bench_step_sync --model-dir benchmarks/configs/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 \
        --batch 256 --git-sha SHA                                   # H200
    python -m benchmarks.bench_step_sync --model-dir '' --batch 4 --steps 3   # CPU smoke (nothing syncs
                                                                              # there)

Writes benchmarks/results/step_sync_<date>_<sha>.json (date, git sha, GPU, exact command).
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import random
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import invocation  # noqa: E402
from benchmarks.phase_timing import time_phases  # noqa: E402
from hyserve import LLM, SamplingParams  # noqa: E402
from hyserve.bench.profiling import graph_replay_ms  # noqa: E402
from hyserve.bench.report import sanitize, stamp  # noqa: E402

CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"
# the step's phases, timed by wrapping these methods (benchmarks/phase_timing.py)
PHASES = (("scheduler", "schedule"), ("runner", "execute"), ("scheduler", "update"), ("engine", "_read"))


def _site(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frames inside hyserve (where the sync is asked for), outermost first."""
    ours = [f for f in stack if "/hyserve/" in f.filename.replace("\\", "/")]
    frames = (ours or stack)[-4:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))


class SyncRecorder:
    """Collects torch's synchronisation warnings by call site while active (other warnings go to the handler
    that was there; the warning filters and handler are restored on exit)."""

    def __init__(self) -> None:
        self.sites: collections.Counter[str] = collections.Counter()
        self.messages: dict[str, str] = {}
        self._ctx = warnings.catch_warnings()

    def __enter__(self) -> SyncRecorder:
        self._ctx.__enter__()
        previous = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
            text = str(message)
            if "synchroniz" not in text:
                return previous(message, category, filename, lineno, file, line)
            site = _site(traceback.extract_stack()[:-1])
            self.sites[site] += 1
            self.messages.setdefault(site, text.splitlines()[0])
            return None

        warnings.showwarning = show
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc: object) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self._ctx.__exit__(*exc)


class ModuleHostTimer:
    """Host time spent inside each part (child module) of every decoder layer while active, summed by module
    class (the launch cost of each layer kind: nothing here waits for the device)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.ms: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        stacks = [
            m for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList)
        ]
        self._mods = [part for layer in (stacks[0] if stacks else []) for part in layer.children()]
        self._handles: list[Any] = []
        self._t0: dict[int, float] = {}

    def __enter__(self) -> ModuleHostTimer:
        def pre(mod, args):  # noqa: ANN001, ANN202
            self._t0[id(mod)] = time.perf_counter()

        def post(mod, args, out):  # noqa: ANN001, ANN202
            name = type(mod).__name__
            self.ms[name] += (time.perf_counter() - self._t0.pop(id(mod))) * 1e3
            self.calls[name] += 1

        for m in self._mods:
            self._handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class PieceHostTimer:
    """With piecewise graphs (engine/runner/mixed_graphs.py) the layers' modules are not called: host time of
    each mixer core kind (launched eagerly) and of the graph replays, by wrapping `_Core.run` and
    `CUDAGraph.replay` while active, and of the step's metadata (`build_meta`)."""

    def __init__(self, runner: Any) -> None:
        self.ms: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.runner = runner

    def _timed(self, name: str, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            t = time.perf_counter()
            out = fn(*args)
            key = name(*args) if callable(name) else name
            self.ms[key] += (time.perf_counter() - t) * 1e3
            self.calls[key] += 1
            return out

        return run

    def __enter__(self) -> PieceHostTimer:
        from hyserve.engine.runner import mixed_graphs

        self._run, self._replay = mixed_graphs._Core.run, torch.cuda.CUDAGraph.replay
        mixed_graphs._Core.run = self._timed(lambda core, *a: f"core {core.fn.__qualname__}", self._run)
        torch.cuda.CUDAGraph.replay = self._timed("graph replays", self._replay)
        self.runner.build_meta = self._timed("build_meta", self.runner.build_meta)
        return self

    def __exit__(self, *exc: object) -> None:
        from hyserve.engine.runner import mixed_graphs

        mixed_graphs._Core.run, torch.cuda.CUDAGraph.replay = self._run, self._replay
        del self.runner.build_meta  # back to the class's method


def _add_prompts(eng, tag: str, k: int, n: int, rng: random.Random) -> None:  # noqa: ANN001
    """`k` random prompts of `n` tokens, one output token each, ids "<tag>-<j>" (tags start with "m")."""
    vocab = eng.model_config.vocab_size
    for j in range(k):
        eng.add_request(
            f"{tag}-{j}",
            [rng.randrange(3, vocab) for _ in range(n)],
            SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        )


def _finish_prompts(eng) -> int:  # noqa: ANN001
    """Step until the added prompts ("m..." ids) are done; the decode batch goes on. Returns the steps."""
    n = 0
    while any(r.request_id.startswith("m") for r in eng.requests.values()):
        eng.step()
        n += 1
    return n


def mixed_breakdown(eng, a: argparse.Namespace, rng: random.Random, k: int) -> dict[str, Any]:  # noqa: ANN001
    """One step that prefills `k` new prompts beside the decode batch, twice: once with the host time of each
    layer kind recorded (module hooks), once under the profiler for its device time per kernel. Set beside the
    step's host time, this says whether a mixed step is bound by its launches or by the device."""
    _add_prompts(eng, f"mh{k}", k, a.mixed_len, rng)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with ModuleHostTimer(eng.runner.model) as timer, PieceHostTimer(eng.runner) as pieces:
        t = time.perf_counter()
        eng.step()
        host_ms = (time.perf_counter() - t) * 1e3
    _finish_prompts(eng)
    timer.ms.update(pieces.ms)
    timer.calls.update(pieces.calls)
    out: dict[str, Any] = dict(
        prompts=k,
        step_host_ms=host_ms,
        layer_host_ms={n: dict(ms=v, calls=timer.calls[n]) for n, v in timer.ms.most_common()},
    )
    if torch.cuda.is_available():
        from hyserve.bench.profiling import device_kernel_times

        torch.cuda.synchronize()
        _add_prompts(eng, f"mp{k}", k, a.mixed_len, rng)
        # the step that launches the prompts' prefill, then the next one, which waits for it
        kern = device_kernel_times(eng.step, 1)
        _finish_prompts(eng)
        total = sum(us for us, _ in kern.values()) / 1e3
        top = sorted(kern.items(), key=lambda kv: -kv[1][0])[: a.top_kernels]
        out.update(
            device_ms=total,
            launches=sum(n for _, n in kern.values()),
            kernels=[dict(name=n[:120], ms=us / 1e3, count=c) for n, (us, c) in top],
        )
    return out


def mixed_steps(eng, a: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:  # noqa: ANN001
    """Host time of steps that carry new prompts beside the decode batch (they run the model eagerly): for
    each count in --mixed-prompts, `--mixed-reps` times, that many prompts of --mixed-len tokens are added
    and the step that prefills them is timed (step() and its runner.execute), then decode steps run until
    the prompts are in; each count is set beside the decode-only steps' mean."""
    out = []
    for k in a.mixed_prompts:
        step_ms, exec_ms = [], []
        for rep in range(a.mixed_reps):
            _add_prompts(eng, f"m{k}-{rep}", k, a.mixed_len, rng)
            phases = time_phases(eng, (("runner", "execute"),))
            t = time.perf_counter()
            eng.step()
            step_ms.append((time.perf_counter() - t) * 1e3)
            exec_ms.append(phases["runner.execute"][0])
            del eng.runner.execute  # the timer was set on the instance: back to the class's method
            _finish_prompts(eng)
        # the whole round, device included: the prompts added, every step until they are in (their prefill
        # step and the decode steps behind it), synchronised at both ends
        rounds, steps = [], []
        for rep in range(a.mixed_reps):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            _add_prompts(eng, f"mr{k}-{rep}", k, a.mixed_len, rng)
            n = _finish_prompts(eng)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            rounds.append((time.perf_counter() - t) * 1e3)
            steps.append(n)
        out.append(
            dict(
                prompts=k,
                prompt_len=a.mixed_len,
                step_ms=sum(step_ms) / len(step_ms),
                execute_ms=sum(exec_ms) / len(exec_ms),
                round_ms=sum(rounds) / len(rounds),
                round_steps=sum(steps) / len(steps),
                reps=len(step_ms),
            )
        )
    return out


def run(a: argparse.Namespace) -> dict[str, Any]:
    model = a.model_dir or None
    mixed = sum(a.mixed_prompts)
    llm = LLM(
        model,
        load_format="dummy" if model else "auto",
        quantization=a.quantization,
        max_batch_size=a.batch + max(a.mixed_prompts, default=0),
        max_num_tokens=max(
            8192, a.batch * a.prompt_len, a.batch + max(a.mixed_prompts, default=0) * a.mixed_len
        ),
        cuda_graph_config={"piecewise": not a.no_piecewise},
        log=lambda s: None,
    )
    eng = llm.engine
    vocab = eng.model_config.vocab_size
    rng = random.Random(0)
    # the decode batch lasts through the mixed steps too (each takes a prefill step, then a few decodes)
    lasting = a.steps + 2 + ((a.mixed_reps + 2 * a.breakdown) * len(a.mixed_prompts) * 4 if mixed else 0)
    for i in range(a.batch):
        eng.add_request(
            f"s{i}",
            [rng.randrange(3, vocab) for _ in range(a.prompt_len)],
            SamplingParams(max_tokens=lasting, temperature=0.0, ignore_eos=True),
        )
    while any(r.num_computed < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    eng.step()  # the first decode step (graphs warm, the async pipeline full)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    phases = time_phases(eng, PHASES)
    step_ms: list[float] = []
    tokens = 0
    with SyncRecorder() as rec:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            t = time.perf_counter()
            tokens += sum(len(d.token_ids) for d in eng.step())
            step_ms.append((time.perf_counter() - t) * 1e3)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    for name in ("schedule", "update"):
        eng.scheduler.__dict__.pop(name, None)  # the phase timers off again
    eng.runner.__dict__.pop("execute", None)
    eng.__dict__.pop("_read", None)
    with SyncRecorder() as mixed_rec:
        mixed_rows = mixed_steps(eng, a, rng) if mixed else []
    breakdown = [mixed_breakdown(eng, a, rng, k) for k in a.mixed_prompts] if a.breakdown else []
    while eng.has_unfinished():
        eng.step()
    steps = max(1, tokens // a.batch)
    replay = graph_replay_ms(getattr(eng.runner, "graphs", None), a.batch)
    return dict(
        batch=a.batch,
        decode_steps=steps,
        step_ms=wall / steps * 1e3,
        graph_replay_ms=replay,
        step_call_ms=dict(mean=sum(step_ms) / len(step_ms), max=max(step_ms), n=len(step_ms)),
        phases_ms={k: dict(mean=sum(v) / len(v), max=max(v), calls=len(v)) for k, v in phases.items() if v},
        syncs=[
            dict(site=s, count=c, per_step=c / steps, message=rec.messages[s])
            for s, c in rec.sites.most_common()
        ],
        mixed=mixed_rows,
        mixed_breakdown=breakdown,
        mixed_syncs=[
            dict(site=s, count=c, message=mixed_rec.messages[s]) for s, c in mixed_rec.sites.most_common()
        ],
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model-dir", default=str(CFG_DIR), help="config-only directory ('' = the built-in tiny model)"
    )
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--prompt-len", type=int, default=30)
    ap.add_argument(
        "--quantization", default=None, help="fp8: FP8 weights, as `hyserve serve --quantization`"
    )
    ap.add_argument(
        "--mixed-prompts",
        type=int,
        nargs="*",
        default=[],
        help="then time steps that prefill this many new prompts beside the decode batch, per count",
    )
    ap.add_argument("--mixed-len", type=int, default=1000, help="tokens of each new prompt of a mixed step")
    ap.add_argument("--mixed-reps", type=int, default=3)
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="per mixed-prompt count, the host time of each layer kind and the device time per kernel",
    )
    ap.add_argument(
        "--no-piecewise", action="store_true", help="prefill and mixed steps eagerly (no piecewise graphs)"
    )
    ap.add_argument("--top-kernels", type=int, default=15)
    ap.add_argument("--git-sha", default="")
    ap.add_argument("--result-dir", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args(argv)
    if a.batch < 1 or a.steps < 1 or a.prompt_len < 1:
        ap.error("--batch, --steps and --prompt-len must be >= 1")
    head = stamp(
        "step_sync",
        invocation() if argv is None else ["python", "-m", "benchmarks.bench_step_sync", *argv],
        a.git_sha or None,
    )
    result = {
        **head,
        "model": Path(a.model_dir).name if a.model_dir else "hyserve-tiny",
        "piecewise": not a.no_piecewise,
        **run(a),
    }
    print(
        f"batch {result['batch']}: {result['step_ms']:.2f} ms per decode step over {result['decode_steps']} "
        f"steps; graph replay alone {result['graph_replay_ms'] or float('nan'):.2f} ms"
    )
    for k, v in result["phases_ms"].items():
        print(f"  {k:<22} {v['mean']:8.3f} ms mean  {v['max']:8.3f} max  ({v['calls']} calls)")
    for m in result["mixed"]:
        print(
            f"  step with {m['prompts']} new prompt(s) of {m['prompt_len']} tokens: {m['step_ms']:.2f} ms, "
            f"runner.execute {m['execute_ms']:.2f} ms (mean of {m['reps']}); their round "
            f"{m['round_ms']:.1f} ms over {m['round_steps']:.1f} steps"
        )
    for b in result["mixed_breakdown"]:
        dev = f"{b['device_ms']:.2f} ms on the device ({b['launches']} kernels)" if "device_ms" in b else ""
        print(f"  breakdown, {b['prompts']} new prompt(s): step host {b['step_host_ms']:.2f} ms; {dev}")
        for n, v in b["layer_host_ms"].items():
            print(f"      host {n:<28} {v['ms']:8.2f} ms  ({v['calls']} calls)")
        for kr in b.get("kernels", []):
            print(f"      dev  {kr['ms']:8.3f} ms  x{kr['count']:<4} {kr['name'][:90]}")
    for s in result["mixed_syncs"]:
        print(f"    mixed steps: {s['count']} x {s['site']}\n        {s['message']}")
    print(f"  synchronising calls: {sum(s['count'] for s in result['syncs'])}")
    for s in result["syncs"]:
        print(f"    {s['per_step']:6.2f} per step  {s['site']}\n        {s['message']}")
    out = Path(a.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "_eager-mixed" if a.no_piecewise else ""
    path = out / f"step_sync_{dt.date.today().isoformat()}_{head['git_sha']}{tag}.json"
    path.write_text(json.dumps(sanitize(result), indent=2) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
