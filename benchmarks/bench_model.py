"""Model-level benchmark on one GPU, random weights, bf16: Nemotron Nano 9B v2 by default, or the
Nemotron 3 MoE architectures with `--model-dir`.

Measures hyserve's engine (batch-1 decode tok/s, 8k-token prefill tok/s, decode step times at batch 64, and
at 256 for Nano 30B-A3B) and, for the 9B, transformers' own NemotronH (torch path) as the peer reference.
Each number is quoted against its roofline at the ceilings measured first in the same run
(benchmarks/roofline.py: bytes read, bf16 matmul) and at the H200's published peaks. MoE models are quoted
over their active parameters: the routed top-k experts of a token (for a batch, the experts it touches
under uniform routing) + the shared expert + everything else. A model too big for the device is cut to a
prefix of its own layer pattern (whole repetitions, `--weight-budget-gib`) or to `--num-layers N`.
Writes benchmarks/results/model_<date>_<sha>.json (9B) or model-<model>_<date>_<sha>.json, and a table.

    python3 -m benchmarks.bench_model [--skip-transformers]                      # Nano 9B v2
    python3 -m benchmarks.bench_model --model-dir benchmarks/configs/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16
    python3 -m benchmarks.bench_model --model-dir benchmarks/configs/NVIDIA-Nemotron-3-Super-120B-A12B-BF16
    python3 -m benchmarks.bench_model --quantization fp8 --skip-transformers   # bf16, then FP8, same process
    python3 -m benchmarks.bench_model --quantization fp8 --fp8-only \
        --model-dir benchmarks/configs/NVIDIA-Nemotron-3-Super-120B-A12B-BF16     # the whole Super, FP8 alone

With `--quantization fp8` the engine figures run twice in one process, bf16 first and then with FP8 weights
(quantised per output channel from the same dummy weights), the FP8 records named "[fp8] ..." and quoted
against the FP8 weight-read roofline (1 byte a projection weight + its scales; embeddings, lm_head and
the rest in bf16; for a MoE model the routed experts, still bf16 in hyserve, at 2 bytes), each followed by
its ratio to the bf16 figure of the same run, and the greedy tokens of both compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from benchmarks import invocation  # noqa: E402
from hyserve import LLM, SamplingParams  # noqa: E402
from hyserve.bench.profiling import device_kernel_times  # noqa: E402
from hyserve.bench.report import git_sha, records_markdown  # noqa: E402
from hyserve.engine.gc_tuning import freeze_startup_heap  # noqa: E402
from hyserve.model.nemotron_h.checkpoint import weight_bytes as hyserve_weight_bytes  # noqa: E402
from hyserve.model.nemotron_h.config import HybridModelConfig  # noqa: E402
from hyserve.model.quant_config import QuantConfig  # noqa: E402

CFG_DIR = ROOT / "benchmarks" / "configs" / "NVIDIA-Nemotron-Nano-9B-v2"
from benchmarks.roofline import (  # noqa: E402
    GIB,
    Ceilings,
    active_decode_step_ms,
    active_decode_tokens_per_s,
    active_prefill_tokens_per_s,
    batch_experts,
    ceiling_fields,
    decode_step_ms,
    measure_ceilings,
    num_moe_layers,
    prefill_tokens_per_s,
    weight_bytes,
)

# decode-step batches: (batch, prompt tokens); batch x prompt fits one 8192-token prefill step, so every
# timed step decodes all rows, 32 steps at contexts prompt..prompt+32 (mean prompt + 16)
STEP_SHAPES = {64: 120, 256: 30}


def rec(name, value, unit, reference, reference_value):
    """A record against a peer or a same-run comparison (no ceiling involved)."""
    ratio = None
    if reference_value:
        ratio = value / reference_value
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "reference": reference,
        "reference_value": reference_value,
        "ratio": ratio,
        "ceiling": None,
    }


def roof_rec(name, value, unit, reference, kind, ceilings, reference_at, *, time_like=False):
    """A record against a roofline: at the measured ceiling of its limit and at the published peak."""
    return {
        "name": name,
        "value": value,
        "unit": unit,
        "reference": reference,
        **ceiling_fields(kind, ceilings, value, reference_at, time_like=time_like),
    }


def sync() -> None:
    torch.cuda.synchronize()


def replay_ms(replay, reps: int) -> float:
    """Wall time of one graph replay in ms: one warm replay, then the mean of `reps` back to back."""
    replay()
    sync()
    t = time.perf_counter()
    for _ in range(reps):
        replay()
    sync()
    return (time.perf_counter() - t) / reps * 1e3


def replay_breakdown(
    replay, step_ms: float, steps: int = 20, top: int = 25, batch: int = 1, form: str = ""
) -> str:
    """Device time per decode step by kernel name inside a batch's graph replay (torch profiler),
    the kernels that take the most first: where the replay's gap to the roofline goes. Under PDL a kernel's
    time includes its blocks' wait for the one before, so the form with ordinary launches (`form` names it)
    is the one whose per-kernel times add up to the replay."""
    try:
        rows = [(us / steps, n / steps, name) for name, (us, n) in device_kernel_times(replay, steps).items()]
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"batch-{batch} replay kernel breakdown unavailable: {type(e).__name__}: {e}"
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    lines = [
        f"batch-{batch} graph replay{form}, device time per step by kernel ({total:.0f} us in kernels of "
        f"{step_ms * 1e3:.0f} us per replay; {sum(r[1] for r in rows):.0f} launches per step):"
    ]
    lines += [f"  {us:8.1f} us  {n:5.0f}x  {name[:110]}" for us, n, name in rows[:top]]
    text = "\n".join(lines)
    print(text)
    return text


# ---- which model, which figures ------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ModelPlan:
    """The model one run measures and the figures it runs."""

    model_dir: Path  # a directory with config.json (a temporary one for a cut model)
    raw: dict  # its config.json
    label: str  # the JSON's "model" field
    slug: str  # in the result file name; "" for the 9B default (model_<date>_<sha>.json)
    prefill_8k: bool
    batches: tuple[int, ...]  # decode-step batch sizes (keys of STEP_SHAPES)
    prefix_cache: bool  # the 8k prefill again with the prefix cache on (9B only)
    transformers: bool  # transformers' NemotronH as the peer (9B only)
    max_num_tokens: int = 8192
    device: str = "auto"  # the engine's device ("cpu": the CPU test of this script)
    cache_fraction: float = 0.5  # kv_cache_config.free_gpu_memory_fraction of the engine runs


def repetition_cuts(pattern: str) -> list[int]:
    """Layer counts at which `pattern` (hybrid_override_pattern) can be cut keeping whole repetitions: right
    after each attention layer and the layer that follows it ('...M*E' | 'MEM...')."""
    return [i + 2 for i, c in enumerate(pattern[:-1]) if c == "*"]


def cut_config(raw: dict, num_layers: int) -> dict:
    """config.json of the model cut to its first `num_layers` layers (the pattern's prefix)."""
    pattern = raw.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        raise ValueError("--num-layers needs a config.json with a hybrid_override_pattern string")
    if not 1 <= num_layers <= len(pattern):
        raise ValueError(
            f"--num-layers must be in [1, {len(pattern)}] (the model's layers), got {num_layers}"
        )
    return {**raw, "hybrid_override_pattern": pattern[:num_layers], "num_hidden_layers": num_layers}


FP8 = QuantConfig(method="online", scheme="channel")  # --quantization fp8: per-channel, quantised at load


def model_weight_bytes(raw: dict, fp8: bool = False) -> int:
    """bf16 bytes of every parameter (embedding included): what the model holds on the device; with fp8
    the FP8 model's (e4m3 projections and experts + float32 scales, the rest bf16)."""
    cfg = HybridModelConfig.from_dict(raw)
    return hyserve_weight_bytes(cfg.with_quant(FP8), torch.bfloat16) if fp8 else cfg.num_parameters() * 2


def fit_layers(raw: dict, budget_bytes: float, fp8: bool = False) -> int:
    """The most layers, cut at a repetition boundary (or the whole model), whose bf16 (or FP8) weights fit
    `budget_bytes`."""
    pattern = raw["hybrid_override_pattern"]
    if model_weight_bytes(raw, fp8) <= budget_bytes:
        return len(pattern)
    fits = [
        n for n in repetition_cuts(pattern) if model_weight_bytes(cut_config(raw, n), fp8) <= budget_bytes
    ]
    if not fits:
        first = repetition_cuts(pattern)[:1]
        need = model_weight_bytes(cut_config(raw, first[0]), fp8) / GIB if first else float("nan")
        raise ValueError(
            f"not even one repetition of the layer pattern fits {budget_bytes / GIB:.1f} GiB of "
            f"weights (the first needs {need:.1f} GiB); raise --weight-budget-gib or pass --num-layers"
        )
    return max(fits)


def make_plan(
    model_dir: Path,
    *,
    num_layers: int | None,
    weight_budget: float | None,
    work: Path,
    skip_transformers: bool,
    fp8_only: bool = False,
) -> ModelPlan:
    """The plan for `model_dir`: the 9B's figures as before; a MoE model's over its active parameters, cut to
    `num_layers` or to the repetitions that fit `weight_budget` bytes of bf16 weights (None: no cut)."""
    raw = json.loads((model_dir / "config.json").read_text())
    dense = num_moe_layers(HybridModelConfig.from_dict(raw)) == 0
    if model_dir.resolve() == CFG_DIR.resolve() and num_layers is None:
        return ModelPlan(
            model_dir=model_dir,
            raw=raw,
            label="NVIDIA-Nemotron-Nano-9B-v2 architecture, random weights, bf16",
            slug="",
            prefill_8k=True,
            batches=(64,),
            prefix_cache=True,
            transformers=not skip_transformers,
        )
    total = len(raw.get("hybrid_override_pattern") or raw.get("layers_block_type") or [])
    n = (
        num_layers
        if num_layers is not None
        else (fit_layers(raw, weight_budget, fp8_only) if weight_budget else total)
    )
    weights = "FP8 (per-channel, quantised at load)" if fp8_only else "bf16"
    label = f"{model_dir.name} architecture, random weights, {weights}"
    slug = model_dir.name
    if n != total:
        raw = cut_config(raw, n)
        label = (
            f"{model_dir.name} architecture cut to its first {n} of {total} layers "
            f"({raw['hybrid_override_pattern']}), random weights, {'FP8' if fp8_only else 'bf16'}"
        )
        slug = f"{model_dir.name}-{n}L"
        model_dir = work / slug
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(raw, indent=2))
    # the full Nano 30B-A3B runs every figure; a cut model runs decode at batch 1 and 64
    whole = n == total
    return ModelPlan(
        model_dir=model_dir,
        raw=raw,
        label=label,
        slug=slug,
        prefill_8k=whole,
        batches=(64, 256) if whole and not dense else (64,),
        prefix_cache=False,
        transformers=False,
    )


