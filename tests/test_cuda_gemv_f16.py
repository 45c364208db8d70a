"""The fp16 decode GEMV (``quant_rows_h`` then ``gemv_h``; issue 19 item 1, dequantize-in-registers
with half2 math, a measurement candidate the engine does not launch) on a GPU, for every type
with a half2 form (``tests/tools/gemv_h.H_TYPES``: Q4_0, Q4_1, Q8_0, Q4_K, Q6_K), two widths, batch 1 and 17
rows (NB 16 and a partial block), with and without a folded RMSNorm:

* ``quant_rows_h`` against numpy: the float16 values (x * nw * 2^es, in the lane-interleaved
  layout) and the block scales bit for bit, the half-block sums within float32 rounding, the
  norm scale bit for bit with ``row_scale``'s;
* every variant offered (NB 1, 4, 16; WPP 1, 2, 4; PPW 1, 2 at NB <= 4) gives every output the
  same bits (one reduction order), outputs poisoned with NaN before each launch;
* the outputs against a float64 numpy model of the same arithmetic (the in-register levels
  and block constants rebuilt from the raw blocks and checked to give gguf's dequantized
  weights exactly; each HFMA2 step of the two half chains rounded to float16 as
  ``fma.rn.f16x2`` rounds: an exact float64 product-sum rounded once): within 2e-5 relative
  (what is left is the float32 sums across blocks); and against float64 of the exact weights
  and float inputs within 4e-3 relative (float16 inputs and half chains; ~3e-4 to 1e-3 expected).

Skips with the reason where CuPy or a CUDA device is absent (CI). About 10-30 s on an H100/H200
(the instances compile in worker processes, ``cuda_gemv_bench.compile_all``).
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
from tests.conftest_quant_helpers import make_raw  # noqa: E402
from tests.test_cuda_quants import _ref, upload  # noqa: E402
from tests.tools.cuda_gemv_bench import compile_all, h_buffers, h_instance  # noqa: E402
from tests.tools.gemv_h import H_TYPES  # noqa: E402

pytestmark = pytest.mark.cuda

TYPES = tuple(T(t) for t in H_TYPES)
EPS = 1e-5
VARIANTS = [CC.GemvVariant(nb, wpp, True, ppw) for nb in (1, 4, 16) for wpp in (1, 2, 4)
            for ppw in ((1, 2) if nb <= 4 else (1,))]


def _k(qtype: T, big: bool) -> int:
    if big:
        return 4352                            # 136 blocks of 32: a partial second pass of 128 lanes
    return 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 416


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


@pytest.fixture(scope="module")
def kern(be):
    names = {"row_scale", "quant_rows_h"}
    for t in TYPES:
        for v in VARIANTS:
            names.add(h_instance(int(t), int(t), S.MODE_STORE, v))
    names.add(h_instance(int(T.Q4_K), int(T.Q4_K), S.MODE_SWIGLU, VARIANTS[0]))
    return compile_all(be, names)


def quantize(kern, x, nw):
    """quant_rows_h on x (B, k): (xh, xd (B, ldd, 4), xs)."""
    n, k = x.shape
    xh, xd = h_buffers(n, k)
    xs = cp.zeros(n, cp.float32)
    ldh = xh.shape[1]
    kern["quant_rows_h"]((n, (k + 127) // 128), (128,),
                         (_u64(x), np.int32(k), np.int32(k), _u64(nw), np.float32(EPS), _u64(xs), _u64(xh),
                          np.int32(ldh), _u64(xd), np.int32(ldh // 32)))
    return xh, xd, xs


def launch(kern, t: int, mode: int, v: CC.GemvVariant, wa, wb, q, y, nw=None):
    xh, xd, xs = q
    if mode == S.MODE_SWIGLU:
        n_pairs, a_stride, b_off = wa.m, 1, 0
    else:
        wb, n_pairs, a_stride, b_off = wa, (wa.m + 1) // 2, 2, 1
    n, ldh = xh.shape
    z = np.int32(0)
    ppb = v.pairs_per_block
    kern[h_instance(t, t, mode, v)](
        ((n_pairs + ppb - 1) // ppb, (n + v.nb - 1) // v.nb), (128,),
        (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes), np.int32(a_stride),
         np.int32(b_off), np.int32(n_pairs), np.int32(wa.k), _u64(xh), np.int32(ldh), np.int32(n), _u64(nw),
         np.float32(EPS), _u64(xs if nw is not None else None), _u64(None), _u64(None), _u64(y),
         np.int32(y.shape[1])) + (z,) * 8 + (_u64(None),) * 6 + (_u64(xd), np.int32(ldh // 32)))


# ---- numpy models -------------------------------------------------------------------------

def _f16(raw: np.ndarray, off: int) -> np.ndarray:
    return raw[..., off:off + 2].copy().view(np.float16)[..., 0].astype(np.float64)


def levels(raw: np.ndarray, qtype: T, m: int, k: int):
    """The in-register form of hw<T>: levels L (m, k) (the integer a half holds, times 2^-24;
    16 q for the nibbles read in place) and per 32-input block da, db, oa, ob (m, k / 32):
    weight = da L + oa (inputs 0..15 of the block), db L + ob (16..31)."""
    nu = k // 32
    bs = gguf.GGML_QUANT_SIZES[qtype][1]
    L = np.zeros((m, nu, 32))
    if qtype in (T.Q4_0, T.Q4_1, T.Q8_0):
        blk = raw.reshape(m, nu, bs)
        d = _f16(blk, 0)
        if qtype == T.Q8_0:
            L[:] = blk[:, :, 2:34].view(np.int8).astype(np.float64) + 128
            da = db = d
            oa = ob = -128 * d
        else:
            qs = blk[:, :, 2:18] if qtype == T.Q4_0 else blk[:, :, 4:20]
            L[:, :, :16] = qs & 15
            L[:, :, 16:] = qs & 0xF0
            da, db = d, d / 16
            oa = ob = -8 * d if qtype == T.Q4_0 else _f16(blk, 2)
        return L.reshape(m, k), da, db, oa, ob
    nsb = k // 256
    blk = raw.reshape(m, nsb, bs)
    da = np.zeros((m, nsb, 8))
    db = np.zeros((m, nsb, 8))
    oa = np.zeros((m, nsb, 8))
    ob = np.zeros((m, nsb, 8))
    L = L.reshape(m, nsb, 8, 32)
    if qtype == T.Q4_K:
        d, dmin = _f16(blk, 0), _f16(blk, 2)
        q = blk[:, :, 4:16].astype(np.int64)
        for j in range(8):                      # ggml get_scale_min_k4
            if j < 4:
                sc, mn = q[:, :, j] & 63, q[:, :, j + 4] & 63
            else:
                sc = (q[:, :, j + 4] & 15) | ((q[:, :, j - 4] >> 6) << 4)
                mn = (q[:, :, j + 4] >> 4) | ((q[:, :, j] >> 6) << 4)
            qs = blk[:, :, 16 + 32 * (j // 2):48 + 32 * (j // 2)]
            L[:, :, j] = (qs & 0xF0) if j & 1 else (qs & 15)
            da[:, :, j] = db[:, :, j] = d * sc / (16 if j & 1 else 1)
            oa[:, :, j] = ob[:, :, j] = -dmin * mn
    else:                                       # Q6_K
        d = _f16(blk, 208)
        scales = blk[:, :, 192:208].view(np.int8).astype(np.float64)
        for j in range(8):
            g, t = j // 4, j % 4
            ql = blk[:, :, 64 * g + 32 * (t & 1):64 * g + 32 * (t & 1) + 32].astype(np.int64)
            qh = blk[:, :, 128 + 32 * g:160 + 32 * g].astype(np.int64)
            L[:, :, j] = ((ql >> (4 * (t >> 1))) & 15) | (((qh >> (2 * t)) & 3) << 4)
            da[:, :, j] = d * scales[:, :, 8 * g + 2 * t]
            db[:, :, j] = d * scales[:, :, 8 * g + 2 * t + 1]
            oa[:, :, j] = -32 * da[:, :, j]
            ob[:, :, j] = -32 * db[:, :, j]
    return (L.reshape(m, k), da.reshape(m, nu), db.reshape(m, nu), oa.reshape(m, nu), ob.reshape(m, nu))


def quant_np(x: np.ndarray, nw):
    """numpy of quant_rows_h: float16 values (B, k) in input order, sx (B, k / 32), the half sums."""
    v = x * nw if nw is not None else x.copy()
    n, k = v.shape
    blk = v.reshape(n, k // 32, 32)
    amax = np.abs(blk).max(axis=2)
    ex = ((amax.view(np.uint32) >> 23) & 255).astype(np.int64) - 127
    es = np.clip(14 - ex, -103, 127)
    scale = np.ldexp(np.float32(1), es).astype(np.float32)
    h = np.where(amax[:, :, None] > 0, blk * scale[:, :, None], 0).astype(np.float32).astype(np.float16)
    sx = np.where(amax > 0, np.ldexp(np.float32(1), 24 - es), 0).astype(np.float32)
    return h.reshape(n, k), sx, blk[:, :, :16].astype(np.float64).sum(2), blk[:, :, 16:].astype(np.float64).sum(2)


def unpermute(xh: np.ndarray, k: int) -> np.ndarray:
    """xh rows (B, ldh) of quant_rows_h's layout -> (B, k) float16 in input order."""
    n, ldh = xh.shape
    nu = k // 32
    u = np.arange(nu)[:, None]
    i = np.arange(32)[None, :]
    idx = 4 * (i >> 2) + 2 * (i & 1) + ((i & 3) >> 1)
    pos = (((u >> 5) * 4 + (idx >> 3)) * 32 + (u & 31)) * 8 + (idx & 7)
    return xh.view(np.float16)[:, pos.reshape(-1)].reshape(n, k)


