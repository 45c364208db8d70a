#!/usr/bin/env bash
# Build llama.cpp's CUDA benchmarks HERE (a machine without a GPU, with nvcc 13), so that a
# device call spends no device time building them: .gpubench/llama-bin.tar.xz, which
# tests/tools/gpu_bench.sh and moe_gpu_bench.sh unpack and run with the device's own cuBLAS
# and CUDA runtime on their library path (ldd: GLIBC 2.34, GLIBCXX 3.4.30).
# The source is the one vendored in the PyPI sdist llama-cpp-python 0.3.36 (llama.cpp commit
# 0c1e570), as in earlier sessions; cuBLAS 13.0's headers and link libraries come from the
# PyPI wheel nvidia-cublas; libcuda is a stub (the driver's comes from the device).
# CUDA for sm_90 only; FlashAttention kernels built (llama.cpp's best configuration can use
# them); CPU back ends as loadable variants (x64, haswell, skylakex, icelake, zen4,
# sapphirerapids) so llama.cpp's CPU experts run with the host's best ISA.
# About 55 minutes on 2 cores. Usage: bash tests/tools/llama_prebuild.sh   (from the repo root)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
W=${LLAMA_PREBUILD_DIR:-/tmp/llama-prebuild}
mkdir -p "$W" && cd "$W"
command -v nvcc >/dev/null || { echo "nvcc (CUDA 13) is needed"; exit 1; }
python3 -m venv dl && dl/bin/pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .
dl/bin/pip download -q --no-deps -d wh 'nvidia-cublas>=13.0,<13.1'
tar xzf llama_cpp_python-0.3.36.tar.gz
(cd wh && unzip -qo ./*.whl)
CUDA=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
# cuBLAS beside the toolkit nvcc belongs to (FindCUDAToolkit looks there)
cp -n wh/nvidia/cu13/include/* "$CUDA/include/" 2>/dev/null || true
cp wh/nvidia/cu13/lib/libcublas*.so.13 "$CUDA/lib64/"
ln -sf libcublas.so.13 "$CUDA/lib64/libcublas.so"; ln -sf libcublasLt.so.13 "$CUDA/lib64/libcublasLt.so"
mkdir -p stub && echo 'void aotx_stub(void){}' > stub/s.c && gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o stub/libcuda.so stub/s.c
SRC=$W/llama_cpp_python-0.3.36/vendor/llama.cpp
cmake -S "$SRC" -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
  -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON -DGGML_CUDA_NCCL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH='$ORIGIN' -DCUDA_cuda_driver_LIBRARY="$W/stub/libcuda.so" \
  -DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined \
  -DCMAKE_SHARED_LINKER_FLAGS="-Wl,--allow-shlib-undefined -Wl,--no-as-needed"
# --no-as-needed keeps libcuda.so.1 among libggml-cuda.so's dependencies (the stub defines none of the
# driver calls it makes, so the linker dropped it: on the device "undefined symbol: cuMemCreate").
# The tarball of session 7 lacks it; gpu_bench.sh and moe_gpu_bench.sh preload the driver's
# libcuda.so.1 for llama.cpp's commands either way (seen working on an H100, 2026-12-06).
ninja -C build -j "$(nproc)" llama-bench llama-batched-bench ggml-cuda ggml-cpu-x64 ggml-cpu-haswell \
  ggml-cpu-skylakex ggml-cpu-icelake ggml-cpu-sapphirerapids ggml-cpu-zen4
rm -rf lb && mkdir lb && cp -a build/bin/* lb/
(cd lb && rm -f libggml-cpu-{alderlake,cannonlake,cascadelake,cooperlake,ivybridge,piledriver,sandybridge,sse42}.so \
  && strip --strip-unneeded ./*.so* llama-bench llama-batched-bench && cp /lib/x86_64-linux-gnu/libgomp.so.1 .)
mkdir -p "$ROOT/.gpubench"
tar -cJf "$ROOT/.gpubench/llama-bin.tar.xz" lb
ls -la "$ROOT/.gpubench/llama-bin.tar.xz"
