"""Host overhead of the GPU expert tier per layer call (issue 22, "GPU tier host overhead"):
``python -m tests.tools.moe_gpu_overhead [--reps N] [--fake]``.

On the tiny qwen3moe file (d_model 64, 8 experts of ff 256, top 2, a toy vocabulary), every
expert of every layer on the GPU tier: for batches of 1, 4 and 16 rows routed by layer 1's
router, one GPU-tier call (``launch`` + ``wait``: what ``cpu_moe.moe_rows`` pays per layer
for the GPU's pairs; device time is a few microseconds at this size, so this is host
time) with the per-expert launches ("before": ``grouped = False``, the code this replaces)
and the grouped ones ("after"), median and best of N calls, and ``launch`` alone (the host's
enqueue cost); the two outputs compared bit for bit; the CPU tier's time for the same pairs
(``ExpertPool.compute``) beside them; then a decode forward (1 row, 4 layers) per token both
ways. Prints a table last. ``--fake``: against tests/tools/gpu_fake_cupy (no GPU; checks that
the tool runs, the times mean nothing).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _times(fn, reps: int) -> tuple[float, float]:
    """(median, best) microseconds of fn() over reps calls, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts), 1e6 * min(ts)


def _call_times(gpu, pairs, x, reps: int) -> tuple:
    """((median, best) of launch + wait, (median, best) of launch alone), microseconds."""
    for _ in range(3):
        gpu.wait(gpu.launch(pairs, x))
    call, launch = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        h = gpu.launch(pairs, x)
        t1 = time.perf_counter()
        gpu.wait(h)
        t2 = time.perf_counter()
        call.append(t2 - t0)
        launch.append(t1 - t0)
    return tuple((1e6 * statistics.median(t), 1e6 * min(t)) for t in (call, launch))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--fake", action="store_true", help="run against fake CuPy (no GPU; times mean nothing)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    if args.fake:
        from tests.tools import gpu_fake_cupy as fake

        fake.install()
    import cupy as cp
    import numpy as np

    from aotx.engine.backend import cpu_moe
    from aotx.engine.backend.cuda import CudaBackend
    from aotx.engine.model import experts as X
    from aotx.engine.model.architectures import build
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from tests import models as tm
    from tests.tools.gpu_dryrun_moe import VOCAB, _toy_tokenizer

    tmp = Path(tempfile.mkdtemp(prefix="aotx-moe-overhead-"))
    path = tm.qwen3moe.write(tmp / "qwen3moe.gguf", _toy_tokenizer(tm))
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    t0 = time.perf_counter()
    model = build(cfg, gf, CudaBackend(prefill="f32", expert_int8=False))
    print(f"built {path.name} on CUDA in {time.perf_counter() - t0:.1f} s", flush=True)
    c = model.compiled
    c.place_experts(X.Plan(tuple(tuple(["gpu"] * L.n_expert) for L in X.moe_layers(model.program))))
    st = c.moe_steps[1]
    gpu, a = st.gpu, st.attrs
    rng = np.random.default_rng(0)
    rows = []
    for n in (1, 4, 16):
        x = cp.asarray(rng.standard_normal((n, cfg.d_model)).astype(np.float32))
        xh = x.get()
        logits = a["router"].matmul(xh, per_row=True)
        sel, _, _ = cpu_moe.route(logits, a["n_used"], a["gating"], a["norm_w"], a["w_scale"])
        pairs = cpu_moe.groups(sel)
        res, out = {}, {}
        for grouped in (False, True):
            gpu.grouped = grouped
            res[grouped] = _call_times(gpu, pairs, x, args.reps)
            out[grouped] = gpu.wait(gpu.launch(pairs, x)).copy()
        gpu.grouped = True
        same = bool(np.array_equal(out[False].view(np.int32), out[True].view(np.int32)))
        Y = np.empty((n, a["n_used"], cfg.d_model), np.float32)
        cpu = _times(lambda: st.pool.compute(a, xh, sel, Y, pairs, None, True), args.reps)
        rows.append((n, len(pairs), res[False], res[True], cpu, same))
    # a decode forward per token, 1 row, all experts on the GPU tier
    dec = {}
    for grouped in (False, True):
        for s in c.moe_steps:
            s.gpu.grouped = grouped
        kv = model.new_kv_cache(1, 512)
        toks = rng.integers(0, VOCAB, 8).astype(np.int32)
        model.forward(toks, [Segment(0, 0, 8)], kv)
        pos = [8]

        def step():
            model.forward(toks[:1], [Segment(0, pos[0], 1)], kv)
            pos[0] += 1

        dec[grouped] = _times(step, min(args.reps, 100))
    for s in c.moe_steps:
        s.gpu.grouped = True
    print()
    print("GPU expert tier, one layer call (tiny qwen3moe, all experts on the GPU), microseconds, median (best)")
    print(f"{'rows':>4} {'experts':>7} | {'before: call':>16} {'launch':>14} | {'after: call':>16} {'launch':>14} | "
          f"{'speedup':>7} | {'CPU tier':>14} | bits equal")
    for n, ne, before, after, cpu, same in rows:
        (bc, bl), (ac, al) = before, after
        print(f"{n:>4} {ne:>7} | {bc[0]:>8.1f} ({bc[1]:>5.1f}) {bl[0]:>6.1f} ({bl[1]:>5.1f}) | "
              f"{ac[0]:>8.1f} ({ac[1]:>5.1f}) {al[0]:>6.1f} ({al[1]:>5.1f}) | {bc[0] / ac[0]:>6.2f}x | "
              f"{cpu[0]:>6.1f} ({cpu[1]:>5.1f}) | {same}")
    print(f"decode forward, 1 row, {len(c.moe_steps)} moe layers: before {dec[False][0] / 1e3:.3f} ms/token "
          f"(best {dec[False][1] / 1e3:.3f}), after {dec[True][0] / 1e3:.3f} ms/token (best {dec[True][1] / 1e3:.3f})")
    ok = all(r[-1] for r in rows)
    print("overhead check:", "OK" if ok else "FAIL (grouped outputs differ from the per-expert launches)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
