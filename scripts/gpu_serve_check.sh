#!/usr/bin/env bash
# Serving checks on the Nemotron Nano 9B v2 architecture (random weights, bf16) through the real HTTP server
# and `hyserve bench`. Results: benchmarks/results/serve_*.
#
#   scripts/gpu_serve_check.sh GIT_SHA [mixed|ttft|sweep|profile|needle]...
#
#   mixed   fresh server + empty kernel cache dir: time to ready (cold); a mixed workload (random,
#           shared-prefix, prompts longer than max_num_tokens, greedy/top-p/top-k/seeded/logprobs) run
#           twice back to back (run2/run1); first-request TTFT vs the same request at steady state;
#           JIT compilations after ready from /metrics; then a restart on the same cache dir (warm).
#   ttft    fixed shapes on a fresh server and kernel cache: first request vs steady state, and 64
#           requests run twice back to back (run2/run1).
#   sweep   throughput vs concurrency (1 8 32 64 128 256) for in/out 1000/1000 and 8000/1000, each point
#           quoted against its decode-step roofline (benchmarks/sweep_roofline.py); SWEEP_SHAPES="1000 1000"
#           runs one shape; SWEEP_PUBLISHED="C:TOK_S:LABEL" plots another engine's published point beside
#           it. 30B-A3B FP8 against vLLM's H200 figure: MODEL=...Nano-30B-A3B-BF16 SERVE_FLAGS="--quantization
#           fp8" SWEEP_SHAPES="1000 1000" SWEEP_CONCURRENCY="1 8 64 256 512 1024" SWEEP_MAX_BATCH=1024
#           SWEEP_PUBLISHED="1024:15828:vLLM published, H200".
#   profile py-spy samples of the server (all threads, then only the GIL holder) during 64 streams of
#           decode, summarised by scripts/pyspy_summary.py: where the step time beyond the engine's goes.
#   needle  max_seq_len 1,048,576: needle prompts up to 1M tokens, then a normal request.
#   scale   serving at scale with default sizes (max_batch_size / max_num_tokens sized from memory): time to
#           ready, SCALE_PROMPTS (default 5120) random 1000/1000 requests at 1,024 concurrency through the
#           server, then 1,024 of them through LLM.generate (`hyserve bench offline`); serve_scale.json holds
#           the server's figure against vLLM's published one and against the engine's
#           (benchmarks/scale_records.py). Use MODEL=...Nano-30B-A3B-BF16 SERVE_FLAGS="--quantization fp8".
#           SCALE_ENGINE=0 leaves out the LLM.generate part. SCALE_PROFILE=S: S seconds into the run,
#           py-spy samples the server for 8 s (every thread with idle time, then only the GIL holder),
#           summarised by scripts/pyspy_summary.py.
#   grid    output throughput at 1,024 streams (random 1k/1k, GRID_PROMPTS, default 1024) with default flags and
#           with each max_batch_size x max_num_tokens of GRID_SETTINGS (default: default, 256/512/1024 x
#           8192/16384), a server each; benchmarks/grid_records.py sets the default against the best
#           (serve_grid.json; the bar is 0.95). Seven settings take two commands: split GRID_SETTINGS.
#   batchwait `hyserve bench offline` (the engine alone) over BATCHWAIT_PROMPTS (default 1024) random requests of
#           1000 in / 500 out with lengths varied +-50%, with batch waiting off and then with
#           batch_wait_timeout_iters ${BATCHWAIT_ITERS:-32}: whether holding admissions back for fewer eager
#           prefill steps pays (serve_batchwait_off.json, serve_batchwait_on.json). Use the scale part's MODEL
#           and SERVE_FLAGS (only --quantization fp8 is read).
#
# Environment: MODEL (a config dir, default Nano 9B v2), SERVE_FLAGS (added to every `hyserve serve`, e.g.
# "--quantization fp8"), SWEEP_SHAPES, SWEEP_CONCURRENCY (default "1 8 32 64 128 256") and SWEEP_MAX_BATCH
# (default 256). FP8: MODEL=benchmarks/configs/NVIDIA-Nemotron-3-Super-120B-A12B-BF16
# SERVE_FLAGS="--quantization fp8" ... needle runs the whole Super in FP8 on one H200.
# OUT_DIR (optional): a folder that gets a copy of the result JSONs and server logs after each part (and of
# the py-spy samples), so a run cut short still leaves what ran there.
# Needs the server wheels in .whl/ (benchmarks/README.md, "GPU check scripts"); `profile` also needs
# py-spy there (pip download --no-deps --only-binary :all: --platform manylinux2014_x86_64 py-spy -d .whl).
set -uo pipefail
sha=${1:-unknown}
shift || true
parts=${*:-mixed sweep needle}
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
MODEL=${MODEL:-benchmarks/configs/NVIDIA-Nemotron-Nano-9B-v2}
R=benchmarks/results
mkdir -p "$R"
touch /tmp/gpu_serve_check.start  # save() copies what is newer
URL=http://127.0.0.1:8000
VOCAB=${VOCAB:-131072}
BENCH=(python3 -m hyserve.cli bench serve --base-url $URL --vocab-size $VOCAB --min-token-id ${MIN_ID:-1000} --ignore-eos
       --save-result --result-dir "$R" --git-sha "$sha")
