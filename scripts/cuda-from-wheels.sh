#!/usr/bin/env bash
# Builds the `cuda` feature on a machine with no GPU and no CUDA toolkit:
# NVIDIA's PyPI wheels give nvcc, the headers and the libraries candle links
# (cudart, cuBLAS, cuRAND, NVRTC), unpacked under target/cuda/; the driver
# library, which no wheel carries, is replaced at link time by a stub that
# only names cudarc's driver functions (the real libcuda.so.1 is loaded on
# the GPU machine).
#
#   scripts/cuda-from-wheels.sh            # once: fetch and unpack (~700 MB)
#   source target/cuda/env.sh              # then, in the building shell:
#   cargo build --release -p tokenmesh-worker -p tokenmesh-control --features tokenmesh-worker/cuda
#   cargo test --release -p tokenmesh-worker --features cuda --test reference --test batching --no-run
#
# CUDA 13.0 to match the H200 machines' driver (580, CUDA 13.0): candle's
# kernels are PTX that the driver compiles at start, and a driver refuses PTX
# from a newer toolkit than its own. CUDA_COMPUTE_CAP=90 (Hopper) because
# there is no nvidia-smi to ask. Running the result here (`--device cpu`) needs
# LD_LIBRARY_PATH=target/cuda/run:target/cuda/lib (the stub as libcuda.so.1).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=target/cuda
WHEELS=(nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35)
mkdir -p "$DIR/wheels" "$DIR/unpacked"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR/wheels" "${WHEELS[@]}"
for w in "$DIR"/wheels/*.whl; do
  unzip -q -o "$w" 'nvidia/*' -d "$DIR/unpacked"
done
ROOT=$PWD/$DIR/unpacked/nvidia/cu13
ln -sfn "$ROOT/lib" "$DIR/lib"
# The wheels carry only versioned names; the linker looks for libX.so.
for l in cudart cublas cublasLt nvrtc; do ln -sf "lib$l.so.13" "$ROOT/lib/lib$l.so"; done
ln -sf libcurand.so.10 "$ROOT/lib/libcurand.so"

# libcuda stub: every driver entry point cudarc declares, none of them working.
CUDARC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* 2>/dev/null | tail -1)
if [ -z "$CUDARC" ]; then
  cargo fetch -q
  CUDARC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.* | tail -1)
fi
mkdir -p "$ROOT/lib/stubs" "$DIR/run"
grep -oE '^pub unsafe fn cu[A-Za-z0-9_]+' "$CUDARC/src/driver/sys/mod.rs" | awk '{print $4}' \
  | sort -u | awk '{print "int " $1 "(void) { return 999; /* CUDA_ERROR_UNKNOWN */ }"}' \
  >"$DIR/cuda-stub.c"
cc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$ROOT/lib/stubs/libcuda.so" "$DIR/cuda-stub.c"
ln -sf "$ROOT/lib/stubs/libcuda.so" "$DIR/run/libcuda.so.1"

cat >"$DIR/env.sh" <<EOF
export CUDA_ROOT=$ROOT CUDA_PATH=$ROOT CUDA_HOME=$ROOT
export PATH=$ROOT/bin:\$PATH
export CUDA_COMPUTE_CAP=\${CUDA_COMPUTE_CAP:-90}
export LIBRARY_PATH=$ROOT/lib:$ROOT/lib/stubs
EOF
"$ROOT/bin/nvcc" --version | tail -2
echo "now: source $DIR/env.sh"
