#!/usr/bin/env bash
# Issue 22 item 6 on one H200 in ONE device call (about 9.5 minutes; every step bounded): a
# Qwen3-30B-A3B-shaped random-weight qwen3moe (Q4_K_M mix, ~17 GB, 48 layers;
# tests/tools/moe_gpu_bench.py) with the GPU expert budget below the model's size, AOTX next to
# llama.cpp on the SAME cores 0-7 (8 threads each), one after the other, never at once:
#   every expert on the CPU      AOTX budget 0                llama.cpp -ngl 99 -ncmoe 48
#   ~40% of experts on the GPU   AOTX calibrated, 40% budget  llama.cpp -ncmoe 29 (last 19 layers')
#   every expert on the GPU      AOTX --all-gpu               llama.cpp -ncmoe 0
# each: prefill 512, decode batch 1, aggregate decode at 16 slots (llama-bench -p 512 -n 16 -r 2;
# llama-batched-bench -npl 16); then, if time is left, AOTX's learned GPU expert cache (lfu)
# against the static 40% plan under a skewed router (MOE_BENCH_SKEW, router rows scaled in memory).
#
# Stages and expected times on the H200 host (16 cores; from BENCHMARKS.md sessions 5-6 and the code):
#   0. wheels, CUDA 13 libraries for llama.cpp, llama-bench --list-devices      ~10 s
#   1. the 48-layer file (cores 0-7; ~4 s/GB here: ~60 s), and meanwhile a 1-layer AOTX run on
#      cores 8-15 that compiles the numba and NVRTC kernels and stores the kernel choice
#      (the 48-layer run then finds them cached; nothing is measured while the file is written)
#   2. llama.cpp, prebuilt (.gpubench/llama-bin): llama-bench per -ncmoe (~15-25 s each) then
#      llama-batched-bench per -ncmoe (~10-20 s each); at most MOE_BENCH_LLAMA_S (150) s   ~100 s
#   3. AOTX (until the deadline less 15 s): load ~30 s; expert setup (calibrate 48 layers,
#      place, second pass) ~60-120 s; every configuration's measurements ~20-30 s; the 40% and
#      all-GPU setups reuse the stored calibration (~10 s each); the learned stage ~50 s   ~260 s
#   4. the table                                                                  ~1 s
# Files under $OUT (written as they come): progress.log, aotx.json, llama.jsonl,
# llama_batched.jsonl, llama-devices.txt, table.txt (and aotx_warm.json, *.err tails).
# Without .gpubench/llama-bin, llama.cpp is built from .gpubench/llama.cpp-src.tar.xz in the
# background (4-7 minutes: the old way) and run after AOTX if done in time.
#
# Prepare here first: bash tests/tools/gpu_bench_prep.sh   (makes .whl/ and .gpubench/tokenizer.json)
# Run from the repository root:  PYTHONUNBUFFERED=1 bash tests/tools/moe_gpu_bench.sh   carry: [".whl", ".gpubench"]
# Knobs: MOE_BENCH_DEADLINE (seconds, default 560), MOE_BENCH_LAYERS (default 48), MOE_BENCH_BUDGET (8G),
# MOE_BENCH_GPU_SHARE (0.4; 0: no GPU-tier runs), MOE_BENCH_ALL_GPU (1), MOE_BENCH_SKEW (0.8; 0: no learned
# stage), MOE_BENCH_LLAMA_S (150), MOE_BENCH_WARM (1: the 1-layer warm-up run), MOE_BENCH_WORK (/tmp/moe_gpu_bench),
# GPU_BENCH_FAKE=1 (the AOTX side on fake CuPy: the flow only, numbers meaningless), MOE_BENCH_GRAPHS (1: the
# CPU-tier and 40% placements' decode and aggregate again with CudaBackend(moe_graphs=True), the "with
# moe_graphs" rows; 0: not), MOE_BENCH_BACKEND (more CudaBackend arguments as JSON, e.g. '{"moe_device": false}':
# every moe layer as the host step, so the planner spreads the GPU budget over every layer, as before session 9).
set -uo pipefail
cd "$(dirname "$0")/../.."
# prebuilt llama.cpp carried compressed (the tree that travels is limited): unpack once
if [ -f .gpubench/llama-bin.tar.xz ] && [ ! -x .gpubench/llama-bin/llama-bench ]; then
  mkdir -p .gpubench/llama-bin && tar -xJf .gpubench/llama-bin.tar.xz -C .gpubench/llama-bin --strip-components=1
