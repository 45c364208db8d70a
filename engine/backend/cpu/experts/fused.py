"""The CPU tier's layer kernel on the integer path: every (row, expert) pair of a moe layer in one call.

Owns: ``FusedExperts`` (bound to one moe layer's three stacks; ``fused_for`` keeps it on
the gate stack): one numba call per moe layer for all its (row, expert) pairs (sorted by
expert, activations quantized once per pair, gate + up of every routed expert in one
parallel region of cost-balanced work items, down in a second, written into Y[row, j]);
the same bits as ``ffn.expert_ffn`` per expert. Leaves to others: the stacks and their
tiles (stacks.py), the integer step (lanes.py) and activation quantization (qdot.py),
the pool that runs it (pool.py).
"""

from __future__ import annotations

import threading

import numba
import numpy as np
from numba import njit, prange

from aotx.engine.backend.cpu import markers as cpu_markers, matmul as cpu_matmul
from aotx.engine.backend.cpu.experts.ffn import ACT_CODES, gelu_mul, silu_mul, swiglu_oai
from aotx.engine.backend.cpu.lanes import _lanes
from aotx.engine.backend.cpu.markers import LANES, QB, R as R_TILE
from aotx.engine.backend.cpu.qdot import PARALLEL_MACS, _group, _qblock

# ------------------------------------------------------------------ the fused layer kernel
# One call per moe layer on the integer path: the (row, expert) pairs sorted by expert, the
# activations quantized once per pair, gate and up of every routed expert in ONE parallel
# region (work items: one R-row weight tile x up to RC pairs of one expert, split over
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
            h_off = tg * nb * R_TILE + (r0 // LANES) * 2
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
    elif act == 2:
        gelu_mul(hg[p:p + 1], hu[p:p + 1], hg[p:p + 1])
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
        g, u, dn = attrs["gate"], attrs["up"], attrs["down"]
        self.g, self.u, self.dn = g, u, dn
        self.ff, self.dm = g.m, dn.m
        self.nt_f, self.nt_d = -(-g.m // R_TILE), -(-dn.m // R_TILE)
        self.isa = cpu_markers.HOST_ISA
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
        self.act = ACT_CODES[attrs["act"]]
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
