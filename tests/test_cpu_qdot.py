"""cpu_qdot's int8 GEMV kernels, bit for bit.

The kernels promise (cpu_qdot's module docstring) exact int32 block sums and then a fixed
float32 sequence per output: acc = acc + (d * (dx * S) + c * sx) for Q4 (c = mn + 8 d,
S = sum (q - 8) qx) and acc = acc + d * (dx * S) for Q8_0, block by block, no FMA. numpy's
float32 elementwise arithmetic rounds every operation the same way, so an emulation from
the GGUF bytes (not from the repacked tiles) must match exactly, on the AVX2 path and on
the portable one; and a row's bits must not depend on the other rows of the call (decode
rows are batched in groups of 8, 4 and 1)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import cpu_qdot
from aotx.engine.backend.cpu_matmul import QuantMatrix
from tests.conftest_quant_helpers import make_raw

TYPES = (T.Q4_0, T.Q4_1, T.Q8_0)
ISAS = [pytest.param(cpu_qdot.PORTABLE, id="portable"),
        pytest.param(cpu_qdot.AVX2, id="avx2",
                     marks=pytest.mark.skipif(not cpu_qdot.host_has_avx2(), reason="CPU without AVX2"))]


def _gguf_fields(raw: np.ndarray, qtype: T, k: int):
    """(q, d, mn) from GGUF rows: q (m, k) int64 quant values in input order (Q4 nibbles
    0..15, Q8_0 signed), d and mn (m, nb) float32 (ggml-common.h block_q4_0 / q4_1 / q8_0)."""
    m = raw.shape[0]
    nb = k // 32
    bb = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}[qtype]
    blocks = np.asarray(raw).reshape(m, nb, bb)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float32)
    if qtype == T.Q8_0:
        return blocks[:, :, 2:34].view(np.int8).astype(np.int64).reshape(m, k), d, None
    off = 4 if qtype == T.Q4_1 else 2
    qb = blocks[:, :, off:off + 16].astype(np.int64)
    q = np.concatenate([qb & 15, qb >> 4], axis=2).reshape(m, k)     # low nibbles: inputs 0..15
    mn = (blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float32) if qtype == T.Q4_1
          else np.float32(-8.0) * d)
    return q, d, mn


def _emulate(raw: np.ndarray, qtype: T, k: int, x: np.ndarray) -> np.ndarray:
    """The documented arithmetic in numpy: (n, m) float32."""
    n = x.shape[0]
    nb = k // 32
    xq = np.empty((n, k), np.int8)
    dx = np.empty((n, nb), np.float32)
    sx = np.empty((n, nb), np.float32)
    x8 = np.empty((n, nb), np.int32)
    cpu_qdot.quantize_x(x, xq, dx, sx, x8)
    q, d, mn = _gguf_fields(raw, qtype, k)
    qi = xq.astype(np.int64).reshape(n, nb, 32)
    acc = np.zeros((n, raw.shape[0]), np.float32)
    for b in range(nb):
        S = qi[:, b] @ q[:, b * 32:(b + 1) * 32].T                  # (n, m) exact
        if qtype == T.Q8_0:
            acc = acc + d[None, :, b] * (dx[:, b, None] * S.astype(np.float32))
        else:
            S = S - 8 * qi[:, b].sum(axis=1, keepdims=True)
            c = mn[:, b] + np.float32(8.0) * d[:, b]
            acc = acc + (d[None, :, b] * (dx[:, b, None] * S.astype(np.float32)) + c[None, :] * sx[:, b, None])
    return acc


def _extreme_weights(raw: np.ndarray, qtype: T) -> np.ndarray:
    """Rows 0..2 at the widest block sums: every nibble 15 (Q4), every q = -128 (Q8_0,
    |q| does not fit a signed byte: the sign trick's corner)."""
    raw = raw.copy()
    m = raw.shape[0]
    bb = {T.Q4_0: 18, T.Q4_1: 20, T.Q8_0: 34}[qtype]
    blocks = raw.reshape(m, -1, bb)
    blocks[:3, :, bb - (32 if qtype == T.Q8_0 else 16):] = 0x80 if qtype == T.Q8_0 else 0xFF
    return raw


def _activations(rng, n: int, k: int) -> np.ndarray:
    x = rng.standard_normal((n, k)).astype(np.float32)
    x[0, :32] = 0.0                    # amax = 0: dx = 0, xq = 0
    x[1 % n, 32:64] = -3.0             # every qx = -127
    x[2 % n, :] = 1.0                  # every qx = +127
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_kernel_equals_float32_emulation_bit_for_bit(qtype, isa):
    rng = np.random.default_rng(qtype.value)
    m, k, n = 72, 160, 13               # 3 tiles (last one partial), 5 blocks; rows 8 + 4 + 1
    raw = _extreme_weights(make_raw(qtype, m, k, rng), qtype)
    x = _activations(rng, n, k)
    qm = QuantMatrix(raw, qtype, m, k, int8=True)
    qm.isa = isa
    out = qm.matmul(x, per_row=True)
    np.testing.assert_array_equal(out, _emulate(raw, qtype, k, x))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_avx2_and_portable_paths_agree(qtype):
    if not cpu_qdot.host_has_avx2():
        pytest.skip("CPU without AVX2")
    rng = np.random.default_rng(7)
    m, k = 96, 576
    raw = _extreme_weights(make_raw(qtype, m, k, rng), qtype)
    x = _activations(rng, 11, k)
    qm = QuantMatrix(raw, qtype, m, k, int8=True)
    a = qm.matmul(x, per_row=True)
    qm.isa = cpu_qdot.PORTABLE
    np.testing.assert_array_equal(a, qm.matmul(x, per_row=True))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_row_bits_do_not_depend_on_the_batch(qtype):
    """Batch invariance: each row alone (R = 1) equals the same row inside batches of 8,
    4 + 1 and 16 + 1 rows, which take the kernels' 8-, 4- and 1-row groups."""
    rng = np.random.default_rng(3)
    m, k = 64, 192
    raw = make_raw(qtype, m, k, rng)
    qm = QuantMatrix(raw, qtype, m, k, int8=True)
    x = _activations(rng, 17, k)
    alone = np.concatenate([qm.matmul(x[i:i + 1], per_row=True) for i in range(17)])
    for n in (8, 5, 17):
        np.testing.assert_array_equal(qm.matmul(x[:n], per_row=True), alone[:n])
    np.testing.assert_array_equal(qm.matmul(x[9:17], per_row=True), alone[9:17])


def test_isa_marker_is_checked():
    qm = QuantMatrix(make_raw(T.Q8_0, 32, 32, np.random.default_rng(0)), T.Q8_0, 32, 32, int8=True)
    qm.isa = np.int32(0)
    with pytest.raises(Exception, match="isa marker"):
        qm.matmul(np.ones((1, 32), np.float32))


def test_quantize_x_follows_its_documented_rounding():
    """xq = rint(x * (127 / amax)) (ties to even), dx = amax / 127, sx = the block sum in
    the documented order, x8 = 8 * sum xq; float32 throughout."""
    rng = np.random.default_rng(5)
    n, k = 3, 96
    x = _activations(rng, n, k)
    xq = np.empty((n, k), np.int8)
    dx, sx = np.empty((n, 3), np.float32), np.empty((n, 3), np.float32)
    x8 = np.empty((n, 3), np.int32)
    cpu_qdot.quantize_x(x, xq, dx, sx, x8)
    xb = x.reshape(n, 3, 32)
    amax = np.abs(xb).max(axis=2)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(xb * inv[:, :, None]).astype(np.int8)
    np.testing.assert_array_equal(xq, q.reshape(n, k))
    np.testing.assert_array_equal(dx, amax / np.float32(127.0))
    np.testing.assert_array_equal(x8, 8 * q.astype(np.int32).sum(axis=2))
    p = ((xb[:, :, 0:8] + xb[:, :, 8:16]) + xb[:, :, 16:24]) + xb[:, :, 24:32]
    s = ((p[..., 0] + p[..., 4]) + (p[..., 2] + p[..., 6])) + ((p[..., 1] + p[..., 5]) + (p[..., 3] + p[..., 7]))
    np.testing.assert_array_equal(sx, s)
    assert np.abs(sx - xb.astype(np.float64).sum(axis=2)).max() < 1e-5
