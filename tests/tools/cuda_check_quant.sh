#!/usr/bin/env bash
# GPU check of the CUDA tensor types (issue 14, item 5; helper `quant`), in one call:
# builds the kernels (NVRTC through CuPy), runs the CUDA quant tests and the CUDA parity
# tests, then prints each type's GEMV/dequant throughput. Run from anywhere; PY picks the
# interpreter (default: the repository's .venv if present, else python).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
nvidia-smi -L || true
"$PY" -m pytest -q -rs -m cuda tests/test_cuda_quants.py tests/test_cuda_parity.py
"$PY" -m tests.tools.cuda_time_quants
