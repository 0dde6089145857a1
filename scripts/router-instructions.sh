#!/usr/bin/env bash
# The router's user-space instructions per request under callgrind (BENCHMARKS.md, "The router's
# hop and telemetry's cost"): repeatable on a shared machine, unlike wall-clock figures.
# Usage: scripts/router-instructions.sh BINDIR OUTPREFIX [REQUESTS] [CONCURRENCY] [TOKENS] [ROUTER FLAGS...]
# Needs valgrind. Starts a synthetic worker (1000 tokens/s per sequence) and a router under
# callgrind with instrumentation off, warms up with 40 requests, counts REQUESTS requests.
# MESH=1 counts the worker too: it runs under callgrind as well and gets the same flags (a
# --metrics-listen address becomes a free port of its own), and the count goes on 6 s past the
# last request, longer than the batch span exporter's 5 s delay, so that the last requests'
# spans are exported inside it (BENCHMARKS.md, "Telemetry's cost across the mesh"). Both log at
# LOG (default warn; the servers' own default is info).
set -euo pipefail
BIN=$1; OUTP=$2; N=${3:-300}; C=${4:-4}; TOK=${5:-50}; if [ $# -ge 5 ]; then shift 5; else set --; fi
EXTRA=("$@")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
cg=(valgrind --tool=callgrind --instr-atstart=no)
WORKER_CG=(); WORKER_FLAGS=()
if [ -n "${MESH:-}" ]; then
  WORKER_CG=("${cg[@]}" --callgrind-out-file=$OUTP.worker.%p)
  prev=
  for a in "${EXTRA[@]}"; do
    [ "$prev" = --metrics-listen ] && a="127.0.0.1:$(free_port)"
    WORKER_FLAGS+=("$a"); prev=$a
  done
fi
wp=$(free_port); rp=$(free_port); d=$(mktemp -d)
"${WORKER_CG[@]}" $BIN/tokenmesh-worker --insecure --listen 127.0.0.1:$wp --worker-id cg --model-name synthetic --log "${LOG:-warn}" \
  --engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 --queue-capacity 1024 "${WORKER_FLAGS[@]}" >$d/w.log 2>&1 & WP=$!
printf '[[workers]]\nid = "cg"\nmodel = "synthetic"\nversion = "v1"\naddr = "http://127.0.0.1:%s"\n\n[models."synthetic"]\nstable = "v1"\n' $wp >$d/s.toml
"${cg[@]}" --callgrind-out-file=$OUTP.%p \
  $BIN/tokenmesh-router --insecure --listen 127.0.0.1:$rp --static $d/s.toml --log "${LOG:-warn}" "${EXTRA[@]}" >$d/r.log 2>&1 & RP=$!
trap 'kill $WP $RP 2>/dev/null || true; rm -rf "$d"' EXIT
for _ in $(seq 600); do
  kill -0 $WP $RP 2>/dev/null || { echo "the worker or the router exited:" >&2; tail -n 5 $d/w.log $d/r.log >&2; exit 1; }
  $BIN/meshctl models --insecure --router 127.0.0.1:$rp 2>/dev/null | grep -q " 1  cg" && break; sleep 0.2
done
counted=($RP); [ -n "${MESH:-}" ] && counted+=($WP)
# warm-up (connections, first registrations), not counted
$BIN/meshctl bench --target 127.0.0.1:$rp --concurrency $C --max-tokens $TOK --prompt-words 32 --requests 40 --duration 600 --warmup 0 --output json --no-progress >/dev/null
for p in "${counted[@]}"; do callgrind_control -i on $p >/dev/null; done
$BIN/meshctl bench --target 127.0.0.1:$rp --concurrency $C --max-tokens $TOK --prompt-words 32 --requests $N --duration 600 --warmup 0 --output json --no-progress > $OUTP.bench.json
[ -n "${MESH:-}" ] && sleep 6
for p in "${counted[@]}"; do callgrind_control -i off $p >/dev/null; callgrind_control -d $p >/dev/null; done
sleep 1
kill "${counted[@]}"; wait "${counted[@]}" 2>/dev/null || true
# awk reads to the end: `grep -m1` closing the pipe early fails the script under pipefail.
total() { callgrind_annotate "$(ls -S "$1"* | head -1)" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done {gsub(",","",$1); print $1; done=1}'; }
ir=$(total $OUTP.$RP)
python3 -c "
import json,sys
r=json.load(open('$OUTP.bench.json'))
n=r['requests']; print('requests', n, 'errors', r['errors'])
" || true
echo "Ir total $ir; per request $(( ir / N )); per token $(( ir / (N * TOK) ))"
if [ -n "${MESH:-}" ]; then
  w=$(total $OUTP.worker.$WP)
  echo "worker per request $(( w / N )); mesh (worker + router) per request $(( (w + ir) / N ))"
fi