def bench_hyserve(
    plan: ModelPlan,
    cfg: HybridModelConfig,
    ceilings: Ceilings,
    records: list,
    notes: list,
    *,
    time_init: bool = False,
    quantization: str | None = None,
    launch_ab: bool = True,
) -> None:
    """The engine figures of one weight format. launch_ab: also the PDL, GEMV-settings and packed-QKV A/Bs
    of the decode step (graphs captured fresh; off for the whole Nemotron 3 Super in FP8, to keep that run
    short)."""
    moe = num_moe_layers(cfg) > 0
    t0 = time.perf_counter()
    llm = LLM(
        str(plan.model_dir),
        device=plan.device,
        load_format="dummy",
        max_seq_len=16384,
        max_batch_size=max(plan.batches),
        quantization=quantization,
        max_num_tokens=plan.max_num_tokens,
        kv_cache_config={"enable_block_reuse": False, "free_gpu_memory_fraction": plan.cache_fraction},
        log=print,
    )
    startup_s = time.perf_counter() - t0
    # as `hyserve serve` does before it opens its port: without this, a full garbage collection walks the
    # ~300k start-up objects and stalls the engine loop ~200 ms (benchmarks/bench_host.py), which in a
    # 33-step batch-256 run adds ~6 ms to the mean step (the 23.7-30 ms spread of earlier runs)
    frozen = freeze_startup_heap()
    notes.append(
        f"{frozen} start-up objects moved out of the garbage collector's reach after start-up, as "
        "`hyserve serve` does"
    )
    eng = llm.engine
    g = torch.Generator().manual_seed(0)

    if moe:
        b1_ref = "active-weight bandwidth roofline (top-k routed + shared experts + the rest)"

        def decode_roof(peaks) -> float:  # batch-1 tok/s when the active weights stream at the read ceiling
            return active_decode_tokens_per_s(cfg, peaks.read_bw)

        records.append(rec("hyserve start-up with dummy weights, to ready (s)", startup_s, "s", "none", None))
    else:
        b1_ref = "weight-bandwidth roofline"

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
    records.append(
        roof_rec("hyserve decode batch 1 (tok/s)", tps, "tok/s", b1_ref, "read", ceilings, decode_roof)
    )
    if graphs is not None:
        b1 = graphs.size_for(1)
        assert b1 is not None

        def replay() -> None:
            graphs.replay(b1)

        gpu_ms = replay_ms(replay, 50)
        records.append(
            roof_rec(
                "hyserve decode batch 1, graph replay alone (tok/s)",
                1e3 / gpu_ms,
                "tok/s",
                b1_ref,
                "read",
                ceilings,
                decode_roof,
            )
        )
        notes.append(replay_breakdown(replay, gpu_ms))
        with eng.runner.eager_decode():
            eager = decode_b1("e")
        records.append(
            rec(
                "hyserve decode batch 1, CUDA graphs vs eager (x)",
                tps / eager,
                "x",
                "eager decode, same run",
                1.0,
            )
        )
    if plan.prefill_8k:
        eng.add_request("p8k", ids(8192), SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        sync()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        sync()
        ptps = 8192 / (time.perf_counter() - t)
        if moe:
            records.append(
                roof_rec(
                    "hyserve prefill 8k tokens (tok/s)",
                    ptps,
                    "tok/s",
                    "matmul roofline over active parameters (top-k routed + shared experts)",
                    "matmul",
                    ceilings,
                    lambda peaks: active_prefill_tokens_per_s(cfg, peaks.matmul_flops),
                )
            )
        else:
            records.append(
                roof_rec(
                    "hyserve prefill 8k tokens (tok/s)",
                    ptps,
                    "tok/s",
                    "matmul roofline",
                    "matmul",
                    ceilings,
                    lambda peaks: prefill_tokens_per_s(cfg, peaks.matmul_flops),
                )
            )

    steps = bench_steps(eng, plan, cfg, ceilings, records, notes, ids)
    if plan.device != "cpu" and launch_ab:
        pdl_ab(eng, plan.batches, cfg.vocab_size, records, notes)
        gemv_settings_ab(eng, cfg.vocab_size, records, notes)
        packed_qkv_ab(eng, cfg.vocab_size, records, notes)
    if time_init:
        init_times(eng.runner.model, cfg, records)
    from hyserve.kernels import ops
    from hyserve.kernels.ssd import ssd_chunked_ref

    ssd = "the plain-torch reference" if ops.ssd.cuda in (None, ssd_chunked_ref) else "Triton"
    moe_note = ""
    if moe:
        moe_note = (
            f"; MoE: {num_moe_layers(cfg)} layers of {cfg.n_routed_experts} experts, top-"
            f"{cfg.num_experts_per_tok}, latent {cfg.moe_latent_size}; rooflines assume uniform routing "
            "(random weights route near-uniformly)"
        )
    notes.append(
        "hyserve on CUDA: Triton kernels for decode conv/SSM updates, varlen conv, RMSNorms, KV write and "
        f"paged attention; SSD prefill scan: {ssd}; decode CUDA graphs: "
        f"{'on' if graphs is not None else 'off'} ({steps} batch-{plan.batches[-1]} steps timed){moe_note}"
    )


def bench_steps(
    eng, plan: ModelPlan, cfg: HybridModelConfig, ceilings: Ceilings, records: list, notes: list, ids
) -> int:
    """The decode-step figures at each of the plan's batch sizes (graphs, then eager where graphs run), and a
    note per batch of how the step() calls' times spread; returns the number of steps the last one timed."""

    def step_bn(batch: int, tag: str) -> tuple[float, int]:
        prompt = STEP_SHAPES[batch]
        for i in range(batch):
            eng.add_request(
                f"b{batch}_{i}{tag}" if batch != 64 else f"b{i}{tag}",
                ids(prompt),
                SamplingParams(max_tokens=33, temperature=0, ignore_eos=True),
            )
        while eng.requests and any(r.num_computed < r.num_prompt_tokens for r in eng.requests.values()):
            eng.step()
        sync()
        t = time.perf_counter()
        tokens = 0
        calls: list[float] = []  # host time of each step() call: where a slow step sits in the run
        while eng.has_unfinished():
            c = time.perf_counter()
            tokens += sum(len(d.token_ids) for d in eng.step())
            calls.append((time.perf_counter() - c) * 1e3)
        sync()
        # decode steps = tokens / batch (every request decodes every step): with async scheduling the
        # last step() call only reads the in-flight step's tokens, so calls overcount steps
        steps = tokens // batch
        if tag == "g" and calls:
            mid = sorted(calls)[len(calls) // 2]
            slow = sorted(range(len(calls)), key=lambda i: -calls[i])[:3]
            notes.append(
                f"decode steps at batch {batch}: {len(calls)} step() calls, median {mid:.2f} ms, the "
                f"slowest "
                + ", ".join(f"#{i} {calls[i]:.2f} ms" for i in slow)
                + f" (first {calls[0]:.2f} ms, last {calls[-1]:.2f} ms)"
            )
            print(notes[-1])
        return (time.perf_counter() - t) / max(steps, 1) * 1e3, steps

    steps = 0
    graphs = eng.runner.graphs
    moe = num_moe_layers(cfg) > 0
    for batch in plan.batches:
        step_ms, steps = step_bn(batch, "g")
        context = STEP_SHAPES[batch] + 16  # mean K/V per sequence over the 32 timed steps
        # ratio = roofline / measured (1.0 at the roofline)
        if moe:
            experts = batch_experts(cfg, batch)
            records.append(
                roof_rec(
                    f"hyserve decode step batch {batch} (ms)",
                    step_ms,
                    "ms",
                    f"roofline step time (the ~{experts:.1f} of {cfg.n_routed_experts} experts per layer a "
                    f"batch of {batch} touches under uniform routing + other weights + state + KV)",
                    "read",
                    ceilings,
                    lambda peaks, b=batch, c=context: active_decode_step_ms(cfg, b, c, peaks.read_bw),
                    time_like=True,
                )
            )
        else:
            records.append(
                roof_rec(
                    f"hyserve decode step batch {batch} (ms)",
                    step_ms,
                    "ms",
                    "roofline step time (weights+state+KV)",
                    "read",
                    ceilings,
                    lambda peaks, b=batch, c=context: decode_step_ms(cfg, b, c, peaks.read_bw),
                    time_like=True,
                )
            )
        if graphs is not None and moe and batch == plan.batches[-1]:
            # the largest batch's graph replayed alone and its kernels: the device's share of the step
            size = graphs.size_for(batch)
            if size is not None:

                def replay_b(n: int = size) -> None:
                    graphs.replay(n)

                gpu_ms = replay_ms(replay_b, 20)
                records.append(
                    rec(
                        f"hyserve decode step batch {batch}, graph replay alone (ms)",
                        gpu_ms,
                        "ms",
                        "the engine's step, same run",
                        step_ms,
                    )
                )
                replay_breakdown(replay_b, gpu_ms, steps=5, top=15, batch=batch)
        if graphs is not None:
            with eng.runner.eager_decode():
                eager_ms, _ = step_bn(batch, "e")
            records.append(
                rec(
                    f"hyserve decode step batch {batch}, CUDA graphs speed-up vs eager (x)",
                    eager_ms / step_ms,
                    "x",
                    "eager decode, same run",
                    1.0,
                )
            )
        if moe:
            records[-1 if graphs is None else -2]["note"] = f"{steps} decode steps of {batch} rows timed"
    return steps


def graph_ab(eng, batch: int, vocab_size: int, set_form, labels: tuple = (False, True)) -> dict | None:
    """Decode graphs of two launch forms of the same step, same run: for each label, `set_form(label)` then
    one graph captured fresh over the engine's model and cache (padding rows with a context of one token,
    the same random token ids in both, so a MoE batch routes to many experts); the engine's form is put back
    after. Replayed in turn (a, b, a, b) and timed. Returns {label: (min replay ms, the graph)}, or None
    where the engine has no graph of this batch."""
    from hyserve.engine.runner.cuda_graphs import DecodeGraphs

    g = eng.runner.graphs
    if g is None or g.size_for(batch) is None:
        return None
    forms = {}
    try:
        for label in labels:
            set_form(label)  # compiles that form's variants once (a benchmark, not serving)
            forms[label] = DecodeGraphs(
                g.model,
                g.cache,
                g.device,
                sizes=[batch],
                max_blocks_per_seq=g._tables.shape[1],
                pad_slot=g.pad_slot,
            )
    finally:
        set_form(None)
    ids = torch.randint(3, vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
    for form in forms.values():
        form._ids[:batch].copy_(ids)  # the graph's static input buffer
    times: dict = {label: [] for label in labels}
    for _ in range(2):
        for label in labels:
            times[label].append(replay_ms(lambda f=forms[label], n=batch: f.replay(n), 50))
    return {label: (min(times[label]), forms[label]) for label in labels}


def pdl_ab(eng, batches: tuple[int, ...], vocab_size: int, records: list, notes: list) -> None:
    """Decode graphs with the kernels as programmatic dependent launches (the engine's default on sm_90+)
    against ordinary launches, same run (`graph_ab`), for batch 1 and the largest batch; the ratio is
    ordinary / PDL (> 1: PDL is faster)."""
    from hyserve.kernels import launch_util

    if eng.runner.graphs is None or torch.cuda.get_device_capability()[0] < 9:
        notes.append("PDL A/B not run (no decode graphs or a GPU before sm_90)")
        return
    was = launch_util.pdl_enabled()
    for batch in sorted({1, max(batches)}):
        got = graph_ab(
            eng, batch, vocab_size, lambda flag: launch_util.set_pdl(was if flag is None else flag)
        )
        if got is None:
            continue
        on, off = got[True][0], got[False][0]
        records.append(
            rec(
                f"hyserve decode batch {batch} graph replay, ordinary launches / PDL (x)",
                off / on,
                "x",
                "the same step with ordinary launches, same run",
                1.0,
            )
        )
        notes.append(
            f"PDL A/B batch {batch}: graph replay {on * 1e3:.0f} us with PDL, {off * 1e3:.0f} us without "
            f"(min of 2 rounds of 50 replays each)"
        )
        print(notes[-1])
        if batch == 1:  # without PDL the kernels' device times do not include waiting for the one before
            notes.append(
                replay_breakdown(
                    lambda f=got[False][1]: f.replay(1), off, top=30, form=" with ordinary launches (no PDL)"
                )
            )
        del got
        gc.collect()
        torch.cuda.empty_cache()


def batch1_ab(
    eng,
    vocab_size: int,
    records: list,
    notes: list,
    set_form,
    labels: tuple,
    what: str,
    reference: str,
    describe,
) -> None:
    """One batch-1 launch-form A/B (`graph_ab`) as a record, ratio = first label's time / second's (> 1: the
    second is faster), and a note `describe(us of the first, us of the second)`."""
    got = graph_ab(eng, 1, vocab_size, set_form, labels)
    if got is None:
        return
    a, b = got[labels[0]][0], got[labels[1]][0]
    records.append(rec(f"hyserve decode batch 1 graph replay, {what} (x)", a / b, "x", reference, 1.0))
    notes.append(describe(a * 1e3, b * 1e3))
    print(notes[-1])
    del got
    gc.collect()
    torch.cuda.empty_cache()


def packed_qkv_ab(eng, vocab_size: int, records: list, notes: list) -> None:
    """Attention's q, k and v projected as three calls against one over the packed weight
    (`Attention.pack_qkv`, the engine's form where the weights allow it)."""
    from hyserve.model.attention import Attention

    layers = [m for m in eng.runner.model.modules() if isinstance(m, Attention) and m.packed_qkv is not None]
    if not layers:
        notes.append("packed QKV A/B not run (no packed attention layer)")
        return

    def set_form(form):
        for m in layers:
            m.use_packed_qkv = form != "three"

    batch1_ab(
        eng,
        vocab_size,
        records,
        notes,
        set_form,
        ("three", "packed"),
        "QKV as three projections / packed",
        "three projections, same run",
        lambda three, packed: (
            f"packed QKV A/B batch 1: graph replay {packed:.0f} us with q, k and v in one "
            f"projection, {three:.0f} us with three ({len(layers)} attention layers)"
        ),
    )


def _gemv_settings_before_fdb35a5(w_scale: int, k: int, n: int, device: str = "") -> dict[str, int]:
    """The one-row GEMV settings before fdb35a5+ (by row length alone), for `gemv_settings_ab`."""
    import hyserve.kernels.triton_fused_linear as tfl

    if w_scale == 0:
        return tfl._GPU_SHORT_K[0] if k < 4096 else tfl._GPU[0]
    if w_scale == 1:
        return tfl._GPU_FP8_SHORT_K if k <= 8192 else dict(BLOCK_N=4, BLOCK_K=1024, num_warps=4, num_stages=3)
    return (
        tfl._GPU_FP8_BLOCK_SHORT_K if k <= 8192 else tfl._GPU_FP8_BLOCK
    )  # unchanged (not gpu_settings: this
    # function stands in for it during the A/B)


def gemv_settings_ab(eng, vocab_size: int, records: list, notes: list) -> None:
    """The one-row GEMVs at the earlier settings (by row length alone) against the engine's (by row length
    and output width)."""
    import hyserve.kernels.triton_fused_linear as tfl

    now = tfl.gpu_settings
    batch1_ab(
        eng,
        vocab_size,
        records,
        notes,
        lambda f: setattr(tfl, "gpu_settings", _gemv_settings_before_fdb35a5 if f == "before" else now),
        ("before", "now"),
        "GEMV settings by row length / by output width",
        "the settings by row length alone, same run",
        lambda before, after: (
            f"GEMV settings A/B batch 1: graph replay {after:.0f} us at the engine's settings "
            f"(by output width), {before:.0f} us at the earlier ones (by row length alone)"
        ),
    )


def init_times(model: torch.nn.Module, cfg: HybridModelConfig, records: list) -> None:
    """Dummy-weight init of the loaded model again, timed: drawn on the host and copied (the engine's
    `dummy_init: host`) and drawn on the device (`init_random_weights(..., on_device=True)`, its default)."""
    from hyserve.model.random_init import init_random_weights

    n = sum(p.numel() for p in model.parameters())
    for on_device in (False, True):
        sync()
        t = time.perf_counter()
        init_random_weights(model, cfg, seed=0, on_device=on_device)
        sync()
        s = time.perf_counter() - t
        where = "device" if on_device else "host (dummy_init: host)"
        records.append(rec(f"dummy-weight init, drawn on the {where} (s)", s, "s", "none", None))
        records[-1]["note"] = f"{n / 1e9:.2f}B parameters, {n / s / 1e9:.2f}G parameters/s"


def bench_prefill_with_prefix_cache(cfg: HybridModelConfig, records: list) -> None:
    """The 8k prefill again with the prefix cache on (the server's default): Mamba snapshots every 256
    tokens and at the end, so the scan also keeps its per-chunk states. Quoted against the same prefill
    without the prefix cache, measured earlier in this run."""
    llm = LLM(
        str(CFG_DIR),
        load_format="dummy",
        max_seq_len=16384,
        max_batch_size=64,
        max_num_tokens=8192,
        kv_cache_config={"enable_block_reuse": True, "free_gpu_memory_fraction": 0.5},
    )
    eng = llm.engine
    g = torch.Generator().manual_seed(1)
    times = []
    for i in range(3):  # distinct prompts: no prefix hit
        eng.add_request(
            f"pc{i}",
            [1] + torch.randint(3, cfg.vocab_size, (8191,), generator=g).tolist(),
            SamplingParams(max_tokens=1, temperature=0, ignore_eos=True),
        )
        sync()
        t = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        sync()
        times.append(time.perf_counter() - t)
    plain = next(r["value"] for r in records if r["name"] == "hyserve prefill 8k tokens (tok/s)")
    records.append(
        rec(
            "hyserve prefill 8k tokens, prefix cache on (tok/s)",
            8192 / min(times[1:]),
            "tok/s",
            "the same prefill without the prefix cache, same run",
            plain,
        )
    )
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
        records.append(
            rec(
                "transformers prefill 2k tokens (tok/s)",
                2048 / (time.perf_counter() - t),
                "tok/s",
                "transformers on the H200 earlier (benchmarks/README.md)",
                1070.0,
            )
        )
        out = model.generate(ids[:, :128], max_new_tokens=4, do_sample=False)
        sync()
        t = time.perf_counter()
        out = model.generate(ids[:, :128], max_new_tokens=33, min_new_tokens=33, do_sample=False)
        sync()
        n = out.shape[1] - 128
        records.append(
            rec(
                "transformers decode batch 1 (tok/s)",
                (n - 1) / (time.perf_counter() - t),
                "tok/s",
                "transformers on the H200 earlier (benchmarks/README.md)",
                27.0,
            )
        )
    del model
    torch.cuda.empty_cache()


def fp8_ratios(bf16: list, fp8: list) -> list:
    """Each FP8 record beside its bf16 twin of the same run: (fp8 / bf16) for rates, (bf16 / fp8) for
    times, so above 1 means FP8 is faster."""
    by_name = {r["name"]: r for r in bf16}
    out = []
    for r in fp8:
        twin = by_name.get(r["name"])
        out.append({**r, "name": f"[fp8] {r['name']}"})
        if twin is None or not twin["value"] or not r["value"] or r["unit"] == "x":
            continue
        faster = twin["value"] / r["value"] if r["unit"] in ("ms", "s") else r["value"] / twin["value"]
        out.append(
            rec(
                f"[fp8] {r['name']}: FP8 vs bf16, same run (x)", faster, "x", "the bf16 figure, same run", 1.0
            )
        )
    return out


def greedy_agreement(plan: ModelPlan, cfg: HybridModelConfig, records: list) -> None:
    """Greedy tokens of the bf16 and FP8 engines (the same dummy weights, FP8 quantised from them) on the same
    prompts: the fraction of positions that agree up to and including the first difference of each prompt
    (after it the two continue from different tokens), and the mean |logprob| difference of the tokens
    both chose there."""
    g = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, cfg.vocab_size, (255,), generator=g).tolist() for _ in range(8)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)
    outs = {}
    for quant in (None, "fp8"):
        llm = LLM(
            str(plan.model_dir),
            device=plan.device,
            load_format="dummy",
            max_seq_len=4096,
            max_batch_size=8,
            quantization=quant,
            warmup="off",
            kv_cache_config={"free_gpu_memory_fraction": 0.5},
        )
        outs[quant] = llm.generate(prompts, params)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    agree = total = 0
    lp_diff: list[float] = []
    for a, b in zip(outs[None], outs["fp8"], strict=True):
        ta, tb = a.token_ids, b.token_ids
        n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        agree += n
        total += min(n + 1, len(ta))
        la, lb = a.logprobs or [], b.logprobs or []
        lp_diff += [abs(la[i].logprob - lb[i].logprob) for i in range(min(n, len(la), len(lb)))]
    records.append(
        rec(
            "[fp8] greedy tokens agreeing with bf16 until the first difference (fraction)",
            agree / total,
            "fraction",
            "bf16, same weights",
            1.0,
        )
    )
    if lp_diff:
        records.append(
            rec(
                "[fp8] mean |logprob(fp8) - logprob(bf16)| of the agreed tokens",
                sum(lp_diff) / len(lp_diff),
                "nats",
                "none",
                None,
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=CFG_DIR,
        help="a directory with config.json (default: the Nano 9B v2 architecture)",
    )
    ap.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="cut the model to the first N layers of its pattern (default: whole, or what fits)",
    )
    ap.add_argument(
        "--weight-budget-gib",
        type=float,
        default=None,
        help="cut the model to the whole repetitions of its layer pattern whose bf16 weights fit "
        "(default: 0.75 of the device's memory)",
    )
    ap.add_argument(
        "--time-init",
        action="store_true",
        help="also time dummy-weight init of the loaded model, drawn on the host and on the device",
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--quantization",
        choices=("fp8",),
        default=None,
        help="also run the engine figures with FP8 weights after bf16, ratios in the same run",
    )
    ap.add_argument(
        "--fp8-only",
        action="store_true",
        help="with --quantization fp8: FP8 alone (a model whose bf16 weights do not fit, e.g. the whole "
        "Nemotron 3 Super on one H200), cut to what fits in FP8",
    )
    ap.add_argument(
        "--batches",
        default=None,
        help=f"decode-step batch sizes to time, comma-separated, of {sorted(STEP_SHAPES)} (default: the "
        "plan's; a GPU whose memory cannot hold the Mamba state of 256 rows of a MoE model: 64)",
    )
    ap.add_argument("--git-sha", default="", help="commit of the tree, when it is run without .git")
    args = ap.parse_args()
    if args.weight_budget_gib is not None and args.num_layers is not None:
        ap.error("--num-layers and --weight-budget-gib choose the cut two ways: pass one")
    if args.fp8_only and args.quantization != "fp8":
        ap.error("--fp8-only needs --quantization fp8")
    budget = args.weight_budget_gib * GIB if args.weight_budget_gib is not None else None
    if budget is None and args.num_layers is None:
        budget = 0.75 * torch.cuda.get_device_properties(0).total_memory
    work = Path(tempfile.mkdtemp(prefix="bench_model_"))
    plan = make_plan(
        args.model_dir,
        num_layers=args.num_layers,
        weight_budget=budget,
        work=work,
        skip_transformers=args.skip_transformers or args.fp8_only,
        fp8_only=args.fp8_only,
    )
    if args.fp8_only:
        # FP8 alone: no transformers after it, so the pools may take 0.9 of what the weights leave; batch 64
        plan = dataclasses.replace(
            plan,
            prefix_cache=False,
            slug=(plan.slug or "NVIDIA-Nemotron-Nano-9B-v2") + "-fp8",
            label=plan.label.replace("bf16", "FP8 (per-channel, quantised at load)"),
            batches=(64,),
            cache_fraction=0.9,
        )
    if args.batches is not None:
        batches = tuple(int(b) for b in args.batches.split(","))
        if not batches or any(b not in STEP_SHAPES for b in batches):
            ap.error(f"--batches takes sizes of {sorted(STEP_SHAPES)}, got {args.batches!r}")
        plan = dataclasses.replace(plan, batches=batches)
    raw = plan.raw
    cfg = HybridModelConfig.from_dict(raw)
    records: list = []
    notes: list = []
    ceilings = measure_ceilings("cuda")  # before any engine holds memory
    print(ceilings.summary())
    notes.append(ceilings.summary())
    if plan.slug:
        notes.append(f"{plan.label}: {cfg.describe()}, {num_moe_layers(cfg)} MoE layers")
    if args.fp8_only:  # the rooflines count FP8 bytes; no bf16 twin
        fp8_only: list = []
        bench_hyserve(
            plan, cfg.with_quant(FP8), ceilings, fp8_only, notes, quantization="fp8", launch_ab=False
        )
        records += [{**r, "name": f"[fp8] {r['name']}"} for r in fp8_only]
    else:
        bench_hyserve(plan, cfg, ceilings, records, notes, time_init=args.time_init)
    gc.collect()  # the engine's memory goes back before the next engine or transformers loads its copy
    torch.cuda.empty_cache()
    if args.quantization == "fp8" and not args.fp8_only:
        fp8_cfg = cfg.with_quant(FP8)  # the rooflines count FP8 bytes
        fp8: list = []
        bench_hyserve(plan, fp8_cfg, ceilings, fp8, notes, quantization="fp8")
        gc.collect()
        torch.cuda.empty_cache()
        records += fp8_ratios(records, fp8)
        greedy_agreement(plan, cfg, records)
    if plan.prefix_cache:
        bench_prefill_with_prefix_cache(cfg, records)
    if plan.transformers:
        bench_transformers(raw, records)
    sha = git_sha(args.git_sha)  # a copied tree may hold a stale .git: an explicit sha wins
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "git_sha": sha,
        "gpu": torch.cuda.get_device_name(),
        "command": " ".join(invocation(sys.executable)),
        "model": plan.label,
        "notes": notes,
        "ceilings": ceilings.to_dict(),
        "records": records,
    }
    if plan.slug:
        result["config"] = raw
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    stamp = dt.date.today().isoformat()
    stamp = f"{stamp}_{result['git_sha']}"
    base = f"model-{plan.slug}_{stamp}" if plan.slug else f"model_{stamp}"
    if args.quantization == "fp8" and not args.fp8_only:
        base += "_bf16-vs-fp8"
    (out / f"{base}.json").write_text(json.dumps(result, indent=2))
    table = records_markdown(records)
    title = f"model benchmark {stamp}" if not plan.slug else f"model benchmark {plan.slug} {stamp}"
    (out / f"{base}.md").write_text(f"# {title} ({result['gpu']}, {sha})\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
