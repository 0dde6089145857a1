#!/usr/bin/env bash
# Reproduces the measurements in BENCHMARKS.md: builds in release mode, then
# (1) the synthetic engine directly and through the router, side by side,
# (2) the real model through the router at 1, 4 and 16 streams,
# (3) llama.cpp on the same model and thread count, if llama-cpp-python is
#     available (LLAMACPP_PYTHON, default /tmp/llamacpp-venv/bin/python),
# (4) the 27-point sweep with heatmaps,
# (5) the streamed tokens/s ceiling: a fast synthetic engine (1000 tok/s per
#     sequence, 100 streams) directly and through the router, with the
#     router's CPU time per run,
# (6) proxies: the same load directly to a worker, through tokenmesh-router and
#     through nginx as a plain gRPC proxy (grpc_pass), interleaved, at 100
#     streams, for added time to first token, then at the ceiling load with
#     each proxy's CPU time (needs nginx: apt-get install nginx),
# (7) observability: the router and worker with tracing (OTLP export to
#     scripts/otlp_sink.py, or to a closed port with OTLP_SINK=down) and
#     metrics on, against a mesh with both off, interleaved; TRACE_RATIO=0.1
#     passes --trace-sampling-ratio to the traced router and worker,
# (8) sampling (issue 20): the real model through the router at 1, 4, 16 and
#     32 streams, greedy (temperature 0) and at the server's sampling
#     defaults (temperature 1, no top-k or top-p), interleaved run by run,
#     every request generating its 64 tokens (--ignore-eos), so that both
#     settings do the same prefill and decode work (SAMPLING_STREAMS, default
#     "1 4 16 32", picks the stream counts),
# (9) openai: the router's OpenAI-compatible HTTP API (--api openai, HTTP/1.1
#     and HTTP/2) against its gRPC API, same router and worker, interleaved,
#     at 100 streams,
# (10) hop (issue 20): the router's hop pinned: tokenmesh-router and nginx
#     (one worker process) on their own core with taskset (PROXY_CPU, default
#     1), the worker and the load generator on the other (LOAD_CPU, default
#     0); direct vs router vs nginx interleaved at 20 and 100 streams, with
#     each proxy's CPU time per streamed token; BASE_BIN=DIR adds a second
#     router from DIR (path router-base, e.g. a build of main) to the rotation.
# (11) upstream (issue 21): llama-server (scripts/llama-cpp.sh) called
#     directly against the same llama-server behind the router and an
#     upstream worker (of the llama-server kind, and of the openai kind on
#     the direct path's own endpoint), interleaved, same prompts, prompt
#     cache off, at 1 and 16 streams, with the worker's own part of each
#     first token's time;
#     llama-server pinned to CPU ENGINE_CPU (default 0), the worker, the
#     router and the load generator to CPU PROXY_CPU (default 1), both paths.
# (12) prefix (issue 17): the multi-turn chat workload (meshctl bench chat)
#     against 4 real-model workers behind one router: cache-aware routing
#     with prefix caching on, P2C with caching on, and P2C with caching off
#     (workers without --prefix-cache run the caching-off arms only, under
#     both worker choices).
# ONLY="synthetic real llamacpp sweep ceiling proxies observability sampling openai hop upstream prefix" picks sections.
# Results go to $OUT (default bench-results/). Every run is short: the whole
# script takes about ten minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-results}
REPS=${REPS:-3}
THREADS=${THREADS:-1}
LLAMACPP_PYTHON=${LLAMACPP_PYTHON:-/tmp/llamacpp-venv/bin/python}
mkdir -p "$OUT"
# BIN=DIR runs binaries built elsewhere (e.g. a baseline) and skips the build;
# NO_BUILD=1 uses the binaries already in target/release.
if [ -z "${BIN:-}" ]; then
  [ -n "${NO_BUILD:-}" ] || cargo build --release --workspace
  BIN=target/release
fi

want() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
if want real || want llamacpp || want sampling || want upstream || want prefix; then
  MODEL=$($BIN/meshctl fetch-model --python "${TOKENMESH_PYTHON:-python3}")
