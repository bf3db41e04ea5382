"""Where the host's time goes in `LLMEngine.step()` at a large decode batch: cProfile over decode-only steps,
beside the decode graph's replay alone. When step() takes longer than the replay, the host is the bottleneck
(async scheduling overlaps host and device only while the host's share is the smaller).

    python3 -m benchmarks.profile_step_host --batch 1024 --quantization fp8 --ssm-dtype float16

Prints the step and replay times and the top functions by own time and by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from pathlib import Path

import torch

from hyserve import LLM, SamplingParams
from hyserve.bench.profiling import graph_replay_ms

ROOT = Path(__file__).resolve().parents[1]
CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=str(CFG_DIR))
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--ssm-dtype", default="float32")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    llm = LLM(
        a.model_dir,
        load_format="dummy",
        quantization=a.quantization,
        max_batch_size=a.batch,
        max_seq_len=a.prompt_len + a.steps + 64,
        kv_cache_config={"mamba_ssm_cache_dtype": a.ssm_dtype},
        log=lambda s: None,
    )
    eng = llm.engine
    rng = random.Random(0)
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(max_tokens=a.steps + 8, temperature=0, ignore_eos=True)
    for i in range(a.batch):
        eng.add_request(f"r{i}", [rng.randrange(100, vocab) for _ in range(a.prompt_len)], sp)
    while any(r.num_computed < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    times = []
    prof.enable()
    for _ in range(a.steps):
        t = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    prof.disable()
    replay_ms = graph_replay_ms(eng.runner.graphs, a.batch) or float("nan")
    times.sort()
    print(
        f"batch {a.batch}: step() median {times[len(times) // 2]:.2f} ms (profiled), "
        f"graph replay {replay_ms:.2f} ms"
    )
    for key in ("tottime", "cumulative"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        print(f"---- by {key}\n" + "\n".join(s.getvalue().splitlines()[6:]))
    llm.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
