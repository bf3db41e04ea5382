"""Model-level benchmark on one GPU: Nemotron Nano 9B v2 architecture, random weights, bf16.

Measures hyserve's engine (batch-1 decode tok/s, 8k-token prefill tok/s, batch-64 decode step time)
and, in the same run, transformers' own NemotronH (torch path) as the peer reference. Each number is
quoted against its roofline at the ceilings measured first in the same run (benchmarks/roofline.py:
bytes read, bf16 matmul) and at the H200's published peaks. Writes benchmarks/results/model_<date>.json
and a markdown table.

    python3 benchmarks/bench_model.py [--skip-transformers]
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hyserve import LLM, SamplingParams  # noqa: E402
from hyserve.bench.profiling import device_kernel_times  # noqa: E402
from hyserve.bench.report import records_markdown  # noqa: E402
from hyserve.model.config import HybridModelConfig  # noqa: E402

CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"
from benchmarks.roofline import (  # noqa: E402
    Ceilings,
    ceiling_fields,
    decode_step_ms,
    measure_ceilings,
    prefill_tokens_per_s,
    weight_bytes,
)


def rec(name, value, unit, reference, reference_value):
    """A record against a peer or a same-run comparison (no ceiling involved)."""
    ratio = None
    if reference_value:
        ratio = value / reference_value
    return {"name": name, "value": value, "unit": unit, "reference": reference,
            "reference_value": reference_value, "ratio": ratio, "ceiling": None}


def roof_rec(name, value, unit, reference, kind, ceilings, reference_at, *, time_like=False):
    """A record against a roofline: at the measured ceiling of its limit and at the published peak."""
    return {"name": name, "value": value, "unit": unit, "reference": reference,
            **ceiling_fields(kind, ceilings, value, reference_at, time_like=time_like)}


def sync() -> None:
    torch.cuda.synchronize()


def replay_breakdown(replay, step_ms: float, steps: int = 20, top: int = 25) -> str:
    """Device time per decode step by kernel name inside the batch-1 graph replay (torch profiler),
    the kernels that take the most first: where the replay's gap to the weight roofline goes."""
    try:
        rows = [(us / steps, n / steps, name) for name, (us, n) in device_kernel_times(replay, steps).items()]
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"batch-1 replay kernel breakdown unavailable: {type(e).__name__}: {e}"
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [f"batch-1 graph replay, device time per step by kernel ({total:.0f} us in kernels of "
             f"{step_ms * 1e3:.0f} us per replay; {sum(r[1] for r in rows):.0f} launches per step):"]
    lines += [f"  {us:8.1f} us  {n:5.0f}x  {name[:110]}" for us, n, name in rows[:top]]
    text = "\n".join(lines)
    print(text)
    return text