fi
cpu_secs() { # utime + stime of a process, seconds
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"
}
since() { # since BEFORE NOW: NOW - BEFORE, for CPU seconds and clock readings
  awk -v a="$1" -v b="$2" 'BEGIN { print b - a }'
}
pids=(); tmpdirs=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true
  for d in "${tmpdirs[@]}"; do rm -rf "$d"; done
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_for() { # wait until meshctl can list models at $1
  for _ in $(seq 100); do $BIN/meshctl models --insecure --router "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "nothing serves on $1" >&2; return 1
}
ROUTER_ARGS=() # extra router flags for the next mesh
WORKER_PIN=() ROUTER_PIN=() # e.g. (taskset -c 0): where the next mesh's worker and router run
mesh() { # mesh NAME MODEL_NAME WORKER_ARGS...: one worker and a router; sets WORKER, ROUTER, WORKER_PID, ROUTER_PID
  # (WORKER_LOG, WORKER_LOG_FORMAT: the worker's --log and --log-format, default warn and text)
  local name=$1 model=$2; shift 2
  local wp rp; wp=$(free_port); rp=$(free_port)
  "${WORKER_PIN[@]}" $BIN/tokenmesh-worker --insecure --listen 127.0.0.1:$wp --worker-id "$name" --model-name "$model" \
    --log "${WORKER_LOG:-warn}" --log-format "${WORKER_LOG_FORMAT:-text}" "$@" \
    >"$OUT/$name-worker.log" 2>&1 & pids+=($!); WORKER_PID=$!
  printf '[[workers]]\nid = "%s"\nmodel = "%s"\nversion = "v1"\naddr = "http://127.0.0.1:%s"\n\n[models."%s"]\nstable = "v1"\n' \
    "$name" "$model" "$wp" "$model" >"$OUT/$name-static.toml"
  "${ROUTER_PIN[@]}" $BIN/tokenmesh-router --insecure --listen 127.0.0.1:$rp --static "$OUT/$name-static.toml" --log warn "${ROUTER_ARGS[@]}" \
    >"$OUT/$name-router.log" 2>&1 & pids+=($!)
  WORKER=127.0.0.1:$wp; ROUTER=127.0.0.1:$rp; ROUTER_PID=$!
  wait_for "$ROUTER"
  for _ in $(seq 100); do $BIN/meshctl models --insecure --router "$ROUTER" | grep -q " 1  $name" && return 0; sleep 0.1; done
}

tag() { # tag PATH REP: adds labels.path and labels.rep to the JSON report lines on stdin
  python3 -c 'import json, sys
for line in sys.stdin:
    if line.strip():
        r = json.loads(line); r["labels"]["path"] = sys.argv[1]; r["labels"]["rep"] = sys.argv[2]
        print(json.dumps(r))' "$1" "$2"
}
tree_cpu_secs() { # CPU seconds of a process and its children (nginx: master and workers)
  local total=0 p
  for p in "$1" $(pgrep -P "$1" || true); do total=$(awk -v a="$total" -v b="$(cpu_secs "$p")" 'BEGIN { print a + b }'); done
  echo "$total"
}
wait_port() { # wait until something accepts TCP connections on $1 (host:port)
  for _ in $(seq 100); do
    python3 -c 'import socket, sys; h, p = sys.argv[1].rsplit(":", 1); socket.create_connection((h, int(p)), 0.2)' "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  echo "nothing listens on $1" >&2; return 1
}
NGINX_PIN=()
start_nginx() { # start_nginx NAME UPSTREAM: nginx as a plain gRPC proxy to UPSTREAM; sets NGINX, NGINX_PID
  local name=$1 upstream=$2 np d
  np=$(free_port); d=$(mktemp -d); tmpdirs+=("$d")
  # Plain grpc_pass with an upstream keepalive pool; one worker process per
  # core (auto), access log off. keepalive_requests is raised from its
  # default of 1000: at 1000 requests nginx sends the client's connection a
  # GOAWAY, and with the load generator's one connection that failed one
  # stream in flight per 1000 requests (one INTERNAL, one CANCELLED).
  cat >"$d/nginx.conf" <<EOF
worker_processes ${NGINX_WORKERS:-auto};
daemon off;
pid $d/nginx.pid;
error_log $d/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $d/body; proxy_temp_path $d/proxy; fastcgi_temp_path $d/fastcgi;
  uwsgi_temp_path $d/uwsgi; scgi_temp_path $d/scgi;
  upstream worker { server $upstream; keepalive 256; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:$np http2;
    keepalive_requests 1000000;
    http2_max_concurrent_streams 1024;
    location / {
      grpc_pass grpc://worker;
      grpc_read_timeout 300s;
      grpc_send_timeout 300s;
    }
  }
}
EOF
  cp "$d/nginx.conf" "$OUT/$name-nginx.conf"
  "${NGINX_PIN[@]}" nginx -c "$d/nginx.conf" -p "$d" >"$OUT/$name-nginx.log" 2>&1 & pids+=($!)
  NGINX=127.0.0.1:$np; NGINX_PID=$!
  wait_port "$NGINX"
}

if want synthetic; then
echo "== synthetic engine: direct vs router"
mesh synthetic synthetic --engine synthetic --synthetic-tokens-per-sec 100 --max-batch 256 --queue-capacity 1024
: >"$OUT/synthetic.jsonl"
for c in 16 100; do
  for rep in $(seq "$REPS"); do
    for to in direct router; do
      if [ $to = direct ]; then args=(--direct --target "$WORKER"); else args=(--target "$ROUTER"); fi
      $BIN/meshctl bench "${args[@]}" --concurrency $c --max-tokens 50 --prompt-words 32 \
        --duration 5 --warmup 1 --seed "$rep" --output json --no-progress >>"$OUT/synthetic.jsonl"
    done
  done
