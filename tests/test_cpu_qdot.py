"""cpu_qdot's integer matmul kernel, bit for bit, on every instruction set and weight kind.

The kernel promises (cpu_qdot's module docstring) exact int32 block sums and then a fixed
float32 sequence per output: for each block b, u = dx * float(S) (one rounding), then
main = fma(d, u, main) and, for the kinds with a minimum, second = fma(c, sx, second)
(Q8X2: second = fma(d_1, dx * float(S_1), second)), and at the end main + second. This
file re-computes that sequence in numpy from the GGUF bytes (repack.decompose, itself
checked against gguf's dequantization in test_cpu_matmul.py) with an exact fused
multiply-add, and requires equality on the VNNI, AVX2 and portable paths; then that a
row's bits never depend on the other rows of the call, whatever their number."""

from __future__ import annotations

import struct
from fractions import Fraction

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend.cpu import markers as cpu_markers
from aotx.engine.backend.cpu import qdot as cpu_qdot
from aotx.engine.backend.cpu import repack as cpu_repack
from aotx.engine.backend.cpu.matmul import QuantMatrix
from tests.conftest_quant_helpers import make_raw

TYPES = [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4]
ISAS = [pytest.param(cpu_markers.PORTABLE, id="portable"),
        pytest.param(cpu_markers.AVX2, id="avx2",
                     marks=pytest.mark.skipif(not cpu_markers.host_has_avx2(), reason="CPU without AVX2")),
        pytest.param(cpu_markers.VNNI, id="vnni",
                     marks=pytest.mark.skipif(not cpu_markers.host_has_vnni(), reason="CPU without AVX-VNNI"))]


