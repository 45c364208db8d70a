"""Fixed-order float32 dot products and float16 conversion for the CPU kernels.

Owns: `dots`, a numba intrinsic (LLVM IR) that computes a small tile of float32 dot
products (up to 2 x 4), each in ONE documented order; `axpy`, weighted sums of rows
(attention's V step) in one documented order; `exp_nonpos`; `f16_to_f32`, float16 bit patterns
(uint16: numba has no float16) to float32 with F16C's vcvtph2ps where the CPU has it and
exact integer bit manipulation elsewhere; `f32_to_f16` (round to nearest even) and `f2h_bits`,
its scalar form for kernels (the KV store). Used by
the attention kernel (`attention.py`) and the float matmul path (`cpu/matmul.py`).
Leaves to others: everything about layouts and which rows meet.

The order of a dot product of n elements (n any length), `dots`:
    lane l (0..7) accumulates a[8c + l] * b[8c + l] for c = 0, 1, ... in order, one
    fused multiply-add each (acc_l = fma(a, b, acc_l); the last n % 8 elements go to
    lanes 0 .. n % 8 - 1), then ((acc_0 + acc_1) + (acc_2 + acc_3)) + ((acc_4 + acc_5) +
    (acc_6 + acc_7)) (vhaddps' pairing, so that 8 dot products reduce together).
Every operation is one IEEE float32 operation (llvm.fma rounds once; no fast-math flags:
no contraction, no reassociation), so the result depends only on the two vectors - not
on how many dot products share a call, which CPU runs it, or what else is in the batch.
(llvm.fma is vfmadd on every CPU with AVX2; elsewhere it is computed exactly in
software: slower, the same bits.)
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from aotx.engine.backend.cpu.llvm_ir import _features, _h2f_bits, _ptr, _splat, _splat_value, bits_f32

_F32 = ir.FloatType()
_I16, _I32 = ir.IntType(16), ir.IntType(32)
_V8F32 = ir.VectorType(_F32, 8)
_V4F32 = ir.VectorType(_F32, 4)
_V2F32 = ir.VectorType(_F32, 2)
_V8I16 = ir.VectorType(_I16, 8)
_V8I32 = ir.VectorType(_I32, 8)
_V8H = ir.VectorType(ir.HalfType(), 8)


def host_has_f16c() -> bool:
    """True when numba compiles for a CPU with F16C (vcvtph2ps / vcvtps2ph)."""
    return "f16c" in _features()


# markers (the numba type picks the code, as cpu_qdot's isa markers do)
F16C = np.uint8(1)
PORTABLE = np.int8(0)
HOST_F16 = F16C if host_has_f16c() else PORTABLE


def _fma_v(builder, a, b, c):
    ty = a.type
    name = "llvm.fma.v8f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ty, [ty] * 3), name)
    return builder.call(fn, [a, b, c])


def _pairsum(builder, a, b):
    """vhaddps semantics: [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7]."""
    ev = ir.Constant(ir.VectorType(_I32, 8), [0, 2, 8, 10, 4, 6, 12, 14])
    od = ir.Constant(ir.VectorType(_I32, 8), [1, 3, 9, 11, 5, 7, 13, 15])
    return builder.fadd(builder.shuffle_vector(a, b, ev), builder.shuffle_vector(a, b, od))


def _reduce4(builder, vs):
    """Up to 4 <8 x float> -> <4 x float> of their sums, each in the order
    ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) (missing inputs padded, ignored)."""
    vs = list(vs) + [vs[0]] * (4 - len(vs))
    h = _pairsum(builder, _pairsum(builder, vs[0], vs[1]), _pairsum(builder, vs[2], vs[3]))
    lo = builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3]))
    hi = builder.shuffle_vector(h, h, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7]))
    return builder.fadd(lo, hi)


def _dots_codegen(context, builder, sig, args):
    nq, nk = sig.args[0].literal_value, sig.args[1].literal_value
    intp = context.get_value_type(types.intp)
    _, _, q_ty, _, _, k_ty, _, _, _, o_ty, _, _ = sig.args
    _, _, q, q_off, q_stride, k, k_off, k_stride, n, out, o_off, o_stride = args

    def c(v):
        return ir.Constant(intp, v)

    kfmt = {types.float32: "f32", types.uint16: "f16", types.int16: "bf16"}[k_ty.dtype]
    kelt = _F32 if kfmt == "f32" else _I16
    qp = [_ptr(builder, context, q_ty, q, builder.add(q_off, builder.mul(q_stride, c(i))), _F32) for i in range(nq)]
    kp = [_ptr(builder, context, k_ty, k, builder.add(k_off, builder.mul(k_stride, c(j))), kelt) for j in range(nk)]
    accs = [[cgutils.alloca_once_value(builder, _splat(_V8F32, 0.0)) for _ in range(nk)] for _ in range(nq)]
    n8 = builder.sdiv(n, c(8))

    def vload(p, i):
        return builder.load(builder.bitcast(builder.gep(p, [i]), _V8F32.as_pointer()), align=4)

    def kload(p, i):
        if kfmt == "f32":
            return vload(p, i)
        h = builder.load(builder.bitcast(builder.gep(p, [i]), _V8I16.as_pointer()), align=2)
        return _widen(builder, h, kfmt)

    def kscalar(p, i):
        if kfmt == "f32":
            return builder.load(builder.gep(p, [i]))
        h = _splat_value(builder, _V8I16, builder.load(builder.gep(p, [i])))
        return builder.extract_element(_widen(builder, h, kfmt), ir.Constant(_I32, 0))

    with cgutils.for_range(builder, n8, intp=intp) as loop:
        e = builder.mul(loop.index, c(8))
        qv = [vload(p, e) for p in qp]
        kv = [kload(p, e) for p in kp]
        for i in range(nq):
            for j in range(nk):
                builder.store(_fma_v(builder, qv[i], kv[j], builder.load(accs[i][j])), accs[i][j])
    base = builder.mul(n8, c(8))
    with cgutils.for_range(builder, builder.sub(n, base), intp=intp) as loop:
        e = builder.add(base, loop.index)
        lane = builder.trunc(loop.index, _I32)
        qs = [builder.load(builder.gep(p, [e])) for p in qp]
        ks = [kscalar(p, e) for p in kp]
        for i in range(nq):
            for j in range(nk):
                a = builder.load(accs[i][j])
                t = _fma_v(builder, qs[i], ks[j], builder.extract_element(a, lane))
                builder.store(builder.insert_element(a, t, lane), accs[i][j])
    op = _ptr(builder, context, o_ty, out, o_off, _F32)
    for i in range(nq):
        sums = _reduce4(builder, [builder.load(a) for a in accs[i]])
        row = builder.mul(o_stride, c(i))
        for j in range(nk):
            builder.store(builder.extract_element(sums, ir.Constant(_I32, j)), builder.gep(op, [builder.add(row, c(j))]))
    return context.get_dummy_value()


@intrinsic(prefer_literal=True)
def dots(typingctx, nq, nk, q, q_off, q_stride, k, k_off, k_stride, n, out, o_off, o_stride):
    """dots(nq, nk, q, q_off, q_stride, k, k_off, k_stride, n, out, o_off, o_stride):
    for i < nq, j < nk (literals: nq 1..2, nk 1..4)
        out[o_off + i * o_stride + j] = dot(q[q_off + i q_stride :+ n], k[k_off + j k_stride :+ n])
    in the module docstring's order; q, out float32; k float32, or uint16 float16 bits, or
    int16 bfloat16 bits (converted exactly on load); flat element offsets (intp)."""
    for a, hi in ((nq, 2), (nk, 4)):
        if not isinstance(a, types.IntegerLiteral) or not 1 <= a.literal_value <= hi:
            raise TypeError("dots: nq must be a literal 1..2 and nk a literal 1..4")
    return types.void(nq, nk, q, q_off, q_stride, k, k_off, k_stride, n, out, o_off, o_stride), _dots_codegen


def _axpy_codegen(context, builder, sig, args):
    nq = sig.args[0].literal_value
    intp = context.get_value_type(types.intp)
    _, e_ty, _, _, v_ty, _, _, _, o_ty, _, _ = sig.args
    _, e, e_off, e_stride, v, v_off, hd, nt, out, o_off, o_stride = args

    def c(x):
        return ir.Constant(intp, x)

    ep = [_ptr(builder, context, e_ty, e, builder.add(e_off, builder.mul(e_stride, c(i))), _F32) for i in range(nq)]
    vp = _ptr(builder, context, v_ty, v, v_off, _F32)
    op = [_ptr(builder, context, o_ty, out, builder.add(o_off, builder.mul(o_stride, c(i))), _F32) for i in range(nq)]
    W = 8                                   # vectors of 8 per chunk of the output row

    def vptr(p, i):
        return builder.bitcast(builder.gep(p, [i]), _V8F32.as_pointer())

    nv = builder.sdiv(hd, c(8))
    with cgutils.for_range(builder, builder.sdiv(builder.add(nv, c(W - 1)), c(W)), intp=intp) as chunk:
        v0 = builder.mul(chunk.index, c(W))
        cnt = builder.sub(nv, v0)           # vectors in this chunk (<= W)
        accs = [[cgutils.alloca_once_value(builder, _splat(_V8F32, 0.0)) for _ in range(W)] for _ in range(nq)]
        with cgutils.for_range(builder, nt, intp=intp) as tl:
            t = tl.index
            w = [_splat_value(builder, _V8F32, builder.load(builder.gep(p, [t]))) for p in ep]
            row = builder.mul(t, hd)
            for u in range(W):
                ok = builder.icmp_signed("<", c(u), cnt)
                with builder.if_then(ok):
                    idx = builder.add(row, builder.mul(builder.add(v0, c(u)), c(8)))
                    vv = builder.load(vptr(vp, idx), align=4)
                    for i in range(nq):
                        builder.store(_fma_v(builder, w[i], vv, builder.load(accs[i][u])), accs[i][u])
        for u in range(W):
            ok = builder.icmp_signed("<", c(u), cnt)
            with builder.if_then(ok):
                idx = builder.mul(builder.add(v0, c(u)), c(8))
                for i in range(nq):
                    builder.store(builder.load(accs[i][u]), vptr(op[i], idx), align=4)
    # the hd % 8 tail, element by element, in the same order
    base = builder.mul(nv, c(8))
    with cgutils.for_range(builder, builder.sub(hd, base), intp=intp) as dl:
        d = builder.add(base, dl.index)
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_F32, 0.0)) for _ in range(nq)]
        with cgutils.for_range(builder, nt, intp=intp) as tl:
            vv = builder.load(builder.gep(vp, [builder.add(builder.mul(tl.index, hd), d)]))
            for i in range(nq):
                wt = builder.load(builder.gep(ep[i], [tl.index]))
                builder.store(_fma_v(builder, wt, vv, builder.load(accs[i])), accs[i])
        for i in range(nq):
            builder.store(builder.load(accs[i]), builder.gep(op[i], [d]))
    return context.get_dummy_value()


@intrinsic(prefer_literal=True)
def axpy(typingctx, nq, e, e_off, e_stride, v, v_off, hd, nt, out, o_off, o_stride):
    """axpy(nq, e, e_off, e_stride, v, v_off, hd, nt, out, o_off, o_stride): for i < nq
    (a literal 1..2) and d < hd,
        out[o_off + i o_stride + d] = sum over t < nt, in increasing t, of
                                      e[e_off + i e_stride + t] * v[v_off + t hd + d]
    accumulated from 0 with one fused multiply-add per term (the weighted sum of V rows).
    float32 arrays, flat element offsets (intp)."""
    if not isinstance(nq, types.IntegerLiteral) or not 1 <= nq.literal_value <= 2:
        raise TypeError("axpy: nq must be a literal 1..2")
    return types.void(nq, e, e_off, e_stride, v, v_off, hd, nt, out, o_off, o_stride), _axpy_codegen


def _fma_rows_codegen(context, builder, sig, args):
    intp = context.get_value_type(types.intp)
    _, src_ty, _, dst_ty, _, _ = sig.args
    w, src, soff, dst, doff, n = args
    sp = _ptr(builder, context, src_ty, src, soff, _F32)
    dp = _ptr(builder, context, dst_ty, dst, doff, _F32)
    wv = _splat_value(builder, _V8F32, w)
    with cgutils.for_range(builder, builder.sdiv(n, ir.Constant(intp, 8)), intp=intp) as loop:
        i = builder.mul(loop.index, ir.Constant(intp, 8))
        a = builder.bitcast(builder.gep(sp, [i]), _V8F32.as_pointer())
        o = builder.bitcast(builder.gep(dp, [i]), _V8F32.as_pointer())
        builder.store(_fma_v(builder, wv, builder.load(a, align=4), builder.load(o, align=4)), o, align=4)
    return context.get_dummy_value()


@intrinsic
def fma_row(typingctx, w, src, soff, dst, doff, n):
    """fma_row(w, src, soff, dst, doff, n): dst[doff + i] = fma(w, src[soff + i], dst[doff + i])
    for i < n (a multiple of 8), one rounding each: the weighted sum's step, 8 lanes at a time."""
    if w != types.float32:
        raise TypeError("fma_row: w must be float32")
    return types.void(w, src, soff, dst, doff, n), _fma_rows_codegen


