#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-quantize, llama-bench and
# llama-tokenize from the llama-cpp-python 0.3.36 sdist (whose
# vendor/llama.cpp pins the llama.cpp revision) into target/llama.cpp:
#   target/llama.cpp/src  the sdist's vendor/llama.cpp (sources, vocab
#                         test files under src/models/ggml-vocab-*)
#   target/llama.cpp/bin  the four binaries
# The upstream-worker suites start bin/llama-server; others read src/. Does
# nothing when bin/llama-server is there already (the CI cache).
#
# Usage: scripts/llama-cpp.sh [VENV]   (VENV: a virtualenv with pip; default
# target/test-venv, as scripts/test.sh makes it)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=$PWD/target/llama.cpp
VENV=${1:-target/test-venv}
VERSION=0.3.36
TARGETS=(llama-server llama-quantize llama-bench llama-tokenize)

if [ -x "$OUT/bin/llama-server" ]; then
  echo "llama.cpp: cached in $OUT"
  exit 0
fi
command -v cmake >/dev/null || { echo "llama-cpp.sh: cmake is needed (apt-get install cmake)" >&2; exit 1; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The sdist's build backend has to be importable for pip to read its
# metadata, even with --no-build-isolation.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check scikit-build-core
"$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
  --no-build-isolation --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$work"
sdist=$(ls "$work"/*.tar.gz)
tar -xzf "$sdist" -C "$work"
src=$(ls -d "$work"/*/vendor/llama.cpp)

# GGML_NATIVE dies on CPUs that report AMX (SIGILL): name the instruction
# sets instead, AVX-512 only where this CPU has it, so the binaries run here.
avx512=OFF
grep -qw avx512f /proc/cpuinfo && avx512=ON
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
  -DGGML_AVX512="$avx512" -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
cmake --build "$work/build" --config Release -j "$(nproc)" --target "${TARGETS[@]}"

rm -rf "$OUT"
mkdir -p "$OUT/bin"
cp -a "$src" "$OUT/src"
for t in "${TARGETS[@]}"; do
  cp "$work/build/bin/$t" "$OUT/bin/"
done
"$OUT/bin/llama-server" --version 2>&1 | sed -n 1,2p
