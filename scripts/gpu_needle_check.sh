#!/usr/bin/env bash
# The needle checkpoint on a GPU: train it, then ask it through `hyserve serve` with the long-prompt YAML's
# settings. Each part takes under 10 minutes; run `train` first on a machine, then the others on the same
# machine (the checkpoint lives in build/, which git ignores, so it stays there).
#
#   scripts/gpu_needle_check.sh GIT_SHA [train|grid|long|fp8|same]...
#
#   train  scripts/train_needle.py --device cuda (h200 preset, ~4 min of training + evaluation; STEPS=N fixes
#          the step count instead of --steps auto; TRAIN_ARGS adds train_needle.py options) into
#          build/needle-h200; its log and accuracy table go to benchmarks/results/needle_train_h200_<sha>.*
#   grid   report YAML (chunked prefill, block reuse, snapshots every 256, fp16 SSM state with stochastic
#          rounding): HIT / MISS at 1k 4k 16k 64k 256k tokens x depths 0 0.25 0.5 0.75 1
#   long   the same server: 1M tokens at depth 0.5 and 256k at depth 0.1 and 0.9
#   fp8    the grid again with kv_cache_config.dtype fp8 (the extra column)
#   same   the same prompts again on one server (prefix-cache hits) and on a server with max_num_tokens 2048
#          (other chunk sizes): the answers must not change (batch compositions:
#          tests/e2e/test_needle_checkpoint.py on the CPU, and tests/engine/test_engine_invariance.py)
#
#   OUT_DIR (optional): a folder that gets, after each part, the results and the checkpoint as one archive
#   each (needle_results_<sha>.tgz, needle_ckpt_<sha>.tgz).
# Needs the server wheels in .whl/ (benchmarks/README.md, "GPU check scripts"), as gpu_serve_check.sh.
set -uo pipefail
sha=${1:-unknown}
shift || true
parts=${*:-train grid}
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
R=benchmarks/results
CKPT=${CKPT:-build/needle-h200}
URL=http://127.0.0.1:8000
PID=
mkdir -p "$R" build

yaml() {  # $1 = kv dtype (auto or fp8); the long-prompt extra-llm-api-config.yml, minus TRT-only keys
  local f=/tmp/needle_$1.yml
  cat >"$f" <<EOF
enable_chunked_prefill: true
max_batch_size: 8
max_num_tokens: ${MAX_NUM_TOKENS:-16384}
cuda_graph_config:
  enable_padding: true
  max_batch_size: 8
kv_cache_config:
  dtype: $1
  free_gpu_memory_fraction: 0.8
  enable_block_reuse: true
  tokens_per_block: 64
  mamba_ssm_cache_dtype: float16
  mamba_ssm_stochastic_rounding: true
  mamba_ssm_philox_rounds: 5
  mamba_state_config:
    periodic_snapshot_interval: 256
    additional_snapshot_offsets_from_end:
      - 0
EOF
  echo "$f"
}

start_server() {  # $1 = kv dtype, $2 = log
  $PY -m hyserve.cli serve "$CKPT" --config "$(yaml "$1")" --max-seq-len "${MAX_SEQ_LEN:-1048576}" --port 8000 \
    --disable-log-requests >"$2" 2>&1 &
  PID=$!
  until curl -sf $URL/health >/dev/null 2>&1; do
    sleep 0.5
    if ! kill -0 $PID 2>/dev/null; then echo "server died:"; tail -40 "$2"; return 1; fi
  done
}
stop_server() { [ -n "$PID" ] && kill -INT $PID && wait $PID; PID=; }
save() {  # two archives: the results (with logs and YAMLs) and the checkpoint
  if [ -n "${OUT_DIR:-}" ]; then
    mkdir -p "$OUT_DIR"
    tar czf "$OUT_DIR/needle_results_$sha.tgz" "$R"/needle_*"$sha"* /tmp/needle_*.log /tmp/needle_*.yml \
      2>/dev/null
    [ -f "$CKPT/model.safetensors" ] \
      && tar czf "$OUT_DIR/needle_ckpt_$sha.tgz" -C "$(dirname "$CKPT")" "$(basename "$CKPT")"
  fi
}

needle() {  # $1 = result name, $2 = sizes, $3 = depths, rest = extra flags
  local name=$1 sizes=$2 depths=$3; shift 3
  $PY -m hyserve.cli bench needle --base-url $URL --sizes "$sizes" --needle-depths "$depths" --max-tokens 32 \
    --timeout 900 --save-result --result-dir "$R" --git-sha "$sha" --result-filename "needle_${name}_$sha.json" \
    "$@" | sed -n '/HIT \/ MISS/,$p'
}

GRID_SIZES=${GRID_SIZES:-1k,4k,16k,64k,256k}
GRID_DEPTHS=${GRID_DEPTHS:-0,0.25,0.5,0.75,1}

if [[ " $parts " == *" train "* ]]; then
  echo "== train (h200 preset) into $CKPT"
  $PY scripts/train_needle.py --device cuda ${STEPS:+--steps $STEPS} ${TRAIN_ARGS:-} --out "$CKPT" --results-dir "$R" --tag "needle_train_h200_$sha" \
    2>&1 | grep -v "falling back" | tail -60
  cp "$CKPT"/config.json "$R/needle_train_h200_${sha}_config.json"
  save
fi
if [[ " $parts " == *" grid "* ]]; then
  echo "== HIT / MISS grid (float32 model as trained, KV auto)"
  start_server auto /tmp/needle_serve_grid.log || exit 1
  needle grid "$GRID_SIZES" "$GRID_DEPTHS"
  stop_server; save
fi
if [[ " $parts " == *" long "* ]]; then
  echo "== 1M tokens"
  start_server auto /tmp/needle_serve_long.log || exit 1
  needle long 1M 0.5
  needle long256k 256k 0.1,0.9
  stop_server; save
fi
if [[ " $parts " == *" fp8 "* ]]; then
  echo "== HIT / MISS grid with fp8 KV"
  start_server fp8 /tmp/needle_serve_fp8.log || exit 1
  needle fp8 "$GRID_SIZES" "$GRID_DEPTHS"
  stop_server; save
fi
if [[ " $parts " == *" same "* ]]; then
  echo "== same answers: prefix-cache hits, other chunk sizes"
  SAME_SIZES=${SAME_SIZES:-4k,16k,64k}
  start_server auto /tmp/needle_serve_same.log || exit 1
  needle same_a "$SAME_SIZES" "$GRID_DEPTHS"
  needle same_b "$SAME_SIZES" "$GRID_DEPTHS"  # every prompt again: prefix-cache hits
  stop_server
  MAX_NUM_TOKENS=2048 start_server auto /tmp/needle_serve_same2k.log || exit 1
  needle same_c "$SAME_SIZES" "$GRID_DEPTHS"
  stop_server
  $PY - "$R" "$sha" <<'EOF'
import json, sys
r, sha = sys.argv[1], sys.argv[2]
runs = {k: json.load(open(f"{r}/needle_same_{k}_{sha}.json"))["results"] for k in "abc"}
key = lambda row: (row["target_tokens"], row["depth"])
base = {key(x): x["content"] for x in runs["a"]}
for k in "bc":
    diff = [key(x) for x in runs[k] if base.get(key(x)) != x["content"]]
    print(f"run {k} vs a: {len(runs[k]) - len(diff)} of {len(runs[k])} answers identical", diff or "")
EOF
  save
fi
exit 0
