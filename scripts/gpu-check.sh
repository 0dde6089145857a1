#!/usr/bin/env bash
# The CUDA checks, for a machine with an NVIDIA GPU and the CUDA toolkit
# (nvcc): builds the worker with `--features cuda`, runs the engine's
# correctness tests on the GPU (llama.cpp reference, batching and preemption
# invariance), then measures the worker directly with the load generator.
# Usage: scripts/gpu-check.sh [cuda:N]   (results under target/gpu-check/)
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=${1:-cuda:0}
OUT=target/gpu-check
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
nvcc --version | tail -1

cargo build --release --workspace --features tokenmesh-worker/cuda
MODEL=$(target/release/meshctl fetch-model)

# Correctness on the GPU.
TOKENMESH_TEST_DEVICE="$DEVICE" TOKENMESH_TEST_MODEL="$MODEL" \
  cargo test --release -p tokenmesh-worker --features cuda --test reference --test batching \
  2>&1 | tee "$OUT/tests.log"

# Speed: the worker alone on the GPU, 1 to 32 concurrent streams.
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
target/release/tokenmesh-worker --insecure --listen "127.0.0.1:$PORT" --model "$MODEL" \
  --device "$DEVICE" --max-batch 32 --worker-id gpu-0 > "$OUT/worker.log" 2>&1 &
WORKER=$!
trap 'kill $WORKER 2>/dev/null || true' EXIT
for _ in $(seq 100); do
  grep -q "ready" "$OUT/worker.log" && break
  sleep 0.2
done
for c in 1 4 16 32; do
  target/release/meshctl bench --target "127.0.0.1:$PORT" --direct --concurrency "$c" --no-progress \
    --requests $((c * 8)) --max-tokens 128 --output json | tee -a "$OUT/bench.jsonl"
done
echo "results in $OUT"
