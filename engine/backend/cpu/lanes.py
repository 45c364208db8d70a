"""The integer inner step of the quantized matmul, written as LLVM IR (a numba intrinsic).

Owns: ``_lanes``, 8 weight rows of a repacked tile times 1, 4 or 8 int8-quantized
activation rows over every block, with each kind's exact integer block sums (AVX-VNNI /
AVX512-VNNI ``vpdpbusd``, AVX2 ``vpmaddubsw`` / ``vpmaddwd``, or plain LLVM vector IR,
picked by the ``markers``) and the fixed float steps after them. Leaves to others: the
markers and tile facts (``markers.py``), activation quantization and the loops over
tiles and rows (``qdot.py``), the tile layouts (``repack.py``).

Batch invariance (DESIGN.md): out[i, j] is computed by one fixed sequence of
operations that depends only on x[i] and weight row j - not on n, on the other rows, on
how rows are grouped to share a weight load, on the thread that runs it, or on the
instruction set. Prefill, decode and speculative verify rows all take this one kernel.

Arithmetic (the trade llama.cpp makes in ggml_vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0,
ggml/src/ggml-cpu/arch/x86/quants.c):
* x row i, block b (32 inputs): dx = max|x| / 127, qx = round(x / dx) in [-127, 127]
  (int8), sx = sum of the float x (fixed order), xs = sum of qx (int32), and xh0 / xh1 the
  sums of qx over the block's halves (inputs 0..15 and 16..31).
* Weight kinds (cpu_matmul's module docstring lists which GGUF type takes which), per
  block b with S the exact int32 block sum, u = dx * float(S) (one rounding) and two
  float32 accumulators per output, main and second, starting at 0, blocks in order:
  - Q4: nibbles q in 0..15, scales d, mn (w = d q + mn); S = sum_j (q_j - 8) qx_j,
    c = mn + 8 d:      main = fma(d, u, main);  second = fma(c, sx, second)
  - Q8: int8 q, scale d (w = d q); S = sum_j q_j qx_j:   main = fma(d, u, main)
  - Q5: q in 0..31 as a nibble and a high bit, d, mn (w = d q + mn); S = sum_j (q_j - 16)
    qx_j, c = mn + 16 d: as Q4
  - Q8X2: int8 q, a scale per 16 inputs (w = d_h q, h = half), S_h and u_h per half:
                       main = fma(d_0, u_0, main);  second = fma(d_1, u_1, second)
  and out = main + second (Q8: main). fma rounds once (vfmadd; llvm.fma elsewhere).
The only error against float arithmetic is the rounding of x to int8 (a dot product's
relative error ~1e-3..1e-2, the same as llama.cpp's).

Integer step, per 32-input block, 8 weight rows at a time (one 256-bit register of int32),
NR = 1, 4 or 8 activation rows sharing each weight load:
* a 32-byte load holds 4 consecutive bytes of each of 8 rows (Q4: 4 low nibbles = inputs
  4g..4g+3, 4 high nibbles = inputs 16+4g..16+4g+3; Q8*: inputs 4g..4g+3). Q5 adds two
  32-bit words per load, the high bits of those 64 values, turned into bytes (0 or 16)
  and or-ed into the nibbles.
* VNNI: vpdpbusd(acc, u8 weights, s8 activations) adds 4 byte products into each int32
  lane. Q4 nibbles are unsigned already; int8 weights are biased to unsigned (q xor 0x80
  = q + 128) and 128 * (sum of the qx) is subtracted after: exact.
* AVX2: vpmaddubsw (u8 x s8 pairs to int16) then vpmaddwd against ones (pairs to int32).
  Q4: a lane is at most 2 * 15 * 127 = 3810, the 8 of a block add to at most 30480 <
  32767 in int16; int8 weights take llama.cpp's sign trick (mul_sum_i8_pairs:
  vpmaddubsw(|q|, qx * sign(q)), at most 2 * 128 * 127 = 32512) and go to int32 per load.
* PORTABLE: the same sums in generic LLVM vector IR (widening multiplies).
So the block sums S are exact integers whichever instructions compute them, and the float
step after them is the sequence above, emitted without fast-math flags (no contraction
beyond the explicit fma, no reassociation): a row's result is bit-identical on every path
and whatever else shares its batch (tests/test_cpu_qdot.py re-computes it in numpy).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from aotx.engine.backend.cpu.llvm_ir import (
    _EVEN16, _EVEN8, _F32, _I8, _I16, _I32, _ODD16, _ODD8, _V16I16, _V16I32, _V32I16, _V32I8, _V8F32, _V8I32, _bcast4,
    _fma, _ptr, _splat, _splat_value, _widen_f16, _x86,
)
from aotx.engine.backend.cpu.markers import _ISA_NAMES, _KIND_NAMES, COMPACT, GROUPS, OFFSET, SCALES, R, corrections

def _maddubs(builder, isa: str, u, s):
    """<16 x i16>: u[2l] * s[2l] + u[2l+1] * s[2l+1], u unsigned and s signed <32 x i8>.
    The callers' ranges never reach vpmaddubsw's saturation, so both forms agree."""
    if isa == "avx2":
        return _x86(builder, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, [u, s])
    p = builder.mul(builder.zext(u, _V32I16), builder.sext(s, _V32I16))
    return builder.add(builder.shuffle_vector(p, p, _EVEN16), builder.shuffle_vector(p, p, _ODD16))


def _pairs32(builder, isa: str, a):
    """<8 x i32>: a[2l] + a[2l+1] for a <16 x i16> (vpmaddwd against ones)."""
    if isa == "avx2":
        return _x86(builder, "llvm.x86.avx2.pmadd.wd", _V8I32, [a, _splat(_V16I16, 1)])
    w = builder.sext(a, _V16I32)
    return builder.add(builder.shuffle_vector(w, w, _EVEN8), builder.shuffle_vector(w, w, _ODD8))


def _dpbusd(builder, acc, u, s):
    """acc + (sum of the 4 products u * s in each int32 lane), u unsigned, s signed bytes."""
    return _x86(builder, "llvm.x86.avx512.vpdpbusd.256", _V8I32,
                [acc, builder.bitcast(u, _V8I32), builder.bitcast(s, _V8I32)])


def _load32(builder, wblk, intp, g: int):
    """<32 x i8> at byte g * 4R of a tile block (group g of R rows x 4 bytes)."""
    return builder.load(builder.bitcast(builder.gep(wblk, [ir.Constant(intp, g * 4 * R)]),
                                        _V32I8.as_pointer()), align=1)


def _q4_sums(builder, isa: str, wblk, xrows, init, intp):
    """Exact <8 x i32> per activation row: init + sum_j q_j qx_j over one Q4 block
    (nibbles q in 0..15) of 8 weight rows. wblk: i8* to the block's group 0 for these
    rows; xrows: i8* to each activation row's 32 block inputs; init: <8 x i32> per row."""
    n = len(xrows)
    if isa == "vnni":                   # two chains: half the dependent-latency depth
        lo_acc, hi_acc = list(init), [_splat(_V8I32, 0)] * n
    else:
        acc = [_splat(_V16I16, 0)] * n
    for g in range(4):
        wv = _load32(builder, wblk, intp, g)
        lo = builder.and_(wv, _splat(_V32I8, 15))
        hi = builder.lshr(wv, _splat(_V32I8, 4))
        for ii, xr in enumerate(xrows):
            xa = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 4 * g)]))
            xb = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 16 + 4 * g)]))
            if isa == "vnni":
                lo_acc[ii] = _dpbusd(builder, lo_acc[ii], lo, xa)
                hi_acc[ii] = _dpbusd(builder, hi_acc[ii], hi, xb)
            else:
                acc[ii] = builder.add(acc[ii], builder.add(_maddubs(builder, isa, lo, xa),
                                                           _maddubs(builder, isa, hi, xb)))
    if isa == "vnni":
        return [builder.add(a, b) for a, b in zip(lo_acc, hi_acc)]
    return [builder.add(_pairs32(builder, isa, a), c) for a, c in zip(acc, init)]


