#!/usr/bin/env bash
# Issue 19 on one H200 in ONE device call (at most 10 minutes; everything is bounded):
#   * builds llama.cpp with CUDA (sm_90, no FlashAttention kernels: faster to build; only
#     llama-bench and llama-batched-bench) in the background on cores 2.., from the source
#     tests/tools/gpu_bench_prep.sh put in .gpubench/;
#   * meanwhile, on cores 0-1: the CUDA invariance / kernel-choice tests, random-weight
#     GGUFs in the shapes of the default model, Llama-3.1-8B, Qwen2.5-0.5B and Qwen2.5-7B
#     Q4_K_M, and AOTX's measurements on each (tests/tools/gpu_bench.py);
#   * then llama.cpp on the same files, and one short table.
# Run from the repository root, after tests/tools/gpu_bench_prep.sh here:
#   PYTHONUNBUFFERED=1 bash tests/tools/gpu_bench.sh          carry: [".whl", ".gpubench"]
# Knobs: GPU_BENCH_DEADLINE (seconds, default 560), GPU_BENCH_MODELS (comma list),
# GPU_BENCH_TESTS (1/0), GPU_BENCH_LLAMA (1/0), GPU_BENCH_LLAMA_FIRST (1: llama.cpp before AOTX on each file);
# AOTX_BENCH_GEMM_ROWS=16 also times the aggregates on the eager path's GEMMs (CudaBackend(gemm_min_rows)).
# Files under $OUT: table.txt, summary.json, pytest.log, aotx_*.json, llama-build.log (tail).
set -uo pipefail
cd "$(dirname "$0")/../.."
# prebuilt llama.cpp carried compressed (the tree that travels is limited): unpack once
if [ -f .gpubench/llama-bin.tar.xz ] && [ ! -x .gpubench/llama-bin/llama-bench ]; then
  mkdir -p .gpubench/llama-bin && tar -xJf .gpubench/llama-bin.tar.xz -C .gpubench/llama-bin --strip-components=1
fi
ROOT=$PWD
T0=$(date +%s)
DEADLINE=${GPU_BENCH_DEADLINE:-560}
OUTD=${OUT:-/tmp/gpu_bench_out}
WORK=/tmp/gpu_bench
PY=${PY:-python3}
mkdir -p "$OUTD" "$WORK"
NCPU=$(nproc)
[ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
PIN_BENCH=""; PIN_BUILD=""
if command -v taskset >/dev/null && [ "$NCPU" -ge 4 ]; then
  PIN_BENCH="taskset -c 0,1"; PIN_BUILD="taskset -c 2-$((NCPU - 1))"
fi

# 1. llama.cpp: prebuilt (.gpubench/llama-bin: built elsewhere for sm_90 and CUDA 13, RPATH $ORIGIN; the
#    device's own cuBLAS and CUDA runtime put on ITS library path only), else built here in the background
. tests/tools/gpu_common.sh      # find_lib, driver_libcuda
rm -f "$WORK/llama-build.done"
LLAMA_BIN=$WORK/llama.cpp/build/bin
if [ "${GPU_BENCH_LLAMA:-1}" = 1 ] && [ -x .gpubench/llama-bin/llama-bench ]; then
  LLAMA_BIN=$ROOT/.gpubench/llama-bin
  LLP=$LLAMA_BIN
  for f in "$(find_lib libcublas.so.13)" "$(find_lib libcudart.so.13)"; do [ -n "$f" ] && LLP="$LLP:$(dirname "$f")"; done
  export LLAMA_PRELOAD=$(driver_libcuda)
  # the machine's own path too (where the driver's libraries are)
  LLP="$LLP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export LLAMA_LD_LIBRARY_PATH=$LLP
  LD_LIBRARY_PATH=$LLP LD_PRELOAD=$LLAMA_PRELOAD timeout 60 "$LLAMA_BIN/llama-bench" --list-devices 2>&1 | grep -v "^load_backend: loaded CPU" | tail -8
  if ! LD_LIBRARY_PATH=$LLP LD_PRELOAD=$LLAMA_PRELOAD timeout 60 "$LLAMA_BIN/llama-bench" --list-devices 2>&1 | grep -q CUDA0; then
    # other homes of the CUDA 13 libraries: the image's pip wheels (nvidia-cublas, nvidia-cuda-runtime), the driver's mount
    SP=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" 2>/dev/null)
    for extra in "$(ls -d "$SP"/nvidia/cu13/lib 2>/dev/null | head -1)" \
                 "$(ls -d "$SP"/nvidia/cublas/lib "$SP"/nvidia/cuda_runtime/lib 2>/dev/null | tr '\n' ':')" \
                 "/usr/local/nvidia/lib64:/usr/local/nvidia/lib"; do
      [ -z "$extra" ] && continue
      TRY="$LLAMA_BIN:$extra:$LLP"
      if LD_LIBRARY_PATH=$TRY LD_PRELOAD=$LLAMA_PRELOAD timeout 60 "$LLAMA_BIN/llama-bench" --list-devices 2>&1 | grep -q CUDA0; then
        LLP=$TRY; export LLAMA_LD_LIBRARY_PATH=$LLP; echo "llama.cpp sees the GPU with $extra first"; break
      fi
    done
  fi
  if ! LD_LIBRARY_PATH=$LLP LD_PRELOAD=$LLAMA_PRELOAD timeout 60 "$LLAMA_BIN/llama-bench" --list-devices 2>&1 | grep -q CUDA0; then
    echo "llama.cpp sees no CUDA device; what the CUDA backend's library lacks:"
    LD_LIBRARY_PATH=$LLP ldd "$LLAMA_BIN/libggml-cuda.so" 2>&1 | grep -i "not found" | head -5
    LD_LIBRARY_PATH=$LLP "$PY" -c "import ctypes,sys; ctypes.CDLL(sys.argv[1])" "$LLAMA_BIN/libggml-cuda.so" 2>&1 | tail -2
    ls -la /usr/local/nvidia/lib64/libcuda.so* 2>&1 | head -3; echo "LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  fi
  echo 0 > "$WORK/llama-build.done"
  echo "llama.cpp prebuilt: $LLAMA_BIN (library path $LLP; preloaded ${LLAMA_PRELOAD:-nothing})"
elif [ "${GPU_BENCH_LLAMA:-1}" = 1 ] && [ -f .gpubench/llama.cpp-src.tar.xz ] && command -v cmake >/dev/null \
   && command -v nvcc >/dev/null; then
  GEN=""; command -v ninja >/dev/null && GEN="-G Ninja"
  (
    set -e
    rm -rf "$WORK/llama.cpp"
    tar -xJf .gpubench/llama.cpp-src.tar.xz -C "$WORK"
    cd "$WORK/llama.cpp"
    $PIN_BUILD cmake -S . -B build $GEN -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    $PIN_BUILD cmake --build build --target llama-bench llama-batched-bench -j $((NCPU > 3 ? NCPU - 2 : NCPU))
  ) > "$WORK/llama-build.log" 2>&1 && echo 0 > "$WORK/llama-build.done" || echo 1 > "$WORK/llama-build.done" &
  BUILD_PID=$!
  echo "llama.cpp build started (pid $BUILD_PID, ${PIN_BUILD:-all cores}, log $WORK/llama-build.log)"
else
  echo 1 > "$WORK/llama-build.done"
  echo "llama.cpp: not built (GPU_BENCH_LLAMA=0, no .gpubench/llama.cpp-src.tar.xz, or no cmake/nvcc)"
fi

# 2. Python packages the image lacks, and aotx importable from this checkout
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site \
    .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
fi
mkdir -p /tmp/aotx-gpu && ln -sfn "$ROOT" /tmp/aotx-gpu/aotx
export PYTHONPATH=/tmp/aotx-gpu:$ROOT:/tmp/aotx-site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader || true
"$PY" -c "import cupy, gguf, msgspec, platformdirs; print('cupy', cupy.__version__, 'CUDA runtime',
cupy.cuda.runtime.runtimeGetVersion())" || exit 1

