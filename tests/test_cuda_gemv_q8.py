"""The decode GEMV on int8 activations (``quant_rows`` then ``gemv<...,Q8 = 1>``;
the integer-dot-product form of llama.cpp's MMVQ) on a GPU, for every tensor type with an
integer form (``cuda_src.Q8_TYPES``):

* ``quant_rows`` against numpy float32: the int8 levels and block scales bit for bit (the same
  IEEE operations: max |x|, 127 / max, a product, round half to even), the block sums of x
  within float32 rounding, the RMSNorm scale bit for bit with ``row_scale``'s;
* every variant the kernel choice may pick (NB 1 .. 16 rows per block, WPP 1, 2, 4, PPW 1, 2, 4)
  gives every output the same bits as every other (batch invariance: one reduction order);
* the outputs against a float64 reference of the same arithmetic (the weights dequantized by
  gguf, the inputs as their int8 levels times the block scales, plus each block's offset
  times the difference between the float and the int8 block sums for types with an offset):
  within 1e-5 relative; and against float64 on the float inputs within 2e-2.

Skips with the reason where CuPy or a CUDA device is absent (CI).
"""

from __future__ import annotations

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

from aotx.engine.backend.cuda import choice as CC  # noqa: E402
from aotx.engine.backend.cuda import source as S  # noqa: E402
from aotx.engine.backend.cuda.backend import CudaBackend, _u64  # noqa: E402
from aotx.engine.backend.cuda.matrix import q8_buffers  # noqa: E402
from tests.conftest_quant_helpers import make_raw  # noqa: E402
from tests.test_cuda_quants import _ref, upload  # noqa: E402

pytestmark = pytest.mark.cuda

TYPES = tuple(T(t) for t in S.Q8_TYPES)
EPS = 1e-5
B = 17                                         # batch rows: a partial block at every NB
VARIANTS = [(nb, wpp, ppw) for nb, wpps in CC.GEMV_GRID.items() for wpp in wpps for ppw in CC.PPW_GRID[nb]]


def _k(qtype: T, big: bool) -> int:
    if big:
        return 4352                            # 17 x 256: 136 blocks of 32, a partial pass of 128 lanes
    return 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 416


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


_MODULES: dict = {}


def kernels(be, t: T) -> dict:
    """The instances the tests of type ``t`` launch (one module per type: small compiles)."""
    if t not in _MODULES:
        names = {"row_scale", "quant_rows"}
        for nb, wpp, ppw in VARIANTS:
            names.add(CC.gemv_instance(int(t), int(t), S.MODE_STORE, CC.GemvVariant(nb, wpp, True, ppw), True))
        names.add(CC.gemv_instance(int(t), int(t), S.MODE_SWIGLU, CC.GemvVariant(1, 4, True), True))
        _MODULES[t] = be.module(sorted(names))
    return _MODULES[t]


