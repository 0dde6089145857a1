#!/usr/bin/env bash
# Issue 4's side by side, in one run: our engine (tokenmesh-worker under
# `meshctl bench --direct`) and llama-server (under scripts/llama_server_bench.py),
# the same GGUF, the same thread count, the same prompt length and max_tokens,
# at each concurrency in $STREAMS, one after the other (ours, then
# llama-server, for each point), each server started fresh for its point so its
# peak resident memory (VmHWM) belongs to that point.
#
#   LLAMA_SERVER=/tmp/llama/.../build/bin/llama-server scripts/engine-vs-llamacpp.sh
#
# Environment (defaults): MODEL (the cached SmolLM2-135M-Instruct Q4_1),
# LLAMA_SERVER (required), THREADS (2), MAX_BATCH (32), STREAMS ("1 4 16 32"),
# MAX_TOKENS (64), PROMPT_WORDS (32), DURATION (20 s), WARMUP (5 s),
# CTX_PER_SLOT (256 tokens of llama-server context per slot), OUT
# (scripts/benchmark-results), TAG (engine-vs-llamacpp: the file prefix),
# SAMPLING (greedy: temperature 0 on both; defaults: our server's defaults,
# temperature 1 over the whole vocabulary, and llama-server asked for the
# same, temperature 1, top_k 0, top_p 1, min_p 0, instead of its own
# truncating defaults), IGNORE_EOS (0; 1: every request runs to MAX_TOKENS
# on both engines, so they do the same work whatever they sample).
# Writes $OUT/$TAG-tokenmesh.jsonl, $OUT/$TAG-llama-server.jsonl,
# $OUT/$TAG-rss.txt, $OUT/$TAG-machine.txt and $OUT/$TAG-summary.txt; server
# logs go to a temporary directory (kept, path printed).
# Uses the release binaries as they are (no cargo build).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release
MODEL=${MODEL:-$HOME/.cache/tokenmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA_SERVER=${LLAMA_SERVER:?set LLAMA_SERVER to a llama-server binary}
THREADS=${THREADS:-2}
MAX_BATCH=${MAX_BATCH:-32}
STREAMS=${STREAMS:-"1 4 16 32"}
MAX_TOKENS=${MAX_TOKENS:-64}
PROMPT_WORDS=${PROMPT_WORDS:-32}
DURATION=${DURATION:-20}
WARMUP=${WARMUP:-5}
CTX_PER_SLOT=${CTX_PER_SLOT:-256}
SAMPLING=${SAMPLING:-greedy}
IGNORE_EOS=${IGNORE_EOS:-0}
case $SAMPLING in
  greedy) ours_sampling=(--temperature 0) llama_sampling=(--temperature 0) ;;
  defaults) ours_sampling=() llama_sampling=(--temperature 1 --top-k 0 --top-p 1 --min-p 0) ;;
  *) echo "SAMPLING is greedy or defaults, not $SAMPLING" >&2; exit 2 ;;
esac
if [ "$IGNORE_EOS" = 1 ]; then
  ours_sampling+=(--ignore-eos) llama_sampling+=(--ignore-eos)
fi
OUT=${OUT:-scripts/benchmark-results}
TAG=${TAG:-engine-vs-llamacpp}
LOGS=$(mktemp -d /tmp/engine-vs-llamacpp.XXXXXX)
mkdir -p "$OUT"
OURS=$OUT/$TAG-tokenmesh.jsonl LLAMA=$OUT/$TAG-llama-server.jsonl RSS=$OUT/$TAG-rss.txt
MACHINE=$OUT/$TAG-machine.txt
: >"$OURS"; : >"$LLAMA"
printf 'engine\tstreams\tVmRSS_ready_kB\tVmHWM_after_kB\n' >"$RSS"

pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
mem() { awk -v k="$2:" '$1 == k { print $2 }' "/proc/$1/status"; }
load() { cut -d' ' -f1-3 /proc/loadavg; }
stop() { kill "$pid"; wait "$pid" 2>/dev/null || true; pid=; }

{
  echo "started: $(date -u +%FT%TZ)"
  echo "load average at start (1/5/15 min): $(load)"
  lscpu | grep -E '^(Model name|CPU\(s\)|Thread|Flags)' | sed 's/^Flags:.*avx512f.*/Flags: ... avx512f .../'
  echo "nproc: $(nproc)"
  echo "model: $MODEL ($(stat -c %s "$MODEL") bytes, sha256 $(sha256sum "$MODEL" | cut -c1-16)…)"
  echo "tokenmesh: $(git rev-parse --short HEAD), $BIN/tokenmesh-worker built $(date -u -r $BIN/tokenmesh-worker +%FT%TZ)"
  echo "llama-server: $("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version)"
  echo "threads $THREADS, max_tokens $MAX_TOKENS, prompt words $PROMPT_WORDS, sampling $SAMPLING, ignore_eos $IGNORE_EOS, warm-up ${WARMUP}s, window ${DURATION}s"
} >"$MACHINE"