@intrinsic
def fma32(typingctx, a, b, c):
    """fma32(a, b, c): a * b + c for float32 a, b, c, rounded once (llvm.fma.f32; a loop of
    them vectorizes to vfmadd)."""
    if not (a == b == c == types.float32):
        raise TypeError("fma32 takes three float32")

    def codegen(context, builder, sig, args):
        return _fma_v(builder, *args)

    return types.float32(a, b, c), codegen


# ------------------------------------------------------------------ float16

def _widen(builder, h16, fmt: str):
    """<8 x i16> float16 ("f16") or bfloat16 ("bf16") patterns -> <8 x float>, exact."""
    if fmt == "bf16":
        return builder.bitcast(builder.shl(builder.zext(h16, _V8I32), _splat(_V8I32, 16)), _V8F32)
    if host_has_f16c():
        return builder.fpext(builder.bitcast(h16, _V8H), _V8F32)
    return _h2f_bits(builder, h16)


def _h2f_codegen(context, builder, sig, args):
    f16c = sig.args[0] == types.uint8
    intp = context.get_value_type(types.intp)
    _, s_ty, _, d_ty, _, _ = sig.args
    _, src, s_off, dst, d_off, n = args
    sp = _ptr(builder, context, s_ty, src, s_off, _I16)
    dp = _ptr(builder, context, d_ty, dst, d_off, _F32)
    n8 = builder.sdiv(n, ir.Constant(intp, 8))

    def conv(hv):
        if f16c:
            return builder.fpext(builder.bitcast(hv, _V8H), _V8F32)
        return _h2f_bits(builder, hv)

    with cgutils.for_range(builder, n8, intp=intp) as loop:
        i = builder.mul(loop.index, ir.Constant(intp, 8))
        hv = builder.load(builder.bitcast(builder.gep(sp, [i]), _V8I16.as_pointer()), align=2)
        builder.store(conv(hv), builder.bitcast(builder.gep(dp, [i]), _V8F32.as_pointer()), align=4)
    base = builder.mul(n8, ir.Constant(intp, 8))
    with cgutils.for_range(builder, builder.sub(n, base), intp=intp) as loop:
        i = builder.add(base, loop.index)
        hv = _splat_value(builder, _V8I16, builder.load(builder.gep(sp, [i])))
        builder.store(builder.extract_element(conv(hv), ir.Constant(_I32, 0)), builder.gep(dp, [i]))
    return context.get_dummy_value()


