#!/usr/bin/env bash
# The GPU expert tier's host overhead (issue 22, "GPU tier host overhead"; helper `moe`), one
# device call, at most ~150 s:
#   1. tests/tools/moe_gpu_overhead.py: host time of one GPU-tier layer call on the tiny qwen3moe
#      file, per-expert launches (before) vs the grouped moe_gemv path (after), 1/4/16 rows, the
#      outputs compared bit for bit; the CPU tier beside them; a decode forward both ways
#      (run first, on a quiet machine; its table is printed again at the end);
#   2. tests/test_cuda_moe.py, in this order, with the time left: the grouped launches give the
#      per-expert launches' bits (layer calls, and the logits of all-GPU and mixed placements) and
#      the placement parity (all-GPU / mixed / all-CPU logits vs the CPU float path) on qwen3moe,
#      then gpt-oss, then the grouped test on olmoe and the calibration.
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
timeout "$(left 70)" "$PY" -m tests.tools.moe_gpu_overhead --reps 200 > /tmp/moe-overhead.txt 2>&1
RC=$?
cat /tmp/moe-overhead.txt | tail -14
[ $RC = 0 ] || { echo "FAIL timing: rc $RC"; FAIL=1; }

echo "== 2. tests/test_cuda_moe.py, most important first, with the time left ($(left 3) s)"
T=tests/test_cuda_moe.py
timeout "$(left 3)" "$PY" -m pytest -v --tb=short -rs -s -p no:cacheprovider \
  "$T::test_cuda_gpu_tier_grouped_launches_give_the_bits_of_the_per_expert_launches[qwen3moe]" \
  "$T::test_cuda_gpu_expert_tier_gives_the_cpu_logits_whatever_the_placement[qwen3moe]" \
  "$T::test_cuda_gpu_tier_grouped_launches_give_the_bits_of_the_per_expert_launches[gptoss]" \
  "$T::test_cuda_gpu_expert_tier_gives_the_cpu_logits_whatever_the_placement[gptoss]" \
  "$T::test_cuda_gpu_tier_grouped_launches_give_the_bits_of_the_per_expert_launches[olmoe]" \
  "$T::test_cuda_expert_calibration_times_the_gpu_tier_and_places_by_it" > /tmp/moe-tests.txt 2>&1
RC=$?
grep -E "bit for bit|worst relative|PASSED|FAILED|SKIPPED|Error|passed|failed" /tmp/moe-tests.txt | cut -c1-240 | tail -16
if [ $RC = 124 ]; then echo "TIMEOUT: the tests above without PASSED did not run"; FAIL=1
elif [ $RC != 0 ]; then echo "FAIL tests: rc $RC"; grep -B2 -A25 "^___" /tmp/moe-tests.txt | head -60; FAIL=1
elif grep -q " SKIPPED" /tmp/moe-tests.txt; then echo "FAIL: tests skipped (no GPU seen?)"; FAIL=1; fi

echo "== table (repeated from step 1)"
grep -A5 "^GPU expert tier, one layer call" /tmp/moe-overhead.txt
grep -E "^decode forward|^overhead check" /tmp/moe-overhead.txt
echo "== summary: $([ $FAIL = 0 ] && echo PASS || echo FAIL)"
exit $FAIL
