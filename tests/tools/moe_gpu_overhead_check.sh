#!/usr/bin/env bash
# The GPU expert tier's host overhead (issue 22, "GPU tier host overhead"; helper `moe`), one
# device call, at most ~150 s:
#   1. tests/tools/moe_gpu_overhead.py: host time of one GPU-tier layer call on the tiny qwen3moe
#      file, per-expert launches (before) vs the grouped moe_gemv path (after), 1/4/16 rows, the
#      outputs compared bit for bit; the CPU tier beside them; a decode forward both ways
#      (run first, on a quiet machine; its table is printed again at the end);
#   2. tests/test_cuda_moe.py -k grouped: the grouped launches give the per-expert launches' bits
#      (layer calls, and the logits of all-GPU and mixed placements) on qwen3moe, olmoe, gpt-oss;
#   3. tests/test_cuda_moe.py: the placement parity (all-GPU / mixed / all-CPU logits vs the CPU)
#      and the calibration, with the time left.
# Run from the repo root:  PYTHONUNBUFFERED=1 bash tests/tools/moe_gpu_overhead_check.sh   (carry: .whl)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-python3}
END=$((SECONDS + 145))
left() { local n=$((END - SECONDS - ${1:-0})); [ $n -lt 5 ] && n=5; echo $n; }
if [ -d .whl ]; then
  timeout 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/aotx-site .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  SITE=/tmp/aotx-site
fi
mkdir -p /tmp/aotx-after && ln -sfn "$ROOT" /tmp/aotx-after/aotx
export PYTHONPATH=/tmp/aotx-after:$ROOT${SITE:+:$SITE}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
FAIL=0

echo "== 1. host time per GPU-tier layer call, before/after (tests/tools/moe_gpu_overhead.py)"
timeout "$(left 75)" "$PY" -m tests.tools.moe_gpu_overhead --reps 200 > /tmp/moe-overhead.txt 2>&1
RC=$?
cat /tmp/moe-overhead.txt | tail -14
[ $RC = 0 ] || { echo "FAIL timing: rc $RC"; FAIL=1; }

echo "== 2. grouped == per-expert, bit for bit (tests/test_cuda_moe.py -k grouped)"
timeout "$(left 25)" "$PY" -m pytest -x -q --tb=short -rs -s -p no:cacheprovider tests/test_cuda_moe.py -k grouped \
  > /tmp/moe-grouped.txt 2>&1
RC=$?
grep -E "bit for bit|passed|failed|skipped|SKIPPED|FAILED|Error|error" /tmp/moe-grouped.txt | tail -12
[ $RC = 0 ] || { echo "FAIL grouped test: rc $RC"; tail -30 /tmp/moe-grouped.txt; FAIL=1; }

echo "== 3. placement parity and calibration (with the time left: $(left) s)"
timeout "$(left)" "$PY" -m pytest -x -q --tb=short -rs -s -p no:cacheprovider tests/test_cuda_moe.py \
  -k "whatever_the_placement or calibration" > /tmp/moe-parity.txt 2>&1
RC=$?
grep -E "worst relative|experts:|passed|failed|skipped|SKIPPED|FAILED|Error" /tmp/moe-parity.txt | cut -c1-300 | tail -8
[ $RC = 0 ] || { echo "FAIL/TIMEOUT parity+calibration: rc $RC (124 = ran out of time)"; tail -20 /tmp/moe-parity.txt; \
  [ $RC = 124 ] || FAIL=1; }

echo "== table (repeated from step 1)"
grep -A6 "^GPU expert tier, one layer call" /tmp/moe-overhead.txt
grep -E "^decode forward|^overhead check" /tmp/moe-overhead.txt
echo "== summary: $([ $FAIL = 0 ] && echo PASS || echo FAIL)"
exit $FAIL