done
cleanup; pids=()
fi

if want real; then
echo "== real model through the router ($THREADS thread(s))"
mesh real smollm2-135m-instruct --model "$MODEL" --threads "$THREADS" --max-batch 16
: >"$OUT/real.jsonl"
for c in 1 4 16; do
  $BIN/meshctl bench --target "$ROUTER" --concurrency $c --max-tokens 32 --prompt-words 32 --temperature 0 \
    --duration 10 --warmup 2 --repeat "$REPS" --output json --no-progress >>"$OUT/real.jsonl"
done
cleanup; pids=()
fi

if ! want llamacpp; then
  :
elif [ -x "$LLAMACPP_PYTHON" ]; then
  echo "== llama.cpp, $THREADS thread(s)"
  "$LLAMACPP_PYTHON" scripts/llamacpp_bench.py --model "$MODEL" --threads "$THREADS" --max-tokens 32 --reps "$REPS" \
    | tee "$OUT/llamacpp.txt"
else
  echo "== llama.cpp skipped: $LLAMACPP_PYTHON not found"
fi

if want sweep; then
echo "== sweep (synthetic engine)"
$BIN/meshctl bench sweep --engine synthetic --synthetic-tokens-per-sec 50 --duration 2 --warmup 0.5 \
  --max-tokens 32 --out-dir "$OUT/sweep" --output json --no-progress >/dev/null
fi

if want ceiling; then
echo "== streamed tokens/s ceiling: synthetic engine at 1000 tok/s per sequence, 100 streams"
mesh ceiling synthetic --engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 --queue-capacity 1024
: >"$OUT/ceiling.jsonl"; : >"$OUT/ceiling-router-cpu.txt"
for rep in $(seq "$REPS"); do
  for to in direct router; do
    if [ $to = direct ]; then args=(--direct --target "$WORKER"); else args=(--target "$ROUTER"); fi
    before=$(cpu_secs "$ROUTER_PID")
    $BIN/meshctl bench "${args[@]}" --concurrency 100 --max-tokens 200 --prompt-words 32 \
      --duration 4 --warmup 1 --seed "$rep" --output json --no-progress >>"$OUT/ceiling.jsonl"
    echo "$to rep $rep: router CPU $(since "$before" "$(cpu_secs "$ROUTER_PID")") s over 5 s" \
      | tee -a "$OUT/ceiling-router-cpu.txt"
  done
done
cleanup; pids=()
fi

if want proxies; then
echo "== proxies: direct vs tokenmesh-router vs nginx (grpc_pass), 100 streams"
command -v nginx >/dev/null || { echo "nginx is not installed (apt-get install nginx)" >&2; exit 1; }
{ nginx -v 2>&1; nproc; uptime; } | tee "$OUT/proxies-machine.txt"
# (a) added time to first token: 100 tokens/s per sequence, 50 tokens.
mesh proxies synthetic --engine synthetic --synthetic-tokens-per-sec 100 --max-batch 256 --queue-capacity 1024
start_nginx proxies "$WORKER"
: >"$OUT/proxies.jsonl"
for rep in $(seq "$REPS"); do
  for to in direct router nginx; do
    case $to in
      direct) args=(--direct --target "$WORKER") ;;
      router) args=(--target "$ROUTER") ;;
      nginx) args=(--direct --target "$NGINX") ;; # nginx forwards Worker.Generate as is
    esac
    $BIN/meshctl bench "${args[@]}" --concurrency 100 --max-tokens 50 --prompt-words 32 \
      --duration 5 --warmup 1 --seed "$rep" --output json --no-progress | tag $to "$rep" >>"$OUT/proxies.jsonl"
  done
done
cleanup; pids=()
# (b) the ceiling: 1000 tokens/s per sequence, 200 tokens, with each proxy's CPU time.
mesh proxies-ceiling synthetic --engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 --queue-capacity 1024
start_nginx proxies-ceiling "$WORKER"
: >"$OUT/proxies-ceiling.jsonl"; : >"$OUT/proxies-ceiling-cpu.txt"
for rep in $(seq "$REPS"); do
  for to in direct router nginx; do
    case $to in
      direct) args=(--direct --target "$WORKER"); pid=$$ ;; # no proxy: the figure is meaningless
      router) args=(--target "$ROUTER"); pid=$ROUTER_PID ;;
      nginx) args=(--direct --target "$NGINX"); pid=$NGINX_PID ;;
    esac
    before=$(tree_cpu_secs "$pid"); t0=$(date +%s.%N)
    line=$($BIN/meshctl bench "${args[@]}" --concurrency 100 --max-tokens 200 --prompt-words 32 \
      --duration 4 --warmup 1 --seed "$rep" --output json --no-progress | tag $to "$rep")
    echo "$line" >>"$OUT/proxies-ceiling.jsonl"
    cpu=$(since "$before" "$(tree_cpu_secs "$pid")")
    wall=$(since "$t0" "$(date +%s.%N)")
    # Tokens the proxy streamed in the whole run (warm-up, window, drain) per
    # CPU-second it used; the window's rate times the wall time approximates them.
    tps=$(echo "$line" | python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["output_tokens_per_sec"])')
    [ $to = direct ] && { echo "direct rep $rep: tokens/s $tps" | tee -a "$OUT/proxies-ceiling-cpu.txt"; continue; }
    echo "$to rep $rep: tokens/s $tps, proxy CPU $cpu s over $wall s wall, streamed tokens per proxy CPU-second $(awk -v t="$tps" -v c="$cpu" -v w="$wall" 'BEGIN { if (c > 0) printf "%.0f", t * w / c; else print "n/a" }')" \
      | tee -a "$OUT/proxies-ceiling-cpu.txt"
  done