# 3. tests, models, AOTX, llama.cpp, table
LEFT=$((DEADLINE - ($(date +%s) - T0)))
$PIN_BENCH "$PY" -m tests.tools.gpu_bench run --out "$OUTD" --work "$WORK" --tokenizer .gpubench/tokenizer.json \
  --deadline "$LEFT" --tests "${GPU_BENCH_TESTS:-1}" --models "${GPU_BENCH_MODELS:-smollm2-135m,llama-3.1-8b,qwen2.5-0.5b,qwen2.5-7b}" \
  --llama-bin "$LLAMA_BIN" --build-done "$WORK/llama-build.done" --build-log "$WORK/llama-build.log"
RC=$?
# GPU_BENCH_MICRO=1: the flash prefill attention's and the fp16 GEMV's benches while time is left
if [ "${GPU_BENCH_MICRO:-0}" = 1 ]; then
  for b in "tests.tools.cuda_attn_bench" "tests.tools.cuda_gemv_bench --fp16 --batches 1,4"; do
    LEFT=$((DEADLINE - ($(date +%s) - T0) - 5))
    if [ "$LEFT" -gt 40 ]; then
      echo "== $b ($LEFT s left)"
      $PIN_BENCH timeout -s KILL "$LEFT" "$PY" -m $b 2>&1 | tee "$OUTD/$(echo "$b" | cut -d' ' -f1 | sed 's/tests.tools.//').log" | tail -16
    else
      echo "== $b: skipped, $LEFT s left"
    fi
  done
fi
tail -c 200000 "$WORK/llama-build.log" > "$OUTD/llama-build.log" 2>/dev/null || true
[ -f "$WORK/llama-build.done" ] && echo "llama.cpp build exit: $(cat "$WORK/llama-build.done")" \
  || echo "llama.cpp build still running after $(( $(date +%s) - T0 )) s: $(tail -1 "$WORK/llama-build.log")"
[ -n "${BUILD_PID:-}" ] && kill "$BUILD_PID" 2>/dev/null
echo "gpu_bench.sh: $(( $(date +%s) - T0 )) s"
exit $RC
