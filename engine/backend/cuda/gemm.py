"""The prefill GEMM of the CUDA backend's eager path: quantized weights, one tile at a time.

Owns: ``PrefillGemm``, which computes ``Y[:, :m] (+)= norm(X) @ W[r0:r0 + m].T`` for the
many-row batches the eager path runs (prefill chunks), in one of three modes
(``choice.PREFILL_MODES``): ``f16`` (float16 weights and activations, GemmEx,
float32 accumulation: tensor cores), ``tf32`` (float32 weights, GemmEx with TF32
tensor-core math), ``f32`` (float32 weights, SGEMM). Where the weights come from:
* **dense** (``plan_dense`` accepted the model: every prefill weight's dequantized copy,
  float16 for "f16" sites, float32 for the others, fits ``dense_budget``, at most
  ``DENSE_MAX_BYTES`` and ``DENSE_FREE_FRACTION`` of the device's free memory at load):
  each weight is dequantized once, on its first prefill, kept, and multiplied in one
  GEMM. Small models: no dequantize launch per op per prefill (the eager path of a
  135M-parameter model is bound by the host's launches).
* **tiles** (otherwise, e.g. 7B/8B models): the weight is dequantized tile by tile (at most
  ``TILE_BYTES``, about 4,000 rows of a 4096-wide matrix) into one reused scratch buffer
  every prefill; the scratch is the only weight memory the eager path adds.
``weight_bytes`` is what admission counts (``prefill_weight_bytes``). The activations are
converted (and RMS-normed) once per op (``prepare``) and reused by every GEMM of that op
(q, k, v; gate and up). Both sources hold the same dequantized values (the same kernels
write them); only cuBLAS's blocking of the rows differs.

Leaves which mode each weight uses to the kernel choice (``choice.py``, ``kernel_choice``)
and the order of ops to ``program.py``. Runs on CuPy's current stream (the eager path's).

Limits: float16 inputs saturate at +-65504 (the f16 mode is offered only for inputs that
are RMS-normed or attention outputs); TF32 and float16 round the inputs to 11 significant
bits, so prefill logits differ from the float32 path by about 1e-3 relative.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

TILE_BYTES = 32 << 20           # the dequantized weight tile (fits the H200's 60 MB L2 with room)
DENSE_MAX_BYTES = 4 << 30       # dense prefill copies: at most this much in all ...
DENSE_FREE_FRACTION = 0.25      # ... and at most this fraction of the free device memory at load
# cuBLAS enums (cudaDataType, cublasComputeType_t, cublasGemmAlgo_t): fixed by the CUDA ABI
R_32F, R_16F = 0, 2
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
GEMM_DEFAULT = -1
NT = 256


def _u64(a) -> np.uint64:
    if a is None:
        return np.uint64(0)
    if isinstance(a, (int, np.integer)):
        return np.uint64(a)
    return np.uint64(a.data.ptr)


class Prepared:
    """Activations ready for one mode's GEMMs: ``ptr``, ``ld`` (elements), ``arr`` (kept alive)."""

    __slots__ = ("mode", "ptr", "ld", "arr")

    def __init__(self, mode: str, ptr: int, ld: int, arr):
        self.mode, self.ptr, self.ld, self.arr = mode, ptr, ld, arr


