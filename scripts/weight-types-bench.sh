#!/usr/bin/env bash
# Single-stream decode and prompt processing per weight type, ours against
# llama.cpp, interleaved in one run (issue 15): for each type, the default
# model requantized with llama.cpp's `llama-quantize --allow-requantize`
# (files cached under target/weight-types, never committed), then
# llama-bench's generation speed (-p 0 -n 64) and our Criterion decode step
# at one sequence (worker/benches/engine_step.rs, decode_step/1, 64 tokens of
# context), then llama-bench's prompt processing (-p 128 -n 0) and our
# prefill of one 128-token chunk from an empty cache (prefill_chunk/128), each
# pair one right after the other, so a ratio is of two things measured under
# the same load. On a shared machine only the ratios mean anything.
#
#   LLAMA_CPP=/work/main/target/llama.cpp scripts/weight-types-bench.sh
#
# Environment (defaults): MODEL (the cached SmolLM2-135M-Instruct Q4_1),
# LLAMA_CPP (TOKENMESH_LLAMA_CPP: a directory with bin/llama-bench and
# bin/llama-quantize), TYPES ("Q4_0 Q4_1 Q5_0 Q4_K_M Q5_K_M Q6_K Q8_0 F16";
# Q4_1 is the original file), THREADS (2), OUT (scripts/benchmark-results),
# TAG (weight-types). Writes $OUT/$TAG-summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-$HOME/.cache/tokenmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA_CPP=${LLAMA_CPP:-${TOKENMESH_LLAMA_CPP:?set LLAMA_CPP to a llama.cpp build (bin/llama-bench)}}
TYPES=${TYPES:-"Q4_0 Q4_1 Q5_0 Q4_K_M Q5_K_M Q6_K Q8_0 F16"}
THREADS=${THREADS:-2}
OUT=${OUT:-scripts/benchmark-results}
TAG=${TAG:-weight-types}
DIR=$PWD/target/weight-types
mkdir -p "$OUT" "$DIR"
SUMMARY=$OUT/$TAG-summary.txt

cargo bench --locked -p tokenmesh-worker --bench engine_step --no-run 2>/dev/null
{
  echo "started: $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)"
  lscpu | grep -E '^(Model name|CPU\(s\))'
  echo "tokenmesh: $(git rev-parse --short HEAD), threads $THREADS"
  printf 'type\tfile_MiB\tllama_tg_tok_s\tours_tok_s\tratio\tllama_pp_tok_s\tours_pp_tok_s\tpp_ratio\tload\n'
} | tee "$SUMMARY"

llama_bench() { # llama_bench ARGS...: llama-bench's average tokens/s on $file
  "$LLAMA_CPP/bin/llama-bench" -m "$file" -t "$THREADS" -r 3 -o csv "$@" 2>/dev/null |
    python3 -c 'import csv,sys; rows=list(csv.DictReader(sys.stdin)); print(rows[-1]["avg_ts"])'
}
ours_bench() { # ours_bench FILTER: Criterion's throughput line, "thrpt: [low mid high]", in elem/s
  TOKENMESH_TEST_MODEL=$file TOKENMESH_THREADS=$THREADS \
    cargo bench --locked -p tokenmesh-worker --bench engine_step -- \
    --warm-up-time 1 --measurement-time 4 "$1" 2>/dev/null |
    awk '/thrpt:/ { v = $(NF-3); u = $(NF-2); if (u ~ /^Kelem/) v *= 1000; print v; exit }'
}

for ty in $TYPES; do
  file=$DIR/model.$ty.gguf
  if [ "$ty" = Q4_1 ]; then
    file=$MODEL
  elif [ ! -f "$file" ]; then
    "$LLAMA_CPP/bin/llama-quantize" --allow-requantize "$MODEL" "$file.part" "$ty" "$THREADS" >/dev/null 2>&1
    mv "$file.part" "$file"
  fi
  llama=$(llama_bench -p 0 -n 64)
  ours=$(ours_bench 'decode_step/1$')
  llama_pp=$(llama_bench -p 128 -n 0)
  ours_pp=$(ours_bench 'prefill_chunk/128$')
  ratio=$(python3 -c "print(f'{$ours / $llama:.2f}')")
  pp_ratio=$(python3 -c "print(f'{$ours_pp / $llama_pp:.2f}')")
  printf '%s\t%d\t%.1f\t%.1f\t%s\t%.1f\t%.1f\t%s\t%s\n' "$ty" "$(( $(stat -c %s "$file") >> 20 ))" "$llama" "$ours" \
    "$ratio" "$llama_pp" "$ours_pp" "$pp_ratio" "$(cut -d' ' -f1 /proc/loadavg)" | tee -a "$SUMMARY"
done
echo "finished: $(date -u +%FT%TZ), load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$SUMMARY"
