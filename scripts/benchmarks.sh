#!/usr/bin/env bash
# Reproduces the measurements in BENCHMARKS.md: builds in release mode, then
# (1) the synthetic engine directly and through the router, side by side,
# (2) the real model through the router at 1, 4 and 16 streams,
# (3) llama.cpp on the same model and thread count, if llama-cpp-python is
#     available (LLAMACPP_PYTHON, default /tmp/llamacpp-venv/bin/python),
# (4) the 27-point sweep with heatmaps,
# (5) the streamed tokens/s ceiling: a fast synthetic engine (1000 tok/s per
#     sequence, 100 streams) directly and through the router, with the
#     router's CPU time per run.
# ONLY="synthetic real llamacpp sweep ceiling" picks sections.
# Results go to $OUT (default bench-results/). Every run is short: the whole
# script takes about ten minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
REPS=${REPS:-3}
THREADS=${THREADS:-1}
LLAMACPP_PYTHON=${LLAMACPP_PYTHON:-/tmp/llamacpp-venv/bin/python}
mkdir -p "$OUT"
cargo build --release --workspace
BIN=target/release
MODEL=$($BIN/meshctl fetch-model --python "${TOKENMESH_PYTHON:-python3}")

want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
cpu_secs() { # utime + stime of a process, seconds
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"
}
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # wait until meshctl can list models at $1
  for _ in $(seq 100); do $BIN/meshctl models --router "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "nothing serves on $1" >&2; return 1
}
mesh() { # mesh NAME MODEL_NAME WORKER_ARGS...: one worker and a router; sets WORKER and ROUTER
  local name=$1 model=$2; shift 2
  local wp rp; wp=$(free_port); rp=$(free_port)
  $BIN/tokenmesh-worker --insecure --listen 127.0.0.1:$wp --worker-id "$name" --model-name "$model" --log warn "$@" \
    >"$OUT/$name-worker.log" 2>&1 & pids+=($!)
  printf '[[workers]]\nid = "%s"\nmodel = "%s"\nversion = "v1"\naddr = "http://127.0.0.1:%s"\n\n[models."%s"]\nstable = "v1"\n' \
    "$name" "$model" "$wp" "$model" >"$OUT/$name-static.toml"
  $BIN/tokenmesh-router --insecure --listen 127.0.0.1:$rp --static "$OUT/$name-static.toml" --log warn \
    >"$OUT/$name-router.log" 2>&1 & pids+=($!)
  WORKER=127.0.0.1:$wp; ROUTER=127.0.0.1:$rp; ROUTER_PID=$!
  wait_for "$ROUTER"
  for _ in $(seq 100); do $BIN/meshctl models --router "$ROUTER" | grep -q " 1  $name" && return 0; sleep 0.1; done
}

if want synthetic; then
echo "== synthetic engine: direct vs router"
mesh synthetic synthetic --engine synthetic --synthetic-tokens-per-sec 100 --max-batch 256 --queue-capacity 1024
: >"$OUT/synthetic.jsonl"
for c in 16 100; do
  for rep in $(seq "$REPS"); do
    for to in direct router; do
      if [ $to = direct ]; then args=(--direct --target "$WORKER"); else args=(--target "$ROUTER"); fi
      $BIN/meshctl bench "${args[@]}" --concurrency $c --max-tokens 50 --prompt-words 32 \
        --duration 5 --warmup 1 --seed "$rep" --output json --no-progress >>"$OUT/synthetic.jsonl"
    done
  done
done
cleanup; pids=()
fi

if want real; then
echo "== real model through the router ($THREADS thread(s))"
mesh real smollm2-135m-instruct --model "$MODEL" --threads "$THREADS" --max-batch 16
: >"$OUT/real.jsonl"
for c in 1 4 16; do
  $BIN/meshctl bench --target "$ROUTER" --concurrency $c --max-tokens 32 --prompt-words 32 --temperature 0 \
    --duration 10 --warmup 2 --repeat "$REPS" --output json --no-progress >>"$OUT/real.jsonl"
done
cleanup; pids=()
fi

if ! want llamacpp; then
  :
elif [ -x "$LLAMACPP_PYTHON" ]; then
  echo "== llama.cpp, $THREADS thread(s)"
  "$LLAMACPP_PYTHON" scripts/llamacpp_bench.py --model "$MODEL" --threads "$THREADS" --max-tokens 32 --reps "$REPS" \
    | tee "$OUT/llamacpp.txt"
else
  echo "== llama.cpp skipped: $LLAMACPP_PYTHON not found"
fi

if want sweep; then
echo "== sweep (synthetic engine)"
$BIN/meshctl bench sweep --engine synthetic --synthetic-tokens-per-sec 50 --duration 2 --warmup 0.5 \
  --max-tokens 32 --out-dir "$OUT/sweep" --output json --no-progress >/dev/null
fi

if want ceiling; then
echo "== streamed tokens/s ceiling: synthetic engine at 1000 tok/s per sequence, 100 streams"
mesh ceiling synthetic --engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 --queue-capacity 1024
: >"$OUT/ceiling.jsonl"; : >"$OUT/ceiling-router-cpu.txt"
for rep in $(seq "$REPS"); do
  for to in direct router; do
    if [ $to = direct ]; then args=(--direct --target "$WORKER"); else args=(--target "$ROUTER"); fi
    before=$(cpu_secs "$ROUTER_PID")
    $BIN/meshctl bench "${args[@]}" --concurrency 100 --max-tokens 200 --prompt-words 32 \
      --duration 4 --warmup 1 --seed "$rep" --output json --no-progress >>"$OUT/ceiling.jsonl"
    echo "$to rep $rep: router CPU $(awk -v a="$before" -v b="$(cpu_secs "$ROUTER_PID")" 'BEGIN { print b - a }') s over 5 s" \
      | tee -a "$OUT/ceiling-router-cpu.txt"
  done
done
cleanup; pids=()
fi

for f in synthetic real ceiling; do
  [ -s "$OUT/$f.jsonl" ] && python3 scripts/bench_summary.py "$OUT/$f.jsonl" | tee "$OUT/$f.md"
done
echo "results in $OUT"
