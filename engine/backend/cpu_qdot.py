"""Integer dot-product kernels: quantized weights times int8-quantized activations.

Owns: `quantize_x` (activations to int8 per 32-block, as llama.cpp's Q8_1 does) and the
GEMV kernels `gemm_q4` / `gemm_q8` over the tiles that `cpu_matmul.repack` builds, with
their integer inner step written as LLVM IR (numba `intrinsic`): AVX2's
`vpmaddubsw` / `vpmaddwd` where the CPU has them, plain LLVM vector IR elsewhere. Leaves
to others: the weight layouts and choosing a kernel (`cpu_matmul.py`).

Arithmetic (the trade llama.cpp makes in ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0,
ggml/src/ggml-cpu/arch/x86/quants.c, helpers mul_sum_us8_pairs / mul_sum_i8_pairs):
* x row i, block b (32 inputs): dx = max|x| / 127, qx = round(x / dx) in [-127, 127]
  (int8), sx = sum of the float x, x8 = 8 * sum of qx (int32).
* Q4_0 / Q4_1 weights q in 0..15 with w = d * q + mn (mn = m for Q4_1, -8 d for Q4_0).
  With S = sum_j q_j qx_j - x8 = sum_j (q_j - 8) qx_j (an exact int32) and c = mn + 8 d:
      sum_j w_j x_j ~= d * (dx * S) + c * sx          (c = 0 exactly for Q4_0)
* Q8_0 weights q in -128..127 with w = d * q:  sum_j w_j x_j ~= d * (dx * S), S = sum q qx.
The only error against float arithmetic is the rounding of x to int8 (relative error of a
dot product ~1e-3..1e-2, the same as llama.cpp's).

Integer step, per 32-input block, 8 weight rows at a time, and NR = 1, 4 or 8 activation
rows sharing each weight load (the layout: cpu_matmul's module docstring):
* Q4: a 32-byte load holds 4 bytes of each of 8 rows; its low nibbles are inputs
  4g..4g+3 of a row and its high nibbles inputs 16+4g..16+4g+3. vpmaddubsw(nibbles as
  uint8, the 4 matching qx broadcast) gives, per int16 lane, q_a qx_a + q_b qx_b, at most
  2 * 15 * 127 = 3810 in magnitude, so it never saturates; the 8 such results of a block
  (4 loads x low/high) are added in int16: at most 8 * 3810 = 30480 < 32767, exact.
  One vpmaddwd against ones then sums the 2 lanes of each row into int32.
* Q8_0: the sign trick of llama.cpp's mul_sum_i8_pairs: vpmaddubsw(|q| as uint8,
  qx * sign(q)); a lane is at most 2 * 128 * 127 = 32512 < 32767 in magnitude, exact;
  each load's lanes go through vpmaddwd into int32 at once (two would overflow int16).
So the block sums S are exact integers whichever instructions compute them, and the
float step after them is numba code without fastmath (no reassociation, no FMA
contraction): a row's result is bit-identical on the AVX2 and the portable path, and
whatever number of other rows shares its batch (the decode path relies on it).
"""

from __future__ import annotations

import numpy as np
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

QB = 32      # inputs per quantization block
LANES = 8    # weight rows per integer step (one AVX2 register of int32)

# The kernels take an `isa` marker whose *type* picks the integer step's instructions:
# numba compiles (and caches) one specialization per argument type, so the AVX2 code is
# never compiled on a CPU without AVX2, and tests can run both paths on one that has it.
AVX2 = np.uint8(1)       # vpmaddubsw / vpmaddwd (llvm.x86.avx2.pmadd.ub.sw / pmadd.wd)
PORTABLE = np.int8(0)    # the same sums in generic LLVM vector IR (any target)


def host_has_avx2() -> bool:
    """True when numba compiles for a CPU with AVX2: llvmlite's host feature string, or,
    where NUMBA_CPU_NAME / NUMBA_CPU_FEATURES pick another target (portable caches), those."""
    from numba.core import config

    try:
        if config.CPU_NAME and config.CPU_NAME != "host":
            return "+avx2" in (config.CPU_FEATURES or "").split(",")
        return "+avx2" in llvm_binding.get_host_cpu_features().flatten().split(",")
    except Exception:           # noqa: BLE001 - a host LLVM cannot describe: stay portable
        return False


HOST_ISA = AVX2 if host_has_avx2() else PORTABLE


# ------------------------------------------------------------------ LLVM IR helpers

