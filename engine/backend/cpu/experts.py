"""Mixture-of-experts on the CPU: expert stacks, routing, the expert FFN and the CPU expert pool.

Owns:
* ``CpuExperts``: a 3-D GGUF expert tensor (ggml shape ``(k, m, E)``) as E matrices of
  shape (m, k), each a ``QuantMatrix`` over its slice of the file's memory map, built
  only when the CPU computes that expert (``materialize``); until then nothing of it is
  read. ``dequantize(e)`` gives an expert's float32 values (references, copies to a GPU).
* ``route``: the ``moe`` op's routing (ops.ProgramBuilder.moe): top-k of the softmax or of
  the raw logits, each family's normalisation, in float32 with a float64 softmax sum.
* ``expert_ffn`` and ``join``: one expert's gated FFN on the rows routed to it, and the
  weighted sum of a row's k expert outputs in selection order (j = 0 .. k-1), whatever
  computed them: a row's numbers do not depend on which tier ran which expert's
  arithmetic order beyond that expert's own kernel, nor on the other rows.
* ``FusedExperts``: the CPU tier's layer kernel on the integer path: one numba call per
  moe layer for all its (row, expert) pairs (sorted by expert, activations quantized once
  per pair, gate + up of every routed expert in one parallel region of cost-balanced work
  items, down in a second, written into Y[row, j]); the same bits as ``expert_ffn`` per
  expert. Expert stacks hold every expert's tiles in one array (Q4_K / Q6_K in the compact
  layout: the file's scale integers; cpu_matmul.repack_compact), filled on first use.
* ``ExpertPool``: the CPU expert pool. It computes the (row, expert) pairs the tier plan
  gives the CPU: every pair on a machine without a GPU. Its threads are numba's: before
  the first expert page is touched, each worker thread of the calling thread's numba pool
  is pinned to one core of the process's affinity set (sched_setaffinity through libc,
  from inside a parallel region), so the pages they first touch (repacked experts, the
  file pages they fault in) stay with the cores that use them and the workers do not
  migrate. The calling thread (numba's thread 0: the engine's tick thread) is left
  unpinned, so processes it starts keep the machine's affinity. numba's workqueue layer
  gives each calling thread its own workers, so the pool pins per calling thread, once.
  Counters (rows, expert calls, seconds) feed the startup profile and the traffic stats.

Leaves to others: which experts the CPU computes (the expert-tier plan of
engine/model/experts.py, through the executor), the op's definition (ops.py), the
matmul kernels (cpu_matmul.py) and the GPU tiers (the CUDA backend).

Batch invariance: each expert's matmuls run on the gathered rows routed to it; rows of
short segments (decode, verify) go through the per-row kernels (``per_row=True``), as
every other matmul of the CPU executor does, so their numbers do not depend on which
other rows chose the same expert.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import time
from typing import Any

import numba
import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from aotx.engine.backend import quants
from aotx.engine.backend.cpu.qdot import LANES, PARALLEL_MACS, QB, R as R_TILE, _group, _lanes, _qblock

MOE_NORM_MIN = np.float32(6.103515625e-5)   # ops.MOE_NORM_MIN (llama.cpp's clamp of the weight sum)
_PAGE = 4096


# ------------------------------------------------------------------ expert stacks

class CpuExperts:
    """E expert matrices of shape (m, k) from one 3-D GGUF tensor ``t`` (ggml ``(k, m, E)``;
    ``t.data``: the memory map, ``(E, m, row_bytes)`` uint8 for block types or a typed
    ``(E, m, k)`` array). ``matrix(e)`` is expert e's QuantMatrix (built on first use);
    ``nbytes_per_expert``: its bytes in the file. Attributes of the op set's expert stacks:
    ``n_expert``, ``m``, ``k``, ``name``, ``qtype``."""

    def __init__(self, t: Any, int8: bool = False):
        k, m, E = (int(x) for x in t.shape)
        self.k, self.m, self.n_expert = k, m, E
        self.name = t.name
        self.qtype = t.qtype
        self.int8 = int8
        data = np.asarray(t.data)
        if data.shape[0] != E:
            raise ValueError(f"tensor {t.name!r}: expected {E} experts, the data has shape {list(data.shape)}")
        self._data = data
        self.nbytes_per_expert = int(t.n_bytes) // E
        quants.as_byte_rows(data[0], t.qtype, k)   # a row length the type cannot hold fails here, by name
        self._mats: list[Any] = [None] * E
        self._lock = threading.Lock()
        # the integer path: every expert's tiles in one stack per array (E, tiles, ...), so the
        # fused layer kernel (moe_experts) reaches any expert by offset; allocated now, untouched:
        # an expert's pages are written (and held) only when it is materialized. ``ready[e]``:
        # expert e's tiles are in place.
        from aotx.engine.backend.cpu import matmul as cpu_matmul

        self.kind = cpu_matmul.KIND_OF.get(t.qtype) if int8 else None
        # Q4_K / Q6_K: the compact tiles (their scales as the file has them: 0.59 / 1.08 bytes
        # per weight, not 0.75 / 1.25; the same numbers), what a decode step reads per expert
        self.compact = self.kind is not None and t.qtype in cpu_matmul.COMPACT_OF and cpu_matmul.COMPACT
        if self.compact:
            self.kind = cpu_matmul.COMPACT_OF[t.qtype]
        self.ready = np.zeros(E, np.bool_)
        self.tiles: tuple | None = None
        if self.kind is not None:
            shp = cpu_matmul.tile_shapes(t.qtype, m, k, compact=self.compact)
            self.tiles = tuple(lazy_empty((E,) + shp[a][0], shp[a][1]) for a in ("qs", "qh", "d", "mn"))
            self._tile_bytes = sum(int(a[0].nbytes) for a in self.tiles)
            self.flat_tiles = _flat(self.tiles)

    @property
    def nbytes(self) -> int:
        """Bytes of the experts materialized for the CPU so far (their tiles or QuantMatrices)."""
        if self.tiles is not None:
            return int(self.ready.sum()) * self._tile_bytes
        return sum(w.nbytes for w in self._mats if w is not None)

    def raw(self, e: int) -> np.ndarray:
        """Expert e's bytes in the file's layout: (m, row_bytes) uint8 (a view of the map)."""
        return quants.as_byte_rows(self._data[e], self.qtype, self.k)

    def matrix(self, e: int):
        """Expert e as a QuantMatrix (m, k), built from the map on first use (on the integer
        path: a view of its tiles in the stack, repacked into place then)."""
        w = self._mats[e]
        if w is None:
            from aotx.engine.backend.cpu import matmul as cpu_matmul

            with self._lock:
                w = self._mats[e]
                if w is None:
                    name = f"{self.name}[{e}]"
                    if self.tiles is None:
                        w = cpu_matmul.QuantMatrix(self._data[e], self.qtype, self.m, self.k, name, int8=self.int8)
                    else:
                        w = cpu_matmul.from_tiles(self._data[e], self.qtype, self.m, self.k,
                                                  (self.kind,) + self._fill(e), name)
                    self._mats[e] = w
        return w

    def _fill(self, e: int) -> tuple[np.ndarray, ...]:
        """Repack expert e into its place in the stack (once; the caller holds the lock);
        returns its (qs, qh, d, mn) views."""
        from aotx.engine.backend.cpu import matmul as cpu_matmul

        views = tuple(a[e] for a in self.tiles)
        if not self.ready[e] and self.compact:
            _, *parts = cpu_matmul.repack_compact(self.raw(e), self.qtype, self.m, self.k)
            for v, part in zip(views, parts):
                v[...] = part
            self.ready[e] = True
        if not self.ready[e]:
            half = self.tiles[2].dtype == np.uint16
            try:
                kind, *parts = cpu_matmul.repack(self.raw(e), self.qtype, self.m, self.k, half)
            except cpu_matmul._NotHalf:
                self._widen_scales()            # a scale beyond float16: the whole stack keeps float32
                return self._fill(e)
            for v, part in zip(views, parts):
                v[...] = part
            self.ready[e] = True
        return views

    def _widen_scales(self) -> None:
        """Re-lay the stack with float32 scales (c = mn + off * d stored, as repack does
        with half=False), re-repacking the experts already in place."""
        from aotx.engine.backend.cpu import matmul as cpu_matmul

        qs, qh, d, mn = self.tiles
        self.tiles = (qs, qh, np.empty(d.shape, np.float32), np.empty(mn.shape, np.float32))
        self._tile_bytes = sum(int(a[0].nbytes) for a in self.tiles)
        self.flat_tiles = _flat(self.tiles)
        for e in np.flatnonzero(self.ready):
            _, _, _, de, me = cpu_matmul.repack(self.raw(int(e)), self.qtype, self.m, self.k, False)
            self.tiles[2][e], self.tiles[3][e] = de, me
        self._mats = [None] * self.n_expert  # their views point at the old scales

    def prefer_huge_pages(self) -> None:
        """Every expert of this stack is about to be materialized (the plan holds them all on
        the host): lay the tiles out in ``np.empty`` arrays, whose transparent huge pages the
        streaming kernels' TLB likes (``lazy_empty``'s 4 KiB pages cost ~5% of decode at the
        Qwen3-30B-A3B layer shape), before any expert is written. A no-op once one is."""
        if self.tiles is None or self.ready.any():
            return
        self.tiles = tuple(np.empty(a.shape, a.dtype) for a in self.tiles)
        self.flat_tiles = _flat(self.tiles)

    def materialize(self, experts, threads: int = 1) -> int:
        """Build the QuantMatrices of ``experts`` (an iterable of indices) now; returns the
        bytes they occupy. ``threads`` > 1: the repacking into the stack runs on that many
        threads first (``_repack_many``)."""
        experts = [int(e) for e in experts]
        if threads > 1:
            self._repack_many(experts, threads)
        return sum(self.matrix(e).nbytes for e in experts)

    def _repack_many(self, experts: list[int], threads: int) -> None:
        """Repack the experts of ``experts`` not yet in the stack on ``threads`` threads (numpy
        releases the GIL in its array loops; a 30B-A3B expert matrix takes ~3 ms on one): each
        expert's tiles are computed off the lock and written into its place under it. An
        expert whose scales do not fit float16 is left to ``matrix`` (it widens the stack)."""
        from concurrent.futures import ThreadPoolExecutor

        from aotx.engine.backend.cpu import matmul as cpu_matmul

        if self.tiles is None:
            return
        todo = [e for e in dict.fromkeys(experts) if not self.ready[e]]
        if len(todo) < 2:
            return
        half = self.tiles[2].dtype == np.uint16

        def one(e: int):
            try:
                if self.compact:
                    _, *parts = cpu_matmul.repack_compact(self.raw(e), self.qtype, self.m, self.k)
                else:
                    _, *parts = cpu_matmul.repack(self.raw(e), self.qtype, self.m, self.k, half)
            except cpu_matmul._NotHalf:
                return e, None
            return e, parts

        with ThreadPoolExecutor(max_workers=min(threads, len(todo)), thread_name_prefix="aotx-repack") as ex:
            for e, parts in ex.map(one, todo):
                if parts is None:
                    continue
                with self._lock:
                    if not self.ready[e] and (self.compact or (self.tiles[2].dtype == np.uint16) == half):
                        for v, part in zip((a[e] for a in self.tiles), parts):
                            v[...] = part
                        self.ready[e] = True

    def dequantize(self, e: int) -> np.ndarray:
        """Expert e's values: float32 (m, k), equal to gguf's dequantization."""
        b = self.raw(e)
        return quants.dequantize_byte_rows(b, self.qtype, np.arange(self.m, dtype=np.int64),
                                           np.empty((self.m, self.k), np.float32))

    def __repr__(self) -> str:
        return f"CpuExperts({self.name!r}, {getattr(self.qtype, 'name', self.qtype)}, {self.n_expert} x {self.m}x{self.k})"


def host_matrix(data: np.ndarray, qtype: int, m: int, k: int, name: str, int8: bool) -> Any:
    """A CPU ``QuantMatrix`` over ``data`` ((m, row bytes) uint8 GGUF blocks of ``qtype``):
    the CUDA host step's router and shared-expert weights, computed by the CPU kernels."""
    from gguf import GGMLQuantizationType as T

    from aotx.engine.backend.cpu.matmul import QuantMatrix

    return QuantMatrix(data, T(qtype), m, k, name, int8=int8)

