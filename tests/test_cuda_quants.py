"""The CUDA backend's tensor types on a GPU: the ``dequant<T>``,
``embed<T>`` and ``gemv<TA,TB,...>`` kernels of ``cuda_src`` for Q2_K, Q3_K, IQ4_NL, IQ4_XS
and MXFP4, against gguf.quants.dequantize and float64, and a tiny GGUF of these types
through ``load_model(device="cuda")``.

* dequant and embed: equal to gguf's values bit for bit, for every type in
  ``cuda_src.TYPES`` (each deq8 product is exact in float32: see cuda_src's docstring);
* GEMV (no norm; MODE_STORE for one matrix with an odd row count, the zero pad row
  included; MODE_SWIGLU for two matrices of different types): within 1e-5 relative of
  float64 on gguf's dequantized weights (only the float32 summation order differs);
* the tiny model (tests/test_quants_iq4_mxfp4.py's, plus Q2_K and Q3_K layers): prefill
  (dequantize + cuBLAS) and decode (GEMV, CUDA graph) logits within 1e-3 of the float64
  forward of tests/test_forward.py (max |diff| / max |ref|, as test_cuda_parity's bound).

Row lengths are an odd number of blocks, so rows of 17-, 18- and 110-byte blocks start at
the weakest alignment their type allows. Skips with the reason where CuPy or a CUDA
device is absent.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

try:
    import cupy as cp

    _n_dev = cp.cuda.runtime.getDeviceCount()
except Exception as e:  # noqa: BLE001 - ImportError, or the driver's CUDARuntimeError
    pytest.skip(f"no CUDA device: {type(e).__name__}: {e}", allow_module_level=True)
if _n_dev < 1:
    pytest.skip("no CUDA device: CuPy sees 0 devices", allow_module_level=True)

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from aotx.engine.backend.cuda import source as S  # noqa: E402
from aotx.engine.backend.cuda.backend import CudaBackend, _u64  # noqa: E402
from tests.conftest_quant_helpers import make_raw, random_blocks  # noqa: E402

pytestmark = pytest.mark.cuda

NEW = (T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.MXFP4)
ALL = tuple(T(c) for c in S.TYPES)
SWIGLU_PAIRS = ((T.IQ4_NL, T.MXFP4), (T.MXFP4, T.IQ4_XS), (T.Q2_K, T.Q3_K), (T.Q3_K, T.IQ4_NL))
GEMV_SHAPES = ((1, 1, 4), (3, 4, 4), (5, 4, 1), (17, 16, 1))   # (batch rows, NB, warps per pair)
RTOL = 1e-5


def _k(qtype: T) -> int:
    """An odd number of blocks per row: 3 x 256 or 13 x 32 inputs."""
    return 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 416


def _ref(raw: np.ndarray, qtype: T, k: int) -> np.ndarray:
    if qtype == T.F32:
        return np.asarray(raw, np.float32)
    with np.errstate(over="ignore"):
        return gguf.quants.dequantize(raw, qtype).reshape(-1, k)


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


@pytest.fixture(scope="module")
def kern(be):
    names = [f"dequant<{int(t)}>" for t in ALL] + [f"embed<{int(t)}>" for t in ALL]
    for t in NEW:
        names += [f"gemv<{int(t)},{int(t)},{nb},{S.MODE_STORE},{wpp}>" for _, nb, wpp in GEMV_SHAPES]
    for ta, tb in SWIGLU_PAIRS:
        names += [f"gemv<{int(ta)},{int(tb)},{nb},{S.MODE_SWIGLU},{wpp}>" for _, nb, wpp in GEMV_SHAPES]
    return be.module(names)


def upload(be, qtype: T, raw: np.ndarray, name: str = "w"):
    m = raw.shape[0]
    k = raw.shape[1] if qtype in (T.F32, T.F16) else raw.shape[1] // gguf.GGML_QUANT_SIZES[qtype][1] \
        * gguf.GGML_QUANT_SIZES[qtype][0]
    return be.matrix(SimpleNamespace(name=name, qtype=qtype, shape=(k, m), data=raw))


def dequantize(kern, w) -> cp.ndarray:
    """float32 (m, k) copy of ``w`` made by the ``dequant<T>`` kernel ``kern`` (as cuda_gemm's
    per-tile dequantization launches it, over the whole matrix)."""
    out = cp.empty((w.m, w.k), cp.float32)
    n = w.m * (w.k // 8)
    kern(((n + 255) // 256,), (256,), (_u64(w.data), np.int64(w.row_bytes), np.int32(w.m), np.int32(w.k), _u64(out)))
    return out


def gemv(kern, mode: int, wa, wb, x: cp.ndarray, nb: int, wpp: int, y: cp.ndarray) -> None:
    """One launch of gemv<TA,TB,NB,mode,WPP> without the fused norm, bias or RoPE (the
    argument list of cuda_src.py's gemv: no row scales, no biases, 8 RoPE/KV ints, 6 pointers)."""
    if mode == S.MODE_SWIGLU:
        n_pairs, a_stride, b_off = wa.m, 1, 0
    else:
        wb, n_pairs, a_stride, b_off = wa, (wa.m + 1) // 2, 2, 1
    B, k = x.shape
    ppb = 4 // wpp                                             # GEMV_WARPS // WPP pairs per block
    z = np.int32(0)
    kern[f"gemv<{wa.qtype},{wb.qtype},{nb},{mode},{wpp}>"](
        ((n_pairs + ppb - 1) // ppb, (B + nb - 1) // nb), (128,),
        (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes), np.int32(a_stride),
         np.int32(b_off), np.int32(n_pairs), np.int32(k), _u64(x), np.int32(k), np.int32(B), _u64(None),
         np.float32(1e-5), _u64(None), _u64(None), _u64(None), _u64(y), np.int32(y.shape[1])) + (z,) * 8
        + (_u64(None),) * 6 + (_u64(None), z))


def _rel(out, ref) -> float:
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("qtype", ALL, ids=lambda t: t.name)
def test_dequant_and_embed_equal_gguf(be, kern, qtype):
    rng = np.random.default_rng([qtype.value, 1])
    k, m = _k(qtype), 37
    raw = make_raw(qtype, m, k, rng)
    w = upload(be, qtype, raw)
    ref = _ref(raw, qtype, k)
    np.testing.assert_array_equal(dequantize(kern[f"dequant<{int(qtype)}>"], w).get(), ref)
    tok = rng.integers(0, m, 5).astype(np.int32)
    tok_d = cp.asarray(tok)
    x = cp.full((5, k), cp.nan, cp.float32)
    nu = k // 8
    kern[f"embed<{int(qtype)}>"](((nu + 127) // 128, 5), (128,),
                                 (_u64(w.data), np.int64(w.row_bytes), _u64(tok_d), np.int32(k), _u64(x), np.int32(k),
                                  np.float32(1.0)))                       # scale (gemma's sqrt(d) elsewhere)
    np.testing.assert_array_equal(x.get(), ref[tok])


def test_mxfp4_every_exponent_on_the_device(be, kern):
    seed = np.random.SeedSequence().entropy                  # fresh each run, named on failure
    rng = np.random.default_rng(seed)
    raw = random_blocks(T.MXFP4, 8, 32 * 33, rng)             # every E8M0 byte, subnormal and inf ones
    raw.reshape(8, 33, 17)[0, :4, 0] = [0, 1, 254, 255]
    w = upload(be, T.MXFP4, raw)
    ref = _ref(raw, T.MXFP4, 32 * 33)
    out = dequantize(kern["dequant<39>"], w).get()
    # E8M0 bytes 0 and 1 give subnormal scales (2^-128, 2^-127): the device flushes them (and
    # products with them) to zero, so those blocks are only checked to be within 2^-120 of the
    # reference; every other block (every other exponent, inf and NaN ones) must be exact
    sub = np.repeat(raw.reshape(8, 33, 17)[:, :, 0] < 2, 32, axis=1)
    np.testing.assert_array_equal(np.where(sub, 0, out), np.where(sub, 0, ref), err_msg=f"seed {seed}")
    assert np.all(np.abs(out[sub] - ref[sub]) <= 2.0 ** -120), f"seed {seed}"


@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: f"B{s[0]}-NB{s[1]}-WPP{s[2]}")
@pytest.mark.parametrize("qtype", NEW, ids=lambda t: t.name)
def test_gemv_store_matches_float64(be, kern, qtype, shape):
    B, nb, wpp = shape
    rng = np.random.default_rng([qtype.value, B])
    k, m = _k(qtype), 37                                       # odd m: the pad row is written too
    raw = make_raw(qtype, m, k, rng)
    w = upload(be, qtype, raw)
    x = rng.standard_normal((B, k)).astype(np.float32)
    y = cp.full((B, m + 1), cp.nan, cp.float32)
    x_d = cp.asarray(x)
    gemv(kern, S.MODE_STORE, w, None, x_d, nb, wpp, y)
    out = y.get()
    assert (out[:, m] == 0).all()                              # the zero pad row
    assert _rel(out[:, :m], x.astype(np.float64) @ _ref(raw, qtype, k).astype(np.float64).T) < RTOL


@pytest.mark.parametrize("shape", GEMV_SHAPES, ids=lambda s: f"B{s[0]}-NB{s[1]}-WPP{s[2]}")
@pytest.mark.parametrize("pair", SWIGLU_PAIRS, ids=lambda p: f"{p[0].name}-{p[1].name}")
def test_gemv_swiglu_of_two_types_matches_float64(be, kern, pair, shape):
    B, nb, wpp = shape
    ta, tb = pair
    rng = np.random.default_rng([ta.value, tb.value, B])
    k, m = 768, 40
    ra, rb = make_raw(ta, m, k, rng), make_raw(tb, m, k, rng)
    x = rng.standard_normal((B, k)).astype(np.float32)
    y = cp.full((B, m), cp.nan, cp.float32)
    wa, wb, x_d = upload(be, ta, ra), upload(be, tb, rb), cp.asarray(x)
    gemv(kern, S.MODE_SWIGLU, wa, wb, x_d, nb, wpp, y)
    x64 = x.astype(np.float64)
    a = x64 @ _ref(ra, ta, k).astype(np.float64).T
    c = x64 @ _ref(rb, tb, k).astype(np.float64).T
    assert _rel(y.get(), a / (1.0 + np.exp(-a)) * c) < RTOL


def test_tiny_gguf_of_the_new_types_runs_on_cuda(tiny_gguf, tmp_path):
    from aotx.engine.model.batch import Segment
    from aotx.engine.model.loader import load_model
    from tests.test_forward import TOKENS, reference_logits, rel_err
    from tests.test_quants_iq4_mxfp4 import MIX, new_kv_f32, write_mixed_model

    mix = dict(MIX, **{"blk.0.attn_v.weight": T.Q2_K, "blk.1.ffn_gate.weight": T.Q3_K,
                       "blk.1.attn_output.weight": T.Q2_K, "blk.0.ffn_down.weight": T.Q3_K})
    p = write_mixed_model(tiny_gguf, tmp_path / "new-types.gguf", tensor_types=mix)
    types = {t.tensor_type for t in gguf.GGUFReader(p).tensors}
    assert set(NEW) <= types
    lm = load_model(p, device="cuda")
    ref = reference_logits(tiny_gguf.weights(p), lm.gguf.metadata, TOKENS)
    kv = new_kv_f32(lm.model, 2, 64)
    got = lm.model.forward(np.asarray(TOKENS, np.int32), [Segment(0, 0, len(TOKENS), all_logits=True)], kv)
    assert got.shape == ref.shape and rel_err(got, ref) < 1e-3      # eager: dequant + cuBLAS
    for i, t in enumerate(TOKENS[:3]):                                # graph: GEMV, one row
        row = lm.model.forward(np.array([t], np.int32), [Segment(1, i, 1)], kv)
        assert rel_err(row[0], ref[i]) < 1e-3