def bench_hyserve(cfg: HybridModelConfig, ceilings: Ceilings, records: list, notes: list) -> None:
    llm = LLM(str(CFG_DIR), load_format="dummy", max_seq_len=16384, max_batch_size=64, max_num_tokens=8192,
              kv_cache_config={"enable_block_reuse": False, "free_gpu_memory_fraction": 0.5}, log=print)
    eng = llm.engine
    g = torch.Generator().manual_seed(0)

    def decode_roof(peaks) -> float:  # batch-1 tok/s when the weights stream at the bytes-read ceiling
        return peaks.read_bw / weight_bytes(cfg)

    def ids(n):
        return [1] + torch.randint(3, cfg.vocab_size, (n - 1,), generator=g).tolist()

    wr = eng.warmup_report
    if wr is not None:
        records.append(rec("hyserve warm-up before ready (s)", wr.seconds, "s", "none", None))
        notes.append(wr.summary())
    graphs = eng.runner.graphs

    def decode_b1(tag: str) -> float:
        eng.add_request(f"d1{tag}", ids(512), SamplingParams(max_tokens=65, temperature=0, ignore_eos=True))
        eng.step()  # prefill + first token
        sync()
        t = time.perf_counter()
        n = 0
        while eng.has_unfinished():
            n += sum(len(d.token_ids) for d in eng.step())
        sync()
        return n / (time.perf_counter() - t)

    tps = decode_b1("g")
    records.append(roof_rec("hyserve decode batch 1 (tok/s)", tps, "tok/s", "weight-bandwidth roofline", "read",
                            ceilings, decode_roof))
    if graphs is not None:
        b1 = graphs.size_for(1)
        assert b1 is not None

        def replay() -> None:
            graphs.replay(b1)

        replay()
        sync()
        t = time.perf_counter()
        for _ in range(50):
            replay()
        sync()
        gpu_ms = (time.perf_counter() - t) / 50 * 1e3
        records.append(roof_rec("hyserve decode batch 1, graph replay alone (tok/s)", 1e3 / gpu_ms, "tok/s",
                                "weight-bandwidth roofline", "read", ceilings, decode_roof))
        notes.append(replay_breakdown(replay, gpu_ms))
        with eng.runner.eager_decode():
            eager = decode_b1("e")
        records.append(rec("hyserve decode batch 1, CUDA graphs vs eager (x)", tps / eager, "x",
                            "eager decode, same run", 1.0))
    # 8k prefill
    eng.add_request("p8k", ids(8192), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    sync()
    t = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    sync()
    ptps = 8192 / (time.perf_counter() - t)
    records.append(roof_rec("hyserve prefill 8k tokens (tok/s)", ptps, "tok/s", "matmul roofline", "matmul", ceilings,
                            lambda peaks: prefill_tokens_per_s(cfg, peaks.matmul_flops)))
    # batch-64 decode step
    def step_b64(tag: str) -> tuple[float, int]:
        # 64 x 120 prompt tokens fit one prefill step (max_num_tokens 8192), so every timed step decodes
        # all 64 rows: 32 steps at contexts 120..152
        for i in range(64):
            eng.add_request(f"b{i}{tag}", ids(120), SamplingParams(max_tokens=33, temperature=0, ignore_eos=True))
        while eng.requests and any(r.num_computed < r.num_prompt_tokens for r in eng.requests.values()):
            eng.step()
        sync()
        t = time.perf_counter()
        tokens = 0
        while eng.has_unfinished():
            tokens += sum(len(d.token_ids) for d in eng.step())
        sync()
        # decode steps = tokens / 64 (every request decodes every step): with async scheduling the
        # last step() call only reads the in-flight step's tokens, so calls overcount steps
        steps = tokens // 64
        return (time.perf_counter() - t) / max(steps, 1) * 1e3, steps

    step_ms, steps = step_b64("g")
    # 120-token prompts, 32 decoded tokens: ~136 K/V per step; ratio = roofline / measured (1.0 at the roofline)
    records.append(roof_rec("hyserve decode step batch 64 (ms)", step_ms, "ms", "roofline step time (weights+state+KV)",
                            "read", ceilings, lambda peaks: decode_step_ms(cfg, 64, 136, peaks.read_bw), time_like=True))
    if graphs is not None:
        with eng.runner.eager_decode():
            eager_ms, _ = step_b64("e")
        records.append(rec("hyserve decode step batch 64, CUDA graphs speed-up vs eager (x)", eager_ms / step_ms,
                           "x", "eager decode, same run", 1.0))
    from hyserve.kernels import ops
    from hyserve.kernels.ssd import ssd_chunked_ref

    ssd = "the plain-torch reference" if ops.get("ssd", True) is ssd_chunked_ref else "Triton"
    notes.append(
        f"hyserve on CUDA: Triton kernels for decode conv/SSM updates, varlen conv, RMSNorms, KV write and paged "
        f"attention; SSD prefill scan: {ssd}; decode CUDA graphs: {'on' if graphs is not None else 'off'} "
        f"({steps} batch-64 steps timed)"
    )


def bench_prefill_with_prefix_cache(cfg: HybridModelConfig, records: list) -> None:
    """The 8k prefill again with the prefix cache on (the server's default): Mamba snapshots every 256
    tokens and at the end, so the scan also keeps its per-chunk states. Quoted against the same prefill
    without the prefix cache, measured earlier in this run."""
    llm = LLM(str(CFG_DIR), load_format="dummy", max_seq_len=16384, max_batch_size=64, max_num_tokens=8192,
              kv_cache_config={"enable_block_reuse": True, "free_gpu_memory_fraction": 0.5})
    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    times = []
    for i in range(3):  # distinct prompts: no prefix hit
        eng.add_request(f"pc{i}", [1] + torch.randint(3, cfg.vocab_size, (8191,), generator=g).tolist(),
                        SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        sync()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        sync()
        times.append(time.perf_counter() - t)
    plain = next(r["value"] for r in records if r["name"] == "hyserve prefill 8k tokens (tok/s)")
    records.append(rec("hyserve prefill 8k tokens, prefix cache on (tok/s)", 8192 / min(times[1:]), "tok/s",
                       "the same prefill without the prefix cache, same run", plain))
    snaps = eng.stats().get("snapshot_slots_used")
    records[-1]["note"] = f"snapshot slots used after 3 prompts: {snaps}"
    del eng, llm
    gc.collect()
    torch.cuda.empty_cache()


def bench_transformers(cfg_raw: dict, records: list) -> None:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    raw = dict(cfg_raw)
    raw.pop("auto_map", None)
    with torch.device("cuda"):
        model = NemotronHForCausalLM(NemotronHConfig(**raw)).to(torch.bfloat16).eval()
    ids = torch.randint(3, raw["vocab_size"], (1, 2048), device="cuda")
    with torch.no_grad():
        model(ids[:, :128])
        sync()
        t = time.perf_counter()
        model(ids)
        sync()
        records.append(rec("transformers prefill 2k tokens (tok/s)", 2048 / (time.perf_counter() - t), "tok/s",
                           "transformers on the H200 earlier (benchmarks/README.md)", 1070.0))
        out = model.generate(ids[:, :128], max_new_tokens=4, do_sample=False)
        sync()
        t = time.perf_counter()
        out = model.generate(ids[:, :128], max_new_tokens=33, min_new_tokens=33, do_sample=False)
        sync()
        n = out.shape[1] - 128
        records.append(rec("transformers decode batch 1 (tok/s)", (n - 1) / (time.perf_counter() - t), "tok/s",
                           "transformers on the H200 earlier (benchmarks/README.md)", 27.0))
    del model
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--git-sha", default="", help="commit of the tree, when it is run without .git")
    args = ap.parse_args()
    raw = json.loads((CFG_DIR / "config.json").read_text())
    cfg = HybridModelConfig.from_dict(raw)
    records: list = []
    notes: list = []
    ceilings = measure_ceilings("cuda")  # before any engine holds memory
    print(ceilings.summary())
    notes.append(ceilings.summary())
    bench_hyserve(cfg, ceilings, records, notes)
    gc.collect()  # the engine's memory goes back before the next engine or transformers loads its copy
    torch.cuda.empty_cache()
    bench_prefill_with_prefix_cache(cfg, records)
    if not args.skip_transformers:
        bench_transformers(raw, records)
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    sha = args.git_sha or sha  # the lent GPU's copy may hold a stale .git: an explicit sha wins
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_sha": sha or "unknown",
        "gpu": torch.cuda.get_device_name(),
        "command": " ".join([sys.executable, *sys.argv]),
        "model": "NVIDIA-Nemotron-Nano-9B-v2 architecture, random weights, bf16",
        "notes": notes,
        "ceilings": ceilings.to_dict(),
        "records": records,
    }
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    stamp = f"{stamp}_{result['git_sha']}"
    (out / f"model_{stamp}.json").write_text(json.dumps(result, indent=2))
    table = records_markdown(records)
    (out / f"model_{stamp}.md").write_text(f"# model benchmark {stamp} ({result['gpu']}, {sha})\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
