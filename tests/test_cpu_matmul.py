"""cpu_matmul.QuantMatrix: every supported type on both paths, against references no one
here wrote (gguf.quants.dequantize, float64 numpy), and its batch invariance.

* `decompose` (the integer form the kernels run on) must equal gguf's dequantization bit
  for bit: D * q (+ M) in float32.
* matmul against float64 on the dequantized weights: the float path is within 1e-5
  relative (float32 accumulation; observed ~2e-7), the integer path within 2e-2 (int8
  activations, llama.cpp's Q8_1 rounding; observed ~5e-3). The integer kernel's exact
  arithmetic is test_cpu_qdot.py's business.
* Every row of a call is bit-identical to the same row computed alone, on both paths.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import quants
from aotx.engine.backend.cpu import matmul as cpu_matmul
from aotx.engine.backend.cpu import repack as cpu_repack
from aotx.engine.backend.cpu.matmul import QuantMatrix
from tests.conftest_quant_helpers import make_raw

TYPES = sorted(quants.SUPPORTED_TYPES, key=lambda t: t.value)
RTOL = 1e-5
RTOL_INT8 = 2e-2       # int8 activations vs float64 (llama.cpp's Q8_1 rounding)


def _k(qtype: T, small: int = 96) -> int:
    return 512 if gguf.GGML_QUANT_SIZES[qtype][0] >= 256 else small


def _raw(qtype: T, m: int, k: int, rng) -> np.ndarray:
    from tests.test_cpu_qdot import raw_weights

    return raw_weights(qtype, m, k, rng)


def _ref_weights(raw, qtype, k):
    if qtype == T.F32:
        return np.asarray(raw, np.float64)
    return gguf.quants.dequantize(np.asarray(raw), qtype).reshape(-1, k).astype(np.float64)


def _rel(out, ref):
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("qtype", sorted(cpu_repack.KIND_OF, key=lambda t: t.value), ids=lambda t: t.name)
def test_decompose_equals_gguf_dequantize_bit_for_bit(qtype):
    rng = np.random.default_rng(int(qtype))
    k = _k(qtype, 256)
    raw = _raw(qtype, 37, k, rng)
    q, D, M, B = cpu_repack.decompose(cpu_repack._byte_rows(raw, qtype, k), qtype, k)
    assert q.dtype == np.int8 and D.dtype == np.float32 and D.shape == (37, k // B)
    want = gguf.quants.dequantize(np.asarray(raw), qtype).reshape(37, k).astype(np.float32)
    np.testing.assert_array_equal(cpu_repack.combine(q, D, M, B), want)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("n", [1, 3, 17, 64])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_matches_float64_reference(qtype, n, int8):
    rng = np.random.default_rng(n * 131 + qtype.value)
    k = _k(qtype)
    m = 75                                       # not a multiple of the tile (R rows)
    raw = _raw(qtype, m, k, rng)
    qm = QuantMatrix(raw, qtype, m, k, "blk.0.test", int8=int8)
    assert qm.int8 == (int8 and qtype in cpu_repack.KIND_OF)
    x = rng.standard_normal((n, k)).astype(np.float32)
    out = qm.matmul(x)
    assert out.shape == (n, m) and out.dtype == np.float32
    assert _rel(out, x.astype(np.float64) @ _ref_weights(raw, qtype, k).T) < (RTOL_INT8 if qm.int8 else RTOL)


@pytest.mark.parametrize("int8", [False, True], ids=["f32", "int8"])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_are_bit_identical_alone_and_in_any_batch(qtype, int8):
    """Batch invariance (DESIGN.md): row i of an n-row call equals row i computed alone,
    for n across the kernels' row groupings (and the GEMV / prefill sizes of before)."""
    rng = np.random.default_rng(qtype.value)
    k, m = _k(qtype), 70
    qm = QuantMatrix(_raw(qtype, m, k, rng), qtype, m, k, int8=int8)
    x = rng.standard_normal((37, k)).astype(np.float32)
    alone = np.concatenate([qm.matmul(x[i:i + 1]) for i in range(37)])
    for n in (2, 4, 5, 8, 9, 16, 37):
        np.testing.assert_array_equal(qm.matmul(x[:n]), alone[:n])
    out = np.full((5, m), np.nan, np.float32)
    assert qm.matmul(x[30:35], out) is out
    np.testing.assert_array_equal(out, alone[30:35])
    np.testing.assert_array_equal(qm.matmul(x[:3], per_row=True), alone[:3])   # accepted, ignored


