#!/usr/bin/env bash
# The GPU expert tier's calibration, fixed + marginal (issue 22; helper `moe`), one device call,
# at most ~115 s:
#   1. tests/tools/moe_gpu_tier_predict.py: on the tiny qwen3moe, olmoe and gpt-oss files, layer 0's
#      GPU-tier timings (one expert's call, the layer-shaped call of k experts on 1 and 16 rows) and
#      their split into the call's fixed part and each expert's; then the plan's predicted decode
#      tok/s next to the measured one with every expert on the GPU, 40% of them, and none
#      (run first, on a quiet machine; its table is printed again at the end);
#   2. tests/test_cuda_moe.py, most important first, with the time left: the grouped moe_gemv
#      launches give the per-expert gemv launches' bits (moe_gemv now forms its sums and epilogue
#      through gemv's own device functions) and the logits equal the CPU's whatever the placement,
#      on qwen3moe, then the calibration (the new fields), then gpt-oss and olmoe.
# Run from the repo root:  PYTHONUNBUFFERED=1 bash tests/tools/moe_gpu_tier_check.sh   (carry: .whl)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-python3}
END=$((SECONDS + 112))
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

echo "== 1. predicted vs measured decode, layer-call timings (tests/tools/moe_gpu_tier_predict.py)"
timeout "$(left 62)" "$PY" -m tests.tools.moe_gpu_tier_predict --steps 40 > /tmp/moe-predict.txt 2>&1
RC=$?
grep -v "^== predicted" /tmp/moe-predict.txt | grep -v "^  [a-z0-9]* *\(all\|40%\|cpu\) " | tail -14
[ $RC = 0 ] || { echo "FAIL predict: rc $RC"; tail -20 /tmp/moe-predict.txt; FAIL=1; }

echo "== 2. tests/test_cuda_moe.py, most important first, with the time left ($(left 3) s)"
T=tests/test_cuda_moe.py
timeout "$(left 3)" "$PY" -m pytest -v --tb=short -rs -s -p no:cacheprovider \
  "$T::test_cuda_gpu_tier_grouped_launches_give_the_bits_of_the_per_expert_launches[qwen3moe]" \
  "$T::test_cuda_gpu_expert_tier_gives_the_cpu_logits_whatever_the_placement[qwen3moe]" \
  "$T::test_cuda_expert_calibration_times_the_gpu_tier_and_places_by_it" \
  "$T::test_cuda_gpu_tier_grouped_launches_give_the_bits_of_the_per_expert_launches[gptoss]" \
  "$T::test_cuda_gpu_expert_tier_gives_the_cpu_logits_whatever_the_placement[gptoss]" \
  "$T::test_cuda_gpu_tier_grouped_launches_give_the_bits_of_the_per_expert_launches[olmoe]" > /tmp/moe-tests.txt 2>&1
RC=$?
grep -E "bit for bit|worst relative|fixed|PASSED|FAILED|SKIPPED|Error|passed|failed" /tmp/moe-tests.txt | cut -c1-300 | tail -16
if [ $RC = 124 ]; then echo "TIMEOUT: the tests above without PASSED did not run"; FAIL=1
elif [ $RC != 0 ]; then echo "FAIL tests: rc $RC"; grep -B2 -A25 "^___" /tmp/moe-tests.txt | head -60; FAIL=1
elif grep -q " SKIPPED" /tmp/moe-tests.txt; then echo "FAIL: tests skipped (no GPU seen?)"; FAIL=1; fi

echo "== table (repeated from step 1)"
sed -n '/^== predicted/,$p' /tmp/moe-predict.txt
echo "== summary: $([ $FAIL = 0 ] && echo PASS || echo FAIL) ($SECONDS s)"
exit $FAIL
