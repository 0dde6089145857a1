#!/usr/bin/env bash
# Two (or more) worker binaries side by side on the same model, alternated
# in one run, so a change is measured against the binary before it in the
# same stretch of a machine whose speed drifts: for each repetition, each
# binary in turn serves `meshctl bench --direct` (greedy, a fresh worker per
# point) and one line per point is printed.
#
#   BINS="/tmp/worker-before target/release/tokenmesh-worker" \
#     MODEL=target/weight-types/model.Q4_0.gguf scripts/worker-ab.sh
#
# Environment (defaults): BINS (required: the worker binaries), MODEL (the
# cached SmolLM2-135M-Instruct Q4_1), THREADS (2), MAX_BATCH (32), STREAMS
# (16), MAX_TOKENS (64), PROMPT_WORDS (32), DURATION (15 s), WARMUP (3 s),
# REPS (2). Uses target/release/meshctl as it is (no cargo build).
set -euo pipefail
cd "$(dirname "$0")/.."
BINS=${BINS:?set BINS to the worker binaries to compare}
MODEL=${MODEL:-$HOME/.cache/tokenmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${THREADS:-2}
MAX_BATCH=${MAX_BATCH:-32}
STREAMS=${STREAMS:-16}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT_WORDS=${PROMPT_WORDS:-32}
DURATION=${DURATION:-15}
WARMUP=${WARMUP:-3}
REPS=${REPS:-2}
LOGS=$(mktemp -d /tmp/worker-ab.XXXXXX)

pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "model $MODEL, threads $THREADS, $STREAMS streams, ${DURATION}s, load average $(cut -d' ' -f1-3 /proc/loadavg)"
printf 'rep\tbinary\ttokens_per_s\tttft_p50_ms\titl_p50_ms\n'
for rep in $(seq "$REPS"); do
  for bin in $BINS; do
    port=$(free_port); probes=$(free_port); log=$LOGS/$rep-$(basename "$bin").log
    "$bin" --insecure --listen "127.0.0.1:$port" --metrics-listen "127.0.0.1:$probes" --model "$MODEL" \
      --threads "$THREADS" --max-batch "$MAX_BATCH" >"$log" 2>&1 &
    pid=$!
    # The worker's readiness probe: 200 once its model is loaded and it serves.
    until curl -sf "http://127.0.0.1:$probes/readyz" >/dev/null; do
      kill -0 "$pid" 2>/dev/null || { tail "$log"; exit 1; }
      sleep 0.2
    done
    target/release/meshctl bench --direct --target "127.0.0.1:$port" --concurrency "$STREAMS" \
      --duration "$DURATION" --warmup "$WARMUP" --max-tokens "$MAX_TOKENS" \
      --prompt-words "$PROMPT_WORDS" --temperature 0 --output json --no-progress |
      python3 -c 'import json, sys
for line in sys.stdin:
    if line.strip():
        r = json.loads(line)
        row = [r["output_tokens_per_sec"], r["ttft_ms"]["p50"], r["itl_ms"]["p50"]]
        print("\t".join(sys.argv[1:3] + [f"{row[0]:.1f}", f"{row[1]:.1f}", f"{row[2]:.2f}"]))' "$rep" "$bin"
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=
  done
done
echo "worker logs: $LOGS"
