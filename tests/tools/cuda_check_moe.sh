#!/usr/bin/env bash
# Mixtures of experts on the CUDA backend, in one call (issue 22; helper `moe`), <= 5 min:
#   1. tests/test_cuda_moe.py: tiny qwen3moe, olmoe and gpt-oss logits (dense layers on the GPU, the
#      moe op on the CPU expert tier) against the CPU float path, prefill / multi-slot decode /
#      verify / mixed batches, f16 and f32 KV; device greedy; the plan; the fake-CuPy dry run;
#   2. `aotx run --device cuda` on the tiny qwen3moe file (SmolLM2 tokenizer): the startup
#      profile's expert stages and the admission note; then the same prompt on the CPU;
#   3. gpt-oss (attention sinks, sliding window): `--device cuda` answers.
# Prepare here first: bash tests/tools/cuda_check_moe_prep.sh (makes .moe_files/ and .whl/).
# Run from the repo root:  PYTHONUNBUFFERED=1 bash tests/tools/cuda_check_moe.sh   (carry: .whl, .moe_files)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-python3}
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site .whl/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  SITE=/tmp/aotx-site
fi
mkdir -p /tmp/aotx-after && ln -sfn "$ROOT" /tmp/aotx-after/aotx
export PYTHONPATH=/tmp/aotx-after:$ROOT${SITE:+:$SITE}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
"$PY" -c "import cupy, numba, gguf; print('cupy', cupy.__version__, 'numba', numba.__version__)" || exit 1
FAIL=0

echo "== 1. tests/test_cuda_moe.py"
timeout 200 "$PY" -m pytest -x -q --tb=short -rs -s -p no:cacheprovider tests/test_cuda_moe.py 2>&1 | tail -30
[ "${PIPESTATUS[0]}" = 0 ] || FAIL=1

export AOTX_HOME=/tmp/aotx-moe-home
SOCK=/tmp/aotx-moe-s/e.sock
mkdir -p /tmp/aotx-moe-s
aotx() { timeout 120 "$PY" -m aotx.engine.cli.commands "$@"; }
if [ -f .moe_files/qwen3moe.gguf ]; then
  echo "== 2. aotx run --device cuda (qwen3moe)"
  aotx run --model .moe_files/qwen3moe.gguf --device cuda --socket $SOCK --slots 2 --context 512 --json --profile \
    --temperature 0 --max-tokens 8 "Hello" > /tmp/aotx-moe-s/cuda.out 2> /tmp/aotx-moe-s/cuda.err
  RC=$?
  grep -h '"done"\|stages_s' /tmp/aotx-moe-s/cuda.out /tmp/aotx-moe-s/cuda.err | cut -c1-900
  grep -h "experts\|budget\|CPU tier" "$AOTX_HOME/engine.log" 2>/dev/null | tail -6
  aotx stop --socket $SOCK >/dev/null 2>&1
  if [ $RC != 0 ]; then
    if grep -q "No module named" /tmp/aotx-moe-s/cuda.err "$AOTX_HOME/engine.log" 2>/dev/null; then
      echo "SKIP engine step: $(grep -ho "No module named [^ ]*" /tmp/aotx-moe-s/cuda.err "$AOTX_HOME/engine.log" | head -1)"
    else
      echo "FAIL aotx run --device cuda: rc $RC"; tail -5 /tmp/aotx-moe-s/cuda.err; tail -20 "$AOTX_HOME/engine.log"; FAIL=1
    fi
  else
    echo "-- the same prompt on the CPU (greedy; int8 CPU kernels vs the GPU's float: ids may differ late)"
    aotx run --model .moe_files/qwen3moe.gguf --device cpu --socket ${SOCK}2 --slots 2 --context 512 --json \
      --temperature 0 --max-tokens 8 "Hello" 2>/dev/null | grep '"done"' | cut -c1-400
    aotx stop --socket ${SOCK}2 >/dev/null 2>&1
  fi
  echo "== 3. gpt-oss (attention sinks, sliding window) on --device cuda"
  aotx run --model .moe_files/gptoss.gguf --device cuda --socket ${SOCK}3 --slots 1 --context 256 --json \
    --temperature 0 --max-tokens 4 "Hello" > /tmp/aotx-moe-s/g.out 2> /tmp/aotx-moe-s/g.err
  RC=$?
  grep '"done"' /tmp/aotx-moe-s/g.out | cut -c1-300
  if [ $RC != 0 ] || ! grep -q '"done"' /tmp/aotx-moe-s/g.out; then
    echo "FAIL gpt-oss --device cuda: rc $RC"; tail -5 /tmp/aotx-moe-s/g.err; tail -20 "$AOTX_HOME/engine.log"; FAIL=1
  fi
  aotx stop --socket ${SOCK}3 >/dev/null 2>&1
else
  echo "== 2-3 skipped: no .moe_files/ (run tests/tools/cuda_check_moe_prep.sh here and carry .moe_files)"
fi
echo "== summary: $([ $FAIL = 0 ] && echo PASS || echo FAIL)"
exit $FAIL