def _chains(Lb: np.ndarray, xb: np.ndarray) -> np.ndarray:
    """Half chains of 16 inputs: Lb (m, nu, 16) levels, xb (nu, 16) float16 values as float64 ->
    (m, nu) float64 of float(lo) + float(hi), every HFMA2 step rounded to float16. Lane lo takes
    inputs 0, 1, 4, 5, 8, 9, 12, 13 in that order, lane hi 2, 3, 6, 7, ..."""
    out = 0.0
    for lane in (0, 2):
        acc = np.zeros(Lb.shape[:2])
        for i in range(4):
            for s in (0, 1):
                e = 4 * i + lane + s
                prod = Lb[:, :, e] * 2.0 ** -24 * xb[None, :, e]
                acc = (prod + acc).astype(np.float16).astype(np.float64)
        out = out + acc.astype(np.float32).astype(np.float64)
    return out


def half_model(L, da, db, oa, ob, xh: np.ndarray, sx, s0, s1) -> np.ndarray:
    """(B, m) float64: the unit contributions of the comment in tests/tools/gemv_h.cu summed in float64."""
    m, k = L.shape
    nu = k // 32
    Lr = L.reshape(m, nu, 32)
    out = np.zeros((xh.shape[0], m))
    for b in range(xh.shape[0]):
        xb = xh[b].astype(np.float64).reshape(nu, 32)
        fa = _chains(Lr[:, :, :16], xb[:, :16])
        fb = _chains(Lr[:, :, 16:], xb[:, 16:])
        t = sx[b][None, :] * (da * fa + db * fb) + oa * s0[b][None, :] + ob * s1[b][None, :]
        out[b] = t.sum(axis=1)
    return out