fi
ROOT=$PWD
T0=$(date +%s)
DEADLINE=${MOE_BENCH_DEADLINE:-560}
LAYERS=${MOE_BENCH_LAYERS:-48}
SHARE=${MOE_BENCH_GPU_SHARE:-0.4}
ALL_GPU=${MOE_BENCH_ALL_GPU:-1}
SKEW=${MOE_BENCH_SKEW:-0.8}
LLAMA_S=${MOE_BENCH_LLAMA_S:-150}
WARM=${MOE_BENCH_WARM:-1}
WORK=${MOE_BENCH_WORK:-/tmp/moe_gpu_bench}
OUTD=${OUT:-$WORK/out}
HOMED=$WORK/home
mkdir -p "$OUTD" "$WORK" "$HOMED"
NCPU=$(nproc)
left() { echo $((DEADLINE - ($(date +%s) - T0))); }
log() { echo "[moe_gpu_bench $(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUTD/progress.log" >&2; }
cap() { local t=$1 m=$2; [ "$t" -gt "$m" ] && t=$m; echo "$t"; }   # min
# llama.cpp: --n-cpu-moe N keeps the experts of the first N layers on the CPU
NCMOE_GPU=$(python3 -c "print($LAYERS - round($SHARE * $LAYERS))")
NCMOE_LIST="$LAYERS"; [ "$NCMOE_GPU" != "$LAYERS" ] && NCMOE_LIST="$NCMOE_LIST $NCMOE_GPU"
[ "$ALL_GPU" = 1 ] && NCMOE_LIST="$NCMOE_LIST 0"
[ -d /usr/local/cuda/bin ] && export PATH=/usr/local/cuda/bin:$PATH
PIN_BENCH=""; PIN_SIDE=""; BT=$NCPU
if command -v taskset >/dev/null && [ "$NCPU" -ge 12 ]; then
  PIN_BENCH="taskset -c 0-7"; PIN_SIDE="taskset -c 8-$((NCPU - 1))"; BT=8
fi
export NUMBA_NUM_THREADS=$BT
log "start: deadline ${DEADLINE} s, ${LAYERS} layers, share ${SHARE}, all-gpu ${ALL_GPU}, skew ${SKEW}, ${BT} threads (${PIN_BENCH:-unpinned}), ncmoe ${NCMOE_LIST}"

