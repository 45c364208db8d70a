"""Quantized KV caches on the CPU: llama.cpp's q8_0 and q4_0 blocks, stored and attended.

Owns: the block formats of a quantized KV cache row (``row_bytes``), the KV store that
quantizes each row's K and V (``store_q``: as llama.cpp's CPU backend quantizes its
``-ctk/-ctv q8_0 | q4_0`` caches), the exact dequantization (``dequantize``), and attention
over a quantized cache (``attention_q``). Leaves the cache's allocation to
``kvcache.CpuKVCache``, the float caches and the shared job layout to ``attention.py``.

Block formats (ggml's, so a slot's bytes are what llama.cpp holds and what capsules
copy): a head's row of ``head_dim`` values is ``head_dim / 32`` blocks of 32, each
    q8_0 (34 bytes): d float16, then 32 int8 q;          x = d * q
    q4_0 (18 bytes): d float16, then 16 bytes of nibbles; x[j] = d * (lo(qs[j]) - 8),
                     x[j + 16] = d * (hi(qs[j]) - 8)
Quantization, per block: q8_0 as ggml-cpu's x86 ``quantize_row_q8_0`` (amax = max |x|,
d = amax / 127, q = round-half-even(x * 127 / amax)); q4_0 as ``quantize_row_q4_0_ref``
(m = the value of largest magnitude, d = m / -8, q = min(15, trunc(x / d + 8.5))). d is
rounded to float16 (nearest even) for storage.

Rotation (llama.cpp since its PR 21038, on by default for a quantized cache): where the
head size is a multiple of 64, K and V are rotated by an orthonormal Walsh-Hadamard matrix
before they are quantized (``rotations``: K by the largest power of two from 64 up that
divides the head size, V by blocks of 64, as llama.cpp's ``attn_rot_k`` / ``attn_rot_v``),
the queries by K's, and each head's output is rotated back by V's (the matrices are
symmetric and their own inverse). Dot products and weighted sums do not change under an
orthonormal rotation; the outliers of a few channels are spread over the block, so a
32-value block's scale fits its values better. ``rotate`` applies one per row in a fixed
order (one fused multiply-add per term, inputs in increasing order).

Attention over a quantized cache is attention over its dequantized values, bit for bit:
d * q is exact in float32 (an 11-bit d times an integer of at most 8 bits), and the
kernel dequantizes K and V a chunk of ``CHUNK`` positions at a time into a small float32
tile (never the whole cache: the bytes read from memory are the quantized ones) and runs
``attention.py``'s arithmetic on it: the scores through ``fdot.dots`` in its fixed order,
the max and ``exp_nonpos``, the denominator, and V summed over positions in increasing
order with one fused multiply-add per term, as ``fdot.axpy`` does. So a row's output is
``rotate(attention_rows(rotate(q), dequantize(cache)))`` (without the rotations where the
head size has none), and batch invariance carries over.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from aotx.engine.backend.kvformat import BLOCK, BLOCK_BYTES, QUANT_TYPES, hadamard, row_bytes, rotations  # noqa: F401

from .attention import _blocks, _inv_den, _job, _scores, _softmax, _weigh_chunk, _window, attended_keys, checked_sinks
from .fdot import _widen, f2h_bits, fma32
from .llvm_ir import _ptr, _splat, _splat_value

KIND = {"q8_0": 0, "q4_0": 1}    # the kernels' argument
CHUNK = 32                       # positions dequantized at a time (a tile that stays in L1)
NO_ROTATION = np.zeros((1, 1), np.float32)   # the kernels' rotation argument when there is none


_F32, _I8, _I16, _I32 = ir.FloatType(), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V8I16, _V8F32 = ir.VectorType(_I16, 8), ir.VectorType(_F32, 8)
_V16I8, _V16F32 = ir.VectorType(_I8, 16), ir.VectorType(_F32, 16)
_V32I8, _V32F32 = ir.VectorType(_I8, 32), ir.VectorType(_F32, 32)


def _deq_codegen(context, builder, sig, args):
    kind = sig.args[0].literal_value
    intp = context.get_value_type(types.intp)
    _, src_ty, _, _, dst_ty, _ = sig.args
    _, src, off, nb, dst, doff = args
    bb = 34 if kind == 0 else 18
    sp = _ptr(builder, context, src_ty, src, off, _I8)
    dp = _ptr(builder, context, dst_ty, dst, doff, _F32)
    with cgutils.for_range(builder, nb, intp=intp) as loop:
        blk = builder.gep(sp, [builder.mul(loop.index, ir.Constant(intp, bb))])
        h = builder.load(builder.bitcast(blk, _I16.as_pointer()), align=1)
        d = builder.extract_element(_widen(builder, _splat_value(builder, _V8I16, h), "f16"), ir.Constant(_I32, 0))
        out = builder.gep(dp, [builder.mul(loop.index, ir.Constant(intp, BLOCK))])
        qp = builder.gep(blk, [ir.Constant(intp, 2)])
        if kind == 0:                          # d * q, q the 32 int8
            v = builder.load(builder.bitcast(qp, _V32I8.as_pointer()), align=1)
            f = builder.fmul(_splat_value(builder, _V32F32, d), builder.sitofp(v, _V32F32))
            builder.store(f, builder.bitcast(out, _V32F32.as_pointer()), align=4)
        else:                                  # d * (nibble - 8): low nibbles the first 16, high the rest
            v = builder.load(builder.bitcast(qp, _V16I8.as_pointer()), align=1)
            halves = (builder.and_(v, _splat(_V16I8, 15)), builder.lshr(v, _splat(_V16I8, 4)))
            for k, part in enumerate(halves):
                f = builder.fsub(builder.uitofp(part, _V16F32), _splat(_V16F32, 8.0))
                f = builder.fmul(_splat_value(builder, _V16F32, d), f)
                builder.store(f, builder.bitcast(builder.gep(out, [ir.Constant(intp, 16 * k)]),
                                                 _V16F32.as_pointer()), align=4)
    return context.get_dummy_value()


@intrinsic(prefer_literal=True)
def deq_blocks(typingctx, kind, src, off, nb, dst, doff):
    """deq_blocks(kind, src, off, nb, dst, doff): the ``nb`` blocks at byte ``off`` of src
    (uint8) dequantized into dst[doff : doff + 32 nb] (float32): kind (a literal) 0 for
    q8_0, 1 for q4_0. d * q, exact in float32; d converted exactly (F16C's vcvtph2ps where
    the CPU has it, integer operations elsewhere)."""
    if not isinstance(kind, types.IntegerLiteral) or kind.literal_value not in (0, 1):
        raise TypeError("deq_blocks: kind must be a literal 0 (q8_0) or 1 (q4_0)")
    return types.void(kind, src, off, nb, dst, doff), _deq_codegen


@njit(cache=True, inline="always", error_model="numpy")
def _quant_block(x, xo, out, oo, kind):
    """The 32 values x[xo:xo+32] (float32) -> one block at out[oo:] (uint8)."""
    if kind == 0:
        amax = np.float32(0.0)
        for j in range(BLOCK):
            amax = max(amax, abs(x[xo + j]))
        d = amax / np.float32(127.0)
        iv = np.float32(127.0) / amax if amax != np.float32(0.0) else np.float32(0.0)
        h = f2h_bits(d)
        out[oo] = np.uint8(h & np.uint16(0xFF))
        out[oo + 1] = np.uint8(h >> np.uint16(8))
        for j in range(BLOCK):
            out[oo + 2 + j] = np.uint8(np.int32(np.rint(x[xo + j] * iv)) & 0xFF)
    else:
        amax = np.float32(0.0)
        mx = np.float32(0.0)
        for j in range(BLOCK):
            v = x[xo + j]
            if amax < abs(v):
                amax = abs(v)
                mx = v
        d = mx / np.float32(-8.0)
        iv = np.float32(1.0) / d if d != np.float32(0.0) else np.float32(0.0)
        h = f2h_bits(d)
        out[oo] = np.uint8(h & np.uint16(0xFF))
        out[oo + 1] = np.uint8(h >> np.uint16(8))
        for j in range(16):
            a = min(15, np.int32(x[xo + j] * iv + np.float32(8.5)))
            b = min(15, np.int32(x[xo + 16 + j] * iv + np.float32(8.5)))
            out[oo + 2 + j] = np.uint8(a | (b << 4))


@njit(cache=True, inline="always", error_model="numpy")
def _dequant(src, si, off, n_rows, rb, hd, kind, dst):
    """``n_rows`` rows of blocks from byte ``off`` of ``src`` (uint8; ``si`` the same
    bytes as int8, unused) -> dst[0 : n_rows * hd] float32, exactly (a row's blocks are
    consecutive: one ``deq_blocks`` call)."""
    if kind == 0:
        deq_blocks(0, src, off, n_rows * (hd // BLOCK), dst, 0)
    else:
        deq_blocks(1, src, off, n_rows * (hd // BLOCK), dst, 0)


@njit(cache=True, inline="always", error_model="numpy")
def _rotate(x, xo, hd, R, out, oo):
    """out[oo + j] = sum over i, in increasing order, of x[xo + i] * R[i, j] within each
    block of R's size (one fused multiply-add per term, from 0)."""
    n = R.shape[0]
    for b in range(hd // n):
        for j in range(n):
            out[oo + b * n + j] = np.float32(0.0)
        for i in range(n):
            xi = x[xo + b * n + i]
            for j in range(n):
                out[oo + b * n + j] = fma32(xi, R[i, j], out[oo + b * n + j])


@njit(cache=True, error_model="numpy")
def _store_q(kc, vc, k, v, slots, positions, kind, rk, rv, rot):
    """Row r of k, v ((N, KV, hd) float32) -> its slot and position of the caches
    ((n_slots, KV, n_ctx, row_bytes) uint8), rotated (``rot``: by rk, rv) and quantized."""
    bb = 34 if kind == 0 else 18
    hd = k.shape[2]
    tk = np.empty(hd, np.float32)
    tv = np.empty(hd, np.float32)
    for r in range(k.shape[0]):
        s, p = slots[r], positions[r]
        for h in range(k.shape[1]):
            kr = k[r, h]
            vr = v[r, h]
            if rot:
                _rotate(kr, 0, hd, rk, tk, 0)
                _rotate(vr, 0, hd, rv, tv, 0)
            else:
                for d in range(hd):
                    tk[d] = kr[d]
                    tv[d] = vr[d]
            ko = kc[s, h, p]
            vo = vc[s, h, p]
            for b in range(hd // BLOCK):
                _quant_block(tk, b * BLOCK, ko, b * bb, kind)
                _quant_block(tv, b * BLOCK, vo, b * bb, kind)


def _rot_args(head_dim: int, rotate: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    r = rotations(head_dim) if rotate else None
    return (r[0], r[1], True) if r is not None else (NO_ROTATION, NO_ROTATION, False)


def store_q(k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray,
            positions: np.ndarray, kv_type: str, rotate: bool = True) -> None:
    """Quantize row r of k, v ((N, KV, hd) float32) into position positions[r] of slot
    slots[r] of the caches ((n_slots, KV, n_ctx, row_bytes) uint8), as llama.cpp's CPU
    backend stores a ``kv_type`` cache (rotated first where ``rotations`` has one, unless
    ``rotate`` is False). The caller has checked the slots and positions."""
    k = np.asarray(k, np.float32)
    _store_q(k_cache, v_cache, k, np.asarray(v, np.float32), np.ascontiguousarray(slots, np.int32),
             np.ascontiguousarray(positions, np.int32), KIND[kv_type], *_rot_args(k.shape[2], rotate))


def rotate(x: np.ndarray, R: np.ndarray) -> np.ndarray:
    """(..., hd) float32 rows times ``R`` per block of its size, in the kernels' order."""
    x = np.ascontiguousarray(x, np.float32)
    flat = x.reshape(-1)
    out = np.empty_like(flat)
    _rotate_rows(flat, x.shape[-1], R, out)
    return out.reshape(x.shape)


@njit(cache=True, error_model="numpy")
def _rotate_rows(x, hd, R, out):
    for r in range(x.shape[0] // hd):
        _rotate(x, r * hd, hd, R, out, r * hd)


def quantize(x: np.ndarray, kv_type: str) -> np.ndarray:
    """(..., hd) float32 -> (..., row_bytes) uint8 blocks (the store's quantization,
    without its rotation)."""
    x = np.ascontiguousarray(x, np.float32)
    hd = x.shape[-1]
    rows = x.reshape(-1, 1, 1, hd)
    out = np.zeros((rows.shape[0], 1, 1, row_bytes(kv_type, hd)), np.uint8)
    idx = np.arange(rows.shape[0], dtype=np.int32)
    _store_q(out, np.zeros_like(out), rows[:, 0], rows[:, 0], idx, np.zeros_like(idx), KIND[kv_type], NO_ROTATION,
             NO_ROTATION, False)
    return out.reshape(x.shape[:-1] + (out.shape[-1],))


def dequantize(blocks: np.ndarray, kv_type: str, head_dim: int) -> np.ndarray:
    """(..., row_bytes) uint8 blocks -> (..., head_dim) float32, exactly."""
    b = np.ascontiguousarray(blocks, np.uint8)
    rb = row_bytes(kv_type, head_dim)
    flat = b.reshape(-1)
    n = flat.shape[0] // rb
    out = np.empty(n * head_dim, np.float32)
    _dequant(flat, flat.view(np.int8), 0, n, rb, head_dim, KIND[kv_type], out)
    return out.reshape(b.shape[:-1] + (head_dim,))


# ------------------------------------------------------------------ attention


@njit(cache=True, error_model="numpy")
def _rows_q(q, qs, qh, K, Ki, V, Vi, base, t0, r0, r1, g, G, lengths, scale, window, out, sc, ones, o, den,
            sinks, has_sinks, kt, rb, kind, rv, rot, whole, KF, VF):
    """``attention._rows`` over a quantized cache: rows r0..r1-1, KV head g; row r's query
    head g * G + gi at flat element (r - r0) * qs + qh + gi * hd of q; position t of this
    slot and head starts at byte base + (t - t0) * rb of K / V (uint8; Ki / Vi the same bytes
    as int8). kt: (CHUNK * hd) float32 tile. ``rot``: each head's output rotated back by rv.
    ``whole``: KF / VF hold the job's whole span dequantized already (position t at element
    (t - t0) * hd: a prefill's rows share it instead of each dequantizing it again), read in
    the same chunks with the same arithmetic."""
    N, H, hd = out.shape
    span = sc.shape[1]
    for r in range(r0, r1):
        lo, n = _window(r, lengths, window, out, g, G, hd)
        if n <= 0:
            continue
        kb = base + (lo - t0) * rb
        q0 = (r - r0) * qs + qh
        for c0 in range(0, n, CHUNK):
            cn = min(CHUNK, n - c0)
            if whole:
                kk, ko = KF, (lo - t0 + c0) * hd
            else:
                _dequant(K, Ki, kb + c0 * rb, cn, rb, hd, kind, kt)
                kk, ko = kt, 0
            _scores(q, q0, kk, ko, cn, G, hd, sc, c0, span)
        _softmax(sc, n, g, G, scale, den, sinks, has_sinks)
        o[:, :] = 0.0
        for c0 in range(0, n, CHUNK):
            cn = min(CHUNK, n - c0)
            if whole:
                vv, vo = VF, (lo - t0 + c0) * hd
            else:
                _dequant(V, Vi, kb + c0 * rb, cn, rb, hd, kind, kt)
                vv, vo = kt, 0
            _weigh_chunk(sc, c0, cn, G, vv, vo, hd, o)
        for gi in range(G):
            inv = _inv_den(sc, span, n, g, G, gi, ones, den, sinks, has_sinks)
            h = g * G + gi
            if rot:                          # back from the rotated space: o * inv, times rv
                for d in range(hd):
                    kt[d] = o[gi, d] * inv
                _rotate(kt, 0, hd, rv, out[r, h], 0)
            else:
                for d in range(hd):
                    out[r, h, d] = o[gi, d] * inv


@njit(cache=True, inline="always", error_model="numpy")
def _run_job_q(p, starts, q, K, Ki, V, Vi, slots, lengths, scale, window, out, KV, n_ctx, sinks, has_sinks, rb,
               kind, rk, rv, rot):
    N, H, hd = q.shape
    G = H // KV
    r0, r1, s, g, lo_min, span = _job(p, starts, slots, lengths, KV, window, n_ctx)
    sc = np.empty((G, max(span, 1)), np.float32)
    ones = np.ones(max(span, 1), np.float32)
    o = np.empty((G, hd), np.float32)
    den = np.empty(1 + G, np.float32)
    kt = np.empty(CHUNK * hd, np.float32)
    head0 = ((s * KV + g) * n_ctx + lo_min) * rb
    whole = r1 - r0 > 1                  # several rows (a prefill): the span dequantized once for all
    KF = np.empty(span * hd if whole else 1, np.float32)
    VF = np.empty(span * hd if whole else 1, np.float32)
    if whole:
        _dequant(K, Ki, head0, span, rb, hd, kind, KF)
        _dequant(V, Vi, head0, span, rb, hd, kind, VF)
    if rot:   # the job's query heads, rotated as K was
        qr = np.empty((r1 - r0) * G * hd, np.float32)
        qf = q.reshape(-1)
        for r in range(r0, r1):
            for gi in range(G):
                _rotate(qf, (r * H + g * G + gi) * hd, hd, rk, qr, ((r - r0) * G + gi) * hd)
        _rows_q(qr, G * hd, 0, K, Ki, V, Vi, head0, lo_min, r0, r1, g, G, lengths, scale, window, out, sc, ones, o,
                den, sinks, has_sinks, kt, rb, kind, rv, rot, whole, KF, VF)
    else:
        _rows_q(q.reshape(-1)[r0 * H * hd:], H * hd, g * G * hd, K, Ki, V, Vi, head0, lo_min, r0, r1, g, G, lengths,
                scale, window, out, sc, ones, o, den, sinks, has_sinks, kt, rb, kind, rv, rot, whole, KF, VF)


@njit(cache=True, parallel=True, error_model="numpy")
def _attention_q_parallel(q, kc, vc, slots, lengths, scale, window, out, sinks, has_sinks, kind, rk, rv, rot):
    n_slots, KV, n_ctx, rb = kc.shape
    starts = _blocks(slots, q.shape[0])
    K, V = kc.reshape(-1), vc.reshape(-1)
    Ki, Vi = K.view(np.int8), V.view(np.int8)
    for p in prange((starts.shape[0] - 1) * KV):
        _run_job_q(p, starts, q, K, Ki, V, Vi, slots, lengths, scale, window, out, KV, n_ctx, sinks, has_sinks, rb,
                   kind, rk, rv, rot)


@njit(cache=True, error_model="numpy")
def _attention_q_serial(q, kc, vc, slots, lengths, scale, window, out, sinks, has_sinks, kind, rk, rv, rot):
    n_slots, KV, n_ctx, rb = kc.shape
    starts = _blocks(slots, q.shape[0])
    K, V = kc.reshape(-1), vc.reshape(-1)
    Ki, Vi = K.view(np.int8), V.view(np.int8)
    for p in range((starts.shape[0] - 1) * KV):
        _run_job_q(p, starts, q, K, Ki, V, Vi, slots, lengths, scale, window, out, KV, n_ctx, sinks, has_sinks, rb,
                   kind, rk, rv, rot)


def kernel_for_q(keys: int, n_heads: int, head_dim: int):
    """The compiled kernel ``attention_q`` runs for ``keys`` attended pairs (on the threads,
    or on the calling thread below ``attention.PARALLEL_MACS``; the same arithmetic). Its
    arguments: (q C-contiguous float32, k_cache, v_cache, slots int32, lengths int32,
    float32 scale, int window, out, sinks, has_sinks, kind: ``KIND[kv_type]``, rk, rv, rot:
    the rotations, ``NO_ROTATION`` twice and False without)."""
    from .attention import PARALLEL_MACS

    return _attention_q_parallel if keys * n_heads * head_dim * 2 >= PARALLEL_MACS else _attention_q_serial


def attention_q(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, slots: np.ndarray, lengths: np.ndarray,
                scale: float, window: int, out: np.ndarray, kv_type: str, sinks: np.ndarray | None = None,
                rotate: bool = True) -> np.ndarray:
    """``attention.attention_rows`` over a quantized cache (``kv_type`` q8_0 or q4_0;
    k_cache, v_cache: (n_slots, KV, n_ctx, row_bytes) uint8, C-contiguous, stored by
    ``store_q`` with the same ``rotate``). The same result, bit for bit, as
    ``rotate(attention_rows(rotate(q, rk), dequantize(k_cache), dequantize(v_cache)), rv)``
    with (rk, rv) = ``rotations(hd)``, or without the rotations where there are none.
    Returns out."""
    if k_cache.dtype != np.uint8 or v_cache.dtype != np.uint8:
        raise ValueError(f"a {kv_type} KV cache holds uint8 blocks, got {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.shape[-1] != row_bytes(kv_type, q.shape[2]):
        raise ValueError(f"a {kv_type} row of head size {q.shape[2]} is {row_bytes(kv_type, q.shape[2])} bytes, the "
                         f"cache's are {k_cache.shape[-1]}")
    has_sinks = sinks is not None
    sinks = checked_sinks(scale, sinks, q.shape[1])
    if q.shape[0]:
        lengths = np.ascontiguousarray(lengths, np.int32)
        run = kernel_for_q(attended_keys(lengths, window), q.shape[1], q.shape[2])
        run(np.ascontiguousarray(q, np.float32), k_cache, v_cache, np.ascontiguousarray(slots, np.int32), lengths,
            np.float32(scale), int(window), out, sinks, has_sinks, KIND[kv_type], *_rot_args(q.shape[2], rotate))
    return out

