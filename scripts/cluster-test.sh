#!/usr/bin/env bash
# The docker-compose cluster test (issue #9): deploy/docker-compose.yml with the
# offline images (scripts/docker-images.sh), every service that needs no pulled
# image (etcd ×3, routers ×2, workers v1 ×2 and v2 ×1, the control plane when
# it is built), real clients from the host (meshctl from target/release and a
# grpcio client from target/test-venv). Cases:
#   bad input: a missing model file / certificate ends the container (exit 2,
#     the missing path in its log), and it is not restarted in a loop
#   up → first token; a stream through each router
#   a worker killed mid-stream: the client's stream completes (failover)
#   a worker cut off the network: ejected by keepalive, back when reconnected
#   an etcd node stopped: generates work and worker registrations survive
#   a router restarted: a client's channel reconnects
#   a canary rollout through the Control API (when tokenmesh-control is built)
# Skipped, with a message, when no Docker engine is reachable. Needs the
# release build and the model (scripts/test.sh provides both; nothing is built
# here but the images). Everything the test creates is removed on exit.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s.%N)

now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
current_step=start
step() { current_step=$*; printf '\n--> %s\n' "$*"; }
# Why the test stopped, repeated after the services' logs on the way out, so
# that it is the last thing a CI log shows (which keeps only its tail).
failure=
die() { failure="cluster test FAILED in step \"$current_step\": $*"; echo "$failure" >&2; exit 1; }
trap 'rc=$?; [ -n "$failure" ] || failure="cluster test FAILED in step \"$current_step\": the command on line $LINENO exited $rc ($BASH_COMMAND)"' ERR

if ! command -v docker >/dev/null 2>&1 || ! docker info >/dev/null 2>&1; then
  echo "cluster test skipped: no Docker engine reachable (docker info failed)"
  exit 0
fi
if docker compose version >/dev/null 2>&1; then
  COMPOSE_BIN=(docker compose)
elif command -v docker-compose >/dev/null 2>&1; then
  COMPOSE_BIN=(docker-compose)
else
  die "a Docker engine is reachable but Compose is not installed (docker compose or docker-compose)"
fi

B=target/release
for b in tokenmesh-router tokenmesh-worker tokenmesh-certs meshctl; do
  [ -x "$B/$b" ] || die "$B/$b is missing: build once with cargo build --release --workspace --locked (scripts/test.sh does)"
