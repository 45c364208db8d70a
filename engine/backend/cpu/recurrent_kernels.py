"""The numba kernels of the CPU's recurrent layers: the short causal convolution and the
gated delta rule (one row at a time, and the chunked form for aligned chunks of a prefill),
with the per-head L2 norm and the sigmoid gate.

Owns: ``conv_rows`` / ``conv_rows_par`` (the convolution, rows serial or in parallel: the
same bits), ``delta_rows`` (the recurrence), ``delta_chunk`` and ``_chunk_by_heads`` (the
chunked form, its heads in groups on Python threads, numpy's products on one BLAS thread
each: cpu/blas.py says why), ``unit_lower_solve``, ``l2_rows``, ``sigmoid_gate_rows``,
``_gates``. Leaves the per-slot state, the choice of kernel per segment and the op closures
to cpu/recurrent.py.

Bits: the recurrence's and the convolution's arithmetic, element by element, is written out
in the order it runs and compiled without numba's ``reassoc`` (``_FAST_IN_ORDER``), so
interleaving rows or vectorising channels changes no bit (tests/test_recurrent_ops.py;
tests/tools/recurrent_bits.py compares them with an older revision's kernels). The delta
rule's two dot products per state row are 16 lane sums in vector IR added in a fixed order
(`delta_rows`); before 2026-12-07 they were serial sums (other bits, ~2x the error).
"""

from __future__ import annotations

import functools
import math
from concurrent.futures import ThreadPoolExecutor

import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from aotx.engine.backend.cpu.blas import one_thread as one_blas_thread
from aotx.engine.backend.cpu.llvm_ir import _F32, _V8F32, _fma, _hreduce, _ptr, _splat, _splat_value
from aotx.engine.backend.cpu.parallel import PARALLEL

_SIG_CONV = ["void(float32[:, :], float32[:, :], float32[:, :, :], int64[:], int64[:], int64[:], boolean, "
             "float32[:, :])"]
_SIG_DELTA = ["void(float32[:, :], float32[:, :], float32[:, :], float32[:, :], float32[:, :], float32[:], "
              "float32[:], float32[:, :, :], int64, int64, int64[:], float64, float32[:, :])"]
_SIG_L2 = ["void(float32[:, :], int64, float64, float32[:, :])"]
_SIG_GATE = ["void(float32[:, :], float32[:, :], float32[:, :])"]
_SIG_SUBST = ["void(float32[:, :, ::1], float32[:, :, ::1])"]   # contiguous: the row updates vectorise


# The recurrent kernels' flags: numba's fastmath without "reassoc", so that LLVM keeps each sum in
# the order written (it contracts a*b + c into one FMA, as before): the interleaved rows of
# the delta rule and the vectorised channels of the convolution give the bits of one element
# at a time.
_FAST_IN_ORDER = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}


@nb.njit(cache=True, fastmath=_FAST_IN_ORDER, error_model="numpy", inline="always")
def _conv_row(x, wt, state, slot, r0, t, silu, out):
    """Row t of a segment at r0 of ``conv_rows`` (wt: the taps transposed, (K, C))."""
    K, C = wt.shape
    acc = np.zeros(C, np.float32)
    for j in range(K):
        src = t - (K - 1) + j
        if src >= 0:
            u = x[r0 + src]
        else:
            u = state[slot, K - 1 + src]
        for c in range(C):
            acc[c] += u[c] * wt[j, c]
    if silu:
        for c in range(C):
            a = acc[c]
            out[r0 + t, c] = a / (np.float32(1.0) + np.exp(-a))
    else:
        for c in range(C):
            out[r0 + t, c] = acc[c]


@nb.njit(cache=True, fastmath=_FAST_IN_ORDER, error_model="numpy", inline="always")
def _conv_taps(w):
    """w (C, K) as (K, C): unit stride over channels."""
    C, K = w.shape
    wt = np.empty((K, C), np.float32)
    for c in range(C):
        for j in range(K):
            wt[j, c] = w[c, j]
    return wt


