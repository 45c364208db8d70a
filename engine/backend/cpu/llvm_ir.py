"""LLVM IR building blocks for the CPU kernels' numba intrinsics.

Owns: the vector types, splats, pointer arithmetic, x86 intrinsic calls, one-rounding
``llvm.fma``, exact float16 widening (F16C where the CPU has it, integer bit
manipulation elsewhere), lane reductions, ``bits_f32`` and the CPU features numba
compiles for (``_features``). Shared by the integer step (``lanes.py``), activation
quantization (``qdot.py``) and the float dot products (``fdot.py``).
Leaves to others: every kernel's arithmetic and its order.
"""

from __future__ import annotations

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

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
