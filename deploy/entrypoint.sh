#!/bin/bash
# Entrypoint of the tokenmesh image. Runs a tokenmesh binary or etcd with its
# flags from TOKENMESH_* / ETCD_* variables, after checking that the files it
# needs are there, so a missing model or certificate ends the container at once
# with the missing path in its last log line. Helpers for compose:
#   certs-init ROLE:NAME...  issue the CA (in /ca) and a leaf per NAME into
#                            /certs/NAME; existing certificates are kept
#   policy-init              put the default traffic policy in etcd unless one exists
#   ready PORT               health check: GET /readyz on the plaintext metrics
#                            listener 127.0.0.1:PORT answers 200 (else exit 1
#                            with the server's reason); needs no certificate
set -euo pipefail

die() { echo "tokenmesh-entrypoint: $*" >&2; exit 2; }

# --tls-dir DIR must hold ca.pem, ROLE.pem and ROLE.key (tokenmesh-certs), or
# ca.crt, tls.crt and tls.key (a cert-manager Secret), as the binaries take them.
need_tls() {
  local dir=$1 role=$2 f files
  [ -d "$dir" ] || die "TLS directory $dir is missing (certificates for role $role; is the certs job done and the volume mounted?)"
  files="ca.pem $role.pem $role.key"
  if [ ! -e "$dir/$role.pem" ] && [ -e "$dir/tls.crt" ]; then files="ca.crt tls.crt tls.key"; fi
  for f in $files; do
    [ -r "$dir/$f" ] || die "certificate file $dir/$f is missing or unreadable (role $role)"
  done
}

# An empty OTEL_EXPORTER_OTLP_ENDPOINT (compose's way to turn export off)
# would reach the binaries as an endpoint "" that every export fails on.
[ -n "${OTEL_EXPORTER_OTLP_ENDPOINT:-}" ] || unset OTEL_EXPORTER_OTLP_ENDPOINT

case "${1:-}" in
  certs-init)
    shift
    for spec in "$@"; do
      role=${spec%%:*} name=${spec#*:}
      if [ -f "/certs/$name/$role.pem" ]; then
        echo "certs: $name ($role) exists"
        continue
      fi
      tokenmesh-certs issue --ca-dir /ca --dir "/certs/$name" --role "$role" --name "$name" --dns "$name" >/dev/null
      echo "certs: issued spiffe://tokenmesh/$role/$name into /certs/$name"
    done
    exit 0
    ;;
  policy-init)
    # TOKENMESH_POLICY: the whole policy as JSON without spaces (Kubernetes'
    # bootstrap Job); else all traffic to TOKENMESH_STABLE_VERSION.
    : "${TOKENMESH_MODEL_NAME:?set TOKENMESH_MODEL_NAME}"
    key="${TOKENMESH_ETCD_PREFIX:-/tokenmesh}/models/$TOKENMESH_MODEL_NAME/policy"
    if [ -n "${TOKENMESH_POLICY:-}" ]; then
      case "$TOKENMESH_POLICY" in *[[:space:]]*) die "TOKENMESH_POLICY must be JSON without spaces" ;; esac
      value=$TOKENMESH_POLICY
    else
      : "${TOKENMESH_STABLE_VERSION:?set TOKENMESH_STABLE_VERSION or TOKENMESH_POLICY}"
      value="{\"stable\":\"$TOKENMESH_STABLE_VERSION\"}"
    fi
    # create the key only if it has never been written: a policy changed by an
    # operator (or the control plane) survives `docker compose up` again
    # (txn's parser takes the JSON unquoted: it has no spaces)
    txn="create(\"$key\") = \"0\"

put $key $value


"
    out=$(printf '%s' "$txn" | etcdctl txn)
    case "$out" in
      SUCCESS*) echo "policy: $key = $value" ;;
      *) echo "policy: $key exists: $(etcdctl get --print-value-only "$key")" ;;
    esac
    exit 0
    ;;
  ready)
    # bash's /dev/tcp: no HTTP client in the image is needed. A TLS handshake
    # with the gRPC port would succeed for a draining worker too.
    port=${2:?usage: ready METRICS_PORT}
    exec 3<>"/dev/tcp/127.0.0.1/$port"
    printf 'GET /readyz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    read -r -t 5 _ status _ <&3
    if [ "$status" = 200 ]; then exit 0; fi
    # the body says why (docker inspect shows it)
    timeout 5 sed '1,/^\r$/d' <&3 || true
    exit 1
    ;;
  tokenmesh-worker)
    if [ -n "${TOKENMESH_TLS_DIR:-}" ]; then need_tls "$TOKENMESH_TLS_DIR" worker; fi
    model=${TOKENMESH_MODEL:-default}
    if [ "$model" != default ] && [ "${TOKENMESH_ENGINE:-model}" = model ] && [ ! -r "$model" ]; then
      die "model file $model is missing or unreadable (compose mounts \${TOKENMESH_MODELS_DIR:-\$HOME/.cache/tokenmesh/models} at /models; fetch it with \`meshctl fetch-model\`)"
    fi
    ;;
  tokenmesh-router)
    if [ -n "${TOKENMESH_TLS_DIR:-}" ]; then need_tls "$TOKENMESH_TLS_DIR" router; fi
    ;;
  tokenmesh-control)
    command -v tokenmesh-control >/dev/null || die "tokenmesh-control is not in this image (rebuild it with the control plane built)"
    if [ -n "${TOKENMESH_TLS_DIR:-}" ]; then need_tls "$TOKENMESH_TLS_DIR" control; fi
    ;;
  etcd)
    for f in "${ETCD_CERT_FILE:-}" "${ETCD_KEY_FILE:-}" "${ETCD_TRUSTED_CA_FILE:-}"; do
      [ -z "$f" ] || [ -r "$f" ] || die "etcd certificate file $f is missing or unreadable"
    done
    ;;
esac
exec "$@"
