"""The MMQ (``kernels/mmq.cu``: int8 tensor cores over many batch rows) on a GPU: a row's output
bits are the int8 decode GEMV's, whatever the number of rows, the row's place or the tile.

* every type with an integer form (``mmq.MMQ_TYPES``), rows of 3-13 blocks and of 136 blocks
  (some lanes add two), with and without the RMSNorm scale: a batch row's outputs through the
  MMQ at 1, 2, 16, 64 and 128 rows, first, last or at an odd offset in the batch, and in every
  tile shape (8 or 16 row pairs, 16/32/64 batch rows a block, 1, 2 or 4 warp sets sharing each
  group's leaves), are the bits the int8 GEMV
  (``gemv<..., Q8 1>``, its default variant) gives over all 128 rows; and those outputs match
  float64 numpy from the GGUF bytes: within 1e-5 of the same int8 arithmetic, within 2e-2 of
  the float inputs (the tolerances of tests/test_cuda_gemv_q8.py);
* the epilogues: SwiGLU of two types, the residual add, and the QKV mode (RoPE, float16 K/V
  written at each row's slot and position): the GEMV's bits;
* a whole model (Q4_K with Q6_K V, down and head; int8 activations): a slot's logits are the
  same bits with the MMQ off, with it from 16 rows (the default) and from 1 row, decoded alone
  and in batches of 16 and 64, and as the first row of a verify window.

Skips with the reason where CuPy, a CUDA device or sm_80 is absent (CI).
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
if int(cp.cuda.Device().compute_capability) < 80:
    pytest.skip("the MMQ needs sm_80+ (int8 mma.sync, cp.async)", allow_module_level=True)

import gguf  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from aotx.engine.backend.cuda import choice as CC  # noqa: E402
from aotx.engine.backend.cuda import mmq as MQ  # noqa: E402
from aotx.engine.backend.cuda import source as S  # noqa: E402
from aotx.engine.backend.cuda.backend import CudaBackend, _u64  # noqa: E402
from aotx.engine.model.batch import Segment  # noqa: E402
from tests.conftest_quant_helpers import make_raw  # noqa: E402
from tests.models.cuda_testmodel import write_llama  # noqa: E402
from tests.test_cuda_gemv_q8 import _offsets, _quant_np, quantize  # noqa: E402
from tests.test_cuda_quants import _ref, upload  # noqa: E402

pytestmark = pytest.mark.cuda

TYPES = tuple(T(t) for t in MQ.MMQ_TYPES)
FULL = (T.Q4_K, T.Q6_K)                     # every tile shape; the other types: three
# (WN, WM, S): 8 or 16 row pairs, 16 / 32 / 64 batch rows, 1, 2 or 4 warp sets sharing the leaves
SHAPES_ALL = ((1, 1, 1), (1, 2, 2), (1, 4, 4), (2, 1, 4), (2, 2, 1), (2, 4, 2), (2, 4, 1))
ROWS = (1, 2, 16, 64, 128)
BMAX = 128
EPS = 1e-5
GEMV1 = CC.GemvVariant(1, 4, True)          # the int8 GEMV's default at one row: the reference


def _shapes(t: T) -> tuple:
    return SHAPES_ALL if t in FULL else ((1, 1, 1), (2, 1, 4), (2, 4, 2))


def _k(qtype: T, big: bool) -> int:
    if big:
        return 4352                          # 136 blocks of 32: lanes 0..7 add two
    return 768 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 416


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


_MODULES: dict = {}


def kernels(be, t: T) -> dict:
    """The instances the tests of type ``t`` launch (one module per type: small compiles)."""
    if t not in _MODULES:
        names = {"quant_rows", CC.gemv_instance(int(t), int(t), S.MODE_STORE, GEMV1, True)}
        names.update(f"mmq<{int(t)},{int(t)},{S.MODE_STORE},{wn},{wm},{sp}>" for wn, wm, sp in _shapes(t))
        if t == T.Q4_K:
            for mode in (S.MODE_SWIGLU, S.MODE_QKV16):
                names.add(CC.gemv_instance(int(T.Q4_K), int(T.Q6_K) if mode == S.MODE_SWIGLU else int(T.Q4_K), mode,
                                           GEMV1, True))
            names.add(f"mmq<{int(T.Q4_K)},{int(T.Q6_K)},{S.MODE_SWIGLU},2,4,1>")
            names.add(f"mmq<{int(T.Q4_K)},{int(T.Q4_K)},{S.MODE_QKV16},2,4,2>")
        if t == T.Q6_K:
            names.add(CC.gemv_instance(int(t), int(t), S.MODE_ADD, GEMV1, True))
            names.add(f"mmq<{int(t)},{int(t)},{S.MODE_ADD},1,2,4>")
        ks = be.module(sorted(names))
        for n, kern in ks.items():            # the widest tiles of 136-block rows need more than 48 KiB
            if n.startswith("mmq"):
                kern.max_dynamic_shared_size_bytes = MQ.smem_limit(be)
        _MODULES[t] = ks
    return _MODULES[t]


def _args(wa, wb, mode: int, q, row0: int, rows: int, y, nw=None, bias=None, qkv=None):
    """The GEMV's (and the MMQ's) argument tuple over batch rows row0 .. row0 + rows - 1 of the
    int8 rows ``q`` = (xq, xd, xs); y row 0 is batch row row0."""
    xq, xd, xs = q
    ldq = int(xq.shape[1])
    if mode == S.MODE_SWIGLU:
        n_pairs, a_stride, b_off = wa.m, 1, 0
    else:
        wb, n_pairs, a_stride, b_off = wa, wa.m // 2 if qkv else (wa.m + 1) // 2, 2, 1
    z = np.int32(0)
    if qkv is None:
        extra = (z,) * 8 + (_u64(None),) * 6
    else:
        extra = qkv
    return (n_pairs, (_u64(wa.data), _u64(wb.data), np.int64(wa.row_bytes), np.int64(wb.row_bytes),
                      np.int32(a_stride), np.int32(b_off), np.int32(n_pairs), np.int32(wa.k),
                      np.uint64(xq.data.ptr + row0 * ldq), np.int32(ldq), np.int32(rows), _u64(nw), np.float32(EPS),
                      np.uint64(xs.data.ptr + 4 * row0) if nw is not None else _u64(None), _u64(bias), _u64(bias),
                      _u64(y), np.int32(y.shape[1])) + extra + (np.uint64(xd.data.ptr + xd.strides[0] * row0),
                                                                np.int32(ldq // 32)))


def gemv(kern, ta, tb, mode, n_pairs, args, rows):
    ppb = GEMV1.pairs_per_block
    kern[CC.gemv_instance(ta, tb, mode, GEMV1, True)](((n_pairs + ppb - 1) // ppb, (rows + GEMV1.nb - 1) // GEMV1.nb),
                                                      (128,), args)


def mmq(kern, ta, tb, mode, wn, wm, sp, n_pairs, args, rows, k):
    grid = ((rows + 16 * wm - 1) // (16 * wm), (n_pairs + 8 * wn - 1) // (8 * wn))
    kern[f"mmq<{ta},{tb},{mode},{wn},{wm},{sp}>"](grid, (32 * wn * wm * sp,), args,
                                                   shared_mem=MQ.smem_bytes(ta, tb, k, wn, wm, sp))


def _bits_differ(a: np.ndarray, b: np.ndarray) -> int:
    return int((a.view(np.uint32) != b.view(np.uint32)).sum())


@pytest.mark.parametrize("big", (False, True), ids=("small", "wide"))
@pytest.mark.parametrize("norm", (False, True), ids=("plain", "norm"))
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_rows_mmq_outputs_are_the_int8_gemvs_bits_at_every_row_count_place_and_tile(be, qtype, norm, big):
    kern = kernels(be, qtype)
    t = int(qtype)
    rng = np.random.default_rng([t, norm, big])
    k = _k(qtype, big)
    m = 37                                      # odd: the pad row is written too
    raw = make_raw(qtype, m, k, rng)
    if qtype == T.MXFP4:                        # finite scales (random bytes reach 2^127)
        raw.reshape(m, -1, 17)[:, :, 0] = rng.integers(118, 130, (m, k // 32))
    w = upload(be, qtype, raw, "w")
    x = (rng.standard_normal((BMAX, k)) * rng.uniform(0.1, 10.0, (BMAX, 1))).astype(np.float32)
    x[3, 64:96] = 0.0                           # a block of zeros: scale 0, levels 0
    nwh = rng.uniform(0.5, 1.5, k).astype(np.float32) if norm else None
    nw = cp.asarray(nwh) if norm else None
    q = quantize(kern, cp.asarray(x), nw)

    ref = cp.full((BMAX, m + 1), np.nan, cp.float32)
    n_pairs, args = _args(w, None, S.MODE_STORE, q, 0, BMAX, ref, nw)
    gemv(kern, t, t, S.MODE_STORE, n_pairs, args, BMAX)
    ref = ref.get()
    assert np.isfinite(ref).all()
    for wn, wm, sp in _shapes(qtype):
        for M in ROWS:
            for row0 in sorted({0, BMAX - M, 7 if M + 7 <= BMAX else 0}):
                y = cp.full((M, m + 1), np.nan, cp.float32)          # poisoned: every output must be written
                n_pairs, args = _args(w, None, S.MODE_STORE, q, row0, M, y, nw)
                mmq(kern, t, t, S.MODE_STORE, wn, wm, sp, n_pairs, args, M, k)
                got = y.get()
                bad = _bits_differ(got, ref[row0:row0 + M])
                assert bad == 0, (f"WN {wn} WM {wm} S {sp}, {M} rows from row {row0}: {bad} outputs differ from "
                                  f"the int8 GEMV's")

    # the same int8 arithmetic in float64, and the float inputs (test_cuda_gemv_q8's references)
    lv, dx, sx = _quant_np(x, nwh)
    wd = _ref(raw, qtype, k).astype(np.float64)
    xt = (lv.astype(np.float64).reshape(BMAX, -1, 32) * dx[:, :, None]).reshape(BMAX, k)
    want = xt @ wd.T + (sx - xt.reshape(BMAX, -1, 32).sum(axis=2)) @ _offsets(raw, qtype, m, k).T
    xs = q[2].get().astype(np.float64)
    if norm:
        want = want * xs[:, None]
    got = ref[:, :m].astype(np.float64)
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    assert rel < 1e-5, f"{rel:.3g} from the float64 reference of the same int8 arithmetic"
    xf = x.astype(np.float64) * (nwh.astype(np.float64) if norm else 1.0)
    wantf = xf @ wd.T * (xs[:, None] if norm else 1.0)
    relf = float(np.linalg.norm(got - wantf) / np.linalg.norm(wantf))
    assert 0.0 < relf < 2e-2, relf


def test_mmq_epilogues_swiglu_add_and_qkv_give_the_gemvs_bits(be):
    """SwiGLU of a Q4_K gate and a Q6_K up, the residual add (Q6_K) and the QKV mode (Q4_K:
    RoPE on q and k, float16 K and V written at each row's slot and position)."""
    rng = np.random.default_rng(9)
    k, rows = 4352, 40
    x = cp.asarray(rng.standard_normal((rows, k)).astype(np.float32))
    # SwiGLU
    kern = kernels(be, T.Q4_K)
    kern.update(kernels(be, T.Q6_K))
    g = upload(be, T.Q4_K, make_raw(T.Q4_K, 50, k, rng), "gate")
    u = upload(be, T.Q6_K, make_raw(T.Q6_K, 50, k, rng), "up")
    q = quantize(kern, x, None)
    outs = []
    for use in ("gemv", "mmq"):
        y = cp.full((rows, 50), np.nan, cp.float32)
        n_pairs, args = _args(g, u, S.MODE_SWIGLU, q, 0, rows, y)
        if use == "gemv":
            gemv(kern, int(T.Q4_K), int(T.Q6_K), S.MODE_SWIGLU, n_pairs, args, rows)
        else:
            mmq(kern, int(T.Q4_K), int(T.Q6_K), S.MODE_SWIGLU, 2, 4, 1, n_pairs, args, rows, k)
        outs.append(y.get())
    assert np.isfinite(outs[0]).all() and _bits_differ(*outs) == 0, "SwiGLU"
    # the residual add
    d = upload(be, T.Q6_K, make_raw(T.Q6_K, 64, k, rng), "down")
    resid = rng.standard_normal((rows, 64)).astype(np.float32)
    outs = []
    for use in ("gemv", "mmq"):
        y = cp.asarray(resid)
        n_pairs, args = _args(d, None, S.MODE_ADD, q, 0, rows, y)
        if use == "gemv":
            gemv(kern, int(T.Q6_K), int(T.Q6_K), S.MODE_ADD, n_pairs, args, rows)
        else:
            mmq(kern, int(T.Q6_K), int(T.Q6_K), S.MODE_ADD, 1, 2, 4, n_pairs, args, rows, k)
        outs.append(y.get())
    assert _bits_differ(*outs) == 0 and not np.array_equal(outs[0], resid), "residual add"
    # QKV: 4 q heads and 2 kv heads of 32 dims (neox RoPE on 16 of them), a float16 cache of 3 slots x 64
    hd, H, KV, n_ctx, half = 32, 4, 2, 64, 8
    wqkv = upload(be, T.Q4_K, make_raw(T.Q4_K, (H + 2 * KV) * hd, k, rng), "qkv")
    slot = cp.asarray((np.arange(rows) % 3).astype(np.int32))          # each (slot, position) once: no
    pos = cp.asarray((np.arange(rows) // 3 + 10).astype(np.int32))     # two rows write one cache row
    ang = np.arange(n_ctx)[:, None] * (1e4 ** (-np.arange(half) / half))[None, :]
    rc, rs = cp.asarray(np.cos(ang).astype(np.float32)), cp.asarray(np.sin(ang).astype(np.float32))
    outs = []
    for use in ("gemv", "mmq"):
        y = cp.full((rows, H * hd), np.nan, cp.float32)
        kc = cp.zeros((3, KV, n_ctx, hd), cp.float16)
        vc = cp.zeros((3, KV, n_ctx, hd), cp.float16)
        qkv = (np.int32(0), np.int32(H * hd), np.int32(KV * hd), np.int32(hd), np.int32(half), np.int32(1),
               np.int32(KV), np.int32(n_ctx), _u64(slot), _u64(pos), _u64(rc), _u64(rs), _u64(kc), _u64(vc))
        n_pairs, args = _args(wqkv, None, S.MODE_QKV16, q, 0, rows, y, qkv=qkv)
        if use == "gemv":
            gemv(kern, int(T.Q4_K), int(T.Q4_K), S.MODE_QKV16, n_pairs, args, rows)
        else:
            mmq(kern, int(T.Q4_K), int(T.Q4_K), S.MODE_QKV16, 2, 4, 2, n_pairs, args, rows, k)
        outs.append((y.get(), kc.get(), vc.get()))
    (yg, kg, vg), (ym, km, vm) = outs
    assert np.isfinite(yg).all() and _bits_differ(yg, ym) == 0, "q rows"
    assert np.abs(kg.astype(np.float32)).sum() > 0 and kg.tobytes() == km.tobytes() and vg.tobytes() == vm.tobytes(), "K / V rows"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A Q4_K_M-like mix (Q6_K V and down projections, untied Q6_K output), 2 layers, rows of 256 and 768."""
    return write_llama(tmp_path_factory.mktemp("mmq") / "q4km.gguf", n_layers=2, d_model=256, n_heads=4,
                       n_kv_heads=2, ffn=768, vocab=512, qtype=T.Q4_K, emb_qtype=T.Q4_K, out_qtype=T.Q6_K,
                       layer_types={"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K}, seed=5)


def _build(path, mmq_min_rows):
    from aotx.engine.model.architectures import build
    from aotx.engine.model.config import ModelConfig
    from aotx.engine.model.gguf_file import GGUFFile

    gf = GGUFFile.open(path)
    be = CudaBackend(int8_activations=True, int8_min_bytes=0, mmq_min_rows=mmq_min_rows)
    return build(ModelConfig.from_metadata(gf.metadata, str(path)), gf, be)


def test_a_models_logits_are_the_same_bits_with_and_without_the_mmq_at_1_16_and_64_rows(model_path):
    models = {mr: _build(model_path, mr) for mr in (None, 16, 1)}
    assert all(g.mmq is not None for g in models[1].compiled.gemvs if g.q8)
    assert all(g.mmq is None for g in models[None].compiled.gemvs)
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, 512, (64, 12)).astype(np.int32)
    nxt = rng.integers(0, 512, 64).astype(np.int32)
    out = {}
    for mr, m in models.items():
        kv = m.new_kv_cache(64, 64)
        for s in range(64):
            m.forward(prompts[s], [Segment(s, 0, 12)], kv)
        rows = {}
        for n in (1, 16, 64):                    # slots 0 .. n - 1 decode their next token together
            lg = m.forward(nxt[:n], [Segment(s, 12, 1) for s in range(n)], kv)
            rows[n] = lg
        win = m.forward(np.array([nxt[0], 5, 6, 7], np.int32), [Segment(0, 12, 4, all_logits=True)], kv)
        rows["verify"] = win[:1]
        out[mr] = rows
    ref = out[None][1][0]
    assert np.isfinite(ref).all()
    for mr, rows in out.items():
        for n, lg in rows.items():
            assert lg[0].tobytes() == ref.tobytes(), f"MMQ from {mr} rows, batch {n}: slot 0's logits differ"
            if n in (16, 64):
                assert lg.tobytes() == out[None][n].tobytes(), f"MMQ from {mr} rows, batch {n}: a row differs"
