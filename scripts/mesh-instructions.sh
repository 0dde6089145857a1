#!/usr/bin/env bash
# The worker's and the router's user-space instructions per request under
# callgrind, both processes given the same extra flags (BENCHMARKS.md, issue 20:
# telemetry's cost): repeatable on a shared machine, unlike wall-clock figures.
# Usage: scripts/mesh-instructions.sh BINDIR OUTPREFIX [REQUESTS] [CONCURRENCY] [TOKENS] [FLAGS...]
# A synthetic worker (1000 tokens/s per sequence) and a router, both under
# callgrind with instrumentation off; 40 warm-up requests, then REQUESTS counted
# requests, then 6 s more counted (longer than the batch span exporter's 5 s
# delay) so that the spans of the last requests are exported inside the count.
set -euo pipefail
BIN=$1; OUTP=$2; N=${3:-300}; C=${4:-4}; TOK=${5:-50}; if [ $# -ge 5 ]; then shift 5; else set --; fi
EXTRA=("$@")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# METRICS among the flags: each process gets its own free port there.
WF=(); RF=()
for a in "${EXTRA[@]}"; do
  if [ "$a" = METRICS ]; then WF+=("127.0.0.1:$(free_port)"); RF+=("127.0.0.1:$(free_port)"); else WF+=("$a"); RF+=("$a"); fi
done
wp=$(free_port); rp=$(free_port); d=$(mktemp -d)
cg=(valgrind --tool=callgrind --instr-atstart=no)
"${cg[@]}" --callgrind-out-file=$OUTP.worker.%p $BIN/tokenmesh-worker --insecure --listen 127.0.0.1:$wp --worker-id cg \
  --model-name synthetic --log warn --engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 \
  --queue-capacity 1024 "${WF[@]}" >$d/w.log 2>&1 & WP=$!
printf '[[workers]]\nid = "cg"\nmodel = "synthetic"\nversion = "v1"\naddr = "http://127.0.0.1:%s"\n\n[models."synthetic"]\nstable = "v1"\n' $wp >$d/s.toml
"${cg[@]}" --callgrind-out-file=$OUTP.router.%p $BIN/tokenmesh-router --insecure --listen 127.0.0.1:$rp \
  --static $d/s.toml --log warn "${RF[@]}" >$d/r.log 2>&1 & RP=$!
trap 'kill $WP $RP 2>/dev/null || true; cp $d/w.log $OUTP.worker.log; cp $d/r.log $OUTP.router.log; rm -rf "$d"' EXIT
for _ in $(seq 600); do kill -0 $RP $WP 2>/dev/null || { echo "a process exited; logs in $OUTP.*.log" >&2; exit 1; }; $BIN/meshctl models --insecure --router 127.0.0.1:$rp 2>/dev/null | grep -q " 1  cg" && break; sleep 0.2; done
bench() { $BIN/meshctl bench --target 127.0.0.1:$rp --concurrency $C --max-tokens $TOK --prompt-words 32 --requests "$1" --duration 600 --warmup 0 --output json --no-progress; }
bench 40 >/dev/null # warm-up (connections, first registrations), not counted
callgrind_control -i on $WP >/dev/null; callgrind_control -i on $RP >/dev/null
bench "$N" >$OUTP.bench.json
sleep 6
for p in $WP $RP; do callgrind_control -i off $p >/dev/null; callgrind_control -d $p >/dev/null; done
sleep 1
kill $WP $RP; wait $WP $RP 2>/dev/null || true
total() { callgrind_annotate "$(ls -S "$1".* | head -1)" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done {gsub(",","",$1); print $1; done=1}'; }
w=$(total $OUTP.worker.$WP); r=$(total $OUTP.router.$RP)
python3 -c "
import json
r=json.load(open('$OUTP.bench.json'))
print('requests', r['requests'], 'errors', r['errors'])
" || true
echo "per request: worker $(( w / N )), router $(( r / N )), both $(( (w + r) / N ))"