def _flat(tiles: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """(E, T, ...) stacks as (E T, ...) views: one matrix of E T tiles for the kernels."""
    return tuple(a.reshape((a.shape[0] * a.shape[1],) + a.shape[2:]) for a in tiles)


def expert_vectors(t: Any) -> np.ndarray:
    """A 2-D GGUF tensor of one bias per expert (ggml ``(n, E)``) as float32 (E, n)."""
    n, E = (int(x) for x in t.shape)
    raw = np.ascontiguousarray(t.data).reshape(E, -1)
    if t.qtype == T.F32:
        out = raw.view(np.float32).reshape(E, n)
    elif t.qtype == T.F16:
        out = raw.view(np.float16).reshape(E, n).astype(np.float32)
    elif t.qtype == T.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(E, n)
    else:
        raise ValueError(f"tensor {t.name!r}: per-expert biases of type {t.qtype.name} (F32, F16 or BF16 expected)")
    return np.ascontiguousarray(out, dtype=np.float32)


# ------------------------------------------------------------------ routing

@njit(cache=True, error_model="numpy")
def _route(logits, k, softmax_weight, norm_w, w_scale, sel, wts, margin):
    n, E = logits.shape
    p = np.empty(E, np.float32)
    taken = np.zeros(E, np.bool_)
    for i in range(n):
        if softmax_weight:
            for e in range(E):
                p[e] = logits[i, e]
        else:
            mx = logits[i, 0]
            for e in range(1, E):
                if logits[i, e] > mx:
                    mx = logits[i, e]
            s = 0.0
            for e in range(E):
                v = np.float32(np.exp(logits[i, e] - mx))
                p[e] = v
                s += v
            inv = np.float32(1.0 / s)
            for e in range(E):
                p[e] = p[e] * inv
        taken[:] = False
        for j in range(k):
            best = -1
            bv = np.float32(0.0)
            for e in range(E):
                if taken[e]:
                    continue
                if best < 0 or p[e] > bv:
                    best = e
                    bv = p[e]
            taken[best] = True
            sel[i, j] = best
            wts[i, j] = bv
        # the routing margin: the k-th kept logit minus the best left out (inf when none is)
        nxt = -np.inf
        for e in range(E):
            if not taken[e] and logits[i, e] > nxt:
                nxt = logits[i, e]
        margin[i] = logits[i, sel[i, k - 1]] - nxt
        if softmax_weight:
            mx = wts[i, 0]
            for j in range(1, k):
                if wts[i, j] > mx:
                    mx = wts[i, j]
            s = 0.0
            for j in range(k):
                v = np.float32(np.exp(wts[i, j] - mx))
                wts[i, j] = v
                s += v
            inv = np.float32(1.0 / s)
            for j in range(k):
                wts[i, j] = wts[i, j] * inv
        if norm_w:
            s = np.float32(0.0)
            for j in range(k):
                s += wts[i, j]
            if s < MOE_NORM_MIN:
                s = MOE_NORM_MIN
            for j in range(k):
                wts[i, j] = wts[i, j] / s
        if w_scale != 0.0 and w_scale != 1.0:
            for j in range(k):
                wts[i, j] = wts[i, j] * np.float32(w_scale)


def route(logits: np.ndarray, k: int, gating: str, norm_w: bool,
          w_scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Top-k routing of router logits (n, E) float32 (bias already added), as the ``moe``
    op defines it: returns ``sel`` (n, k) int32 expert ids in decreasing probability (ties:
    lower id first; a NaN row takes the first ids) and ``w`` (n, k) float32 weights.
    gating "softmax": p = softmax(logits), w = p[sel]; "softmax_weight": sel by the raw
    logits, w = softmax of those k. ``norm_w``: w / max(sum w, 6.1e-5); ``w_scale``
    multiplies w unless it is 0 or 1. Third: ``margin`` (n,) float32, the k-th kept logit
    minus the largest one left out: how far the row is from a routing tie, where two
    correct engines may pick different experts (the tests excuse such rows)."""
    n = logits.shape[0]
    sel = np.empty((n, k), np.int32)
    w = np.empty((n, k), np.float32)
    margin = np.empty(n, np.float32)
    if n:
        _route(np.ascontiguousarray(logits, np.float32), int(k), gating == "softmax_weight", bool(norm_w),
               float(w_scale), sel, w, margin)
    return sel, w, margin


# ------------------------------------------------------------------ activations and the join

@njit(cache=True, fastmath=True, error_model="numpy")
def swiglu_oai(gate, up, alpha, limit, out):
    """gpt-oss's clamped SwiGLU (ggml_swiglu_oai): x = min(g, limit), y = clamp(u, -limit,
    limit), out = x / (1 + exp(-alpha x)) * (y + 1). All (n, f) float32 (out may be gate)."""
    n, f = gate.shape
    a = np.float32(alpha)
    lim = np.float32(limit)
    for i in range(n):
        for j in range(f):
            x = min(gate[i, j], lim)
            y = min(max(up[i, j], -lim), lim)
            out[i, j] = x / (np.float32(1.0) + np.exp(-a * x)) * (y + np.float32(1.0))


@njit(cache=True, fastmath=True, error_model="numpy")
def silu_mul(gate, up, out):
    """out = silu(gate) * up, (n, f) float32 (out may be gate)."""
    n, f = gate.shape
    for i in range(n):
        for j in range(f):
            g = gate[i, j]
            out[i, j] = g / (np.float32(1.0) + np.exp(-g)) * up[i, j]


@njit(cache=True, error_model="numpy")
def _join(Y, w, out):
    n, k, d = Y.shape
    for i in range(n):
        for c in range(d):
            acc = w[i, 0] * Y[i, 0, c]
            for j in range(1, k):
                acc = acc + w[i, j] * Y[i, j, c]
            out[i, c] = acc


def join(Y: np.ndarray, w: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[i] = sum_j w[i, j] * Y[i, j] in the order j = 0, 1, ..., k-1 (float32, each
    product and sum rounded; no fused multiply-add reordering). Y: (n, k, d), w: (n, k),
    out: (n, d) float32."""
    if Y.shape[0]:
        _join(Y, w, out)
    return out


@njit(cache=True, error_model="numpy")
def _scatter(Y, y, rows, js):
    for t in range(rows.shape[0]):
        Y[rows[t], js[t]] = y[t]


def groups(sel: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """The (row, slot j) pairs of a routing ``sel`` (n, k) by expert: [(e, rows (c,) int64,
    js (c,) int64)], experts in increasing id, rows increasing within an expert."""
    flat = sel.reshape(-1).astype(np.int64)
    if flat.size == 0:
        return []
    order = np.argsort(flat, kind="stable")
    return _runs(order, flat[order], sel.shape[1])


def _runs(order: np.ndarray, es: np.ndarray, k: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """``groups`` of the flat pair indices ``order`` (sorted by expert, stable), whose
    experts are ``es``."""
    if order.size == 0:
        return []
    cut = np.flatnonzero(np.diff(es)) + 1
    return [(int(es[part_start]), part // k, part % k)
            for part_start, part in zip(np.concatenate(([0], cut)), np.split(order, cut))]


def expert_ffn(gate: CpuExperts, up: CpuExperts, down: CpuExperts, e: int, x: np.ndarray, act: str,
               alpha: float, limit: float, biases: tuple, per_row: bool) -> np.ndarray:
    """Expert e's output on rows x (c, d) float32: down(act(gate x + bg, up x + bu)) + bd,
    (c, d) float32. ``biases``: (gate, up, down) (E, n) arrays or None."""
    bg, bu, bd = biases
    g = gate.matrix(e).matmul(x, per_row=per_row)
    u = up.matrix(e).matmul(x, per_row=per_row)
    if bg is not None:
        g += bg[e]
    if bu is not None:
        u += bu[e]
    if act == "silu":
        silu_mul(g, u, g)
    else:
        swiglu_oai(g, u, alpha, limit, g)
    y = down.matrix(e).matmul(g, per_row=per_row)
    if bd is not None:
        y += bd[e]
    return y


# ------------------------------------------------------------------ the fused layer kernel
# One call per moe layer on the integer path: the (row, expert) pairs sorted by expert, the
# activations quantized once per pair, gate and up of every routed expert in ONE parallel
# region (work items: one 32-row weight tile x up to RC pairs of one expert, split over
# the threads by cost), the activation and its quantization, down in a second region,
# written straight into Y[row, j]. Each output element is the one `_lanes` dot product the
# per-expert QuantMatrix.matmul computes for it (the same quantized row, tile and order),
# so the numbers are the per-expert path's, bit for bit, whatever the batch (tests).

RC = 64                  # pairs per work item (rows sharing one weight tile's loads)
_PAR_PAIRS = 32          # from this many pairs the per-pair steps (quantize, activation) run in parallel


@njit(cache=True, inline="always", error_model="numpy")
def _tile_pairs(kind, isa, qs, qh, d, mn, tg, m_rows, xq, dx, sx, xs, xh, p0, p1, out, dst, col0, bias, use_bias,
                acc):
    """Global tile ``tg`` of a stack (its m_rows valid rows) on quantized pair rows p0..p1-1:
    out[dst[p], col0 + r] = the row's dot product (+ bias[col0 + r])."""
    nb, G, RR, C = qs.shape[1], qs.shape[2], qs.shape[3], qs.shape[4]
    S = d.shape[2]
    k = xq.shape[1]
    for r0 in range(0, RR, LANES):
        r1 = min(LANES, m_rows - r0)
        if r1 <= 0:
            break
        w_off = (tg * nb * G * RR + r0) * C
        if qh.ndim == 4:            # a compact kind's super-block scales (T, nsb, n, R)
            h_off = tg * qh.shape[1] * qh.shape[2] * qh.shape[3] + r0
        else:
            h_off = tg * nb * 32 + (r0 // LANES) * 2
        d_off = tg * nb * S * RR + r0
        i = p0
        while i < p1:
            nr = _group(p1, i)
            if nr == 8:
                _lanes(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, i * k, dx, sx, xs, xh, i * nb, nb, k, acc, 8)
            elif nr == 4:
                _lanes(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, i * k, dx, sx, xs, xh, i * nb, nb, k, acc, 4)
            else:
                _lanes(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, i * k, dx, sx, xs, xh, i * nb, nb, k, acc, 1)
            for ii in range(nr):
                o = dst[i + ii]
                for r in range(r1):
                    c = col0 + r0 + r
                    v = acc[ii * LANES + r]
                    if use_bias:
                        v = v + bias[c]
                    out[o, c] = v
            i += nr


@njit(cache=True, error_model="numpy")
def _items(gs, ge, n_tiles, n_chunks):
    """Work items (group, tile, first pair, end pair) for every group's tiles x pair chunks
    (tile-major within a group: a tile's chunks run back to back on one thread), and the
    item bounds of ``n_chunks`` chunks of about equal cost (pairs x tiles)."""
    G = ge.shape[0]
    n = 0
    for g in range(G):
        n += n_tiles * ((gs[g + 1] - gs[g] + RC - 1) // RC)
    it = np.empty((n, 4), np.int64)
    pre = np.empty(n + 1, np.int64)
    pre[0] = 0
    j = 0
    for g in range(G):
        for t in range(n_tiles):
            for p0 in range(gs[g], gs[g + 1], RC):
                p1 = min(p0 + RC, gs[g + 1])
                it[j, 0], it[j, 1], it[j, 2], it[j, 3] = g, t, p0, p1
                pre[j + 1] = pre[j] + (p1 - p0)
                j += 1
    nc = max(1, min(n_chunks, n))
    bounds = np.empty(nc + 1, np.int64)
    total = pre[n]
    i = 0
    for c in range(nc + 1):
        want = (total * c + nc - 1) // nc
        while i < n and pre[i] < want:
            i += 1
        bounds[c] = i
    bounds[nc] = n
    return it, bounds


@njit(cache=True, error_model="numpy")
def _run_chunk(c, kind, isa, qs, qh, d, mn, m, n_tiles, stack_tiles, it, bounds, ge, xq, dx, sx, xs, xh, out, dst,
               bias, use_bias, kind2, qs2, qh2, d2, mn2, xq2, dx2, sx2, xs2, xh2, out2, bias2):
    """Chunk c of the items of ``_items`` over one stack (tiles t < n_tiles), or two stacks
    of one shape (gate and up: tiles n_tiles .. 2 n_tiles - 1 go to the second, of kind
    ``kind2``, on its own quantized rows xq2..., into out2): per item, expert ge[g]'s tile t
    on pairs p0..p1-1."""
    nt = n_tiles
    acc = np.empty(8 * LANES, np.float32)
    for j in range(bounds[c], bounds[c + 1]):
        g, t, p0, p1 = it[j, 0], it[j, 1], it[j, 2], it[j, 3]
        e = ge[g]
        if t < nt:
            tg = e * stack_tiles + t
            _tile_pairs(kind, isa, qs, qh, d, mn, tg, min(R_TILE, m - t * R_TILE), xq, dx, sx, xs, xh, p0, p1,
                        out, dst, t * R_TILE, bias[e if use_bias else 0], use_bias, acc)
        else:
            t2 = t - nt
            tg = e * stack_tiles + t2
            _tile_pairs(kind2, isa, qs2, qh2, d2, mn2, tg, min(R_TILE, m - t2 * R_TILE), xq2, dx2, sx2, xs2, xh2,
                        p0, p1, out2, dst, t2 * R_TILE, bias2[e if use_bias else 0], use_bias, acc)


@njit(cache=True, parallel=True, error_model="numpy")
def _run_items_par(kind, isa, qs, qh, d, mn, m, n_tiles, stack_tiles, it, bounds, ge, xq, dx, sx, xs, xh, out, dst,
                   bias, use_bias, kind2, qs2, qh2, d2, mn2, xq2, dx2, sx2, xs2, xh2, out2, bias2):
    for c in prange(bounds.shape[0] - 1):
        _run_chunk(c, kind, isa, qs, qh, d, mn, m, n_tiles, stack_tiles, it, bounds, ge, xq, dx, sx, xs, xh, out,
                   dst, bias, use_bias, kind2, qs2, qh2, d2, mn2, xq2, dx2, sx2, xs2, xh2, out2, bias2)


@njit(cache=True, error_model="numpy")
def _run_items(par, kind, isa, qs, qh, d, mn, m, n_tiles, stack_tiles, it, bounds, ge, xq, dx, sx, xs, xh, out, dst,
               bias, use_bias, kind2, qs2, qh2, d2, mn2, xq2, dx2, sx2, xs2, xh2, out2, bias2):
    """The chunks over the threads (``par``) or on the calling thread (work too small for a
    parallel region's fork and join: cpu_qdot.PARALLEL_MACS)."""
    if par:
        _run_items_par(kind, isa, qs, qh, d, mn, m, n_tiles, stack_tiles, it, bounds, ge, xq, dx, sx, xs, xh, out,
                       dst, bias, use_bias, kind2, qs2, qh2, d2, mn2, xq2, dx2, sx2, xs2, xh2, out2, bias2)
    else:
        for c in range(bounds.shape[0] - 1):
            _run_chunk(c, kind, isa, qs, qh, d, mn, m, n_tiles, stack_tiles, it, bounds, ge, xq, dx, sx, xs, xh,
                       out, dst, bias, use_bias, kind2, qs2, qh2, d2, mn2, xq2, dx2, sx2, xs2, xh2, out2, bias2)


@njit(cache=True, inline="always", error_model="numpy")
def _quantize_pair(x, row, xq, p, dx, sx, xs, xh, cs, ch):
    """cpu_qdot.quantize_x of x[row] into pair row p of the scratch."""
    k = x.shape[1]
    nb = k // QB
    for b in range(nb):
        _qblock(x, row * k + b * QB, xq, p * k + b * QB, dx, sx, xs, xh, p * nb + b, cs, ch)


@njit(cache=True, parallel=True, error_model="numpy")
def _quantize_pairs_par(x, rows, xq, dx, sx, xs, xh, cs, ch):
    for p in prange(rows.shape[0]):
        _quantize_pair(x, rows[p], xq, p, dx, sx, xs, xh, cs, ch)


@njit(cache=True, error_model="numpy")
def _act_row(hg, hu, p, act, alpha, limit):
    if act == 0:
        silu_mul(hg[p:p + 1], hu[p:p + 1], hg[p:p + 1])
    else:
        swiglu_oai(hg[p:p + 1], hu[p:p + 1], alpha, limit, hg[p:p + 1])


@njit(cache=True, parallel=True, error_model="numpy")
def _act_quantize_par(hg, hu, P, act, alpha, limit, xq, dx, sx, xs, xh, cs, ch):
    for p in prange(P):
        _act_row(hg, hu, p, act, alpha, limit)
        _quantize_pair(hg, p, xq, p, dx, sx, xs, xh, cs, ch)


@njit(cache=True, error_model="numpy")
def _sort_pairs(sel, skip, ready_g, ready_u, ready_d, traffic, count):
    """The pairs (flat index f = row k + j of ``sel``) of experts not in ``skip``, sorted by
    expert (stable: rows increasing within one): (order (P,), group starts (G+1,), group
    experts (G,)); P = -1 (and nothing counted) when one of them is not materialized in
    all three stacks. ``count``: add the pairs per expert to ``traffic``."""
    n, k = sel.shape
    E = skip.shape[0]
    cnt = np.zeros(E, np.int64)
    for f in range(n * k):
        e = sel[f // k, f % k]
        if not skip[e]:
            cnt[e] += 1
    G = 0
    for e in range(E):
        if cnt[e]:
            if not (ready_g[e] and ready_u[e] and ready_d[e]):
                return np.empty(0, np.int64), np.empty(1, np.int64), np.empty(0, np.int64), -1
            G += 1
    if count:
        for e in range(E):
            traffic[e] += cnt[e]
    gs = np.empty(G + 1, np.int64)
    ge = np.empty(G, np.int64)
    pos = np.empty(E, np.int64)
    g = 0
    acc = 0
    for e in range(E):
        if cnt[e]:
            gs[g] = acc
            ge[g] = e
            pos[e] = acc
            acc += cnt[e]
            g += 1
    gs[G] = acc
    order = np.empty(acc, np.int64)
    for f in range(n * k):
        e = sel[f // k, f % k]
        if not skip[e]:
            order[pos[e]] = f
            pos[e] += 1
    return order, gs, ge, acc


@njit(cache=True, error_model="numpy")
def _moe_experts(kg, ku, kd, isa, x, sel, skip, traffic, count, Y2,
                 gqs, gqh, gd, gmn, uqs, uqh, ud, umn, dqs, dqh, dd, dmn, ready_g, ready_u, ready_d,
                 ff, dm, nt_f, nt_d, cs1, ch1, csu, chu, cs2, ch2, bg, bu, bdn, use_bias, act, alpha, limit, n_chunks,
                 xq, dx, sx, xs, xh, hg, hu, xq2, dx2, sx2, xs2, xh2, xqu, dxu, sxu, xsu, xhu):
    """The fused layer (section comment): Y2 (n k, dm) rows f = r k + j of the pairs of
    experts not in ``skip``. Returns the number of pairs computed, or -1 (nothing done)
    when one of their experts is not materialized; and the number of experts. Scratch (at least P rows): xq.. (dm
    inputs, gate's corrections cs1/ch1), hg, hu (ff), xq2.. (ff inputs, down's), xqu.. (dm
    inputs, up's corrections csu/chu: the same arrays as xq.. when up is of gate's kind)."""
    order, gs, ge, P = _sort_pairs(sel, skip, ready_g, ready_u, ready_d, traffic, count)
    if P <= 0:
        return P, 0
    k = sel.shape[1]
    rows = order // k
    two = xqu.ctypes.data != xq.ctypes.data
    if P >= _PAR_PAIRS:
        _quantize_pairs_par(x, rows, xq, dx, sx, xs, xh, cs1, ch1)
        if two:
            _quantize_pairs_par(x, rows, xqu, dxu, sxu, xsu, xhu, csu, chu)
    else:
        for p in range(P):
            _quantize_pair(x, rows[p], xq, p, dx, sx, xs, xh, cs1, ch1)
            if two:
                _quantize_pair(x, rows[p], xqu, p, dxu, sxu, xsu, xhu, csu, chu)
    ident = np.arange(P)
    par = P * ff * dm >= PARALLEL_MACS and n_chunks > 1
    it, bounds = _items(gs, ge, 2 * nt_f, n_chunks if par else 1)
    _run_items(par, kg, isa, gqs, gqh, gd, gmn, ff, nt_f, nt_f, it, bounds, ge, xq, dx, sx, xs, xh, hg, ident,
               bg, use_bias, ku, uqs, uqh, ud, umn, xqu, dxu, sxu, xsu, xhu, hu, bu)
    if P >= _PAR_PAIRS:
        _act_quantize_par(hg, hu, P, act, alpha, limit, xq2, dx2, sx2, xs2, xh2, cs2, ch2)
    else:
        for p in range(P):
            _act_row(hg, hu, p, act, alpha, limit)
            _quantize_pair(hg, p, xq2, p, dx2, sx2, xs2, xh2, cs2, ch2)
    it, bounds = _items(gs, ge, nt_d, n_chunks if par else 1)
    _run_items(par, kd, isa, dqs, dqh, dd, dmn, dm, nt_d, nt_d, it, bounds, ge, xq2, dx2, sx2, xs2, xh2, Y2, order,
               bdn, use_bias, kd, dqs, dqh, dd, dmn, xq2, dx2, sx2, xs2, xh2, Y2, bdn)
    return P, ge.shape[0]


_ZB = np.zeros((1, 1), np.float32)


def fused_for(attrs: dict) -> FusedExperts | None:
    """The layer's FusedExperts (kept on its gate stack), or None where it does not apply."""
    g, u, dn = attrs["gate"], attrs["up"], attrs["down"]
    hit = getattr(g, "_fused_cache", None)
    if hit is None or hit[0] is not u or hit[1] is not dn:
        hit = (u, dn, FusedExperts.of(attrs))
        try:
            g._fused_cache = hit
        except AttributeError:           # a stack that takes no attributes: build it each time
            pass
    return hit[2]


class FusedExperts:
    """The fused kernel bound to one moe layer's three stacks (``of`` gives None where it
    does not apply: a stack not on the integer path, or shapes that do not chain). ``run(x, sel, Y, skip, traffic)``: Y[r, j] for the pairs whose expert
    is not in ``skip``; the experts routed to are materialized first."""

    def __init__(self, attrs: dict):
        from aotx.engine.backend.cpu import matmul as cpu_matmul
        from aotx.engine.backend.cpu import qdot as cpu_qdot

        g, u, dn = attrs["gate"], attrs["up"], attrs["down"]
        self.g, self.u, self.dn = g, u, dn
        self.ff, self.dm = g.m, dn.m
        self.nt_f, self.nt_d = -(-g.m // R_TILE), -(-dn.m // R_TILE)
        self.isa = cpu_qdot.HOST_ISA
        self.kg, self.ku, self.kd = (cpu_matmul._MARKER[st.kind] for st in (g, u, dn))
        self.two = g.kind != u.kind
        self.c1 = cpu_matmul._CORR[(g.kind, int(self.isa))]
        self.cu = cpu_matmul._CORR[(u.kind, int(self.isa))]
        self.c2 = cpu_matmul._CORR[(dn.kind, int(self.isa))]
        bg, bu, bd = attrs["gate_bias"], attrs["up_bias"], attrs["down_bias"]
        self.use_bias = bg is not None or bu is not None or bd is not None
        E = g.n_expert
        z = np.zeros

        def b(v, m):
            return np.ascontiguousarray(v, np.float32) if v is not None else z((E, m), np.float32)
        self.biases = (b(bg, g.m), b(bu, u.m), b(bd, dn.m)) if self.use_bias else (_ZB, _ZB, _ZB)
        self.act = 0 if attrs["act"] == "silu" else 1
        self.alpha, self.limit = float(attrs["alpha"]), float(attrs["limit"])
        self.no_skip = np.zeros(E, np.bool_)
        self._no_traffic = np.zeros(E, np.int64)
        self._local = threading.local()

    @staticmethod
    def of(attrs: dict) -> FusedExperts | None:
        g, u, dn = attrs["gate"], attrs["up"], attrs["down"]
        if not all(getattr(st, "tiles", None) is not None for st in (g, u, dn)):
            return None
        if g.m != u.m or g.k != u.k or dn.k != g.m or g.n_expert != u.n_expert or g.n_expert != dn.n_expert:
            return None
        return FusedExperts(attrs)

    def _scratch(self, P: int) -> tuple[np.ndarray, ...]:
        sc = getattr(self._local, "sc", None)
        if sc is None or sc[0].shape[0] < P:
            cap = max(P, 16, 2 * (sc[0].shape[0] if sc is not None else 0))
            nd, nf = self.dm // QB, self.ff // QB
            e = np.empty
            sc = (e((cap, self.dm), np.int8), e((cap, nd), np.float32), e((cap, nd), np.float32),
                  e((cap, nd), np.int32), e((cap, 2 * nd), np.int32), e((cap, self.ff), np.float32),
                  e((cap, self.ff), np.float32), e((cap, self.ff), np.int8), e((cap, nf), np.float32),
                  e((cap, nf), np.float32), e((cap, nf), np.int32), e((cap, 2 * nf), np.int32))
            if self.two:        # up's own quantized rows (its kind's corrections)
                sc += (e((cap, self.dm), np.int8), e((cap, nd), np.float32), e((cap, nd), np.float32),
                       e((cap, nd), np.int32), e((cap, 2 * nd), np.int32))
            else:
                sc += sc[:5]
            self._local.sc = sc
        return sc

    def run(self, x: np.ndarray, sel: np.ndarray, Y: np.ndarray, skip: np.ndarray | None = None,
            traffic: np.ndarray | None = None, n_chunks: int | None = None) -> tuple[int, int]:
        """x (n, d) float32 C-contiguous, sel (n, k) int32, Y (n, k, d) float32 C-contiguous;
        ``traffic`` (E,) int64 gets the computed pairs per expert added. Returns (pairs,
        experts) computed."""
        g, u, dn = self.g, self.u, self.dn
        n, k = sel.shape
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, np.float32)     # the kernel reads rows by offset
        if not Y.flags.c_contiguous or Y.shape != (n, k, self.dm):
            raise ValueError(f"moe: Y must be a C-contiguous ({n}, {k}, {self.dm}) array, got {Y.shape}")
        skip = self.no_skip if skip is None else skip
        count = traffic is not None
        tr = traffic if count else self._no_traffic
        nc = 2 * numba.get_num_threads() if n_chunks is None else int(n_chunks)
        Y2 = Y.reshape(n * k, self.dm)
        for _ in range(2):
            sc = self._scratch(n * k)
            got, n_exp = _moe_experts(self.kg, self.ku, self.kd, self.isa, x, sel, skip, tr, count, Y2, *g.flat_tiles,
                               *u.flat_tiles, *dn.flat_tiles, g.ready, u.ready, dn.ready, self.ff, self.dm, self.nt_f, self.nt_d,
                               *self.c1, *self.cu, *self.c2, *self.biases, self.use_bias, self.act, self.alpha, self.limit,
                               nc, *sc)
            if got >= 0:
                return int(got), int(n_exp)
            want = np.unique(sel[~skip[sel]])
            for st in (g, u, dn):
                st.materialize(want)
        raise RuntimeError("moe: experts not materialized")   # unreachable: materialize sets ready


def lazy_empty(shape: tuple, dtype) -> np.ndarray:
    """An uninitialized array whose memory is committed only where it is written, 4 KiB at a
    time: an expert stack (every expert of a layer, most never materialized when the plan
    leaves them in the file) must not hold what it does not use. numpy asks the kernel for
    transparent huge pages on large arrays, so writing one expert's few KiB of scales
    committed a whole 2 MiB page (a 64 MiB stack with one byte written per 2 MiB held 63 MiB);
    an anonymous mapping with huge pages refused holds what is written. Small arrays, and
    systems without ``MADV_NOHUGEPAGE``, get ``np.empty``."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if n < (4 << 20) or not hasattr(mmap, "MADV_NOHUGEPAGE"):
        return np.empty(shape, dt)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_NOHUGEPAGE)
    except OSError:     # a kernel without transparent huge pages: nothing to refuse
        pass
    return np.frombuffer(buf, dt).reshape(shape)


# ------------------------------------------------------------------ the pool

_libc = None


def _setaffinity():
    global _libc
    if _libc is None:
        try:
            lib = ctypes.CDLL(None, use_errno=True)
            f = lib.sched_setaffinity
        except (OSError, AttributeError):
            _libc = False
            return None
        f.argtypes = (ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)
        f.restype = ctypes.c_int
        _libc = f
    return _libc or None


_pin_kernel = None


def _make_pin_kernel(setaff):
    @njit(parallel=True, cache=False)
    def pin(masks, done, rcs):
        nt = masks.shape[0]
        for _ in prange(nt * 64):
            t = numba.get_thread_id()
            if t > 0 and done[t] == 0:        # thread 0 is the caller: left unpinned
                rcs[t] = setaff(0, masks.shape[1], masks[t].ctypes)
                done[t] = 1
    return pin


@njit(parallel=True, cache=True)
def _touch(flat, step):
    """Read one byte per page of ``flat`` (uint8, 1-D) in parallel: the pages fault in on
    the threads that will read them."""
    n = flat.shape[0]
    pages = (n + step - 1) // step
    acc = 0
    for p in prange(pages):
        acc += flat[p * step]
    return acc


class ExpertPool:
    """The CPU expert pool (module docstring): numba's worker threads, pinned to cores
    before the first expert page is touched, and counters. ``pin=False`` leaves them
    unpinned (tests on a shared machine). One pool per process (``shared()``): numba's
    threads are the process's."""

    _shared: ExpertPool | None = None
    _shared_lock = threading.Lock()

    def __init__(self, pin: bool = True):
        self.pin = bool(pin)
        self.cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.n_threads = numba.get_num_threads()
        self.pinned: dict[int, list[int]] = {}      # calling thread's native id -> core of each worker (-1: not)
        self.rows = 0
        self.expert_calls = 0
        self.seconds = 0.0

    @classmethod
    def shared(cls) -> ExpertPool:
        with cls._shared_lock:
            if cls._shared is None:
                cls._shared = cls(pin=os.environ.get("AOTX_PIN_EXPERT_THREADS", "1") != "0")
            return cls._shared

    def ensure_pinned(self) -> list[int]:
        """Pin the calling thread's numba workers (once per calling thread). Returns the
        core of each numba thread (-1 for the caller and for a worker that could not be
        pinned). Never raises: an OS without sched_setaffinity leaves them unpinned."""
        me = threading.get_native_id()
        got = self.pinned.get(me)
        if got is not None:
            return got
        cores = [-1] * self.n_threads
        setaff = _setaffinity() if self.pin and self.cores else None
        if setaff is not None and self.n_threads > 1:
            global _pin_kernel
            try:
                if _pin_kernel is None:
                    _pin_kernel = _make_pin_kernel(setaff)
                words = (max(self.cores) // 64) + 1
                masks = np.zeros((self.n_threads, words), np.uint64)
                want = [self.cores[t % len(self.cores)] for t in range(self.n_threads)]
                for t, c in enumerate(want):
                    masks[t, c // 64] |= np.uint64(1) << np.uint64(c % 64)
                done = np.zeros(self.n_threads, np.int64)
                rcs = np.full(self.n_threads, -1, np.int64)
                _pin_kernel(masks.view(np.uint8).reshape(self.n_threads, -1), done, rcs)
                cores = [want[t] if t > 0 and done[t] and rcs[t] == 0 else -1 for t in range(self.n_threads)]
            except Exception:  # noqa: BLE001 - pinning is an optimization; never fail a load over it
                cores = [-1] * self.n_threads
        self.pinned[me] = cores
        return cores

    def warm(self, stacks: list[CpuExperts], experts: list[int] | None = None) -> int:
        """Pin, then touch the pages of ``experts`` (default all) of every stack: build
        their QuantMatrices (a repacked copy is written by the pinned workers' pass) and
        fault the file pages in. Returns the bytes the CPU now holds for them."""
        self.ensure_pinned()
        total = 0
        for st in stacks:
            ids = range(st.n_expert) if experts is None else experts
            if len(set(ids)) == st.n_expert:
                st.prefer_huge_pages()
            for e in ids:
                raw = st.raw(e).reshape(-1)
                if raw.size:
                    _touch(raw, _PAGE)
            total += st.materialize(ids, threads=self.n_threads)
        return total

    def compute(self, node: dict, x: np.ndarray, sel: np.ndarray, Y: np.ndarray, pairs, small: np.ndarray | None,
                all_small: bool) -> None:
        """Y[r, j] = expert sel[r, j]'s output on x[r] for the pairs ``pairs`` (from
        ``groups``: (e, rows, js) triples) of one moe node (``node``: its attrs). ``small``:
        bool (n,) rows of short segments (per-row kernels), or None with ``all_small``."""
        self.ensure_pinned()
        t0 = time.perf_counter()
        gate, up, down = node["gate"], node["up"], node["down"]
        biases = (node["gate_bias"], node["up_bias"], node["down_bias"])
        act, alpha, limit = node["act"], node["alpha"], node["limit"]
        n_rows = 0
        for e, rows, js in pairs:
            if all_small or small is None:
                parts = ((rows, js, True),)
            else:
                m = small[rows]
                parts = ((rows[m], js[m], True), (rows[~m], js[~m], False))
            for r, j, per_row in parts:
                if r.size == 0:
                    continue
                y = expert_ffn(gate, up, down, e, np.ascontiguousarray(x[r]), act, alpha, limit, biases, per_row)
                _scatter(Y, y, r, j)
                n_rows += int(r.size)
                self.expert_calls += 1
        self.rows += n_rows
        self.seconds += time.perf_counter() - t0

    def run_fused(self, fused: FusedExperts, x: np.ndarray, sel: np.ndarray, Y: np.ndarray,
                  skip: np.ndarray | None = None, traffic: np.ndarray | None = None) -> None:
        """``compute`` of every pair of ``sel`` whose expert is not in ``skip`` through the
        fused layer kernel (one call for the layer)."""
        self.ensure_pinned()
        t0 = time.perf_counter()
        P, G = fused.run(x, sel, Y, skip, traffic)
        self.rows += P
        self.expert_calls += G
        self.seconds += time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        return {"threads": self.n_threads, "pinned": {str(k): v for k, v in self.pinned.items()},
                "rows": self.rows, "expert_calls": self.expert_calls, "seconds": round(self.seconds, 4)}


# ------------------------------------------------------------------ tiers on the CPU

CPU_TIERS = ("host", "mmap")


def measure(attrs: dict, rows: tuple[int, ...], pool: ExpertPool, reps: int = 5) -> dict[str, Any]:
    """Seconds per expert of this moe node's FFN on n rows (for each n in ``rows``), the
    best of ``reps`` runs after a warm-up, on the CPU pool (pinned first), through the
    kernel the layer runs. With the fused kernel the timing is a layer's call as decode and
    prefill make it: n rows, each routed to the same ``n_used`` experts (0 .. n_used - 1; a
    layer's experts have one shape and type), divided by n_used, so the plan's "n_used x
    one expert" is the layer's measured time, its threads' parallelism included (one
    expert's call alone, times n_used, priced a decode layer at up to the thread count
    times what it took: the H200 benchmark's plan said 2.6 tok/s where 7.7 ran). Without
    it, one expert's call (expert 0) on n rows."""
    pool.ensure_pinned()
    gate, up, down = attrs["gate"], attrs["up"], attrs["down"]
    biases = (attrs["gate_bias"], attrs["up_bias"], attrs["down_bias"])
    rng = np.random.default_rng(0)
    out: dict[int, float] = {}
    fused = fused_for(attrs)
    k_used = max(1, min(int(attrs.get("n_used", 1) or 1), int(attrs.get("n_expert", 1) or 1)))
    for n in rows:
        x = rng.standard_normal((n, gate.k)).astype(np.float32)
        per = 1
        if fused is not None:           # what the layer runs: the fused kernel, n rows x n_used experts
            per = k_used
            sel = np.ascontiguousarray(np.broadcast_to(np.arange(k_used, dtype=np.int32), (n, k_used)))
            Y = np.empty((n, k_used, down.m), np.float32)

            def once():
                fused.run(x, sel, Y)
        else:
            def once():
                expert_ffn(gate, up, down, 0, x, attrs["act"], attrs["alpha"], attrs["limit"], biases, True)
        once()
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            once()
            best = min(best, time.perf_counter() - t0)
        out[int(n)] = best / per
    return {"cpu": out}


def place(nodes: list, p: Any, pool: ExpertPool) -> dict[str, Any]:
    """Apply an expert-tier plan on the CPU backend: "host" experts are materialized and
    their pages touched now by the pinned pool; "mmap" ones stay in the file's map until a
    row is routed to them. A "gpu" tier is refused (ValueError): this backend has no GPU.
    Returns {"gpu_bytes": 0, "host_bytes": bytes now held, "recalibrate": True}."""
    held = 0
    for node, tiers in zip(nodes, p.tiers):
        a = node.attrs
        if len(tiers) != a["n_expert"] or any(t not in CPU_TIERS for t in tiers):
            raise ValueError(f"moe layer {a['moe_layer']}: tiers {sorted(set(tiers))} for {a['n_expert']} experts "
                             f"(the CPU backend has {', '.join(CPU_TIERS)})")
        host = [e for e, t in enumerate(tiers) if t == "host"]
        held += pool.warm([a["gate"], a["up"], a["down"]], host)
    return {"gpu_bytes": 0, "host_bytes": held, "recalibrate": True}


# ------------------------------------------------------------------ the whole op on host rows

def _gpu_pairs(gpu: Any, Y: np.ndarray, g: np.ndarray, experts: np.ndarray, k: int, fut: Any) -> None:
    """The GPU tier's share of a moe op: the flat pairs ``g`` (row * k + j, sorted by expert,
    ``experts`` theirs) computed on the device while the CPU tier's future ``fut`` (or None)
    runs; joins it, then writes the GPU's rows into Y."""
    rows, js = g // k, g % k
    try:
        yg = gpu.wait(gpu.launch_routed(experts, rows))
    finally:
        if fut is not None:
            fut.result()
    _scatter(Y, yg, rows, js)


def moe_rows(attrs: dict, x: np.ndarray, pool: ExpertPool, traffic: np.ndarray | None = None,
             small: np.ndarray | None = None, gpu: Any = None, worker: Any = None) -> np.ndarray:
    """The ``moe`` op on host rows x (n, d) float32: router (+ bias), routing, the experts
    on the pool, the join, the shared expert. ``small``: bool (n,), the rows of short
    segments (decode, verify), which go through the per-row kernels (their numbers
    independent of the batch) while the others take the prefill path; None: every row is
    small. ``attrs``: the node's attributes with CPU weights (``router`` and the shared
    expert's matrices as QuantMatrix, biases as numpy); ``traffic`` (E,) int64 gets the
    routed rows per expert added. For a backend whose own rows live elsewhere (the CUDA
    backend's CPU expert tier).

    ``gpu``: a GPU expert tier (duck typed: ``on`` (E,) bool, the experts it holds;
    ``launch_routed(experts, rows)`` starts their FFNs on the device for the (row, expert)
    pairs given as two (P,) int64 arrays, grouped by expert in increasing id, rows
    increasing within, and returns a handle; ``wait(handle) -> (P, d)`` float32 host
    outputs, one per pair in order). The pairs are split between the tiers with a few
    whole-array operations (no per-expert work for the GPU's). With GPU pairs, the CPU
    pool computes the other pairs on ``worker`` (a one-thread executor: numba releases the
    GIL) while this thread launches the GPU's; both join in Y before the weighted sum, so
    the result does not depend on which tier computed which expert beyond each tier's own
    kernel. Returns (n, d)."""
    x = np.ascontiguousarray(x, np.float32)
    n = x.shape[0]
    d = attrs["down"].m
    if n == 0:
        return np.empty((0, d), np.float32)
    all_small = small is None or bool(small.all())
    if all_small:
        small = None

    def mm(W, v):
        v = np.ascontiguousarray(v)
        if small is None:
            return W.matmul(v, per_row=True)
        y = np.empty((v.shape[0], W.m), np.float32)
        if small.any():
            y[small] = W.matmul(np.ascontiguousarray(v[small]), per_row=True)
        y[~small] = W.matmul(np.ascontiguousarray(v[~small]), per_row=False)
        return y

    logits = mm(attrs["router"], x)
    if attrs["router_bias"] is not None:
        logits += attrs["router_bias"]
    k = attrs["n_used"]
    sel, w, _ = route(logits, k, attrs["gating"], attrs["norm_w"], attrs["w_scale"])
    if traffic is not None:
        traffic += np.bincount(sel.reshape(-1), minlength=traffic.shape[0])
    Y = np.empty((n, k, d), np.float32)
    flat = sel.reshape(-1).astype(np.int64)
    fused = fused_for(attrs)
    if gpu is None or not gpu.on[flat].any():
        if fused is not None:
            pool.run_fused(fused, x, sel, Y)
        else:
            pool.compute(attrs, x, sel, Y, groups(sel), small, all_small)
    elif fused is not None:                          # the CPU's pairs: every expert the GPU does not hold
        fut = worker.submit(pool.run_fused, fused, x, sel, Y, np.ascontiguousarray(gpu.on, np.bool_))
        order = np.argsort(flat, kind="stable")
        es = flat[order]
        here = gpu.on[es]
        _gpu_pairs(gpu, Y, order[here], es[here], k, fut)
    else:
        order = np.argsort(flat, kind="stable")      # pairs by expert, rows increasing within
        es = flat[order]
        here = gpu.on[es]
        cpu_pairs = _runs(order[~here], es[~here], k)
        fut = worker.submit(pool.compute, attrs, x, sel, Y, cpu_pairs, small, all_small) if cpu_pairs else None
        _gpu_pairs(gpu, Y, order[here], es[here], k, fut)
    y = join(Y, w, np.empty((n, d), np.float32))
    shared = attrs.get("shared")
    if shared is not None:
        g = mm(shared[0], x)
        silu_mul(g, mm(shared[1], x), g)
        h = mm(shared[2], g)
        if attrs.get("shared_gate") is not None:
            h *= 1.0 / (1.0 + np.exp(-mm(attrs["shared_gate"], x)))
        y += h
    return y