_I1, _I8, _I16, _I32 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32)
_V32I8 = ir.VectorType(_I8, 32)
_V32I16 = ir.VectorType(_I16, 32)
_V16I16 = ir.VectorType(_I16, 16)
_V16I32 = ir.VectorType(_I32, 16)
_V8I32 = ir.VectorType(_I32, 8)
_EVEN16 = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
_ODD16 = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))
_EVEN8 = ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2)))
_ODD8 = ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2)))


def _splat(ty: ir.VectorType, v: int) -> ir.Constant:
    return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)


def _ptr(builder, context, aryty, ary, off, elt: ir.Type):
    """Pointer to element `off` (intp, flat, in elements) of array `ary`, cast to elt*."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [off]), elt.as_pointer())


def _bcast4(builder, p8):
    """The 4 bytes at i8* p8 repeated 8 times: <32 x i8> (vpbroadcastd)."""
    v = builder.load(builder.bitcast(p8, _I32.as_pointer()), align=1)
    v8 = builder.insert_element(ir.Constant(_V8I32, ir.Undefined), v, ir.Constant(_I32, 0))
    v8 = builder.shuffle_vector(v8, ir.Constant(_V8I32, ir.Undefined), _splat(_V8I32, 0))
    return builder.bitcast(v8, _V32I8)


def _maddubs(builder, avx2: bool, u, s):
    """<16 x i16>: u[2l] * s[2l] + u[2l+1] * s[2l+1], u unsigned and s signed <32 x i8>.
    The callers' ranges never reach vpmaddubsw's saturation, so both forms agree."""
    if avx2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V16I16, [_V32I8, _V32I8]),
                                            "llvm.x86.avx2.pmadd.ub.sw")
        return builder.call(fn, [u, s])
    p = builder.mul(builder.zext(u, _V32I16), builder.sext(s, _V32I16))
    return builder.add(builder.shuffle_vector(p, p, _EVEN16), builder.shuffle_vector(p, p, _ODD16))


def _pairs32(builder, avx2: bool, a):
    """<8 x i32>: a[2l] + a[2l+1] for a <16 x i16> (vpmaddwd against ones)."""
    if avx2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8I32, [_V16I16, _V16I16]),
                                            "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [a, _splat(_V16I16, 1)])
    w = builder.sext(a, _V16I32)
    return builder.add(builder.shuffle_vector(w, w, _EVEN8), builder.shuffle_vector(w, w, _ODD8))


def _sign(builder, avx2: bool, x, q):
    """x * sign(q) per byte (0 where q = 0), x in [-127, 127] so it never overflows."""
    if avx2:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V32I8, [_V32I8, _V32I8]),
                                            "llvm.x86.avx2.psign.b")
        return builder.call(fn, [x, q])
    zero = _splat(_V32I8, 0)
    neg = builder.icmp_signed("<", q, zero)
    isz = builder.icmp_signed("==", q, zero)
    return builder.select(isz, zero, builder.select(neg, builder.sub(zero, x), x))


def _isa_is_avx2(isa_ty) -> bool:
    if isa_ty == types.uint8:
        return True
    if isa_ty == types.int8:
        return False
    raise TypeError(f"isa marker must be cpu_qdot.AVX2 (uint8) or PORTABLE (int8), got {isa_ty}")


def _splat_value(builder, vty: ir.VectorType, v):
    """A scalar IR value repeated over vty's lanes."""
    u = builder.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(u, ir.Constant(vty, ir.Undefined), _splat(ir.VectorType(_I32, vty.count), 0))


def _q4_block(builder, avx2: bool, wblk, xrows, intp):
    """Exact int32 block sums <8 x i32> per activation row: sum_j q_j qx_j over one Q4
    block (nibbles q in 0..15) of 8 weight rows. wblk: i8* to the block's group 0 for these
    rows (group stride 32 rows * 4 bytes); xrows: i8* to each row's 32 block inputs."""
    acc = [_splat(_V16I16, 0)] * len(xrows)
    for g in range(4):
        wv = builder.load(builder.bitcast(builder.gep(wblk, [ir.Constant(intp, g * 128)]),
                                          _V32I8.as_pointer()), align=1)
        lo = builder.and_(wv, _splat(_V32I8, 15))
        hi = builder.lshr(wv, _splat(_V32I8, 4))
        for ii, xr in enumerate(xrows):
            xa = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 4 * g)]))
            xb = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 16 + 4 * g)]))
            acc[ii] = builder.add(acc[ii], builder.add(_maddubs(builder, avx2, lo, xa),
                                                       _maddubs(builder, avx2, hi, xb)))
    return [_pairs32(builder, avx2, a) for a in acc]


