"""Quantized weight matrices and their matmul on the CPU (numba).

Owns: `QuantMatrix`, a weight W (m, k) kept quantized, with `matmul` (x @ W.T, for any
number of rows n) and `rows` (dequantized rows, for embedding lookups); `from_tiles` (a
matrix over tiles held elsewhere: the expert stacks) and `join_rows` (several matrices of
one input as one); the float path (`gemm_float`) and the per-thread scratch. Leaves to
others: the layouts, decomposition and repacking (`repack.py`, whose docstring gives the
tiles), the kernels (`qdot.py`, `fdot.py`), plain dequantization of the file layouts
(`quants.py`), choosing tensors and shapes (engine/model).

Batch invariance: `matmul` computes out[i, j] from x[i] and weight row j alone, by one
fixed sequence of operations whatever n is: the same kernel for a decode row, a
speculative verify window and a 512-token prefill chunk (DESIGN.md). Nothing
here chooses a kernel by n.

How it computes
* Integer path (the default, ``int8=True``): x is rounded to int8 per 32-block as
  llama.cpp does (Q8_1-style activations) and multiplied with integer weights
  (`qdot.gemm`: vpdpbusd, or vpmaddubsw / vpmaddwd, or portable LLVM vector code), with
  a relative error ~5e-3 against float64, llama.cpp's fidelity, over the tiles `repack.py`
  lays out once at load.
* Float path (every other type: F32, F16, BF16, Q2_K, Q3_K and any type not listed above;
  and every type when the matrix is built with ``int8=False``): float32 activations times
  weight rows - F32, F16 and BF16 read in place (converted exactly as they are loaded),
  others dequantized into a per-thread scratch, tile by tile, per call - each output
  one `fdot.dots` dot product in its fixed order: ~1e-6 against float64. Correct and
  batch-invariant; slower than the integer path.

Not thread-safe per instance: the scratch buffers are per thread, but a QuantMatrix must
not be mutated (it never is after __init__; tests set ``isa``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from aotx.engine.backend import quants
from aotx.engine.backend.cpu import fdot as cpu_fdot, markers as cpu_markers, qdot as cpu_qdot
from aotx.engine.backend.cpu.parallel import PARALLEL
from aotx.engine.backend.cpu.repack import (
    COMPACT_OF, KIND_OF, R, _byte_rows, _dequantize, repack, repack_compact,
)

TILE_FLOATS = 1 << 20  # float path: scratch size (float32 elements) of one dequantized tile: 4 MiB
_MARKER = {"q4": cpu_markers.Q4, "q5": cpu_markers.Q5, "q8": cpu_markers.Q8, "q8x2": cpu_markers.Q8X2,
           "q4k": cpu_markers.Q4K, "q6k": cpu_markers.Q6K, "q6p": cpu_markers.Q6P}
# Q4_K / Q6_K matrices take the compact layout (the same numbers; 21% / 14% fewer bytes per
# decode step). AOTX_COMPACT_TILES=0: the standard Q4 / Q8X2 tiles (comparisons).
COMPACT = os.environ.get("AOTX_COMPACT_TILES", "1") != "0"
_CORR = {(kind, int(isa)): tuple(np.int32(v) for v in cpu_markers.corrections(kind, cpu_markers.isa_name(isa)))
         for kind in _MARKER for isa in (cpu_markers.VNNI, cpu_markers.AVX2, cpu_markers.PORTABLE)}


# ------------------------------------------------------------------ the float path

@njit(cache=True, inline="always", error_model="numpy")
def _float_group(x, w, out, col0, g):
    n, k = x.shape
    mw = w.shape[0]
    m = out.shape[1]
    j = 4 * g
    if j + 4 <= mw:
        i = 0
        while i + 2 <= n:
            cpu_fdot.dots(2, 4, x, i * k, k, w, j * k, k, k, out, i * m + col0 + j, m)
            i += 2
        if i < n:
            cpu_fdot.dots(1, 4, x, i * k, k, w, j * k, k, k, out, i * m + col0 + j, m)
    else:
        for jj in range(j, mw):
            for i in range(n):
                cpu_fdot.dots(1, 1, x, i * k, k, w, jj * k, k, k, out, i * m + col0 + jj, m)


@njit(cache=True, parallel=True, error_model="numpy")
def _gemm_float_parallel(x, w, out, col0):
    for g in prange((w.shape[0] + 3) // 4):
        _float_group(x, w, out, col0, g)


@njit(cache=True, error_model="numpy")
def _gemm_float_serial(x, w, out, col0):
    for g in range((w.shape[0] + 3) // 4):
        _float_group(x, w, out, col0, g)


def gemm_float(x: np.ndarray, w: np.ndarray, out: np.ndarray, col0: int) -> None:
    """out[i, col0 + j] = dot(x[i], w[j]) in cpu_fdot's order: x (n, k) float32, w (mw, k)
    float32 / float16 bits (uint16) / bfloat16 bits (int16), out (n, m) float32, all
    C-contiguous. Groups of 4 weight rows (over the threads when the work is large);
    inside them activation rows two at a time (each output the same single dot product)."""
    run = _gemm_float_parallel if (x.shape[0] * w.shape[0] * x.shape[1] >= cpu_qdot.PARALLEL_MACS
                                   and PARALLEL.ready) else _gemm_float_serial
    run(x, w, out, col0)


_local = threading.local()


def _act_scratch(n: int, k: int) -> tuple[np.ndarray, ...]:
    """Per-thread buffers for n rows of k int8-quantized activations (qdot.quantize_x):
    xq (n, k) int8, dx and sx (n, k/32) float32, xs (n, k/32) and xh (n, k/16) int32.
    One allocation per k, grown to the largest n seen; the views for each n are kept
    (a decode step asks for the same few shapes ~200 times)."""
    try:
        views = _local.views
    except AttributeError:
        views = _local.views = {}
        _local.act = {}
    v = views.get((n, k))
    if v is not None:
        return v
    bufs = _local.act
    b = bufs.get(k)
    if b is None or b[0].shape[0] < n:
        cap = max(n, 16 if b is None else 2 * b[0].shape[0])
        nb = k // 32
        b = bufs[k] = (np.empty((cap, k), np.int8), np.empty((cap, nb), np.float32),
                       np.empty((cap, nb), np.float32), np.empty((cap, nb), np.int32),
                       np.empty((cap, 2 * nb), np.int32))
        for key in [key for key in views if key[1] == k]:
            del views[key]
    if len(views) > 256:
        views.clear()
    v = views[(n, k)] = tuple(a[:n] for a in b)
    return v


def _scratch(size: int) -> np.ndarray:
    """A per-thread float32 buffer of at least `size` elements, reused across calls."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.size < size:
        buf = np.empty(max(size, TILE_FLOATS), np.float32)
        _local.buf = buf
    return buf