@nb.njit(cache=True, fastmath=_FAST_IN_ORDER, error_model="numpy", inline="always")
def _conv_state(x, state, slot, r0, n):
    """The slot's state becomes its last K-1 inputs (ascending: old[i + n] is read before it
    is overwritten)."""
    Km1, C = state.shape[1], state.shape[2]
    for i in range(Km1):
        src = n - Km1 + i
        for c in range(C):
            if src >= 0:
                state[slot, i, c] = x[r0 + src, c]
            else:
                state[slot, i, c] = state[slot, i + n, c]


@nb.njit(_SIG_CONV, cache=True, fastmath=_FAST_IN_ORDER, error_model="numpy")
def conv_rows(x, w, state, seg_slot, seg_row0, seg_n, silu, out):
    """ggml_ssm_conv over each segment: x, out (N, C) float32; w (C, K); state (n_slots,
    K-1, C), updated to each segment's last K-1 inputs. For row t of a segment:
    out[t, c] = sum_{j<K} w[c, j] * u[t-K+1+j, c] (u: the segment's rows, before them the
    slot's state), accumulated in float32 in that order (one fused multiply-add per term,
    from 0); silu(out) when ``silu``. Channels are vectorised, which changes no element's
    arithmetic; ``conv_rows_par`` is the same with rows in parallel (for long segments)."""
    wt = _conv_taps(w)
    for s in range(seg_slot.shape[0]):
        for t in range(seg_n[s]):
            _conv_row(x, wt, state, seg_slot[s], seg_row0[s], t, silu, out)
        _conv_state(x, state, seg_slot[s], seg_row0[s], seg_n[s])


@nb.njit(_SIG_CONV, cache=True, fastmath=_FAST_IN_ORDER, error_model="numpy", parallel=True)
def conv_rows_par(x, w, state, seg_slot, seg_row0, seg_n, silu, out):
    """``conv_rows`` with each segment's rows in parallel: the same bits."""
    wt = _conv_taps(w)
    for s in range(seg_slot.shape[0]):
        slot, r0 = seg_slot[s], seg_row0[s]
        for t in nb.prange(seg_n[s]):
            _conv_row(x, wt, state, slot, r0, t, silu, out)
        _conv_state(x, state, slot, r0, seg_n[s])


def _vptr(builder, p, off):
    return builder.bitcast(builder.gep(p, [off]), _V8F32.as_pointer())


def _lanes16_sum(builder, a, b):
    """16 partial sums (a: lanes i % 16 < 8, b: the others) added in one fixed order: a + b
    lane by lane, then _hreduce's tree over the 8 lanes."""
    return _hreduce(builder, builder.fadd(a, b), builder.fadd)


@intrinsic
def _decay_dot16(typingctx, M, m_off, k, k_off, n16, eg):
    """For i < 16 n16: M[m_off + i] = M[m_off + i] eg (stored); returns sum_i k[k_off + i]
    M[m_off + i] as 16 lane sums (lane i % 16: fma over i ascending) added as _lanes16_sum
    does. Flat element offsets; the 16 n16 elements contiguous in both arrays."""
    sig = types.float32(M, m_off, k, k_off, n16, eg)

    def codegen(context, builder, sig, args):
        mv, mo, kv, ko, n, e = args
        intp = context.get_value_type(types.intp)
        mp = _ptr(builder, context, sig.args[0], mv, mo, _F32)
        kp = _ptr(builder, context, sig.args[2], kv, ko, _F32)
        ev = _splat_value(builder, _V8F32, e)
        acc = [cgutils.alloca_once_value(builder, _splat(_V8F32, 0.0)) for _ in range(2)]
        with cgutils.for_range(builder, n, intp=intp) as loop:
            i = builder.mul(loop.index, ir.Constant(intp, 16))
            for h in range(2):
                off = builder.add(i, ir.Constant(intp, 8 * h))
                pm = _vptr(builder, mp, off)
                m = builder.fmul(builder.load(pm, align=4), ev)
                builder.store(m, pm, align=4)
                kk = builder.load(_vptr(builder, kp, off), align=4)
                builder.store(_fma(builder, kk, m, builder.load(acc[h])), acc[h])
        return _lanes16_sum(builder, builder.load(acc[0]), builder.load(acc[1]))
    return sig, codegen


