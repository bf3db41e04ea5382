#!/usr/bin/env bash
# A/B of a restructure: the model benchmark of the previous code (a copy under .ab/old, made with
# `git archive OLD hyserve benchmarks/bench_model.py benchmarks/roofline.py benchmarks/configs |
# tar -x -C .ab/old`) and of this tree in turn, then the GPU tests given (default: the engine-level ones).
# usage: scripts/gpu_ab_check.sh NEW_SHA OLD_SHA [rounds] [pytest args ...]
#   OUT_DIR (optional): a folder that gets the log as it is written and each round's result files, so a run
#   cut short still leaves what ran there (default: the log in benchmarks/results/).
set -uo pipefail
new=${1:?new sha}; old=${2:?old sha}; rounds=${3:-1}; shift 3 || shift $#
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT_DIR:-benchmarks/results}
mkdir -p benchmarks/results "$out"
log=$out/gpu_ab_${new}.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  pairs=()
  for r in $(seq 1 "$rounds"); do
    echo "== model benchmark, round $r: $old (previous code)"
    (cd .ab/old && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.bench_model --skip-transformers \
       --git-sha "${old}_r$r" 2>&1 | grep -v "warm-up \[" | tail -12)
    echo "== model benchmark, round $r: $new (this tree)"
    PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.bench_model --skip-transformers --git-sha "${new}_r$r" 2>&1 \
       | grep -v "warm-up \[" | tail -12
    pairs+=(.ab/old/benchmarks/results/model_*_"${old}_r$r".json benchmarks/results/model_*_"${new}_r$r".json)
    cp "${pairs[@]}" "$out"/ 2>/dev/null
  done
  echo "== previous code (A) against this tree (B), same run"
  python3 scripts/ab_compare.py "${pairs[@]}"
  echo "== GPU tests at $new"
  if [ $# -eq 0 ]; then
    set -- tests/gpu/test_gpu_warmup.py::test_no_jit_after_warmup_tiny tests/gpu/test_gpu_float32.py \
      tests/engine/test_async_scheduling.py tests/gpu/test_gpu_model.py::test_tiny_cuda_matches_cpu \
      tests/gpu/test_gpu_model.py::test_tiny_async_scheduling_on_cuda_graphs_matches_sync
  fi
  PYTHONPATH=$PWD timeout 200 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short --show-capture=no "$@" 2>&1 | tail -40
} 2>&1 | tee "$log"
exit 0
