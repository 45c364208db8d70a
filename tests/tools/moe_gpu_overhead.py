"""Host overhead of the GPU expert tier per layer call (issue 22, "GPU tier host overhead"):
``python -m tests.tools.moe_gpu_overhead [--reps N] [--fake]``.

On the tiny qwen3moe file (d_model 64, 8 experts of ff 256, top 2, a toy vocabulary), every
expert of every layer on the GPU tier: for batches of 1, 4 and 16 rows routed by layer 1's
router, one GPU-tier call (launch + wait: what ``cpu_moe.moe_rows`` pays per layer for
the GPU's pairs; device time is a few microseconds at this size, so this is host time)
with the per-expert launches ("before": ``grouped = False``, the code this replaces) and
the grouped ones (``launch_routed``, "after"), median and best of N calls, and the launch
alone (the host's enqueue cost); the two outputs compared bit for bit; the whole op per
layer call (``moe_rows``: router, routing, the tiers, the join) with the GPU tier both ways
and with every expert on the CPU tier; then a decode forward (1 row, 4 layers) per token
both ways. Prints a table last. ``--fake``: against tests/tools/gpu_fake_cupy (no GPU; checks that
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


def _call_times(launch, wait, reps: int) -> tuple:
    """((median, best) of launch + wait, (median, best) of launch alone), microseconds."""
    for _ in range(3):
        wait(launch())
    call, enqueue = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        h = launch()
        t1 = time.perf_counter()
        wait(h)
        t2 = time.perf_counter()
        call.append(t2 - t0)
        enqueue.append(t1 - t0)
    return tuple((1e6 * statistics.median(t), 1e6 * min(t)) for t in (call, enqueue))


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

    from aotx.engine.backend.cpu import experts as cpu_moe
    from aotx.engine.backend.cuda.backend import CudaBackend
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
        experts = np.repeat(np.array([e for e, _, _ in pairs], np.int64), [int(r.shape[0]) for _, r, _ in pairs])
        routed = np.concatenate([r for _, r, _ in pairs])
        gpu.grouped = False
        before = _call_times(lambda: gpu.launch(pairs, x), gpu.wait, args.reps)
        y_before = gpu.wait(gpu.launch(pairs, x)).copy()
        gpu.grouped = True
        after = _call_times(lambda: gpu.launch_routed(experts, routed, x), gpu.wait, args.reps)
        y_after = gpu.wait(gpu.launch_routed(experts, routed, x)).copy()
        same = bool(np.array_equal(y_before.view(np.int32), y_after.view(np.int32)))
        # the whole op per layer call (router, routing, the tiers, the join) as moe.MoeStep runs it
        gpu._x = x
        op = {}
        for grouped in (False, True):
            gpu.grouped = grouped
            op[grouped] = _times(lambda: cpu_moe.moe_rows(a, xh, st.pool, None, None, gpu, c.moe_worker), args.reps)
        gpu._x = None
        gpu.grouped = True
        op_cpu = _times(lambda: cpu_moe.moe_rows(a, xh, st.pool), args.reps)
        rows.append((n, len(pairs), before, after, op[False], op[True], op_cpu, same))
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
    print(f"{'rows':>4} {'experts':>7} | {'tier before':>15} {'(launch)':>8} | {'tier after':>15} {'(launch)':>8} | "
          f"{'speedup':>7} | {'op before':>9} {'op after':>9} {'op CPU':>9} | bits equal")
    for n, ne, before, after, ob, oa, oc, same in rows:
        print(f"{n:>4} {ne:>7} | {before[0][0]:>7.1f} ({before[0][1]:>5.1f}) {before[1][0]:>8.1f} | "
              f"{after[0][0]:>7.1f} ({after[0][1]:>5.1f}) {after[1][0]:>8.1f} | {before[0][0] / after[0][0]:>6.2f}x | "
              f"{ob[0]:>9.1f} {oa[0]:>9.1f} {oc[0]:>9.1f} | {same}")
    print("tier: the GPU tier's launch + wait (the per-expert gemv launches before, one moe_gemv per GEMV after);"
          " op: the whole moe op on the host rows (router, routing, tiers, join): GPU tier before / after, and"
          " every expert on the CPU tier")
    print(f"decode forward, 1 row, {len(c.moe_steps)} moe layers: before {dec[False][0] / 1e3:.3f} ms/token "
          f"(best {dec[False][1] / 1e3:.3f}), after {dec[True][0] / 1e3:.3f} ms/token (best {dec[True][1] / 1e3:.3f})")
    ok = all(r[-1] for r in rows)
    print("overhead check:", "OK" if ok else "FAIL (grouped outputs differ from the per-expert launches)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
