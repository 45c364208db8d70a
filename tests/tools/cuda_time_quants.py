"""GEMV and dequantization throughput of every CUDA tensor type on this GPU: a one-off
measurement for the lead next to tests/test_cuda_quants.py (not a test; BENCHMARKS_CUDA.md
figures come from `aotx bench`).

For each type in cuda_src.TYPES: one 4096 x 4096 weight of random blocks (the values do not
matter for timing), ``gemv<T,T,NB,STORE,WPP>`` at batch 1 (NB 1, 4 warps per row pair, as
the decode graph's layer matrices) and batch 16 (NB 16, 1 warp), and ``dequant<T>`` (the
prefill path's float32 copy), each timed with CUDA events over 100 launches after a warm-up.
Prints GB/s of weight bytes read (dequant: bytes read + written) per type.

A device-machine script (run by hand on the GPU machine, never by CI), from the
repository root: ``python -m tests.tools.cuda_time_quants``.
"""

from __future__ import annotations

from types import SimpleNamespace

import cupy as cp
import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cuda import source as S
from aotx.engine.backend.cuda.backend import CudaBackend, _u64

M = K = 4096
REPS = 100


def weight(qtype: T, rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        return rng.standard_normal((M, K), np.float32)
    if qtype in (T.F16, T.BF16):
        return rng.integers(0, 1 << 14, (M, K), dtype=np.uint16).view(np.uint8).reshape(M, 2 * K)
    be, bb = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, (M, K // be * bb), dtype=np.uint8)


def timed(fn) -> float:
    """Seconds per call of fn (CUDA events, REPS calls after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record()
    for _ in range(REPS):
        fn()
    b.record()
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / 1e3 / REPS


def main() -> None:
    be = CudaBackend()
    types = [T(c) for c in S.TYPES]
    shapes = ((1, 1, 4), (16, 16, 1))
    names = [f"dequant<{int(t)}>" for t in types]
    names += [f"gemv<{int(t)},{int(t)},{nb},{S.MODE_STORE},{wpp}>" for t in types for _, nb, wpp in shapes]
    kern = be.module(names)
    rng = np.random.default_rng(0)
    print(f"{be.device_name}: weight {M} x {K}, GB/s of weight bytes")
    print(f"{'type':8} {'bytes/w':>8} {'gemv B=1':>10} {'gemv B=16':>10} {'dequant':>10}")
    for t in types:
        raw = weight(t, rng)
        w = be.matrix(SimpleNamespace(name=t.name, qtype=t, shape=(K, M), data=raw))
        row = []
        for B, nb, wpp in shapes:
            x = cp.asarray(rng.standard_normal((B, K), np.float32))
            y = cp.empty((B, M), cp.float32)
            ppb = 4 // wpp
            z = np.int32(0)
            args = ((_u64(w.data), _u64(w.data), np.int64(w.row_bytes), np.int64(w.row_bytes), np.int32(2),
                     np.int32(1), np.int32(M // 2), np.int32(K), _u64(x), np.int32(K), np.int32(B), _u64(None),
                     np.float32(1e-5), _u64(None), _u64(None), _u64(None), _u64(y), np.int32(M)) + (z,) * 8
                    + (_u64(None),) * 6 + (_u64(None), z))
            k = kern[f"gemv<{int(t)},{int(t)},{nb},{S.MODE_STORE},{wpp}>"]
            grid = ((M // 2 + ppb - 1) // ppb, (B + nb - 1) // nb)
            row.append(w.nbytes / timed(lambda: k(grid, (128,), args)) / 1e9)
        dq = kern[f"dequant<{int(t)}>"]
        out = cp.empty((M, K), cp.float32)
        n = M * (K // 8)
        dargs = (_u64(w.data), np.int64(w.row_bytes), np.int32(M), np.int32(K), _u64(out))
        row.append((w.nbytes + out.nbytes) / timed(lambda: dq(((n + 255) // 256,), (256,), dargs)) / 1e9)
        print(f"{t.name:8} {w.nbytes / (M * K):8.4f} {row[0]:10.0f} {row[1]:10.0f} {row[2]:10.0f}")
        del w, out


if __name__ == "__main__":
    main()