def quantize(kern, x, nw):
    """quant_rows on x (B, k): (xq, xd (B, ldq / 32, 2), xs)."""
    n, k = x.shape
    xq, xd = q8_buffers(n, k)
    xs = cp.zeros(n, cp.float32)
    ldq = xq.shape[1]
    kern["quant_rows"]((n, (k + 127) // 128), (128,),
                       (_u64(x), np.int32(k), np.int32(k), _u64(nw), np.float32(EPS), _u64(xs), _u64(xq), np.int32(ldq),
                        _u64(xd), np.int32(ldq // 32)))
    return xq, xd, xs


def launch(kern, t: int, mode: int, v: CC.GemvVariant, wa, wb, q, y, nw=None):
    xq, xd, xs = q
    if mode == S.MODE_SWIGLU:
        n_pairs, a_stride, b_off = wa.m, 1, 0
    else:
        wb, n_pairs, a_stride, b_off = wa, (wa.m + 1) // 2, 2, 1
    n, ldq = xq.shape
    k = wa.k
    z = np.int32(0)
    ppb = v.pairs_per_block
    kern[CC.gemv_instance(t, t, mode, v, True)](
        ((n_pairs + ppb - 1) // ppb, (n + v.nb - 1) // v.nb), (128,),
        (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes), np.int32(a_stride),
         np.int32(b_off), np.int32(n_pairs), np.int32(k), _u64(xq), np.int32(ldq), np.int32(n), _u64(nw),
         np.float32(EPS), _u64(xs if nw is not None else None), _u64(None), _u64(None), _u64(y),
         np.int32(y.shape[1])) + (z,) * 8 + (_u64(None),) * 6 + (_u64(xd), np.int32(ldq // 32)))


def _offsets(raw: np.ndarray, qtype: T, m: int, k: int) -> np.ndarray:
    """(m, k / 32) float64: each 32-input block's offset mw (the weight is scale * level + mw)
    for the types that have one, else zeros."""
    nb = k // 32
    if qtype in (T.Q4_1, T.Q5_1):
        bs = gguf.GGML_QUANT_SIZES[qtype][1]
        blk = raw.reshape(m, nb, bs)
        return blk[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
    if qtype in (T.Q4_K, T.Q5_K):
        bs = gguf.GGML_QUANT_SIZES[qtype][1]
        blk = raw.reshape(m, k // 256, bs)
        dmin = blk[:, :, 2:4].copy().view(np.float16)[:, :, 0].astype(np.float64)
        q = blk[:, :, 4:16].astype(np.int64)
        mn = np.zeros((m, k // 256, 8))
        for j in range(8):                      # ggml get_scale_min_k4
            mn[:, :, j] = (q[:, :, j + 4] & 63) if j < 4 else ((q[:, :, j + 4] >> 4) | ((q[:, :, j] >> 6) << 4))
        return (-dmin[:, :, None] * mn).reshape(m, nb)
    return np.zeros((m, nb))


def _quant_np(x: np.ndarray, nw):
    """numpy float32 of quant_rows: levels, block scales (B, k / 32)."""
    v = x * nw if nw is not None else x.copy()
    n, k = v.shape
    blk = v.reshape(n, k // 32, 32)
    amax = np.abs(blk).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((blk * inv[:, :, None]).astype(np.float32)).astype(np.int8)
    d = (amax / np.float32(127.0)).astype(np.float32)
    return q.reshape(n, k), d, blk.astype(np.float64).sum(axis=2)


@pytest.mark.parametrize("big", (False, True), ids=("small", "wide"))
@pytest.mark.parametrize("norm", (False, True), ids=("plain", "norm"))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_int8_gemv_variants_agree_bit_for_bit_and_match_float64(be, qtype, norm, big):
    kern = kernels(be, qtype)
    rng = np.random.default_rng([qtype.value, norm, big])
    k = _k(qtype, big)
    m = 37                                      # odd: the pad row is written too
    raw = make_raw(qtype, m, k, rng)
    if qtype == T.MXFP4:                        # finite scales (random bytes reach 2^127)
        raw.reshape(m, -1, 17)[:, :, 0] = rng.integers(118, 130, (m, k // 32))
    w = upload(be, qtype, raw, "w")
    x = rng.standard_normal((B, k)).astype(np.float32)
    x[3, 64:96] = 0.0                           # a block of zeros: scale 0, levels 0
    nwh = rng.uniform(0.5, 1.5, k).astype(np.float32) if norm else None
    nw = cp.asarray(nwh) if norm else None
    q = quantize(kern, cp.asarray(x), nw)
    xq, xd, xs = (a.get() for a in q)

    # quant_rows against numpy
    lv, dx, sx = _quant_np(x, nwh)
    assert np.array_equal(xq[:, :k], lv), "int8 levels differ from numpy's"
    xd = xd.reshape(B, -1, 2)
    assert np.array_equal(xd[:, :k // 32, 0], dx), "block scales differ from numpy's"
    assert np.allclose(xd[:, :k // 32, 1], sx, rtol=1e-5, atol=1e-4)
    if norm:
        ref_s = cp.zeros(B, cp.float32)
        xx = cp.asarray(x)
        kern["row_scale"]((B,), (128,), (_u64(xx), np.int32(k), np.int32(k), np.float32(EPS), _u64(ref_s)))
        assert xs.tobytes() == ref_s.get().tobytes()

    # every variant: the same bits
    outs = {}
    for nb, wpp, ppw in VARIANTS:
        y = cp.zeros((B, m + 1), cp.float32)
        launch(kern, int(qtype), S.MODE_STORE, CC.GemvVariant(nb, wpp, True, ppw), w, None, q, y, nw)
        outs[(nb, wpp, ppw)] = y.get()
    first = outs[VARIANTS[0]]
    for v, o in outs.items():
        bad = int((o.view(np.uint32) != first.view(np.uint32)).sum())
        assert bad == 0, f"NB {v[0]} WPP {v[1]} PPW {v[2]}: {bad} outputs differ from NB 1 WPP 1"

    # the same arithmetic in float64
    wd = _ref(raw, qtype, k).astype(np.float64)
    xt = (lv.astype(np.float64).reshape(B, -1, 32) * dx[:, :, None]).reshape(B, k)
    ref = xt @ wd.T + (sx - xt.reshape(B, -1, 32).sum(axis=2)) @ _offsets(raw, qtype, m, k).T
    if norm:
        ref = ref * xs[:, None].astype(np.float64)
    got = first[:, :m].astype(np.float64)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < 1e-5, f"{rel:.3g} from the float64 reference of the same int8 arithmetic"
    # and against float inputs: what rounding the inputs to int8 costs
    xf = x.astype(np.float64) * (nwh.astype(np.float64) if norm else 1.0)
    reff = xf @ wd.T * (xs[:, None].astype(np.float64) if norm else 1.0)
    relf = float(np.linalg.norm(got - reff) / np.linalg.norm(reff))
    assert 0.0 < relf < 2e-2, relf


def test_int8_swiglu_epilogue_is_silu_of_gate_times_up(be):
    """The fused gate/up GEMV on int8 activations: silu(gate) * up of the two STORE results."""
    rng = np.random.default_rng(5)
    qtype, k, m = T.Q4_K, 768, 40
    kern = kernels(be, qtype)
    wa = upload(be, qtype, make_raw(qtype, m, k, rng), "g")
    wb = upload(be, qtype, make_raw(qtype, m, k, rng), "u")
    x = cp.asarray(rng.standard_normal((3, k)).astype(np.float32))
    q = quantize(kern, x, None)
    y = cp.zeros((3, m), cp.float32)
    launch(kern, int(qtype), S.MODE_SWIGLU, CC.GemvVariant(1, 4, True), wa, wb, q, y)
    ga, gb = cp.zeros((3, m + 1), cp.float32), cp.zeros((3, m + 1), cp.float32)
    launch(kern, int(qtype), S.MODE_STORE, CC.GemvVariant(1, 4, True), wa, None, q, ga)
    launch(kern, int(qtype), S.MODE_STORE, CC.GemvVariant(1, 4, True), wb, None, q, gb)
    a, b = ga.get()[:, :m].astype(np.float64), gb.get()[:, :m].astype(np.float64)
    want = a / (1.0 + np.exp(-a)) * b
    assert np.allclose(y.get(), want, rtol=1e-5, atol=1e-6)
