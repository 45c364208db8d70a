"""Quantized weight matrices and their matmul on the CPU (numba + numpy BLAS).

Owns: `QuantMatrix`, a weight W (m, k) kept quantized, with `matmul` (x @ W.T) and `rows`
(dequantized rows, for embedding lookups). Leaves to others: block formats and plain
dequantization (`quants.py`), choosing tensors and shapes (engine/model).

How it computes
* Q4_0, Q4_1 and Q8_0 are repacked once at load into a row-tiled layout (still quantized,
  ~1.2x the file's bytes because the float16 scales become float32):
      tiles of R = 32 output rows; for tile t, block b (32 inputs), byte group g, row r
      and byte c (the GGUF block's byte 4g + c):
      Q4_*:  qs[t, b, g, r, c] uint8, g < 4  (low nibble = input b*32 + 4g + c,
             high nibble = input b*32 + 16 + 4g + c)
             d[t, b, r], mn[t, b, r] float32  (w = d * q + mn; Q4_0 stores mn = -8 d)
      Q8_0:  qs[t, b, g, r, c] int8, g < 8  (input b*32 + 4g + c), d[t, b, r] float32
  so one 32-byte load holds 4 consecutive bytes of each of 8 rows: what AVX2's
  vpmaddubsw / vpmaddwd need to produce 8 rows' int32 dot products in one register
  (cpu_qdot.py), without the horizontal sums of a row-major layout.
* Small batches (n <= GEMV_MAX_N, decode) use that kernel with float32 activations
  (uint8 -> int32 -> float32, FMA; ~1e-6 against float64), or, for a matrix built with
  int8=True, quantize x to int8 per 32-block as llama.cpp does (Q8_1 activations) and run
  the integer kernels of `cpu_qdot.py` (AVX2 vpmaddubsw / vpmaddwd, or portable LLVM vector
  code on CPUs without AVX2), at llama.cpp's fidelity (a dot product's relative error
  ~5e-3 against float64, from rounding x to int8). A row's result does not depend on the
  other rows of the call.
* Larger batches (prefill) dequantize a tile of W rows into a reused float32 scratch and
  call numpy's BLAS (x @ tile.T): float32 activations, ~1e-6 against float64. (The int8
  kernels with 4 rows per weight load measured ~2x slower than this path at n = 128.)
* Other supported types (F32, F16, BF16, Q5_0, Q5_1, Q2_K..Q6_K, IQ4_NL, IQ4_XS, MXFP4)
  stay in the file's layout (a memmap view, no copy) and always take the
  dequantize-tile + BLAS path: correct, not tuned.

Not thread-safe per instance: the scratch buffers are per thread, but a QuantMatrix must
not be mutated (it never is after __init__).
"""

from __future__ import annotations

import threading

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from . import cpu_qdot, quants

R = 32                 # output rows per tile in the repacked layouts
GEMV_MAX_N = 4         # batches up to this many rows use the GEMV kernels (float or int8)
TILE_FLOATS = 1 << 20  # scratch size (float32 elements) of one dequantized tile: 4 MiB

_REPACKED = (T.Q4_0, T.Q4_1, T.Q8_0)


# ------------------------------------------------------------------ repacking at load

def _f16_field(blocks: np.ndarray, off: int) -> np.ndarray:
    """float32 (m, nb) from the float16 at byte `off` of each block (blocks uint8 (m, nb, bb))."""
    lo = blocks[:, :, off].astype(np.uint16)
    hi = blocks[:, :, off + 1].astype(np.uint16)
    return quants.F16_LUT[lo | (hi << 8)]