for n in $STREAMS; do
  # Ours: one worker, --threads $THREADS --max-batch $MAX_BATCH, default KV budget.
  port=$(free_port); wlog=$LOGS/tokenmesh-$n.log
  "$BIN/tokenmesh-worker" --insecure --listen "127.0.0.1:$port" --model "$MODEL" \
    --threads "$THREADS" --max-batch "$MAX_BATCH" >"$wlog" 2>&1 &
  pid=$!
  for _ in $(seq 600); do grep -q ready "$wlog" && break; kill -0 "$pid" || break; sleep 0.2; done
  # and the port accepting connections.
  for _ in $(seq 300); do
    python3 -c 'import socket,sys; socket.create_connection(("127.0.0.1", int(sys.argv[1])), 0.2)' "$port" 2>/dev/null && break
    sleep 0.2
  done
  sleep 1
  rss_ready=$(mem "$pid" VmRSS)
  echo "tokenmesh $n streams: load $(load)" >>"$MACHINE"
  "$BIN/meshctl" bench --direct --target "127.0.0.1:$port" --concurrency "$n" \
    --duration "$DURATION" --warmup "$WARMUP" --max-tokens "$MAX_TOKENS" \
    --prompt-words "$PROMPT_WORDS" "${ours_sampling[@]}" --output json --no-progress |
    python3 -c 'import json, sys
for line in sys.stdin:
    if line.strip():
        r = json.loads(line); r["labels"]["engine"] = "tokenmesh"; r["labels"]["load_1min"] = sys.argv[1]
        print(json.dumps(r))' "$(load | cut -d' ' -f1)" >>"$OURS"
  printf 'tokenmesh\t%s\t%s\t%s\n' "$n" "$rss_ready" "$(mem "$pid" VmHWM)" >>"$RSS"
  stop

  # llama-server: -np N slots (one per stream), N × CTX_PER_SLOT context.
  port=$(free_port); llog=$LOGS/llama-server-$n.log
  "$LLAMA_SERVER" -m "$MODEL" -t "$THREADS" -tb "$THREADS" -np "$n" -c $((n * CTX_PER_SLOT)) \
    --host 127.0.0.1 --port "$port" >"$llog" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    python3 -c 'import sys, urllib.request; urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/health", timeout=1)' "$port" 2>/dev/null && break
    kill -0 "$pid" || { tail "$llog"; exit 1; }
    sleep 0.2
  done
  rss_ready=$(mem "$pid" VmRSS)
  echo "llama-server $n streams: load $(load)" >>"$MACHINE"
  python3 scripts/llama_server_bench.py --url "http://127.0.0.1:$port/completion" \
    --concurrency "$n" --duration "$DURATION" --warmup "$WARMUP" --max-tokens "$MAX_TOKENS" \
    --prompt-words "$PROMPT_WORDS" "${llama_sampling[@]}" \
    --label engine=llama-server --label "load_1min=$(load | cut -d' ' -f1)" >>"$LLAMA"
  printf 'llama-server\t%s\t%s\t%s\n' "$n" "$rss_ready" "$(mem "$pid" VmHWM)" >>"$RSS"
  stop
done
echo "finished: $(date -u +%FT%TZ), load average $(load)" >>"$MACHINE"

python3 - "$OURS" "$LLAMA" "$RSS" >"$OUT/$TAG-summary.txt" <<'EOF'
import json, sys
ours = {r["labels"]["concurrency"]: r for r in map(json.loads, open(sys.argv[1]))}
theirs = {r["labels"]["concurrency"]: r for r in map(json.loads, open(sys.argv[2]))}
rss = {}
for line in open(sys.argv[3]).read().splitlines()[1:]:
    e, n, ready, hwm = line.split("\t")
    rss[(e, n)] = int(hwm) / 1024
print("| streams | engine | tokens/s | TTFT p50 / p99 ms | inter-token p50 / p99 ms | peak RSS MiB | load (1 min) |")
print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
for n in ours:
    for name, r in (("tokenmesh", ours[n]), ("llama-server", theirs.get(n))):
        if r is None:
            continue
        t, i = r["ttft_ms"], r["itl_ms"]
        print(f"| {n} | {name} | {r['output_tokens_per_sec']:.1f} | {t['p50']:.0f} / {t['p99']:.0f} | "
              f"{i['p50']:.1f} / {i['p99']:.1f} | {rss.get((name, n), 0):.0f} | {r['labels'].get('load_1min', '')} |")
print()
# A window in which no request finished (a long request at many streams) has
# no latencies: no ratio rather than a division by zero.
ratio = lambda x, y: f"{x / y:.2f}" if y else "-"
print("| streams | tokens/s ours / llama.cpp | TTFT p50 ours / llama.cpp | ITL p50 ours / llama.cpp | tokens per request, ours (estimated) / llama-server | llama-server requests at max_tokens |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
for n in ours:
    a, b = ours[n], theirs.get(n)
    if b is None:
        continue
    est = 1 + (a["e2e_ms"]["mean"] - a["ttft_ms"]["mean"]) / a["itl_ms"]["mean"] if a["itl_ms"]["mean"] else 0
    ls = b.get("llama_server", {})
    print(f"| {n} | {ratio(a['output_tokens_per_sec'], b['output_tokens_per_sec'])} | "
          f"{ratio(a['ttft_ms']['p50'], b['ttft_ms']['p50'])} | {ratio(a['itl_ms']['p50'], b['itl_ms']['p50'])} | "
          f"{est:.1f} / {ls.get('completion_tokens_mean') or 0:.1f} | {100 * (ls.get('full_length_share') or 0):.0f} % |")
EOF
cat "$OUT/$TAG-summary.txt"
echo "server logs: $LOGS"