class PrefillGemm:
    """See the module docstring. ``kernels``: name -> RawKernel holding ``rows_half``,
    ``rms_norm`` and ``dequant<T>`` / ``dequant_h<T>`` of every tensor type it is given."""

    def __init__(self, kernels: dict, blas_handle: int, tile_bytes: int = TILE_BYTES):
        self.k = kernels
        self.blas = blas_handle
        self.tile_bytes = int(tile_bytes)
        self._scratch: cp.ndarray | None = None
        self._one = np.ones(1, np.float32)
        self._zero = np.zeros(1, np.float32)
        self._dense_ok: set[tuple[int, int]] = set()      # (id(DevMatrix), element bytes) kept dense
        self._dense: dict[tuple[int, int], cp.ndarray] = {}
        self.dense_bytes = 0
        self.dense_reason = "not planned"

    @property
    def weight_bytes(self) -> int:
        """Device bytes the eager path adds for weights: the dense copies when accepted
        (then no tile scratch is ever allocated), else the one tile scratch."""
        return self.dense_bytes if self._dense_ok else self.tile_bytes

    @staticmethod
    def dense_budget(free_bytes: int | None) -> int:
        """Bytes dense prefill copies may take, given the device's free memory (None: unknown)."""
        if free_bytes is None:
            return DENSE_MAX_BYTES
        return int(min(DENSE_MAX_BYTES, DENSE_FREE_FRACTION * max(0, int(free_bytes))))

    def plan_dense(self, uses, budget: int) -> bool:
        """Accept dense copies when they all fit ``budget`` bytes. ``uses``: (DevMatrix,
        mode) for every eager GEMM (a matrix used in two modes counts twice). All or
        nothing: a model either keeps every copy or runs every GEMM on tiles."""
        need: dict[tuple[int, int], int] = {}
        for w, mode in uses:
            item = 2 if mode == "f16" else 4
            need[(id(w), item)] = int(w.m) * int(w.k) * item
        total = sum(need.values())
        if not need:
            self._dense_ok, self.dense_bytes, self.dense_reason = set(), 0, "no eager GEMM"
        elif total <= budget:
            self._dense_ok, self.dense_bytes = set(need), total
            self.dense_reason = f"dense: {total / 2**20:.1f} MiB of dequantized weights kept (budget {budget / 2**20:.0f} MiB)"
        else:
            self._dense_ok, self.dense_bytes = set(), 0
            self.dense_reason = (f"tiles: dense copies would take {total / 2**20:.1f} MiB, over the budget of "
                                 f"{budget / 2**20:.0f} MiB")
        return bool(self._dense_ok)

    def _dense_of(self, w, half: bool) -> cp.ndarray | None:
        """The dense dequantized copy of ``w`` (made on first use), or None (tiles)."""
        key = (id(w), 2 if half else 4)
        if key not in self._dense_ok:
            return None
        d = self._dense.get(key)
        if d is None:
            m, k = int(w.m), int(w.k)
            d = cp.empty((m, k), cp.float16 if half else cp.float32)
            deq = self.k[f"{'dequant_h' if half else 'dequant'}<{int(w.qtype)}>"]
            step = max(1, (1 << 30) // max(1, k // 8))     # rows per launch: m * k / 8 threads stay below 2^30
            for r0 in range(0, m, step):
                nr = min(step, m - r0)
                n_el = nr * (k // 8)
                deq(((n_el + NT - 1) // NT,), (NT,), (np.uint64(w.data.data.ptr + r0 * w.row_bytes),
                                                      np.int64(w.row_bytes), np.int32(nr), np.int32(k),
                                                      np.uint64(d.data.ptr + r0 * k * d.itemsize)))
            self._dense[key] = d
        return d

    def scratch(self) -> cp.ndarray:
        if self._scratch is None:
            self._scratch = cp.empty(self.tile_bytes, cp.uint8)
        return self._scratch

    @staticmethod
    def kernel_names(qtypes) -> set[str]:
        out = {"rows_half", "rms_norm"}
        for t in qtypes:
            out.update({f"dequant<{int(t)}>", f"dequant_h<{int(t)}>"})
        return out

    def tile_rows(self, k: int, item: int) -> int:
        """Rows of a k-wide weight per tile of ``item``-byte elements (a multiple of 16)."""
        r = self.tile_bytes // (item * k)
        return max(1, r // 16 * 16 if r >= 16 else r)

    def prepare(self, mode: str, x: int, ldx: int, k: int, n: int, norm) -> Prepared:
        """The activations of one op for ``mode``: rows of x (float32 (n, ldx), k inputs)
        RMS-normed with ``norm`` = (weight, eps) when given; float16 for "f16"."""
        if mode == "f16":
            h = cp.empty((n, k), cp.float16)
            nw, eps = (norm[0], float(norm[1])) if norm is not None else (None, 0.0)
            self.k["rows_half"]((n,), (128,), (np.uint64(x), np.int32(ldx), _u64(nw), np.float32(eps), np.int32(k),
                                                h, np.int32(k)))
            return Prepared(mode, h.data.ptr, k, h)
        if norm is None:
            return Prepared(mode, x, ldx, None)
        ld = (k + 3) // 4 * 4
        h = cp.empty((n, ld), cp.float32)
        self.k["rms_norm"]((n,), (256,), (np.uint64(x), np.int32(ldx), _u64(norm[0]), np.float32(norm[1]),
                                          np.int32(k), h, np.int32(ld), np.int32(0)))
        return Prepared(mode, h.data.ptr, ld, h)

    def gemm(self, p: Prepared, w, r0: int, m: int, n: int, y: int, ldy: int, accumulate: bool) -> None:
        """y[:, :m] (+= when ``accumulate``) p @ W[r0:r0 + m].T, float32 (n, ldy) at address y.
        ``w`` is a DevMatrix (quantized rows, ``row_bytes`` each)."""
        k = w.k
        half = p.mode == "f16"
        item = 2 if half else 4
        beta = self._one if accumulate else self._zero
        dense = self._dense_of(w, half)
        if dense is not None:
            self._blas_gemm(p, half, dense.data.ptr + r0 * k * item, k, m, n, y, ldy, beta)
            return
        rows = self.tile_rows(k, item)
        buf = self.scratch()
        deq = self.k[f"{'dequant_h' if half else 'dequant'}<{int(w.qtype)}>"]
        base = w.data.data.ptr
        for t0 in range(0, m, rows):
            nr = min(rows, m - t0)
            n_el = nr * (k // 8)
            deq(((n_el + NT - 1) // NT,), (NT,), (np.uint64(base + (r0 + t0) * w.row_bytes), np.int64(w.row_bytes),
                                                  np.int32(nr), np.int32(k), buf))
            self._blas_gemm(p, half, buf.data.ptr, k, nr, n, y + 4 * t0, ldy, beta)

    def _blas_gemm(self, p: Prepared, half: bool, a: int, k: int, m: int, n: int, c: int, ldy: int, beta) -> None:
        """C (n, m; ld ldy, float32) (+)= p @ A.T, A (m, k) row-major at address a."""
        if p.mode == "f32":
            cublas.sgemm(self.blas, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k, self._one.ctypes.data,
                         a, k, p.ptr, p.ld, beta.ctypes.data, c, ldy)
        else:
            cublas.gemmEx(self.blas, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k, self._one.ctypes.data,
                          a, R_16F if half else R_32F, k, p.ptr, R_16F if half else R_32F, p.ld,
                          beta.ctypes.data, c, R_32F, ldy, COMPUTE_32F if half else COMPUTE_32F_FAST_TF32,
                          GEMM_DEFAULT)