@intrinsic
def h2f(typingctx, mode, src, s_off, dst, d_off, n):
    """h2f(mode, src, s_off, dst, d_off, n): dst[d_off + i] = float(src[s_off + i]) for
    i < n; src uint16 float16 patterns, dst float32, mode F16C or PORTABLE (exact both)."""
    if mode not in (types.uint8, types.int8):
        raise TypeError(f"h2f: mode must be cpu_fdot.F16C or PORTABLE, got {mode}")
    return types.void(mode, src, s_off, dst, d_off, n), _h2f_codegen


@njit(cache=True, parallel=True, error_model="numpy")
def _h2f_rows(mode, src, dst):
    n, k = src.shape
    for i in prange(n):
        h2f(mode, src, i * k, dst, i * k, k)


def f16_to_f32(bits: np.ndarray, mode=None) -> np.ndarray:
    """float16 bit patterns (any shape, uint16) -> float32 array of the same shape, exact
    (F16C's vcvtph2ps where the CPU has it; ``mode`` forces F16C or PORTABLE)."""
    bits = np.ascontiguousarray(bits, np.uint16)
    out = np.empty(bits.shape, np.float32)
    if bits.size:
        k = bits.shape[-1] if bits.ndim else 1
        _h2f_rows(HOST_F16 if mode is None else mode, bits.reshape(-1, k), out.reshape(-1, k))
    return out