PID=

READY_S=
start_server() {  # $1 = log file, rest = serve flags; sets PID and READY_S (seconds to ready)
  local log=$1; shift
  local t0; t0=$(date +%s.%N)
  if curl -sf $URL/health >/dev/null 2>&1; then echo "port 8000 is already serving"; return 1; fi
  # shellcheck disable=SC2086  # SERVE_FLAGS is a list of flags
  python3 -m hyserve.cli serve "${MODEL}" --load-format dummy --port 8000 ${SERVE_FLAGS:-} "$@" >"$log" 2>&1 &
  PID=$!
  until curl -sf $URL/health >/dev/null 2>&1; do
    sleep 0.5
    if ! kill -0 $PID 2>/dev/null; then echo "server died:"; tail -40 "$log"; return 1; fi
  done
  READY_S=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
}

stop_server() { [ -n "$PID" ] && kill -INT $PID && wait $PID; PID=; save; }
save() {  # only what this run wrote: a copy of every stored result would crowd out the new ones
  if [ -n "${OUT_DIR:-}" ]; then
    mkdir -p "$OUT_DIR" && find "$R" /tmp -maxdepth 1 -name 'serve_*' -newer /tmp/gpu_serve_check.start \
      \( -name '*.json' -o -name '*.log' -o -name '*.png' \) -exec cp {} "$OUT_DIR"/ \; 2>/dev/null
  fi
}

jit_after_ready() { curl -s $URL/metrics | awk '/^hyserve_jit_compiles_after_ready_total/ {print $2}'; }

if [[ " $parts " == *" mixed "* ]]; then
  echo "== mixed workload on a fresh server (empty kernel cache)"
  cache=/tmp/hyserve-cache-$$
  rm -rf "$cache"
  flags=(--cache-dir "$cache" --max-batch-size 128 --max-num-tokens 8192 --max-seq-len 32768)
  start_server /tmp/serve_cold.log "${flags[@]}" || exit 1
  cold=$READY_S
  grep -E "warm-up:|captured|activation peak" /tmp/serve_cold.log
  echo "time to ready, empty cache: ${cold}s"
  "${BENCH[@]}" --num-prompts 1 --max-concurrency 1 --random-input-len 2000 --random-output-len 64 \
    --temperature 0 --result-filename serve_first_request.json | tail -4
  "${BENCH[@]}" --num-prompts 96 --max-concurrency 32 --random-input-len 1000 --random-output-len 200 \
    --random-range-ratio 0.9 --temperature 0 --reps 2 --result-filename serve_mixed_random.json | tail -14
  "${BENCH[@]}" --dataset-name shared-prefix --shared-prefix-len 3000 --num-prefixes 4 --num-prompts 64 \
    --max-concurrency 32 --random-input-len 300 --random-output-len 100 --temperature 0.8 \
    --extra-body '{"top_p": 0.9, "logprobs": 2}' --reps 2 --result-filename serve_mixed_prefix.json | tail -14
  "${BENCH[@]}" --num-prompts 8 --max-concurrency 8 --random-input-len 20000 --random-range-ratio 0.5 \
    --random-output-len 32 --temperature 1.0 --extra-body '{"top_k": 20, "seed": 7}' \
    --result-filename serve_mixed_long.json | tail -8
  "${BENCH[@]}" --num-prompts 1 --max-concurrency 1 --random-input-len 2000 --random-output-len 64 \
    --temperature 0 --seed 99 --result-filename serve_steady_request.json | tail -4
  echo "JIT compilations after ready: $(jit_after_ready)"
  grep -c "JIT after ready" /tmp/serve_cold.log | sed 's/^/late-compile log lines: /'
  grep "JIT after ready" /tmp/serve_cold.log | cut -c1-400 | head -5
  stop_server
  start_server /tmp/serve_warm.log "${flags[@]}" || exit 1
  warm=$READY_S
  grep -E "warm-up:" /tmp/serve_warm.log
  echo "time to ready, warm cache: ${warm}s"
  stop_server
  python3 - "$R" "$cold" "$warm" "$sha" <<'EOF'
