#!/usr/bin/env bash
# The router's instructions per request with telemetry off, on (OTLP export to
# scripts/otlp_sink.py and --metrics-listen) and on at --trace-sampling-ratio 0.1,
# RUNS runs each, interleaved (BENCHMARKS.md, issue 20). Wraps
# scripts/router-instructions.sh, so MESH=1 counts the worker's instructions too (each
# process given the telemetry flags); needs valgrind and a python with grpcio for the sink.
# Usage: scripts/telemetry-instructions.sh BINDIR OUTDIR [RUNS] [REQUESTS]
set -euo pipefail
BIN=$1; OUT=$2; RUNS=${3:-2}; N=${4:-300}
PY=${SINK_PYTHON:-${TOKENMESH_PYTHON:-python3}}
mkdir -p "$OUT"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
sp=$(free_port)
"$PY" scripts/otlp_sink.py "$sp" >"$OUT/sink.log" 2>&1 & SINK=$!
trap 'kill $SINK 2>/dev/null || true' EXIT
for _ in $(seq 100); do (exec 3<>/dev/tcp/127.0.0.1/$sp) 2>/dev/null && break; sleep 0.1; done
on=(--otlp-endpoint "http://127.0.0.1:$sp")
for run in $(seq "$RUNS"); do
  for mode in off on ratio0.1; do
    case $mode in
      off) flags=() ;;
      on) flags=("${on[@]}" --metrics-listen "127.0.0.1:$(free_port)") ;;
      ratio0.1) flags=("${on[@]}" --metrics-listen "127.0.0.1:$(free_port)" --trace-sampling-ratio 0.1) ;;
    esac
    line=$(scripts/router-instructions.sh "$BIN" "$OUT/cg-$mode-$run" "$N" 4 50 "${flags[@]}" | tr '\n' ' ')
    echo "telemetry $mode run $run (load $(cut -d' ' -f1-3 /proc/loadavg)): $line" | tee -a "$OUT/summary.txt"
  done
done
kill $SINK; wait $SINK 2>/dev/null || true
echo "sink: $(tail -1 "$OUT/sink.log")" | tee -a "$OUT/summary.txt"
