#!/usr/bin/env bash
# FP8 weights: the GPU tests of the FP8 kernels and model, then the FP8 GEMM benchmark and the Nano 9B v2
# model benchmark (bf16 then FP8 in one process, ratios in the same run). Results land in benchmarks/results/.
#   OUT_DIR (optional): a folder that gets the log as it is written and a copy of the result files this run
#   writes, after each part (scripts/device_out.sh).
# usage: scripts/gpu_fp8_check.sh [GIT_SHA [tests|kernels|model|super ...]]   (default: tests kernels model)
#   super (not a default part): Nemotron 3 Super 120B-A12B, every layer, FP8 alone on one GPU (an H200)
#   (bench_model.py --quantization fp8 --fp8-only): start-up, capacity report, batch-1 and batch-64 decode.
set -uo pipefail
sha=${1:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
shift || true
parts=" ${*:-tests kernels model} "
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p benchmarks/results
# shellcheck source=scripts/device_out.sh
. scripts/device_out.sh
out_mark
log=${OUT_DIR:-benchmarks/results}/gpu_fp8_check.log  # written to OUT_DIR as it goes
mkdir -p "$(dirname "$log")"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  if [[ $parts == *" tests "* ]]; then
    echo "== FP8 GPU tests (kernels at the Nano 9B v2 shapes, the FP8 model on the kernels vs the reference ops)"
    timeout 540 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/unit/test_fp8_linear.py \
      tests/engine/test_fp8_weights.py 2>&1 | tail -30
    timeout 300 python3 -m pytest -q -p no:cacheprovider -rfEs --tb=short tests/unit/test_moe_kernels.py -k fp8 2>&1 | tail -8
    echo "== an FP8 (ModelOpt-layout) checkpoint loaded from disk on the GPU, greedy, beside its 16-bit twin"
    for v in dense latent-moe; do
      python3 -m hyserve.cli make-tiny /tmp/tiny-$v --variant $v >/dev/null
      python3 -m hyserve.cli make-tiny /tmp/tiny-$v-fp8 --variant $v --fp8 >/dev/null
      for d in /tmp/tiny-$v /tmp/tiny-$v-fp8; do
        printf '%s: ' "$d"
        python3 -m hyserve.cli generate $d --device cuda --dtype bfloat16 --prompt-ids 1,5,6,7,8,9,10 --max-tokens 12 \
          --ignore-eos --json 2>/dev/null | python3 -c 'import json, sys; print(json.loads(sys.stdin.readlines()[-1])["token_ids"])'
      done
    done
  fi
  out_save
  [[ $parts == *" kernels "* ]] && echo "== FP8 GEMM vs bf16 cuBLAS (M = 1, 64, 8192)" \
    && timeout 540 python3 -m benchmarks.bench_kernels --only fp8_linear --git-sha "$sha" \
       --out "benchmarks/results/kernels_fp8_$sha.json" 2>&1 | tail -45
  out_save
  [[ $parts == *" model "* ]] && echo "== Nano 9B v2: bf16, then FP8, in one process" \
    && timeout 560 python3 -m benchmarks.bench_model --quantization fp8 --skip-transformers --git-sha "$sha" 2>&1 \
       | grep -v "warm-up \[" | tail -45
  out_save
  [[ $parts == *" super "* ]] && echo "== Nemotron 3 Super 120B-A12B, every layer, FP8 on one GPU" \
    && timeout 560 python3 -m benchmarks.bench_model --quantization fp8 --fp8-only --weight-budget-gib 125 \
       --model-dir benchmarks/configs/NVIDIA-Nemotron-3-Super-120B-A12B-BF16 --git-sha "$sha" 2>&1 \
       | grep -v "warm-up \[" | tail -45
  out_save
} 2>&1 | tee "$log"
exit 0