import json, sys, datetime
r, cold, warm, sha = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "git_sha": sha,
           "gpu": __import__("subprocess").run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                               capture_output=True, text=True).stdout.strip(),
           "command": "scripts/gpu_serve_check.sh mixed",
           "records": [{"name": "time to ready, empty kernel cache (s)", "value": cold, "unit": "s",
                        "reference": "warm restart, same run", "reference_value": warm, "ratio": cold / warm}]},
          open(f"{r}/serve_startup.json", "w"), indent=2)
EOF
fi

if [[ " $parts " == *" ttft "* ]]; then
  echo "== first request vs steady state, fixed shapes, fresh server and kernel cache"
  start_server /tmp/serve_ttft.log --cache-dir /tmp/hyserve-ttft-$$ --max-batch-size 64 --max-seq-len 8192 || exit 1
  echo "time to ready, empty cache: ${READY_S}s"
  seed=100
  for tag in first warm1 warm2 steady; do
    seed=$((seed + 1))  # a new prompt each time: no prefix-cache hit
    "${BENCH[@]}" --num-prompts 1 --max-concurrency 1 --random-input-len 2000 --random-output-len 64 \
      --temperature 0 --seed $seed --result-filename "serve_ttft_$tag.json" | grep -E "Mean TTFT|Mean TPOT" | sed "s/^/$tag /"
    [ $tag = warm1 ] && "${BENCH[@]}" --num-prompts 64 --max-concurrency 32 --random-input-len 1000 \
      --random-output-len 100 --temperature 0 --reps 2 --result-filename serve_ttft_fixed_reps.json \
      | grep -E "run2/run1|rep [12]/2"
  done
  echo "JIT compilations after ready: $(jit_after_ready)"
  stop_server
fi

if [[ " $parts " == *" sweep "* ]]; then
  echo "== throughput sweep"
  start_server /tmp/serve_sweep.log --max-batch-size "${SWEEP_MAX_BATCH:-256}" --max-num-tokens 8192 --max-seq-len 9216 \
    || exit 1
  IFS=, read -ra shapes <<< "${SWEEP_SHAPES:-1000 1000,8000 1000}"  # "in out" pairs
  for io in "${shapes[@]}"; do
    set -- $io
    for c in ${SWEEP_CONCURRENCY:-1 8 32 64 128 256}; do
      n=$(( c < 4 ? 2 : c ))
      "${BENCH[@]}" --num-prompts $n --max-concurrency $c --random-input-len $1 --random-output-len $2 \
        --temperature 0 --result-filename "serve_sweep_in$1_out$2_c$c.json" | grep -E "Output token throughput|Mean TPOT|Mean TTFT" | sed "s/^/in=$1 c=$c /"
      save
    done
  done
  stop_server
  sweep_args=()
  [[ " ${SERVE_FLAGS:-} " == *" --quantization fp8 "* ]] && sweep_args+=(--quantization fp8)
  [ -n "${SWEEP_PUBLISHED:-}" ] && sweep_args+=(--published "$SWEEP_PUBLISHED")
  python3 -m benchmarks.sweep_roofline --results "$R" --git-sha "$sha" --model-dir "$MODEL" "${sweep_args[@]}"
  if [ -n "${OUT_DIR:-}" ]; then
    mkdir -p "$OUT_DIR" && cp "$R"/serve_sweep_roofline.* "$OUT_DIR"/ 2>/dev/null
  fi