def _bits_to_bytes(builder, word, value: int):
    """<32 x i8>: byte i = value where bit i of the i32 ``word`` is set, else 0 (llama.cpp's
    bytes_from_bits_32: broadcast, byte shuffle, bit test)."""
    v = builder.bitcast(_splat_value(builder, _V8I32, word), _V32I8)
    v = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 32), [i // 8 for i in range(32)]))
    bit = ir.Constant(_V32I8, [1 << (i % 8) for i in range(32)])
    on = builder.icmp_unsigned("!=", builder.and_(v, bit), _splat(_V32I8, 0))
    return builder.select(on, _splat(_V32I8, value), _splat(_V32I8, 0))


def _q5_sums(builder, isa: str, wblk, hblk, xrows, init, intp):
    """As _q4_sums for 5-bit q = nibble | (high bit << 4) in 0..31: hblk is i32* to the
    block's high-bit words for these 8 rows (group g: words [g * 8], [g * 8 + 1] for the
    low- and high-nibble inputs; bit i = byte i of the group's 32-byte load). On AVX2 /
    portable, int16 lanes take two groups at most (4 x 2 x 31 x 127 = 31496 < 32767)."""
    n = len(xrows)
    if isa == "vnni":
        lo_acc, hi_acc = list(init), [_splat(_V8I32, 0)] * n
    else:
        acc32 = list(init)
        acc = [_splat(_V16I16, 0)] * n
    for g in range(4):
        wv = _load32(builder, wblk, intp, g)
        hl = builder.load(builder.gep(hblk, [ir.Constant(intp, R // 4 * g)]))
        hh = builder.load(builder.gep(hblk, [ir.Constant(intp, R // 4 * g + 1)]))
        lo = builder.or_(builder.and_(wv, _splat(_V32I8, 15)), _bits_to_bytes(builder, hl, 16))
        hi = builder.or_(builder.lshr(wv, _splat(_V32I8, 4)), _bits_to_bytes(builder, hh, 16))
        for ii, xr in enumerate(xrows):
            xa = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 4 * g)]))
            xb = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 16 + 4 * g)]))
            if isa == "vnni":
                lo_acc[ii] = _dpbusd(builder, lo_acc[ii], lo, xa)
                hi_acc[ii] = _dpbusd(builder, hi_acc[ii], hi, xb)
            else:
                acc[ii] = builder.add(acc[ii], builder.add(_maddubs(builder, isa, lo, xa),
                                                           _maddubs(builder, isa, hi, xb)))
        if isa != "vnni" and g % 2 == 1:
            acc32 = [builder.add(c32, _pairs32(builder, isa, a)) for c32, a in zip(acc32, acc)]
            acc = [_splat(_V16I16, 0)] * n
    if isa == "vnni":
        return [builder.add(a, b) for a, b in zip(lo_acc, hi_acc)]
    return acc32


def _q8_sums(builder, isa: str, wblk, xrows, init, intp, halves: bool):
    """Exact <8 x i32> per activation row of init + sum_j q_j' qx_j over one int8 block
    (8 groups of 4 bytes), or with ``halves`` a pair (groups 0..3, groups 4..7; init a
    pair too). q' = q + 128 on the VNNI path (biased to unsigned: the caller's init
    carries -128 * sum qx), q' = q elsewhere."""
    n = len(xrows)
    zero8 = _splat(_V32I8, 0)
    if halves:
        parts = [[a for a, _ in init], [b for _, b in init]]
    else:                               # two chains (even and odd groups)
        parts = [list(init), [_splat(_V8I32, 0)] * n]
    for g in range(8):
        wv = _load32(builder, wblk, intp, g)
        h = g // 4 if halves else g % 2
        if isa == "vnni":
            wu = builder.xor(wv, _splat(_V32I8, 0x80))      # q + 128 as unsigned
        elif isa == "avx2":
            aw = builder.select(builder.icmp_signed("<", wv, zero8), builder.sub(zero8, wv), wv)
        for ii, xr in enumerate(xrows):
            xa = _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 4 * g)]))
            if isa == "vnni":
                parts[h][ii] = _dpbusd(builder, parts[h][ii], wu, xa)
                continue
            if isa == "avx2":
                p = _maddubs(builder, "avx2", aw, _x86(builder, "llvm.x86.avx2.psign.b", _V32I8, [xa, wv]))
            else:               # |q| = 128 does not fit a signed byte: multiply the signed bytes
                pr = builder.mul(builder.sext(wv, _V32I16), builder.sext(xa, _V32I16))
                p = builder.add(builder.shuffle_vector(pr, pr, _EVEN16), builder.shuffle_vector(pr, pr, _ODD16))
            parts[h][ii] = builder.add(parts[h][ii], _pairs32(builder, isa, p))
    if halves:
        return list(zip(parts[0], parts[1]))
    return [builder.add(a, b) for a, b in zip(parts[0], parts[1])]


