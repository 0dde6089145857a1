#!/usr/bin/env bash
# The router's user-space instructions per request under callgrind (BENCHMARKS.md, "The router's
# hop and telemetry's cost"): repeatable on a shared machine, unlike wall-clock figures.
# Usage: scripts/router-instructions.sh BINDIR OUTPREFIX [REQUESTS] [CONCURRENCY] [TOKENS] [ROUTER FLAGS...]
# Needs valgrind. Starts a synthetic worker (1000 tokens/s per sequence) and a router under
# callgrind with instrumentation off, warms up with 40 requests, counts REQUESTS requests.
set -euo pipefail
BIN=$1; OUTP=$2; N=${3:-300}; C=${4:-4}; TOK=${5:-50}; if [ $# -ge 5 ]; then shift 5; else set --; fi
EXTRA=("$@")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wp=$(free_port); rp=$(free_port); d=$(mktemp -d)
$BIN/tokenmesh-worker --insecure --listen 127.0.0.1:$wp --worker-id cg --model-name synthetic --log warn \
  --engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 --queue-capacity 1024 >$d/w.log 2>&1 & WP=$!
printf '[[workers]]\nid = "cg"\nmodel = "synthetic"\nversion = "v1"\naddr = "http://127.0.0.1:%s"\n\n[models."synthetic"]\nstable = "v1"\n' $wp >$d/s.toml
valgrind --tool=callgrind --callgrind-out-file=$OUTP.%p --instr-atstart=no \
  $BIN/tokenmesh-router --insecure --listen 127.0.0.1:$rp --static $d/s.toml --log warn "${EXTRA[@]}" >$d/r.log 2>&1 & RP=$!
trap 'kill $WP $RP 2>/dev/null || true; rm -rf "$d"' EXIT
for _ in $(seq 600); do $BIN/meshctl models --insecure --router 127.0.0.1:$rp 2>/dev/null | grep -q " 1  cg" && break; sleep 0.2; done
# warm-up (connections, first registrations), not counted
$BIN/meshctl bench --target 127.0.0.1:$rp --concurrency $C --max-tokens $TOK --prompt-words 32 --requests 40 --duration 600 --warmup 0 --output json --no-progress >/dev/null
callgrind_control -i on $RP >/dev/null
$BIN/meshctl bench --target 127.0.0.1:$rp --concurrency $C --max-tokens $TOK --prompt-words 32 --requests $N --duration 600 --warmup 0 --output json --no-progress > $OUTP.bench.json
callgrind_control -i off $RP >/dev/null
callgrind_control -d $RP >/dev/null
sleep 1
kill $RP; wait $RP 2>/dev/null || true
f=$(ls -S $OUTP.$RP* | head -1)
# awk reads to the end: `grep -m1` closing the pipe early fails the script under pipefail.
ir=$(callgrind_annotate $f 2>/dev/null | awk '/PROGRAM TOTALS/ && !done {gsub(",","",$1); print $1; done=1}')
python3 -c "
import json,sys
r=json.load(open('$OUTP.bench.json'))
n=r['requests']; print('requests', n, 'errors', r['errors'])
" || true
echo "Ir total $ir; per request $(( ir / N )); per token $(( ir / (N * TOK) ))"
