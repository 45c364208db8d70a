"""quants.py: every supported type's dequantization equals gguf.quants.dequantize (the
gguf package's numpy reference), exactly; layouts and errors."""

from __future__ import annotations

import numpy as np
import pytest
import gguf
from gguf import GGMLQuantizationType as T

from aotx.engine.backend import quants
from tests.conftest_quant_helpers import can_quantize, make_raw

TYPES = sorted(quants.SUPPORTED_TYPES, key=lambda t: t.value)


def _reference(raw: np.ndarray, qtype: T, k: int) -> np.ndarray:
    if qtype == T.F32:
        return np.asarray(raw, np.float32)
    return gguf.quants.dequantize(raw, qtype).reshape(-1, k)


def test_supported_types_are_the_documented_set():
    assert {t.name for t in quants.SUPPORTED_TYPES} == {
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
        "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "MXFP4"}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_block_layout_matches_gguf(qtype):
    assert quants.block_layout(qtype) == gguf.GGML_QUANT_SIZES[qtype]


def test_block_layout_refuses_unsupported_types_by_name():
    with pytest.raises(quants.UnsupportedTensorType, match="IQ2_XXS"):
        quants.block_layout(T.IQ2_XXS)


def test_which_types_gguf_can_quantize():
    # documents why the K types are built from random blocks in the helpers
    assert all(can_quantize(t) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.BF16, T.MXFP4))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf_reference(qtype, seed):
    rng = np.random.default_rng(seed)
    k = 512 if seed != 2 else 768
    m = 17
    raw = make_raw(qtype, m, k, rng)
    ref = _reference(raw, qtype, k)
    assert np.isfinite(ref).all()
    ids = rng.integers(0, m, 9)
    got = quants.dequantize_rows(raw, qtype, ids, k)
    assert got.dtype == np.float32 and got.shape == (9, k)
    np.testing.assert_array_equal(got, ref[ids])
    np.testing.assert_array_equal(quants.dequantize_rows(raw, qtype, slice(None), k), ref)
    np.testing.assert_array_equal(quants.dequantize_rows(raw, qtype, slice(3, 16, 4), k), ref[3:16:4])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_rows_accepts_a_readonly_uint8_view(qtype):
    rng = np.random.default_rng(5)
    raw = make_raw(qtype, 4, 256, rng)
    view = np.ascontiguousarray(raw).view(np.uint8).reshape(4, -1)
    view.flags.writeable = False
    np.testing.assert_array_equal(quants.dequantize_rows(view, qtype, [-1, 0], 256),
                                  _reference(raw, qtype, 256)[[-1, 0]])


def test_f16_special_values_survive():
    vals = np.array([[0.0, -0.0, 6e-8, -65504.0, np.inf, 1.0, 0.5, -2.0]], np.float16)
    got = quants.dequantize_rows(vals, T.F16, [0], 8)
    np.testing.assert_array_equal(got, vals.astype(np.float32))


def test_errors_name_the_bad_value():
    raw = np.zeros((4, 20), np.uint8)
    with pytest.raises(ValueError, match="multiple of the Q4_1 block size 32"):
        quants.dequantize_rows(raw, T.Q4_1, [0], 33)
    with pytest.raises(ValueError, match="not a whole number of rows"):
        quants.dequantize_rows(raw[:, :18], T.Q4_1, [0], 64)
    with pytest.raises(IndexError, match="max 4"):
        quants.dequantize_rows(raw, T.Q4_1, [0, 4], 32)