fi

if [[ " $parts " == *" profile "* ]]; then
  echo "== where the server's time goes at concurrency 64 (py-spy, carried in .whl)"
  start_server /tmp/serve_profile.log --max-batch-size 64 --max-seq-len 4096 || exit 1
  "${BENCH[@]}" --num-prompts 64 --max-concurrency 64 --random-input-len 1000 --random-output-len 2000 \
    --temperature 0 --result-filename serve_profile_c64.json > /tmp/serve_profile_bench.log 2>&1 &
  bench=$!
  sleep 12  # past the prefills: decode steps only
  for mode in all gil; do
    extra=(); [ $mode = gil ] && extra=(--gil)
    /tmp/site/bin/py-spy record -p $PID -d 8 -r 250 -f raw --subprocesses --nonblocking "${extra[@]}" -o /tmp/pyspy_$mode.txt >/dev/null 2>&1
    python3 scripts/pyspy_summary.py /tmp/pyspy_$mode.txt | head -45 | sed "s/^/[$mode] /"
  done
  wait $bench
  grep -E "Median ITL|Output token thr" /tmp/serve_profile_bench.log
  [ -n "${OUT_DIR:-}" ] && mkdir -p "$OUT_DIR" && cp /tmp/pyspy_*.txt "$OUT_DIR"/
  stop_server
fi

if [[ " $parts " == *" grid "* ]]; then
  echo "== default flags against explicit max_batch_size x max_num_tokens, 1,024 streams"
  for setting in ${GRID_SETTINGS:-default 256x8192 512x8192 1024x8192 256x16384 512x16384 1024x16384}; do
    flags=()
    if [ "$setting" != default ]; then
      flags=(--max-batch-size "${setting%x*}" --max-num-tokens "${setting#*x}")
    fi
    start_server "/tmp/serve_grid_$setting.log" --max-seq-len 4096 "${flags[@]}" || continue
    "${BENCH[@]}" --num-prompts "${GRID_PROMPTS:-1024}" --max-concurrency 1024 --random-input-len 1000 \
      --random-output-len 1000 --temperature 0 --result-filename "serve_grid_$setting.json" \
      | grep -E "Output token throughput" | sed "s/^/$setting: /"
    stop_server
  done
  python3 -m benchmarks.grid_records "$R" "$sha"
  save
fi

if [[ " $parts " == *" scale "* ]]; then
  echo "== serving at scale, default sizes"
  n=${SCALE_PROMPTS:-5120}
  start_server /tmp/serve_scale.log --max-seq-len 4096 || exit 1
  ready=$READY_S
  echo "time to ready: ${ready}s"
  grep -E "max_batch_size|captured|warm-up:|live slots|snapshot slots|KV cache  |max_step_ms" /tmp/serve_scale.log
  "${BENCH[@]}" --num-prompts "$n" --max-concurrency 1024 --random-input-len 1000 --random-output-len 1000 \
    --temperature 0 --goodput ttft:2000 tpot:100 --result-filename serve_scale_c1024.json \
    > /tmp/serve_scale_bench.log 2>&1 &
  bench=$!
  if [ -n "${SCALE_PROFILE:-}" ]; then  # py-spy of the server in steady state: all threads, then the GIL holder
    sleep "$SCALE_PROFILE"
    for mode in idle gil; do
      extra=(--idle); [ $mode = gil ] && extra=(--gil)
      /tmp/site/bin/py-spy record -p $PID -d 8 -r 200 -f raw --threads --subprocesses --nonblocking "${extra[@]}" \
        -o /tmp/pyspy_scale_$mode.txt >/dev/null 2>&1
      python3 scripts/pyspy_summary.py /tmp/pyspy_scale_$mode.txt --top 60 | cut -c1-150 | sed "s/^/[$mode] /"
    done
    [ -n "${OUT_DIR:-}" ] && mkdir -p "$OUT_DIR" && cp /tmp/pyspy_scale_*.txt "$OUT_DIR"/
  fi
  wait $bench
  grep -E "requests|Duration|Output token throughput|goodput|TTFT|TPOT|ITL" /tmp/serve_scale_bench.log
  # how the step-time target was corrected, and how many steps carried prefill
  curl -s $URL/metrics | grep -E "^hyserve_(step_time_scale|engine_steps_total|engine_prefill_steps_total|prefill_tokens_scheduled_total)"
  stop_server
  if [ "${SCALE_ENGINE:-1}" = 0 ]; then
    rm -f "$R"/serve_scale_engine.json  # the records of this run only
    python3 -m benchmarks.scale_records "$R" "$ready" "$sha"
    save
  fi