def _tile(a: np.ndarray, m_pad: int) -> np.ndarray:
    """Zero-pad rows to m_pad, then: (m, nb, G*4) bytes -> (m_pad/R, nb, G, R, 4);
    (m, nb) scales -> (m_pad/R, nb, R). Contiguous."""
    m = a.shape[0]
    if m_pad != m:
        a = np.concatenate([a, np.zeros((m_pad - m,) + a.shape[1:], a.dtype)])
    if a.ndim == 3:
        nb, nbytes = a.shape[1:]
        a = a.reshape(m_pad // R, R, nb, nbytes // 4, 4)
        return np.ascontiguousarray(a.transpose(0, 2, 3, 1, 4))
    a = a.reshape((m_pad // R, R) + a.shape[1:])
    return np.ascontiguousarray(a.transpose(0, 2, 1))


def repack(b: np.ndarray, qtype: T, m: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Repack uint8 (m, row_bytes) Q4_0/Q4_1/Q8_0 rows into (qs, d, mn) tiles (see module
    docstring). Reads the rows in slabs so a memmap is never copied whole."""
    be, bb = quants.block_layout(qtype)
    nb = k // be
    m_pad = -(-m // R) * R
    nt = m_pad // R
    if qtype == T.Q8_0:
        qs = np.empty((nt, nb, 8, R, 4), np.int8)
    else:
        qs = np.empty((nt, nb, 4, R, 4), np.uint8)
    d = np.empty((nt, nb, R), np.float32)
    mn = np.empty((nt, nb, R), np.float32) if qtype != T.Q8_0 else np.empty((0, 0, R), np.float32)
    slab = 64 * R
    for r0 in range(0, m_pad, slab):
        r1 = min(m_pad, r0 + slab)
        blocks = np.asarray(b[r0:min(r1, m)]).reshape(-1, nb, bb)
        t0, t1 = r0 // R, r1 // R
        dd = _f16_field(blocks, 0)
        d[t0:t1] = _tile(dd, r1 - r0)
        if qtype == T.Q4_1:
            mn[t0:t1] = _tile(_f16_field(blocks, 2), r1 - r0)
            qs[t0:t1] = _tile(blocks[:, :, 4:20], r1 - r0)
        elif qtype == T.Q4_0:
            mn[t0:t1] = _tile(-8.0 * dd, r1 - r0)
            qs[t0:t1] = _tile(blocks[:, :, 2:18], r1 - r0)
        else:
            qs[t0:t1] = _tile(blocks[:, :, 2:34].view(np.int8), r1 - r0)
    return qs, d, mn


# ------------------------------------------------------------------ GEMV kernels
# x (n, k) float32, out (n, m) float32. Parallel over chunks of row tiles.

@njit(cache=True, fastmath=True, parallel=True)
def _gemv_q4(qs, d, mn, x, xs, out, n_chunks):
    """Q4_0/Q4_1 tiles: out[i, t*R + r] = sum_b d * (sum_j q * x) + mn * xs[i, b].

    qs (T, nb, 4, R, 4) uint8, d/mn (T, nb, R) float32, x (n, k) float32, xs (n, nb) float32
    block sums of x, out (n, m) float32. The r loops vectorize across 32 rows (stride-4
    byte loads); the np.uint8 casts keep the nibble math in narrow lanes.
    """
    nt, nb, G, RR, C = qs.shape
    n, m = out.shape
    per = (nt + n_chunks - 1) // n_chunks
    F = np.uint8(15)
    S = np.uint8(4)
    for c in prange(n_chunks):
        acc = np.empty(RR, np.float32)
        s = np.empty(RR, np.float32)
        for t in range(c * per, min(nt, (c + 1) * per)):
            for i in range(n):
                xi = x[i]
                for r in range(RR):
                    acc[r] = 0.0
                for b in range(nb):
                    for r in range(RR):
                        s[r] = 0.0
                    for g in range(G):
                        W = qs[t, b, g]
                        o = b * 32 + 4 * g
                        x0 = xi[o]; x1 = xi[o + 1]; x2 = xi[o + 2]; x3 = xi[o + 3]
                        y0 = xi[o + 16]; y1 = xi[o + 17]; y2 = xi[o + 18]; y3 = xi[o + 19]
                        for r in range(RR):
                            q0 = W[r, 0]; q1 = W[r, 1]; q2 = W[r, 2]; q3 = W[r, 3]
                            s[r] += (np.float32(np.uint8(q0 & F)) * x0 + np.float32(np.uint8(q0 >> S)) * y0
                                     + np.float32(np.uint8(q1 & F)) * x1 + np.float32(np.uint8(q1 >> S)) * y1
                                     + np.float32(np.uint8(q2 & F)) * x2 + np.float32(np.uint8(q2 >> S)) * y2
                                     + np.float32(np.uint8(q3 & F)) * x3 + np.float32(np.uint8(q3 >> S)) * y3)
                    db = d[t, b]
                    mb = mn[t, b]
                    xsb = xs[i, b]
                    for r in range(RR):
                        acc[r] += db[r] * s[r] + mb[r] * xsb
                r1 = min(RR, m - t * RR)
                for r in range(r1):
                    out[i, t * RR + r] = acc[r]


@njit(cache=True, fastmath=True, parallel=True)
def _gemv_q8(qs, d, x, out, n_chunks):
    """Q8_0 tiles (T, nb, 8, R, 4) int8: out[i, t*R + r] = sum_b d[t, b, r] * sum_j q * x[i, b*32 + j]."""
    nt, nb, G, RR, C = qs.shape
    n, m = out.shape
    per = (nt + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        acc = np.empty(RR, np.float32)
        s = np.empty(RR, np.float32)
        for t in range(c * per, min(nt, (c + 1) * per)):
            for i in range(n):
                xi = x[i]
                for r in range(RR):
                    acc[r] = 0.0
                for b in range(nb):
                    for r in range(RR):
                        s[r] = 0.0
                    for g in range(G):
                        W = qs[t, b, g]
                        o = b * 32 + 4 * g
                        x0 = xi[o]; x1 = xi[o + 1]; x2 = xi[o + 2]; x3 = xi[o + 3]
                        for r in range(RR):
                            s[r] += (np.float32(W[r, 0]) * x0 + np.float32(W[r, 1]) * x1
                                     + np.float32(W[r, 2]) * x2 + np.float32(W[r, 3]) * x3)
                    db = d[t, b]
                    for r in range(RR):
                        acc[r] += db[r] * s[r]
                r1 = min(RR, m - t * RR)
                for r in range(r1):
                    out[i, t * RR + r] = acc[r]


# ------------------------------------------------------------------ packed -> float32 rows

@njit(cache=True, parallel=True)
def _unpack_q4(qs, d, mn, ids, out):
    n, k = out.shape
    for i in prange(n):
        t = ids[i] // R
        r = ids[i] % R
        for b in range(k // 32):
            db = d[t, b, r]
            mb = mn[t, b, r]
            for j in range(16):
                q = qs[t, b, j // 4, r, j % 4]
                out[i, b * 32 + j] = db * np.float32(q & np.uint8(15)) + mb
                out[i, b * 32 + 16 + j] = db * np.float32(q >> np.uint8(4)) + mb


@njit(cache=True, parallel=True)
def _unpack_q8(qs, d, ids, out):
    n, k = out.shape
    for i in prange(n):
        t = ids[i] // R
        r = ids[i] % R
        for b in range(k // 32):
            db = d[t, b, r]
            for j in range(32):
                out[i, b * 32 + j] = db * np.float32(qs[t, b, j // 4, r, j % 4])


@njit(cache=True)
def _unpack_q4_range(qs, d, mn, r0, out):
    """Rows r0 .. r0 + out.shape[0] (r0 a multiple of R) into out (rows, k); tile-major."""
    n, k = out.shape
    nb = k // 32
    t0 = r0 // R
    ntile = (n + R - 1) // R
    for tt in prange(ntile * nb):
        t = tt // nb
        b = tt % nb
        rmax = min(R, n - t * R)
        for r in range(rmax):
            db = d[t0 + t, b, r]
            mb = mn[t0 + t, b, r]
            for j in range(16):
                q = qs[t0 + t, b, j // 4, r, j % 4]
                out[t * R + r, b * 32 + j] = db * np.float32(q & np.uint8(15)) + mb
                out[t * R + r, b * 32 + 16 + j] = db * np.float32(q >> np.uint8(4)) + mb


@njit(cache=True)
def _unpack_q8_range(qs, d, r0, out):
    n, k = out.shape
    nb = k // 32
    t0 = r0 // R
    ntile = (n + R - 1) // R
    for tt in prange(ntile * nb):
        t = tt // nb
        b = tt % nb
        rmax = min(R, n - t * R)
        for r in range(rmax):
            db = d[t0 + t, b, r]
            for j in range(32):
                out[t * R + r, b * 32 + j] = db * np.float32(qs[t0 + t, b, j // 4, r, j % 4])


_local = threading.local()


def _act_scratch(n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per-thread buffers for n rows of k int8-quantized activations (cpu_qdot.quantize_x):
    xq (n, k) int8, dx and sx (n, k/32) float32, x8 (n, k/32) int32. Reused across calls."""
    try:
        bufs = _local.act
    except AttributeError:
        bufs = _local.act = {}
    b = bufs.get((n, k))
    if b is None:
        if len(bufs) > 64:
            bufs.clear()
        nb = k // 32
        b = bufs[(n, k)] = (np.empty((n, k), np.int8), np.empty((n, nb), np.float32),
                            np.empty((n, nb), np.float32), np.empty((n, nb), np.int32))
    return b


def _scratch(size: int) -> np.ndarray:
    """A per-thread float32 buffer of at least `size` elements, reused across calls."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, TILE_FLOATS), np.float32)
        _local.buf = buf
    return buf


class QuantMatrix:
    """A weight matrix W of shape (m, k) float (m = output features, k = input features)
    kept in its GGUF quantized layout (or a layout repacked at load, still quantized:
    memory stays ~ file size; see the module docstring).

    raw:   uint8 (m, row_bytes) as gguf.GGUFReader's tensor.data gives it for block types;
           for F32/F16/BF16 the typed (m, k) array or a uint8 view of it. May be a
           read-only memmap: non-repacked types keep a view of it, never a copy.
    qtype: one of quants.SUPPORTED_TYPES.
    int8:  GEMV (n <= GEMV_MAX_N) of Q4_0/Q4_1/Q8_0 with x rounded to int8 per 32-block,
           as llama.cpp does: ~2x faster, relative error ~5e-3 instead of ~1e-6.
    Raises quants.UnsupportedTensorType or ValueError (shape mismatch), naming `name`.
    """

    def __init__(self, raw: np.ndarray, qtype: T, m: int, k: int, name: str = "", int8: bool = False):
        self.qtype = qtype
        self.int8 = bool(int8)
        self.isa = cpu_qdot.HOST_ISA    # the int8 kernels' instruction set (tests may swap it)
        self.m = int(m)
        self.k = int(k)
        self.name = name
        try:
            b = quants.as_byte_rows(raw, qtype, self.k)
        except ValueError as e:
            raise type(e)(f"{name or 'tensor'}: {e}") from None
        if b.shape[0] != self.m:
            raise ValueError(f"{name or 'tensor'}: expected {self.m} rows of {self.k} "
                             f"{qtype.name} elements, got {b.shape[0]} rows")
        self._n_chunks = max(1, min(-(-self.m // R), 16))
        if qtype in _REPACKED:
            self._qs, self._d, self._mn = repack(b, qtype, self.m, self.k)
            self._raw = None
            self.nbytes = self._qs.nbytes + self._d.nbytes + self._mn.nbytes
        else:
            self._raw = b
            self._f32 = b.view(np.float32) if qtype == T.F32 else None
            self.nbytes = b.nbytes

    def __repr__(self) -> str:
        return f"QuantMatrix({self.name!r}, {self.qtype.name}, m={self.m}, k={self.k})"

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None, *, per_row: bool = False) -> np.ndarray:
        """x @ W.T.  x: (n, k) float32 (C-contiguous; other inputs are converted).
        out: optional (n, m) float32 C-contiguous buffer to write into. Returns (n, m).

        ``per_row``: use the GEMV kernels whatever n is (Q4_0/Q4_1/Q8_0), so each row's
        result is bit-identical to computing it alone: decode and speculative verify rows
        then do not depend on what else is in the batch."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"{self.name or 'matmul'}: x has shape {x.shape}, expected (n, {self.k})")
        n = x.shape[0]
        if out is None:
            out = np.empty((n, self.m), np.float32)
        if n == 0:
            return out
        q = self.qtype
        small = n <= GEMV_MAX_N or per_row
        if q in _REPACKED and small and self.int8:
            xq, dx, sx, x8 = _act_scratch(n, self.k)
            if q == T.Q8_0:
                cpu_qdot.matmul_q8(self.isa, self._qs, self._d, x, xq, dx, sx, x8, out, self._n_chunks)
            else:
                cpu_qdot.matmul_q4(self.isa, self._qs, self._d, self._mn, x, xq, dx, sx, x8, out,
                                   self._n_chunks)
            return out
        if q in _REPACKED and small:
            if q == T.Q8_0:
                _gemv_q8(self._qs, self._d, x, out, self._n_chunks)
            else:
                xs = x.reshape(n, -1, 32).sum(axis=2)
                _gemv_q4(self._qs, self._d, self._mn, x, xs, out, self._n_chunks)
            return out
        if self._raw is not None and q == T.F32:
            np.matmul(x, self._f32.T, out=out)
            return out
        rows_per_tile = max(R, (TILE_FLOATS // self.k) // R * R)
        if rows_per_tile >= self.m:
            w = self._dequant_range(0, self.m)
            np.matmul(x, w.T, out=out)
            return out
        for r0 in range(0, self.m, rows_per_tile):
            r1 = min(self.m, r0 + rows_per_tile)
            w = self._dequant_range(r0, r1)
            out[:, r0:r1] = x @ w.T
        return out

    def _dequant_range(self, r0: int, r1: int) -> np.ndarray:
        """float32 (r1 - r0, k) view into the thread's scratch; valid until the next call."""
        w = _scratch((r1 - r0) * self.k)[: (r1 - r0) * self.k].reshape(r1 - r0, self.k)
        if self.qtype == T.Q8_0:
            _unpack_q8_range(self._qs, self._d, r0, w)
        elif self.qtype in _REPACKED:
            _unpack_q4_range(self._qs, self._d, self._mn, r0, w)
        else:
            quants.dequantize_byte_rows(self._raw, self.qtype, np.arange(r0, r1, dtype=np.int64), w)
        return w

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows: ids int (n,) in [-m, m) -> float32 (n, k) (embedding lookup)."""
        idx = quants.row_ids(ids, self.m)
        out = np.empty((idx.size, self.k), np.float32)
        if idx.size == 0:
            return out
        if self.qtype == T.Q8_0:
            _unpack_q8(self._qs, self._d, idx, out)
        elif self.qtype in _REPACKED:
            _unpack_q4(self._qs, self._d, self._mn, idx, out)
        else:
            quants.dequantize_byte_rows(self._raw, self.qtype, idx, out)
        return out