# 0. python with CuPy; packages the image lacks; aotx importable from this checkout
PY=${PY:-python3}
if ! "$PY" -c "import cupy" 2>/dev/null && [ -x /opt/torch/.venv/bin/python ]; then PY=/opt/torch/.venv/bin/python; fi
if [ -d .whl ] && ! "$PY" -c "import gguf, msgspec, platformdirs, google_crc32c" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site \
    .whl/*.whl >/dev/null 2>&1 || { log "wheel install failed"; exit 1; }
fi
mkdir -p /tmp/aotx-gpu && ln -sfn "$ROOT" /tmp/aotx-gpu/aotx
export PYTHONPATH=/tmp/aotx-gpu:$ROOT:/tmp/aotx-site
FAKE=${GPU_BENCH_FAKE:-}
[ -z "$FAKE" ] && { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$OUTD/progress.log"; }
if [ -n "$FAKE" ]; then
  "$PY" -c "import numba, gguf; print('numba', numba.__version__, '(fake CuPy)')" || exit 1
else
  "$PY" -c "import cupy, numba, gguf; print('cupy', cupy.__version__, 'numba', numba.__version__)" || exit 1
fi

# llama.cpp: the prebuilt binaries, with the device's CUDA 13 cuBLAS and runtime on the library path
. tests/tools/gpu_common.sh      # find_lib, driver_libcuda
LBIN=""; LLP=""; BUILD_PID=""; LPRE=$(driver_libcuda)
if [ -x .gpubench/llama-bin/llama-bench ]; then
  LBIN=$ROOT/.gpubench/llama-bin
  CUBLAS=$(find_lib libcublas.so.13); CUDART=$(find_lib libcudart.so.13)
  LLP=$LBIN
  for f in "$CUBLAS" "$CUDART"; do [ -n "$f" ] && LLP="$LLP:$(dirname "$f")"; done
  LLP="$LLP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  log "llama.cpp prebuilt: $LBIN; libcublas.so.13: ${CUBLAS:-NOT FOUND}; libcudart.so.13: ${CUDART:-NOT FOUND}"
  LD_LIBRARY_PATH=$LLP LD_PRELOAD=$LPRE timeout 60 "$LBIN/llama-bench" --list-devices > "$OUTD/llama-devices.txt" 2>&1
  rc=$?
  if grep -qi "cuda" "$OUTD/llama-devices.txt"; then
    log "llama.cpp devices (rc $rc): $(grep -i cuda "$OUTD/llama-devices.txt" | head -3 | tr '\n' ' ')"
  else
    log "WARNING llama-bench --list-devices (rc $rc) names no CUDA device: $(tail -5 "$OUTD/llama-devices.txt" | tr '\n' ' ')"
    LD_LIBRARY_PATH=$LLP LD_PRELOAD=$LPRE ldd "$LBIN/llama-bench" "$LBIN"/libggml-cuda*.so 2>&1 | grep -i "not found" | head -5 >&2
  fi
elif [ -z "$FAKE" ] && [ -f .gpubench/llama.cpp-src.tar.xz ] && command -v cmake >/dev/null && command -v nvcc >/dev/null; then
  # the old way: build in the background (cores 8..), run after AOTX if done in time
  rm -f "$WORK/llama-build.done"
  GEN=""; command -v ninja >/dev/null && GEN="-G Ninja"
  (
    set -e
    rm -rf "$WORK/llama.cpp"
    tar -xJf .gpubench/llama.cpp-src.tar.xz -C "$WORK"
    cd "$WORK/llama.cpp"
    $PIN_SIDE cmake -S . -B build $GEN -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
    $PIN_SIDE cmake --build build --target llama-bench llama-batched-bench -j $((NCPU > 12 ? NCPU - 8 : NCPU))
  ) > "$WORK/llama-build.log" 2>&1 && echo 0 > "$WORK/llama-build.done" || echo 1 > "$WORK/llama-build.done" &
  BUILD_PID=$!
  log "llama.cpp: no .gpubench/llama-bin; building from source in the background (pid $BUILD_PID)"
else
  log "llama.cpp: no .gpubench/llama-bin and no way to build it: AOTX only"
fi

# 1. the file (cores 0-7) and meanwhile the 1-layer warm-up run (cores 8..)
F=$WORK/qwen3-30b-a3b-shape-${LAYERS}l.gguf
WARM_PID=""
if [ "$WARM" = 1 ] && [ "$LAYERS" -gt 1 ]; then
  F1=$WORK/qwen3-30b-a3b-shape-1l.gguf
  [ -f "$F1" ] || "$PY" -m tests.tools.moe_gpu_bench write "$F1" --tokenizer .gpubench/tokenizer.json --layers 1 \
    > /dev/null 2> "$WORK/warm.err"
  NUMBA_NUM_THREADS=$BT $PIN_SIDE timeout 240 "$PY" -m tests.tools.moe_gpu_bench aotx "$F1" --json "$OUTD/aotx_warm.json" \
    --home "$HOMED" > /dev/null 2>> "$WORK/warm.err" &
  WARM_PID=$!          # timeout's (taskset execs it): a TERM to it reaches python
  log "warm-up (1 layer: numba and NVRTC compiles, kernel choice) started on ${PIN_SIDE:-all cores} (pid $WARM_PID)"
fi
if [ ! -f "$F" ]; then
  log "writing $F"
  $PIN_BENCH timeout "$(cap "$(left)" 200)" "$PY" -m tests.tools.moe_gpu_bench write "$F.tmp" \
    --tokenizer .gpubench/tokenizer.json --layers "$LAYERS" && mv "$F.tmp" "$F" || { log "FAIL writing the file"; exit 1; }
fi
log "file: $(stat -c %s "$F") bytes; $(free -g | awk '/Mem:/ {print $2 " GB RAM, " $7 " GB available"}')"
if [ -n "$WARM_PID" ]; then
  for _ in $(seq 1 30); do kill -0 "$WARM_PID" 2>/dev/null || break; sleep 2; done
  if kill -0 "$WARM_PID" 2>/dev/null; then
    log "warm-up still running after the file + 60 s: stopped"; kill "$WARM_PID" 2>/dev/null; wait "$WARM_PID" 2>/dev/null
  else
    wait "$WARM_PID"; log "warm-up done (exit $?): $(grep -o 'loaded in [0-9.]* s' "$WORK/warm.err" | tail -1)"
  fi
  tail -c 3000 "$WORK/warm.err" > "$OUTD/warm.err"
fi

run_llama() {          # $1: seconds it may take in all
  local lend=$(( $(date +%s) + $1 )) n t
  for n in $NCMOE_LIST; do
    t=$(( lend - $(date +%s) )); [ "$t" -lt 15 ] && { log "llama-bench -ncmoe $n: skipped (time)"; continue; }
    log "llama-bench -ncmoe $n (${t} s at most)"
    LD_LIBRARY_PATH=$LLP LD_PRELOAD=$LPRE $PIN_BENCH timeout "$(cap "$t" 70)" "$LBIN/llama-bench" -m "$F" -ngl 99 -ncmoe "$n" -fa 0 \
      -t "$BT" -p 512 -n 16 -r 2 -o jsonl >> "$OUTD/llama.jsonl" 2>> "$WORK/llama.err"
    log "llama-bench -ncmoe $n exit $?"
  done
  for n in $NCMOE_LIST; do
    t=$(( lend - $(date +%s) )); [ "$t" -lt 12 ] && { log "llama-batched-bench -ncmoe $n: skipped (time)"; continue; }
    log "llama-batched-bench -ncmoe $n (${t} s at most)"
    LD_LIBRARY_PATH=$LLP LD_PRELOAD=$LPRE $PIN_BENCH timeout "$(cap "$t" 45)" "$LBIN/llama-batched-bench" -m "$F" -ngl 99 -ncmoe "$n" \
      -fa off -t "$BT" -tb "$BT" -c 4096 -b 2048 -ub 512 -npp 32 -ntg 8 -npl 16 --output-format jsonl 2>> "$WORK/llama.err" \
      | sed "s/^{/{\"n_cpu_moe_batched\": $n, /" >> "$OUTD/llama_batched.jsonl"
    log "llama-batched-bench -ncmoe $n exit ${PIPESTATUS[0]}"
  done
  tail -c 4000 "$WORK/llama.err" > "$OUTD/llama.err.tail" 2>/dev/null
}

# 2. llama.cpp first when prebuilt (bounded), so its rows exist whatever AOTX does
if [ -n "$LBIN" ]; then
  run_llama "$(cap $(( $(left) - 200 )) "$LLAMA_S")"
fi

# 3. AOTX, until the deadline less 15 s (it skips a stage that would not fit, and writes aotx.json as it goes)
T=$(( $(left) - 15 ))
if [ -n "$BUILD_PID" ]; then T=$(( T - 120 )); fi      # leave llama.cpp some time after a background build
log "AOTX (${T} s at most, ${BT} threads)"
$PIN_BENCH timeout "$T" "$PY" -m tests.tools.moe_gpu_bench aotx "$F" --json "$OUTD/aotx.json" --home "$HOMED" \
  --budget "${MOE_BENCH_BUDGET:-8G}" --gpu-share "$SHARE" $([ "$ALL_GPU" = 1 ] && echo --all-gpu) \
  --learned-skew "$SKEW" --deadline $(( $(date +%s) + T - 5 )) > "$WORK/aotx.out" 2> "$WORK/aotx.err"
log "AOTX exit $?"
grep '^\[aotx' "$WORK/aotx.err" | tee -a "$OUTD/progress.log" >&2
tail -c 4000 "$WORK/aotx.err" > "$OUTD/aotx.err.tail"

# 2'. llama.cpp after AOTX when it was built here
if [ -n "$BUILD_PID" ]; then
  while [ ! -f "$WORK/llama-build.done" ] && [ "$(left)" -gt 60 ]; do sleep 5; done
  if [ "$(cat "$WORK/llama-build.done" 2>/dev/null)" = 0 ]; then
    LBIN=$WORK/llama.cpp/build/bin; LLP=${LD_LIBRARY_PATH:-}
    run_llama $(( $(left) - 10 ))
  else
    log "llama.cpp not built in time: $(tail -2 "$WORK/llama-build.log" 2>/dev/null | tr '\n' ' ')"
  fi
  tail -c 30000 "$WORK/llama-build.log" > "$OUTD/llama-build.log" 2>/dev/null
fi

# 4. the table
"$PY" - "$OUTD" "$LAYERS" <<'PYEOF' | tee "$OUTD/table.txt"
import json, pathlib, sys
d, layers = pathlib.Path(sys.argv[1]), int(sys.argv[2])
try:
    a = json.loads((d / "aotx.json").read_text())
except (OSError, ValueError):
    a = {}
l: dict = {}
build = "-"
for ln in ((d / "llama.jsonl").read_text().splitlines() if (d / "llama.jsonl").exists() else []):
    try:
        r = json.loads(ln)
    except ValueError:
        continue
    n = int(r.get("n_cpu_moe", layers))
    l.setdefault(n, {})["prefill_512_tok_s" if r.get("n_gen") == 0 else "decode_b1_tok_s"] = round(float(r["avg_ts"]), 2)
    build = f"{r.get('build_commit', '?')} ({r.get('backends', '?')}, {r.get('gpu_info', '?')})"
for ln in ((d / "llama_batched.jsonl").read_text().splitlines() if (d / "llama_batched.jsonl").exists() else []):
    try:
        r = json.loads(ln)
    except ValueError:
        continue
    if "speed_tg" in r:
        l.setdefault(int(r["n_cpu_moe_batched"]), {})["aggregate_16_tok_s"] = round(float(r["speed_tg"]), 2)
print(f"Qwen3-30B-A3B-shaped random weights ({layers} layers), same cores")
for k in ("plan", "admission", "experts_stages", "experts_setup_s", "budget", "gpu_weight_bytes", "load_s", "skipped"):
    if k in a:
        print(f"  aotx {k}: {a[k]}")
for name in ("gpu_tier", "all_gpu"):
    for k in ("plan", "experts_setup_s", "gpu_pair_share"):
        if k in a.get(name, {}):
            print(f"  aotx {name} {k}: {a[name][k]}")
ncm = sorted(l, reverse=True)
gpu_n = [n for n in ncm if n not in (layers, 0)]
rows = [(f"experts on the CPU (llama.cpp -ncmoe {layers})", a, l.get(layers, {}))]
if "gpu_tier" in a or gpu_n:
    g = a.get("gpu_tier", {})
    rows.append((f"~{g.get('share', 0.4):.0%} on the GPU (llama.cpp -ncmoe {gpu_n[0] if gpu_n else '-'})", g,
                 l.get(gpu_n[0], {}) if gpu_n else {}))
if "all_gpu" in a or 0 in l:
    rows.append(("every expert on the GPU (llama.cpp -ncmoe 0)", a.get("all_gpu", {}), l.get(0, {})))
print(f"{'':46}{'':22}{'aotx':>10}{'llama.cpp':>11}{'ratio':>8}")
for name, x, y in rows:
    for k in ("prefill_512_tok_s", "decode_b1_tok_s", "aggregate_16_tok_s"):
        u, v = x.get(k), y.get(k)
        r = f"{u / v:8.2f}" if u and v else ""
        print(f"{name:46}{k:22}{u if u is not None else '-':>10}{v if v is not None else '-':>11}{r}")
        gx = x.get("graphs", {})
        if k in gx:               # the same placement with moe_graphs (graphs between the host moe steps)
            u = gx[k]
            r = f"{u / v:8.2f}" if u and v else ""
            print(f"{'  with moe_graphs':46}{k:22}{u:>10}{v if v is not None else '-':>11}{r}")
        if "error" in gx and k == "decode_b1_tok_s":
            print(f"{'  with moe_graphs':46}{gx['error'][:80]}")
ln = a.get("learned")
if ln:
    print(f"learned GPU expert cache, router skew {ln.get('router_skew')}, {ln.get('share', 0):.0%} budget, "
          f"{ln.get('copies_per_tick')} copies per tick at most (AOTX only)")
    print(f"{'':46}{'static':>10}{'lfu':>10}{'lfu/static':>11}")
    s, f = ln.get("static", {}), ln.get("lfu", {})
    for k in ("decode_b1_tok_s", "aggregate_16_tok_s", "gpu_pair_share"):
        u, v = s.get(k), f.get(k)
        r = f"{v / u:11.2f}" if u and v else ""
        print(f"{'':4}{k:42}{u if u is not None else '-':>10}{v if v is not None else '-':>10}{r}")
    if "warmup" in f:
        print(f"    lfu warm-up {f['warmup']}; while measured: {f.get('copies_while_measured')} copies; {f.get('cache')}")
print(f"llama.cpp build {build}")
PYEOF
log "done: $(( $(date +%s) - T0 )) s"
