"""Integer dot-product kernels: quantized weights times int8-quantized activations.

Owns: `quantize_x` (activations to int8 per 32-block, as llama.cpp's Q8_1 does) and the
matmul kernel `gemm` over the weight tiles that `cpu_matmul.repack` builds, for every row
count n, with its integer inner step written as LLVM IR (numba `intrinsic`): AVX-VNNI /
AVX512-VNNI `vpdpbusd`, AVX2 `vpmaddubsw` / `vpmaddwd`, or plain LLVM vector IR, picked
by the CPU. Leaves to others: the weight layouts and which tensor takes which kernel
(`cpu_matmul.py`).

Batch invariance (shared/DESIGN.md): out[i, j] is computed by one fixed sequence of
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

import os

# numba's parallel regions run on libgomp's pool, whose threads spin between regions:
# 300,000 pause loops by default (~10 ms on recent Intel cores). On a machine where
# another process holds a core, a join then waits for a descheduled thread while the
# spinning one burns its time slice: decode measured 0.7 tok/s on this workplace's busy
# 2-core machine, 24 tok/s with OMP_WAIT_POLICY=PASSIVE, 12 with GOMP_SPINCOUNT=2000
# (~100 us of spinning: enough to keep the pool awake between one decode step's regions).
# Set before libgomp loads (at numba's first parallel launch); the user's settings win.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "2000")

import numpy as np  # noqa: E402
from llvmlite import binding as llvm_binding  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

QB = 32      # inputs per quantization block
LANES = 8    # weight rows per integer step (one 256-bit register of int32)
R = 32       # rows per tile of the repacked layouts (cpu_matmul.repack)

# The kernels take marker arguments whose *numba type* picks what is compiled: numba
# compiles (and caches) one specialization per argument type, so the VNNI code is never
# compiled on a CPU without VNNI, and tests can run every path on one that has them all.
PORTABLE = np.int8(0)    # generic LLVM vector IR (any target)
AVX2 = np.uint8(1)       # vpmaddubsw / vpmaddwd (llvm.x86.avx2.pmadd.ub.sw / pmadd.wd)
VNNI = np.uint16(2)      # vpdpbusd (llvm.x86.avx512.vpdpbusd.256: AVX-VNNI or AVX512-VNNI+VL)
# weight kinds (cpu_matmul.repack builds their tiles)
Q4 = np.int16(0)
Q8 = np.int32(0)
Q8X2 = np.uint32(0)
Q5 = np.uint64(0)
# compact K-quant kinds (cpu_matmul.repack_compact): Q4_K's and Q6_K's quants as Q4 / Q8X2,
# their scales as the file has them - a small integer per 32 (Q4_K: sc and mn, 6 bits) or
# per 16 inputs (Q6_K: sc, int8) and float32 d (and dmin) per 256-input super-block -
# multiplied out in the kernel (D = d sc, M = -(dmin mn), c = M + 8 D: exact float32
# products and the one rounding of the stored layout's repack, so the same bits as Q4 /
# Q8X2 tiles of the same matrix) at 0.59 / 1.08 bytes per weight instead of 0.75 / 1.25:
# less memory traffic where a matmul is bound by it (decode).
Q4K = np.float32(0)
Q6K = np.float64(0)
# packed Q6_K ("q6p"): u = q + 32 in 0..63 as Q4's nibble tiles plus its 2 high bits, 4
# groups' worth per byte (mn: (T, nb, 2, R, 4) uint8, half h = the nibble half, bits 2g..2g+1
# for group g), the scales as q6k's: 0.83 bytes per weight (the file's 0.82). S_h =
# sum (u - 32) qx over each 16-input half (the nibble halves), init -32 * the half's qx sum.
Q6P = np.complex64(0)

_ISA_NAMES = {types.int8: "portable", types.uint8: "avx2", types.uint16: "vnni"}
_KIND_NAMES = {types.int16: "q4", types.int32: "q8", types.uint32: "q8x2", types.uint64: "q5",
               types.float32: "q4k", types.float64: "q6k", types.complex64: "q6p"}
COMPACT = {"q4k": "q4", "q6k": "q8x2", "q6p": "q6p"}   # compact kind -> the kind whose integer step it takes
# per kind: bytes of one tile block (groups x 32 rows x 4), scale floats per block and row
# (compact kinds: scale bytes per block and row)
GROUPS = {"q4": 4, "q8": 8, "q8x2": 8, "q5": 4, "q4k": 4, "q6k": 8, "q6p": 4}
SCALES = {"q4": 1, "q8": 1, "q8x2": 2, "q5": 1, "q4k": 2, "q6k": 2, "q6p": 2}
OFFSET = {"q4": 8, "q5": 16}     # the kinds with a minimum: S = sum (q - OFFSET) qx


def _features() -> set[str]:
    """The CPU features numba compiles for: llvmlite's host feature string, or, where
    NUMBA_CPU_NAME / NUMBA_CPU_FEATURES pick another target (portable caches), those."""
    from numba.core import config

    try:
        if config.CPU_NAME and config.CPU_NAME != "host":
            flags = (config.CPU_FEATURES or "").split(",")
        else:
            flags = llvm_binding.get_host_cpu_features().flatten().split(",")
    except Exception:           # noqa: BLE001 - a host LLVM cannot describe: stay portable
        return set()
    return {f[1:] for f in flags if f.startswith("+")}


def host_has_avx2() -> bool:
    """True when numba compiles for a CPU with AVX2."""
    return "avx2" in _features()


def host_has_vnni() -> bool:
    """True when numba compiles for a CPU with 256-bit vpdpbusd (AVX-VNNI, or AVX512-VNNI
    with AVX512VL)."""
    f = _features()
    return "avx2" in f and ("avxvnni" in f or {"avx512vnni", "avx512vl"} <= f)


def host_isa():
    """The fastest integer path this CPU runs: VNNI, AVX2 or PORTABLE."""
    return VNNI if host_has_vnni() else AVX2 if host_has_avx2() else PORTABLE


def isa_name(isa) -> str:
    """'vnni', 'avx2' or 'portable' for an isa marker."""
    return {int(VNNI): "vnni", int(AVX2): "avx2", int(PORTABLE): "portable"}[int(isa)]


HOST_ISA = host_isa()


# ------------------------------------------------------------------ LLVM IR helpers

_I8, _I16, _I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
_F32 = ir.FloatType()
_V32I8 = ir.VectorType(_I8, 32)
_V32I16 = ir.VectorType(_I16, 32)
_V16I16 = ir.VectorType(_I16, 16)
_V16I32 = ir.VectorType(_I32, 16)
_V8I32 = ir.VectorType(_I32, 8)
_V8F32 = ir.VectorType(_F32, 8)
_EVEN16 = ir.Constant(ir.VectorType(_I32, 16), list(range(0, 32, 2)))
_ODD16 = ir.Constant(ir.VectorType(_I32, 16), list(range(1, 32, 2)))
_EVEN8 = ir.Constant(ir.VectorType(_I32, 8), list(range(0, 16, 2)))
_ODD8 = ir.Constant(ir.VectorType(_I32, 8), list(range(1, 16, 2)))


def _splat(ty: ir.VectorType, v) -> ir.Constant:
    return ir.Constant(ty, [ir.Constant(ty.element, v)] * ty.count)


def _ptr(builder, context, aryty, ary, off, elt: ir.Type):
    """Pointer to element `off` (intp, flat, in elements) of array `ary`, cast to elt*."""
    data = context.make_array(aryty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [off]), elt.as_pointer())


def _splat_value(builder, vty: ir.VectorType, v):
    """A scalar IR value repeated over vty's lanes."""
    u = builder.insert_element(ir.Constant(vty, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(u, ir.Constant(vty, ir.Undefined), _splat(ir.VectorType(_I32, vty.count), 0))


def _bcast4(builder, p8):
    """The 4 bytes at i8* p8 repeated 8 times: <32 x i8> (vpbroadcastd)."""
    v = builder.load(builder.bitcast(p8, _I32.as_pointer()), align=1)
    return builder.bitcast(_splat_value(builder, _V8I32, v), _V32I8)


def _x86(builder, name: str, ret: ir.Type, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


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
    """<32 x i8> at byte g * 128 of a tile block (group g of 32 rows x 4 bytes)."""
    return builder.load(builder.bitcast(builder.gep(wblk, [ir.Constant(intp, g * 128)]),
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
        hl = builder.load(builder.gep(hblk, [ir.Constant(intp, 8 * g)]))
        hh = builder.load(builder.gep(hblk, [ir.Constant(intp, 8 * g + 1)]))
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


def corrections(kind: str, isa: str) -> tuple[int, int]:
    """(cs, ch): quantize_x stores xs = -cs * (sum of a block's qx) and xh = -ch * (sum of
    a half's qx), the integer terms the kernel of this kind and isa adds to its block
    sums (module docstring): Q4 subtracts 8 * sum qx, Q5 16 * sum qx, and the VNNI path
    128 * sum qx for the bias of int8 weights."""
    vnni = 128 if isa == "vnni" else 0
    kind = COMPACT.get(kind, kind)
    return {"q4": (8, 0), "q8": (vnni, 0), "q8x2": (0, vnni), "q5": (16, 0), "q6p": (0, 32)}[kind]


_LANE_ARGS = ("kind", "isa", "qs", "qh", "w_off", "h_off", "d", "mn", "d_off", "xq", "x_off", "dx", "sx", "xs",
              "xh", "xs_off", "nb", "k", "acc", "nr")


def _h2f_bits(builder, h16):
    """<8 x i16> float16 patterns -> <8 x float>, exactly, with integer operations
    (subnormals renormalised through one exact float subtraction; inf and NaN kept)."""
    h = builder.zext(h16, _V8I32)
    sign = builder.shl(builder.and_(h, _splat(_V8I32, 0x8000)), _splat(_V8I32, 16))
    o = builder.shl(builder.and_(h, _splat(_V8I32, 0x7FFF)), _splat(_V8I32, 13))
    e = builder.and_(o, _splat(_V8I32, 0x0F800000))
    o = builder.add(o, _splat(_V8I32, (127 - 15) << 23))
    is_inf = builder.icmp_unsigned("==", e, _splat(_V8I32, 0x0F800000))
    o = builder.select(is_inf, builder.add(o, _splat(_V8I32, (128 - 16) << 23)), o)
    is_sub = builder.icmp_unsigned("==", e, _splat(_V8I32, 0))
    sub = builder.fsub(builder.bitcast(builder.add(o, _splat(_V8I32, 1 << 23)), _V8F32),
                       builder.bitcast(_splat(_V8I32, 113 << 23), _V8F32))
    o = builder.select(is_sub, builder.bitcast(sub, _V8I32), o)
    return builder.bitcast(builder.or_(o, sign), _V8F32)


def _widen_f16(builder, h):
    """<8 x i16> float16 bit patterns -> <8 x float>, exact (vcvtph2ps with F16C)."""
    if "f16c" in _features():
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), _V8F32)
    return _h2f_bits(builder, h)


def _fma(builder, a, b, c):
    """a * b + c rounded once (llvm.fma: vfmadd on AVX2 CPUs, exact in software elsewhere)."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F32, [_V8F32] * 3), "llvm.fma.v8f32")
    return builder.call(fn, [a, b, c])


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
    wstride = 128 * GROUPS[kind]
    dstride = 64 if compact else 32 * SCALES[kind]
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
                hh = builder.load(builder.bitcast(builder.gep(hp, [c(128)]), _V32I8.as_pointer()), align=1)
                sums = _q6p_sums(builder, isa, wblk, hl, hh, xrows, init, intp)
            else:
                sums = _q8_sums(builder, isa, wblk, xrows, init, intp, halves=True)
        else:
            init = [bcast_i32(xs0, x) if cs else _splat(_V8I32, 0) for x in xi]
            if kind == "q4":
                sums = _q4_sums(builder, isa, wblk, xrows, init, intp)
            elif kind == "q5":
                hblk = builder.gep(h0, [builder.mul(b, c(32))])
                sums = _q5_sums(builder, isa, wblk, hblk, xrows, init, intp)
            else:
                sums = _q8_sums(builder, isa, wblk, xrows, init, intp, halves=False)
        bd = builder.mul(b, c(dstride))
        if compact:
            n_s = 2 if kind == "q4" else 1
            sbase = builder.mul(builder.lshr(b, c(3)), c(32 * n_s))

            def f8(off, signed):
                v = builder.load(builder.bitcast(builder.gep(d0, [off]), ir.VectorType(_I8, 8).as_pointer()),
                                 align=1)
                return builder.sitofp(builder.sext(v, _V8I32) if signed else builder.zext(v, _V8I32), _V8F32)

            dsv = builder.load(builder.bitcast(builder.gep(sbp, [sbase]), _V8F32.as_pointer()), align=4)
            if kind == "q4":        # D = d sc, M = -(dmin mn), c = M + 8 D (repack's float32 steps)
                dv = builder.fmul(dsv, f8(bd, False))
                dmv = builder.load(builder.bitcast(builder.gep(sbp, [builder.add(sbase, c(32))]), _V8F32.as_pointer()),
                                   align=4)
                mv = builder.fneg(builder.fmul(dmv, f8(builder.add(bd, c(32)), False)))
                cv = builder.fadd(mv, builder.fmul(_splat(_V8F32, float(OFFSET[kind])), dv))
            else:                   # Q6_K (q6k, q6p): D_h = d sc_h
                dv = builder.fmul(dsv, f8(bd, True))
                dv1 = builder.fmul(dsv, f8(builder.add(bd, c(32)), True))
        else:
            dv = vload(d0, bd)
            if kind == "q8x2":
                dv1 = vload(d0, builder.add(bd, c(32)))
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
        raise TypeError(f"kind marker must be cpu_qdot.Q4/Q5/Q8/Q8X2, got {kind}")
    if isa not in _ISA_NAMES:
        raise TypeError(f"isa marker must be cpu_qdot.VNNI, AVX2 or PORTABLE, got {isa}")
    if not isinstance(nr, types.IntegerLiteral) or nr.literal_value not in (1, 4, 8):
        raise TypeError("nr must be the literal 1, 4 or 8")
    sig = types.void(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, x_off, dx, sx, xs, xh, xs_off, nb, k, acc, nr)
    return sig, _lanes_codegen


# ------------------------------------------------------------------ activations

@intrinsic
def bits_f32(typingctx, i):
    """The float32 whose bit pattern is the integer i's low 32 bits (a bitcast)."""
    if not isinstance(i, types.Integer):
        raise TypeError("bits_f32 takes an integer")

    def codegen(context, builder, sig, args):
        v = context.cast(builder, args[0], sig.args[0], types.int32)
        return builder.bitcast(v, _F32)

    return types.float32(i), codegen


def _hreduce(builder, v, op):
    """op over the 8 lanes of v (a fixed tree of shuffles: exact for max and integer add)."""
    for width in (4, 2, 1):
        idx = ir.Constant(ir.VectorType(_I32, 8), list(range(width, 2 * width)) + [0] * (8 - width))
        v = op(v, builder.shuffle_vector(v, v, idx))
    return builder.extract_element(v, ir.Constant(_I32, 0))


def _qblock_codegen(context, builder, sig, args):
    """One 32-input block: xq, dx, sx, xs, xh as quantize_x documents (see there)."""
    intp = context.get_value_type(types.intp)
    (x_ty, _, q_ty, _, dx_ty, sx_ty, xs_ty, xh_ty, _, _, _) = sig.args
    x, x_off, xq, q_off, dx, sx, xs, xh, s_off, cs, ch = args
    cs = builder.trunc(cs, _I32) if cs.type.width > 32 else cs
    ch = builder.trunc(ch, _I32) if ch.type.width > 32 else ch
    xp = _ptr(builder, context, x_ty, x, x_off, _F32)
    v = [builder.load(builder.bitcast(builder.gep(xp, [ir.Constant(intp, 8 * c)]), _V8F32.as_pointer()), align=4)
         for c in range(4)]
    bits = [builder.and_(builder.bitcast(a, _V8I32), _splat(_V8I32, 0x7FFFFFFF)) for a in v]

    def smax(a, b):
        return builder.select(builder.icmp_signed(">", a, b), a, b)

    am = smax(smax(bits[0], bits[1]), smax(bits[2], bits[3]))
    amax = builder.bitcast(_hreduce(builder, am, smax), _F32)
    p8 = builder.fadd(builder.fadd(builder.fadd(v[0], v[1]), v[2]), v[3])      # x_j + x_8+j + ...
    lo = builder.shuffle_vector(p8, p8, ir.Constant(ir.VectorType(_I32, 4), [0, 1, 2, 3]))
    hi = builder.shuffle_vector(p8, p8, ir.Constant(ir.VectorType(_I32, 4), [4, 5, 6, 7]))
    v4 = builder.fadd(lo, hi)
    v2 = builder.fadd(builder.shuffle_vector(v4, v4, ir.Constant(ir.VectorType(_I32, 2), [0, 1])),
                      builder.shuffle_vector(v4, v4, ir.Constant(ir.VectorType(_I32, 2), [2, 3])))
    total = builder.fadd(builder.extract_element(v2, ir.Constant(_I32, 0)),
                         builder.extract_element(v2, ir.Constant(_I32, 1)))
    c127 = ir.Constant(_F32, 127.0)
    d = builder.fdiv(amax, c127)
    pos = builder.fcmp_ordered(">", amax, ir.Constant(_F32, 0.0))
    inv = builder.select(pos, builder.fdiv(c127, amax), ir.Constant(_F32, 0.0))
    iv = _splat_value(builder, _V8F32, inv)
    rint = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V8F32, [_V8F32]), "llvm.rint.v8f32")
    qi = [builder.fptosi(builder.call(rint, [builder.fmul(a, iv)]), _V8I32) for a in v]
    qp = _ptr(builder, context, q_ty, xq, q_off, _I8)
    for c in range(4):
        builder.store(builder.trunc(qi[c], ir.VectorType(_I8, 8)),
                      builder.bitcast(builder.gep(qp, [ir.Constant(intp, 8 * c)]), ir.VectorType(_I8, 8).as_pointer()),
                      align=1)
    t0 = _hreduce(builder, builder.add(qi[0], qi[1]), builder.add)
    t1 = _hreduce(builder, builder.add(qi[2], qi[3]), builder.add)
    builder.store(d, builder.gep(_ptr(builder, context, dx_ty, dx, s_off, _F32), [ir.Constant(intp, 0)]))
    builder.store(total, builder.gep(_ptr(builder, context, sx_ty, sx, s_off, _F32), [ir.Constant(intp, 0)]))
    builder.store(builder.mul(builder.neg(cs), builder.add(t0, t1)),
                  builder.gep(_ptr(builder, context, xs_ty, xs, s_off, _I32), [ir.Constant(intp, 0)]))
    hp = _ptr(builder, context, xh_ty, xh, builder.mul(s_off, ir.Constant(intp, 2)), _I32)
    builder.store(builder.mul(builder.neg(ch), t0), builder.gep(hp, [ir.Constant(intp, 0)]))
    builder.store(builder.mul(builder.neg(ch), t1), builder.gep(hp, [ir.Constant(intp, 1)]))
    return context.get_dummy_value()


@intrinsic
def _qblock(typingctx, x, x_off, xq, q_off, dx, sx, xs, xh, s_off, cs, ch):
    return types.void(x, x_off, xq, q_off, dx, sx, xs, xh, s_off, cs, ch), _qblock_codegen


@njit(cache=True, inline="always", error_model="numpy")
def _quantize_row(x, i, xq, dx, sx, xs, xh, cs, ch):
    """quantize_x for row i."""
    k = x.shape[1]
    nb = k // QB
    for b in range(nb):
        _qblock(x, i * k + b * QB, xq, i * k + b * QB, dx, sx, xs, xh, i * nb + b, cs, ch)


@njit(cache=True, error_model="numpy")
def _quantize_serial(x, xq, dx, sx, xs, xh, cs, ch):
    for i in range(x.shape[0]):
        _quantize_row(x, i, xq, dx, sx, xs, xh, cs, ch)


@njit(cache=True, parallel=True, error_model="numpy")
def _quantize_parallel(x, xq, dx, sx, xs, xh, cs, ch):
    for i in prange(x.shape[0]):
        _quantize_row(x, i, xq, dx, sx, xs, xh, cs, ch)


PARALLEL_QUANTIZE_ROWS = 32   # from this many rows quantize_x runs on every thread


@njit(cache=True, error_model="numpy")
def quantize_x(x, xq, dx, sx, xs, xh, cs, ch):
    """x (n, k) float32 -> xq (n, k) int8 in [-127, 127], dx (n, k/32) float32 block
    scales (max |x| / 127), sx (n, k/32) float32 block sums of x, xs (n, k/32) int32 =
    -cs * (sum of the block's xq), xh (n, k/16) int32 = -ch * (sum of each 16-input half's
    xq) (cs, ch: `corrections`). xq = rint(x * (127 / max|x|)), ties to even; a block of
    zeros gives dx = 0 and xq = 0. max|x| is taken on the bit patterns (exact).

    Order of sx: p_j = ((x_j + x_8+j) + x_16+j) + x_24+j for j < 8, then
    ((p0 + p4) + (p2 + p6)) + ((p1 + p5) + (p3 + p7)); every operation IEEE float32 (no
    fast-math), so the result does not depend on vectorization or on whether rows run on
    one thread or several: a row's outputs depend on that row alone."""
    if x.shape[0] >= PARALLEL_QUANTIZE_ROWS:
        _quantize_parallel(x, xq, dx, sx, xs, xh, cs, ch)
    else:
        _quantize_serial(x, xq, dx, sx, xs, xh, cs, ch)


# ------------------------------------------------------------------ the matmul kernel
# Parallel over chunks of 32-row tiles; inside a tile, 8-row lane groups; inside those,
# activation rows in groups of 8, 4 and 1 that share each weight load. A row's float
# arithmetic is the same whichever group it falls in (see _lanes_codegen), so the
# grouping (which depends on n) never shows in the result.

@njit(cache=True, error_model="numpy")
def _group(n, i):
    """Activation rows to take at once from row i of n: 8, 4 or 1."""
    if n - i >= 8:
        return 8
    if n - i >= 4:
        return 4
    return 1


@njit(cache=True, inline="always", error_model="numpy")
def _tiles(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out, t0, t1, acc):
    """Output tiles t0..t1-1 of gemm (acc: 64 float32 scratch)."""
    nt, nb, G, RR, C = qs.shape
    S = d.shape[2]
    n, m = out.shape
    k = xq.shape[1]
    for t in range(t0, t1):
        for r0 in range(0, RR, LANES):
            r1 = min(LANES, m - t * RR - r0)
            if r1 <= 0:
                break
            w_off = (t * nb * G * RR + r0) * C
            if qh.ndim == 4:        # a compact kind's super-block scales (T, nsb, n, R)
                h_off = t * qh.shape[1] * qh.shape[2] * qh.shape[3] + r0
            else:
                h_off = t * nb * 32 + (r0 // LANES) * 2
            d_off = t * nb * S * RR + r0
            i = 0
            while i < n:
                nr = _group(n, i)
                if nr == 8:
                    _lanes(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, i * k, dx, sx, xs, xh, i * nb, nb, k,
                           acc, 8)
                elif nr == 4:
                    _lanes(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, i * k, dx, sx, xs, xh, i * nb, nb, k,
                           acc, 4)
                else:
                    _lanes(kind, isa, qs, qh, w_off, h_off, d, mn, d_off, xq, i * k, dx, sx, xs, xh, i * nb, nb, k,
                           acc, 1)
                for ii in range(nr):
                    for r in range(r1):
                        out[i + ii, t * RR + r0 + r] = acc[ii * LANES + r]
                i += nr


@njit(cache=True, parallel=True, error_model="numpy")
def _gemm_parallel(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out, n_chunks):
    nt = qs.shape[0]
    per = (nt + n_chunks - 1) // n_chunks
    for c in prange(n_chunks):
        acc = np.empty(8 * LANES, np.float32)
        _tiles(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out, c * per, min(nt, (c + 1) * per), acc)


@njit(cache=True, error_model="numpy")
def _gemm_serial(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out):
    acc = np.empty(8 * LANES, np.float32)
    _tiles(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out, 0, qs.shape[0], acc)


# Below this many multiply-adds a matmul runs on the calling thread alone: a parallel
# region's fork and join (a few microseconds on idle cores, milliseconds when another
# process holds one) cost more than they save. Decode's layer matmuls are 0.1-1 M: the
# small K/V projections stay on one thread, the rest spread.
PARALLEL_MACS = 150_000


@njit(cache=True, error_model="numpy")
def gemm(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out, n_chunks):
    """Weight tiles x int8 activations, out (n, m) float32.

    kind: Q4, Q5, Q8 or Q8X2; isa: VNNI, AVX2 or PORTABLE. qs (T, nb, G, 32, 4) uint8
    / int8 tiles, qh (T, nb, 4, 4, 2) uint32 high bits (Q5; any uint32 array otherwise),
    d and mn (T, nb, S, 32) float32 or float16 bits (S scales per block and row; mn
    unused, any such array, for Q8 and Q8X2), xq (n, k) int8, dx / sx (n, nb) float32, xs (n,
    nb) int32, xh (n, 2 nb) int32 (quantize_x), out (n, m). out[i, t*32 + r] = the sum
    over blocks, in order, of the module docstring's t for that kind. Tiles are split
    over n_chunks parallel jobs when the work is at least PARALLEL_MACS; a tile's
    arithmetic is the same either way.
    """
    n, m = out.shape
    if n_chunks > 1 and n * m * xq.shape[1] >= PARALLEL_MACS:
        _gemm_parallel(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out, n_chunks)
    else:
        _gemm_serial(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out)


@njit(cache=True, error_model="numpy")
def matmul(kind, isa, qs, qh, d, mn, x, xq, dx, sx, xs, xh, out, n_chunks, cs, ch):
    """quantize_x then gemm in one call (one numba dispatch per matmul, not two).
    x (n, k) float32; xq, dx, sx, xs, xh scratch as quantize_x fills them (cs, ch =
    corrections(kind, isa)); out (n, m)."""
    quantize_x(x, xq, dx, sx, xs, xh, cs, ch)
    gemm(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out, n_chunks)
