#!/usr/bin/env bash
# The CUDA checks: the engine's correctness tests on the GPU (llama.cpp
# reference, batching and preemption invariance), the worker's Status on the
# GPU, then the worker measured directly with the load generator at 1, 4, 16
# and 32 streams, on the GPU and (CPU_COMPARE=1, the default) on the same
# machine's CPU cores with the same binary, for a side-by-side ratio; and,
# where vLLM is installed, upstream workers (--engine upstream, of the vllm
# and of the openai kind) in front of vLLM measured the same way.
#
#   scripts/gpu-check.sh [cuda:N]
#       A GPU machine with the Rust toolchain and the CUDA toolkit (nvcc):
#       builds with `--features cuda` here first.
#   scripts/gpu-check.sh --prebuilt DIR [cuda:N]
#       A GPU machine without a toolchain: DIR holds tokenmesh-worker, meshctl
#       and the test binaries `reference` and `batching` (target/release/deps/
#       reference-HASH, renamed), all built elsewhere with `--features cuda`,
#       e.g. with scripts/cuda-from-wheels.sh on a machine with no GPU. CUDA's
#       libraries are then looked for in /usr/local/cuda and Python's nvidia-*
#       packages when the dynamic linker does not find them.
#
# Environment: OUT (results, default target/gpu-check), MODEL (the GGUF file;
# default: the cached default model, fetched if need be), STREAMS (default
# "1 4 16 32"), DURATION (seconds measured per point, default 8),
# MAX_TOKENS (default 128), CPU_COMPARE (1/0), CPU_STREAMS (default: STREAMS).
#
# Every step runs whatever happened before it; each one's exit status goes to
# $OUT/summary.txt, so one run reports everything it could. At most 8 files
# are written under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

PREBUILT=""
if [ "${1:-}" = "--prebuilt" ]; then
  PREBUILT=$(cd "$2" && pwd) || { echo "no such directory: $2" >&2; exit 2; }
  shift 2
fi
DEVICE=${1:-cuda:0}
OUT=${OUT:-target/gpu-check}
STREAMS=${STREAMS:-1 4 16 32}
CPU_STREAMS=${CPU_STREAMS:-$STREAMS}
DURATION=${DURATION:-8}
MAX_TOKENS=${MAX_TOKENS:-128}
CPU_COMPARE=${CPU_COMPARE:-1}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt   # one line per step: its status, then what it found
LOG=$OUT/steps.log         # everything the steps print
: >"$SUMMARY"
: >"$LOG"

note() { echo "$*" | tee -a "$SUMMARY"; }
# step NAME CMD...: runs CMD with its output in steps.log and records its status.
step() {
  local name=$1 started rc
  shift
  started=$(date +%s)
  printf '\n==> %s: %s\n' "$name" "$*" >>"$LOG"
  "$@" >>"$LOG" 2>&1
  rc=$?
  note "$(printf '%-24s rc=%-3s %4ss' "$name" "$rc" $(($(date +%s) - started)))"
  return $rc
}

step gpu bash -c 'nvidia-smi; nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv'
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >>"$SUMMARY" 2>&1

if [ -z "$PREBUILT" ]; then
  export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)}
  step nvcc nvcc --version
  step build cargo build --release -p tokenmesh-worker -p tokenmesh-control --features tokenmesh-worker/cuda
  step build-tests cargo test --release -p tokenmesh-worker --features cuda --test reference --test batching --no-run
  BIN=$OUT/bin
  mkdir -p "$BIN"
  ln -sf "$ROOT/target/release/tokenmesh-worker" "$ROOT/target/release/meshctl" "$BIN/"
  for t in reference batching; do
    ln -sf "$(ls -t "$ROOT"/target/release/deps/$t-* | grep -v '\.d$' | head -1)" "$BIN/$t"
  done
else
  BIN=$PREBUILT
  # A machine without the toolkit may still have CUDA's libraries (Python's
  # nvidia-* wheels, /usr/local/cuda): find each one the binary lacks.
  dirs=$(ls -d /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib 2>/dev/null
    python3 - <<'EOF' 2>/dev/null
import glob, site, sys
roots = site.getsitepackages() + [site.getusersitepackages()] + sys.path
print("\n".join(sorted({d for r in roots for d in glob.glob(r + "/nvidia/*/lib")})))
EOF
  )
  for lib in $(ldd "$BIN/tokenmesh-worker" 2>/dev/null | awk '/not found/ {print $1}'); do
    for d in $dirs; do
      if [ -e "$d/$lib" ]; then
        LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        break
      fi
    done
  done
  export LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}
  note "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
fi
step ldd bash -c "ldd '$BIN/tokenmesh-worker' | grep -E 'cuda|cublas|curand|nvrtc|not found'; ! ldd '$BIN/tokenmesh-worker' | grep -q 'not found'"

if [ -z "${MODEL:-}" ]; then
  MODEL=$("$BIN/meshctl" fetch-model 2>>"$LOG")
fi
note "model: $MODEL ($(sha256sum "$MODEL" 2>&1 | cut -c1-16))"

# Correctness on the GPU.
export TOKENMESH_TEST_DEVICE=$DEVICE TOKENMESH_TEST_MODEL=$MODEL
export TOKENMESH_TEST_FIXTURE=$ROOT/tests/fixtures/llamacpp_greedy.json
step test-reference timeout 120 "$BIN/reference" --nocapture --test-threads=1
step test-batching timeout 180 "$BIN/batching" --nocapture --test-threads=1
grep -E '^test |test result' "$LOG" >>"$SUMMARY"