class QuantMatrix:
    """A weight matrix W of shape (m, k) float (m = output features, k = input features)
    kept quantized (its GGUF layout, or the integer tiles of the module docstring).

    raw:   uint8 (m, row_bytes) as gguf.GGUFReader's tensor.data gives it for block types;
           for F32/F16/BF16 the typed (m, k) array or a uint8 view of it. May be a
           read-only memmap: a view of it is kept (for `rows` and the float path), never
           copied.
    qtype: one of quants.SUPPORTED_TYPES, or a type in KIND_OF.
    int8:  True (default): the integer path for the types in KIND_OF; False: the float
           path for every type (float32 activations; e.g. to compare with CUDA's float
           arithmetic).
    Raises quants.UnsupportedTensorType or ValueError (shape mismatch), naming `name`.
    """

    def __init__(self, raw: np.ndarray, qtype: T, m: int, k: int, name: str = "", int8: bool = True):
        self.qtype = qtype
        self.isa = cpu_markers.HOST_ISA    # the integer kernels' instruction set (tests may swap it)
        self.m = int(m)
        self.k = int(k)
        self.name = name
        try:
            b = _byte_rows(raw, qtype, self.k)
        except ValueError as e:
            raise type(e)(f"{name or 'tensor'}: {e}") from None
        if b.shape[0] != self.m:
            raise ValueError(f"{name or 'tensor'}: expected {self.m} rows of {self.k} "
                             f"{qtype.name} elements, got {b.shape[0]} rows")
        self._n_chunks = max(1, min(-(-self.m // R), 16))
        self._raw = b
        # the float path reads these in place: float32, float16 bits (uint16), bfloat16 bits (int16)
        self._direct = {T.F32: np.float32, T.F16: np.uint16, T.BF16: np.int16}.get(qtype)
        if self._direct is not None:
            self._direct = b.view(self._direct)
        self.kind = KIND_OF.get(qtype) if int8 else None
        self.int8 = self.kind is not None
        if self.kind is not None:
            if COMPACT and qtype in COMPACT_OF:
                self.kind, self._qs, self._qh, self._d, self._mn = repack_compact(b, qtype, self.m, self.k)
            else:
                self.kind, self._qs, self._qh, self._d, self._mn = repack(b, qtype, self.m, self.k)
            self._marker = _MARKER[self.kind]
            self.nbytes = self._qs.nbytes + self._qh.nbytes + self._d.nbytes + self._mn.nbytes
        else:
            self.nbytes = b.nbytes

    @property
    def numerics(self) -> str:
        """'int8' (integer path: int8 activations) or 'f32' (float path)."""
        return "int8" if self.int8 else "f32"

    def __repr__(self) -> str:
        return f"QuantMatrix({self.name!r}, {self.qtype.name}, m={self.m}, k={self.k}, {self.numerics})"

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None, *, per_row: bool = False) -> np.ndarray:
        """x @ W.T.  x: (n, k) float32 (C-contiguous; other inputs are converted).
        out: optional (n, m) float32 C-contiguous buffer to write into. Returns (n, m).

        Row-invariant for every n: out[i] depends on x[i] alone, bit for bit (the module
        docstring). ``per_row`` is accepted for older callers and ignored: every call is
        per row."""
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.k:
            raise ValueError(f"{self.name or 'matmul'}: x has shape {x.shape}, expected (n, {self.k})")
        n = x.shape[0]
        if out is None:
            out = np.empty((n, self.m), np.float32)
        if n == 0:
            return out
        if self.int8:
            xq, dx, sx, xs, xh = _act_scratch(n, self.k)
            isa = self.isa
            cs, ch = _CORR[(self.kind, int(isa))]
            kern = cpu_qdot.matmul if PARALLEL.ready else cpu_qdot.matmul_serial
            kern(self._marker, isa, self._qs, self._qh, self._d, self._mn, x, xq, dx, sx, xs, xh, out,
                 self._n_chunks, cs, ch)
            return out
        if self._direct is not None:
            gemm_float(x, self._direct, out, 0)
            return out
        rows_per_tile = max(R, (TILE_FLOATS // self.k) // R * R)
        for r0 in range(0, self.m, rows_per_tile):
            r1 = min(self.m, r0 + rows_per_tile)
            gemm_float(x, self._dequant_range(r0, r1), out, r0)
        return out

    def bound_matmul(self) -> Callable[[np.ndarray, np.ndarray], None]:
        """``f(x, out)``: ``matmul(x, out)`` with the weights, the kernel and its constants
        bound once, for a caller that runs it many times (a program's linear steps: ~200
        per decode step, where the checks and lookups of ``matmul`` cost more than a small
        GEMV's arithmetic). x must be (n, k) float32 and out (n, m) float32, both
        C-contiguous: not checked. The same kernels and numbers as ``matmul``; ``isa`` is
        read now."""
        if not self.int8:
            return lambda x, out: self.matmul(x, out)
        threaded, serial, scratch, parallel = cpu_qdot.matmul, cpu_qdot.matmul_serial, _act_scratch, PARALLEL
        marker, isa, qs, qh, d, mn = self._marker, self.isa, self._qs, self._qh, self._d, self._mn
        cs, ch = _CORR[(self.kind, int(isa))]
        n_chunks, k = self._n_chunks, self.k

        def run(x: np.ndarray, out: np.ndarray) -> None:
            n = x.shape[0]
            if n:
                xq, dx, sx, xs, xh = scratch(n, k)
                # the serial twin until the threaded kernel is compiled (warmup.py): the same numbers
                (threaded if parallel.ready else serial)(marker, isa, qs, qh, d, mn, x, xq, dx, sx, xs, xh, out,
                                                         n_chunks, cs, ch)
        return run

    def _dequant_range(self, r0: int, r1: int) -> np.ndarray:
        """float32 (r1 - r0, k) view into the thread's scratch; valid until the next call."""
        w = _scratch((r1 - r0) * self.k)[: (r1 - r0) * self.k].reshape(r1 - r0, self.k)
        _dequantize(self._raw, self.qtype, self.k, np.arange(r0, r1, dtype=np.int64), w)
        return w

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows: ids int (n,) in [-m, m) -> float32 (n, k) (embedding lookup),
        equal to gguf.quants.dequantize."""
        if self._raw is None:
            raise ValueError(f"{self.name}: a joined matrix (join_rows) has no file rows to look up")
        idx = quants.row_ids(ids, self.m)
        out = np.empty((idx.size, self.k), np.float32)
        if idx.size:
            _dequantize(self._raw, self.qtype, self.k, idx, out)
        return out



def from_tiles(raw: np.ndarray, qtype: T, m: int, k: int, tiles: tuple[np.ndarray, ...], name: str = "") -> QuantMatrix:
    """A QuantMatrix on the integer path over tiles ``repack`` made (kind, qs, qh, d, mn),
    held elsewhere (views are kept, nothing copied); ``raw``: its file rows (``rows``)."""
    kind, qs, qh, d, mn = tiles
    w = object.__new__(QuantMatrix)
    w.qtype, w.isa, w.m, w.k, w.name = qtype, cpu_markers.HOST_ISA, int(m), int(k), name
    w._n_chunks = max(1, min(-(-w.m // R), 16))
    w._raw, w._direct = _byte_rows(raw, qtype, w.k), None
    w.kind, w.int8, w._marker = kind, True, _MARKER[kind]
    w._qs, w._qh, w._d, w._mn = qs, qh, d, mn
    w.nbytes = qs.nbytes + qh.nbytes + d.nbytes + mn.nbytes
    return w


def join_rows(mats: list[QuantMatrix], name: str = "") -> QuantMatrix | None:
    """One matrix whose rows are the rows of ``mats`` in order ([q; k; v], [gate; up]), so
    that one matmul (one activation quantization, one kernel call) replaces several on the
    same input. The tiles are the members' tiles, concatenated: every output element is
    computed by the same operations as before, bit for bit. The members become views of
    the joined arrays (the weights are not held twice) and keep working on their own.

    None where the members cannot share tiles: not all on the integer path, different
    kinds, input lengths or scale types, or a member before the last whose row count is not
    a multiple of R (its last tile would be padded). The joined matrix has no file rows:
    ``rows`` (an embedding lookup) is not available on it."""
    if len(mats) < 2 or not all(isinstance(w, QuantMatrix) and w.int8 for w in mats):
        return None
    first = mats[0]
    if any(w.kind != first.kind or w.k != first.k or w.isa != first.isa or w._d.dtype != first._d.dtype
           for w in mats) or any(w.m % R for w in mats[:-1]):
        return None
    j = object.__new__(QuantMatrix)
    j.qtype, j.isa, j.k, j.name = first.qtype, first.isa, first.k, name or "+".join(w.name for w in mats)
    j.m = sum(w.m for w in mats)
    j._n_chunks = max(1, min(-(-j.m // R), 16))
    j._raw, j._direct = None, None
    j.kind, j.int8, j._marker = first.kind, True, first._marker
    parts = ("_qs", "_qh", "_d", "_mn")
    for a in parts:
        setattr(j, a, np.concatenate([getattr(w, a) for w in mats]))
    j.nbytes = sum(w.nbytes for w in mats)
    t0 = 0
    for w in mats:
        t1 = t0 + w._qs.shape[0]
        for a in parts:
            full = getattr(j, a)
            if full.shape[0]:                    # (qh and mn are empty for kinds without them)
                setattr(w, a, full[t0:t1])
        t0 = t1
    return j


