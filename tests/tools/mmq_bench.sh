#!/usr/bin/env bash
# The MMQ (kernels/mmq.cu) on one GPU in ONE device call of about 6 minutes (every step bounded):
#   0. the 8B-shape random-weight file written in the background (CPU and disk only);
#   1. tests/test_cuda_mmq.py (bits = the int8 GEMV's per type, row count, place and tile;
#      epilogues; a whole model with and without the MMQ), then tests/test_cuda_invariance.py
#      (batch invariance with the MMQ on by default) while time is left;
#   2. GEMV vs MMQ per launch at Llama-3.1-8B's shapes, Q4_K and Q6_K, 1/16/64/128 rows
#      (tests/tools/mmq_bench.py micro);
#   3. the engine's aggregate decode at 16 and 64 rows on the 8B-shape file, MMQ on and off, and
#      prefill 512 (tests/tools/mmq_bench.py engine);
#   4. one short table, last.
# Prepare here:   bash tests/tools/mmq_bench_prep.sh        (wheels into .whl/)
# Device (H100):  PYTHONUNBUFFERED=1 bash tests/tools/mmq_bench.sh      carry: [".whl"], timeout_s 420
# Knobs: MMQ_BENCH_DEADLINE (seconds for the whole script, default 360), MMQ_BENCH_TESTS (1/0),
# MMQ_BENCH_ENGINE (1/0), MMQ_BENCH_TEST_S (the MMQ tests' limit, 130), MMQ_BENCH_MICRO_S (75). Files under $OUT: table.txt, micro.json, engine.json, pytest.log,
# invariance.log, micro.log, engine.log, write.log.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
T0=$(date +%s)
DEADLINE=${MMQ_BENCH_DEADLINE:-360}
OUTD=${OUT:-/tmp/mmq_bench_out}
WORK=/tmp/mmq_bench_work
PY=${PY:-python3}
FAKE=${MMQ_BENCH_FAKE:-0}         # 1: a rehearsal on fake CuPy at small shapes (no GPU; numbers meaningless)
SHAPE=llama-3.1-8b; FAKE_ARG=""
[ "$FAKE" = 1 ] && { SHAPE=smollm2-135m; FAKE_ARG="--fake"; }
mkdir -p "$OUTD" "$WORK"
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( DEADLINE - $(el) )); }

if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aotx-site \
    .whl/*.whl >/dev/null 2>&1 || { echo "wheel install failed"; exit 1; }
fi
mkdir -p /tmp/aotx-mmq && ln -sfn "$ROOT" /tmp/aotx-mmq/aotx
export PYTHONPATH=/tmp/aotx-mmq:$ROOT:/tmp/aotx-site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv,noheader || true
[ "$FAKE" = 1 ] || "$PY" -c "import cupy, gguf, msgspec, platformdirs; print('cupy', cupy.__version__, 'CUDA runtime',
cupy.cuda.runtime.runtimeGetVersion(), 'cc', cupy.cuda.Device().compute_capability)" || exit 1

echo "== $(el)s 0. the $SHAPE-shape file (background)"
( "$PY" - "$WORK" "$SHAPE" > "$OUTD/write.log" 2>&1 <<'PYEOF'
import sys, time
from pathlib import Path
from tests.models import shapes
t = time.perf_counter()
p = Path(sys.argv[1]) / f"{sys.argv[2]}.gguf"
tmp = p.with_suffix(".part")
shapes.write_shape(tmp, sys.argv[2], [], seed=1)
tmp.rename(p)
print(f"written {p} ({p.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.1f} s")
PYEOF
) &
P_WRITE=$!

T_RC=0
if [ "${MMQ_BENCH_TESTS:-1}" = 1 ]; then
  echo "== $(el)s 1. tests/test_cuda_mmq.py"
  timeout -s KILL ${MMQ_BENCH_TEST_S:-130} "$PY" -m pytest -q --tb=short -rs -p no:cacheprovider \
    tests/test_cuda_mmq.py > "$OUTD/pytest.log" 2>&1
  T_RC=$?
  tail -15 "$OUTD/pytest.log"
  [ "$T_RC" -eq 137 ] && echo "(cut at its time limit: pytest.log shows how far it got)"
fi

echo "== $(el)s 2. GEMV vs MMQ per launch"
MICRO_S=${MMQ_BENCH_MICRO_S:-75}
timeout -s KILL "$MICRO_S" "$PY" -m tests.tools.mmq_bench micro $FAKE_ARG --out "$OUTD" --deadline $(( MICRO_S - 15 )) 2>&1 \
  | tee "$OUTD/micro.log" | tail -40
M_RC=${PIPESTATUS[0]}

E_RC=0
if [ "${MMQ_BENCH_ENGINE:-1}" = 1 ]; then
  echo "== $(el)s 3. the engine: aggregate decode, MMQ on and off ($(left) s left)"
  while [ ! -f "$WORK/$SHAPE.gguf" ] && kill -0 "$P_WRITE" 2>/dev/null && [ "$(left)" -gt 90 ]; do sleep 2; done
  tail -3 "$OUTD/write.log"
  if [ -f "$WORK/$SHAPE.gguf" ] && [ "$(left)" -gt 60 ]; then
    timeout -s KILL $(( $(left) - 15 )) "$PY" -m tests.tools.mmq_bench engine $FAKE_ARG --out "$OUTD" --work "$WORK" \
      --deadline $(( $(left) - 45 )) 2>&1 | tee "$OUTD/engine.log" | tail -12
    E_RC=${PIPESTATUS[0]}
  else
    echo "engine step skipped: $(left) s left or no file"
  fi
fi
kill "$P_WRITE" 2>/dev/null

if [ "${MMQ_BENCH_TESTS:-1}" = 1 ] && [ "$(left)" -gt 60 ]; then
  echo "== $(el)s 4. tests/test_cuda_invariance.py with the MMQ on by default ($(left) s left)"
  timeout -s KILL $(( $(left) - 10 )) "$PY" -m pytest -q --tb=line -rs -p no:cacheprovider \
    tests/test_cuda_invariance.py > "$OUTD/invariance.log" 2>&1
  tail -6 "$OUTD/invariance.log"
fi

echo "== $(el)s table"
"$PY" -m tests.tools.mmq_bench table --out "$OUTD"
echo "tests rc $T_RC, micro rc $M_RC (1: some bits differ), engine rc $E_RC; $(el) s"
exit $(( T_RC != 0 || M_RC != 0 || E_RC != 0 ))