def f32_to_f16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> float16 bit patterns (uint16), rounding to nearest, ties to even (IEEE
    754 roundTiesToEven, as vcvtps2ph with imm 0 and numpy's astype(float16) do);
    overflow gives +-inf. ``out``: an optional uint16 array of x's shape."""
    with np.errstate(over="ignore"):
        h = np.asarray(x, np.float32).astype(np.float16).view(np.uint16)
    if out is None:
        return h
    out[...] = h
    return out


@intrinsic
def f32_bits(typingctx, x):
    """The bit pattern of the float32 x, as a uint32 (a bitcast)."""
    if x != types.float32:
        raise TypeError("f32_bits takes a float32")

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)

    return types.uint32(x), codegen


@njit(cache=True, inline="always", error_model="numpy")
def f2h_bits(x):
    """float32 x -> float16 bits (a uint16), as ``f32_to_f16``: round to nearest, ties to
    even, overflow to +-inf, NaN stays NaN; for numba kernels (stores into a float16 KV
    cache without a numpy temporary)."""
    f = f32_bits(x)
    sign = (f >> np.uint32(16)) & np.uint32(0x8000)
    a = f & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x7F800000):                      # inf, NaN (keeps the payload's top bits)
        m = (a & np.uint32(0x7FFFFF)) >> np.uint32(13)
        if a > np.uint32(0x7F800000) and m == 0:
            m = np.uint32(1)
        return np.uint16(sign | np.uint32(0x7C00) | m)
    if a >= np.uint32(0x477FF000):                      # rounds to 65520 or more: inf
        return np.uint16(sign | np.uint32(0x7C00))
    if a < np.uint32(0x38800000):                       # below 2^-14: a float16 subnormal or zero
        if a < np.uint32(0x33000000):                   # at most 2^-25: rounds to zero
            return np.uint16(sign)
        shift = np.uint32(126) - (a >> np.uint32(23))   # 14 .. 24 bits dropped
        m = (a & np.uint32(0x7FFFFF)) | np.uint32(0x800000)
        q = m >> shift
        rem = m & ((np.uint32(1) << shift) - np.uint32(1))
        half = np.uint32(1) << (shift - np.uint32(1))
        if rem > half or (rem == half and (q & np.uint32(1)) != 0):
            q += np.uint32(1)
        return np.uint16(sign | q)
    q = (a - np.uint32(0x38000000)) >> np.uint32(13)    # normal: rebias, drop 13 bits
    rem = a & np.uint32(0x1FFF)
    if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (q & np.uint32(1)) != 0):
        q += np.uint32(1)                               # a carry into the exponent is right
    return np.uint16(sign | q)


# ------------------------------------------------------------------ exp

_EXP_LO = np.float32(-87.0)
_LOG2E = np.float32(1.44269504088896341)
_C1 = np.float32(0.693359375)
_C2 = np.float32(-2.12194440e-4)
_P0, _P1, _P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
_P3, _P4, _P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)


@njit(cache=True, inline="always", error_model="numpy")
def exp_nonpos(x):
    """exp(x) for float32 x <= 0 (softmax weights after subtracting the max), within 2 ulp
    of the true value, 1.0 exactly at 0, and exp(x) for x < -87 taken as exp(-87).
    Cephes' expf: x = n ln2 + r (ln2 in two parts), a degree-6 polynomial in r, times 2^n
    built from its bits. Plain float32 operations in a fixed order (no libm call, so the
    loops that use it vectorize, and every CPU gives the same bits)."""
    if x < _EXP_LO:
        x = _EXP_LO
    fx = np.floor(x * _LOG2E + np.float32(0.5))
    r = (x - fx * _C1) - fx * _C2
    z = r * r
    y = (((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5) * z + r + np.float32(1.0)
    return y * bits_f32(np.int32((np.int32(fx) + np.int32(127)) << np.int32(23)))