def _q8_block(builder, avx2: bool, wblk, xrows, intp):
    """As _q4_block for a Q8_0 block (q signed, 8 groups of 4 bytes)."""
    out = [_splat(_V8I32, 0)] * len(xrows)
    zero = _splat(_V32I8, 0)
    for g in range(8):
        wv = builder.load(builder.bitcast(builder.gep(wblk, [ir.Constant(intp, g * 128)]),
                                          _V32I8.as_pointer()), align=1)
        aw = builder.select(builder.icmp_signed("<", wv, zero), builder.sub(zero, wv), wv)
        for ii, xr in enumerate(xrows):
            xa = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 4 * g)]))
            if avx2:
                p = _maddubs(builder, True, aw, _sign(builder, True, xa, wv))
            else:       # |q| = 128 does not fit a signed byte: multiply the signed bytes
                pr = builder.mul(builder.sext(wv, _V32I16), builder.sext(xa, _V32I16))
                p = builder.add(builder.shuffle_vector(pr, pr, _EVEN16), builder.shuffle_vector(pr, pr, _ODD16))
            out[ii] = builder.add(out[ii], _pairs32(builder, avx2, p))
    return out


def _make_lanes(kind: str, nr: int):
    """An intrinsic that computes 8 weight rows times nr activation rows over all nb
    blocks and stores acc[ii * 8 + r] (float32), for activation row ii and weight row r:
        Q4:   acc = sum over b, in order, of  d * (dx * (S - x8)) + (mn + 8 d) * sx
        Q8_0: acc = sum over b, in order, of  d * (dx * S)
    with S the exact int32 block sum (_q4_block / _q8_block), every float operation
    rounded to float32 on its own (fmul / fadd without fast-math flags: no FMA, no
    reassociation), so the result does not depend on `isa` or on nr.

    Q4 arguments: (isa, qs, w_off, d, mn, d_off, xq, x_off, dx, sx, x8, xs_off, nb, k, acc)
    Q8_0:         (isa, qs, w_off, d, d_off, xq, x_off, dx, xs_off, nb, k, acc)
    *_off are flat element offsets (intp) of block 0: w_off into qs (group 0, row r0),
    d_off into d / mn (row r0), x_off into xq (n, k) int8 (activation row 0 of the nr),
    xs_off into dx / sx / x8 (n, nb); block b adds b * 1024 (Q8_0) or 512 (Q4) to w_off,
    b * 32 to d_off and x_off, b to xs_off; activation row ii adds ii * k to x_off and
    ii * nb to xs_off."""
    q4 = kind == "q4"
    wstride = 512 if q4 else 1024

    def codegen(context, builder, signature, args):
        avx2 = _isa_is_avx2(signature.args[0])
        intp = context.get_value_type(types.intp)
        a = dict(zip(_Q4_ARGS if q4 else _Q8_ARGS, zip(signature.args, args)))

        def ptr(name, off, elt):
            ty, val = a[name]
            return _ptr(builder, context, ty, val, off, elt)

        nb, k = a["nb"][1], a["k"][1]
        w0 = ptr("qs", a["w_off"][1], _I8)
        d0 = ptr("d", a["d_off"][1], ir.FloatType())
        m0 = ptr("mn", a["d_off"][1], ir.FloatType()) if q4 else None
        x0 = ptr("xq", a["x_off"][1], _I8)
        fx0 = ptr("dx", a["xs_off"][1], ir.FloatType())
        sx0 = ptr("sx", a["xs_off"][1], ir.FloatType()) if q4 else None
        e0 = ptr("x8", a["xs_off"][1], _I32) if q4 else None
        out = ptr("acc", ir.Constant(intp, 0), _V8F32)
        slots = [cgutils.alloca_once_value(builder, _splat_f(0.0)) for _ in range(nr)]
        eight = _splat_f(8.0)
        with cgutils.for_range(builder, nb, intp=intp) as loop:
            b = loop.index
            wblk = builder.gep(w0, [builder.mul(b, ir.Constant(intp, wstride))])
            b32 = builder.mul(b, ir.Constant(intp, 32))
            xrows = [builder.gep(x0, [builder.add(b32, builder.mul(k, ir.Constant(intp, ii)))])
                     for ii in range(nr)]
            sums = (_q4_block if q4 else _q8_block)(builder, avx2, wblk, xrows, intp)
            dv = builder.load(builder.bitcast(builder.gep(d0, [b32]), _V8F32.as_pointer()), align=4)
            if q4:
                mv = builder.load(builder.bitcast(builder.gep(m0, [b32]), _V8F32.as_pointer()), align=4)
                cv = builder.fadd(mv, builder.fmul(eight, dv))
            for ii in range(nr):
                xi = builder.add(b, builder.mul(nb, ir.Constant(intp, ii)))
                f = _splat_value(builder, _V8F32, builder.load(builder.gep(fx0, [xi])))
                s = sums[ii]
                if q4:
                    s = builder.sub(s, _splat_value(builder, _V8I32, builder.load(builder.gep(e0, [xi]))))
                t = builder.fmul(dv, builder.fmul(f, builder.sitofp(s, _V8F32)))
                if q4:
                    g = _splat_value(builder, _V8F32, builder.load(builder.gep(sx0, [xi])))
                    t = builder.fadd(t, builder.fmul(cv, g))
                builder.store(builder.fadd(builder.load(slots[ii]), t), slots[ii])
        for ii in range(nr):
            builder.store(builder.load(slots[ii]), builder.gep(out, [ir.Constant(intp, ii)]), align=4)
        return context.get_dummy_value()

    if q4:
        @intrinsic
        def lanes(typingctx, isa, qs, w_off, d, mn, d_off, xq, x_off, dx, sx, x8, xs_off, nb, k, acc):
            _isa_is_avx2(isa)
            return types.void(isa, qs, w_off, d, mn, d_off, xq, x_off, dx, sx, x8, xs_off, nb, k, acc), codegen
    else:
        @intrinsic
        def lanes(typingctx, isa, qs, w_off, d, d_off, xq, x_off, dx, xs_off, nb, k, acc):
            _isa_is_avx2(isa)
            return types.void(isa, qs, w_off, d, d_off, xq, x_off, dx, xs_off, nb, k, acc), codegen
    return lanes


