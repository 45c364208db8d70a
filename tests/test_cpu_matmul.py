"""cpu_matmul.QuantMatrix: matmul against a float64 reference on the dequantized weights,
rows() against gguf.quants.dequantize, every supported type, GEMV and BLAS paths.

Tolerance: activations stay float32 (no int8 quantization of x), so the only error is
float32 accumulation: ||out - ref|| / ||ref|| < 1e-5 (observed ~3e-7)."""

from __future__ import annotations

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import cpu_matmul, quants
from aotx.engine.backend.cpu_matmul import QuantMatrix
from tests.conftest_quant_helpers import make_raw

TYPES = sorted(quants.SUPPORTED_TYPES, key=lambda t: t.value)
K_TYPES = {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
RTOL = 1e-5


def _ref_weights(raw, qtype, k):
    if qtype == T.F32:
        return np.asarray(raw, np.float64)
    return gguf.quants.dequantize(raw, qtype).reshape(-1, k).astype(np.float64)


def _rel(out, ref):
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("n", [1, 3, 17, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_reference(qtype, n):
    rng = np.random.default_rng(n * 131 + qtype.value)
    k = 512 if qtype in K_TYPES else 96
    m = 75                                       # not a multiple of the 32-row tile
    raw = make_raw(qtype, m, k, rng)
    w = _ref_weights(raw, qtype, k)
    qm = QuantMatrix(raw, qtype, m, k, "blk.0.test")
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = qm.matmul(x)
    assert out.shape == (n, m) and out.dtype == np.float32
    assert _rel(out, x.astype(np.float64) @ w.T) < RTOL


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q8_0], ids=lambda t: t.name)
@pytest.mark.parametrize("seed", range(4))
def test_repacked_gemv_and_blas_paths_agree(qtype, seed):
    rng = np.random.default_rng(seed)
    m, k = int(rng.integers(1, 300)), 32 * int(rng.integers(1, 40))
    raw = make_raw(qtype, m, k, rng)
    w = _ref_weights(raw, qtype, k)
    qm = QuantMatrix(raw, qtype, m, k)
    for n in (1, cpu_matmul.GEMV_MAX_N, cpu_matmul.GEMV_MAX_N + 1, 40):
        x = rng.standard_normal((n, k)).astype(np.float32)
        out = np.full((n, m), np.nan, np.float32)
        assert qm.matmul(x, out) is out
        assert _rel(out, x.astype(np.float64) @ w.T) < RTOL


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
    with pytest.raises(quants.UnsupportedTensorType, match="IQ4_XS"):
        QuantMatrix(raw, T.IQ4_XS, 4, 256)


def test_default_model_head_and_layer(default_model_path):
    reader = gguf.GGUFReader(default_model_path, "r")
    by_name = {t.name: t for t in reader.tensors}
    rng = np.random.default_rng(0)
    for name in ("blk.0.ffn_down.weight", "token_embd.weight"):
        t = by_name[name]
        k, m = (int(s) for s in t.shape)
        qm = QuantMatrix(t.data, t.tensor_type, m, k, name)
        sel = rng.integers(0, m, 64)
        w = gguf.quants.dequantize(np.asarray(t.data[sel]), t.tensor_type).astype(np.float64)
        x = rng.standard_normal((1, k)).astype(np.float32)
        assert _rel(qm.matmul(x)[:, sel], x.astype(np.float64) @ w.T) < RTOL
        np.testing.assert_array_equal(qm.rows(sel[:5]), w[:5].astype(np.float32))