def raw_weights(qtype: T, m: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """GGUF rows of ``qtype``; the IQ4 types get random blocks with sane float16 scales."""
    if qtype in (T.IQ4_NL, T.IQ4_XS, T.MXFP4):
        import gguf

        be, bb = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (m, k // be, bb), dtype=np.uint8)
        if qtype == T.MXFP4:
            blocks[:, :, 0] = rng.integers(118, 124, (m, k // be))      # e8m0 scales ~2^-8
        else:
            blocks[:, :, 0:2] = (rng.uniform(0.5, 2.0, (m, k // be)) * 1e-3).astype(np.float16).view(
                np.uint8).reshape(m, k // be, 2)
        return blocks.reshape(m, -1)
    return make_raw(qtype, m, k, rng)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c rounded once (IEEE fusedMultiplyAdd). float64 holds a * b exactly;
    where a * b + c is not exact in float64 (TwoSum error), Fraction decides."""
    a, b, c = np.broadcast_arrays(*(np.atleast_1d(np.asarray(v, np.float32)).astype(np.float64) for v in (a, b, c)))
    p = a * b
    s = p + c
    bp = s - p
    err = (p - (s - bp)) + (c - bp)
    out = s.astype(np.float32)
    for idx in zip(*np.nonzero(err != 0)):
        exact = Fraction(float(a[idx])) * Fraction(float(b[idx])) + Fraction(float(c[idx]))
        out[idx] = _round_f32(exact)
    return out


def _round_f32(x: Fraction) -> np.float32:
    """Nearest float32 to the rational x, ties to even."""
    f = np.float32(float(x))                     # within one float32 ulp of the answer
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - x),
                                     struct.unpack("<I", struct.pack("<f", float(c)))[0] & 1))
    return np.float32(best)


def quantized(x: np.ndarray, kind: str, isa: str):
    n, k = x.shape
    nb = k // 32
    bufs = (np.empty((n, k), np.int8), np.empty((n, nb), np.float32), np.empty((n, nb), np.float32),
            np.empty((n, nb), np.int32), np.empty((n, 2 * nb), np.int32))
    cs, ch = cpu_markers.corrections(kind, isa)
    cpu_qdot.quantize_x(x, *bufs, np.int32(cs), np.int32(ch))
    return bufs


def emulate(raw: np.ndarray, qtype: T, k: int, x: np.ndarray) -> np.ndarray:
    """The documented arithmetic in numpy: (n, m) float32."""
    kind = cpu_repack.KIND_OF[qtype]
    xq, dx, sx, _, _ = quantized(x, kind, "portable")
    q, D, M, B = cpu_repack.decompose(cpu_repack._byte_rows(raw, qtype, k), qtype, k)
    n, m, nb = x.shape[0], raw.shape[0], k // 32
    qi = xq.astype(np.int64).reshape(n, nb, 32)
    qw = q.astype(np.int64).reshape(m, nb, 32)
    main = np.zeros((n, m), np.float32)
    second = np.zeros((n, m), np.float32)
    for b in range(nb):
        if kind == "q8x2":
            for h in range(2):
                S = qi[:, b, 16 * h:16 * h + 16] @ qw[:, b, 16 * h:16 * h + 16].T
                u = dx[:, b, None] * S.astype(np.float32)
                acc = main if h == 0 else second
                acc[...] = fma32(D[None, :, 2 * b + h], u, acc)
            continue
        off = cpu_markers.OFFSET.get(kind, 0)
        if qtype in (T.Q4_0, T.Q5_0):                   # q = u - off, w = d u + (-off d)
            qn, Mb = qw[:, b] + off, np.float32(-off) * D[:, b]
        else:
            qn, Mb = qw[:, b], (M[:, b] if M is not None else None)
        S = qi[:, b] @ (qn - off).T
        u = dx[:, b, None] * S.astype(np.float32)
        main = fma32(D[None, :, b], u, main)
        if Mb is not None:
            c = Mb + np.float32(off) * D[:, b]
            second = fma32(c[None, :], sx[:, b, None], second)
    return main + second if kind in ("q4", "q5", "q8x2") else main


def extreme(raw: np.ndarray, qtype: T) -> np.ndarray:
    """Rows 0..2 at the widest block sums for the int16 lanes of the AVX2 path: every Q4
    nibble 15, every Q8_0 q = -128 (|q| does not fit a signed byte: the sign trick's corner)."""
    raw = raw.copy()
    m = raw.shape[0]
    if qtype in (T.Q4_0, T.Q4_1):
        bb = 18 if qtype == T.Q4_0 else 20
        raw.reshape(m, -1, bb)[:3, :, bb - 16:] = 0xFF
    elif qtype == T.Q8_0:
        raw.reshape(m, -1, 34)[:3, :, 2:] = 0x80
    return raw


def activations(rng, n: int, k: int) -> np.ndarray:
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[0, :32] = 0.0                    # amax = 0: dx = 0, xq = 0
    x[1 % n, 32:64] = -3.0             # every qx = -127
    x[2 % n, :] = 1.0                  # every qx = +127
    x[3 % n, 64:96] = np.linspace(-1.0, 1.0, 32, dtype=np.float32)
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_the_documented_arithmetic_bit_for_bit(qtype, isa):
    rng = np.random.default_rng(int(qtype))
    k = 512 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS) else 160
    m, n = 72, 13                        # 3 tiles (the last partial); rows take groups 8 + 4 + 1
    raw = extreme(raw_weights(qtype, m, k, rng), qtype)
    x = activations(rng, n, k)
    qm = QuantMatrix(raw, qtype, m, k)
    qm.isa = isa
    np.testing.assert_array_equal(qm.matmul(x), emulate(raw, qtype, k, x))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_bits_do_not_depend_on_the_batch(qtype):
    """Batch invariance of the kernel: each row alone equals the same row inside calls of
    every size from 2 to 40 rows (groups of 8, 4 and 1 share weight loads differently;
    from 32 rows quantize_x runs on every thread)."""
    rng = np.random.default_rng(3)
    k = 256 if qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_XS) else 96
    m = 40
    qm = QuantMatrix(raw_weights(qtype, m, k, rng), qtype, m, k)
    x = activations(rng, 40, k)
    alone = np.concatenate([qm.matmul(x[i:i + 1]) for i in range(40)])
    for n in range(2, 41):
        lo = int(rng.integers(0, 41 - n))
        np.testing.assert_array_equal(qm.matmul(x[lo:lo + n]), alone[lo:lo + n])


def test_markers_are_checked():
    qm = QuantMatrix(make_raw(T.Q8_0, 32, 32, np.random.default_rng(0)), T.Q8_0, 32, 32)
    qm.isa = np.int32(0)
    with pytest.raises(Exception, match="isa marker"):
        qm.matmul(np.ones((1, 32), np.float32))


@pytest.mark.parametrize("kind,isa", [("q4", "vnni"), ("q8", "avx2"), ("q5", "vnni"), ("q8", "vnni"), ("q8x2", "vnni")])
def test_quantize_x_follows_its_documented_rounding(kind, isa):
    """xq = rint(x * (127 / amax)) (ties to even), dx = amax / 127, sx = the block sum in
    the documented order, xs / xh = -corrections * (sums of xq); float32 throughout."""
    rng = np.random.default_rng(5)
    n, k = 40, 96                        # 40 rows: the parallel path
    x = activations(rng, n, k)
    x[5, :32] = np.arange(32, dtype=np.float32) - 15.5    # exact .5 ties after scaling by 127/16.5
    xq, dx, sx, xs, xh = quantized(x, kind, isa)
    xb = x.reshape(n, 3, 32)
    amax = np.abs(xb).max(axis=2)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8)
    np.testing.assert_array_equal(xq, q.reshape(n, k))
    np.testing.assert_array_equal(dx, amax / np.float32(127.0))
    cs, ch = cpu_markers.corrections(kind, isa)
    np.testing.assert_array_equal(xs, -cs * q.astype(np.int32).sum(axis=2))
    np.testing.assert_array_equal(xh, -ch * q.astype(np.int32).reshape(n, 6, 16).sum(axis=2))
    p = ((xb[:, :, 0:8] + xb[:, :, 8:16]) + xb[:, :, 16:24]) + xb[:, :, 24:32]
    s = ((p[..., 0] + p[..., 4]) + (p[..., 2] + p[..., 6])) + ((p[..., 1] + p[..., 5]) + (p[..., 3] + p[..., 7]))
    np.testing.assert_array_equal(sx, s)
    assert np.abs(sx - xb.astype(np.float64).sum(axis=2)).max() < 1e-5


def test_fma_emulation_guards_itself():
    """The test's exact fma against a case where separate rounding differs: a*b + c with
    a*b needing more than 24 bits."""
    a = np.float32(1 + 2 ** -12)
    c = np.float32(-1.0)
    assert fma32(a, a, c)[0] == np.float32(2 ** -11 + 2 ** -24)
    assert np.float32(a * a) + c != fma32(a, a, c)[0]