done
cleanup; pids=()
python3 scripts/bench_compare.py "$OUT/proxies.jsonl" | tee "$OUT/proxies-compare.md"
python3 scripts/bench_compare.py "$OUT/proxies-ceiling.jsonl" | tee "$OUT/proxies-ceiling-compare.md"
fi

if want hop; then
echo "== hop: direct vs router vs nginx, proxies pinned to CPU ${PROXY_CPU:-1}, worker and load on CPU ${LOAD_CPU:-0}"
command -v nginx >/dev/null || { echo "nginx is not installed (apt-get install nginx)" >&2; exit 1; }
command -v taskset >/dev/null || { echo "taskset is not installed (util-linux)" >&2; exit 1; }
PROXY_CPU=${PROXY_CPU:-1}; LOAD_CPU=${LOAD_CPU:-0}
{ nginx -v 2>&1; nproc; uptime; echo "proxies on CPU $PROXY_CPU, worker and load generator on CPU $LOAD_CPU"; } \
  | tee "$OUT/hop-machine.txt"
# The engine at 1000 tokens/s per sequence, 50 tokens per request: request-heavy,
# so the per-request work of the hop shows as well as the per-token work.
WORKER_PIN=(taskset -c "$LOAD_CPU"); ROUTER_PIN=(taskset -c "$PROXY_CPU"); NGINX_PIN=(taskset -c "$PROXY_CPU")
mesh hop synthetic --engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 --queue-capacity 1024
NGINX_WORKERS=1 start_nginx hop "$WORKER" # one worker process: one core, as the router has
paths=(direct router nginx)
if [ -n "${BASE_BIN:-}" ]; then
  bp=$(free_port)
  "${ROUTER_PIN[@]}" "$BASE_BIN/tokenmesh-router" --insecure --listen 127.0.0.1:$bp --static "$OUT/hop-static.toml" --log warn \
    >"$OUT/hop-router-base.log" 2>&1 & pids+=($!)
  BASE_ROUTER=127.0.0.1:$bp; BASE_PID=$!
  wait_for "$BASE_ROUTER"
  for _ in $(seq 100); do $BIN/meshctl models --insecure --router "$BASE_ROUTER" | grep -q " 1  hop" && break; sleep 0.1; done
  paths=(direct router-base router nginx)
fi
WORKER_PIN=(); ROUTER_PIN=(); NGINX_PIN=()
: >"$OUT/hop-cpu.txt"
for c in 20 100; do
  : >"$OUT/hop-c$c.jsonl"
  for rep in $(seq "$REPS"); do
    for to in "${paths[@]}"; do
      case $to in
        direct) args=(--direct --target "$WORKER"); pid= ;;
        router) args=(--target "$ROUTER"); pid=$ROUTER_PID ;;
        router-base) args=(--target "$BASE_ROUTER"); pid=$BASE_PID ;;
        nginx) args=(--direct --target "$NGINX"); pid=$NGINX_PID ;;
      esac
      before=0; [ -n "$pid" ] && before=$(tree_cpu_secs "$pid"); t0=$(date +%s.%N)
      line=$(taskset -c "$LOAD_CPU" $BIN/meshctl bench "${args[@]}" --concurrency $c --max-tokens 50 --prompt-words 32 \
        --duration 5 --warmup 1 --seed "$rep" --output json --no-progress | tag $to "$rep")
      echo "$line" >>"$OUT/hop-c$c.jsonl"
      [ -z "$pid" ] && continue
      cpu=$(since "$before" "$(tree_cpu_secs "$pid")")
      wall=$(since "$t0" "$(date +%s.%N)")
      tps=$(echo "$line" | python3 -c 'import json, sys; print(json.loads(sys.stdin.read())["output_tokens_per_sec"])')
      # The window's rate times the run's wall time approximates the tokens
      # the proxy streamed over the run (warm-up, window and drain).
      echo "c=$c $to rep $rep: tokens/s $tps, proxy CPU $cpu s over $wall s, CPU per streamed token $(awk -v t="$tps" -v c="$cpu" -v w="$wall" 'BEGIN { if (t > 0) printf "%.2f", 1e6 * c / (t * w); else print "n/a" }') us" \
        | tee -a "$OUT/hop-cpu.txt"
    done
  done
  python3 scripts/bench_compare.py "$OUT/hop-c$c.jsonl" | tee "$OUT/hop-c$c-compare.md"
