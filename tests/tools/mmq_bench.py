"""The int8 GEMV against the MMQ on one GPU (what tests/tools/mmq_bench.sh runs).

``python -m tests.tools.mmq_bench micro --out DIR``: the decode GEMV (int8 activations, the
variant the kernel choice runs by default at that row count) and the MMQ (kernels/mmq.cu, the
tile shape ``mmq.py`` picks) at Llama-3.1-8B's shapes (k 4096 -> n 4096 / 1024 / 14336, k 14336
-> n 4096) in Q4_K and Q6_K, over 1, 16, 64 and 128 batch rows: device time per launch
(CUDA events around a captured graph of launches over copies of the weight that together pass
256 MB, so the weights come from memory, not L2), GB/s of the weight bytes one launch
needs, and whether the two gave the same bits (they must). ``quant_rows`` is not in the
timing (both read its output).

``python -m tests.tools.mmq_bench engine --out DIR --work DIR``: a random-weight file of the
8B shape (``tests/models/shapes.py``), loaded with int8 activations (the kernel choice off:
default variants), 64 slots prefilled with 128 tokens; then per batch of 16 and 64 slots, 32
greedy decode ticks through the captured graph with the MMQ (``mmq_min_rows`` 16) and with
it off, from the same positions and tokens: tokens/s with the host loop, device time of one
tick's graph, and whether the last tick's logits are the same bits (they must); and prefill
512 with ``prefill="gemv"`` (the batch-invariant eager path, its GEMVs as the MMQ) against the
default tensor-core GEMMs.

``python -m tests.tools.mmq_bench table --out DIR``: the short table of both (last thing the
shell script prints). Every step writes ``DIR/<step>.json``. ``--fake``: on fake CuPy
(tests/tools/gpu_fake_cupy.py) at small shapes, to rehearse the script without a GPU
(numbers meaningless). A device-machine tool, never run by CI.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SITES = (("o/q (4096x4096)", 4096, 4096), ("k/v (1024x4096)", 1024, 4096), ("gate|up (14336x4096)", 14336, 4096),
         ("down (4096x14336)", 4096, 14336))
FAKE_SITES = (("o/q", 256, 512), ("down", 256, 1024))
ROWS = (1, 16, 64, 128)
POOL = 256 << 20


def _median_ms(cp, fn, reps: int = 5) -> float:
    ts = []
    for _ in range(reps):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return statistics.median(ts)


def cmd_micro(args) -> int:
    import cupy as cp
    from gguf import GGMLQuantizationType as T

    from aotx.engine.backend.cuda import choice as CC
    from aotx.engine.backend.cuda import mmq as MQ
    from aotx.engine.backend.cuda import source as S
    from aotx.engine.backend.cuda.backend import CudaBackend, _u64
    from aotx.engine.backend.cuda.matrix import q8_buffers
    from tests.conftest_quant_helpers import random_blocks

    out = Path(args.out)
    deadline = time.monotonic() + args.deadline          # no site starts after this
    be = CudaBackend()
    rng = np.random.default_rng(0)
    sites = FAKE_SITES if args.fake else SITES
    pool = (4 << 20) if args.fake else POOL
    plan = []
    names = {"quant_rows"}
    for label, n, k in sites:
        for qt in (T.Q4_K, T.Q6_K):
            t = int(qt)
            site = MQ.make_site(t, t, k, (n + 1) // 2, be.n_sm, MQ.smem_limit(be))
            for M in ROWS:
                v = CC.GemvVariant.parse(CC.gemv_default(M, False, n, k, True))
                names.add(CC.gemv_instance(t, t, S.MODE_STORE, v, True))
                names.add(site.name(S.MODE_STORE, MQ.wm_for(M)))
            plan.append((label, qt, n, k, site))
    t0 = time.perf_counter()
    kern = be.module(sorted(names))
    for nm, kk in kern.items():
        if nm.startswith("mmq"):
            kk.max_dynamic_shared_size_bytes = MQ.smem_limit(be)
    res = {"compile_s": round(time.perf_counter() - t0, 1), "device": be.device_name, "rows": []}
    print(f"{len(names)} kernels compiled (or from CuPy's cache) in {res['compile_s']} s on {be.device_name}",
          flush=True)
    from tests.tools.gpu_bench import copy_bandwidth

    res["copy_GBs"] = round(copy_bandwidth(cp) / 1e9, 1) if not args.fake else 0.0
    x = cp.asarray(rng.standard_normal((max(ROWS), max(k for _, _, k in sites))).astype(np.float32))
    for label, qt, n, k, site in plan:
        if time.monotonic() > deadline:
            print(f"deadline: {label} {qt.name} skipped", flush=True)
            continue
        t = int(qt)
        raw = random_blocks(qt, n, k, rng)
        w = be.matrix(SimpleNamespace(name="w", qtype=qt, shape=(k, n), data=raw))
        per = int(n * w.row_bytes)
        copies = 2 if args.fake else max(2, -(-pool // per))
        stack = cp.empty((copies,) + tuple(w.data.shape), cp.uint8)
        for c in range(copies):
            stack[c] = w.data
        xq, xd = q8_buffers(max(ROWS), k)
        ldq = int(xq.shape[1])
        kern["quant_rows"]((max(ROWS), (k + 127) // 128), (128,),
                           (_u64(x), np.int32(x.shape[1]), np.int32(k), _u64(None), np.float32(1e-5), _u64(None),
                            _u64(xq), np.int32(ldq), _u64(xd), np.int32(ldq // 32)))
        n_pairs = (n + 1) // 2
        for M in ROWS:
            v = CC.GemvVariant.parse(CC.gemv_default(M, False, n, k, True))
            ys = {"gemv": cp.zeros((M, n + 1), cp.float32), "mmq": cp.zeros((M, n + 1), cp.float32)}

            def launch(kind, c, M=M, v=v):
                wp = stack[c].data.ptr
                y = ys[kind]
                a = (np.uint64(wp), np.uint64(wp), np.int64(w.row_bytes), np.int64(w.row_bytes), np.int32(2),
                     np.int32(1), np.int32(n_pairs), np.int32(k), _u64(xq), np.int32(ldq), np.int32(M), _u64(None),
                     np.float32(1e-5), _u64(None), _u64(None), _u64(None), _u64(y), np.int32(n + 1)) \
                    + (np.int32(0),) * 8 + (_u64(None),) * 6 + (_u64(xd), np.int32(ldq // 32))
                if kind == "mmq":
                    site.launch(kern, S.MODE_STORE, M, a)
                else:
                    ppb = v.pairs_per_block
                    kern[CC.gemv_instance(t, t, S.MODE_STORE, v, True)](
                        ((n_pairs + ppb - 1) // ppb, (M + v.nb - 1) // v.nb), (128,), a)

            row = {"site": label, "type": qt.name, "n": n, "k": k, "rows": M, "copies": copies,
                   "weight_bytes": per, "gemv_variant": v.name,
                   "mmq_tile": f"wn{site.wn}wm{MQ.wm_for(M)}s{site.split(MQ.wm_for(M))}"}
            for kind in ("gemv", "mmq"):
                s = cp.cuda.Stream(non_blocking=True)
                with s:
                    launch(kind, 0)
                    s.synchronize()
                    s.begin_capture()
                    for c in range(copies):
                        launch(kind, c)
                    g = s.end_capture()
                    g.upload(s)
                    g.launch(s)
                    s.synchronize()
                    ms = _median_ms(cp, lambda: g.launch(s), 1 if args.fake else 5) / copies
                row[f"{kind}_us"] = round(ms * 1e3, 2)
                row[f"{kind}_GBs"] = round(per / (ms * 1e-3) / 1e9, 1)
            row["speedup"] = round(row["gemv_us"] / row["mmq_us"], 2)
            for kind in ("gemv", "mmq"):
                ys[kind].fill(np.nan)
                launch(kind, 0)
            cp.cuda.Device().synchronize()
            a, b = ys["gemv"].get()[:, :n], ys["mmq"].get()[:, :n]
            row["bits_equal"] = bool(np.isfinite(a).all() and a.tobytes() == b.tobytes())
            res["rows"].append(row)
            print(f"{label:22} {qt.name:5} M {M:3}: GEMV {row['gemv_us']:9.1f} us {row['gemv_GBs']:8.1f} GB/s "
                  f"({v.name})  MMQ {row['mmq_us']:9.1f} us {row['mmq_GBs']:8.1f} GB/s ({row['mmq_tile']})  "
                  f"x{row['speedup']:.2f}  bits {'same' if row['bits_equal'] else 'DIFFERENT'}", flush=True)
        del stack, w
        (out / "micro.json").write_text(json.dumps(res, indent=1))       # what is done so far, if cut
    (out / "micro.json").write_text(json.dumps(res, indent=1))
    return 0 if all(r["bits_equal"] for r in res["rows"]) else 1


def _replay_ms(cp, graph, stream, n: int = 20) -> float:
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(stream)
    for _ in range(n):
        graph.launch(stream)
    e1.record(stream)
    e1.synchronize()
    return cp.cuda.get_elapsed_time(e0, e1) / n


def cmd_engine(args) -> int:
    import cupy as cp

    from aotx.engine.backend.cuda.backend import CudaBackend
    from aotx.engine.model.architectures import build
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile
    from tests.models import shapes

    out, work = Path(args.out), Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.deadline          # no measurement starts after this
    name = "smollm2-135m" if args.fake else "llama-3.1-8b"
    res: dict = {"shape": name}
    t0 = time.perf_counter()
    path = work / f"{name}.gguf"
    if not path.exists():
        shapes.write_shape(path, name, [], seed=1)
    res["write_s"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, str(path))
    be = CudaBackend(int8_activations=True, int8_min_bytes=0, mmq_min_rows=16)
    model = build(cfg, gf, be)
    prog = model.compiled
    cp.cuda.Device().synchronize()
    res["load_s"] = round(time.perf_counter() - t0, 1)
    res["mmq_sites"] = sum(g.mmq is not None for g in prog.gemvs)
    res["gemv_sites"] = len(prog.gemvs)
    res["no_mmq"] = sorted({f"{g.site}: {g.mmq_why}" for g in prog.gemvs if g.mmq is None})
    print(f"{name}: written in {res['write_s']} s, loaded in {res['load_s']} s, {res['mmq_sites']} of "
          f"{res['gemv_sites']} GEMVs with an MMQ form", flush=True)
    (out / "engine.json").write_text(json.dumps(res, indent=1))
    rng = np.random.default_rng(0)
    V = cfg.vocab_size
    slots, plen, steps = (8, 16, 4) if args.fake else (64, 128, 32)
    kv = model.new_kv_cache(slots, plen + 2 * (steps + 4) + 8)
    chunk = min(16, slots)
    for s0 in range(0, slots, chunk):
        model.forward(rng.integers(0, V, plen * chunk).astype(np.int32),
                      [Segment(s, 0, plen) for s in range(s0, s0 + chunk)], kv)
    cp.cuda.Device().synchronize()
    res["aggregate"] = {}
    for B in ((4, 8) if args.fake else (16, 64)):
        cur0 = rng.integers(0, V, B).astype(np.int32)
        row: dict = {}
        last = {}
        for mode in ("mmq", "gemv"):
            if time.monotonic() > deadline:
                row[f"{mode}_skipped"] = "deadline"
                continue
            prog.mmq_min_rows = 16 if mode == "mmq" and not args.fake else (2 if mode == "mmq" else None)
            prog.drop_graphs()
            cur = cur0
            pos = plen
            for _ in range(3):                     # capture and warm up
                cur = model.greedy(cur, [Segment(s, pos, 1) for s in range(B)], kv)
                pos += 1
            cp.cuda.Device().synchronize()
            t = time.perf_counter()
            for _ in range(steps):
                cur = model.greedy(cur, [Segment(s, pos, 1) for s in range(B)], kv)
                pos += 1
            dt = time.perf_counter() - t
            last[mode] = model.last_logits().get().copy()
            row[f"{mode}_tok_s"] = round(B * steps / dt, 1)
            row[f"{mode}_tick_device_ms"] = round(_replay_ms(cp, prog._state(kv).graphs[(B, B)], kv.stream), 3)
        if len(last) == 2:
            row["bits_equal"] = bool(last["mmq"].tobytes() == last["gemv"].tobytes())
        res["aggregate"][str(B)] = row
        (out / "engine.json").write_text(json.dumps(res, indent=1))      # what is done so far, if cut
        print(f"aggregate {B}: {row}", flush=True)
    prog.mmq_min_rows = 16
    prog.drop_graphs()
    # prefill 512: the default tensor-core GEMMs, and prefill="gemv" (batch-invariant: the MMQ)
    n = 64 if args.fake else 512
    res["prefill"] = {}
    if time.monotonic() < deadline:
        kvp = model.new_kv_cache(1, n + 8)
        toks = rng.integers(0, V, n).astype(np.int32)
        for label, forced in (("tensor-core GEMMs", None), ("prefill=gemv (MMQ)", "gemv")):
            prog._forced_prefill = forced
            ts = []
            for _ in range(3):
                cp.cuda.Device().synchronize()
                t = time.perf_counter()
                model.forward(toks, [Segment(0, 0, n)], kvp)
                cp.cuda.Device().synchronize()
                ts.append(time.perf_counter() - t)
            res["prefill"][label] = round(n / min(ts[1:]), 1)
        res["prefill_rows"] = n
        prog._forced_prefill = None
        print(f"prefill {n}: {res['prefill']}", flush=True)
    (out / "engine.json").write_text(json.dumps(res, indent=1))
    ok = all(r.get("bits_equal", True) for r in res["aggregate"].values())
    return 0 if ok else 1


def cmd_table(args) -> int:
    out = Path(args.out)
    lines = []
    mp = out / "micro.json"
    if mp.exists():
        m = json.loads(mp.read_text())
        lines.append(f"== device us per launch, GEMV / MMQ (speed-up; MMQ GB/s of weight bytes) on {m.get('device')}, "
                     f"copy {m.get('copy_GBs')} GB/s")
        by: dict = {}
        for r in m["rows"]:
            by.setdefault((r["site"], r["type"]), {})[r["rows"]] = r
        lines.append(f"{'site':22} {'type':5} " + " ".join(f"{'M=' + str(M):>24}" for M in ROWS))
        for (site, t), rs in by.items():
            cells = []
            for M in ROWS:
                r = rs.get(M)
                cells.append(f"{r['gemv_us']:.0f}/{r['mmq_us']:.0f} ({r['speedup']:.2f}x {r['mmq_GBs']:.0f})"
                             if r else "-")
            lines.append(f"{site:22} {t:5} " + " ".join(f"{c:>24}" for c in cells))
        same = sum(r["bits_equal"] for r in m["rows"])
        lines.append(f"bits: the MMQ equals the GEMV in {same} of {len(m['rows'])} launches")
    else:
        lines.append("== no micro bench results")
    ep = out / "engine.json"
    if ep.exists():
        e = json.loads(ep.read_text())
        lines.append(f"== {e['shape']} through the engine (int8 activations, default GEMV variants; "
                     f"{e.get('mmq_sites')} of {e.get('gemv_sites')} GEMVs with an MMQ form)")
        for B, r in e.get("aggregate", {}).items():
            lines.append(f"aggregate {B:>3}: MMQ {r.get('mmq_tok_s', '-')} tok/s ({r.get('mmq_tick_device_ms', '-')} "
                         f"ms/tick)  GEMV {r.get('gemv_tok_s', '-')} tok/s ({r.get('gemv_tick_device_ms', '-')} "
                         f"ms/tick)  logits bits {'same' if r.get('bits_equal') else r.get('bits_equal', '-')}")
        for label, v in e.get("prefill", {}).items():
            lines.append(f"prefill {e.get('prefill_rows', 512)}, {label}: {v} tok/s")
    else:
        lines.append("== no engine results")
    text = "\n".join(lines)
    print(text)
    (out / "table.txt").write_text(text + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cmd", choices=("micro", "engine", "table"))
    ap.add_argument("--out", default="/tmp/mmq_bench")
    ap.add_argument("--work", default="/tmp/mmq_bench_work")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds this step may start new measurements")
    ap.add_argument("--fake", action="store_true", help="fake CuPy, small shapes (a rehearsal)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.fake:
        from tests.tools import gpu_fake_cupy

        gpu_fake_cupy.install()
        gpu_fake_cupy.emulate = args.cmd == "micro"     # quant_rows, the GEMV and the MMQ computed (bits compared)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    return {"micro": cmd_micro, "engine": cmd_engine, "table": cmd_table}[args.cmd](args)


if __name__ == "__main__":
    raise SystemExit(main())
