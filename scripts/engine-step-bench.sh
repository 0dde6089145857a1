#!/usr/bin/env bash
# The engine alone, side by side with llama.cpp's own benchmark, in one run:
# llama-bench (prompt processing of 128 tokens, generation of 64, the same
# GGUF and thread count), then our Criterion step benchmark
# (worker/benches/engine_step.rs: a decode step at 1, 4 and 16 sequences and a
# 128-token prompt chunk) with the VNNI kernels and without them.
#
#   LLAMA_BENCH=/tmp/llama/.../build/bin/llama-bench scripts/engine-step-bench.sh
#
# Environment (defaults): MODEL (the cached SmolLM2-135M-Instruct Q4_1),
# LLAMA_BENCH (skipped when unset), THREADS (2), OUT
# (scripts/benchmark-results), TAG (engine-step).
# Writes $OUT/$TAG-llama-bench.txt, $OUT/$TAG-criterion.txt and
# $OUT/$TAG-machine.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-$HOME/.cache/tokenmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
OUT=${OUT:-scripts/benchmark-results}
TAG=${TAG:-engine-step}
mkdir -p "$OUT"
{
  echo "started: $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  lscpu | grep -E '^(Model name|CPU\(s\))'
  grep -o -w 'avx2\|avx512_vnni\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
  echo "model: $MODEL ($(stat -c %s "$MODEL") bytes)"
  echo "tokenmesh: $(git rev-parse --short HEAD), threads $THREADS"
} >"$OUT/$TAG-machine.txt"

if [ -n "${LLAMA_BENCH:-}" ]; then
  "$LLAMA_BENCH" -m "$MODEL" -t "$THREADS" -p 128 -n 64 -r 5 -o md | tee "$OUT/$TAG-llama-bench.txt"
fi

export TOKENMESH_TEST_MODEL=$MODEL TOKENMESH_THREADS=$THREADS
: >"$OUT/$TAG-criterion.txt"
for vnni in 1 0; do
  echo "## TOKENMESH_CPU_VNNI=$vnni" | tee -a "$OUT/$TAG-criterion.txt"
  TOKENMESH_CPU_VNNI=$vnni cargo bench --locked -p tokenmesh-worker --bench engine_step 2>/dev/null |
    # The benchmark's name with its time, then its throughput line (not
    # the change against an earlier run that Criterion prints after them).
    awk '/^(decode_step|prefill_chunk)/ { print; n = 1; next } n > 0 && /time:|thrpt:/ { print; n-- }' |
    tee -a "$OUT/$TAG-criterion.txt"
done
echo "finished: $(date -u +%FT%TZ)" >>"$OUT/$TAG-machine.txt"
