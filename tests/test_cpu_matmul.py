"""cpu_matmul.QuantMatrix: matmul against a float64 reference on the dequantized weights,
rows() against gguf.quants.dequantize, every supported type, GEMV and BLAS paths.

Tolerances: where activations stay float32 (the BLAS path, and every type that is not
repacked) the only error is float32 accumulation: ||out - ref|| / ||ref|| < 1e-5
(observed ~3e-7). With int8=True the GEMV path of Q4_0/Q4_1/Q8_0 (n <= GEMV_MAX_N) rounds x to int8 per
32-block as llama.cpp does: against float64 it is within 2e-2 (observed ~5e-3), and
against `_int8_reference`, which applies the same rounding in float64, within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import cpu_matmul, quants
from aotx.engine.backend.cpu_matmul import QuantMatrix
from tests.conftest_quant_helpers import make_raw

TYPES = sorted(quants.SUPPORTED_TYPES, key=lambda t: t.value)
K_TYPES = {t for t in TYPES if gguf.GGML_QUANT_SIZES[t][0] == 256}   # Q2_K..Q6_K, IQ4_XS
RTOL = 1e-5
RTOL_INT8 = 2e-2       # int8 activations vs float64 (llama.cpp's Q8_1 rounding)
_REPACKED = (T.Q4_0, T.Q4_1, T.Q8_0)


def _tol(qtype, n, int8=True):
    return RTOL_INT8 if int8 and qtype in _REPACKED and n <= cpu_matmul.GEMV_MAX_N else RTOL


def _int8_reference(raw, qtype, k, x):
    """float64 emulation of the int8-activation GEMV: x rounded per 32-block to
    round(x * 127 / amax) * amax / 127 (float32 scale, ties to even); the Q4_1 weights
    split into d * (q - 8) (times the rounded x) and m + 8 d (times the exact block sum)."""
    n = x.shape[0]
    xb = x.reshape(n, -1, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xr = (np.rint(xb * inv).astype(np.float64) * (amax / np.float32(127.0)).astype(np.float64)).reshape(n, k)
    w = _ref_weights(raw, qtype, k)
    if qtype != T.Q4_1:
        return xr @ w.T
    blocks = np.asarray(raw).reshape(raw.shape[0], -1, 20)
    d = blocks[:, :, 0:2].copy().view(np.float16)[:, :, 0].astype(np.float64)
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
    m8 = m + 8 * d                                            # (rows, nb)
    wc = w - np.repeat(m8, 32, axis=1)
    return xr @ wc.T + xb.sum(axis=2).astype(np.float64) @ m8.T


def _ref_weights(raw, qtype, k):
    if qtype == T.F32:
        return np.asarray(raw, np.float64)
    return gguf.quants.dequantize(raw, qtype).reshape(-1, k).astype(np.float64)


def _rel(out, ref):
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("n", [1, 3, 17, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_reference(qtype, n, int8):
    rng = np.random.default_rng(n * 131 + qtype.value)
    k = 512 if qtype in K_TYPES else 96
    m = 75                                       # not a multiple of the 32-row tile
    raw = make_raw(qtype, m, k, rng)
    w = _ref_weights(raw, qtype, k)
    qm = QuantMatrix(raw, qtype, m, k, "blk.0.test", int8=int8)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = qm.matmul(x)
    assert out.shape == (n, m) and out.dtype == np.float32
    assert _rel(out, x.astype(np.float64) @ w.T) < _tol(qtype, n, int8)
    if _tol(qtype, n, int8) != RTOL:
        assert _rel(out, _int8_reference(raw, qtype, k, x)) < 1e-4


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("seed", range(4))
def test_repacked_gemv_and_blas_paths_agree(qtype, seed, int8):
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(1, 300)), 32 * int(rng.integers(1, 40))
    raw = make_raw(qtype, m, k, rng)
    w = _ref_weights(raw, qtype, k)
    qm = QuantMatrix(raw, qtype, m, k, int8=int8)
    for n in (1, cpu_matmul.GEMV_MAX_N, cpu_matmul.GEMV_MAX_N + 1, 40):
        x = rng.standard_normal((n, k)).astype(np.float32)
        out = np.full((n, m), np.nan, np.float32)
        assert qm.matmul(x, out) is out
        assert _rel(out, x.astype(np.float64) @ w.T) < _tol(qtype, n, int8)
        if int8 and n <= cpu_matmul.GEMV_MAX_N:
            assert _rel(out, _int8_reference(raw, qtype, k, x)) < 1e-4


def test_head_sized_matrix_takes_several_tiles(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "TILE_FLOATS", 64 * 96)    # force 64-row tiles
    monkeypatch.setattr(cpu_matmul, "_local", type(cpu_matmul._local)())
    rng = np.random.default_rng(9)
    m, k = 300, 96
    for qtype in (T.Q8_0, T.Q4_1, T.F16):
        raw = make_raw(qtype, m, k, rng)
        qm = QuantMatrix(raw, qtype, m, k)
        x = rng.standard_normal((9, k)).astype(np.float32)
        assert _rel(qm.matmul(x), x.astype(np.float64) @ _ref_weights(raw, qtype, k).T) < RTOL


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_equal_gguf_dequantize(qtype):
    rng = np.random.default_rng(qtype.value)
    k = 256
    raw = make_raw(qtype, 70, k, rng)
    qm = QuantMatrix(raw, qtype, 70, k)
    ids = np.array([0, 69, 33, 33, -1])
    np.testing.assert_array_equal(qm.rows(ids), _ref_weights(raw, qtype, k).astype(np.float32)[ids])
    assert qm.rows(np.array([], np.int64)).shape == (0, k)


def test_readonly_memmap_input_is_not_copied_for_raw_types(tmp_path):
    rng = np.random.default_rng(3)
    raw = make_raw(T.Q6_K, 8, 256, rng)
    p = tmp_path / "w.bin"
    raw.tofile(p)
    mm = np.memmap(p, np.uint8, "r", shape=raw.shape)
    qm = QuantMatrix(mm, T.Q6_K, 8, 256)
    assert np.shares_memory(qm._raw, mm)
    qm4 = QuantMatrix(np.memmap(p, np.uint8, "r", shape=(8, 210)), T.Q6_K, 8, 256)
    assert qm4.nbytes == raw.nbytes


def test_repacked_memory_stays_near_file_size():
    rng = np.random.default_rng(4)
    for qtype, limit in ((T.Q4_1, 1.25), (T.Q4_0, 1.45), (T.Q8_0, 1.1)):
        raw = make_raw(qtype, 256, 576, rng)
        assert QuantMatrix(raw, qtype, 256, 576).nbytes <= limit * raw.nbytes


def test_shape_errors_name_the_tensor():
    raw = np.zeros((4, 20), np.uint8)
    with pytest.raises(ValueError, match="blk.3.ffn_up: expected 5 rows"):
        QuantMatrix(raw, T.Q4_1, 5, 32, "blk.3.ffn_up")
    qm = QuantMatrix(raw, T.Q4_1, 4, 32, "blk.3.ffn_up")
    with pytest.raises(ValueError, match=r"blk.3.ffn_up: x has shape \(1, 31\)"):
        qm.matmul(np.zeros((1, 31), np.float32))
    with pytest.raises(quants.UnsupportedTensorType, match="IQ2_XXS"):
        QuantMatrix(raw, T.IQ2_XXS, 4, 256)


def test_default_model_head_and_layer(default_model_path):
    reader = gguf.GGUFReader(default_model_path, "r")
    by_name = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(0)
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        t = by_name[name]
        k, m = (int(s) for s in t.shape)
        qm = QuantMatrix(t.data, t.tensor_type, m, k, name)
        qi = QuantMatrix(t.data, t.tensor_type, m, k, name, int8=True)
        sel = rng.integers(0, m, 64)
        w = gguf.quants.dequantize(np.asarray(t.data[sel]), t.tensor_type).astype(np.float64)
        x = rng.standard_normal((1, k)).astype(np.float32)
        assert _rel(qm.matmul(x)[:, sel], x.astype(np.float64) @ w.T) < RTOL
        assert _rel(qi.matmul(x)[:, sel], x.astype(np.float64) @ w.T) < _tol(t.tensor_type, 1)
        np.testing.assert_array_equal(qm.rows(sel[:5]), w[:5].astype(np.float32))


@pytest.mark.parametrize("qtype", _REPACKED, ids=lambda t: t.name)
def test_int8_gemv_edge_rows(qtype):
    """Zero blocks (amax = 0), a block that saturates at +-127 and rows whose unsigned
    int16 nibble sums wrap (all q = 15 times x = +127) stay exact against the emulation."""
    rng = np.random.default_rng(11)
    m, k = 40, 128
    raw = make_raw(qtype, m, k, rng)
    if qtype != T.Q8_0:                                     # all nibbles 15: the widest sums
        bb = 18 if qtype == T.Q4_0 else 20
        blocks = raw.reshape(m, -1, bb)
        blocks[:3, :, bb - 16:] = 0xFF
    x = rng.standard_normal((3, k)).astype(np.float32)
    x[0, :32] = 0.0
    x[1, 32:64] = 5.0
    x[2] = 1.0
    qm = QuantMatrix(raw, qtype, m, k, int8=True)
    out = qm.matmul(x)
    assert np.isfinite(out).all()
    assert _rel(out, _int8_reference(raw, qtype, k, x)) < 1e-4