_Q4_ARGS = ("isa", "qs", "w_off", "d", "mn", "d_off", "xq", "x_off", "dx", "sx", "x8", "xs_off", "nb", "k", "acc")
_Q8_ARGS = ("isa", "qs", "w_off", "d", "d_off", "xq", "x_off", "dx", "xs_off", "nb", "k", "acc")
_V8F32 = ir.VectorType(ir.FloatType(), 8)


def _splat_f(v: float) -> ir.Constant:
    return ir.Constant(_V8F32, [ir.Constant(ir.FloatType(), v)] * 8)


_q4_x1 = _make_lanes("q4", 1)
_q4_x4 = _make_lanes("q4", 4)
_q4_x8 = _make_lanes("q4", 8)
_q8_x1 = _make_lanes("q8", 1)
_q8_x4 = _make_lanes("q8", 4)
_q8_x8 = _make_lanes("q8", 8)


# ------------------------------------------------------------------ activations

@njit(cache=True, error_model="numpy")
def quantize_x(x, xq, dx, sx, x8):
    """x (n, k) float32 -> xq (n, k) int8 in [-127, 127], dx (n, k/32) float32 block
    scales, sx (n, k/32) float32 block sums of x, x8 (n, k/32) int32 = 8 * sum of the
    block's xq (the Q4 kernels' nibble offset). Rounds half to even (np.rint).

    No fastmath: every rounding is IEEE float32 in a fixed order (sx adds 8 strided
    partial sums, then pairs), so the result does not depend on how LLVM vectorizes this
    function in one caller or another."""
    n, k = x.shape
    nb = k // QB
    p = np.empty(8, np.float32)
    for i in range(n):
        for b in range(nb):
            o = b * QB
            amax = np.float32(0.0)
            for j in range(QB):
                a = abs(x[i, o + j])
                if a > amax:
                    amax = a
            for j in range(8):
                p[j] = ((x[i, o + j] + x[i, o + 8 + j]) + x[i, o + 16 + j]) + x[i, o + 24 + j]
            s = ((p[0] + p[4]) + (p[2] + p[6])) + ((p[1] + p[5]) + (p[3] + p[7]))
            d = amax / np.float32(127.0)
            inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
            t = 0
            for j in range(QB):
                q = np.int8(np.rint(x[i, o + j] * inv))
                xq[i, o + j] = q
                t += q
            dx[i, b] = d
            x8[i, b] = np.int32(8 * t)
            sx[i, b] = s


# ------------------------------------------------------------------ GEMV kernels
# Parallel over chunks of 32-row tiles; inside a tile, 8-row lane groups; inside those,
# activation rows in groups of 8, 4 and 1 that share each weight load. A row's float
# arithmetic is the same whichever group it falls in (see _make_lanes).

