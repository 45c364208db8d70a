#!/usr/bin/env bash
# The CUDA backend on one GPU machine, in one call (issue 14; helper `cuda`):
#   1. the CUDA tests (-x, short tracebacks): every architecture's Program against the CPU
#      float path (graph and eager, f16 and f32 KV, fused and generic kernels), the
#      llama parity and state tests, device sampling, capsules;
#   2. the llama decode/prefill benchmark (tests/tools/bench_cuda.py, the default model's
#      shape: the real file when installed, else random weights of its shape), after the
#      port (f16 KV, the default; then f32) and, when .before/ was carried, before it;
#   3. a short table last.
# Installs nothing from a registry: the wheels the image lacks come from a carried .whl/
# (tests/tools/cuda_check_prep.sh makes .whl/ and .before/ here). Run from the repo root:
#   PYTHONUNBUFFERED=1 bash tests/tools/cuda_check.sh          (carry: .whl, .before)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-python3}
case $PY in */*) PY="$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")" ;; esac   # the before run changes folder
OUTD=${OUT:-/tmp/cuda_check}
mkdir -p "$OUTD"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site .whl/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  SITE=/tmp/aotx-site
fi
# pyproject maps the package `aotx` to the repository root: a link stands in for the install
mkdir -p /tmp/aotx-after && ln -sfn "$ROOT" /tmp/aotx-after/aotx
export PYTHONPATH=/tmp/aotx-after:$ROOT${SITE:+:$SITE}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
"$PY" -c "import cupy, gguf, msgspec, platformdirs, google_crc32c; print('cupy', cupy.__version__)" || exit 1

echo "== 1. CUDA tests"
TESTS="tests/test_cuda_plan.py tests/test_cuda_program.py tests/test_cuda_parity.py tests/test_cuda_state.py
       tests/test_device_sampling.py tests/test_capsule_homes.py"
for t in tests/test_cuda_quants.py; do [ -f "$t" ] && TESTS="$TESTS $t"; done
timeout 330 "$PY" -m pytest -x -q --tb=short -rs -p no:cacheprovider $TESTS 2>&1 | tee "$OUTD/pytest.log" \
  | tail -40
T_RC=${PIPESTATUS[0]}

echo "== 2. benchmarks"
timeout 80 "$PY" -m tests.tools.bench_cuda --json > "$OUTD/after_f16.json" 2> "$OUTD/after_f16.err" \
  || tail -5 "$OUTD/after_f16.err"
timeout 60 "$PY" -m tests.tools.bench_cuda --json --kv-type f32 > "$OUTD/after_f32.json" 2> "$OUTD/after_f32.err" \
  || tail -5 "$OUTD/after_f32.err"
if [ -d .before ]; then
  mkdir -p /tmp/aotx-before && ln -sfn "$ROOT/.before" /tmp/aotx-before/aotx
  (cd .before && PYTHONPATH=/tmp/aotx-before:$ROOT/.before${SITE:+:$SITE} timeout 80 "$PY" -m aotx.engine.backend.bench_cuda \
     --json > "$OUTD/before.json" 2> "$OUTD/before.err") || tail -5 "$OUTD/before.err"
fi

echo "== 3. summary"
"$PY" - "$OUTD" "$T_RC" <<'PYEOF'
import json, pathlib, re, sys
d, rc = pathlib.Path(sys.argv[1]), int(sys.argv[2])
log = (d / "pytest.log").read_text() if (d / "pytest.log").exists() else ""
tail = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
print(f"tests: {'PASS' if rc == 0 else 'FAIL'} ({tail[-1].strip('= ') if tail else 'rc %d' % rc})")
runs = {}
for name in ("before", "after_f32", "after_f16"):
    p = d / f"{name}.json"
    try:
        runs[name] = json.loads(p.read_text().strip().splitlines()[-1])
    except Exception:
        pass
if not runs:
    print("no benchmark ran"); sys.exit(0)
rows = [("prefill 128 tok/s", lambda r: r["prefill_tok_s"]["128"]), ("prefill 512", lambda r: r["prefill_tok_s"]["512"]),
        ("prefill 2048", lambda r: r["prefill_tok_s"]["2048"]), ("decode b1 tok/s", lambda r: r["decode_b1_tok_s"]),
        ("aggregate 4", lambda r: r["aggregate_tok_s"]["4"]), ("aggregate 16", lambda r: r["aggregate_tok_s"]["16"]),
        ("aggregate 64", lambda r: r["aggregate_tok_s"]["64"]), ("tick ms, 1 slot", lambda r: r["tick_device_ms"]["1"]),
        ("tick ms, 64 slots", lambda r: r["tick_device_ms"]["64"])]
names = list(runs)
first = next(iter(runs.values()))
print(f"model {first.get('model')} ({first.get('model_kind')}), {first.get('device')}")
print(f"{'':20}" + "".join(f"{n:>12}" for n in names) + ("   after_f16/before" if "before" in runs and "after_f16" in runs else ""))
for label, get in rows:
    vals = []
    for n in names:
        try:
            vals.append(float(get(runs[n])))
        except Exception:
            vals.append(float("nan"))
    ratio = ""
    if "before" in runs and "after_f16" in runs:
        b, a = vals[names.index("before")], vals[names.index("after_f16")]
        ratio = f"   {a / b:8.2f}" if b == b and b else ""
    print(f"{label:20}" + "".join(f"{v:12.1f}" if v >= 10 else f"{v:12.3f}" for v in vals) + ratio)
PYEOF
exit $T_RC
