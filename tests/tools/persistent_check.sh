#!/usr/bin/env bash
# The persistent decode step and the fp16 GEMV (measurement candidates in tests/tools:
# persistent_step.py, gemv_h.cu) on one GPU, one bounded call: the persistent decode
# step's tests (its bits against the graph of kernels), the CUDA invariance tests (the
# engine's graph path), the default model's shape through
# gpu_bench's AOTX side (persistent against the graph of kernels, blocks per SM, warps per pair,
# L2 prefetch; bits compared), the fp16 GEMV test and bench.
# Here first: .whl/ (gguf, msgspec, platformdirs, google-crc32c for Python 3.12) and
# .gpubench/tokenizer.json (tests/tools/gpu_bench_prep.sh makes both).
# Device:  PYTHONUNBUFFERED=1 bash tests/tools/persistent_check.sh   carry: [".whl", ".gpubench"]
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUTD=${OUT:-/tmp/pcheck}
mkdir -p "$OUTD" /tmp/pcheck
T0=$(date +%s)
el() { echo "[$(( $(date +%s) - T0 )) s]"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site .whl/*.whl \
  >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/aotx-gpu && ln -sfn "$ROOT" /tmp/aotx-gpu/aotx
export PYTHONPATH=/tmp/aotx-gpu:$ROOT:/tmp/aotx-site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
STEPS=${PCHECK_STEPS:-persistent,invariance,bench,flash,fp16}
if [[ $STEPS == *persistent* ]]; then
  echo "$(el) == tests/test_cuda_persistent*.py"
  timeout -s KILL 200 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_cuda_persistent_host.py \
    tests/test_cuda_persistent.py 2>&1 | tee "$OUTD/pytest_persistent.log" | tail -25
fi

if [[ $STEPS == *invariance* ]]; then
  echo "$(el) == tests/test_cuda_invariance.py (float32 activations)"
  timeout -s KILL 150 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_cuda_invariance.py -k "not int8" 2>&1 \
    | tee "$OUTD/pytest_invariance.log" | tail -8
fi

if [[ $STEPS == *bench* ]]; then
  echo "$(el) == gpu_bench aotx: smollm2-135m shape"
  mkdir -p /tmp/pcheck && python3 -m tests.tools.gpu_bench write --out /tmp/pcheck --tokenizer .gpubench/tokenizer.json \
    --models smollm2-135m >/dev/null && \
  timeout -s KILL 170 python3 -m tests.tools.gpu_bench aotx --model /tmp/pcheck/smollm2-135m.gguf --name smollm2-135m \
    --home /tmp/pcheck/home --budget 15 --json "$OUTD/aotx_smollm2.json" 2>&1 | tail -12
  python3 - "$OUTD/aotx_smollm2.json" <<'PY'
import json, sys
try:
    r = json.load(open(sys.argv[1]))
except Exception as e:
    print("no result:", e); raise SystemExit
print("decode b1", r["decode_b1_tok_s"], "tok/s", r["decode_b1_device_ms"], "ms device;", r["persistent"])
print("aggregate", r["aggregate_tok_s"], "tick ms", r["tick_device_ms"], "prefill", r["prefill_tok_s"])
for k, v in (r.get("persistent_variants") or {}).items():
    print(f"  {k:38} {v}")
PY
fi

if [[ $STEPS == *flash* ]]; then
  echo "$(el) == flash prefill attention: tests and bench"
  timeout -s KILL 150 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_cuda_flash_attention.py 2>&1 \
    | tee "$OUTD/pytest_flash.log" | tail -8
  timeout -s KILL 90 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_cuda_program.py -k long_segments 2>&1 \
    | tail -4
  timeout -s KILL 100 python3 -m tests.tools.cuda_attn_bench 2>&1 | tee "$OUTD/attn_bench.log" | tail -14
fi

if [[ $STEPS == *fp16* ]]; then
  echo "$(el) == fp16 GEMV test and bench"
  timeout -s KILL 90 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_cuda_gemv_f16.py 2>&1 \
    | tee "$OUTD/pytest_f16.log" | tail -8
  timeout -s KILL 150 python3 -m tests.tools.cuda_gemv_bench --fp16 2>&1 | tee "$OUTD/gemv_fp16.log" | tail -16
fi
echo "$(el) done"
