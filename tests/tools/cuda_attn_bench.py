"""Long-prefill attention on the GPU: ``python -m tests.tools.cuda_attn_bench``.

Times one layer's attention of one prompt segment through ``attention.AttendStep.eager``
(the code the eager path runs, on stand-in context objects: a float16 KV cache of one
layer, the segment's query rows, the output rows) with the flash-style kernel
(``attn_prefill``) and with the cuBLAS path it replaces (``FLASH_ATTENTION = False``:
float32 copies of K and V, the (KV, G n, T) score matrix, ``causal_softmax``, a second
matmul). Shapes: Llama-3.1-8B (32 heads, 8 KV heads, head dim 128) and Qwen2.5-0.5B (14
heads, 2 KV heads, head dim 64), segments of 512, 2048 and 8192 tokens starting at
position 0. Device time by CUDA events around the call, median of ``--runs`` after a
warm-up; the relative difference of the two outputs is printed as a sanity check. The
table comes last. About 15-30 s on an H100/H200 (the cuBLAS path at 8192 tokens on the 8B
shape allocates a 8.6 GB score matrix).
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

import cupy as cp
import numpy as np

SHAPES = {"llama-3.1-8b": (32, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}


def _time(fn, runs: int) -> float:
    """Median device ms of ``fn()`` on the current stream (one warm-up call first)."""
    fn()
    st = cp.cuda.get_current_stream()
    ts = []
    for _ in range(runs):
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record(st)
        fn()
        e1.record(st)
        e1.synchronize()
        ts.append(cp.cuda.get_elapsed_time(e0, e1))
    return statistics.median(ts)


def bench(kernels: dict, H: int, KV: int, hd: int, n: int, runs: int) -> dict:
    from aotx.engine.backend.cuda import attention as CA

    rng = np.random.default_rng(0)
    n_ctx = n
    kc = cp.asarray(rng.standard_normal((1, 1, KV, n_ctx, hd), np.float32).astype(np.float16))
    vc = cp.asarray(rng.standard_normal((1, 1, KV, n_ctx, hd), np.float32).astype(np.float16))
    kv = SimpleNamespace(k=kc, v=vc, kvt=1, n_ctx=n_ctx, layer_ptrs=lambda L: (kc.data.ptr, vc.data.ptr))
    bufs = [cp.asarray(rng.standard_normal((n, H * hd), np.float32)), cp.zeros((n, H * hd), cp.float32)]
    c = SimpleNamespace(kv=kv, ptr=lambda v: bufs[v].data.ptr, ld=lambda v: int(bufs[v].shape[1]),
                        arr=lambda v: bufs[v],
                        layout_info=SimpleNamespace(all_short=False, short_rows=None, long_segs=[(0, 0, 0, n)]))
    att = CA.AttendStep.__new__(CA.AttendStep)
    att.s = SimpleNamespace(layer=0, q=0, out=1, n_heads=H, n_kv=KV, hd=hd, scale=float(1 / np.sqrt(hd)), window=0)
    att.sinks = None
    att.flash = {kvt: f"attn_prefill<{hd},{kvt}>" for kvt in (0, 1)}
    prog = SimpleNamespace(k=kernels)
    res = {}
    outs = {}
    flash = CA.FLASH_ATTENTION
    try:
        for name, on in (("flash", True), ("cublas", False)):
            CA.FLASH_ATTENTION = on
            res[name] = _time(lambda: att.eager(prog, c), runs)
            outs[name] = bufs[1].copy()
            cp.get_default_memory_pool().free_all_blocks()
    finally:
        CA.FLASH_ATTENTION = flash
    d = float(cp.linalg.norm(outs["flash"] - outs["cublas"]) / cp.linalg.norm(outs["cublas"]))
    res["rel_diff"] = d
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lengths", default="512,2048,8192")
    a = ap.parse_args()
    from aotx.engine.backend.cuda.backend import CudaBackend

    be = CudaBackend()
    names = ["causal_softmax"] + [f"attn_prefill<{hd},{kvt}>" for hd in (64, 128) for kvt in (0, 1)]
    kernels = be.module(names)
    print(f"device: {be.device_name}, compute capability {be.device.compute_capability}")
    rows = []
    for model, (H, KV, hd) in SHAPES.items():
        for n in (int(x) for x in a.lengths.split(",")):
            r = bench(kernels, H, KV, hd, n, a.runs)
            print(f"{model} n={n}: flash {r['flash']:.3f} ms, cuBLAS {r['cublas']:.3f} ms, "
                  f"||flash - cuBLAS|| / ||cuBLAS|| = {r['rel_diff']:.2e}", flush=True)
            rows.append((model, H, KV, hd, n, r))
    print()
    print(f"{'shape':<14} {'heads':>9} {'hd':>4} {'tokens':>6} {'flash ms':>9} {'cuBLAS ms':>10} {'speedup':>8} "
          f"{'rel diff':>9}")
    for model, H, KV, hd, n, r in rows:
        print(f"{model:<14} {f'{H}/{KV}':>9} {hd:>4} {n:>6} {r['flash']:>9.3f} {r['cublas']:>10.3f} "
              f"{r['cublas'] / r['flash']:>7.2f}x {r['rel_diff']:>9.2e}")


if __name__ == "__main__":
    main()
