"""Where the host time of one batch-1 CUDA decode step goes: ``python -m tests.tools.cuda_host_profile``.

Issue 14 measured batch-1 decode on the default shape at 0.91x the pre-port tree with the
same device time per replay, i.e. the loss is host time per token. This script builds the
default shape (random weights unless ``--model``) through the tree on ``sys.path`` (it
takes that tree's ``bench_cuda._build`` and ``_model_path``, so it runs the pre-port tree's
``aotx.engine.backend.bench_cuda`` as well as ``tests.tools.bench_cuda``), then:

* tokens/s of 512 greedy steps, host loop included (median of 3 runs of 512);
* the device time of one replay (CUDA events around 50 back-to-back replays);
* "gap": wall per token minus device per replay, the host time the GPU waits for;
* the host time of each phase of one step without the wait (the same step with the
  stream's ``synchronize`` timed apart);
* a cProfile of 256 steps, top functions by own time.

Prints one JSON object on the last line (``--json``) after a readable table.
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
    ap.add_argument("--steps", type=int, default=512)
    a = ap.parse_args()
    bc = importlib.import_module(a.bench_module)
    from aotx.engine.model.batch import Segment

    tmp = Path(tempfile.mkdtemp())
    path, what = bc._model_path(a.model, tmp)
    model = bc._build(path)
    cfg = model.cfg
    try:
        kv = model.new_kv_cache(1, 4096, "f16")
    except TypeError:                       # the pre-port tree: float32 KV, no kv_type
        kv = model.new_kv_cache(1, 4096)
    rng = np.random.default_rng(0)
    model.forward(rng.integers(0, cfg.vocab_size, 128).astype(np.int32), [Segment(0, 0, 128)], kv)
    tok = np.array([1], np.int32)
    pos = 128
    for _ in range(16):
        tok = model.greedy(tok, [Segment(0, pos, 1)], kv)
        pos += 1
    runs = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(a.steps):
            tok = model.greedy(tok, [Segment(0, pos, 1)], kv)
            pos += 1
        runs.append(a.steps / (time.perf_counter() - t))
    tok_s = statistics.median(runs)

    # device time of one replay
    comp = getattr(model, "compiled", model)
    st = comp._state(kv) if hasattr(comp, "_state") else kv
    graphs = st.graphs
    g = graphs[(1, 1)]
    stream = kv.stream
    e0, e1 = cp.cuda.Event(), cp.cuda.Event()
    e0.record(stream)
    for _ in range(50):
        g.launch(stream)
    e1.record(stream)
    e1.synchronize()
    dev_ms = cp.cuda.get_elapsed_time(e0, e1) / 50

    # host time without the wait: patch the stream's synchronize to time it apart
    waits = []
    orig = cp.cuda.Stream.synchronize

    def timed_sync(self):
        t = time.perf_counter()
        orig(self)
        waits.append(time.perf_counter() - t)

    cp.cuda.Stream.synchronize = timed_sync
    try:
        t = time.perf_counter()
        for _ in range(256):
            tok = model.greedy(tok, [Segment(0, pos, 1)], kv)
            pos += 1
        wall = (time.perf_counter() - t) / 256
    finally:
        cp.cuda.Stream.synchronize = orig
    wait = sum(waits) / 256
    host = wall - wait

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(256):
        tok = model.greedy(tok, [Segment(0, pos, 1)], kv)
        pos += 1
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
    print(s.getvalue())
    res = {"model": what, "decode_b1_tok_s": round(tok_s, 1), "runs": [round(r, 1) for r in runs],
           "wall_us_per_token": round(1e6 / tok_s, 1), "device_us_per_replay": round(1e3 * dev_ms, 1),
           "gap_us": round(1e6 / tok_s - 1e3 * dev_ms, 1), "host_us_outside_wait": round(1e6 * host, 1),
           "wait_us": round(1e6 * wait, 1), "graph_nodes": _nodes(g)}
    print(json.dumps(res))


def _nodes(g) -> int | None:
    try:
        n = cp.cuda.runtime.graphGetNodes(g.graph) if hasattr(cp.cuda.runtime, "graphGetNodes") else None
        return len(n) if n is not None else None
    except Exception:  # noqa: BLE001 - informational only
        return None


if __name__ == "__main__":
    main()