# The worker alone, 1 to 32 concurrent streams. bench_device DEVICE NAME
# [worker flags...]: starts a worker, checks its Status, loads it at each
# point of the streams list, stops it.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
bench_device() {
  local device=$1 name=$2 streams=$3 wlog=$OUT/worker-$2.log pid c
  shift 3
  "$BIN/tokenmesh-worker" --insecure --listen "127.0.0.1:$PORT" --model "$MODEL" \
    --device "$device" --max-batch 32 --kv-budget-mib 1024 --worker-id "$name" "$@" \
    >"$wlog" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q "ready" "$wlog" && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.2
  done
  if ! grep -q "ready" "$wlog"; then
    note "worker-$name     did not become ready: $(tail -3 "$wlog" | tr '\n' ' ')"
    kill $pid 2>/dev/null
    return 1
  fi
  grep -E 'device opened|model loaded' "$wlog" | sed 's/\x1b\[[0-9;]*m//g' >>"$SUMMARY"
  step "status-$name" python3 scripts/worker_status.py "127.0.0.1:$PORT"
  tail -1 "$LOG" >>"$SUMMARY"
  for c in $streams; do
    step "bench-$name-c$c" bash -c "set -o pipefail; timeout 90 '$BIN/meshctl' bench --target 127.0.0.1:$PORT --direct \
      --concurrency $c --max-tokens $MAX_TOKENS --prompt-words 32 --temperature 0 \
      --duration $DURATION --warmup 2 --no-progress --output json | tee -a '$OUT/bench-$name.jsonl'"
  done
  kill $pid 2>/dev/null
  wait $pid 2>/dev/null
  return 0
}
bench_device "$DEVICE" gpu "$STREAMS"
grep -q '"accelerator": "cuda"' "$LOG" && note "status: accelerator cuda" || note "status: accelerator is NOT cuda"
if [ "$CPU_COMPARE" = 1 ]; then
  bench_device cpu cpu "$CPU_STREAMS" --threads "$(nproc)"
fi

# An upstream worker in front of vLLM on the GPU (issue 21), when vLLM is
# installed: VLLM_MODEL is what vLLM loads (default: the GGUF file, which
# needs VLLM_TOKENIZER, a local Hugging Face tokenizer directory, since the
# machine has no network). vLLM's own output goes to steps.log.
if python3 -c 'import vllm' 2>/dev/null; then
  VLLM_PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
  python3 -m vllm.entrypoints.openai.api_server --model "${VLLM_MODEL:-$MODEL}" \
    ${VLLM_TOKENIZER:+--tokenizer "$VLLM_TOKENIZER"} --host 127.0.0.1 --port "$VLLM_PORT" \
    --served-model-name upstream-model --max-model-len 4096 >>"$LOG" 2>&1 &
  vllm_pid=$!
  step vllm-health bash -c "for _ in \$(seq 600); do curl -fs http://127.0.0.1:$VLLM_PORT/health >/dev/null && exit 0; kill -0 $vllm_pid || exit 1; sleep 1; done; exit 1"
  # Both kinds in front of the same vLLM: vllm (token ids, failover) and
  # openai (the generic API: text only, as for SGLang or trtllm-serve).
  if [ $? -eq 0 ]; then for kind in vllm openai; do
    name=upstream; [ $kind = openai ] && name=upstream-openai
    wlog=$OUT/worker-$name.log
    "$BIN/tokenmesh-worker" --insecure --listen "127.0.0.1:$PORT" --engine upstream \
      --upstream-kind $kind --upstream-url "http://127.0.0.1:$VLLM_PORT" --max-batch 32 \
      --worker-id $name --model-name smollm2-135m-instruct >"$wlog" 2>&1 &
    wpid=$!
    for _ in $(seq 300); do grep -q "ready" "$wlog" && break; sleep 0.2; done
    step "status-$name" python3 scripts/worker_status.py "127.0.0.1:$PORT"
    tail -1 "$LOG" >>"$SUMMARY"
    for c in $STREAMS; do
      step "bench-$name-c$c" bash -c "set -o pipefail; timeout 90 '$BIN/meshctl' bench --target 127.0.0.1:$PORT --direct \
        --model smollm2-135m-instruct --concurrency $c --max-tokens $MAX_TOKENS --prompt-words 32 --temperature 0 \
        --duration $DURATION --warmup 2 --no-progress --output json | tee -a '$OUT/bench-$name.jsonl'"
    done
    kill $wpid 2>/dev/null
    wait $wpid 2>/dev/null
  done; fi
  kill $vllm_pid 2>/dev/null
  wait $vllm_pid 2>/dev/null
else
  note "upstream: vllm is not installed here; the upstream case did not run"
fi

# One line per point: device, streams, tokens/s, TTFT and inter-token latency.
python3 - "$OUT"/bench-*.jsonl >>"$SUMMARY" 2>&1 <<'EOF'
import json, os, sys
print("device streams     tok/s  ttft p50  ttft p99  itl p50  itl p99 (ms)  requests errors")
for path in sys.argv[1:]:
    device = os.path.basename(path)[len("bench-"):-len(".jsonl")]
    for line in open(path):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        print(f"{device:6} {r['labels'].get('concurrency', '?'):>7} {r['output_tokens_per_sec']:9.1f}"
              f" {r['ttft_ms']['p50']:9.2f} {r['ttft_ms']['p99']:9.2f} {r['itl_ms']['p50']:8.2f}"
              f" {r['itl_ms']['p99']:8.2f}      {r['requests']:8} {sum(r['errors'].values())}")
EOF
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader >>"$SUMMARY" 2>&1
echo "results in $OUT"
cat "$SUMMARY"