@njit(cache=True, error_model="numpy")
def _group(n, i):
    """Activation rows to take at once from row i of n: 8, 4 or 1."""
    if n - i >= 8:
        return 8
    if n - i >= 4:
        return 4
    return 1


@njit(cache=True, parallel=True, error_model="numpy")
def gemm_q4(isa, qs, d, mn, xq, dx, sx, x8, out, n_chunks):
    """Q4 tiles x int8 activations.

    isa: AVX2 or PORTABLE. qs (T, nb, 4, 32, 4) uint8, d/mn (T, nb, 32) float32 (see
    cpu_matmul.repack), xq (n, k) int8, dx/sx (n, nb) float32, x8 (n, nb) int32, out (n, m)
    float32. out[i, t*32 + r] = sum over b, in order, of d * (dx * S) + (mn + 8 d) * sx,
    S = sum_j (q_j - 8) qx_j exact.
    """
    nt, nb, G, RR, C = qs.shape
    n, m = out.shape
    k = xq.shape[1]
    per = (nt + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        acc = np.empty(8 * LANES, np.float32)
        for t in range(c * per, min(nt, (c + 1) * per)):
            for r0 in range(0, RR, LANES):
                r1 = min(LANES, m - t * RR - r0)
                if r1 <= 0:
                    break
                w_off = (t * nb * G * RR + r0) * C
                d_off = t * nb * RR + r0
                i = 0
                while i < n:
                    nr = _group(n, i)
                    if nr == 8:
                        _q4_x8(isa, qs, w_off, d, mn, d_off, xq, i * k, dx, sx, x8, i * nb, nb, k, acc)
                    elif nr == 4:
                        _q4_x4(isa, qs, w_off, d, mn, d_off, xq, i * k, dx, sx, x8, i * nb, nb, k, acc)
                    else:
                        _q4_x1(isa, qs, w_off, d, mn, d_off, xq, i * k, dx, sx, x8, i * nb, nb, k, acc)
                    for ii in range(nr):
                        for r in range(r1):
                            out[i + ii, t * RR + r0 + r] = acc[ii * LANES + r]
                    i += nr


@njit(cache=True, parallel=True, error_model="numpy")
def gemm_q8(isa, qs, d, xq, dx, out, n_chunks):
    """Q8_0 tiles x int8 activations: qs (T, nb, 8, 32, 4) int8, d (T, nb, 32) float32,
    xq (n, k) int8, dx (n, nb) float32, out (n, m) float32.
    out[i, t*32 + r] = sum over b, in order, of d * (dx * S), S the exact int32 block sum."""
    nt, nb, G, RR, C = qs.shape
    n, m = out.shape
    k = xq.shape[1]
    per = (nt + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        acc = np.empty(8 * LANES, np.float32)
        for t in range(c * per, min(nt, (c + 1) * per)):
            for r0 in range(0, RR, LANES):
                r1 = min(LANES, m - t * RR - r0)
                if r1 <= 0:
                    break
                w_off = (t * nb * G * RR + r0) * C
                d_off = t * nb * RR + r0
                i = 0
                while i < n:
                    nr = _group(n, i)
                    if nr == 8:
                        _q8_x8(isa, qs, w_off, d, d_off, xq, i * k, dx, i * nb, nb, k, acc)
                    elif nr == 4:
                        _q8_x4(isa, qs, w_off, d, d_off, xq, i * k, dx, i * nb, nb, k, acc)
                    else:
                        _q8_x1(isa, qs, w_off, d, d_off, xq, i * k, dx, i * nb, nb, k, acc)
                    for ii in range(nr):
                        for r in range(r1):
                            out[i + ii, t * RR + r0 + r] = acc[ii * LANES + r]
                    i += nr


@njit(cache=True, error_model="numpy")
def matmul_q4(isa, qs, d, mn, x, xq, dx, sx, x8, out, n_chunks):
    """quantize_x then gemm_q4 in one call (one numba dispatch per GEMV, not two).
    x (n, k) float32; xq, dx, sx, x8 scratch as quantize_x fills them; out (n, m)."""
    quantize_x(x, xq, dx, sx, x8)
    gemm_q4(isa, qs, d, mn, xq, dx, sx, x8, out, n_chunks)


@njit(cache=True, error_model="numpy")
def matmul_q8(isa, qs, d, x, xq, dx, sx, x8, out, n_chunks):
    """quantize_x then gemm_q8 in one call."""
    quantize_x(x, xq, dx, sx, x8)
    gemm_q8(isa, qs, d, xq, dx, out, n_chunks)
