#!/usr/bin/env bash
# Builds tokenmesh and runs a local mesh: one router and two workers of the
# default model (fetched on first use), static discovery, no etcd needed.
# Arguments are passed to `meshctl up` (see `meshctl up --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v protoc >/dev/null; then
  echo "installing protobuf-compiler (needed to build the gRPC stubs)" >&2
  if [ "$(id -u)" -eq 0 ]; then apt-get update -qq && apt-get install -y -qq protobuf-compiler
  else sudo apt-get update -qq && sudo apt-get install -y -qq protobuf-compiler; fi
fi
cargo build --release --workspace
exec target/release/meshctl up "$@"