@intrinsic
def _update_dot16(typingctx, M, m_off, k, k_off, q, q_off, n16, d, bt):
    """For i < 16 n16: M[m_off + i] = fma(d k_i, bt, M[m_off + i]) (stored); returns
    sum_i M[m_off + i] q[q_off + i] in _decay_dot16's lane order."""
    sig = types.float32(M, m_off, k, k_off, q, q_off, n16, d, bt)

    def codegen(context, builder, sig, args):
        mv, mo, kv, ko, qv, qo, n, dd, b = args
        intp = context.get_value_type(types.intp)
        mp = _ptr(builder, context, sig.args[0], mv, mo, _F32)
        kp = _ptr(builder, context, sig.args[2], kv, ko, _F32)
        qp = _ptr(builder, context, sig.args[4], qv, qo, _F32)
        dv = _splat_value(builder, _V8F32, dd)
        bv = _splat_value(builder, _V8F32, b)
        acc = [cgutils.alloca_once_value(builder, _splat(_V8F32, 0.0)) for _ in range(2)]
        with cgutils.for_range(builder, n, intp=intp) as loop:
            i = builder.mul(loop.index, ir.Constant(intp, 16))
            for h in range(2):
                off = builder.add(i, ir.Constant(intp, 8 * h))
                pm = _vptr(builder, mp, off)
                kk = builder.load(_vptr(builder, kp, off), align=4)
                m = _fma(builder, builder.fmul(dv, kk), bv, builder.load(pm, align=4))
                builder.store(m, pm, align=4)
                qq = builder.load(_vptr(builder, qp, off), align=4)
                builder.store(_fma(builder, m, qq, builder.load(acc[h])), acc[h])
        return _lanes16_sum(builder, builder.load(acc[0]), builder.load(acc[1]))
    return sig, codegen


@nb.njit(_SIG_DELTA, cache=True, fastmath=_FAST_IN_ORDER, error_model="numpy", parallel=True)
def _delta_rows(q, k, v, alpha, beta, a, dtb, M, r0, r1, kmap, scale, out):
    """delta_rows' kernel: q, k with contiguous rows, M C-contiguous (its caller sees to it)."""
    H = M.shape[0]
    S = M.shape[1]
    n16 = S // 16
    C = 16 * n16
    sc = np.float32(scale)
    lq = q.strides[0] // 4
    lk = k.strides[0] // 4
    for h in nb.prange(H):
        kb = kmap[h] * S
        vb = h * S
        for t in range(r0, r1):
            x = alpha[t, h] + dtb[h]
            sp = x if x > np.float32(20.0) else np.log(np.float32(1.0) + np.exp(x))
            eg = np.exp(a[h] * sp)
            bt = np.float32(1.0) / (np.float32(1.0) + np.exp(-beta[t, h]))
            for j in range(S):
                mo = (h * S + j) * S
                s = _decay_dot16(M, mo, k, t * lk + kb, n16, eg)
                for i in range(C, S):           # the tail when S is not a multiple of 16
                    m = M[h, j, i] * eg
                    M[h, j, i] = m
                    s += k[t, kb + i] * m
                d = v[t, vb + j] - s
                o = _update_dot16(M, mo, k, t * lk + kb, q, t * lq + kb, n16, d, bt)
                for i in range(C, S):
                    m = M[h, j, i] + (d * k[t, kb + i]) * bt
                    M[h, j, i] = m
                    o += m * q[t, kb + i]
                out[t, vb + j] = o * sc