done
cleanup; pids=()
echo "== hop summary: proxy CPU per streamed token (utime+stime / tokens streamed), target: router <= nginx"
python3 scripts/hop_summary.py "$OUT/hop-cpu.txt" | tee "$OUT/hop-summary.md"
fi

if want observability; then
echo "== observability: router tracing + metrics on vs off, 100 streams"
SINK_PYTHON=${SINK_PYTHON:-${TOKENMESH_PYTHON:-python3}}
sink_port=$(free_port)
if [ "${OTLP_SINK:-up}" = up ]; then
  "$SINK_PYTHON" scripts/otlp_sink.py "$sink_port" >"$OUT/otlp-sink.log" 2>&1 & pids+=($!); SINK_PID=$!
  wait_port "127.0.0.1:$sink_port"
fi # else nothing listens there: the collector is down
{ echo "collector: ${OTLP_SINK:-up} (127.0.0.1:$sink_port)"
  echo "sampler: ${TRACE_RATIO:+--trace-sampling-ratio $TRACE_RATIO}${TRACE_RATIO:-${OTEL_TRACES_SAMPLER:-default (parent-based, always on)} ${OTEL_TRACES_SAMPLER_ARG:-}}"
  nproc; uptime; } | tee "$OUT/observability-machine.txt"
obs_args=(--engine synthetic --synthetic-tokens-per-sec 1000 --max-batch 256 --queue-capacity 1024)
ROUTER_ARGS=()
mesh obs-off synthetic "${obs_args[@]}"
OFF_WORKER=$WORKER; OFF_ROUTER=$ROUTER; OFF_PID=$ROUTER_PID; OFF_WPID=$WORKER_PID
ratio_args=(); [ -n "${TRACE_RATIO:-}" ] && ratio_args=(--trace-sampling-ratio "$TRACE_RATIO")
ROUTER_ARGS=(--otlp-endpoint "http://127.0.0.1:$sink_port" --metrics-listen "127.0.0.1:$(free_port)" "${ratio_args[@]}")
mesh obs-on synthetic "${obs_args[@]}" --otlp-endpoint "http://127.0.0.1:$sink_port" --metrics-listen "127.0.0.1:$(free_port)" "${ratio_args[@]}"
ON_ROUTER=$ROUTER; ON_PID=$ROUTER_PID; ON_WPID=$WORKER_PID
ROUTER_ARGS=()
: >"$OUT/observability.jsonl"; : >"$OUT/observability-cpu.txt"
for rep in $(seq "$REPS"); do
  for to in direct router-off router-on; do
    case $to in
      direct) args=(--direct --target "$OFF_WORKER"); pid=$OFF_PID; wpid=$OFF_WPID ;;
      router-off) args=(--target "$OFF_ROUTER"); pid=$OFF_PID; wpid=$OFF_WPID ;;
      router-on) args=(--target "$ON_ROUTER"); pid=$ON_PID; wpid=$ON_WPID ;;
    esac
    before=$(cpu_secs "$pid"); wbefore=$(cpu_secs "$wpid"); sink_before=$([ -n "${SINK_PID:-}" ] && cpu_secs "$SINK_PID" || echo 0)
    $BIN/meshctl bench "${args[@]}" --concurrency 100 --max-tokens 50 --prompt-words 32 \
      --duration 5 --warmup 1 --seed "$rep" --output json --no-progress | tag $to "$rep" >>"$OUT/observability.jsonl"
    # The sink's CPU is taken from the same two cores: part of the on runs' cost here.
    sink=$([ -n "${SINK_PID:-}" ] && since "$sink_before" "$(cpu_secs "$SINK_PID")" || echo 0)
    echo "$to rep $rep: router CPU $(since "$before" "$(cpu_secs "$pid")") s, OTLP sink CPU $sink s, worker CPU $(since "$wbefore" "$(cpu_secs "$wpid")") s" \
      | tee -a "$OUT/observability-cpu.txt"
  done
done
cleanup; pids=()
[ -s "$OUT/otlp-sink.log" ] && cat "$OUT/otlp-sink.log"
python3 scripts/bench_compare.py "$OUT/observability.jsonl" | tee "$OUT/observability-compare.md"
python3 scripts/bench_compare.py "$OUT/observability.jsonl" --baseline router-off | tee -a "$OUT/observability-compare.md"
echo "== observability summary (router-on against router-off, same repetition; target: tokens/s within 2 %, TTFT p50 +0.3 ms at most)"
python3 - "$OUT/observability.jsonl" <<'PY' | tee "$OUT/observability-summary.md"
import json, statistics, sys
runs = {}
for line in open(sys.argv[1]):
    r = json.loads(line)
    runs.setdefault(r["labels"]["rep"], {})[r["labels"]["path"]] = r