def test_float_path_tiles_do_not_change_results(monkeypatch):
    """The float path dequantizes a tile of rows at a time; the tile size (here forced to
    64 rows) changes nothing, bit for bit."""
    rng = np.random.default_rng(9)
    m = 300
    for qtype, k in ((T.Q8_0, 96), (T.Q4_1, 96), (T.Q2_K, 256)):
        x = rng.standard_normal((9, k)).astype(np.float32)
        raw = make_raw(qtype, m, k, rng)
        big = QuantMatrix(raw, qtype, m, k, int8=False).matmul(x)
        monkeypatch.setattr(cpu_matmul, "TILE_FLOATS", 64 * 96)
        monkeypatch.setattr(cpu_matmul, "_local", type(cpu_matmul._local)())
        np.testing.assert_array_equal(QuantMatrix(raw, qtype, m, k, int8=False).matmul(x), big)
        monkeypatch.undo()
        assert _rel(big, x.astype(np.float64) @ _ref_weights(raw, qtype, k).T) < RTOL


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_equal_gguf_dequantize(qtype):
    rng = np.random.default_rng(qtype.value)
    k = 256
    raw = _raw(qtype, 70, k, rng)
    qm = QuantMatrix(raw, qtype, 70, k)
    ids = np.array([0, 69, 33, 33, -1])
    np.testing.assert_array_equal(qm.rows(ids), _ref_weights(raw, qtype, k).astype(np.float32)[ids])
    assert qm.rows(np.array([], np.int64)).shape == (0, k)


def test_readonly_memmap_input_is_not_copied_for_file_layout_types(tmp_path):
    rng = np.random.default_rng(3)
    raw = make_raw(T.Q2_K, 8, 256, rng)
    p = tmp_path / "w.bin"
    raw.tofile(p)
    mm = np.memmap(p, np.uint8, "r", shape=raw.shape)
    qm = QuantMatrix(mm, T.Q2_K, 8, 256)
    assert not qm.int8 and np.shares_memory(qm._raw, mm)
    assert qm.nbytes == raw.nbytes


def test_repacked_memory_is_as_documented():
    """Bytes per weight of the integer layouts (cpu_matmul's docstring), against the file."""
    rng = np.random.default_rng(4)
    for qtype, limit in ((T.Q4_1, 1.0), (T.Q4_0, 1.12), (T.Q4_K, 1.34), (T.Q8_0, 1.0), (T.Q5_0, 1.1),
                         (T.Q5_1, 1.0), (T.Q5_K, 1.28), (T.Q6_K, 1.53)):
        k = _k(qtype, 576)
        raw = make_raw(qtype, 256, k, rng)
        assert QuantMatrix(raw, qtype, 256, k).nbytes <= limit * raw.nbytes + 64, qtype.name


def test_q4_0_scales_beyond_float16_fall_back_to_float32():
    """-8 d overflows float16 when |d| > 8188: those tiles keep float32 scales, same results."""
    rng = np.random.default_rng(6)
    raw = make_raw(T.Q4_0, 40, 64, rng)
    raw.reshape(40, -1, 18)[3, 1, 0:2] = np.array([9000.0], np.float16).view(np.uint8)
    qm = QuantMatrix(raw, T.Q4_0, 40, 64)
    assert qm._d.dtype == np.float32
    x = rng.standard_normal((3, 64)).astype(np.float32)
    ref = x.astype(np.float64) @ gguf.quants.dequantize(raw, T.Q4_0).reshape(40, 64).astype(np.float64).T
    assert _rel(qm.matmul(x), ref) < RTOL_INT8


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
        qf = QuantMatrix(t.data, t.tensor_type, m, k, name, int8=False)
        qi = QuantMatrix(t.data, t.tensor_type, m, k, name)
        sel = rng.integers(0, m, 64)
        w = gguf.quants.dequantize(np.asarray(t.data[sel]), t.tensor_type).astype(np.float64)
        x = rng.standard_normal((1, k)).astype(np.float32)
        assert _rel(qf.matmul(x)[:, sel], x.astype(np.float64) @ w.T) < RTOL
        assert _rel(qi.matmul(x)[:, sel], x.astype(np.float64) @ w.T) < RTOL_INT8
        np.testing.assert_array_equal(qi.rows(sel[:5]), w[:5].astype(np.float32))