def delta_rows(q, k, v, alpha, beta, a, dtb, M, r0, r1, kmap, scale, out):
    """The gated delta rule, one row at a time, for rows r0 .. r1-1 of one slot whose state
    is M (n_heads, S, S) float32 C-contiguous with M[h, j, i] = S_h[i][j] (ggml's layout:
    row j of M is column j of S). q, k (N, Hk*S) (L2-normalised), v (N, H*S), alpha, beta
    (N, H) raw; a, dtb (H,); kmap (H,) the key head of each value head. Per row and head h
    (key head kmap[h]), as ggml_gated_delta_net:
        g = a[h] softplus(alpha + dtb[h]);  b = sigmoid(beta)
        for each j:  M[j] *= exp(g);  s = M[j].k;  M[j] += ((v_j - s) k) b;  out_j = scale M[j].q
    (rows j of M are independent, so each is decayed, updated and read in two passes over
    it). The arithmetic, element by element: m = M exp(g) rounded; m' = fma((v_j - s) k_i,
    b, m); the dot products s and o as 16 lane sums (lane i % 16, one fma per element in
    ascending i) added in a fixed order, then the tail past the last multiple of 16 in
    ascending i (`_decay_dot16`, `_update_dot16`: 8-float vector IR, 4x the scalar form's
    speed, ~1e-6 from float64 where the serial sums were ~2e-6). Heads run in parallel; a
    head's arithmetic is the same on any thread and whatever else is in the batch."""
    if M.dtype != np.float32 or not M.flags.c_contiguous:
        raise ValueError(f"delta_rows: the state must be C-contiguous float32, got {M.dtype} strides {M.strides}")
    if q.strides[1] != 4:
        q = np.ascontiguousarray(q)
    if k.strides[1] != 4:
        k = np.ascontiguousarray(k)
    _delta_rows(q, k, v, alpha, beta, a, dtb, M, r0, r1, kmap, scale, out)


@nb.njit(_SIG_SUBST, cache=True, fastmath=True, error_model="numpy", nogil=True)
def unit_lower_solve(A, R):
    """In place: R <- (I + A)^-1 R per head, A (H, C, C) strictly lower triangular (forward
    substitution, rows in order); R (H, C, Sv) float32."""
    H, C, Sv = R.shape
    for h in range(H):
        for t in range(1, C):
            for s in range(t):
                f = A[h, t, s]
                if f != 0.0:
                    for j in range(Sv):
                        R[h, t, j] -= f * R[h, s, j]


@nb.njit(_SIG_L2, cache=True, fastmath=True, error_model="numpy")
def l2_rows(x, hd, eps, out):
    """out = x / sqrt(sum(x**2) + eps) over each hd chunk of every row (sum in float64)."""
    n, w = x.shape
    for r in range(n):
        for h0 in range(0, w, hd):
            s = 0.0
            for j in range(hd):
                v = np.float64(x[r, h0 + j])
                s += v * v
            d = s + eps
            f = np.float32(1.0 / math.sqrt(d)) if d > 0.0 else np.float32(0.0)
            for j in range(hd):
                out[r, h0 + j] = x[r, h0 + j] * f


@nb.njit(_SIG_GATE, cache=True, fastmath=True, error_model="numpy")
def sigmoid_gate_rows(x, g, out):
    """out = x * sigmoid(g) = x / (1 + exp(-g)), element-wise (out may be x)."""
    n, w = x.shape
    for r in range(n):
        for j in range(w):
            out[r, j] = x[r, j] / (np.float32(1.0) + np.exp(-g[r, j]))