fi
if [[ " $parts " == *" scale "* && "${SCALE_ENGINE:-1}" != 0 ]]; then
  q=""
  [[ "${SERVE_FLAGS:-}" == *"--quantization fp8"* ]] && q="quantization: fp8"
  printf '%s\nmax_seq_len: 4096\n' "$q" > /tmp/scale_engine.yml
  python3 -m hyserve.cli bench offline --model "$MODEL" --load-format dummy --config /tmp/scale_engine.yml \
    --input-len 1000 --output-len 1000 --num-prompts 1024 --min-token-id "${MIN_ID:-1000}" --save-result \
    --result-dir "$R" --git-sha "$sha" --result-filename serve_scale_engine.json | tail -8
  python3 -m benchmarks.scale_records "$R" "$ready" "$sha"
  save
fi

if [[ " $parts " == *" batchwait "* ]]; then
  echo "== batch waiting off / on, the engine alone"
  q=""
  [[ "${SERVE_FLAGS:-}" == *"--quantization fp8"* ]] && q="quantization: fp8"
  for mode in off on; do
    iters=0; [ $mode = on ] && iters=${BATCHWAIT_ITERS:-32}
    printf '%s\nmax_seq_len: 4096\nbatch_wait_timeout_iters: %s\n' "$q" "$iters" > /tmp/batchwait_$mode.yml
    python3 -m hyserve.cli bench offline --model "$MODEL" --load-format dummy --config /tmp/batchwait_$mode.yml \
      --input-len 1000 --output-len 500 --random-range-ratio 0.5 --num-prompts "${BATCHWAIT_PROMPTS:-1024}" \
      --min-token-id "${MIN_ID:-1000}" --save-result --result-dir "$R" --git-sha "$sha" \
      --result-filename serve_batchwait_$mode.json | tail -6 | sed "s/^/[$mode] /"
  done
  save
fi

if [[ " $parts " == *" needle "* ]]; then
  echo "== needle up to 1M tokens (max_seq_len 1,048,576)"
  # the architecture dir has no tokenizer: pair its config with the built-in byte-level tokenizer
  # (one token per byte) so the chat endpoint and the needle text work
  nd=/tmp/nano9b-bytes
  mkdir -p $nd && cp "$MODEL/config.json" $nd/
  python3 -c "from hyserve.model.tiny import builtin_model_dir as b; import shutil, sys
for f in ('tokenizer.json', 'tokenizer_config.json'): shutil.copy(b() / f, sys.argv[1])" $nd
  MODEL=$nd start_server /tmp/serve_needle.log --max-batch-size 8 --max-num-tokens 16384 --max-seq-len 1048576 \
    || exit 1
  sed -n '/capacity plan/,/concurrency at/p' /tmp/serve_needle.log
  python3 -m hyserve.cli bench needle --base-url $URL --sizes ${NEEDLE_SIZES:-8k,128k,1M} --max-tokens 16 --timeout 900 \
    --save-result --result-dir "$R" --git-sha "$sha" --result-filename serve_needle.json | tail -12
  save
  "${BENCH[@]}" --num-prompts 1 --max-concurrency 1 --random-input-len 500 --random-output-len 32 \
    --temperature 0 --result-filename serve_after_needle.json | grep -E "Successful|Failed|TTFT"
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv
  stop_server
fi
save
exit 0
