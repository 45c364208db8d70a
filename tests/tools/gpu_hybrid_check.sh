#!/usr/bin/env bash
# Hybrid models (qwen35: gated DeltaNet + gated attention) on CUDA, in ONE device call of under
# 4 minutes (every step bounded):
#   1. tests/test_cuda_hybrid.py: CUDA vs CPU logits (prefill, 3-slot decode, a mixed eager batch,
#      a verify window and its rollback), batch invariance bit for bit, rollback = the kept rows'
#      state, a capsule restored byte-exact and decoding identically, KV alone diverging;
#   2. while time is left, tests/test_cuda_parity.py and tests/test_cuda_state.py (the program.py and
#      kv.py paths every model shares: nothing there may have moved);
#   3. one short summary, last.
# Prepare here:   bash tests/tools/mmq_bench_prep.sh        (wheels into .whl/: gguf, msgspec, ...)
# Device:         PYTHONUNBUFFERED=1 bash tests/tools/gpu_hybrid_check.sh      carry: [".whl"], timeout_s 300
# Knobs: HYBRID_CHECK_DEADLINE (seconds for the whole script, default 235), HYBRID_CHECK_TEST_S (the
# hybrid tests' limit, default 200: cold NVRTC and numba compiles included; qwen35's tests run
# first, qwen3next's last). Files under $OUT: hybrid.log, shared.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
DEADLINE=${HYBRID_CHECK_DEADLINE:-235}
OUTD=${OUT:-/tmp/gpu_hybrid_out}
PY=${PY:-python3}
mkdir -p "$OUTD"
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(el) )); }

if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site \
    .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
fi
mkdir -p /tmp/aotx-hybrid && ln -sfn "$ROOT" /tmp/aotx-hybrid/aotx
export PYTHONPATH=/tmp/aotx-hybrid:$ROOT:/tmp/aotx-site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import cupy, numba, gguf, msgspec, platformdirs; print('cupy', cupy.__version__, 'CUDA runtime',
cupy.cuda.runtime.runtimeGetVersion(), 'cc', cupy.cuda.Device().compute_capability, 'numba', numba.__version__)" \
  || exit 1

echo "== $(el)s 1. tests/test_cuda_hybrid.py"
timeout -s KILL "${HYBRID_CHECK_TEST_S:-200}" "$PY" -m pytest -q --tb=short -rs -s -p no:cacheprovider \
  tests/test_cuda_hybrid.py > "$OUTD/hybrid.log" 2>&1
H_RC=$?
grep -E "worst relative error|passed|failed|error|skipped|SKIP" "$OUTD/hybrid.log" | tail -8
[ "$H_RC" -eq 0 ] || tail -60 "$OUTD/hybrid.log"
[ "$H_RC" -eq 137 ] && echo "(cut at its time limit: hybrid.log shows how far it got)"

S_RC=-1
if [ "$(left)" -gt 40 ]; then
  echo "== $(el)s 2. tests/test_cuda_parity.py tests/test_cuda_state.py ($(left) s left)"
  timeout -s KILL $(( $(left) - 5 )) "$PY" -m pytest -q --tb=line -rs -p no:cacheprovider \
    tests/test_cuda_parity.py tests/test_cuda_state.py > "$OUTD/shared.log" 2>&1
  S_RC=$?
  tail -6 "$OUTD/shared.log"
else
  echo "== 2. skipped: $(left) s left"
fi

echo "== $(el)s summary: hybrid tests rc $H_RC (0 = all passed), shared CUDA tests rc $S_RC (-1: not run, 137: cut)"
exit $(( H_RC != 0 ))