tps, ttft = [], []
for rep, by in sorted(runs.items(), key=lambda kv: str(kv[0])):
    on, off = by.get("router-on"), by.get("router-off")
    if not (on and off):
        continue
    tps.append(100 * on["output_tokens_per_sec"] / off["output_tokens_per_sec"])
    p = lambda r: (r.get("ttft_ms") or {}).get("p50")
    if p(on) is not None and p(off) is not None:
        ttft.append(p(on) - p(off))
fmt = lambda v, u: f"{statistics.median(v):.2f}{u} ({min(v):.2f} to {max(v):.2f}, {len(v)} pairs)" if v else "n/a"
print(f"tokens/s, on as % of off: {fmt(tps, ' %')}")
print(f"added TTFT p50, on minus off: {fmt(ttft, ' ms')}")
PY
fi

if want sampling; then
echo "== sampling: real model, temperature 0 vs the defaults (t=1), 1 to 32 streams ($THREADS thread(s))"
mesh sampling smollm2-135m-instruct --model "$MODEL" --threads "$THREADS" --max-batch 32
{ nproc; uptime; } | tee "$OUT/sampling-machine.txt"
: >"$OUT/sampling.jsonl"
for c in ${SAMPLING_STREAMS:-1 4 16 32}; do
  for rep in $(seq "$REPS"); do
    for t in t0 defaults; do
      # No --temperature: the request leaves sampling to the server's defaults.
      # Each run its own prompts (seed), so that the second of a pair does
      # not find the first's prompts in the worker's prefix cache.
      if [ $t = t0 ]; then targs=(--temperature 0 --seed $((2 * rep))); else targs=(--seed $((2 * rep + 1))); fi
      $BIN/meshctl bench --target "$ROUTER" --concurrency $c --max-tokens 64 --prompt-words 32 "${targs[@]}" \
        --ignore-eos --duration 10 --warmup 2 --output json --no-progress | tag $t "$rep" >>"$OUT/sampling.jsonl"
    done
  done
done
cleanup; pids=()
fi

if want openai; then
echo "== OpenAI-compatible HTTP vs gRPC through the same router, 100 streams"
{ nproc; uptime; } | tee "$OUT/openai-machine.txt"
hp=$(free_port)
ROUTER_ARGS=(--http-listen "127.0.0.1:$hp")
mesh openai synthetic --engine synthetic --synthetic-tokens-per-sec 100 --max-batch 256 --queue-capacity 1024
ROUTER_ARGS=()
HTTP=127.0.0.1:$hp
wait_port "$HTTP"
: >"$OUT/openai.jsonl"; : >"$OUT/openai-router-cpu.txt"
for rep in $(seq "$REPS"); do
  for to in grpc openai openai-h2; do
    case $to in
      grpc) args=(--target "$ROUTER") ;;
      openai) args=(--api openai --target "$HTTP") ;; # HTTP/1.1, a connection per stream
      openai-h2) args=(--api openai --http2 --target "$HTTP") ;;
    esac
    before=$(cpu_secs "$ROUTER_PID")
    $BIN/meshctl bench "${args[@]}" --concurrency 100 --max-tokens 50 --prompt-words 32 \
      --duration "${OPENAI_DURATION:-5}" --warmup 1 --seed "$rep" --output json --no-progress | tag $to "$rep" >>"$OUT/openai.jsonl"
    echo "$to rep $rep: router CPU $(since "$before" "$(cpu_secs "$ROUTER_PID")") s" \
      | tee -a "$OUT/openai-router-cpu.txt"
  done
done
cleanup; pids=()
python3 scripts/bench_compare.py "$OUT/openai.jsonl" --baseline grpc | tee "$OUT/openai-compare.md"
fi

if want upstream; then
echo "== upstream engine: llama-server directly vs through the router and an upstream worker, 1 and 16 streams"
# llama-server from scripts/llama-cpp.sh (TOKENMESH_LLAMA_CPP), $THREADS
# thread(s), 16 slots; the direct path is its OpenAI-compatible
# /v1/completions (HTTP/1.1), the mesh path gRPC to the router, which the
# upstream worker forwards to llama-server's /completion (the prompt as
# text, llama-server tokenizes it). Pinned: llama-server alone on
# ENGINE_CPU, everything else (meshctl on both paths, the worker, the
# router) on PROXY_CPU, so the mesh's processes take no time from the
# engine's thread and the direct path's client shares its core alike.
# Like for like: both paths send the same prompts (the same --seed per
# repetition), in alternating order, with llama-server's prompt cache off
# for both (cache_prompt false: meshctl's --extra-body on the direct path,
# the worker's --upstream-prompt-cache false on the other; --cache-ram 0
# also stops its host-memory prompt cache, which would otherwise save and
# load a slot's KV at each slot choice). Short prompts keep the prefill,
# whose time varies from prompt to prompt, small. The worker logs the parts
# of each first token's time (its own, prepare, /completion), which
# scripts/upstream_parts.py summarizes apart from llama-server's noise.
# A third path, `openai`, goes through a second router and a worker of
# --upstream-kind openai, which calls the same /v1/completions the direct
# path calls (text in, text out, no token ids): the mesh's cost with the
# engine's endpoint held equal.
LLAMA_SERVER=${TOKENMESH_LLAMA_CPP:-target/llama.cpp}/bin/llama-server
[ -x "$LLAMA_SERVER" ] || { echo "no $LLAMA_SERVER: run scripts/llama-cpp.sh" >&2; exit 1; }
command -v taskset >/dev/null || { echo "taskset is not installed (util-linux)" >&2; exit 1; }
ENGINE_CPU=${ENGINE_CPU:-0}; PROXY_CPU=${PROXY_CPU:-1}
{ nproc; uptime; "$LLAMA_SERVER" --version 2>&1 | head -1
  echo "llama-server on CPU $ENGINE_CPU; worker, router and meshctl on CPU $PROXY_CPU"; } | tee "$OUT/upstream-machine.txt"
