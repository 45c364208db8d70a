"""The decode GEMV's variants with several row pairs per warp (``gemv<...,WPP,PPW>``, PPW 2
or 4: one x and norm-weight load serves PPW pairs) on a GPU: the same bits
as the one-pair kernel for every tensor type, epilogue mode, norm placement and batch
shape, including blocks whose last pairs are past the matrix; and within 1e-5 of float64.

Batch invariance needs every variant the kernel choice may pick to give exactly the bits
of every other (cuda_src.py, "the canonical reduction order"): here each is compared with
``gemv<...,NB,MODE,4>`` (four warps per pair, one pair per warp), itself checked against
float64 by test_cuda_quants.py. Skips with the reason where CuPy or a CUDA device is absent.
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

pytestmark = pytest.mark.cuda

TYPES = (T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_K, T.IQ4_XS, T.F16)
MODES = (S.MODE_STORE, S.MODE_ADD, S.MODE_SWIGLU)
SHAPES = ((1, 1), (2, 2), (3, 4), (5, 4))     # (batch rows, NB)
# (WPP, PPW) compared with (4, 1) at each NB
VARIANTS = {1: ((4, 2), (4, 4), (1, 4), (2, 4)), 2: ((4, 4), (1, 2)), 4: ((4, 2), (1, 2))}
NORMS = ("none", "block", "pre")               # no RMSNorm; its scale per block; from row_scale
EPS = 1e-5


def _k(qtype: T, big: bool) -> int:
    """An odd number of blocks per row (small), or a 7B/8B-like width with a partial pass."""
    if big:
        return 4352                                   # 17 x 256: 4 full passes of 1024 and a part
    return 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 416


def _name(t, nb: int, mode: int, wpp: int, ppw: int) -> str:
    return CC.gemv_instance(int(t), int(t), mode, CC.GemvVariant(nb, wpp, False, ppw))


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


@pytest.fixture(scope="module")
def kern(be):
    names = ["row_scale"]
    for t in TYPES:
        for mode in MODES:
            for _, nb in SHAPES:
                names.append(f"gemv<{int(t)},{int(t)},{nb},{mode},4>")
                names += [_name(t, nb, mode, w, q) for w, q in VARIANTS[nb]]
    return be.module(sorted(set(names)))


def launch(kern, name: str, ppb: int, mode: int, wa, wb, x, nb: int, y, nw=None, xs=None, bias=None):
    if mode == S.MODE_SWIGLU:
        n_pairs, a_stride, b_off = wa.m, 1, 0
    else:
        wb, n_pairs, a_stride, b_off = wa, (wa.m + 1) // 2, 2, 1
    B, k = x.shape
    z = np.int32(0)
    kern[name](((n_pairs + ppb - 1) // ppb, (B + nb - 1) // nb), (128,),
               (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes), np.int32(a_stride),
                np.int32(b_off), np.int32(n_pairs), np.int32(k), _u64(x), np.int32(k), np.int32(B), _u64(nw),
                np.float32(EPS), _u64(xs), _u64(bias), _u64(bias), _u64(y), np.int32(y.shape[1])) + (z,) * 8
               + (_u64(None),) * 6 + (_u64(None), z))


@pytest.mark.parametrize("big", (False, True), ids=("small", "wide"))
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("mode", MODES, ids=("store", "add", "swiglu"))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_pairs_per_warp_give_the_bits_of_one_pair(be, kern, qtype, mode, norm, big):
    rng = np.random.default_rng([qtype.value, mode, NORMS.index(norm), big])
    k = _k(qtype, big)
    m = 37 if mode != S.MODE_SWIGLU else 40        # odd m: the pad row is written too
    ra = make_raw(qtype, m, k, rng)
    rb = make_raw(qtype, m, k, rng)
    wa, wb = upload(be, qtype, ra, "a"), upload(be, qtype, rb, "b")
    nw = cp.asarray(rng.uniform(0.5, 1.5, k).astype(np.float32)) if norm != "none" else None
    width = m if mode == S.MODE_SWIGLU else m + 1
    bias = cp.asarray(rng.standard_normal(width + 1).astype(np.float32)) if mode == S.MODE_STORE else None
    for B, nb in SHAPES:
        x = cp.asarray(rng.standard_normal((B, k)).astype(np.float32))
        xs = None
        if norm == "pre":
            xs = cp.empty(B, cp.float32)
            kern["row_scale"]((B,), (128,), (_u64(x), np.int32(k), np.int32(k), np.float32(EPS), _u64(xs)))
        y0 = cp.asarray(rng.standard_normal((B, width)).astype(np.float32))   # ADD adds into it
        t = int(qtype)
        ref = y0.copy()
        launch(kern, f"gemv<{t},{t},{nb},{mode},4>", 1, mode, wa, wb, x, nb, ref, nw, xs, bias)
        a = ref.get()
        for wpp, ppw in VARIANTS[nb]:
            y1 = y0.copy()
            launch(kern, _name(t, nb, mode, wpp, ppw), 4 // wpp * ppw, mode, wa, wb, x, nb, y1, nw, xs, bias)
            b = y1.get()
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), \
                f"B={B} NB={nb} WPP={wpp} PPW={ppw}: {int((a.view(np.uint32) != b.view(np.uint32)).sum())} " \
                f"outputs differ, max |diff| {float(np.nanmax(np.abs(a - b)))}"
        if mode == S.MODE_STORE and norm == "none":
            ref = x.get().astype(np.float64) @ _ref(ra, qtype, k).astype(np.float64).T
            ref = ref + bias.get()[:m].astype(np.float64)
            got = b[:, :m]
            assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 1e-5