# ---- the tests ----------------------------------------------------------------------------

@pytest.mark.parametrize("rows", (1, 17), ids=("b1", "b17"))
@pytest.mark.parametrize("big", (False, True), ids=("small", "wide"))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_fp16_gemv_variants_agree_bit_for_bit_and_match_the_half_model(be, kern, qtype, big, rows):
    norm = big                                  # the norm folded in on the wide rows only (fewer cases)
    rng = np.random.default_rng([qtype.value, big, rows])
    k = _k(qtype, big)
    m = 37                                      # odd: the pad row is written too
    raw = make_raw(qtype, m, k, rng)
    w = upload(be, qtype, raw, "w")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, 32:64] *= 1e4                          # a block beyond float16's range before its scaling
    x[0, 64:96] = 0.0                           # a block of zeros
    nwh = rng.uniform(0.5, 1.5, k).astype(np.float32) if norm else None
    nw = cp.asarray(nwh) if norm else None
    q = quantize(kern, cp.asarray(x), nw)
    xh, xd, xs = (a.get() for a in q)

    # quant_rows_h against numpy
    hv, sx, s0, s1 = quant_np(x, nwh)
    got_h = unpermute(xh, k)
    assert got_h.view(np.uint16).tobytes() == hv.view(np.uint16).tobytes(), "float16 values or layout differ"
    xd = xd.reshape(rows, -1, 4)[:, :k // 32]
    assert np.array_equal(xd[:, :, 0], sx), "block scales differ from numpy's"
    # the half sums are float32 sums of 16 values: their error scales with the sum of magnitudes, not with
    # the sum (a block of ~1e4 values that cancels; the old rtol on the sum failed Q8_0-wide-b17 on the H100)
    v = x * nwh if norm else x
    blk = np.abs(v.astype(np.float64)).reshape(rows, -1, 32)
    tol0, tol1 = (1e-3 + 16 * 2.0 ** -24 * blk[:, :, h].sum(2) for h in (slice(0, 16), slice(16, 32)))
    assert np.all(np.abs(xd[:, :, 1] - s0) <= tol0) and np.all(np.abs(xd[:, :, 2] - s1) <= tol1), \
        "half sums differ from numpy's by more than float32 summation allows"
    if norm:
        ref_s = cp.zeros(rows, cp.float32)
        kern["row_scale"]((rows,), (128,), (_u64(cp.asarray(x)), np.int32(k), np.int32(k), np.float32(EPS),
                                            _u64(ref_s)))
        assert xs.tobytes() == ref_s.get().tobytes()

    # every variant: the same bits, every output written
    first = None
    for v in VARIANTS:
        y = cp.full((rows, m + 1), np.nan, cp.float32)
        launch(kern, int(qtype), S.MODE_STORE, v, w, None, q, y, nw)
        o = y.get()
        assert np.isfinite(o).all(), f"{v.name}: outputs not written"
        if first is None:
            first = o
        bad = int((o.view(np.uint32) != first.view(np.uint32)).sum())
        assert bad == 0, f"{v.name}: {bad} outputs differ from {VARIANTS[0].name}"

    # the levels rebuild gguf's weights exactly; the half model of the same arithmetic
    L, da, db, oa, ob = levels(raw, qtype, m, k)
    wd = _ref(raw, qtype, k).astype(np.float64)
    nu = k // 32
    wl = np.concatenate([(da[:, :, None] * L.reshape(m, nu, 32)[:, :, :16] + oa[:, :, None]),
                         (db[:, :, None] * L.reshape(m, nu, 32)[:, :, 16:] + ob[:, :, None])], axis=2)
    assert np.array_equal(wl.reshape(m, k), wd), "the level model does not give gguf's weights"
    ref = half_model(L, da, db, oa, ob, hv, sx, xd[:, :, 1], xd[:, :, 2])
    if norm:
        ref = ref * xs[:, None].astype(np.float64)
    got = first[:, :m].astype(np.float64)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    assert rel < 2e-5, f"{rel:.3g} from the float64 model of the same half arithmetic"
    # against float64 of the exact weights and float inputs
    xf = x.astype(np.float64) * (nwh.astype(np.float64) if norm else 1.0)
    reff = xf @ wd.T * (xs[:, None].astype(np.float64) if norm else 1.0)
    relf = float(np.linalg.norm(got - reff) / np.linalg.norm(reff))
    assert 0.0 < relf < 4e-3, relf


def test_fp16_swiglu_epilogue_is_silu_of_gate_times_up(be, kern):
    """The fused gate/up form: silu(gate) * up of the two STORE results."""
    rng = np.random.default_rng(5)
    qtype, k, m = T.Q4_K, 768, 40
    wa = upload(be, qtype, make_raw(qtype, m, k, rng), "g")
    wb = upload(be, qtype, make_raw(qtype, m, k, rng), "u")
    x = cp.asarray(rng.standard_normal((3, k)).astype(np.float32))
    q = quantize(kern, x, None)
    v = VARIANTS[0]
    y = cp.full((3, m), np.nan, cp.float32)
    launch(kern, int(qtype), S.MODE_SWIGLU, v, wa, wb, q, y)
    ga, gb = cp.zeros((3, m + 1), cp.float32), cp.zeros((3, m + 1), cp.float32)
    launch(kern, int(qtype), S.MODE_STORE, v, wa, None, q, ga)
    launch(kern, int(qtype), S.MODE_STORE, v, wb, None, q, gb)
    a, b = ga.get()[:, :m].astype(np.float64), gb.get()[:, :m].astype(np.float64)
    want = a / (1.0 + np.exp(-a)) * b
    assert np.allclose(y.get(), want, rtol=1e-5, atol=1e-6)