lp=$(free_port)
taskset -c "$ENGINE_CPU" "$LLAMA_SERVER" -m "$MODEL" --host 127.0.0.1 --port "$lp" -t "$THREADS" -np 16 -c 16384 --cache-ram 0 --metrics --no-webui \
  >"$OUT/upstream-llama-server.log" 2>&1 & pids+=($!)
for _ in $(seq 300); do curl -fs "http://127.0.0.1:$lp/health" >/dev/null && break; sleep 0.2; done
cached() { curl -fs "http://127.0.0.1:$lp/metrics" | awk '/^llamacpp:prompt_tokens_cached_total/ { print $2 + 0 }'; }
: >"$OUT/upstream-compare.md"
WORKER_PIN=(taskset -c "$PROXY_CPU"); ROUTER_PIN=(taskset -c "$PROXY_CPU")
WORKER_LOG="warn,tokenmesh_worker::upstream::forward=debug" WORKER_LOG_FORMAT=json \
  mesh upstream smollm2-135m-instruct --engine upstream --upstream-url "http://127.0.0.1:$lp" --max-batch 16 \
  --upstream-prompt-cache false
ROUTER_LS=$ROUTER
WORKER_LOG="warn,tokenmesh_worker::upstream::forward=debug" WORKER_LOG_FORMAT=json \
  mesh upstream-openai smollm2-135m-instruct --engine upstream --upstream-url "http://127.0.0.1:$lp" --max-batch 16 \
  --upstream-kind openai --upstream-context-length 1024 --upstream-accelerator cpu --upstream-prompt-cache false
ROUTER_OPENAI=$ROUTER
WORKER_PIN=(); ROUTER_PIN=()
: >"$OUT/upstream.jsonl"; : >"$OUT/upstream-parts.jsonl"
for c in 1 16; do
  : >"$OUT/upstream-c$c.jsonl"
  for rep in $(seq "$REPS"); do
    order=(direct router openai); [ $((rep % 2)) = 0 ] && order=(openai router direct)
    for to in "${order[@]}"; do
      case $to in
        direct) args=(--api openai --target "127.0.0.1:$lp" --extra-body '{"cache_prompt": false}'); log=/dev/null ;;
        router) args=(--target "$ROUTER_LS"); log="$OUT/upstream-worker.log" ;;
        openai) args=(--target "$ROUTER_OPENAI"); log="$OUT/upstream-openai-worker.log" ;;
      esac
      before=$(cached); lines=$(wc -l <"$log")
      taskset -c "$PROXY_CPU" $BIN/meshctl bench "${args[@]}" --concurrency $c --max-tokens 32 --prompt-words "${UPSTREAM_PROMPT_WORDS:-8}" \
        --temperature 0 --duration "${UPSTREAM_DURATION:-20}" --warmup 2 --seed "$rep" --output json --no-progress \
        | tag "$to" "$rep" | tee -a "$OUT/upstream.jsonl" >>"$OUT/upstream-c$c.jsonl"
      echo "c=$c rep $rep $to: prompt tokens llama-server took from its cache: $(( $(cached) - before ))" \
        | tee -a "$OUT/upstream-cache.txt"
      if [ $to != direct ]; then
        tail -n +$((lines + 1)) "$log" \
          | python3 scripts/upstream_parts.py run path=$to streams=$c rep=$rep >>"$OUT/upstream-parts.jsonl"
      fi
    done
  done
  { echo "-- $c stream(s): router + upstream worker (router: llama-server kind, /completion; openai: openai kind,"
    echo "   /v1/completions) vs llama-server direct (/v1/completions), same prompts, prompt cache off;"
    echo "   per repetition the difference of TTFT p50s and the ratio of tokens/s, then median (range) over $REPS"
  } | tee -a "$OUT/upstream-compare.md"
  python3 scripts/bench_compare.py "$OUT/upstream-c$c.jsonl" --baseline direct | tee -a "$OUT/upstream-compare.md"