def delta_chunk(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, b: np.ndarray, M: np.ndarray,
                scale: float, out: np.ndarray) -> None:
    """One chunk of C positions for all heads at once, in float32 (the WY form of the gated
    delta rule, Yang et al. 2024; the algebra of llama.cpp's build_delta_net_chunking):
    q, k (H, C, S) (key heads already broadcast to value heads), v (H, C, S), g (H, C) the
    log decays, b (H, C) sigmoid(beta), M (H, S, S) the state in delta_rows' layout (updated);
    out (H, C, S). With G = cumsum(g), D[t, s] = exp(G_t - G_s) for s <= t:
        (I + A) U = b V - b exp(G) (K S0),  A = strictly-lower(b D (K K^T))
        O = scale (exp(G) (Q S0) + lower(D (Q K^T)) U)
        S1 = exp(G_last) S0 + (K exp(G_last - G))^T U"""
    H, C, _ = q.shape
    G = np.cumsum(g, axis=1, dtype=np.float32)
    eG = np.exp(G)
    low = np.tril(np.ones((C, C), np.bool_))
    with np.errstate(over="ignore"):      # exp(G_t - G_s) for s > t is masked out
        D = np.where(low[None], np.exp(G[:, :, None] - G[:, None, :]), np.float32(0.0)).astype(np.float32)
    S0 = np.ascontiguousarray(M.transpose(0, 2, 1))            # S0[h, i, j] = S_h[i][j]
    A = np.matmul(k, k.transpose(0, 2, 1)) * D * b[:, :, None]
    A = np.ascontiguousarray(np.where(np.tril(low, -1)[None], A, np.float32(0.0)), dtype=np.float32)
    U = np.ascontiguousarray(b[:, :, None] * v - (b * eG)[:, :, None] * np.matmul(k, S0), dtype=np.float32)
    unit_lower_solve(A, U)
    QK = np.matmul(q, k.transpose(0, 2, 1)) * D
    out[:] = np.float32(scale) * (eG[:, :, None] * np.matmul(q, S0) + np.matmul(QK, U))
    last = G[:, -1]
    kd = k * np.exp(last[:, None] - G)[:, :, None]
    S1 = np.exp(last)[:, None, None] * S0 + np.matmul(kd.transpose(0, 2, 1), U)
    M[:] = S1.transpose(0, 2, 1)


@functools.cache
def _head_pool() -> ThreadPoolExecutor:
    """The worker threads of ``_chunk_by_heads`` (made at the first chunk that splits)."""
    return ThreadPoolExecutor(max_workers=max(1, nb.config.NUMBA_NUM_THREADS - 1), thread_name_prefix="aotx-delta")


def _chunk_by_heads(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, b: np.ndarray, M: np.ndarray,
                    scale: float, out: np.ndarray) -> None:
    """``delta_chunk`` with its heads in numba's thread count of groups, one Python thread
    each (numpy and ``unit_lower_solve`` release the GIL), every group's products on one BLAS
    thread. Each head's arithmetic is the same whatever its group: the same bits."""
    H = q.shape[0]
    parts = min(nb.get_num_threads(), H) if PARALLEL.ready else 1
    if parts <= 1:
        with one_blas_thread():
            delta_chunk(q, k, v, g, b, M, scale, out)
        return
    pool = _head_pool()
    cut = [H * i // parts for i in range(parts + 1)]

    def part(i: int) -> None:
        h = slice(cut[i], cut[i + 1])
        with one_blas_thread():     # thread-local: each worker sets its own
            delta_chunk(q[h], k[h], v[h], g[h], b[h], M[h], scale, out[h])

    futures = [pool.submit(part, i) for i in range(1, parts)]
    part(0)
    for f in futures:
        f.result()


def _gates(alpha: np.ndarray, beta: np.ndarray, a: np.ndarray, dtb: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(g, b) as delta_rows computes them, float32 (rows, H)."""
    x = alpha + dtb
    with np.errstate(over="ignore"):
        sp = np.where(x > 20.0, x, np.log(np.float32(1.0) + np.exp(x))).astype(np.float32)
        return (a * sp).astype(np.float32), (np.float32(1.0) / (np.float32(1.0) + np.exp(-beta))).astype(np.float32)
