#!/usr/bin/env bash
# One device call for a restructure: the GPU tests of this tree, then the model benchmark of the previous
# code (a copy under .ab/old, made with `git archive OLD hyserve benchmarks/bench_model.py
# benchmarks/roofline.py benchmarks/configs | tar -x -C .ab/old`, carried) and of this tree, in turn.
# usage: scripts/gpu_ab_check.sh NEW_SHA OLD_SHA [rounds] [extra pytest files ...]
set -uo pipefail
new=${1:?new sha}; old=${2:?old sha}; rounds=${3:-1}; shift 3 || shift $#
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
mkdir -p benchmarks/results
log=benchmarks/results/gpu_ab_${new}.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  echo "== GPU tests at $new"
  # the engine-level files whole (their CPU tests run on the GPU here), the kernel files' GPU tests
  PYTHONPATH=$PWD timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --show-capture=no \
    tests/test_gpu_model.py tests/test_gpu_warmup.py tests/test_async_scheduling.py tests/test_cuda_graphs.py \
    tests/test_engine_invariance.py 2>&1 | tail -30
  PYTHONPATH=$PWD timeout 240 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --show-capture=no -m gpu \
    tests/test_fp8_kv.py tests/test_triton_kernels.py "$@" 2>&1 | tail -30
  pairs=()
  for r in $(seq 1 "$rounds"); do
    echo "== model benchmark, round $r: $old (previous code)"
    (cd .ab/old && PYTHONPATH=$PWD python3 benchmarks/bench_model.py --skip-transformers --git-sha "${old}_r$r" 2>&1 \
       | grep -v "warm-up \[" | tail -14)
    echo "== model benchmark, round $r: $new (this tree)"
    PYTHONPATH=$PWD python3 benchmarks/bench_model.py --skip-transformers --git-sha "${new}_r$r" 2>&1 \
       | grep -v "warm-up \[" | tail -14
    pairs+=(.ab/old/benchmarks/results/model_*_"${old}_r$r".json benchmarks/results/model_*_"${new}_r$r".json)
  done
  echo "== previous code (A) against this tree (B), same call"
  python3 scripts/ab_compare.py "${pairs[@]}"
  cp .ab/old/benchmarks/results/model_*_"${old}"_r*.json benchmarks/results/ 2>/dev/null
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then cp benchmarks/results/model_*_"${new}"_r*.json benchmarks/results/model_*_"${old}"_r*.json "$log" "$OUT"/ 2>/dev/null; fi
exit 0