done
{ echo "-- the upstream worker's own part of each first token's time (request in -> first token relayed, less"
  echo "   its waits on llama-server), per run p50/p99 over its requests, then median (range) over the runs"
} | tee -a "$OUT/upstream-compare.md"
python3 scripts/upstream_parts.py summary "$OUT/upstream-parts.jsonl" | tee -a "$OUT/upstream-compare.md"
echo "-- load average: $(cut -d' ' -f1-3 /proc/loadavg) at the end; at the start: $(sed -n 2p "$OUT/upstream-machine.txt")" \
  | tee -a "$OUT/upstream-compare.md"
cleanup; pids=()
fi

if want prefix; then
echo "== prefix caching and cache-aware routing: multi-turn chat, 4 real-model workers, one router"
{ nproc; uptime; } | tee "$OUT/prefix-machine.txt"
: >"$OUT/prefix.jsonl"
PREFIX_WORKERS=${PREFIX_WORKERS:-4}
if $BIN/tokenmesh-worker --help | grep -q -- '--prefix-cache'; then
  arms="cache-aware:on p2c:on p2c:off"
else
  echo "this worker has no --prefix-cache flag: caching-off arms only" | tee -a "$OUT/prefix-machine.txt"
  arms="cache-aware:none p2c:none"
fi
for rep in $(seq "${PREFIX_REPS:-1}"); do
  for arm in $arms; do
    choice=${arm%%:*}; cache=${arm##*:}
    cache_args=(); [ "$cache" = none ] || cache_args=(--prefix-cache "$cache")
    toml="$OUT/prefix-static.toml"; : >"$toml"; waddrs=()
    for i in $(seq "$PREFIX_WORKERS"); do
      wp=$(free_port)
      $BIN/tokenmesh-worker --insecure --listen 127.0.0.1:$wp --worker-id "prefix-$i" --model "$MODEL" \
        --threads "$THREADS" --log warn "${cache_args[@]}" >"$OUT/prefix-$i-worker.log" 2>&1 & pids+=($!)
      printf '[[workers]]\nid = "prefix-%s"\nmodel = "smollm2-135m-instruct"\nversion = "v1"\naddr = "http://127.0.0.1:%s"\n\n' \
        "$i" "$wp" >>"$toml"
      waddrs+=("127.0.0.1:$wp")
    done
    rp=$(free_port)
    $BIN/tokenmesh-router --insecure --listen 127.0.0.1:$rp --static "$toml" --log warn --worker-choice "$choice" \
      >"$OUT/prefix-router.log" 2>&1 & pids+=($!)
    wait_for 127.0.0.1:$rp
    for _ in $(seq 600); do # until every worker is ready behind the router (the READY column)
      [ "$($BIN/meshctl models --insecure --router 127.0.0.1:$rp | awk 'NR == 2 { print $4 }')" = "$PREFIX_WORKERS" ] && break
      sleep 0.1
    done
    $BIN/meshctl bench chat --target 127.0.0.1:$rp --conversations "${PREFIX_CONVERSATIONS:-8}" \
      --turns "${PREFIX_TURNS:-4}" --system-words "${PREFIX_SYSTEM_WORDS:-300}" --user-words 24 --max-tokens 24 \
      --temperature 0 --seed "$rep" --label "choice=$choice" --label "cache=$cache" --label "rep=$rep" \
      $( [ "$cache" = none ] || echo --workers "$(IFS=,; echo "${waddrs[*]}")" ) --output json >>"$OUT/prefix.jsonl"
    cleanup; pids=()
  done
done
python3 - "$OUT/prefix.jsonl" <<'PY' | tee "$OUT/prefix.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| choice | cache | rep | TTFT p50 turn 1 | TTFT p50 later | TTFT p99 later | tok/s | same worker | max/mean load | hit ratio | oracle |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for r in rows:
    l = r["labels"]; t = r["ttft_ms_by_turn"]; h = r["worker_hit_ratio"]
    print(f"| {l['choice']} | {l['cache']} | {l['rep']} | {t[0]['p50']:.0f} ms | {r['ttft_ms_later_turns']['p50']:.0f} ms"
          f" | {r['ttft_ms_later_turns']['p99']:.0f} ms | {r['output_tokens_per_sec']:.1f} | {r['same_worker_ratio']*100:.0f} %"
          f" | {r['max_over_mean_load']:.2f} | {'-' if h is None else f'{h*100:.0f} %'} | {r['oracle_hit_ratio']*100:.0f} % |")
PY
fi


for f in synthetic real ceiling proxies proxies-ceiling observability sampling openai hop-c20 hop-c100 upstream; do
  [ -s "$OUT/$f.jsonl" ] && python3 scripts/bench_summary.py "$OUT/$f.jsonl" | tee "$OUT/$f.md"
done
echo "results in $OUT"
