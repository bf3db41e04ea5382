#!/usr/bin/env bash
# GPU tests, then the kernel and model benchmarks (benchmarks/README.md). Results land in benchmarks/results/.
# usage: scripts/gpu_check.sh [GIT_SHA [tests|kernels|model|soak ...]]   (GIT_SHA names results; for a tree
#   without .git)
#   OUT_DIR (optional): a folder that gets the log as it is written and a copy of every result file this run
#   writes, after each part, so a run cut short still leaves what ran there.
#   tests: one pytest per GPU test file, each under GPU_TEST_TIMEOUT s (default 240); GPU_TESTS="a b" runs only
#   tests/a.py and tests/b.py (paths under tests/ without .py: GPU_TESTS="unit/test_fp8_kv gpu/test_gpu_model").
#   soak_start, soak_wait (not default parts): the soak started with setsid, so one longer than a command can
#   run (SOAK_DURATION 600 with the 30B-A3B: start it, then call soak_wait at once, in the next command,
#   while the machine is held; each waits at most SOAK_WAIT_S and copies the log and JSON when it is done).
#   soak (not a default part): benchmarks/bench_soak.py, `hyserve serve` of the Nano 9B v2 architecture under
#   512 streams with disconnects, slow readers and injected faults for SOAK_DURATION s (default 600; SOAK_ARGS
#   adds options); from two minutes on it also holds the server's RSS flat and the inter-token p99 steady.
#   Nano 30B-A3B in FP8 at 1,024 streams inside one 10-minute call: SOAK_DURATION=420 SOAK_ARGS="--model
#   benchmarks/configs/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 --concurrency 1024 --serve-args '--quantization fp8
#   --max-seq-len 8192'". It needs the server wheels in .whl/ (benchmarks/README.md, "GPU check scripts").
#   moe_model (not a default part): tests/unit/test_bench_model_moe.py, then benchmarks/bench_model.py on
#   Nemotron 3 Nano 30B-A3B (with --time-init) and on Super cut to what fits; together they may take over
#   10 minutes, so moe_nano and moe_super run one model each.
#   attn, structured (not default parts): the paged-attention kernel records alone; bench_structured.py
#   (xgrammar in .whl/).
#   attn_sweep (not a default part): paged-attention launch alternatives, bf16 and fp8 KV decode, prefill.
#   moe_decode (not a default part): benchmarks/bench_moe_decode.py --write, the batch-1 MoE decode
#   GEMVs chained as a step runs them, settings swept; the fastest becomes the 1-token config entry. Put it
#   before moe_nano in the same run to measure the model with it.
#   ncu_moe (not a default part): Nsight Compute's view (speed of light, memory, scheduler, warp
#   stalls, occupancy) of the batch-1 MoE up and down GEMVs at the tuned 1-token settings; put it after
#   moe_decode to profile what that wrote. Text in ncu_moe_<sha>.txt. MOE_DECODE_ARGS="--shape super --fp8" tunes
#   Nemotron 3 Super's e4m3 experts instead (their own ",w=fp8" entry; MOE_DECODE_TIMEOUT, default 300 s).
#   linear_sweep (not a default part): bench_kernels.py --only linear_sweep, the one-row GEMV launch settings at
#   the Nano 9B v2 and 30B-A3B projections (and the FP8 GEMV's).
#   fp8_gemv_super (not a default part): the FP8 GEMV settings at Nemotron 3 Super's dense projections,
#   each shape's winner (3% or more faster than today's setting) written into linear_configs/<GPU>.json; copy
#   that file back into the tree. Put it before moe_super / gpu_fp8_check.sh super to measure the model with it.
#   longprompt (not a default part): benchmarks/bench_long_prompt.py, a 131k and a 1.04M-token
#   prompt through LLM per KV dtype (LONG_PROMPT_ARGS adds options; ~3-4 min a dtype).
#   stepsync (not a default part): benchmarks/bench_step_sync.py, the host syncs and phases of a large
#   decode step, then the host time of steps that prefill 1 or 8 new 1,000-token prompts beside it (they
#   run eagerly; what batch waiting saves), each with its host time per layer kind and device time per kernel
#   (STEP_SYNC_ARGS; default Nano 30B-A3B FP8 at batch 256).
#   spec (not a default part): benchmarks/bench_spec_decode.py, verify-step cost against a plain decode step
#   for k = 1, 2, 3, 5, 7 at batch 1 and 16 (Nano 30B-A3B, FP8 weights), batch 64 with speculation allowed vs off,
#   and n-gram drafting on the needle checkpoint at batch 1 (SPEC_ARGS adds options).
#   fairness (not a default part): benchmarks/bench_fairness.py, a 1M-token prompt beside 8 streams
#   and a short chat request every second through `hyserve serve`, per max_step_ms in FAIRNESS_STEP_MS
#   (default off,150; about 4-5 min each); FAIRNESS_ARGS adds options. Server wheels in .whl/ as for soak.
set -uo pipefail
sha=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
shift || true
parts=" ${*:-tests kernels model} "
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# benchmark peers carried as wheels (mamba_ssm's Triton kernels + einops; see benchmarks/README.md), when present
if ls .whl/mamba_ssm-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .whl/mamba_ssm-*.whl .whl/einops-*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
fi
mkdir -p benchmarks/results
# the server wheels in .whl/ (xgrammar included), when present: the structured-output GPU tests, fairness and
# soak need them
if ls .whl/fastapi-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
  export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# the log goes to OUT_DIR as it is written and results are copied after every part, so a run cut short