def _q6p_sums(builder, isa: str, wblk, hlo, hhi, xrows, init, intp):
    """Exact (<8 x i32>, <8 x i32>) per activation row: init pair + sum_j u_j qx_j over the
    two 16-input halves of one packed-Q6 block (u = nibble | 2 high bits << 4, 0..63):
    half 0 = the low nibbles (inputs 4g + c), half 1 = the high ones (16 + 4g + c). hlo,
    hhi: <32 x i8> high-bit bytes of the halves (bits 2g, 2g+1: group g). AVX2 / portable:
    int16 lanes hold two groups at most (2 x 2 x 63 x 127 = 32004 < 32767)."""
    n = len(xrows)
    acc = [[a for a, _ in init], [b for _, b in init]]
    if isa != "vnni":
        a16 = [[_splat(_V16I16, 0)] * n, [_splat(_V16I16, 0)] * n]
    for g in range(4):
        wv = _load32(builder, wblk, intp, g)
        hv = []
        for hb in (hlo, hhi):
            t = builder.lshr(hb, _splat(_V32I8, 2 * g)) if g else hb
            hv.append(builder.shl(builder.and_(t, _splat(_V32I8, 3)), _splat(_V32I8, 4)))
        u = [builder.or_(builder.and_(wv, _splat(_V32I8, 15)), hv[0]),
             builder.or_(builder.lshr(wv, _splat(_V32I8, 4)), hv[1])]
        for ii, xr in enumerate(xrows):
            xs = [_bcast4(builder, builder.gep(xr, [ir.Constant(intp, 4 * g)])),
                  _bcast4(builder, builder.gep(xr, [ir.Constant(intp, 16 + 4 * g)]))]
            for h in range(2):
                if isa == "vnni":
                    acc[h][ii] = _dpbusd(builder, acc[h][ii], u[h], xs[h])
                else:
                    a16[h][ii] = builder.add(a16[h][ii], _maddubs(builder, isa, u[h], xs[h]))
        if isa != "vnni" and g % 2 == 1:
            for h in range(2):
                acc[h] = [builder.add(c32, _pairs32(builder, isa, a)) for c32, a in zip(acc[h], a16[h])]
                a16[h] = [_splat(_V16I16, 0)] * n
    return list(zip(acc[0], acc[1]))


