"""Integer matmul on the CPU: int8-quantized activations times repacked weight tiles.

Owns: ``quantize_x`` (activations to int8 per 32-block, as llama.cpp's Q8_1 does, its
block step as LLVM IR: ``_qblock``) and the matmul kernel ``gemm`` (and ``matmul``:
both in one call; ``matmul_serial``: the same on one thread, quick to compile) over the
tiles that ``repack.py`` builds, for every row count n:
parallel over chunks of R-row tiles (markers.R), 8-row lane groups inside a tile, activation rows
in groups of 8, 4 and 1 sharing each weight load. Leaves to others: the integer step
and its arithmetic (``lanes.py``), the markers (``markers.py``), the weight layouts and
which tensor takes which kernel (``repack.py``, ``matmul.py``).

Batch invariance (DESIGN.md): out[i, j] is computed by one fixed sequence of operations
that depends only on x[i] and weight row j - not on n, on the other rows, on how rows
are grouped to share a weight load, on the thread that runs it, or on the instruction
set. Prefill, decode and speculative verify rows all take this one kernel.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from aotx.engine.backend.cpu.lanes import _lanes
from aotx.engine.backend.cpu.llvm_ir import _F32, _I8, _I32, _V8F32, _V8I32, _hreduce, _ptr, _splat, _splat_value
from aotx.engine.backend.cpu.markers import LANES, QB, R

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
# Parallel over chunks of R-row tiles; inside a tile, 8-row lane groups; inside those,
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
                h_off = t * nb * R + (r0 // LANES) * 2
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

    kind: Q4, Q5, Q8 or Q8X2; isa: VNNI, AVX2 or PORTABLE. qs (T, nb, G, R, 4) uint8
    / int8 tiles, qh (T, nb, 4, R/8, 2) uint32 high bits (Q5; any uint32 array otherwise),
    d and mn (T, nb, S, R) float32 or float16 bits (S scales per block and row; mn
    unused, any such array, for Q8 and Q8X2), xq (n, k) int8, dx / sx (n, nb) float32, xs (n,
    nb) int32, xh (n, 2 nb) int32 (quantize_x), out (n, m). out[i, t*R + r] = the sum
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


@njit(cache=True, error_model="numpy")
def matmul_serial(kind, isa, qs, qh, d, mn, x, xq, dx, sx, xs, xh, out, n_chunks, cs, ch):
    """``matmul`` on the calling thread alone (its arguments, its numbers bit for bit: the
    same tiles in the same order). It compiles without the parallel regions, in a fraction
    of the time: an engine's first reply runs on it while ``matmul`` compiles
    (``warmup.py``)."""
    _quantize_serial(x, xq, dx, sx, xs, xh, cs, ch)
    _gemm_serial(kind, isa, qs, qh, d, mn, xq, dx, sx, xs, xh, out)