# still leaves what ran
log=${OUT_DIR:-benchmarks/results}/gpu_check.log
mkdir -p "$(dirname "$log")"
# the GPU test files of the tests part (GPU_TESTS names a subset; GPU_TEST_TIMEOUT bounds each, default 240 s)
gpu_tests="unit/test_triton_kernels unit/test_triton_ssd unit/test_fused_linear unit/test_fp8_kv
  unit/test_ssm_rounding gpu/test_gpu_model gpu/test_gpu_warmup engine/test_async_scheduling gpu/test_gpu_float32
  unit/test_moe_kernels unit/test_token_bitmask_kernel"
# shellcheck source=scripts/device_out.sh
. scripts/device_out.sh
out_mark
save() { out_save; }
soak_wait() {  # $1 = seconds at most: wait for the detached soak (soak_start), then show and copy what it wrote
  local pid end
  if ! pid=$(cat /tmp/soak_detached.pid 2>/dev/null); then
    echo "no detached soak on this machine (soak_start runs one)"
    return 0
  fi
  end=$((SECONDS + $1))
  while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
  if kill -0 "$pid" 2>/dev/null; then
    echo "the soak is still running (pid $pid): run the soak_wait part next, before the machine goes back"
    tail -5 /tmp/soak_detached.log
  else
    echo "the soak finished"
    tail -60 /tmp/soak_detached.log
  fi
  out_save /tmp/soak_detached.log /tmp/soak_detached.json
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
  if [[ $parts == *" tests "* ]]; then
    # one pytest per file, each under its own timeout, so a slow or hung file names itself and the rest still run;
    # the whole report goes to the log (a tail cut the failures' first lines off)
    echo "== GPU tests"
    for t in ${GPU_TESTS:-$gpu_tests}; do
      echo "-- tests/$t.py"
      timeout "${GPU_TEST_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --show-capture=no \
        --durations=3 "tests/$t.py" 2>&1
      echo "   exit ${PIPESTATUS[0]} after ${SECONDS}s of the run"
    done
  fi
  [[ $parts == *" kernels "* ]] && echo "== kernel benchmarks" && python3 -m benchmarks.bench_kernels --git-sha "$sha" 2>&1 | tail -60
  [[ $parts == *" kernels "* ]] && echo "== prefill attention against SDPA over rounds" \
    && python3 -m benchmarks.bench_kernels --only attn_rounds --rounds 5 --git-sha "$sha" \
       --out "benchmarks/results/attn_rounds_$sha.json" 2>&1 | tail -8
  # attn (not a default part): the paged attention records alone (bf16 and fp8 KV decode, prefill)
  [[ $parts == *" attn "* ]] && echo "== paged attention kernel records (bf16 and fp8 KV)" \
    && timeout 300 python3 -m benchmarks.bench_kernels --only attn --git-sha "$sha" \
       --out "benchmarks/results/kernels_attn_$sha.json" 2>&1 | tail -20 && save
  [[ $parts == *" attn_sweep "* ]] && echo "== paged attention launch alternatives (bf16 and fp8 KV)" \
    && timeout 420 python3 -m benchmarks.bench_kernels --only attn_sweep --git-sha "$sha" \
       --out "benchmarks/results/attn_sweep_$sha.json" 2>&1 | grep -v "^ok " | tail -60 && save
  # shellcheck disable=SC2086  # LONG_PROMPT_ARGS / STEP_SYNC_ARGS are lists of options
  [[ $parts == *" longprompt "* ]] && echo "== long prompts per KV dtype" \
    && timeout "${LONG_PROMPT_TIMEOUT:-590}" python3 -m benchmarks.bench_long_prompt --git-sha "$sha" \
       ${LONG_PROMPT_ARGS:-} 2>&1 | grep -v "warm-up \[" | tail -40 && save
  # shellcheck disable=SC2086
  [[ $parts == *" stepsync "* ]] && echo "== host syncs of a large decode step" \
    && timeout 300 python3 -m benchmarks.bench_step_sync --git-sha "$sha" ${STEP_SYNC_ARGS:---quantization fp8 --mixed-prompts 1 8 --breakdown} 2>&1 | tail -40 && save
  # moe_decode (not a default part): the batch-1 MoE decode chain in a graph, its settings swept and
  # the fastest written as the 1-token entry of hyserve/kernels/moe_configs/<GPU>.json (copied to OUT_DIR)
  # shellcheck disable=SC2086  # MOE_DECODE_ARGS is a list of options
  [[ $parts == *" moe_decode "* ]] && echo "== MoE decode chain at batch 1: settings swept, fastest written" \
    && timeout "${MOE_DECODE_TIMEOUT:-300}" python3 -m benchmarks.bench_moe_decode --write --git-sha "$sha" \
      ${MOE_DECODE_ARGS:-} 2>&1 | tail -60 \
    && { [ -z "${OUT_DIR:-}" ] || cp hyserve/kernels/moe_configs/*.json "$OUT_DIR"/; } && save
  if [[ $parts == *" ncu_moe "* ]]; then
    echo "== Nsight Compute: the batch-1 MoE up and down GEMVs at the tuned 1-token settings"
    # shellcheck disable=SC2086  # MOE_DECODE_ARGS is a list of options
    timeout 240 ncu --clock-control none -k regex:"_(up|down)_gemv" --launch-skip 8 --launch-count 2 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
      --section Occupancy python3 -m benchmarks.bench_moe_decode --profile-once ${MOE_DECODE_ARGS:-} \
      > "benchmarks/results/ncu_moe_$sha.txt" 2>&1
    echo "   exit $? (ncu_moe_$sha.txt)"; grep -E "Throughput|Busy|Issue|Occupancy|Stall|Duration" \
      "benchmarks/results/ncu_moe_$sha.txt" | head -40; save
  fi
  [[ $parts == *" linear_sweep "* ]] && echo "== one-row GEMV launch settings (bf16 and FP8)" \
    && timeout 330 python3 -m benchmarks.bench_kernels --only linear_sweep --git-sha "$sha" \
       --out "benchmarks/results/linear_sweep_$sha.json" 2>&1 | grep -E "us vs|GEMV|cuBLAS" | grep -v "^ok " \
       | tail -120 && save
  [[ $parts == *" fp8_gemv_super "* ]] && echo "== FP8 GEMV settings at Nemotron 3 Super's dense projections" \
    && timeout 300 python3 -m benchmarks.bench_kernels --only fp8_gemv_super_sweep --write-linear-configs \
       --git-sha "$sha" --out "benchmarks/results/fp8_gemv_super_$sha.json" 2>&1 | grep -E "GEMV|linear configs" \
       | grep -v "^ok " | tail -160 && save && out_save hyserve/kernels/linear_configs/*.json
  # structured (not a default part): JSON-schema-constrained decode against unconstrained, batch 1 / 64
  [[ $parts == *" spec "* ]] && echo "== speculative decoding: verify-step cost, end to end" \
    && timeout "${SPEC_TIMEOUT:-540}" python3 -m benchmarks.bench_spec_decode --git-sha "$sha" ${SPEC_ARGS:-} \
    2>&1 | grep -v "warm-up \[" | tail -40 && save
  [[ $parts == *" structured "* ]] && echo "== structured outputs: constrained / free decode (xgrammar in .whl)" \
    && timeout 300 python3 -m benchmarks.bench_structured --rounds 3 --git-sha "$sha" 2>&1 | tail -20 && save
  [[ $parts == *" model "* ]] && echo "== model benchmarks" && python3 -m benchmarks.bench_model --git-sha "$sha" 2>&1 | grep -v "warm-up \[" | tail -40
  if [[ $parts == *" fairness "* ]]; then
    echo "== fairness: a 1M-token prompt beside 8 streams and a short request every second"
    # the JSON is written after every setting; the budget and the timeout leave time to copy it to OUT_DIR
    # shellcheck disable=SC2086  # FAIRNESS_ARGS is a list of options
    timeout "${FAIRNESS_TIMEOUT:-560}" python3 -m benchmarks.bench_fairness --max-step-ms "${FAIRNESS_STEP_MS:-off,150}" \
      --time-budget-s "${FAIRNESS_BUDGET:-500}" --git-sha "$sha" ${FAIRNESS_ARGS:-} 2>&1 | tail -30
    save
  fi
  if [[ $parts == *" soak_start "* ]]; then
    # a soak longer than one command: started with setsid, so it runs on after this command returns, for as
    # long as the machine is held; `soak_wait` (the next command, before the machine goes
    # back) waits for it and copies what it wrote
    echo "== soak, detached: ${SOAK_DURATION:-600}s through hyserve serve"
    rm -f /tmp/soak_detached.*
    # shellcheck disable=SC2086  # SOAK_ARGS is a list of options
    setsid bash -c 'echo $$ > /tmp/soak_detached.pid; exec "$@"' soak python3 -m benchmarks.bench_soak \
      --git-sha "$sha" --duration "${SOAK_DURATION:-600}" --out /tmp/soak_detached.json ${SOAK_ARGS:-} \
      > /tmp/soak_detached.log 2>&1 < /dev/null &
    sleep 2
    soak_wait "${SOAK_WAIT_S:-540}"
  fi
  if [[ $parts == *" soak_wait "* ]]; then
    soak_wait "${SOAK_WAIT_S:-560}"
  fi
  if [[ $parts == *" soak "* ]]; then
    echo "== soak: ${SOAK_DURATION:-600}s through hyserve serve"
    # shellcheck disable=SC2086  # SOAK_ARGS is a list of options
    python3 -m benchmarks.bench_soak --git-sha "$sha" --duration "${SOAK_DURATION:-600}" ${SOAK_ARGS:-} 2>&1 | tail -60
    save
  fi
  if [[ $parts == *" moe_model "* || $parts == *" moe_nano "* || $parts == *" moe_super "* ]]; then
    echo "== MoE model benchmarks: roofline arithmetic (CPU) and device-drawn dummy init (GPU) tests"
    timeout 120 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/unit/test_bench_model_moe.py 2>&1 | tail -15
  fi
  if [[ $parts == *" moe_model "* || $parts == *" moe_nano "* ]]; then
    echo "== Nemotron 3 Nano 30B-A3B: batch 1, 8k prefill, batch-64/256 steps, dummy init timed"
    # shellcheck disable=SC2086  # MOE_NANO_ARGS is a list of options (an H100 holds no batch of 256: --batches 64)
    timeout "${MOE_NANO_TIMEOUT:-400}" python3 -m benchmarks.bench_model \
      --model-dir benchmarks/configs/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 --time-init --git-sha "$sha" ${MOE_NANO_ARGS:-} 2>&1 \
      | grep -v "warm-up \[" | tail -40
    save
  fi
  if [[ $parts == *" moe_model "* || $parts == *" moe_super "* ]]; then
    echo "== Nemotron 3 Super cut to the repetitions of its pattern that fit (0.75 of the GPU): batch 1, 64"
    timeout "${MOE_SUPER_TIMEOUT:-360}" python3 -m benchmarks.bench_model \
      --model-dir benchmarks/configs/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 --git-sha "$sha" 2>&1 \
      | grep -v "warm-up \[" | tail -40
    save
  fi
  save
} 2>&1 | tee "$log"
exit 0
