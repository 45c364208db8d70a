#!/usr/bin/env bash
# Constrained decoding on the GPU (issue 21): the sampling kernel's token mask against the
# host chain, an engine on CUDA with a JSON-schema reply through the device path, and the
# CUDA cost of the mask for BENCHMARKS.md. Run from the repository root on the GPU machine,
# in one call (well under 10 minutes):  bash tests/tools/cuda_check_gateway.sh
set -euo pipefail
PY=${PY:-python}
$PY -c "import cupy, llguidance; print('cupy', cupy.__version__, 'llguidance', llguidance.__name__)"
$PY -m pytest -q -rs -m cuda tests/test_gateway_cuda.py
$PY -m tests.tools.bench_constraints --device cuda --tokens 64
