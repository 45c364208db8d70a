#!/usr/bin/env bash
# Issue 14's Done-when on one GPU: the two real files (Qwen2.5-Coder-0.5B-Instruct, qwen2;
# Gemma 3 270M, gemma3) through --device cuda: tests/test_real_archs.py with
# AOTX_REAL_DEVICE=cuda (teacher-forced vs llama.cpp's references, 4 concurrent conversations
# = each alone, ngram speculation = plain greedy, capsule round trip, `aotx run`), then one
# answer each. The files are too big for one device call (64 MiB): carry them in pieces into
# /tmp/real first (split -b 56M -d -a 2 FILE q|g into the ignored .dev/real/, one call per
# piece: `mkdir -p /tmp/real && cp .dev/real/* /tmp/real/`, carry [".dev/real/qNN"]), while the
# machine stays warm. Then:  bash tests/tools/gpu_real.sh   carry [".whl"]
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-python3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site .whl/*.whl \
  >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/aotx-real && ln -sfn "$ROOT" /tmp/aotx-real/aotx
export PYTHONPATH=/tmp/aotx-real:$ROOT:/tmp/aotx-site
cd /tmp/real || { echo "no /tmp/real: carry the pieces first"; exit 1; }
[ -f qwen2.5-coder-0.5b-instruct-q4_k_m.gguf ] || cat q?? > qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
[ -f gemma-3-270m-q4_k_m.gguf ] || cat g?? > gemma-3-270m-q4_k_m.gguf
sha256sum qwen2.5-coder-0.5b-instruct-q4_k_m.gguf gemma-3-270m-q4_k_m.gguf
cd "$ROOT"
export AOTX_REAL_MODELS_DIR=/tmp/real AOTX_REAL_DEVICE=cuda
timeout ${T_REAL:-330} "$PY" -m pytest -q --tb=short -rs -p no:cacheprovider --timeout 300 tests/test_real_archs.py \
  ${EXTRA_TESTS:-} 2>&1 | tail -25
export AOTX_HOME=/tmp/aotx-real-home
for m in qwen2.5-coder-0.5b-instruct-q4_k_m.gguf:"Write a Python function that reverses a string." \
         gemma-3-270m-q4_k_m.gguf:"The capital of France is"; do
  f=${m%%:*}; q=${m#*:}
  echo "== aotx run --device cuda --model $f"
  timeout 120 "$PY" -m aotx.engine.cli.commands run --model /tmp/real/$f --device cuda --socket /tmp/aotx-real-s.sock \
    --temperature 0 --max-tokens 48 "$q" 2>&1 | tail -12
  timeout 30 "$PY" -m aotx.engine.cli.commands stop --socket /tmp/aotx-real-s.sock >/dev/null 2>&1
done
