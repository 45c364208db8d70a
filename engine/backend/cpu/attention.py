"""Attention over the KV cache on the CPU: one kernel for every row.

Owns: `attention_rows` (decode, speculative verify and prefill rows alike, a sliding
window, float32 or float16 KV, optional per-head attention sinks); `store_rows`, which
writes every row's K/V into either cache dtype in one call. Leaves to others: the cache's
allocation and layout (program.py), RoPE and the projections (ops.py, matmul.py).

KV cache layout, per layer: (n_slots, n_kv_heads, n_ctx, head_dim), float32, or float16
kept as its uint16 bit patterns (numba has no float16): one slot's one head is a
contiguous (n_ctx, head_dim) block.

Batch invariance: a row's output depends only on its query, its slot's K/V over its
window and the scale - never on the other rows, the batch size, the segment it came in
or whether it is a decode, verify or prefill row. For row i with length L (positions
[lo, L), lo = max(0, L - window) if window > 0 else 0) and query head h (KV head
h // (H // KV), Ainslie et al. 2023), in this order:
    s_t = dots(q_h, k_t) * scale           for t in [lo, L)   (cpu_fdot's fixed order)
    m = max_t s_t;   e_t = exp_nonpos(s_t - m)                (cpu_fdot's exp)
    den = dots(e, ones)                    (8 lanes by (t - lo) mod 8, then the tree)
    with a sink logit z_h (gpt-oss): m = max(max_t s_t, z_h), den += exp_nonpos(z_h - m)
    after the sum (the sink takes probability mass and adds no value)
    o = axpy: sum over t, in increasing order, of e_t * v_t   (one fma per term)
    out = o * (1 / den)
float16 K/V are converted to float32 exactly (F16C's vcvtph2ps) before any arithmetic.
Rows are grouped into blocks of consecutive rows of one slot only to share the K/V
conversion and cache reads; a row's arithmetic is the same in any block.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import fdot as cpu_fdot
from .fdot import axpy, dots, exp_nonpos, f2h_bits, fma_row, h2f
from .parallel import PARALLEL

ROW_BLOCK = 16   # rows of one slot that share one K/V conversion


@njit(cache=True, error_model="numpy")
def _blocks(slots, n):
    """Start rows of runs of consecutive rows with one slot, each at most ROW_BLOCK long;
    the last entry is n. int64 (n_blocks + 1,)."""
    starts = np.empty(n + 1, np.int64)
    nb = 0
    i = 0
    while i < n:
        starts[nb] = i
        nb += 1
        j = i + 1
        while j < n and j - i < ROW_BLOCK and slots[j] == slots[i]:
            j += 1
        i = j
    starts[nb] = n
    return starts[:nb + 1]


@njit(cache=True, fastmath={"nnan", "ninf", "nsz"}, error_model="numpy")
def _max(a):
    """The largest element of a 1-D float32 array. The flags (no NaN, no inf, no signed
    zeros) only let the reduction vectorize: a max is the same in any order, and a
    signed zero max gives the same exp(s - max) below."""
    mx = np.float32(-3.4e38)
    for u in range(a.shape[0]):
        mx = max(mx, a[u])
    return mx


@njit(cache=True, inline="always", error_model="numpy")
def _window(r, lengths, window, out, g, G, hd):
    """Row r's attended positions [lo, L) as (lo, n = L - lo); a row with none (n <= 0)
    gets zeros for its heads of KV head g."""
    L = lengths[r]
    lo = L - window if window > 0 and L > window else 0
    n = L - lo
    if n <= 0:
        for gi in range(G):
            for d in range(hd):
                out[r, g * G + gi, d] = 0.0
    return lo, n


@njit(cache=True, inline="always", error_model="numpy")
def _weigh_chunk(sc, c0, cn, G, V, vo, hd, o):
    """o[gi] = fma(sc[gi, c0 + t], V position t, o[gi]) element by element, for t < cn in
    increasing order (V's position t at vo + t * hd): a chunk of axpy's weighted sum."""
    for t in range(cn):
        for gi in range(G):
            fma_row(sc[gi, c0 + t], V, vo + t * hd, o, gi * hd, hd)


@njit(cache=True, inline="always", error_model="numpy")
def _scores(q, q0, K, ko, n, G, hd, sc, s0, span):
    """sc[gi, s0 + t] = dots(q head gi, K position t) for t < n, query heads two at a time
    (the same per-pair math) and positions four at a time then one (every score's own
    fixed order whatever its group): the query heads at q0 + gi * hd, K's positions at
    ko + t * hd."""
    gi = 0
    while gi < G:
        if gi + 2 <= G:
            t = 0
            while t + 4 <= n:
                dots(2, 4, q, q0 + gi * hd, hd, K, ko + t * hd, hd, hd, sc, gi * span + s0 + t, span)
                t += 4
            while t < n:
                dots(2, 1, q, q0 + gi * hd, hd, K, ko + t * hd, hd, hd, sc, gi * span + s0 + t, span)
                t += 1
            gi += 2
        else:
            t = 0
            while t + 4 <= n:
                dots(1, 4, q, q0 + gi * hd, hd, K, ko + t * hd, hd, hd, sc, gi * span + s0 + t, span)
                t += 4
            while t < n:
                dots(1, 1, q, q0 + gi * hd, hd, K, ko + t * hd, hd, hd, sc, gi * span + s0 + t, span)
                t += 1
            gi += 1


@njit(cache=True, inline="always", error_model="numpy")
def _softmax(sc, n, g, G, scale, den, sinks, has_sinks):
    """Each head's scores sc[gi, :n] -> exp_nonpos(s * scale - max) in place (the max over
    the sink logit too; den[1 + gi] keeps it when there are sinks)."""
    for gi in range(G):
        # max_t fl(scale * dot_t) = fl(scale * max_t dot_t) for scale > 0 (rounding is monotonic)
        mx = _max(sc[gi, :n]) * scale
        if has_sinks:
            mx = max(mx, sinks[g * G + gi])
            den[1 + gi] = mx
        for u in range(n):
            sc[gi, u] = exp_nonpos(sc[gi, u] * scale - mx)


@njit(cache=True, inline="always", error_model="numpy")
def _inv_den(sc, span, n, g, G, gi, ones, den, sinks, has_sinks):
    """1 / (head gi's sum of weights sc[gi, :n], plus its sink's weight when there are sinks)."""
    dots(1, 1, sc, gi * span, 0, ones, 0, 0, n, den, 0, 0)
    d_sum = den[0]
    if has_sinks:
        d_sum += exp_nonpos(sinks[g * G + gi] - den[1 + gi])
    return np.float32(1.0) / d_sum


@njit(cache=True, inline="always", error_model="numpy")
def _normalize(sc, span, n, g, G, hd, o, ones, den, sinks, has_sinks, out, r):
    """out[r, head] = o[gi] / (the sum of the weights, plus the sink's)."""
    for gi in range(G):
        inv = _inv_den(sc, span, n, g, G, gi, ones, den, sinks, has_sinks)
        h = g * G + gi
        for d in range(hd):
            out[r, h, d] = o[gi, d] * inv


@njit(cache=True, error_model="numpy")
def _rows(q, K, V, base, t0, r0, r1, g, G, lengths, scale, window, out, sc, ones, o, den, sinks, has_sinks):
    """Rows r0..r1-1, KV head g, over K / V (flat float32 arrays): position t of this slot
    and head at element base + (t - t0) * hd. sc: (G, span) scores scratch, ones: span
    ones, o: (G, hd) accumulators, den: (1 + G,) scratch (the sum, each head's max); sinks: (H,) sink logits, read when
    has_sinks."""
    N, H, hd = q.shape
    span = sc.shape[1]
    for r in range(r0, r1):
        lo, n = _window(r, lengths, window, out, g, G, hd)
        if n <= 0:
            continue
        kb = base + (lo - t0) * hd
        _scores(q, (r * H + g * G) * hd, K, kb, n, G, hd, sc, 0, span)
        _softmax(sc, n, g, G, scale, den, sinks, has_sinks)
        gi = 0
        while gi < G:
            if gi + 2 <= G:
                axpy(2, sc, gi * span, span, V, kb, hd, n, o, gi * hd, hd)
                gi += 2
            else:
                axpy(1, sc, gi * span, span, V, kb, hd, n, o, gi * hd, hd)
                gi += 1
        _normalize(sc, span, n, g, G, hd, o, ones, den, sinks, has_sinks, out, r)


CHUNK = 32   # float16 positions converted at a time by a one-row job (a tile that stays in L1)


@njit(cache=True, error_model="numpy")
def _rows_half_chunks(mode, q, kh, vh, base, t0, r0, r1, g, G, lengths, scale, window, out, sc, ones, o, den,
                      sinks, has_sinks, kt):
    """``_rows`` over a float16 cache (kh / vh: flat uint16) converting CHUNK positions at a
    time into kt (CHUNK * hd float32) instead of the job's whole span first: a decode row
    reads its history once, as float16, where the whole span's conversion wrote and read it
    again as float32 (5x the bytes past L2). The same arithmetic, bit for bit: the scores in
    the same groups of four (CHUNK is a multiple of 4), the weighted sum of V per element
    in increasing t with one fma per term from 0 (axpy's sum, here fma_row's). hd a
    multiple of 8."""
    _, H, hd = q.shape
    span = sc.shape[1]
    for r in range(r0, r1):
        lo, n = _window(r, lengths, window, out, g, G, hd)
        if n <= 0:
            continue
        kb = base + (lo - t0) * hd
        for c0 in range(0, n, CHUNK):
            cn = min(CHUNK, n - c0)
            h2f(mode, kh, kb + c0 * hd, kt, 0, cn * hd)
            _scores(q, (r * H + g * G) * hd, kt, 0, cn, G, hd, sc, c0, span)
        _softmax(sc, n, g, G, scale, den, sinks, has_sinks)
        o[:, :] = 0.0
        for c0 in range(0, n, CHUNK):
            cn = min(CHUNK, n - c0)
            h2f(mode, vh, kb + c0 * hd, kt, 0, cn * hd)
            _weigh_chunk(sc, c0, cn, G, kt, 0, hd, o)
        _normalize(sc, span, n, g, G, hd, o, ones, den, sinks, has_sinks, out, r)


@njit(cache=True, inline="always", error_model="numpy")
def _job(p, starts, slots, lengths, KV, window, n_ctx):
    """Job p of the prange: (first row, end row, slot, KV head, lo_min, span). Jobs are
    interleaved short with long (a causal prefill's rows grow) so that numba's static
    split of the range gives each thread a similar share of the work."""
    nj = (starts.shape[0] - 1) * KV
    j = p // 2 if p % 2 == 0 else nj - 1 - p // 2
    bi = j // KV
    g = j % KV
    r0, r1 = starts[bi], starts[bi + 1]
    lo_min = n_ctx
    hi_max = 0
    for r in range(r0, r1):
        L = lengths[r]
        lo = L - window if window > 0 and L > window else 0
        lo_min = min(lo_min, lo)
        hi_max = max(hi_max, L)
    return r0, r1, slots[r0], g, lo_min, max(hi_max - lo_min, 0)


@njit(cache=True, inline="always", error_model="numpy")
def _run_job_half(p, starts, mode, q, kflat, vflat, slots, lengths, scale, window, out, KV, n_ctx, sinks,
                  has_sinks):
    """Job p over a float16 cache: a block of rows of one slot against one KV head, its K/V
    range converted to float32 first (exactly), then ``_rows``; a job of one row (decode)
    converts by chunks instead (``_rows_half_chunks``: the same bits)."""
    N, H, hd = q.shape
    G = H // KV
    r0, r1, s, g, lo_min, span = _job(p, starts, slots, lengths, KV, window, n_ctx)
    sc = np.empty((G, max(span, 1)), np.float32)
    ones = np.ones(max(span, 1), np.float32)
    o = np.empty((G, hd), np.float32)
    den = np.empty(1 + G, np.float32)
    head0 = ((s * KV + g) * n_ctx + lo_min) * hd
    if r1 - r0 == 1 and hd % 8 == 0:     # one row (decode): its history read once, by chunks
        kt = np.empty(CHUNK * hd, np.float32)
        _rows_half_chunks(mode, q, kflat, vflat, head0, lo_min, r0, r1, g, G, lengths, scale, window, out, sc, ones,
                          o, den, sinks, has_sinks, kt)
        return
    kf = np.empty(max(span, 1) * hd, np.float32)
    vf = np.empty(max(span, 1) * hd, np.float32)
    h2f(mode, kflat, head0, kf, 0, span * hd)
    h2f(mode, vflat, head0, vf, 0, span * hd)
    _rows(q, kf, vf, 0, lo_min, r0, r1, g, G, lengths, scale, window, out, sc, ones, o, den, sinks, has_sinks)


@njit(cache=True, inline="always", error_model="numpy")
def _run_job_f32(p, starts, q, kflat, vflat, slots, lengths, scale, window, out, KV, n_ctx, sinks, has_sinks):
    """Job p over a float32 cache: ``_rows`` reads the cache in place."""
    N, H, hd = q.shape
    G = H // KV
    r0, r1, s, g, lo_min, span = _job(p, starts, slots, lengths, KV, window, n_ctx)
    sc = np.empty((G, max(span, 1)), np.float32)
    ones = np.ones(max(span, 1), np.float32)
    o = np.empty((G, hd), np.float32)
    den = np.empty(1 + G, np.float32)
    head0 = ((s * KV + g) * n_ctx + lo_min) * hd
    _rows(q, kflat, vflat, head0, lo_min, r0, r1, g, G, lengths, scale, window, out, sc, ones, o, den, sinks,
          has_sinks)


# One kernel per cache type and per threading: each compiles only the path it runs (a kernel
# taking both cache types compiled ``_rows`` for both, one of them never run), and the
# serial ones are the threaded ones' twins (warmup.py). Their arguments are attention_rows'
# kernel's (``kernel_for``); ``half`` is implied by the kernel and not read.

@njit(cache=True, parallel=True, error_model="numpy")
def _attention_parallel(mode, q, kc, vc, slots, lengths, scale, window, out, half, sinks, has_sinks):
    """attention_rows' kernel over a float16 cache, jobs over the threads."""
    n_slots, KV, n_ctx, _ = kc.shape
    starts = _blocks(slots, q.shape[0])
    kflat = kc.reshape(-1)
    vflat = vc.reshape(-1)
    for p in prange((starts.shape[0] - 1) * KV):
        _run_job_half(p, starts, mode, q, kflat, vflat, slots, lengths, scale, window, out, KV, n_ctx, sinks,
                      has_sinks)


@njit(cache=True, error_model="numpy")
def _attention_serial(mode, q, kc, vc, slots, lengths, scale, window, out, half, sinks, has_sinks):
    """attention_rows' kernel over a float16 cache on the calling thread (the same jobs, in order)."""
    n_slots, KV, n_ctx, _ = kc.shape
    starts = _blocks(slots, q.shape[0])
    kflat = kc.reshape(-1)
    vflat = vc.reshape(-1)
    for p in range((starts.shape[0] - 1) * KV):
        _run_job_half(p, starts, mode, q, kflat, vflat, slots, lengths, scale, window, out, KV, n_ctx, sinks,
                      has_sinks)


@njit(cache=True, parallel=True, error_model="numpy")
def _attention_parallel_f32(mode, q, kc, vc, slots, lengths, scale, window, out, half, sinks, has_sinks):
    """attention_rows' kernel over a float32 cache, jobs over the threads."""
    n_slots, KV, n_ctx, _ = kc.shape
    starts = _blocks(slots, q.shape[0])
    kflat = kc.reshape(-1)
    vflat = vc.reshape(-1)
    for p in prange((starts.shape[0] - 1) * KV):
        _run_job_f32(p, starts, q, kflat, vflat, slots, lengths, scale, window, out, KV, n_ctx, sinks, has_sinks)


@njit(cache=True, error_model="numpy")
def _attention_serial_f32(mode, q, kc, vc, slots, lengths, scale, window, out, half, sinks, has_sinks):
    """attention_rows' kernel over a float32 cache on the calling thread (the same jobs, in order)."""
    n_slots, KV, n_ctx, _ = kc.shape
    starts = _blocks(slots, q.shape[0])
    kflat = kc.reshape(-1)
    vflat = vc.reshape(-1)
    for p in range((starts.shape[0] - 1) * KV):
        _run_job_f32(p, starts, q, kflat, vflat, slots, lengths, scale, window, out, KV, n_ctx, sinks, has_sinks)


# Below this many multiply-adds attention runs on the calling thread (decode at short
# context: a parallel region's fork / join would cost more than it saves).
PARALLEL_MACS = 500_000


NO_SINKS = np.zeros(1, np.float32)   # the sinks argument of a kernel without sinks


def attention_rows(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray,
                   lengths: np.ndarray, scale: float, window: int, out: np.ndarray,
                   sinks: np.ndarray | None = None) -> np.ndarray:
    """Every row attends to its slot's cached positions (the module docstring's order).

    q: (N, H, hd) float32; k_cache, v_cache: (n_slots, KV, n_ctx, hd) float32, or uint16
    float16 bit patterns (both the same dtype), C-contiguous, already holding this
    batch's K/V; slots, lengths: (N,) int32 - row i reads positions
    [max(0, lengths[i] - window) if window > 0 else 0, lengths[i]) of slot slots[i];
    scale: the score scale (> 0; 1/sqrt(hd) usually); out: (N, H, hd) float32, written;
    sinks: None, or (H,) float32 attention-sink logits (gpt-oss; not scaled): head h's
    softmax denominator also holds exp(sinks[h] - m), m the max over the scores and the
    sink. H must be a multiple of KV. Returns out."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (np.float32, np.uint16):
        raise ValueError(f"KV cache dtype must be float32 or uint16 (float16 bits), got {k_cache.dtype}/{v_cache.dtype}")
    has_sinks = sinks is not None
    sinks = checked_sinks(scale, sinks, q.shape[1])
    n = q.shape[0]
    if n:
        lengths = np.ascontiguousarray(lengths, np.int32)
        run = kernel_for(attended_keys(lengths, window), q.shape[1], q.shape[2], k_cache.dtype == np.uint16)
        run(cpu_fdot.HOST_F16, np.ascontiguousarray(q, np.float32), k_cache, v_cache,
            np.ascontiguousarray(slots, np.int32), lengths, np.float32(scale), int(window), out,
            k_cache.dtype == np.uint16, sinks, has_sinks)
    return out


def checked_sinks(scale: float, sinks: np.ndarray | None, n_heads: int) -> np.ndarray:
    """The kernels' sinks argument ((H,) float32, or NO_SINKS), after the checks the kernels
    do not make: a positive scale, one sink per head. Raises ValueError."""
    if not scale > 0:
        raise ValueError(f"attention scale must be positive, got {scale}")
    if sinks is None:
        return NO_SINKS
    sinks = np.ascontiguousarray(sinks, np.float32).reshape(-1)
    if sinks.shape[0] != n_heads:
        raise ValueError(f"sinks has {sinks.shape[0]} entries for {n_heads} heads")
    return sinks


def attended_keys(lengths: np.ndarray, window: int) -> int:
    """How many (row, position) pairs a batch with these lengths attends to."""
    return int(lengths.sum()) if window <= 0 else int(np.minimum(lengths, window).sum())


def kernel_for(keys: int, n_heads: int, head_dim: int, half: bool):
    """The compiled kernel attention_rows runs for ``keys`` attended pairs over a float16
    (``half``) or float32 cache: on the threads, or on the calling thread below
    PARALLEL_MACS or while the threaded kernels compile (warmup.py; the same jobs and
    arithmetic either way). Its arguments: (cpu_fdot.HOST_F16, q C-contiguous float32,
    k_cache, v_cache, slots int32, lengths int32, float32 scale, int window, out, half:
    bool, sinks float32 (H,) (or NO_SINKS), has_sinks); the caller has made the checks
    attention_rows makes."""
    threaded = keys * n_heads * head_dim * 2 >= PARALLEL_MACS and PARALLEL.ready
    if half:
        return _attention_parallel if threaded else _attention_serial
    return _attention_parallel_f32 if threaded else _attention_serial_f32


@njit(cache=True, error_model="numpy")
def store_f16(kc, vc, k, v, slots, positions):
    """``store_rows`` into a float16 (uint16 bits) cache, without its checks."""
    for r in range(k.shape[0]):
        s, p = slots[r], positions[r]
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                kc[s, h, p, d] = f2h_bits(k[r, h, d])
                vc[s, h, p, d] = f2h_bits(v[r, h, d])


@njit(cache=True, error_model="numpy")
def store_f32(kc, vc, k, v, slots, positions):
    """``store_rows`` into a float32 cache, without its checks."""
    for r in range(k.shape[0]):
        s, p = slots[r], positions[r]
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                kc[s, h, p, d] = k[r, h, d]
                vc[s, h, p, d] = v[r, h, d]


def store_rows(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray,
               positions: np.ndarray) -> None:
    """Row r of k, v ((N, KV, hd) float32, any strides) goes to position positions[r] of
    slot slots[r] of the caches (float32, or uint16 float16 bits rounded to nearest even as
    ``cpu_fdot.f32_to_f16``), in one call for the whole batch. Raises ValueError for a slot
    or position outside the cache (the kernels do not check)."""
    n_slots, _, n_ctx, _ = k_cache.shape
    slots = np.ascontiguousarray(slots, np.int32)
    positions = np.ascontiguousarray(positions, np.int32)
    if slots.size and (slots.min() < 0 or slots.max() >= n_slots or positions.min() < 0
                       or positions.max() >= n_ctx):
        raise ValueError(f"a row's slot or position lies outside the cache ({n_slots} slots of {n_ctx})")
    k = np.asarray(k, np.float32)
    v = np.asarray(v, np.float32)
    (store_f16 if k_cache.dtype == np.uint16 else store_f32)(k_cache, v_cache, k, v, slots, positions)
