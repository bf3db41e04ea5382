#!/usr/bin/env bash
# The MoE kernels: the GPU tests of tests/unit/test_moe_kernels.py and the tiny MoE models on CUDA, then
# benchmarks/bench_moe.py (with --tune: autotune first and write hyserve/kernels/moe_configs/<GPU>.json).
# Results land in benchmarks/results/.
#   OUT_DIR (optional): a folder that gets a copy of the new results, the config file and the log after each part.
# usage: scripts/gpu_moe_check.sh [GIT_SHA [tests|ktests] [tune|tune-gemv|tune-fp8|bench] [step] ...]
#        (default: tests tune; ktests: the kernel tests alone (the SiLU-gated experts' too), without the tiny
#        models through the engine; tune-gemv: re-tune the decode buckets 1-8 only, merged into the config
#        file, then benchmark; tune-fp8: the Nano 30B-A3B FP8 experts' own entries for the grouped-GEMM
#        buckets (FP8_SIZES, default 256-8192; the plain and SWAP tile forms, and from 64-row tiles the w8a8
#        form A8: e4m3 activations), merged under ",w=fp8", then
#        timed against the 16-bit entries from graphs; step: benchmarks/bench_batch_step.py, a batch-1,024
#        decode step of Nano 30B-A3B with FP8 weights and float32 state (float16 on a card under 100 GB;
#        STEP_STATES overrides), per kernel group)
set -uo pipefail
sha=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
shift || true
parts=" ${*:-tests tune} "
cd "$(dirname "$0")/.."
source scripts/device_out.sh
out_mark
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p benchmarks/results
log=benchmarks/results/moe_gpu_check_$sha.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  if [[ $parts == *" tests "* ]]; then
    echo "== GPU tests"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=10 tests/unit/test_moe_kernels.py \
      "tests/gpu/test_gpu_model.py::test_tiny_cuda_matches_cpu[moe]" "tests/gpu/test_gpu_model.py::test_tiny_cuda_matches_cpu[latent-moe]" 2>&1 | tail -60
  elif [[ $parts == *" ktests "* ]]; then
    echo "== GPU kernel tests"
    timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --durations=5 tests/unit/test_moe_kernels.py \
      tests/unit/test_moe_silu_triton.py 2>&1 | tail -40
  fi
  out_save "$log"
  if [[ $parts == *" tune "* ]]; then
    echo "== tune + benchmark"
    timeout 420 python3 -m benchmarks.bench_moe --tune --git-sha "$sha" --out "benchmarks/results/moe_$sha.json" 2>&1
  elif [[ $parts == *" tune-gemv "* ]]; then
    echo "== tune the decode buckets + benchmark"
    timeout 420 python3 -m benchmarks.bench_moe --tune-sizes 1,2,4,8 --git-sha "$sha" --out "benchmarks/results/moe_$sha.json" 2>&1
  elif [[ $parts == *" tune-fp8 "* ]]; then
    echo "== tune the FP8 experts' grouped GEMMs + time them against the 16-bit entries"
    sizes=${FP8_SIZES:-256,512,1024,2048,4096,8192}
    timeout 420 python3 -m benchmarks.bench_moe --tune --fp8 --no-super --tune-sizes "$sizes" --sizes "$sizes" \
      --git-sha "$sha" --out "benchmarks/results/moe_$sha.json" 2>&1 | grep -v "^      skip"
    out_save "$log" hyserve/kernels/moe_configs/*.json
  elif [[ $parts == *" bench "* ]]; then
    echo "== benchmark"
    timeout 300 python3 -m benchmarks.bench_moe --git-sha "$sha" --out "benchmarks/results/moe_$sha.json" 2>&1
  fi
  if [[ $parts == *" step "* ]]; then
    # 1,024 float32 states of Nano 30B-A3B take 47 GiB: on an 80 GB card the step runs with float16 state
    mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
    states=${STEP_STATES:-$([ "${mem:-0}" -lt 100000 ] && echo float16 || echo float32)}
    echo "== a batch-1,024 decode step, per kernel group ($states state)"
    timeout 240 python3 -m benchmarks.bench_batch_step --weights fp8 --states "$states" --batches 1024 --git-sha "$sha" 2>&1 \
      | tail -30
  fi
} 2>&1 | tee "$log"
out_save "$log" hyserve/kernels/moe_configs/*.json
exit 0
