#!/usr/bin/env bash
# Check of the regression fixes of issue 14/19 (helper `gpu`, session 2) on ONE GPU call,
# about 200 s (each step has its own timeout; at most about 270 s):
#   1. the CUDA tests the change touches (-x): bit-identical rows across buckets, variants
#      and graph vs eager, dense and tiled prefill against float32 (test_cuda_invariance:
#      the new GEMV reduction must keep the bits), the llama and qwen2 logits against the
#      CPU float path, then the GEMV kernels against float64 (test_cuda_quants, the store
#      GEMV of Q3_K and MXFP4; NB 16 with WPP 1 over 17 rows is among the shapes);
#   2. tests/tools/bench_cuda.py on the default shape after the change (f16 KV) and, when
#      .before/ was carried, before the port (commit 64e403f), with device microseconds per
#      step at 1, 4 and 64 rows;
#   3. a short table: before, after, after/before.
# Run from the repository root (make .whl/ and .before/ first with
# tests/tools/cuda_check_prep.sh when the checkout lacks them):
#   PYTHONUNBUFFERED=1 bash tests/tools/gpu_check_fix.sh          (carry: .whl, .before)
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
PY=${PY:-python3}
OUTD=${OUT:-/tmp/gpu_check_fix}
mkdir -p "$OUTD"
T0=$SECONDS
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site .whl/*.whl \
    >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
  SITE=/tmp/aotx-site
fi
mkdir -p /tmp/aotx-after && ln -sfn "$ROOT" /tmp/aotx-after/aotx
export PYTHONPATH=/tmp/aotx-after:$ROOT${SITE:+:$SITE}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
"$PY" -c "import cupy, gguf, msgspec, platformdirs, google_crc32c; print('cupy', cupy.__version__)" || exit 1
XD=""
"$PY" -c "import xdist" 2>/dev/null && XD="-n 6"

echo "== 1. CUDA tests (xdist: ${XD:-none})"
timeout 110 "$PY" -m pytest -x -q --tb=short -rs -p no:cacheprovider $XD tests/test_cuda_invariance.py \
  "tests/test_cuda_program.py::test_logits_match_cpu_every_architecture[llama-f16]" \
  "tests/test_cuda_program.py::test_logits_match_cpu_every_architecture[qwen2-f16]" 2>&1 | tee "$OUTD/pytest.log" | tail -25
T_RC=${PIPESTATUS[0]}
if [ $T_RC -eq 0 ]; then     # the GEMV against float64 at NB 1/4/16 (WPP 4/1), batches 1/3/5/17 (partial blocks)
  timeout 75 "$PY" -m pytest -x -q --tb=short -p no:cacheprovider $XD tests/test_cuda_quants.py \
    -k "gemv_store and (Q3_K or MXFP4)" 2>&1 | tee -a "$OUTD/pytest.log" | tail -15
  T_RC=${PIPESTATUS[0]}
fi
echo "(tests: $((SECONDS - T0)) s)"

echo "== 2. benchmarks"
left=$((245 - (SECONDS - T0)))
if [ -d .before ]; then half=$((left / 2)); else half=$left; fi
[ $half -lt 60 ] && half=60; [ $half -gt 75 ] && half=75
timeout $half "$PY" -m tests.tools.bench_cuda --json > "$OUTD/after.json" 2> "$OUTD/after.err" \
  || { echo "after: rc $? (timeout ${half} s)"; tail -5 "$OUTD/after.err"; }
left=$((245 - (SECONDS - T0)))
[ $left -lt 55 ] && left=55          # the before run is what the table compares with: never skipped
if [ -d .before ]; then
  mkdir -p /tmp/aotx-before && ln -sfn "$ROOT/.before" /tmp/aotx-before/aotx
  (cd .before && PYTHONPATH=/tmp/aotx-before:$ROOT/.before${SITE:+:$SITE} timeout $left "$PY" -m aotx.engine.backend.bench_cuda \
     --json > "$OUTD/before.json" 2> "$OUTD/before.err") || { echo "before: failed or timed out"; tail -5 "$OUTD/before.err"; }
fi

echo "== 3. summary ($((SECONDS - T0)) s)"
"$PY" - "$OUTD" "$T_RC" <<'PYEOF'
import json, pathlib, re, sys
d, rc = pathlib.Path(sys.argv[1]), int(sys.argv[2])
log = (d / "pytest.log").read_text() if (d / "pytest.log").exists() else ""
tail = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
print(f"tests: {'PASS' if rc == 0 else 'FAIL'} ({tail[-1].strip('= ') if tail else 'rc %d' % rc})")
runs = {}
for name in ("before", "after"):
    try:
        runs[name] = json.loads((d / f"{name}.json").read_text().strip().splitlines()[-1])
    except Exception:
        pass
if not runs:
    print("no benchmark ran"); sys.exit(0)
g = lambda *ks: (lambda r: r[ks[0]][ks[1]] if len(ks) == 2 else r[ks[0]])
rows = [("prefill 128 tok/s", g("prefill_tok_s", "128")), ("prefill 512", g("prefill_tok_s", "512")),
        ("prefill 2048", g("prefill_tok_s", "2048")), ("decode b1 tok/s", g("decode_b1_tok_s")),
        ("aggregate 4", g("aggregate_tok_s", "4")), ("aggregate 16", g("aggregate_tok_s", "16")),
        ("aggregate 64", g("aggregate_tok_s", "64")), ("tick ms, 1 slot", g("tick_device_ms", "1")),
        ("tick ms, 4 slots", g("tick_device_ms", "4")), ("tick ms, 64 slots", g("tick_device_ms", "64"))]
names = list(runs)
first = next(iter(runs.values()))
print(f"model {first.get('model')} ({first.get('model_kind')}), {first.get('device')}")
both = "before" in runs and "after" in runs
print(f"{'':20}" + "".join(f"{n:>12}" for n in names) + ("   after/before" if both else ""))
for label, get in rows:
    vals = []
    for n in names:
        try:
            vals.append(float(get(runs[n])))
        except Exception:
            vals.append(float("nan"))
    ratio = ""
    if both:
        b, a = vals[names.index("before")], vals[names.index("after")]
        ratio = f"   {a / b:8.2f}" if b == b and b else ""
    print(f"{label:20}" + "".join(f"{v:12.1f}" if v >= 10 else f"{v:12.3f}" for v in vals) + ratio)
for n in names:
    for B, ks in runs[n].get("kernel_us", {}).items():
        print(f"{n} kernel us at {B} rows: " + ", ".join(f"{k} {v}" for k, v in ks.items()))
PYEOF
exit $T_RC
