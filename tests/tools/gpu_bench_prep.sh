#!/usr/bin/env bash
# Prepare, HERE (a machine with pip and the default model), what tests/tools/gpu_bench.sh
# needs on the GPU machine, in two git-ignored folders that travel with the call:
#   .whl/       the wheels the H200 image lacks (gguf, msgspec, platformdirs, google-crc32c)
#   .gpubench/  llama.cpp's source (the one vendored in llama-cpp-python 0.3.36, from
#               /work/main/.peer/llama.cpp-src.tar.xz or $LLAMA_SRC) and SmolLM2's tokenizer
#               metadata as JSON (from the default model's GGUF: the random-weight models
#               of the benchmark carry it, so llama.cpp can load them)
# Then, on the device:  PYTHONUNBUFFERED=1 bash tests/tools/gpu_bench.sh   carry: [".whl", ".gpubench"]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
for d in /.whl/ /.gpubench/; do grep -qxF "$d" "$EXCL" 2>/dev/null || echo "$d" >> "$EXCL"; done
if [ ! -d .whl ] || [ -z "$(ls .whl/*.whl 2>/dev/null)" ]; then
  mkdir -p .whl
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl gguf==0.19.0 msgspec==0.23.0 platformdirs==4.14.9 google-crc32c==1.9.0
fi
mkdir -p .gpubench
cp "${LLAMA_SRC:-/work/main/.peer/llama.cpp-src.tar.xz}" .gpubench/llama.cpp-src.tar.xz
"$PY" - <<'PYEOF'
import sys
sys.path.insert(0, ".")
from aotx.engine.model.loader import default_model_path
from tests.models import shapes
kv = shapes.tokenizer_kv_from_gguf(default_model_path())
shapes.save_tokenizer(kv, ".gpubench/tokenizer.json")
print("tokenizer keys:", ", ".join(e["key"] for e in kv))
PYEOF
ls -la .whl .gpubench && du -sh .whl .gpubench