done
MODEL=${TOKENMESH_TEST_MODEL:-$HOME/.cache/tokenmesh/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$MODEL" ] || die "model $MODEL is missing: fetch it with $B/meshctl fetch-model"
PY=${TOKENMESH_PYTHON:-target/test-venv/bin/python}
"$PY" -c 'import grpc, grpc_tools' 2>/dev/null || die "$PY lacks grpcio/grpcio-tools (scripts/test.sh creates target/test-venv)"

have_control=false
[ -x "$B/tokenmesh-control" ] && have_control=true

step "images (offline)"
t=$(now)
scripts/docker-images.sh
images_s=$(took "$t")

# --- the cluster's settings ------------------------------------------------
export COMPOSE_PROJECT_NAME="tmct$$"
export COMPOSE_FILE=deploy/docker-compose.yml
export TOKENMESH_IMAGE=tokenmesh:local
export TOKENMESH_MODELS_DIR TOKENMESH_MODEL_FILE
TOKENMESH_MODELS_DIR=$(cd "$(dirname "$MODEL")" && pwd)
TOKENMESH_MODEL_FILE=$(basename "$MODEL")
free_port() { "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
R1=127.0.0.1:$(free_port) R2=127.0.0.1:$(free_port) CTL=127.0.0.1:$(free_port)
export TOKENMESH_ROUTER1_PUBLISH=$R1 TOKENMESH_ROUTER2_PUBLISH=$R2 TOKENMESH_CONTROL_PUBLISH=$CTL
# the routers' OpenAI-compatible HTTP ports, off the fixed defaults too
export TOKENMESH_ROUTER1_HTTP_PUBLISH=127.0.0.1:$(free_port) TOKENMESH_ROUTER2_HTTP_PUBLISH=127.0.0.1:$(free_port)
# keepalive ejection must be quick, and well before a lease could expire
export TOKENMESH_KEEPALIVE_INTERVAL_MS=1000 TOKENMESH_KEEPALIVE_TIMEOUT_MS=1000 TOKENMESH_LEASE_TTL=12
# a canary rollout decided in seconds: stats every 1 s, an analysis round every 1 s
export TOKENMESH_STATS_INTERVAL_MS=1000 TOKENMESH_ANALYSIS_INTERVAL_MS=1000
# no collector in the offline cluster
export OTEL_EXPORTER_OTLP_ENDPOINT=
NET=${COMPOSE_PROJECT_NAME}_mesh

WORK=target/cluster-test
rm -rf "$WORK"
mkdir -p "$WORK"
compose() { "${COMPOSE_BIN[@]}" "$@"; }
cid() { compose ps -q "$1"; }

cleanup() {
  local rc=$?
  set +e
  if [ $rc -ne 0 ]; then
    echo "--- compose ps and the last log lines of each service (exit $rc)" >&2
    compose ps -a >&2
    compose logs --no-color --tail 25 >&2
    echo "${failure:-cluster test FAILED in step \"$current_step\" (exit $rc)}" >&2
  fi
  compose down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1
  # one-off `run` containers and anything else labelled with the project
  docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" | xargs -r docker rm -f >/dev/null
  docker network ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" | xargs -r docker network rm >/dev/null
  docker volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME" | xargs -r docker volume rm >/dev/null
  left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"; docker volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
  [ -z "$left" ] || echo "cleanup left behind: $left" >&2
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

client() { "$PY" tests/python/cluster_client.py --proto-dir proto --gen-dir "$WORK/gen" --tls-dir "$WORK/certs" "$@"; }
json() { "$PY" -c "import json,sys; print(json.loads(sys.argv[1])$2)" "$1"; }
meshctl_gen() { "$B/meshctl" generate --router "$1" --tls-dir "$WORK/certs" --max-tokens 24 "Name three colours."; }

# Waits up to $2 seconds for $1 (a command) to succeed; no fixed sleeps.
wait_for() {
  local what=$1 deadline=$(( $(date +%s) + $2 ))
  until eval "$what" >/dev/null 2>&1; do
    [ "$(date +%s)" -lt "$deadline" ] || die "timed out after $2 s waiting for: $what"
    sleep 0.2
  done
}
health() { docker inspect -f '{{.State.Health.Status}}' "$(cid "$1")"; }

# --- up --------------------------------------------------------------------
services=(certs etcd-1 etcd-2 etcd-3 policy-init worker-v1-1 worker-v1-2 worker-v2-1 router-1 router-2)
$have_control && services+=(control)
step "up: ${services[*]}"
t_up=$(now)
compose up -d "${services[@]}"
up_returned_s=$(took "$t_up")
# the client's certificates, from the certs volume
docker cp "$(cid certs):/certs/client/." "$WORK/certs"
docker cp "$(cid certs):/certs/operator/." "$WORK/certs"
wait_for "meshctl_gen $R1" 180
first_token_s=$(took "$t_up")
echo "up returned after ${up_returned_s} s; first generated reply ${first_token_s} s after up"
client --target "$R1" --timeout 180 wait-ready --want v1=2,v2=1
client --target "$R2" --timeout 60 wait-ready --want v1=2,v2=1
# every tokenmesh service's compose health check (GET /readyz on its
# plaintext metrics port) passes once the mesh serves
for s in worker-v1-1 worker-v1-2 worker-v2-1 router-1 router-2; do
  wait_for "[ \"\$(health $s)\" = healthy ]" 60
done
all_ready_s=$(took "$t_up")

# --- bad input -----------------------------------------------------------------
step "bad input: missing model file, missing certificate"
msg() { grep -m1 -E 'tokenmesh-entrypoint|Error' <<<"$1"; }
bad_model=$(compose run --rm --no-deps -e TOKENMESH_MODEL=/models/absent.gguf worker-v1-1 2>&1) && die "a worker with a missing model started"
msg "$bad_model"
grep -q "/models/absent.gguf" <<<"$bad_model" || die "the missing model's path is not in the message: $bad_model"
bad_cert=$(compose run --rm --no-deps -e TOKENMESH_TLS_DIR=/certs/worker-absent worker-v1-1 2>&1) && die "a worker with missing certificates started"
msg "$bad_cert"
grep -q "/certs/worker-absent" <<<"$bad_cert" || die "the missing certificate directory is not in the message: $bad_cert"
bad_router=$(compose run --rm --no-deps -e TOKENMESH_TLS_DIR=/certs/worker-v1-1 router-1 2>&1) && die "a router with a worker's certificate directory started"
msg "$bad_router"
grep -q "router.pem" <<<"$bad_router" || die "the missing router.pem is not in the message: $bad_router"
# under compose's restart policy (on-failure:3) it ends as exited, not in a loop
cat >"$WORK/bad.yml" <<'EOF'
services:
  worker-bad:
    image: ${TOKENMESH_IMAGE}
    command: ["tokenmesh-worker"]
    restart: on-failure:3
    networks: [mesh]
    environment:
      TOKENMESH_MODEL: /models/absent.gguf
      TOKENMESH_INSECURE: "true"
EOF
compose -f deploy/docker-compose.yml -f "$WORK/bad.yml" up -d --no-deps worker-bad
badc=$(compose -f deploy/docker-compose.yml -f "$WORK/bad.yml" ps -q worker-bad)
wait_for "[ \"\$(docker inspect -f '{{.State.Status}}/{{.RestartCount}}' $badc)\" = exited/3 ]" 60
echo "worker-bad: $(docker inspect -f '{{.State.Status}}, exit {{.State.ExitCode}}, {{.RestartCount}} restarts' "$badc"): $(docker logs "$badc" 2>&1 | tail -1)"
docker rm -f "$badc" >/dev/null

# --- a stream through each router -------------------------------------------------
step "a stream through each router"
for r in "$R1" "$R2"; do
  out=$(meshctl_gen "$r") || die "meshctl generate through $r: $out"
  echo "$r: $(tail -1 <<<"$out")"
  client --target "$r" generate --max-tokens 16
done

# --- failover -------------------------------------------------------------------
step "a worker killed mid-stream: the client's stream completes"
# 512 tokens (this prompt runs to max_tokens): at the CPU kernels' few ms a
# token, a shorter stream can end before `docker kill` or `docker network
# disconnect` has taken effect, and then nothing fails over.
out=$(client --target "$R1" --timeout 120 kill-mid-stream --after-tokens 4 --max-tokens 512 \
  --kill-cmd "${COMPOSE_BIN[*]} kill -s SIGKILL {worker}") || die "failover: $out"
echo "$out"
killed=$(json "$out" '["killed"]')
compose start "$killed"
client --target "$R1" --timeout 120 wait-ready --want v1=2,v2=1

# --- keepalive ejection -----------------------------------------------------------
step "a worker cut off the network mid-stream: keepalive ejects it, the stream fails over; it returns when reconnected"
# A silent partition sends no RST: only the router's HTTP/2 keepalive
# (1 s interval, 1 s timeout here) notices that the open stream is dead.
out=$(client --target "$R2" --timeout 120 kill-mid-stream --after-tokens 4 --max-tokens 512 \
  --kill-cmd "docker network disconnect $NET \$(${COMPOSE_BIN[*]} ps -q {worker})") || die "partition: $out"
echo "$out"
cut=$(json "$out" '["killed"]')
others=$([ "$cut" = worker-v1-1 ] && echo worker-v1-2 || echo worker-v1-1)
client --target "$R2" --timeout 8 wait-ready --want v1=1 --exact
echo "router-2 log: $(compose logs --no-color router-2 | grep -E "WARN.*worker=$cut" | tail -2 | sed 's/^[^|]*| //' || true)"
out=$(client --target "$R2" generate --version v1 --max-tokens 8) || die "generate while a worker is cut off: $out"
[ "$(json "$out" '["worker"]')" = "$others" ] || die "a request went to the cut-off worker: $out"
# keep it cut off until its lease has expired and its registration is gone,
# so that coming back means re-registering, as after a long partition
etcd_keys() { compose exec -T etcd-2 etcdctl get --prefix --keys-only /tokenmesh/workers/; }
unregistered() { local keys; keys=$(etcd_keys) || return 1; ! grep -q "/$1\$" <<<"$keys"; }
wait_for "unregistered $cut" $(( TOKENMESH_LEASE_TTL + 20 ))
echo "$cut's registration expired with its lease"
t=$(now)
docker network connect --alias "$cut" "$NET" "$(cid "$cut")"
client --target "$R2" --timeout 60 wait-ready --want v1=2,v2=1
client --target "$R1" --timeout 60 wait-ready --want v1=2,v2=1
echo "$cut re-registered and healthy on both routers $(took "$t") s after reconnecting"

# --- etcd node loss ---------------------------------------------------------------
step "an etcd node stopped: the mesh keeps working"
compose stop etcd-1
for r in "$R1" "$R2"; do client --target "$r" generate --max-tokens 8 >/dev/null || die "generate via $r with etcd-1 down"; done
# registrations live on: they must stay in etcd (read from etcd-2) for longer
# than one lease TTL, which only works if the workers' lease keep-alives moved
# to a surviving node
t=$(date +%s)
while [ $(( $(date +%s) - t )) -le $(( TOKENMESH_LEASE_TTL + 2 )) ]; do
  regs=$(etcd_keys | grep -c . || true)
  [ "$regs" -eq 3 ] || die "a worker registration lapsed with etcd-1 down (2 of 3 etcd nodes up): $regs of 3 left: $(etcd_keys | tr '\n' ' '); the worker's log says: $(compose logs --no-color worker-v1-1 worker-v1-2 worker-v2-1 | grep 'registration lost' | tail -1 | cut -c1-200)"
done
echo "3 worker registrations held for over one lease TTL with etcd-1 down"
client --target "$R2" --timeout 30 wait-ready --want v1=2,v2=1
compose start etcd-1
wait_for '[ "$(health etcd-1)" = healthy ]' 60

# --- router restart ----------------------------------------------------------------
step "a router restarted: a client's channel reconnects"
client --target "$R1" --timeout 90 reconnect --restart-cmd "${COMPOSE_BIN[*]} restart -t 5 router-1"
client --target "$R1" --timeout 60 wait-ready --want v1=2,v2=1
meshctl_gen "$R1" | tail -1

# --- canary -------------------------------------------------------------------------
step "a canary rollout through the control plane"
if $have_control; then
  wait_for '[ "$(health control)" = healthy ]' 60
  M=smollm2-135m-instruct
  ctl() { "$B/meshctl" "$@" --control "$CTL" --tls-dir "$WORK/certs"; }
  # v2 is the same model, so it is healthy; a loose TTFT tolerance keeps the
  # timing noise of a shared 2-core machine from rolling it back
  t=$(now)
  ctl canary start "$M" v2 --steps 50,100 --hold 2 --min-requests 3 --max-ttft-p99-ratio 5
  # the control plane writes the policy; both routers follow it from etcd
  client --timeout 30 split --routers "$R1,$R2" --stable v1 --canary v2 --weight 50 --n 16
  # The automated analysis advances a step once it holds long enough and each
  # arm has --min-requests requests in the routers' stats (stats/{router}/...),
  # and promotes after the last one; rollout-wait sends that traffic.
  out=$(client --target "$CTL" --timeout 90 rollout-wait --routers "$R1,$R2")
  echo "$out"
  case "$(json "$out" '["state"]')" in
    ROLLOUT_STATE_PROMOTED)
      canary_result="passed: started with meshctl, 50/50 split on both routers, promoted by the automated analysis $(took "$t") s after the start" ;;
    ROLLOUT_STATE_RUNNING)
      ctl canary rollback "$M" >/dev/null 2>&1 || true
      die "the canary rollout was not decided within 90 s (are the routers publishing stats?): $out" ;;
    *) die "the canary rollout ended $(json "$out" '["state"]'): $out" ;;
  esac
  client --timeout 30 split --routers "$R1,$R2" --stable v2 --n 6
  ctl canary get "$M"
else
  canary_result="PENDING: tokenmesh-control is not built (the control plane has not landed)"
  echo "$canary_result"
fi

echo
echo "cluster test passed in $(took "$started") s: images ${images_s} s, up returned ${up_returned_s} s," \
  "first token ${first_token_s} s after up, all workers ready ${all_ready_s} s after up; canary: $canary_result"
