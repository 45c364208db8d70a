#!/usr/bin/env bash
# Long histories on one GPU (issue 33, item 4), in ONE device call (every step bounded):
#   1. tests/test_cuda_kv_quant.py (CUDA's q8_0/q4_0 blocks against the CPU's, capsules);
#   2. the Llama-3.1-8B-shape random-weight file (tests/models/shapes.py), written here;
#   3. llama.cpp (the prebuilt 0c1e570, FlashAttention): decode (tg32) after 4k/16k/32k tokens of
#      history (llama-bench -d) and prefill 4k/16k/32k (pp), per KV type (-ctk/-ctv);
#   4. AOTX on the same file: tests/tools/bench_long_context.py --device cuda, per KV type
#      (TTFT = prefill in chunks of 512 and the first token; decode = 32 greedy ticks after it);
#   5. other CUDA test files while time is left (LC_TESTS).
# Prepare here: bash tests/tools/mmq_bench_prep.sh (wheels into .whl/); cp ../shared/peer/llama-bin.tar.xz .gpubench/;
#               .gpubench/tokenizer.json as tests/tools/gpu_bench_prep.sh writes it
# Device:       PYTHONUNBUFFERED=1 bash tests/tools/gpu_long_context.sh     carry: [".whl", ".gpubench"]
# Knobs: LC_DEADLINE (seconds, 540), LC_KV (f16,q8_0,q4_0), LC_HISTORY (4096,16384,32768), LC_TESTS,
# LC_SHAPE (a tests/models/shapes.py name, llama-3.1-8b), LC_KVQ (1/0: step 1), LC_LLAMA_S (llama.cpp's limit per KV type).
# Files under $OUT: kvq.log, llama_*.jsonl, aotx.jsonl, tests.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
DEADLINE=${LC_DEADLINE:-540}
KVS=${LC_KV:-f16,q8_0,q4_0}
HIST=${LC_HISTORY:-4096,16384,32768}
OUTD=${OUT:-/tmp/lc_out}
WORK=/tmp/lc_work
PY=${PY:-python3}
mkdir -p "$OUTD" "$WORK"
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(el) )); }
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site \
  .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
mkdir -p /tmp/aotx-lc && ln -sfn "$ROOT" /tmp/aotx-lc/aotx
export PYTHONPATH=/tmp/aotx-lc:$ROOT:/tmp/aotx-site
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true

echo "== $(el)s 2. the llama-3.1-8b-shape file (background)"
( "$PY" -c "
import sys
from pathlib import Path
from tests.models import shapes
p = Path('$WORK/${LC_SHAPE:-llama-3.1-8b}.gguf')
shapes.write_shape(p.with_suffix('.part'), '${LC_SHAPE:-llama-3.1-8b}', shapes.load_tokenizer('.gpubench/tokenizer.json'), seed=1)
p.with_suffix('.part').rename(p)
print('written', p, p.stat().st_size)
" > "$OUTD/write.log" 2>&1 ) &
P_WRITE=$!

if [ "${LC_KVQ:-1}" = 1 ]; then
echo "== $(el)s 1. tests/test_cuda_kv_quant.py"
timeout -s KILL 170 "$PY" -m pytest -q --tb=short -rs -s -p no:cacheprovider tests/test_cuda_kv_quant.py > "$OUTD/kvq.log" 2>&1
echo "kvq rc $?"; grep -E "CUDA vs CPU|passed|failed|Error|assert" "$OUTD/kvq.log" | tail -12
fi

wait "$P_WRITE"; tail -2 "$OUTD/write.log"
F=$WORK/${LC_SHAPE:-llama-3.1-8b}.gguf
[ -f "$F" ] || { echo "no model file"; exit 1; }

echo "== $(el)s 3. llama.cpp ($(left) s left)"
if [ -f .gpubench/llama-bin.tar.xz ] && [ ! -x .gpubench/llama-bin/llama-bench ]; then
  mkdir -p .gpubench/llama-bin && tar -xJf .gpubench/llama-bin.tar.xz -C .gpubench/llama-bin --strip-components=1
fi
. tests/tools/gpu_common.sh
LB=$ROOT/.gpubench/llama-bin
LLP=$LB
for f in "$(find_lib libcublas.so.13)" "$(find_lib libcudart.so.13)"; do [ -n "$f" ] && LLP="$LLP:$(dirname "$f")"; done
SP=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" 2>/dev/null)
for extra in "$SP"/nvidia/cu13/lib "$SP"/nvidia/cublas/lib "$SP"/nvidia/cuda_runtime/lib /usr/local/nvidia/lib64; do
  [ -d "$extra" ] && LLP="$LLP:$extra"
done
PRE=$(driver_libcuda)
lb() { LD_LIBRARY_PATH=$LLP${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} LD_PRELOAD=$PRE "$LB/llama-bench" "$@"; }
lb --list-devices 2>&1 | grep -i cuda | head -2
IFS=, read -ra KVA <<< "$KVS"
for kv in "${KVA[@]}"; do
  [ "$(left)" -lt ${LC_LLAMA_MIN:-200} ] && { echo "llama.cpp $kv skipped: $(left) s left"; continue; }
  timeout -s KILL ${LC_LLAMA_S:-90} bash -c "$(declare -f lb); LLP='$LLP' PRE='$PRE' LB='$LB'; lb -m '$F' -p 0 -n 32 -d $HIST -fa 1 -ctk $kv -ctv $kv -r 2 -o jsonl" \
    > "$OUTD/llama_tg_$kv.jsonl" 2> "$OUTD/llama_tg_$kv.err"
  timeout -s KILL ${LC_LLAMA_S:-60} bash -c "$(declare -f lb); LLP='$LLP' PRE='$PRE' LB='$LB'; lb -m '$F' -p $HIST -n 0 -fa 1 -ctk $kv -ctv $kv -r 1 -o jsonl" \
    > "$OUTD/llama_pp_$kv.jsonl" 2> "$OUTD/llama_pp_$kv.err"
  "$PY" - "$OUTD/llama_tg_$kv.jsonl" "$OUTD/llama_pp_$kv.jsonl" <<'PYEOF'
import json, sys
for f in sys.argv[1:]:
    for line in open(f):
        try:
            r = json.loads(line)
        except ValueError:
            continue
        print(f"llama.cpp kv {r.get('type_k')}: pp {r.get('n_prompt')} tg {r.get('n_gen')} depth {r.get('n_depth')}: "
              f"{r.get('avg_ts'):.1f} tok/s")
PYEOF
  tail -2 "$OUTD/llama_tg_$kv.err" | grep -iv "^load_backend" | head -2
done

echo "== $(el)s 4. AOTX ($(left) s left)"
timeout -s KILL $(( $(left) > 260 ? 240 : $(left) - 20 )) "$PY" tests/tools/bench_long_context.py \
  --engine aotx --device cuda --model "$F" --kv-type "$KVS" --history "$HIST" --json 2>&1 | tee "$OUTD/aotx.jsonl" | tail -12

echo "== $(el)s 5. other CUDA tests ($(left) s left)"
if [ "$(left)" -gt 40 ]; then
  timeout -s KILL $(( $(left) - 10 )) "$PY" -m pytest -q --tb=line -rs -p no:cacheprovider ${LC_TESTS:-tests/test_device_sampling.py tests/test_cuda_state.py} \
    > "$OUTD/tests.log" 2>&1
  tail -5 "$OUTD/tests.log"
fi
echo "== $(el)s done"