_LANE_ARGS = ("kind", "isa", "qs", "qh", "w_off", "h_off", "d", "mn", "d_off", "xq", "x_off", "dx", "sx", "xs",
              "xh", "xs_off", "nb", "k", "acc", "nr")


def _lanes_codegen(context, builder, signature, args):
    """8 weight rows times nr activation rows over all nb blocks; stores acc[ii * 8 + r]
    (float32) for activation row ii and weight row r, as the module docstring's sums.

    *_off are flat element offsets (intp) of block 0: w_off into qs (group 0, row r0),
    d_off into d / mn (row r0; block b adds b * 32 * SCALES[kind]), x_off into xq (n, k)
    int8 (activation row 0 of the nr), xs_off into dx / sx / xs (n, nb) (xh: 2 * xs_off);
    block b adds b * 128 * GROUPS[kind] to w_off, b * 32 to x_off, b to xs_off; activation
    row ii adds ii * k to x_off and ii * nb to xs_off. Every float operation is one IEEE
    operation in a fixed order: fmul, llvm.fma (one rounding), fadd; no fast-math flags."""
    kind = _KIND_NAMES[signature.args[0]]
    compact = kind in COMPACT
    kind = COMPACT.get(kind, kind)      # a compact kind: its base kind's integer step, its own scales
    isa = _ISA_NAMES[signature.args[1]]
    nr = signature.args[-1].literal_value
    intp = context.get_value_type(types.intp)
    a = dict(zip(_LANE_ARGS, zip(signature.args, args)))

    def ptr(name, off, elt):
        ty, val = a[name]
        return _ptr(builder, context, ty, val, off, elt)

    def c(v):
        return ir.Constant(intp, v)

    nb, k = a["nb"][1], a["k"][1]
    wstride = 4 * R * GROUPS[kind]
    dstride = 2 * R if compact else R * SCALES[kind]
    cs, ch = corrections(kind, isa)
    has_min = kind in OFFSET
    w0 = ptr("qs", a["w_off"][1], _I8)
    h0 = ptr("qh", a["h_off"][1], _I32) if kind == "q5" else None
    half = a["d"][0].dtype == types.uint16          # scales kept as the file's float16 bits
    if compact:     # d: scale bytes [b, 2, row]; qh: float32 super-block d (, dmin) [sb, 1 or 2, row]
        d0 = ptr("d", a["d_off"][1], _I8)
        sbp = ptr("qh", a["h_off"][1], _F32)
        m0 = None
    else:
        d0 = ptr("d", a["d_off"][1], _I16 if half else _F32)
        m0 = ptr("mn", a["d_off"][1], _I16 if half else _F32) if has_min else None
    x0 = ptr("xq", a["x_off"][1], _I8)
    fx0 = ptr("dx", a["xs_off"][1], _F32)
    sx0 = ptr("sx", a["xs_off"][1], _F32) if has_min else None
    xs0 = ptr("xs", a["xs_off"][1], _I32)
    xh0 = ptr("xh", builder.mul(a["xs_off"][1], c(2)), _I32)
    out = ptr("acc", c(0), _V8F32)
    zero = _splat(_V8F32, 0.0)
    main = [cgutils.alloca_once_value(builder, zero) for _ in range(nr)]
    second = [cgutils.alloca_once_value(builder, zero) for _ in range(nr)] if has_min or kind in ("q8x2", "q6p") \
        else None

    def vload(p, idx):
        if half:
            h = builder.load(builder.bitcast(builder.gep(p, [idx]), ir.VectorType(_I16, 8).as_pointer()), align=2)
            return _widen_f16(builder, h)
        return builder.load(builder.bitcast(builder.gep(p, [idx]), _V8F32.as_pointer()), align=4)

    def bcast_i32(p, idx):
        return _splat_value(builder, _V8I32, builder.load(builder.gep(p, [idx])))

    with cgutils.for_range(builder, nb, intp=intp) as loop:
        b = loop.index
        wblk = builder.gep(w0, [builder.mul(b, c(wstride))])
        b32 = builder.mul(b, c(32))
        xrows = [builder.gep(x0, [builder.add(b32, builder.mul(k, c(ii)))]) for ii in range(nr)]
        xi = [builder.add(b, builder.mul(nb, c(ii))) for ii in range(nr)]
        if kind in ("q8x2", "q6p"):
            zi = _splat(_V8I32, 0)
            init = [(bcast_i32(xh0, builder.mul(x, c(2))), bcast_i32(xh0, builder.add(builder.mul(x, c(2)), c(1))))
                    if ch else (zi, zi) for x in xi]
            if kind == "q6p":       # high bits: mn (T, nb, 2, R, 4) bytes, parallel to d's (T, nb, 2, R)
                hoff = builder.mul(builder.add(a["d_off"][1], builder.mul(b, c(dstride))), c(4))
                hp = ptr("mn", hoff, _I8)
                hl = builder.load(builder.bitcast(hp, _V32I8.as_pointer()), align=1)
                hh = builder.load(builder.bitcast(builder.gep(hp, [c(4 * R)]), _V32I8.as_pointer()), align=1)
                sums = _q6p_sums(builder, isa, wblk, hl, hh, xrows, init, intp)
            else:
                sums = _q8_sums(builder, isa, wblk, xrows, init, intp, halves=True)
        else:
            init = [bcast_i32(xs0, x) if cs else _splat(_V8I32, 0) for x in xi]
            if kind == "q4":
                sums = _q4_sums(builder, isa, wblk, xrows, init, intp)
            elif kind == "q5":
                hblk = builder.gep(h0, [builder.mul(b, c(R))])
                sums = _q5_sums(builder, isa, wblk, hblk, xrows, init, intp)
            else:
                sums = _q8_sums(builder, isa, wblk, xrows, init, intp, halves=False)
        bd = builder.mul(b, c(dstride))
        if compact:
            n_s = 2 if kind == "q4" else 1
            sbase = builder.mul(builder.lshr(b, c(3)), c(R * n_s))

            def f8(off, signed):
                v = builder.load(builder.bitcast(builder.gep(d0, [off]), ir.VectorType(_I8, 8).as_pointer()),
                                 align=1)
                return builder.sitofp(builder.sext(v, _V8I32) if signed else builder.zext(v, _V8I32), _V8F32)

            dsv = builder.load(builder.bitcast(builder.gep(sbp, [sbase]), _V8F32.as_pointer()), align=4)
            if kind == "q4":        # D = d sc, M = -(dmin mn), c = M + 8 D (repack's float32 steps)
                dv = builder.fmul(dsv, f8(bd, False))
                dmv = builder.load(builder.bitcast(builder.gep(sbp, [builder.add(sbase, c(R))]), _V8F32.as_pointer()),
                                   align=4)
                mv = builder.fneg(builder.fmul(dmv, f8(builder.add(bd, c(R)), False)))
                cv = builder.fadd(mv, builder.fmul(_splat(_V8F32, float(OFFSET[kind])), dv))
            else:                   # Q6_K (q6k, q6p): D_h = d sc_h
                dv = builder.fmul(dsv, f8(bd, True))
                dv1 = builder.fmul(dsv, f8(builder.add(bd, c(R)), True))
        else:
            dv = vload(d0, bd)
            if kind == "q8x2":
                dv1 = vload(d0, builder.add(bd, c(R)))
            if has_min:                 # c = mn + off * d: stored, or from float16 d and mn (the same value)
                cv = vload(m0, bd)
                if half:
                    cv = builder.fadd(cv, builder.fmul(_splat(_V8F32, float(OFFSET[kind])), dv))
        for ii in range(nr):
            f = _splat_value(builder, _V8F32, builder.load(builder.gep(fx0, [xi[ii]])))
            if kind in ("q8x2", "q6p"):
                s0, s1 = sums[ii]
                builder.store(_fma(builder, dv, builder.fmul(f, builder.sitofp(s0, _V8F32)), builder.load(main[ii])),
                              main[ii])
                builder.store(_fma(builder, dv1, builder.fmul(f, builder.sitofp(s1, _V8F32)),
                                   builder.load(second[ii])), second[ii])
                continue
            u = builder.fmul(f, builder.sitofp(sums[ii], _V8F32))
            builder.store(_fma(builder, dv, u, builder.load(main[ii])), main[ii])
            if has_min:
                g = _splat_value(builder, _V8F32, builder.load(builder.gep(sx0, [xi[ii]])))
                builder.store(_fma(builder, cv, g, builder.load(second[ii])), second[ii])
    for ii in range(nr):
        v = builder.load(main[ii])
        if second is not None:
            v = builder.fadd(v, builder.load(second[ii]))
        builder.store(v, builder.gep(out, [c(ii)]), align=4)
    return context.get_dummy_value()


@intrinsic(prefer_literal=True)
def _lanes(typingctx, kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, x_off, dx, sx, xs, xh, xs_off, nb, k, acc, nr):
    if kind not in _KIND_NAMES:
        raise TypeError(f"kind marker must be markers.Q4/Q5/Q8/Q8X2, got {kind}")
    if isa not in _ISA_NAMES:
        raise TypeError(f"isa marker must be markers.VNNI, AVX2 or PORTABLE, got {isa}")
    if not isinstance(nr, types.IntegerLiteral) or nr.literal_value not in (1, 4, 8):
        raise TypeError("nr must be the literal 1, 4 or 8")
    sig = types.void(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, x_off, dx, sx, xs, xh, xs_off, nb, k, acc, nr)
    return sig, _lanes_codegen
