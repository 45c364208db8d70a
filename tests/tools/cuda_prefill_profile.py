"""Host time of one eager CUDA prefill: ``python -m tests.tools.cuda_prefill_profile``.

The default shape (random weights unless ``--model``) built through the tree on
``sys.path`` (its bench module's ``_build``/``_model_path``, as cuda_host_profile.py):
wall time of prefills of 128/512/2048 tokens (10 runs each after a warm-up: min, median),
then a cProfile of 3 prefills of ``--n`` tokens, the top functions by own time (kernel
launches, cuBLAS calls and CuPy array operations show up by name), and the device time of
one such prefill (CUDA events) to compare with its wall time.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import cupy as cp
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bench-module", default="tests.tools.bench_cuda")
    ap.add_argument("--model")
    ap.add_argument("--n", type=int, default=512)
    a = ap.parse_args()
    bc = importlib.import_module(a.bench_module)
    from aotx.engine.model.batch import Segment

    path, what = bc._model_path(a.model, Path(tempfile.mkdtemp()))
    model = bc._build(path)
    try:
        kv = model.new_kv_cache(1, 4096, "f16")
    except TypeError:                       # the pre-port tree: float32 KV only
        kv = model.new_kv_cache(1, 4096)
    rng = np.random.default_rng(0)
    res = {"model": what}
    for n in (128, 512, 2048):
        toks = rng.integers(0, model.cfg.vocab_size, n).astype(np.int32)
        model.forward(toks, [Segment(0, 0, n)], kv)
        ts = []
        for _ in range(10):
            t = time.perf_counter()
            model.forward(toks, [Segment(0, 0, n)], kv)
            ts.append(time.perf_counter() - t)
        res[f"prefill_{n}_ms"] = {"min": round(1e3 * min(ts), 2), "median": round(1e3 * statistics.median(ts), 2)}
    toks = rng.integers(0, model.cfg.vocab_size, a.n).astype(np.int32)
    st = cp.cuda.get_current_stream()
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    cp.cuda.Device().synchronize()
    e0.record(st)
    t = time.perf_counter()
    model.forward(toks, [Segment(0, 0, a.n)], kv)
    wall = time.perf_counter() - t
    e1.record(st)
    e1.synchronize()
    res[f"prefill_{a.n}_wall_ms"] = round(1e3 * wall, 2)
    res[f"prefill_{a.n}_events_ms (current stream)"] = round(cp.cuda.get_elapsed_time(e0, e1), 2)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        model.forward(toks, [Segment(0, 0, a.n)], kv)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    print(json.dumps(res))


if __name__ == "__main__":
    main()
