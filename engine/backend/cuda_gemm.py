"""The prefill GEMM of the CUDA backend's eager path: quantized weights, one tile at a time.

Owns: ``PrefillGemm``, which computes ``Y[:, :m] (+)= norm(X) @ W[r0:r0 + m].T`` for the
many-row batches the eager path runs (prefill chunks), in one of three modes
(``cuda_choice.PREFILL_MODES``): the weight is dequantized tile by tile (at most
``TILE_BYTES``, about 4,000 rows of a 4096-wide matrix) into one reused scratch buffer and
multiplied by cuBLAS: ``f16`` (float16 tile and activations, GemmEx, float32 accumulation:
tensor cores), ``tf32`` (float32 tile, GemmEx with TF32 tensor-core math), ``f32``
(float32 tile, SGEMM). No whole-model copies: the scratch is the only weight memory the
eager path adds (``scratch_bytes``). The activations are converted (and RMS-normed) once
per op (``prepare``) and reused by every GEMM of that op (q, k, v; gate and up).

Leaves which mode each weight uses to the kernel choice (``cuda_choice``, ``kernel_choice``)
and the order of ops to ``cuda_program``. Runs on CuPy's current stream (the eager path's).

Limits: float16 inputs saturate at +-65504 (the f16 mode is offered only for inputs that
are RMS-normed or attention outputs); TF32 and float16 round the inputs to 11 significant
bits, so prefill logits differ from the float32 path by about 1e-3 relative.
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from cupy_backends.cuda.libs import cublas

TILE_BYTES = 32 << 20           # the dequantized weight tile (fits the H200's 60 MB L2 with room)
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

    @property
    def scratch_bytes(self) -> int:
        return self.tile_bytes

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
        rows = self.tile_rows(k, item)
        buf = self.scratch()
        deq = self.k[f"{'dequant_h' if half else 'dequant'}<{int(w.qtype)}>"]
        beta = self._one if accumulate else self._zero
        base = w.data.data.ptr
        for t0 in range(0, m, rows):
            nr = min(rows, m - t0)
            n_el = nr * (k // 8)
            deq(((n_el + NT - 1) // NT,), (NT,), (np.uint64(base + (r0 + t0) * w.row_bytes), np.int64(w.row_bytes),
                                                  np.int32(nr), np.int32(k), buf))
            c = y + 4 * t0
            if p.mode == "f32":
                cublas.sgemm(self.blas, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, nr, n, k, self._one.ctypes.data,
                             buf.data.ptr, k, p.ptr, p.ld, beta.ctypes.data, c, ldy)
            else:
                cublas.gemmEx(self.blas, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, nr, n, k, self._one.ctypes.data,
                              buf.data.ptr, R_16F if half else R_32F, k, p.ptr, R_16F if half else R_32F, p.ld,
                              beta.ctypes.data, c, R_32F, ldy, COMPUTE_32F if half else COMPUTE_32F_FAST_TF32,
                              GEMM_DEFAULT)
